// The emulated device's controls, for code that is not itself emulated (the
// bindings): no CUDA built-ins, no macros.
#pragma once

#include <cstdint>

namespace rnnkern::emu {

// Order in which a block's threads resume after each barrier.
enum class Order { Forward, Reverse, Shuffle };
void set_order(Order order, unsigned seed);

// Kernels launched on the emulator so far (tests check that work ran there).
int64_t launches();
// Of them, the cooperative launches that ran.
int64_t cooperative_launches();
// Multiply-adds of the cublasGemmEx calls so far (m * n * k each): the work
// the host loops give the GEMMs, which the tests count against the real steps.
int64_t gemm_multiply_adds();
// Rows the persistent kernels' CTAs staged so far (per CTA: grid x rows per step),
// likewise counted against the real steps.
int64_t staged_rows();
// Bytes the persistent kernels asked to prefetch so far (every thread's spans).
int64_t prefetched_bytes();

// The device model of the occupancy query and the cooperative launch's check:
// multiprocessors (132, an H100's) and the registers each thread of a kernel
// takes (64; the sm_90 build's real figures are in tests/test_cuda_resources.py).
void set_device_model(int multiprocessors, int registers_per_thread);
int multiprocessors();

}  // namespace rnnkern::emu
