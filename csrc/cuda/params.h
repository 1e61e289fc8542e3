// Plain parameter structs of the CUDA kernels, and their entry points.
//
// Shared by the kernels (*.cu, which include no torch headers: they cost
// about a minute of compile time per file) and by bindings.cpp, which unpacks
// torch tensors into these structs.  Every pointer is a dense row-major array
// of the documented shape (the binding makes tensors contiguous), except the
// per-step rows of xproj and grad_output, whose time and batch strides are
// given in elements so that batch-first views need no copy.
//
// Types: S is the storage dtype of the op (double, float, __half,
// __nv_bfloat16); A the accumulate dtype of the gate math (double for double,
// float otherwise).  The workspace and the carried gradients are A.
//
// The step options and the LayerNorm cell's gains (rnnkern/reference.py):
// `resets` [T, B] bool (the step at position t of row b starts from the
// reset state: reset_h / reset_c, h0 / c0 where those are null; a row's
// first step starts from h0 / c0 whatever resets says), `zoneout` [T, B, Z]
// S (Z = P + H for the cells with a cell state: h's units, then c's; H
// otherwise), read through its time and batch strides (an
// evaluation mask is a [Z] vector expanded with strides (0, 0, 1)), and `ln`
// [10H] S, the layer norms' gains and shift of lstm_ln.  Each is null when
// not given.
#pragma once

#include <cstdint>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include "../cells.h"

namespace rnnkern::cuda {

// When the persistent kernels (persistent.cuh) take the layers they fit.
//   Never:  the host loop always.
//   Auto:   (the default) within the sizes where they were timed at least level
//           with the host loop: see persistent_chosen.
//   Always: every layer they fit (for timing them: RNNKERN_CUDA_PERSISTENT=always).
enum class PersistentMode : int { Never = 0, Auto = 1, Always = 2 };

// Where and how to launch: the current stream, ATen's cuBLAS handle (bound to
// that stream, with its graph-safe workspace), and whether float GEMMs may
// use TF32 (torch.backends.cuda.matmul.allow_tf32); when the persistent kernels
// run (rnnkern.ops.set_cuda_persistent), and whether the stream is capturing a
// CUDA graph (no GPU has replayed a captured cooperative launch yet: Auto keeps
// the host loop there).
struct Context {
  cudaStream_t stream;
  cublasHandle_t blas;
  bool allow_tf32;
  PersistentMode persistent = PersistentMode::Auto;
  bool capturing = false;
};

// Auto's bounds.  Per step: the values of h_{t-1} (forward: B x P) or da_{t+1}
// (backward: B x da_width) that the persistent kernel stages, by element size:
// the largest staged count at which it was at least level with the host loop
// (auto.py's 0.97) in every cell timed, each direction apart (the backward as
// forward + backward less forward), on the H200 of 2026-12-04 (T=1024 and 4096 at B=1 H=256
// and B=16 H=768, T=1024 at B=64 H=1024, T=256 at B=256 H=1024;
// bench/results/gpu-h200-2026-12-04, staging in 16-byte chunks, 8 in flight).
// A step there cost about 3.5 us + 0.045 us per half-type value a thread of the
// CTA's 256 staged (the fifth H100 session, one element at a time: 0.26 us).
//   half types: 65536 values x gates (B=64 H=1024 forward: LSTM 0.99-1.04x the host loop,
//               GRU 1.35x, RNN 1.37-1.82x; backward, the tanh RNN: 2.0x).  Past it
//               the GRU's backward at 196608 was 0.87-1.03x, the B=256 forward
//               0.32-0.62x.  The forward counts each staged value once per gate:
//               each feeds G dot products per unit, the backward's one (its K,
//               G x H, counts the gates already).  On the H100 of 2026-12-06, both
//               modes in one call (bench/results/gpu-h100-2026-12-06), the gated
//               cells' forward at B=64 H=1024 (196608 and 262144) was 0.65-0.94x
//               the host loop (LSTM bf16 0.81x, fp16 0.65x; GRU 0.94x, 0.77x),
//               the RNN's (65536) 1.39x bf16, 0.86x fp16; at B=16 H=768 (LSTM
//               49152) every cell 1.8-2.4x.
//   float32:    12288 values, gates not counted (B=16 H=768 forward 1.55-2.46x, the
//               LSTM's at 49152 values x gates among them; the RNN's backward ~1.9x);
//               its register-tile products fall behind from there: the LSTM's
//               backward at 49152 ~0.7x, every B=64 forward 0.14-0.27x.
//   float64:    4096 values, the bound of the H100's first timing (never timed itself).
constexpr int64_t kPersistentAutoStagedHalf = 65536;
constexpr int64_t kPersistentAutoStagedFloat = 12288;
constexpr int64_t kPersistentAutoStagedDouble = 4096;
// Per call: at least 32 steps.  Only T >= 256 was timed; what the persistent
// launch costs once (the host's attribute and occupancy queries, the
// cooperative launch, W's slice loaded into shared memory: at most 227 KiB per
// SM, ~10 us from HBM) was not measured apart; it is taken to stay under the
// ~80 us that 32 steps save at the least.  Shorter calls -- an agent acting one
// step at a time -- keep the host loop until a GPU times them.
constexpr int64_t kPersistentAutoMinSteps = 32;

// Auto's bound on the values staged per step for elements of `element_bytes`,
// each feeding `gates` dot products per unit (the forward: the cell's G; the
// backward: 1).
constexpr int64_t persistent_auto_staged(int64_t element_bytes, int64_t gates) {
  return element_bytes <= 2   ? kPersistentAutoStagedHalf / gates
         : element_bytes == 4 ? kPersistentAutoStagedFloat
                              : kPersistentAutoStagedDouble;
}

// Whether the persistent kernel is to be tried for a layer of T steps and B rows
// staging K values a row per step, in elements of `element_bytes`, each value
// feeding `gates` dot products per unit (it still declines what does not fit).
inline bool persistent_chosen(const Context& ctx, int64_t T, int64_t B, int64_t K, int64_t element_bytes,
                              int64_t gates) {
  switch (ctx.persistent) {
    case PersistentMode::Never: return false;
    case PersistentMode::Always: return true;
    case PersistentMode::Auto:
      return !ctx.capturing && T >= kPersistentAutoMinSteps &&
             B * K <= persistent_auto_staged(element_bytes, gates);
  }
  return false;
}

// recurrence (one layer, one direction).  G = gate_count(cell), W = workspace_width(cell).
struct RecurrenceForwardParams {
  Cell cell;
  int64_t T, B, H, P;
  bool reverse;
  const int64_t* lengths;  // device [B], or null: every sequence has T steps
  // Host [T], with lengths: step s's products cover rows [0, live_rows[s]), up
  // to the last row still running (live_rows()), so a batch whose lengths fall
  // along its rows -- a packed batch, sorted longest first -- costs its real
  // steps, not rows x longest.  Null: every step covers all B rows.
  const int64_t* live_rows;
  // The same on the device, for the persistent kernel: where it is chosen
  // (persistent_chosen) and there are lengths, else null.
  const int64_t* live_rows_dev;

