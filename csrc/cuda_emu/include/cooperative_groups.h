// cooperative_groups for the emulated device: the grid group of a cooperative
// launch, the one part the kernels use.  this_grid().sync() is a barrier of
// every thread of the grid (runtime.cpp runs a cooperative grid's blocks at
// once); outside a cooperative launch it is an error, as on hardware, where it
// needs cudaLaunchCooperativeKernel.
#pragma once

namespace rnnkern::emu {
void grid_sync(const char* file, int line);
bool in_cooperative_launch();
}  // namespace rnnkern::emu

namespace cooperative_groups {

class grid_group {
 public:
  // The call site, for the emulator's divergence and deadlock reports.
  void sync(const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
    ::rnnkern::emu::grid_sync(file, line);
  }
  bool is_valid() const { return ::rnnkern::emu::in_cooperative_launch(); }
};

inline grid_group this_grid() { return grid_group(); }

}  // namespace cooperative_groups
