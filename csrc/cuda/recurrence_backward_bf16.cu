// recurrence backward, storage type __nv_bfloat16 (kernels: recurrence_backward.cuh).
#include "recurrence_backward.cuh"

RNNKERN_INSTANTIATE_RECURRENCE_BACKWARD(__nv_bfloat16)
