// A cooperative kernel that exists to test the emulated device's cooperative
// grids (tests/test_cuda_emulated.py): blocks exchange values through global
// memory at every step and only the grid barrier orders a block's read of
// another block's value after its write.  Written in the sources' CUDA dialect
// (RNNKERN_LAUNCH_COOPERATIVE, RNNKERN_DYNAMIC_SHARED, cooperative_groups), so
// the same text also compiles with nvcc for sm_90 (the resource test does).
// The faults are the mutation checks: each must be caught.
#pragma once

#include <cooperative_groups.h>

#include "../cuda/common.cuh"

namespace rnnkern::cuda_emu {

enum GridExchangeFault : int {
  kNoFault = 0,
  kNoGridBarrier = 1,    // the grid barrier removed: a block reads values not yet written
  kReadOneStepEarly = 2, // a block reads the step being written instead of the last one
  kLastBlockExits = 3,   // the last block skips the final barrier (on hardware: a hang)
};

// x holds N = gridDim.x * per_block values; block b owns [b * per_block, (b + 1) * per_block)
// and keeps its slice of w in dynamic shared memory.  Per step:
//   next[i] = w[i] * cur[(i + shift) % N] + cur[i]
__global__ void grid_exchange_kernel(const float* w, float* x0, float* x1, int per_block, int shift,
                                     int steps, int fault) {
  RNNKERN_DYNAMIC_SHARED(float, w_local);
  const int n = per_block * static_cast<int>(gridDim.x);
  const int base = static_cast<int>(blockIdx.x) * per_block;
  for (int j = threadIdx.x; j < per_block; j += blockDim.x) w_local[j] = w[base + j];
  __syncthreads();
  float* cur = x0;
  float* next = x1;
  for (int s = 0; s < steps; ++s) {
    const float* src = fault == kReadOneStepEarly ? next : cur;
    for (int j = threadIdx.x; j < per_block; j += blockDim.x) {
      const int i = base + j;
      next[i] = w_local[j] * src[(i + shift) % n] + cur[i];
    }
    const bool skip = fault == kNoGridBarrier ||
                      (fault == kLastBlockExits && blockIdx.x == gridDim.x - 1 && s == steps - 1);
    if (!skip) cooperative_groups::this_grid().sync();
    float* t = cur;
    cur = next;
    next = t;
  }
}

inline size_t grid_exchange_smem(int per_block) { return sizeof(float) * size_t(per_block); }

// Launches the kernel (cooperatively unless told not to) and returns the launch's error;
// opt_in: ask for dynamic shared memory beyond 48 KiB first, as a kernel that needs it must.
inline cudaError_t grid_exchange(const float* w, float* x0, float* x1, int blocks, int threads,
                                 int per_block, int shift, int steps, int fault, bool cooperative,
                                 bool opt_in) {
  const size_t smem = grid_exchange_smem(per_block);
  if (opt_in && smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(
        grid_exchange_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return e;
  }
  if (!cooperative) {
    RNNKERN_LAUNCH(dim3(blocks), dim3(threads), smem, nullptr, grid_exchange_kernel)
    (w, x0, x1, per_block, shift, steps, fault);
    return cudaGetLastError();
  }
  return RNNKERN_LAUNCH_COOPERATIVE(dim3(blocks), dim3(threads), smem, nullptr,
                                    grid_exchange_kernel)(w, x0, x1, per_block, shift, steps, fault);
}

// How many blocks of `threads` the device holds at once (the grid a cooperative launch may use),
// after the opt-in a launch beyond 48 KiB makes (the occupancy of a kernel without it is 0
// there, as on hardware; persistent_fits does the same).
inline int grid_exchange_capacity(int threads, int per_block) {
  const size_t smem = grid_exchange_smem(per_block);
  if (smem > 48 * 1024 && cudaFuncSetAttribute(grid_exchange_kernel,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(smem)) != cudaSuccess)
    return 0;
  int per_sm = 0, sms = 0, device = 0;
  RNNKERN_CUDA_CHECK(cudaGetDevice(&device));
  RNNKERN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  RNNKERN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, grid_exchange_kernel, threads, grid_exchange_smem(per_block)));
  return per_sm * sms;
}

}  // namespace rnnkern::cuda_emu
