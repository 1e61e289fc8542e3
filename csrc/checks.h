// Argument checking shared by every backend of the rnnkern ops.
//
// The schemas live in ops.cpp.  Every backend implementation calls the
// matching check_* function before touching data, so a bad call raises a
// c10::Error that names the argument and never reaches a kernel.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>

#include <vector>

#include "cells.h"

namespace rnnkern {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

Cell parse_cell(c10::string_view name);
const char* cell_name(Cell cell);

// Sizes of one call of the recurrence (one layer, one direction).
struct RecurrenceSizes {
  Cell cell;
  int64_t T;  // time steps
  int64_t B;  // batch
  int64_t H;  // hidden units (cell state size for LSTM)
  int64_t P;  // size of h: H, or proj_size for an LSTM with w_hr
  int64_t G;  // gates per unit
  bool has_proj;
  bool has_resets = false;   // resets [T, B] given
  bool has_zoneout = false;  // zoneout [T, B, Z] given, Z = P + H (LSTM) or H
  bool has_reset_state = false;  // reset_h [B, P] (and reset_c [B, H]) given
  // LSTM only.  Forward: c_n is the cell state after every step, [T, B, H] at
  // the steps' time positions (zeros past a row's length), not only the last.
  // Backward: grad_c_n is that tensor's gradient, [T, B, H], added to the
  // carried dc at each step.
  bool cell_steps = false;
  // xproj (output, the workspace, their gradients) hold the rows of a packed
  // batch, [N, *], time-major, where the others hold the [T, B] grid: the
  // sequences sorted longest first (lengths non-increasing), row b of step t at
  // (rows of the steps before t) + b, as PackedSequence.data.  No padding
  // positions, so a batch of skewed lengths costs its real steps in memory
  // too.  With lengths, on the CPU only.
  bool packed_rows = false;
  int64_t N = 0;  // rows of xproj: T * B, or the real steps with packed_rows
};

// Zoneout mask units per row: h's P then c's H for the cells with a cell
// state, H otherwise.
int64_t zoneout_width(Cell cell, int64_t H, int64_t P);

// The sizes of a tensor with `width` values per row of the call's layout
// (xproj, output, workspace, their gradients): [T, B, width], or [N, width]
// with packed rows.
std::vector<int64_t> layout_sizes(const RecurrenceSizes& s, int64_t width);

// recurrence(cell, xproj[T,B,G*H], h0[B,P], c0[B,H]?, w_hh[G*H,P], b_ih[G*H]?,
//            b_hh[G*H]?, w_hr[P,H]?, lengths[B]?, reverse, train,
//            resets[T,B] bool?, zoneout[T,B,Z]?, ln[10H]? (lstm_ln only),
//            reset_h[B,P]? and reset_c[B,H]? (LSTMs): the state a reset step
//            starts from, when it is not h0 (needs resets)), cell_steps (lstm only).
// allow_packed_rows: the backend takes xproj [N, G*H] (RecurrenceSizes::
// packed_rows); else xproj must be 3-D.
RecurrenceSizes check_recurrence(c10::string_view cell, const Tensor& xproj, const Tensor& h0,
                                 const OptTensor& c0, const Tensor& w_hh, const OptTensor& b_ih,
                                 const OptTensor& b_hh, const OptTensor& w_hr,
                                 const OptTensor& lengths, const OptTensor& resets,
                                 const OptTensor& zoneout, const OptTensor& ln,
                                 const OptTensor& reset_h, const OptTensor& reset_c,
                                 bool cell_steps = false, bool allow_packed_rows = false);

RecurrenceSizes check_recurrence_backward(c10::string_view cell, const Tensor& grad_output,
                                          const Tensor& grad_h_n, const OptTensor& grad_c_n,
                                          const Tensor& h0, const OptTensor& c0, const Tensor& w_hh,
                                          const OptTensor& w_hr, const Tensor& output,
                                          const Tensor& workspace, const OptTensor& lengths,
                                          const OptTensor& resets, const OptTensor& zoneout,
                                          const OptTensor& ln, const OptTensor& reset_h,
                                          const OptTensor& reset_c, bool allow_packed_rows = false);

// Sizes of one call of the single-step op.
struct StepSizes {
  Cell cell;
  int64_t B;  // batch
  int64_t I;  // input features
  int64_t H;  // hidden units
  int64_t G;  // gates per unit
};

// step(cell, x[B,I], h[B,H], c[B,H]?, w_ih[G*H,I], w_hh[G*H,H], b_ih[G*H]?, b_hh[G*H]?,
//      ln[10H]? (lstm_ln only))
StepSizes check_step(c10::string_view cell, const Tensor& x, const Tensor& h, const OptTensor& c,
                     const Tensor& w_ih, const Tensor& w_hh, const OptTensor& b_ih,
                     const OptTensor& b_hh, const OptTensor& ln);

StepSizes check_step_backward(c10::string_view cell, const Tensor& grad_h_new,
                              const OptTensor& grad_c_new, const Tensor& x, const Tensor& h,
                              const OptTensor& c, const Tensor& w_ih, const Tensor& w_hh,
                              const Tensor& h_new, const Tensor& workspace, const OptTensor& ln);

// linear(x[M,K], weight[N,K]) -> x weight^T: the input projection of the CPU backend.
// recurrence_from_input(cell, x[T,B,I], w_ih[G*H,I], h0, c0?, w_hh, b_ih?, b_hh?):
// recurrence's sizes, with x and w_ih where xproj would be.
RecurrenceSizes check_recurrence_from_input(c10::string_view cell, const Tensor& x,
                                            const Tensor& w_ih, const Tensor& h0,
                                            const OptTensor& c0, const Tensor& w_hh,
                                            const OptTensor& b_ih, const OptTensor& b_hh);
void check_linear(const Tensor& x, const Tensor& weight);
void check_linear_backward(const Tensor& grad_y, const Tensor& x, const Tensor& weight);

// The dtype gate math runs in: float for half types, else the input dtype.
at::ScalarType acc_type(at::ScalarType t);

// An empty placeholder returned for outputs a cell does not have (c_n of a
// GRU, the workspace of an inference call, ...).
Tensor empty_like_options(const Tensor& like, at::ScalarType dtype);

}  // namespace rnnkern