  const void* xproj;  // S [T, B, G*H], row (t, b) at t*xproj_stride_t + b*xproj_stride_b
  int64_t xproj_stride_t, xproj_stride_b;
  const void* h0;    // S [B, P]
  const void* w_hh;  // S [G*H, P]
  const void* b_ih;  // S [G*H] or null
  const void* b_hh;  // S [G*H] or null
  const void* w_hr;  // S [P, H] (LSTM projection) or null
  const void* c0;    // S [B, H] (cells with a cell state)
  const bool* resets;    // device [T, B] or null
  const void* reset_h;   // S [B, P]: the state a reset restarts from (h0 where null)
  const void* reset_c;   // S [B, H] (cells with a cell state; c0 where null)
  const void* zoneout;   // S [T, B, Z], element (t, b, k) at
  int64_t zoneout_stride_t, zoneout_stride_b;  // t*zoneout_stride_t + b*zoneout_stride_b + k
  const void* ln;        // S [10H] (lstm_ln) or null

  void* output;     // S [T, B, P]
  void* workspace;  // A [T, B, workspace_size(cell, H, zoneout)], or null when not training
  void* c_steps;    // S [T, B, H]: c after every step (LSTM with cell_steps), or null

  // Scratch, allocated by the caller so that the time loop allocates nothing.
  void* hproj;    // A [B, G*H] (reset-before GRU: [B, 2H]) = h_{t-1} W_hh^T
  void* h_state;  // S [2, B, P] ping-pong state, slot 0 = h0; only with lengths or
                  // resets (without, the output row of the previous step is the state)
  void* c_state;  // A [2, B, H] ping-pong cell state, slot 0 = c0 (LSTM, LSTM-LN);
                  // c_n is slot T % 2
  void* rh;       // S [B, H] r * h_{t-1} (reset-before GRU)
  void* hn;       // A [B, H] (r * h_{t-1}) W_hn^T (reset-before GRU)
  void* h_full;   // S [B, H] o * tanh(c), the input of the projection (LSTM with w_hr)
};

// recurrence_backward.  Also the backward of the step op (T = 1, no grad_output).
struct RecurrenceBackwardParams {
  Cell cell;
  int64_t T, B, H, P;
  bool reverse;
  const int64_t* lengths;    // device [B] or null
  const int64_t* live_rows;  // host [T] or null (as in the forward)
  const int64_t* live_rows_dev;  // device [T] or null (as in the forward)

