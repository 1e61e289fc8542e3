// The fused step kernel, storage type __half (kernels: step.cuh).
#include "step.cuh"

RNNKERN_INSTANTIATE_STEP(__half)
