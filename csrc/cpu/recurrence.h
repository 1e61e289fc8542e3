// The CPU recurrence's drivers (forward.cpp, backward.cpp): their arguments
// and entry points, called by the op entry points (bindings.cpp).
//
// Gate math runs in float (for float, bfloat16, float16) or double; half
// inputs are converted on entry and outputs converted back (bindings.cpp).
// The row loops (rows.h) are compiled for several x86 ISA levels
// (target_clones) and vectorise.
//
// The options beyond torch.nn (resets, zoneout, the LayerNorm cell lstm_ln;
// formulas in rnnkern/reference.py) run inside the same loops: per-row
// choices of the state a step starts from, template flags of the row
// kernels, and for lstm_ln row kernels of its own (see forward_impl and
// backward_impl).  A call without them runs the code it ran before they
// existed.
#pragma once

#include <ATen/core/Tensor.h>

#include "../checks.h"
#include "rows.h"

namespace rnnkern::cpu {

// ------------------------------------------------------------------------
// Forward driver.  All tensors are contiguous, of dtype A (the zoneout mask:
// unit stride along Z, any strides along T and B; xproj may be bfloat16 where
// A is float).
template <typename A>
struct ForwardArgs {
  const RecurrenceSizes& z;
  Tensor xproj, h0, c0, w_hh, b_x, b_h, w_hr;  // b_x, b_h: b_ih, b_hh or zeros
  Positions pos;
  bool train;
  Tensor resets, zoneout, ln;  // undefined when not given
  // The state a reset step starts from: reset_h, reset_c where given, else
  // h0, c0 themselves (the same tensors).
  Tensor reset_h, reset_c;
  // A bfloat16 call (its values held as float): the per-step products run on
  // bf16 pairs (pairs.h), the states rounded to bf16 as the products read them.
  bool bf16_products = false;
  // Where xproj is left undefined: the input rows x_rows [T*B, I] (the grid's
  // order, contiguous) and w_ih [G*H, I], multiplied in each step: the same
  // bits as xproj from rnnkern::linear (one chain over I, one of linear's K
  // chunks: I <= gemm::kKC, pairs::kChunk), without its trip through memory.
  // A float32 LSTM: inside the step's product, x_t W_ih^T, then h_{t-1}
  // W_hh^T added to it, the gate math adding zeros for xproj (the LSTM gate
  // adds xproj and hproj first; the RNN's and GRU's formulas add them in
  // other orders).  The float32 GRU and RNN, and every cell on bf16 pairs
  // (x_rows and w_ih then bfloat16): x_t W_ih^T is a product of its own,
  // which the gate math reads in place of xproj's row (rounded to bf16 on
  // pairs, as linear's bf16 output is).  Plain cells (not the reset-before
  // GRU or lstm_ln), without lengths, resets or a projection, T > 1.
  Tensor x_rows, w_ih;
};

template <typename A>
Options<A> options_of(const RecurrenceSizes& z, const Tensor& resets, const Tensor& zoneout) {
  Options<A> o;
  o.B = z.B;
  if (resets.defined()) o.resets = resets.template const_data_ptr<bool>();
  if (zoneout.defined()) {
    o.zone = zoneout.template const_data_ptr<A>();
    o.zt = zoneout.stride(0);
    o.zb = zoneout.stride(1);
    o.zc = z.P;
  }
  return o;
}

// Forward of the whole sequence into output [T, B, P], h_n, c_n and the
// workspace ws (forward.cpp; A = float or double); output_bf16: the output
// rounded to bf16 (its bits) where forward_impl rounds it in the steps
// (rounds_rows_in_steps; then defined), else undefined.
template <typename A>
void forward_impl(const ForwardArgs<A>& a, Tensor& output, Tensor& h_n, Tensor& c_n,
                  Tensor& ws, Tensor& output_bf16);

// Inference of one sequence (batch 1) from its input: x [T, I] (rows ldx
// apart, unit stride along I), w_ih [G*H, I], h0 [1, H], c0 [1, H] (LSTM),
// w_hh [G*H, H], b_x, b_h [G*H], float32 and contiguous but x; a plain cell
// (no options).  The input projection goes along with the steps' products
// (gemm::row_with_tiles_wide, 512-bit vectors) instead of before them: the
// same bits as rnnkern::linear followed by forward_impl (forward.cpp).
struct FromInputArgs {
  Cell cell;
  int64_t T, I, H, G;
  const float* x;
  int64_t ldx;
  Tensor w_ih, h0, c0, w_hh, b_x, b_h;
  bool reverse;
};
void forward_from_input(const FromInputArgs& a, Tensor& output, Tensor& h_n, Tensor& c_n);

// Backward (BPTT) of the whole sequence, every gradient (backward.cpp).
template <typename A>
struct BackwardArgs {
  const RecurrenceSizes& z;
  Tensor grad_output, grad_h_n, grad_c_n, h0, c0, w_hh, w_hr, output, ws;
  Positions pos;
  Tensor resets, zoneout, ln;  // undefined when not given
  Tensor reset_h, reset_c;     // as ForwardArgs'
  bool bf16_products = false;  // as ForwardArgs'
  // The caller's bf16 output (contiguous; undefined unless the products run
  // on pairs): output's values, which the weight gradients read as their
  // bits (their pairs), not rounded again from output's float32 copy.
  // output itself is then undefined where no reader needs the whole of it in
  // float32 (widened_output): the row kernels widen the rows they read.
  Tensor output_bf16 = Tensor();
  // A bfloat16 grad_output (contiguous) of a float32-computed call where its
  // rows are read only by the row kernels (widened_grad_output): grad_output
  // is then undefined, and each row widened as it is read, in cache.  The
  // whole widened up front cost a write and a read of twice its bytes (LSTM
  // B=32 T=128 H=256: 0.5 ms a tensor, with the output's, 3-4% of a bf16
  // training call).
  Tensor grad_output_bf16 = Tensor();
};

// Whether the backward reads a bfloat16 grad_output row by row
// (BackwardArgs::grad_output_bf16): a float32-computed call without a
// projection (whose total gradient phase reads it whole) or layer norms.
inline bool widened_grad_output(const RecurrenceSizes& z, bool acc_float, bool grad_output_bf16) {
  return acc_float && grad_output_bf16 && !z.has_proj && z.cell != Cell::LstmLn;
}

// Whether the backward needs no float32 copy of the output besides its bf16
// bits (BackwardArgs::output_bf16): where the only readers are the row
// kernels (the RNN's h_t, the GRU's h_{t-1}) and the weight gradient's product
// on pairs -- not with lengths (gathered rows), resets (the restarts' states),
// a projection, layer norms or the reset-before GRU's phases.
inline bool widened_output(const RecurrenceSizes& z, bool output_bf16, bool lengths, bool resets) {
  return output_bf16 && !lengths && !resets && !z.has_proj && z.cell != Cell::LstmLn &&
         z.cell != Cell::GruResetBefore;
}

// Whether a bfloat16 call on the pair products rounds its results to bf16
// step by step, as each step leaves them: the forward its output
// (forward_impl's output_bf16: where h_t is written into the output, the
// grid without a projection, T > 1), the backward its gate gradients
// d_xproj (backward_impl's d_xproj_bf16).  The cells whose step writes
// those rows whole in its first phase.  The rounded rows are what every
// later reader takes (the next step's product, dW_hh, and the caller), read
// in cache and rounded once, where the float32 rows were rounded again by
// each of them, the whole tensor last (d_xproj: 16 MB at LSTM B=32 T=128
// H=256).
inline bool rounds_rows_in_steps(const RecurrenceSizes& z, bool bf16_products) {
  return bf16_products && (z.cell == Cell::RnnTanh || z.cell == Cell::RnnRelu ||
                           z.cell == Cell::Lstm || z.cell == Cell::Gru);
}

// d_reset_h, d_reset_c: written where a.z.has_reset_state (else the restarts'
// gradient is d_h0's, d_c0's).  d_xproj and d_xproj_bf16 are allocated
// here.  d_xproj_bf16: d_xproj rounded to bf16 (its bits, the layout's
// [T, B, G*H] or [N, G*H]), written where rounds_rows_in_steps (then
// defined, and A float), else undefined.  d_xproj: the gate gradients in
// that layout, but where d_xproj_bf16 carries them and the steps' products
// read its rows (the RNNs and the LSTM without lengths): then one step's
// scratch [B, G*H], to be read by no one.
template <typename A>
void backward_impl(const BackwardArgs<A>& a, Tensor& d_xproj, Tensor& d_h0, Tensor& d_c0,
                   Tensor& d_w_hh, Tensor& d_b_ih, Tensor& d_b_hh, Tensor& d_w_hr,
                   Tensor& d_ln, Tensor& d_reset_h, Tensor& d_reset_c, Tensor& d_xproj_bf16);

}  // namespace rnnkern::cpu
