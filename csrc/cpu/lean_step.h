// The CPU backend's lean single step: step and step_backward of a small
// call without the recurrence drivers' machinery.
//
// The single step of a small call (one token, one observation of an RL
// policy, one streaming frame), for the torch.nn cells without options:
// the recurrence driver's machinery (work split, weight slices, state
// buffers, a dozen ATen calls converting and allocating) costs several
// times the arithmetic there (44k instructions for an RNNCell step at H = 8,
// which torch.nn runs in 4 us).  Single-threaded, scratch per thread, the
// same row kernels and cells.h formulas as the driver; the outputs and
// workspace in the driver's layouts, so each path's backward serves the
// other's forward.
#pragma once

#include <ATen/core/Tensor.h>

#include <initializer_list>
#include <tuple>

#include "../checks.h"

namespace rnnkern::cpu {

// Whether step(cell ...) with these sizes and tensors takes the lean path
// (lean_step.cpp says when).
bool lean_step(const StepSizes& s, std::initializer_list<const Tensor*> ts,
               std::initializer_list<const OptTensor*> opts);

// step's outputs (h_new, c_new, workspace) from checked arguments, the
// driver's layouts.
std::tuple<Tensor, Tensor, Tensor> step_lean(const StepSizes& s, const Tensor& x, const Tensor& h,
                                             const OptTensor& c, const Tensor& w_ih,
                                             const Tensor& w_hh, const OptTensor& b_ih,
                                             const OptTensor& b_hh);

// step_backward's outputs; gh, gc: the incoming gradients made dense.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> step_backward_lean(
    const StepSizes& s, const Tensor& gh, const OptTensor& gc, const Tensor& x, const Tensor& h,
    const OptTensor& c, const Tensor& w_ih, const Tensor& w_hh, const Tensor& h_new,
    const Tensor& workspace, int64_t needs);

}  // namespace rnnkern::cpu
