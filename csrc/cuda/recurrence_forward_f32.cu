// recurrence forward, storage type float (kernels: recurrence_forward.cuh).
#include "recurrence_forward.cuh"

RNNKERN_INSTANTIATE_RECURRENCE_FORWARD(float)
