// recurrence backward (BPTT): the time loop in reverse.
//
// Per step: one fused pointwise kernel (pointwise_backward.cuh) that adds the step's
// output gradient to the carried dh, runs the cell's backward and writes the
// gate gradients -- into d_xproj at the row's time position and into `da`,
// the A of the step's GEMM -- then one cuBLAS GEMM  dh += da W_hh  (fp32
// accumulator for half types).  The reset-before GRU has a GEMM
// drh = dn W_hn between two pointwise stages; the LSTM projection a stage
// and a GEMM  dh_full = dh_tot W_hr  before the cell's.
//
// The weight and bias gradients are not formed here: the loop leaves the
// time-ordered inputs of one large GEMM / reduction each (d_xproj, dhn_all,
// rh_all, dh_tot_all, h_full_all, and `da` of step 0), which the caller
// (bindings.cpp) runs once after the loop.
//
// LSTM-LN: one row kernel per step (lstm_ln_backward_kernel: the three
// layer norms' backward need row means), then the same GEMM; it leaves
// dhproj_all for dW_hh and, per row, the sums of the gains' and biases'
// gradients (ln_grads).
//
// Resets and zoneout are template parameters (common.cuh's bool_switch).
// With resets the carried gradient of a reset step's starting state goes to
// dh0_reset / dc0_reset (taken by the next kernel of the loop that reads the
// carry), and the caller pairs those steps' gate gradients with the reset
// state in dW_hh.
//
// Nothing is allocated and nothing waits for the device in the loop.
// Instantiated per dtype in recurrence_backward_<dtype>.cu.
#pragma once

#include "persistent.cuh"

namespace rnnkern::cuda {

template <typename S, BackwardPhase kPhase, bool kResets, bool kZoneout>
__global__ void __launch_bounds__(kPointwiseThreads)
    backward_pointwise_kernel(const BackwardStep<S> st) {
  const int64_t width = kPhase == BackwardPhase::Projection ? st.P : st.H;
  const int64_t n = st.B * width;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / width, j = i - b * width;
    if constexpr (kPhase == BackwardPhase::RnnTanh) {
      rnn_backward_unit<false, kResets, kZoneout>(st, b, j);
    } else if constexpr (kPhase == BackwardPhase::RnnRelu) {
      rnn_backward_unit<true, kResets, kZoneout>(st, b, j);
    } else if constexpr (kPhase == BackwardPhase::Lstm) {
      lstm_backward_unit<kResets, kZoneout>(st, b, j);
    } else if constexpr (kPhase == BackwardPhase::Gru) {
      gru_backward_unit<kResets, kZoneout>(st, b, j);
    } else if constexpr (kPhase == BackwardPhase::GruRbCandidate) {
      gru_rb_backward_candidate_unit<kResets, kZoneout>(st, b, j);
    } else if constexpr (kPhase == BackwardPhase::GruRbReset) {
      gru_rb_backward_reset_unit<kResets>(st, b, j);
    } else {
      projection_backward_unit<kResets, kZoneout>(st, b, j);
    }
  }
}

template <typename S, BackwardPhase kPhase, bool kResets, bool kZoneout>
void launch_backward_pointwise(const BackwardStep<S>& st, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  RNNKERN_LAUNCH(pointwise_blocks(n), kPointwiseThreads, 0, stream,
                 backward_pointwise_kernel<S, kPhase, kResets, kZoneout>)(st);
  RNNKERN_LAUNCH_CHECK();
}

// LSTM-LN, one block per batch row.
template <typename S, bool kResets, bool kZoneout>
__global__ void __launch_bounds__(kRowThreads) lstm_ln_backward_kernel(const BackwardStep<S> st) {
  using A = acc_t<S>;
  __shared__ __align__(16) unsigned char smem[4 * kRowThreads * sizeof(RowSum<A>)];
  const int64_t H = st.H;
  const int64_t b = blockIdx.x;
  const int64_t p = st.pos(b);  // the same for the whole block: no divergent barrier
  if (p < 0) {
    lstm_ln_backward_finished(st, b);
  } else {
    lstm_ln_backward_row<kResets, kZoneout>(st, b, p, st.ln_scratch + b * 4 * H,
                                            st.ln_grads + b * 14 * H,
                                            reinterpret_cast<RowSum<A>*>(smem));
  }
}

