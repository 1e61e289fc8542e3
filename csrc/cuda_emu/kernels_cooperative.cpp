// The emulated device's cooperative-grid test kernel (grid_exchange.cuh) as a
// translation unit of the emulated build; bindings.cpp exposes it to the tests.
#define RNNKERN_CUDA_EMULATION 1
#define RNNKERN_EMU_ARCH 900
#include "prelude.h"

#include "grid_exchange.cuh"

namespace rnnkern::cuda_emu {

int grid_exchange_run(const float* w, float* x0, float* x1, int blocks, int threads, int per_block,
                      int shift, int steps, int fault, bool cooperative, bool opt_in) {
  return static_cast<int>(grid_exchange(w, x0, x1, blocks, threads, per_block, shift, steps, fault,
                                        cooperative, opt_in));
}

int grid_exchange_blocks(int threads, int per_block) {
  return grid_exchange_capacity(threads, per_block);
}

}  // namespace rnnkern::cuda_emu
