// recurrence backward, storage type float (kernels: recurrence_backward.cuh).
#include "recurrence_backward.cuh"

RNNKERN_INSTANTIATE_RECURRENCE_BACKWARD(float)
