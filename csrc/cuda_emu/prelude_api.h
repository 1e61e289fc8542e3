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

}  // namespace rnnkern::emu