  const void* grad_output;  // S [T, B, P] with strides below, or null (zeros)
  int64_t grad_output_stride_t, grad_output_stride_b;
  const void* h0;         // S [B, P]
  const void* c0;         // S [B, H] (LSTM)
  const void* w_hh;       // S [G*H, P]
  const void* w_hr;       // S [P, H] or null
  const void* output;     // S [T, B, P]
  const void* workspace;  // A [T, B, workspace_size(cell, H, zoneout)]
  const bool* resets;     // device [T, B] or null (as in the forward)
  const void* reset_h;    // S [B, P] or null (as in the forward)
  const void* reset_c;    // S [B, H] or null
  const void* zoneout;    // S [T, B, Z] with strides below, or null
  int64_t zoneout_stride_t, zoneout_stride_b;
  const void* ln;         // S [10H] (lstm_ln) or null

  void* d_xproj;  // S [T, B, G*H]
  void* dh;       // A [B, P] carried dL/dh: grad_h_n on entry, grad_h0 on exit
  void* dc;       // A [B, H] carried dL/dc (LSTM): grad_c_n on entry, grad_c0 on exit
  const void* gc_steps;  // S [T, B, H] (cell_steps): dL/dc of every step, added there; or null
                  // (with resets, both: the part through each row's first step)
  void* dh0_reset;  // A [B, P] with resets: the gradient of the reset state through the
                    // reset steps (zeroed by the caller; grad_reset_h, or without
                    // reset_h grad_h0 = dh + dh0_reset), else null
  void* dc0_reset;  // A [B, H] the same for reset_c / c0 (cells with a cell state)

  // Scratch.  The *_all arrays are in time-position order, inputs of the
  // weight-gradient GEMMs the caller runs after the loop.
  void* da;          // S [B, G*H] (reset-before: [B, 2H]) gate gradients of the step,
                     // the A of  dh += da W_hh;  after the loop: those of step 0
  void* da_other;    // S like da: the persistent kernel's second buffer, or null (host loop)
  void* dhn_all;     // S [T, B, H] GRU: gradient of W_hn h + b_hn
  void* dn;          // S [B, H]    reset-before: candidate pre-activation gradient
  void* drh;         // A [B, H]    reset-before: dn W_hn
  void* rh_all;      // S [T, B, H] reset-before: r * h_{t-1}
  void* dh_tot;      // S [B, P]    projection: total gradient of the projected h_t
  void* dh_tot_all;  // S [T, B, P]
  void* dh_full;     // A [B, H]    projection: dh_tot W_hr
  void* h_full_all;  // S [T, B, H] projection: o * tanh(c)
  void* dhproj_all;  // S [T, B, 4H] LSTM-LN: gradient of h_{t-1} W_hh^T (the A of dW_hh)
  void* ln_scratch;  // A [B, 4H]    LSTM-LN: per-row values between the row reductions
  void* ln_grads;    // A [B, 14H]   LSTM-LN: per row, summed over the steps: d ln (10H) then
                     //              d b (4H, the same for b_ih and b_hh); zeroed by the caller
};

// step: one fused kernel per phase, [x, h] [W_ih; W_hh]^T and the gates.
struct StepParams {
  Cell cell;
  int64_t B, I, H;
  const void* x;     // S [B, I]
  const void* h;     // S [B, H]
  const void* c;     // S [B, H] (LSTM)
  const void* w_ih;  // S [G*H, I]
  const void* w_hh;  // S [G*H, H]
  const void* b_ih;  // S [G*H] or null
  const void* b_hh;  // S [G*H] or null
  void* h_new;       // S [B, H]
  void* c_new;       // S [B, H] (LSTM)
  void* workspace;   // A [B, W*H]
  void* rh;          // S [B, H] scratch (reset-before GRU)
};

// Entry points, instantiated for S in {double, float, __half, __nv_bfloat16}
// (recurrence_forward_<dtype>.cu, ...).  They throw std::runtime_error on a
// CUDA or cuBLAS error and never synchronise with the host.
template <typename S>
void recurrence_forward(const RecurrenceForwardParams& p, const Context& ctx);
template <typename S>
void recurrence_backward(const RecurrenceBackwardParams& p, const Context& ctx);
template <typename S>
void step_forward(const StepParams& p, const Context& ctx);

// Copies host lengths[0..B) to device memory through kernel parameters: no
// pinned staging buffer and no host synchronisation, so the values are part
// of a captured CUDA graph (as every other argument of the op is).
void upload_lengths(const int64_t* host, int64_t B, int64_t* device, cudaStream_t stream);

// Sets the padding positions (t >= lengths[b], lengths on the device) of a
// [T, B, words] array of 16-bit words to 0: all-zero bits, +0 in every storage
// and accumulate type (each a whole number of words), one kernel for all.
void zero_padding_words(void* a, int64_t T, int64_t B, int64_t words, const int64_t* lengths,
                        cudaStream_t stream);

}  // namespace rnnkern::cuda
