// The fused step kernel, storage type double (kernels: step.cuh).
#include "step.cuh"

RNNKERN_INSTANTIATE_STEP(double)