template <typename S, bool kResets, bool kZoneout>
void launch_lstm_ln_backward(const BackwardStep<S>& st, int64_t rows, cudaStream_t stream) {
  if (rows == 0) return;
  RNNKERN_LAUNCH(row_blocks(rows), kRowThreads, 0, stream,
                 lstm_ln_backward_kernel<S, kResets, kZoneout>)(st);
  RNNKERN_LAUNCH_CHECK();
}

template <typename S>
void recurrence_backward(const RecurrenceBackwardParams& p, const Context& ctx) {
  clear_earlier_error();
  using A = acc_t<S>;
  const int64_t T = p.T, B = p.B, H = p.H, P = p.P;
  if (T == 0 || B == 0) return;
  const Cell cell = p.cell;
  const int64_t G = gate_count(cell);
  const bool reset_before = cell == Cell::GruResetBefore;
  const bool gru = cell == Cell::Gru;
  const bool proj = p.w_hr != nullptr;
  const S* w_hh = static_cast<const S*>(p.w_hh);
  const S* w_hr = static_cast<const S*>(p.w_hr);

  BackwardStep<S> st{};
  st.T = T, st.B = B, st.H = H, st.P = P;
  st.reverse = p.reverse;
  st.lengths = p.lengths;
  st.gout = static_cast<const S*>(p.grad_output);
  st.g_st = p.grad_output_stride_t, st.g_sb = p.grad_output_stride_b;
  st.h0 = static_cast<const S*>(p.h0);
  st.c0 = static_cast<const S*>(p.c0);
  st.reset_h = static_cast<const S*>(p.reset_h != nullptr ? p.reset_h : p.h0);
  st.reset_c = static_cast<const S*>(p.reset_c != nullptr ? p.reset_c : p.c0);
  st.out = static_cast<const S*>(p.output);
  st.ws = static_cast<const A*>(p.workspace);
  st.G = G;
  st.dx = static_cast<S*>(p.d_xproj);
  st.dh = static_cast<A*>(p.dh);
  st.dc = static_cast<A*>(p.dc);
  st.gc_steps = static_cast<const S*>(p.gc_steps);
  st.da = static_cast<S*>(p.da);
  // Rows of W_hh whose gradient reaches dh_{t-1} through the per-step GEMM:
  // all, or r and z for reset-before (the candidate's part goes through drh).
  st.da_width = reset_before ? 2 * H : G * H;
  st.dhn_all = gru ? static_cast<S*>(p.dhn_all) : nullptr;
  st.dn = reset_before ? static_cast<S*>(p.dn) : nullptr;
  st.drh = reset_before ? static_cast<const A*>(p.drh) : nullptr;
  st.rh_all = reset_before ? static_cast<S*>(p.rh_all) : nullptr;
  st.dh_tot = proj ? static_cast<S*>(p.dh_tot) : nullptr;
  st.dh_tot_all = proj ? static_cast<S*>(p.dh_tot_all) : nullptr;
  st.dh_full = proj ? static_cast<const A*>(p.dh_full) : nullptr;
  st.h_full_all = proj ? static_cast<S*>(p.h_full_all) : nullptr;
  st.resets = p.resets;
  st.dh0_reset = static_cast<A*>(p.dh0_reset);
  st.dc0_reset = static_cast<A*>(p.dc0_reset);
  st.zo = static_cast<const S*>(p.zoneout);
  st.zo_st = p.zoneout_stride_t, st.zo_sb = p.zoneout_stride_b;
  st.ln = static_cast<const S*>(p.ln);
  st.dhproj_all = static_cast<S*>(p.dhproj_all);
  st.ln_scratch = static_cast<A*>(p.ln_scratch);
  st.ln_grads = static_cast<A*>(p.ln_grads);
  st.inv_h = A(1) / A(H);
  st.inv_4h = A(1) / A(4 * H);

  const cudaStream_t stream = ctx.stream;
  // With lengths step s visits rows [0, live(s)) only (params.h): the rows
  // past them have not started (backwards), their carried gradients wait
  // untouched, and their padding at s is written before the loop.  (The
  // persistent kernel visits the same rows.)
  auto live = [&](int64_t s) { return p.live_rows == nullptr ? B : p.live_rows[s]; };
  if (live(T - 1) < B) {
    zero_padding(st.dx, T, B, G * H, p.lengths, stream);
    zero_padding(st.dhn_all, T, B, H, p.lengths, stream);
    zero_padding(st.rh_all, T, B, H, p.lengths, stream);
    zero_padding(st.dh_tot_all, T, B, P, p.lengths, stream);
    zero_padding(st.h_full_all, T, B, H, p.lengths, stream);
    zero_padding(st.dhproj_all, T, B, 4 * H, p.lengths, stream);
  }
  // The caller pairs `da` of step 0 with h0 in dW_hh: rows of zero length
  // (none of step 0's) add nothing.
  auto zero_unvisited_da = [&] {
    if (const int64_t r0 = live(0); r0 < B) {
      const size_t row_bytes = sizeof(S) * st.da_width;
      RNNKERN_CUDA_CHECK(cudaMemset2DAsync(st.da + r0 * st.da_width, row_bytes, 0, row_bytes,
                                           B - r0, stream));
    }
  };
  // da_other is there exactly when the context chose the persistent kernel (bindings_impl.h).
  if (p.da_other != nullptr && (p.live_rows == nullptr || p.live_rows_dev != nullptr) &&
      persistent_backward<S>(st, cell, w_hh, static_cast<S*>(p.da_other), p.live_rows_dev,
                             p.resets != nullptr, p.zoneout != nullptr, stream))
    return zero_unvisited_da();
  bool_switch(p.resets != nullptr, p.zoneout != nullptr, [&](auto r, auto z) {
    constexpr bool R = decltype(r)::value, Z = decltype(z)::value;
    for (int64_t s = T - 1; s >= 0; --s) {
      const int64_t rows = live(s);
      st.start_at(s);
      if (proj) {
        launch_backward_pointwise<S, BackwardPhase::Projection, R, Z>(st, rows * P, stream);
        gemm<S, A>(ctx, false, false, rows, H, P, st.dh_tot, P, w_hr, H, 0.f,
                   static_cast<A*>(p.dh_full), H);
      }
      switch (cell) {
        case Cell::RnnTanh:
          launch_backward_pointwise<S, BackwardPhase::RnnTanh, R, Z>(st, rows * H, stream);
          break;
        case Cell::RnnRelu:
          launch_backward_pointwise<S, BackwardPhase::RnnRelu, R, Z>(st, rows * H, stream);
          break;
        case Cell::Lstm:
          launch_backward_pointwise<S, BackwardPhase::Lstm, R, Z>(st, rows * H, stream);
          break;
        case Cell::Gru:
          launch_backward_pointwise<S, BackwardPhase::Gru, R, Z>(st, rows * H, stream);
          break;
        case Cell::GruResetBefore:
          launch_backward_pointwise<S, BackwardPhase::GruRbCandidate, R, Z>(st, rows * H,
                                                                            stream);
          gemm<S, A>(ctx, false, false, rows, H, H, st.dn, H, w_hh + 2 * H * H, H, 0.f,
                     static_cast<A*>(p.drh), H);
          launch_backward_pointwise<S, BackwardPhase::GruRbReset, R, Z>(st, rows * H, stream);
          break;
        case Cell::LstmLn:
          launch_lstm_ln_backward<S, R, Z>(st, rows, stream);
          break;
      }
      // dh_{t-1} += da W_hh[rows]: after step 0 this is the gradient of h0
      // (each row's step 0 starts from h0, whatever resets says).
      gemm<S, A>(ctx, false, false, rows, P, st.da_width, st.da, st.da_width, w_hh, P, 1.f,
                 st.dh, P);
    }
  });
  zero_unvisited_da();
}

}  // namespace rnnkern::cuda

// Explicit instantiation of the entry point (params.h) for one storage type.
#define RNNKERN_INSTANTIATE_RECURRENCE_BACKWARD(S)       \
  template void rnnkern::cuda::recurrence_backward<S>( \
      const rnnkern::cuda::RecurrenceBackwardParams&, const rnnkern::cuda::Context&);
