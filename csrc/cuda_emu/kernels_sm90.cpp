// Every CUDA source of csrc/cuda as one C++ translation unit of the emulated
// device, for sm_90 (the tensor-core path of the step kernel).  Nothing here
// is a copy: the sources are included as they are (see prelude.h).
#define RNNKERN_CUDA_EMULATION 1
#define RNNKERN_EMU_ARCH 900
#include "prelude.h"

#include "../cuda/gemm.cpp"
#include "../cuda/lengths.cu"
#include "../cuda/recurrence_backward_bf16.cu"
#include "../cuda/recurrence_backward_f16.cu"
#include "../cuda/recurrence_backward_f32.cu"
#include "../cuda/recurrence_backward_f64.cu"
#include "../cuda/recurrence_forward_bf16.cu"
#include "../cuda/recurrence_forward_f16.cu"
#include "../cuda/recurrence_forward_f32.cu"
#include "../cuda/recurrence_forward_f64.cu"
#include "../cuda/step_bf16.cu"
#include "../cuda/step_f16.cu"
#include "../cuda/step_f32.cu"
#include "../cuda/step_f64.cu"

namespace rnnkern::emu {

bool persistent_plan(int dtype, int64_t H, int64_t B, int64_t K, int outputs_per_unit,
                     PersistentPlanView& view) {
  cuda::PersistentPlan plan;
  bool fits;
  switch (dtype) {
    case 0: fits = cuda::persistent_plan<double>(H, B, K, outputs_per_unit, plan); break;
    case 1: fits = cuda::persistent_plan<float>(H, B, K, outputs_per_unit, plan); break;
    case 2: fits = cuda::persistent_plan<__half>(H, B, K, outputs_per_unit, plan); break;
    default: fits = cuda::persistent_plan<__nv_bfloat16>(H, B, K, outputs_per_unit, plan); break;
  }
  view = PersistentPlanView{plan.grid, plan.units,      plan.outputs, plan.K,
                            plan.batch_tile, plan.split, plan.k_piece, plan.smem};
  return fits;
}

}  // namespace rnnkern::emu
