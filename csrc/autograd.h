// Registration of rnnkern's autograd formulas (autograd.cpp) for an op family.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstddef>
#include <string>
#include <vector>

namespace rnnkern {

// Registers the Autograd kernels of `ns`::recurrence and `ns`::step (and, for
// "rnnkern", rnnkern::linear); the family's ops must be defined.  Once per
// namespace; later calls do nothing.
void register_autograd(const std::string& ns);

// A recurrence whose outputs were computed ahead, below autograd (a
// bidirectional layer's two directions at once on two threads, their graph
// recorded afterwards on this one: rnnkern/modules, ops.recorded_ahead): the
// next recording call of the recurrence op on this thread with the same
// xproj and w_hh tensors, direction and cell takes these outputs (out, h_n,
// c_n, ws) instead of running the kernel, and its graph node is made here,
// in the order one direction after the other makes it.  So the graph, and
// every gradient's order of summation, are those of the directions run one
// after the other: a node made on another thread would take its sequence
// number (the backward's order among nodes ready at once) from that thread's
// counter.  clear_recurrences_ahead drops what no call took and counts it.
void recurrence_ahead(const at::Tensor& xproj, const at::Tensor& w_hh, bool reverse,
                      const std::string& cell, const at::Tensor& out, const at::Tensor& h_n,
                      const at::Tensor& c_n, const at::Tensor& ws);
size_t clear_recurrences_ahead();

// A bidirectional layer's two recurrences' backward at once, one on each of
// two threads (rnnkern/modules: the directions ran at once in the forward, and
// the engine would run their nodes one after the other on one thread).
// outputs[i]: an output of direction i's recurrence node, grads[i]: the
// gradients that node is about to receive (out, h_n, c_n, ws; undefined where
// none).  Each node's own backward runs below autograd and its result is kept
// for this thread's next call of that node with the very same gradient
// tensors, which returns it instead of running the kernel: the results, and
// every sum's order, are those of the nodes run one after the other.  A call
// with other gradients (a hook changed them) runs the kernel.  The number of
// backwards kept (0 for outputs of another node; one that failed is left to
// the engine's call, which raises its error).
size_t backward_recurrences_at_once(const std::array<at::Tensor, 2>& outputs,
                                    const std::array<std::vector<at::Tensor>, 2>& grads);
// Drops what no call took; their count, with those a call found computed
// for other gradients since the last clear.
size_t clear_recurrence_backwards_ahead();

}  // namespace rnnkern
