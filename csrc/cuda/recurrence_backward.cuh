// recurrence backward (BPTT): the time loop in reverse.
//
// Per step: one fused pointwise kernel (pointwise.cuh) that adds the step's
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
// Nothing is allocated and nothing waits for the device in the loop.
// Instantiated per dtype in recurrence_backward_<dtype>.cu.
#pragma once

#include "pointwise.cuh"

namespace rnnkern::cuda {

enum class BackwardPhase { RnnTanh, RnnRelu, Lstm, Gru, GruRbCandidate, GruRbReset, Projection };

template <typename S, BackwardPhase kPhase>
__global__ void __launch_bounds__(kPointwiseThreads)
    backward_pointwise_kernel(const BackwardStep<S> st) {
  const int64_t width = kPhase == BackwardPhase::Projection ? st.P : st.H;
  const int64_t n = st.B * width;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t b = i / width, j = i - b * width;
    if constexpr (kPhase == BackwardPhase::RnnTanh) {
      rnn_backward_unit<false>(st, b, j);
    } else if constexpr (kPhase == BackwardPhase::RnnRelu) {
      rnn_backward_unit<true>(st, b, j);
    } else if constexpr (kPhase == BackwardPhase::Lstm) {
      lstm_backward_unit(st, b, j);
    } else if constexpr (kPhase == BackwardPhase::Gru) {
      gru_backward_unit(st, b, j);
    } else if constexpr (kPhase == BackwardPhase::GruRbCandidate) {
      gru_rb_backward_candidate_unit(st, b, j);
    } else if constexpr (kPhase == BackwardPhase::GruRbReset) {
      gru_rb_backward_reset_unit(st, b, j);
    } else {
      projection_backward_unit(st, b, j);
    }
  }
}

template <typename S, BackwardPhase kPhase>
void launch_backward_pointwise(const BackwardStep<S>& st, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  RNNKERN_LAUNCH(pointwise_blocks(n), kPointwiseThreads, 0, stream,
                 backward_pointwise_kernel<S, kPhase>)(st);
  RNNKERN_LAUNCH_CHECK();
}

template <typename S>
void recurrence_backward(const RecurrenceBackwardParams& p, const Context& ctx) {
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
  st.out = static_cast<const S*>(p.output);
  st.ws = static_cast<const A*>(p.workspace);
  st.G = G;
  st.dx = static_cast<S*>(p.d_xproj);
  st.dh = static_cast<A*>(p.dh);
  st.dc = static_cast<A*>(p.dc);
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

  const cudaStream_t stream = ctx.stream;
  for (int64_t s = T - 1; s >= 0; --s) {
    st.s = s;
    if (proj) {
      launch_backward_pointwise<S, BackwardPhase::Projection>(st, B * P, stream);
      gemm<S, A>(ctx, false, false, B, H, P, st.dh_tot, P, w_hr, H, 0.f,
                 static_cast<A*>(p.dh_full), H);
    }
    switch (cell) {
      case Cell::RnnTanh:
        launch_backward_pointwise<S, BackwardPhase::RnnTanh>(st, B * H, stream);
        break;
      case Cell::RnnRelu:
        launch_backward_pointwise<S, BackwardPhase::RnnRelu>(st, B * H, stream);
        break;
      case Cell::Lstm:
        launch_backward_pointwise<S, BackwardPhase::Lstm>(st, B * H, stream);
        break;
      case Cell::Gru:
        launch_backward_pointwise<S, BackwardPhase::Gru>(st, B * H, stream);
        break;
      case Cell::GruResetBefore:
        launch_backward_pointwise<S, BackwardPhase::GruRbCandidate>(st, B * H, stream);
        gemm<S, A>(ctx, false, false, B, H, H, st.dn, H, w_hh + 2 * H * H, H, 0.f,
                   static_cast<A*>(p.drh), H);
        launch_backward_pointwise<S, BackwardPhase::GruRbReset>(st, B * H, stream);
        break;
    }
    // dh_{t-1} += da W_hh[rows]: after step 0 this is the gradient of h0.
    gemm<S, A>(ctx, false, false, B, P, st.da_width, st.da, st.da_width, w_hh, P, 1.f, st.dh, P);
  }
}

}  // namespace rnnkern::cuda

// Explicit instantiation of the entry point (params.h) for one storage type.
#define RNNKERN_INSTANTIATE_RECURRENCE_BACKWARD(S)       \
  template void rnnkern::cuda::recurrence_backward<S>( \
      const rnnkern::cuda::RecurrenceBackwardParams&, const rnnkern::cuda::Context&);
