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
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../module.h"
#include "bindings_impl.h"

namespace rnnkern::cuda {
namespace {

// Whether the persistent kernels may run (Context::persistent), process-wide.
bool g_persistent = false;

PyObject* set_cuda_persistent(PyObject*, PyObject* enabled) {
  const int v = PyObject_IsTrue(enabled);
  if (v < 0) return nullptr;
  g_persistent = v != 0;
  Py_RETURN_NONE;
}

PyObject* cuda_persistent(PyObject*, PyObject*) { return PyBool_FromLong(g_persistent); }

const ModuleFunctions functions({
    {"set_cuda_persistent", set_cuda_persistent, METH_O,
     "Whether the CUDA backend's persistent kernels take the layers they fit (off by default)."},
    {"cuda_persistent", cuda_persistent, METH_NOARGS,
     "Whether the CUDA backend's persistent kernels are enabled."},
});

struct CudaDevice {
  static Context context() {
    return Context{at::cuda::getCurrentCUDAStream().stream(), at::cuda::getCurrentCUDABlasHandle(),
                   at::globalContext().allowTF32CuBLAS(), g_persistent};
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
