// The step kernel once more, for an architecture below sm_80, so that the
// FMA path of the half types runs too (the only code that depends on
// __CUDA_ARCH__).  Its symbols live in rnnkern::cuda_sm70 (a macro renames
// the namespace for this translation unit), so they cannot merge with the
// sm_90 instantiations; step_forward_sm70 is its entry point.
#define RNNKERN_CUDA_EMULATION 1
#define RNNKERN_EMU_ARCH 700
#include "prelude.h"

#define cuda cuda_sm70
#include "../cuda/step_bf16.cu"
#include "../cuda/step_f16.cu"
#include "../cuda/step_f32.cu"
#include "../cuda/step_f64.cu"
#undef cuda

namespace rnnkern::cuda_emu {

// params.h's structs, compiled under the other namespace name: the same
// definitions, so the bindings' StepParams and Context are passed as they are.
template <typename S>
void step_forward_sm70(const void* params, const void* context) {
  rnnkern::cuda_sm70::step_forward<S>(*static_cast<const rnnkern::cuda_sm70::StepParams*>(params),
                                      *static_cast<const rnnkern::cuda_sm70::Context*>(context));
}

template void step_forward_sm70<double>(const void*, const void*);
template void step_forward_sm70<float>(const void*, const void*);
template void step_forward_sm70<__half>(const void*, const void*);
template void step_forward_sm70<__nv_bfloat16>(const void*, const void*);

}  // namespace rnnkern::cuda_emu
