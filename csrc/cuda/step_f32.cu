// The fused step kernel, storage type float (kernels: step.cuh).
#include "step.cuh"

RNNKERN_INSTANTIATE_STEP(float)
