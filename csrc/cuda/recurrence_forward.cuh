// recurrence forward: the time loop of one layer in one direction.
//
// Per step: one cuBLAS GEMM  hproj = h_{t-1} W_hh^T  (fp32 result for half
// inputs), then one fused pointwise kernel (pointwise_forward.cuh) that adds xproj
// and the biases, applies the cell and writes h_t (output and state), c_t and
// the workspace.  The reset-before GRU needs a second GEMM on r * h_{t-1} and
// a second pointwise kernel; the LSTM projection a GEMM  h_t = h_full W_hr^T
// (plus, with lengths, an epilogue for the rows that have finished).
//
// LSTM-LN: the same GEMM (raw, 4H wide), then one row kernel (one block per
// batch row, lstm_ln_forward_kernel) for the layer norms, the gates and the
// state: the layer norms need their whole row's statistics first.
//
// Resets and zoneout are template parameters of the pointwise and row
// kernels (common.cuh's bool_switch); resets keep the state in the ping-pong
// slots (as lengths do), where a step writes h0 / c0 for the next one of a
// row that resets.
//
// Everything runs on the caller's stream; the loop allocates nothing and
// never waits for the device, so it can be captured in a CUDA graph.
// Instantiated per dtype in recurrence_forward_<dtype>.cu.
#pragma once

#include "persistent.cuh"

namespace rnnkern::cuda {

// One grid-stride pass of a phase over (b, j), j < H (the projection: j < P).
// hh comes from the step's GEMM output, a row of G*H (reset-before: 2H) values.
// hproj is not __restrict__: the reset-before gates overwrite it (st.rz).
template <typename S, ForwardPhase kPhase, bool kResets, bool kZoneout>
__global__ void __launch_bounds__(kPointwiseThreads)
    forward_pointwise_kernel(const ForwardStep<S> st, const acc_t<S>* hproj) {
  using A = acc_t<S>;
  const int64_t H = st.H;
  const int64_t width = kPhase == ForwardPhase::Projection ? st.P : H;
  const int64_t n = st.B * width;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / width, j = i - b * width;
    if constexpr (kPhase == ForwardPhase::RnnTanh || kPhase == ForwardPhase::RnnRelu) {
      const A hh[1] = {hproj[b * H + j]};
      rnn_forward_unit<kPhase == ForwardPhase::RnnRelu, kResets, kZoneout>(st, b, j, hh);
    } else if constexpr (kPhase == ForwardPhase::Lstm) {
      const A* row = hproj + b * 4 * H;
      const A hh[4] = {row[j], row[H + j], row[2 * H + j], row[3 * H + j]};
      lstm_forward_unit<kResets, kZoneout>(st, b, j, hh);
    } else if constexpr (kPhase == ForwardPhase::Gru) {
      const A* row = hproj + b * 3 * H;
      const A hh[3] = {row[j], row[H + j], row[2 * H + j]};
      gru_forward_unit<kResets, kZoneout>(st, b, j, hh);
    } else if constexpr (kPhase == ForwardPhase::GruRbGates) {
      const A* row = hproj + b * 2 * H;
      const A hh[2] = {row[j], row[H + j]};
      gru_rb_gates_unit(st, b, j, hh);  // reads the state slot; writes no state
    } else if constexpr (kPhase == ForwardPhase::GruRbCandidate) {
      gru_rb_candidate_unit<kResets, kZoneout>(st, b, j);
    } else {
      projection_epilogue_unit<kResets, kZoneout>(st, b, j);
    }
  }
}

template <typename S, ForwardPhase kPhase, bool kResets, bool kZoneout>
void launch_forward_pointwise(const ForwardStep<S>& st, const acc_t<S>* hproj, int64_t n,
                              cudaStream_t stream) {
  if (n == 0) return;
  RNNKERN_LAUNCH(pointwise_blocks(n), kPointwiseThreads, 0, stream,
                 forward_pointwise_kernel<S, kPhase, kResets, kZoneout>)(st, hproj);
  RNNKERN_LAUNCH_CHECK();
}

