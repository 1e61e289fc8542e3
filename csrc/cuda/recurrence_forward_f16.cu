// recurrence forward, storage type __half (kernels: recurrence_forward.cuh).
#include "recurrence_forward.cuh"

RNNKERN_INSTANTIATE_RECURRENCE_FORWARD(__half)
