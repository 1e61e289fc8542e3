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
// multiprocessors (132, an H100's), the registers each thread of a kernel
// takes (64; the sm_90 build's real figures are in tests/test_cuda_resources.py)
// and the dynamic shared memory a block may opt in to (227 KiB, sm_90's; less
// makes the kernels that plan by it plan as for larger sizes, at small ones).
void set_device_model(int multiprocessors, int registers_per_thread, int shared_per_block);
int multiprocessors();
int shared_per_block_optin();

// persistent_plan's choice (csrc/cuda/persistent.cuh) on the device model, for the
// tests of its rule; false where the kernel does not fit.  dtype: 0 float64,
// 1 float32, 2 float16, 3 bfloat16.
struct PersistentPlanView {
  int grid, units, outputs;
  int64_t K;
  int batch_tile, split;
  int64_t k_piece;
  size_t smem;
};
bool persistent_plan(int dtype, int64_t H, int64_t B, int64_t K, int outputs_per_unit,
                     PersistentPlanView& view);

}  // namespace rnnkern::emu