// LSTM-LN, one block per batch row; hproj's row b is the step's
// h_prev W_hh^T, and the kernel's scratch afterwards.
template <typename S, bool kResets, bool kZoneout>
__global__ void __launch_bounds__(kRowThreads)
    lstm_ln_forward_kernel(const ForwardStep<S> st, acc_t<S>* hproj) {
  using M = RowMoments<acc_t<S>>;
  __shared__ __align__(16) unsigned char smem[2 * kRowThreads * sizeof(M)];
  const int64_t b = blockIdx.x;
  const int64_t p = st.pos(b);  // the same for the whole block: no divergent barrier
  if (p < 0) {
    lstm_ln_forward_finished(st, b);
  } else {
    lstm_ln_forward_row<kResets, kZoneout>(st, b, p, hproj + b * 4 * st.H,
                                           reinterpret_cast<M*>(smem));
  }
}

template <typename S, bool kResets, bool kZoneout>
void launch_lstm_ln_forward(const ForwardStep<S>& st, acc_t<S>* hproj, int64_t rows,
                            cudaStream_t stream) {
  if (rows == 0) return;
  RNNKERN_LAUNCH(row_blocks(rows), kRowThreads, 0, stream,
                 lstm_ln_forward_kernel<S, kResets, kZoneout>)(st, hproj);
  RNNKERN_LAUNCH_CHECK();
}

