// recurrence forward, storage type double (kernels: recurrence_forward.cuh).
#include "recurrence_forward.cuh"

RNNKERN_INSTANTIATE_RECURRENCE_FORWARD(double)
