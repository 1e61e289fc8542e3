// The fused step kernel, storage type __nv_bfloat16 (kernels: step.cuh).
#include "step.cuh"

RNNKERN_INSTANTIATE_STEP(__nv_bfloat16)
