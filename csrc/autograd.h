// Registration of rnnkern's autograd formulas (autograd.cpp) for an op family.
#pragma once

#include <string>

namespace rnnkern {

// Registers the Autograd kernels of `ns`::recurrence and `ns`::step (and, for
// "rnnkern", rnnkern::linear); the family's ops must be defined.  Once per
// namespace; later calls do nothing.
void register_autograd(const std::string& ns);

}  // namespace rnnkern
