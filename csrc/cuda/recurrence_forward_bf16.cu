// recurrence forward, storage type __nv_bfloat16 (kernels: recurrence_forward.cuh).
#include "recurrence_forward.cuh"

RNNKERN_INSTANTIATE_RECURRENCE_FORWARD(__nv_bfloat16)