template <typename S>
void recurrence_forward(const RecurrenceForwardParams& p, const Context& ctx) {
  clear_earlier_error();
  using A = acc_t<S>;
  const int64_t T = p.T, B = p.B, H = p.H, P = p.P;
  if (T == 0 || B == 0) return;
  const Cell cell = p.cell;
  const int64_t G = gate_count(cell);
  const bool reset_before = cell == Cell::GruResetBefore;
  const bool proj = p.w_hr != nullptr;
  const bool resets = p.resets != nullptr, zoneout = p.zoneout != nullptr;
  // The state in the ping-pong slots (h_state): with lengths, and with resets.
  const bool slots = p.lengths != nullptr || resets;
  const int64_t hproj_width = reset_before ? 2 * H : G * H;  // reset-before: W_hn apart

  const S* h0 = static_cast<const S*>(p.h0);
  const S* w_hh = static_cast<const S*>(p.w_hh);
  const S* w_hr = static_cast<const S*>(p.w_hr);
  S* out = static_cast<S*>(p.output);
  S* h_state = static_cast<S*>(p.h_state);
  A* c_state = static_cast<A*>(p.c_state);
  A* hproj = static_cast<A*>(p.hproj);

  ForwardStep<S> st{};
  st.T = T, st.B = B, st.H = H, st.P = P;
  st.reverse = p.reverse;
  st.lengths = p.lengths;
  st.xproj = static_cast<const S*>(p.xproj);
  st.x_st = p.xproj_stride_t, st.x_sb = p.xproj_stride_b;
  st.b_ih = static_cast<const S*>(p.b_ih);
  st.b_hh = static_cast<const S*>(p.b_hh);
  st.out = out;
  st.ws = static_cast<A*>(p.workspace);
  st.h_full = static_cast<S*>(p.h_full);
  st.rh = static_cast<S*>(p.rh);
  st.hn = static_cast<const A*>(p.hn);
  st.rz = reset_before ? hproj : nullptr;
  st.resets = p.resets;
  st.h0 = h0;
  st.reset_h = static_cast<const S*>(p.reset_h != nullptr ? p.reset_h : p.h0);
  st.reset_c = static_cast<const S*>(p.reset_c != nullptr ? p.reset_c : p.c0);
  st.zo = static_cast<const S*>(p.zoneout);
  st.zo_st = p.zoneout_stride_t, st.zo_sb = p.zoneout_stride_b;
  st.ln = static_cast<const S*>(p.ln);
  st.c_steps = static_cast<S*>(p.c_steps);

  // With lengths step s's products take rows [0, live(s)), its step kernels
  // rows [0, live(s - 1)): a row finishing at s is visited once more, which
  // copies its state into the next slot -- both slots then hold it, whichever
  // T & 1 is read at the end -- and writes its padding at s.  After that no
  // kernel visits it: its later padding is written before the loop.  (The
  // persistent kernel visits the same rows.)
  auto live = [&](int64_t s) { return s < 0 || p.live_rows == nullptr ? B : p.live_rows[s]; };
  if (T > 1 && live(T - 2) < B) {
    zero_padding(out, T, B, P, p.lengths, ctx.stream);
    zero_padding(st.ws, T, B, workspace_size(cell, H, zoneout), p.lengths, ctx.stream);
    zero_padding(st.c_steps, T, B, H, p.lengths, ctx.stream);
  }

  // (every step's c, cell_steps, is the host loop's)
  if (p.c_steps == nullptr && persistent_chosen(ctx, T, B, P, sizeof(S), G) &&
      (p.live_rows == nullptr || p.live_rows_dev != nullptr) &&
      persistent_forward<S>(st, cell, w_hh, slots ? h_state : nullptr, c_state, p.live_rows_dev,
                            resets, zoneout, ctx.stream))
    return;

  // Without lengths and resets every row is at the same position, and the
  // output row of the previous step is the state (no copies); else ping-pong.
  auto row_of_step = [&](int64_t s) { return p.reverse ? T - 1 - s : s; };

  bool_switch(resets, zoneout, [&](auto r, auto z) {
    constexpr bool R = decltype(r)::value, Z = decltype(z)::value;
    for (int64_t s = 0; s < T; ++s) {
      const int64_t rows = live(s), visited = live(s - 1);
      st.s = s;
      st.h_prev = slots ? h_state + (s & 1) * B * P
                        : (s == 0 ? h0 : out + row_of_step(s - 1) * B * P);
      st.h_next = slots ? h_state + ((s + 1) & 1) * B * P : nullptr;
      if (has_cell_state(cell)) {
        st.c_prev = c_state + (s & 1) * B * H;
        st.c_next = c_state + ((s + 1) & 1) * B * H;
      }

      gemm<S, A>(ctx, false, true, rows, hproj_width, P, st.h_prev, P, w_hh, P, 0.f, hproj,
                 hproj_width);
      switch (cell) {
        case Cell::RnnTanh:
          launch_forward_pointwise<S, ForwardPhase::RnnTanh, R, Z>(st, hproj, visited * H,
                                                                   ctx.stream);
          break;
        case Cell::RnnRelu:
          launch_forward_pointwise<S, ForwardPhase::RnnRelu, R, Z>(st, hproj, visited * H,
                                                                   ctx.stream);
          break;
        case Cell::Lstm:
          launch_forward_pointwise<S, ForwardPhase::Lstm, R, Z>(st, hproj, visited * H,
                                                                ctx.stream);
          if (proj) {
            // h_t = (o * tanh c) W_hr^T, straight into the output row (no
            // slots) or into the next state, then the per-row epilogue (the
            // finished rows, zoneout's blend, the reset rows' h0).
            S* dst = slots ? st.h_next : out + row_of_step(s) * B * P;
            gemm<S, S>(ctx, false, true, rows, P, H, st.h_full, H, w_hr, H, 0.f, dst, P);
            if (slots || Z)
              launch_forward_pointwise<S, ForwardPhase::Projection, R, Z>(st, hproj, visited * P,
                                                                          ctx.stream);
          }
          break;
        case Cell::Gru:
          launch_forward_pointwise<S, ForwardPhase::Gru, R, Z>(st, hproj, visited * H,
                                                               ctx.stream);
          break;
        case Cell::GruResetBefore:
          launch_forward_pointwise<S, ForwardPhase::GruRbGates, R, Z>(st, hproj, visited * H,
                                                                      ctx.stream);
          gemm<S, A>(ctx, false, true, rows, H, H, st.rh, H, w_hh + 2 * H * H, H, 0.f,
                     static_cast<A*>(p.hn), H);
          launch_forward_pointwise<S, ForwardPhase::GruRbCandidate, R, Z>(st, hproj, visited * H,
                                                                          ctx.stream);
          break;
        case Cell::LstmLn:
          launch_lstm_ln_forward<S, R, Z>(st, hproj, visited, ctx.stream);
          break;
      }
    }
  });
}

}  // namespace rnnkern::cuda

// Explicit instantiation of the entry point (params.h) for one storage type.
#define RNNKERN_INSTANTIATE_RECURRENCE_FORWARD(S)       \
  template void rnnkern::cuda::recurrence_forward<S>( \
      const rnnkern::cuda::RecurrenceForwardParams&, const rnnkern::cuda::Context&);
