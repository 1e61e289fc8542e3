// recurrence backward, storage type __half (kernels: recurrence_backward.cuh).
#include "recurrence_backward.cuh"

RNNKERN_INSTANTIATE_RECURRENCE_BACKWARD(__half)
