// recurrence backward, storage type double (kernels: recurrence_backward.cuh).
#include "recurrence_backward.cuh"

RNNKERN_INSTANTIATE_RECURRENCE_BACKWARD(double)
