// The CUDA backend's ops on the emulated device: torch.ops.rnnkern_cuda_emu.*
// for CPU tensors (the schemas are rnnkern's, defined from Python by
// rnnkern/cuda_emulated.py before this module loads).  The op bodies are the
// real backend's (csrc/cuda/bindings_impl.h); only the device differs:
// "device memory" is CPU memory that starts as 0xFF bytes (NaN), as fresh
// cudaMalloc memory holds garbage, and the kernels run on the emulator.
//
// Built only with RNNKERN_CUDA_EMULATION=1 (tests); never part of an install.
#include <ATen/ops/empty.h>
#include <torch/extension.h>

#include <cstring>

#include "../cuda/bindings_impl.h"
#include "prelude_api.h"

namespace rnnkern::cuda_emu {

template <typename S>
void step_forward_sm70(const void* params, const void* context);  // kernels_sm70.cpp

// kernels_cooperative.cpp: the cooperative-grid test kernel (grid_exchange.cuh).
int grid_exchange_run(const float* w, float* x0, float* x1, int blocks, int threads, int per_block,
                      int shift, int steps, int fault, bool cooperative, bool opt_in);
int grid_exchange_blocks(int threads, int per_block);

namespace {

int g_arch = 900;  // the architecture whose step kernel runs (900 or 700)
// Context::persistent: Never unless a test asks (the emulated suite proves the host loop;
// tests/test_cuda_emulated_persistent.py the persistent kernels and Auto's rule).
cuda::PersistentMode g_persistent = cuda::PersistentMode::Never;

// Any non-null handle: the emulated cuBLAS checks it is set.
struct BlasHandleTag {} g_blas_handle;

struct EmulatedDevice {
  static cuda::Context context() {
    return cuda::Context{nullptr, reinterpret_cast<cublasHandle_t>(&g_blas_handle),
                         at::globalContext().allowTF32CuBLAS(), g_persistent};
  }
  static void check_device(const char* op, const at::Tensor& t) {
    TORCH_CHECK_VALUE(t.device().is_cpu(), op,
                      ": the emulated CUDA backend runs on CPU tensors, got ", t.device());
  }
  struct Guard {
    explicit Guard(c10::Device) {}
  };
  static at::Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    at::Tensor t = at::empty(sizes, options);
    if (t.numel() > 0) std::memset(t.data_ptr(), 0xFF, t.nbytes());
    return t;
  }
  template <typename S>
  static void step_forward(const cuda::StepParams& p, const cuda::Context& ctx) {
    if (g_arch >= 800) {
      cuda::step_forward<S>(p, ctx);
    } else {
      step_forward_sm70<S>(&p, &ctx);
    }
  }
};

void set_schedule(const std::string& order, int64_t seed) {
  TORCH_CHECK_VALUE(order == "forward" || order == "reverse" || order == "shuffle",
                    "set_schedule: order must be 'forward', 'reverse' or 'shuffle', got '", order,
                    "'");
  emu::set_order(order == "forward"   ? emu::Order::Forward
                 : order == "reverse" ? emu::Order::Reverse
                                      : emu::Order::Shuffle,
                 static_cast<unsigned>(seed));
}

void set_arch(int64_t arch) {
  TORCH_CHECK_VALUE(arch == 900 || arch == 700, "set_arch: 900 (sm_90, WMMA) or 700 (FMA), got ",
                    arch);
  g_arch = static_cast<int>(arch);
}

// Runs grid_exchange_kernel on x0 (float32, blocks * per_block values) with weights w
// for `steps` steps; returns the launch's CUDA error code and the final values.
std::tuple<int64_t, at::Tensor> grid_exchange(const at::Tensor& w, const at::Tensor& x0,
                                              int64_t blocks, int64_t threads, int64_t shift,
                                              int64_t steps, int64_t fault, bool cooperative,
                                              bool opt_in) {
  TORCH_CHECK_VALUE(w.dtype() == at::kFloat && x0.dtype() == at::kFloat && w.dim() == 1 &&
                        w.sizes() == x0.sizes() && blocks > 0 && w.numel() % blocks == 0,
                    "grid_exchange: w and x0 float32 vectors of one size, a multiple of blocks");
  TORCH_CHECK_VALUE(fault >= 0 && fault <= 3 && steps >= 0 && shift >= 0, "grid_exchange: bad fault, "
                    "steps or shift");
  at::Tensor a = x0.contiguous().clone(), b = EmulatedDevice::empty(x0.sizes(), x0.options());
  const at::Tensor wc = w.contiguous();
  const int code = grid_exchange_run(wc.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(),
                                     int(blocks), int(threads), int(w.numel() / blocks), int(shift),
                                     int(steps), int(fault), cooperative, opt_in);
  return {code, steps % 2 == 0 ? a : b};
}

}  // namespace
// persistent_plan's choice on the emulated device model, for the tests of its rule:
// None where the kernel does not fit.
pybind11::object persistent_plan(const std::string& dtype, int64_t H, int64_t B, int64_t K,
                                 int outputs_per_unit) {
  static const char* const kDtypes[] = {"float64", "float32", "float16", "bfloat16"};
  int code = 0;
  while (code < 4 && dtype != kDtypes[code]) ++code;
  TORCH_CHECK_VALUE(code < 4, "persistent_plan: dtype must be float64, float32, float16 or "
                    "bfloat16, got ", dtype);
  emu::PersistentPlanView plan;
  if (!emu::persistent_plan(code, H, B, K, outputs_per_unit, plan)) return pybind11::none();
  pybind11::dict d;
  d["grid"] = plan.grid, d["units"] = plan.units, d["outputs"] = plan.outputs, d["K"] = plan.K;
  d["batch_tile"] = plan.batch_tile, d["split"] = plan.split, d["k_piece"] = plan.k_piece;
  d["smem"] = plan.smem;
  return d;
}

}  // namespace rnnkern::cuda_emu

