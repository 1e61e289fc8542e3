// Every CUDA source of csrc/cuda as one C++ translation unit of the emulated
// device, for sm_90 (the tensor-core path of the step kernel).  Nothing here
// is a copy: the sources are included as they are (see prelude.h).
#define RNNKERN_CUDA_EMULATION 1
#define RNNKERN_EMU_ARCH 900
#include "prelude.h"

#include "../cuda/gemm.cpp"
#include "../cuda/lengths.cu"
#include "../cuda/recurrence_backward_bf16.cu"
#include "../cuda/recurrence_backward_f16.cu"
#include "../cuda/recurrence_backward_f32.cu"
#include "../cuda/recurrence_backward_f64.cu"
#include "../cuda/recurrence_forward_bf16.cu"
#include "../cuda/recurrence_forward_f16.cu"
#include "../cuda/recurrence_forward_f32.cu"
#include "../cuda/recurrence_forward_f64.cu"
#include "../cuda/step_bf16.cu"
#include "../cuda/step_f16.cu"
#include "../cuda/step_f32.cu"
#include "../cuda/step_f64.cu"
