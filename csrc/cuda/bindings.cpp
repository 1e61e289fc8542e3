// CUDA implementations of rnnkern::recurrence, recurrence_backward, step and
// step_backward (schemas and conventions in ops.cpp).  The op bodies are in
// bindings_impl.h (shared with the emulated device of the tests); this file
// gives them the real device:
//
// every op works on the input's device (device guard) and the current stream,
// with ATen's cuBLAS handle.  All memory is allocated before the kernels' time
// loops, from torch's caching allocator; nothing waits for the device, so the
// ops can be captured in a CUDA graph.  The lengths (int64 on the CPU, checked
// on the host) reach the device as kernel parameters (upload_lengths), which a
// graph captures by value.
// ATen's per-operator headers rather than ATen/ATen.h: a third of the compile time.
#include <ATen/cuda/CUDAContextLight.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../module.h"
#include "bindings_impl.h"

namespace rnnkern::cuda {
namespace {

// When the persistent kernels run (Context::persistent), process-wide.
PersistentMode g_persistent = PersistentMode::Auto;

// mode: 0 never, 1 auto, 2 always (rnnkern.ops.set_cuda_persistent names them).
PyObject* set_cuda_persistent(PyObject*, PyObject* mode) {
  const long v = PyLong_AsLong(mode);
  if (v == -1 && PyErr_Occurred()) return nullptr;
  if (v < 0 || v > 2) {
    PyErr_Format(PyExc_ValueError, "set_cuda_persistent: mode must be 0, 1 or 2, got %ld", v);
    return nullptr;
  }
  g_persistent = static_cast<PersistentMode>(v);
  Py_RETURN_NONE;
}

PyObject* cuda_persistent(PyObject*, PyObject*) { return PyLong_FromLong(long(g_persistent)); }

const ModuleFunctions functions({
    {"set_cuda_persistent", set_cuda_persistent, METH_O,
     "When the CUDA backend's persistent kernels take the layers they fit: 0 never, 1 auto "
     "(the default), 2 always."},
    {"cuda_persistent", cuda_persistent, METH_NOARGS,
     "The persistent kernels' mode: 0 never, 1 auto, 2 always."},
});

// Whether `stream` is capturing a CUDA graph.
bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

struct CudaDevice {
  static Context context() {
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
    return Context{stream, at::cuda::getCurrentCUDABlasHandle(), at::globalContext().allowTF32CuBLAS(),
                   g_persistent, g_persistent == PersistentMode::Auto && capturing(stream)};
  }
  static void check_device(const char* op, const Tensor& t) {
    TORCH_CHECK_VALUE(t.is_cuda(), op, ": expected CUDA tensors, got ", t.device());
  }
  using Guard = c10::cuda::CUDAGuard;
  static Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    return at::empty(sizes, options);
  }
  template <typename S>
  static void step_forward(const StepParams& p, const Context& ctx) {
    cuda::step_forward<S>(p, ctx);
  }
};

}  // namespace
}  // namespace rnnkern::cuda

TORCH_LIBRARY_IMPL(rnnkern, CUDA, m) {
  m.impl("recurrence", &rnnkern::cuda::bindings::recurrence_op<rnnkern::cuda::CudaDevice>);
  m.impl("recurrence_backward", &rnnkern::cuda::bindings::recurrence_backward_op<rnnkern::cuda::CudaDevice>);
  m.impl("step", &rnnkern::cuda::bindings::step_op<rnnkern::cuda::CudaDevice>);
  m.impl("step_backward", &rnnkern::cuda::bindings::step_backward_op<rnnkern::cuda::CudaDevice>);
}