TORCH_LIBRARY_IMPL(rnnkern_cuda_emu, CPU, m) {
  using Dev = rnnkern::cuda_emu::EmulatedDevice;
  m.impl("recurrence", &rnnkern::cuda::bindings::recurrence_op<Dev>);
  m.impl("recurrence_backward", &rnnkern::cuda::bindings::recurrence_backward_op<Dev>);
  m.impl("step", &rnnkern::cuda::bindings::step_op<Dev>);
  m.impl("step_backward", &rnnkern::cuda::bindings::step_backward_op<Dev>);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "rnnkern's CUDA kernels on an emulated device (tests only)";
  module.def("set_schedule", &rnnkern::cuda_emu::set_schedule,
             "Order in which a block's threads resume after a barrier: forward, reverse, shuffle",
             pybind11::arg("order"), pybind11::arg("seed") = 0);
  module.def("set_arch", &rnnkern::cuda_emu::set_arch,
             "Architecture of the step kernel: 900 (WMMA for half types) or 700 (FMA)");
  module.def("arch", [] { return rnnkern::cuda_emu::g_arch; });
  module.def("set_persistent",
             [](int mode) {
               TORCH_CHECK_VALUE(0 <= mode && mode <= 2, "set_persistent: mode must be 0, 1 or 2, got ",
                                 mode);
               rnnkern::cuda_emu::g_persistent = static_cast<rnnkern::cuda::PersistentMode>(mode);
             },
             "When the persistent kernels (csrc/cuda/persistent.cuh) take the layers they fit: "
             "0 never (the default here), 1 auto (the real device's default), 2 always");
  module.def("persistent", [] { return int(rnnkern::cuda_emu::g_persistent); });
  module.def("cooperative_launches", &rnnkern::emu::cooperative_launches,
             "Cooperative launches on the emulator so far");
  module.def("launches", &rnnkern::emu::launches, "Kernels launched on the emulator so far");
  module.def("gemm_multiply_adds", &rnnkern::emu::gemm_multiply_adds,
             "Multiply-adds of the emulated cuBLAS GEMMs so far");
  module.def("staged_rows", &rnnkern::emu::staged_rows,
             "Rows the persistent kernels' CTAs staged so far (each CTA counts its own)");
  module.def("prefetched_bytes", &rnnkern::emu::prefetched_bytes,
             "Bytes the persistent kernels asked to prefetch so far (common.cuh: prefetch_l2)");
  module.def("set_device_model", &rnnkern::emu::set_device_model,
             "Multiprocessors, registers per thread and the dynamic shared memory a block may opt "
             "in to, of the occupancy model (132, 64 and 232448 bytes by default); the kernels' attributes "
             "(dynamic shared memory opted in to) go back to their defaults",
             pybind11::arg("multiprocessors"), pybind11::arg("registers_per_thread") = 64,
             pybind11::arg("shared_per_block") = 227 * 1024);
  module.def("shared_per_block", &rnnkern::emu::shared_per_block_optin);
  module.def("persistent_plan", &rnnkern::cuda_emu::persistent_plan,
             "persistent_plan's choice for H, B, K and outputs per unit on the device model "
             "(a dict), or None where the kernel does not fit",
             pybind11::arg("dtype"), pybind11::arg("H"), pybind11::arg("B"), pybind11::arg("K"),
             pybind11::arg("outputs_per_unit"));
  module.def("multiprocessors", &rnnkern::emu::multiprocessors);
  module.def("grid_exchange", &rnnkern::cuda_emu::grid_exchange,
             "The cooperative-grid test kernel: (CUDA error code, final values)",
             pybind11::arg("w"), pybind11::arg("x0"), pybind11::arg("blocks"),
             pybind11::arg("threads"), pybind11::arg("shift"), pybind11::arg("steps"),
             pybind11::arg("fault") = 0, pybind11::arg("cooperative") = true,
             pybind11::arg("opt_in") = true);
  module.def("grid_exchange_blocks", &rnnkern::cuda_emu::grid_exchange_blocks,
             "Blocks of the test kernel the device model holds at once",
             pybind11::arg("threads"), pybind11::arg("per_block"));
}
