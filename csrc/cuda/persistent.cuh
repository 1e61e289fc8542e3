// The persistent recurrence: one cooperative launch for the whole sequence of
// a layer, W_hh resident in shared memory across the GPU's SMs, one grid
// barrier per step (issue 26).
//
// Why: the host loops of recurrence_forward.cuh / recurrence_backward.cuh
// pay one GEMM launch and one pointwise launch per step and re-read W_hh from
// L2 every step; at small batches that latency, not the arithmetic, is the
// time (cuDNN's and FlashRNN's persistent kernels exist to remove it).
//
// Layout: CTA c owns hidden units [c*U, c*U + U) (the last one fewer) with
// every gate of them.
//   * forward: its slice of W_hh's rows (G gates x U units, each P long) is
//     loaded into shared memory once.  Per step it stages rows of h_{t-1}
//     (written by every CTA in the step before, read after the grid barrier
//     with plain coherent loads, never the read-only path), forms its
//     units' G dot products per batch row, and hands them to the pointwise
//     unit functions of pointwise_forward.cuh -- the same code, hence the same
//     state, output and workspace, as the host loop's pointwise kernels.
//   * backward: its slice of W_hh's columns (the units' columns of all
//     da_width rows) in shared memory.  Per step (in reverse) it first adds
//     da_{s+1} W_hh[:, own units] to its units' carried dh -- da of the step
//     after, written by every CTA, read after the barrier -- then runs the
//     pointwise backward units of pointwise_backward.cuh for its units, which
//     write its columns of da_s.  da alternates between two buffers (a CTA
//     writes da_s while the others may still read da_{s+1}); step 0 writes
//     the caller's `da`, as the host loop leaves it.
//   * both: before each grid barrier a CTA asks L2 for the next step's cold
//     rows of its units (persistent_prefetch_forward / _backward).
// The dot products are a block-wide split-K over the staged rows, each chunk
// of k summed by one worker in a fixed order, then the chunks summed in order
// by one thread per output -- the same bits for every launch and schedule:
// float16 / bfloat16 on the tensor cores from sm_80 (a warp per 16 x 16 tile
// of outputs x rows and chunk, WMMA, fp32 accumulators), float32 / float64
// (and the half types before sm_80) in 4 rows x 4 outputs register tiles.
// All shared memory is dynamic (a cooperative launch on the emulated device
// gives each block its own dynamic buffer).
//
// What fits: tanh/ReLU RNN, LSTM without projection, GRU (reset after), with
// lengths, reverse, resets and zoneout, every storage type.  With lengths a step
// stages and multiplies only the rows up to the last one still running
// (live_rows, as the host loops' GEMMs take them: a packed batch, sorted longest
// first, costs its real steps), since a step's time grows with the values
// staged.  The reset-before
// GRU and the LSTM projection need a second exchange per step, LSTM-LN a
// reduction over all of a row's units: they stay on the host loop, as does
// any size whose slice of W does not fit one SM's shared memory (beside it the
// staged rows go in pieces of k where whole ones do not fit) or whose grid
// cannot be co-resident (the host asks the occupancy API; it never launches a
// grid that cannot be).  Tried where the context's mode chooses it (params.h:
// persistent_chosen; by default up to the batch sizes where the GPU timed it
// at least level with the host loop).
#pragma once

#include <cooperative_groups.h>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <mma.h>

#include "pointwise_backward.cuh"
#include "pointwise_forward.cuh"

namespace rnnkern::cuda {

// Threads of a CTA.  The kernels' __launch_bounds__ also say one CTA per SM:
// ptxas may then use the whole register file (without it, aiming at more CTAs
// per SM, it kept loop variables in local memory).
constexpr int kPersistentThreads = 256;

// The cells the persistent kernels take (a template parameter of both).
enum class PersistentCell { RnnTanh, RnnRelu, Lstm, Gru };

// Gates per hidden unit (cells.h's gate_count for these cells).
__host__ __device__ constexpr int persistent_gates(PersistentCell c) {
  return c == PersistentCell::Lstm ? 4 : c == PersistentCell::Gru ? 3 : 1;
}

// The shape of one persistent launch, chosen on the host (persistent_plan).
struct PersistentPlan {
  int grid = 0;        // CTAs, each with `units` hidden units (the last: the rest)
  int units = 0;
  int outputs = 0;     // dot products per staged row: G * units (forward), units (backward)
  int64_t K = 0;       // their length: P (forward), da_width (backward)
  int batch_tile = 0;  // rows staged at once
  int split = 1;       // chunks of k per dot product (a power of two)
  // Of each staged row, the k staged at once: K, or (where W's slice and a tile of
  // K-long rows do not both fit) a multiple of 16, the products summing the pieces
  // in order (persistent_stage_and_multiply).
  int64_t k_piece = 0;
  // The shared arrays (persistent_layout): W's slice [w_rows][ld] S (zero past K), the
  // staged rows [x_rows][ld_x] S (zero past the piece), the partial sums [part] A.
  int64_t ld = 0, ld_x = 0;
  int w_rows = 0, x_rows = 0;
  int64_t part = 0;
  size_t smem = 0;     // dynamic shared memory of a CTA, bytes
  bool prefetch = true;  // the next step's rows into L2 during the barrier (persistent_prefetch)
};

// The half types multiply on the tensor cores (WMMA 16 x 16 x 16, fp32 accumulators)
// from sm_80 on; their shared layout is the tensor cores' (rows and k padded to 16)
// on every architecture, the device code below sm_80 taking the register tiles on it.
template <typename S>
constexpr bool kHalfType = std::is_same_v<S, __half> || std::is_same_v<S, __nv_bfloat16>;
constexpr int kWmma = 16;
constexpr int kPersistentWarps = kPersistentThreads / 32;

// Whether this compilation's device code takes the tensor cores for S.
template <typename S>
__device__ constexpr bool persistent_wmma() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return kHalfType<S>;
#else
  return false;
#endif
}

// A thread's register tile of the products: kTileRows staged rows x kTileOutputs
// outputs, so that each value read from shared memory feeds 4 FMAs (a thread
// per output would read two values per FMA: shared memory, not the FMA units,
// would set the time).
constexpr int kTileRows = 4, kTileOutputs = 4;

// Row stride of the shared arrays: K padded to an odd number of 32-bit words
// (2- and 4-byte types), so that the rows a warp reads at one k fall in
// different banks.
__host__ __device__ inline int64_t persistent_ld(int64_t K, size_t bytes) {
  if (bytes >= 8) return K;
  int64_t ld = K;
  while ((ld * int64_t(bytes)) % 8 != 4) ++ld;
  return ld;
}

// Slack for aligning the dynamic shared memory's base to 128 bytes (WMMA's
// pointers must be 32-byte aligned; a launch guarantees 16).
constexpr size_t kSmemAlign = 128;

// n rounded up to a multiple of 16 (a count of rows or k, or bytes).
template <typename T>
__host__ __device__ inline T round16(T n) { return (n + 15) / 16 * 16; }

// Register tiles of a block of nb rows x `outputs`, `split` chunks each.
__host__ __device__ inline int persistent_tiles(int nb, int outputs) {
  return ((nb + kTileRows - 1) / kTileRows) * ((outputs + kTileOutputs - 1) / kTileOutputs);
}

// Fills plan's shared layout for its outputs, K, k_piece, batch_tile and split.
template <typename S>
inline void persistent_layout(PersistentPlan& plan) {
  if (kHalfType<S>) {
    // A multiple of 8 (WMMA's ldm), rows 16 apart stay 32-byte aligned.
    plan.ld = round16(plan.K) + 8;
    plan.ld_x = round16(plan.k_piece) + 8;
    plan.w_rows = int(round16(plan.outputs));
    plan.x_rows = int(round16(plan.batch_tile));
    plan.part = int64_t(plan.w_rows / kWmma) * (plan.x_rows / kWmma) * plan.split * kWmma * kWmma;
  } else {
    plan.ld = persistent_ld(plan.K, sizeof(S));
    plan.ld_x = persistent_ld(plan.k_piece, sizeof(S));
    plan.w_rows = plan.outputs;
    plan.x_rows = plan.batch_tile;
    plan.part = int64_t(plan.batch_tile) * plan.outputs * plan.split;
  }
  plan.smem = kSmemAlign + round16(sizeof(S) * size_t(plan.w_rows) * size_t(plan.ld)) +
              round16(sizeof(S) * size_t(plan.x_rows) * size_t(plan.ld_x)) +
              sizeof(acc_t<S>) * size_t(plan.part);
}

// out[r][o] = sum_k x[r][k] w[o][k] for the nb staged rows (w's rows ldw apart,
// x's ldx), as `split` partial sums per output in part[(r * outputs + o) * split +
// chunk], chunk c summing k = c, c + split, ... in order (the same bits however
// the threads run), added to what part holds when `accumulate` (the next piece of
// k: persistent_stage_and_multiply); the caller reads them after a barrier.
template <typename S>
__device__ void persistent_dots(const S* w, int ldw, const S* x, int ldx, acc_t<S>* part, int nb,
                                int outputs, int K, int split, bool accumulate) {
  using A = acc_t<S>;
  const int col_tiles = (outputs + kTileOutputs - 1) / kTileOutputs;
  const int n = persistent_tiles(nb, outputs) * split;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const int tile = i / split, chunk = i - tile * split;
    const int r0 = tile / col_tiles * kTileRows, o0 = (tile - tile / col_tiles * col_tiles) * kTileOutputs;
    // Rows and outputs past the end repeat the last one (read, never stored):
    // no predicate in the k loop.
    const S* xr[kTileRows];
    const S* wo[kTileOutputs];
#pragma unroll
    for (int a = 0; a < kTileRows; ++a) xr[a] = x + (r0 + a < nb ? r0 + a : nb - 1) * ldx;
#pragma unroll
    for (int c = 0; c < kTileOutputs; ++c) wo[c] = w + (o0 + c < outputs ? o0 + c : outputs - 1) * ldw;
    A acc[kTileRows][kTileOutputs] = {};
    if (accumulate)
#pragma unroll
      for (int a = 0; a < kTileRows; ++a)
#pragma unroll
        for (int c = 0; c < kTileOutputs; ++c)
          if (r0 + a < nb && o0 + c < outputs) acc[a][c] = part[((r0 + a) * outputs + o0 + c) * split + chunk];
    for (int k = chunk; k < K; k += split) {
      A xv[kTileRows], wv[kTileOutputs];
#pragma unroll
      for (int a = 0; a < kTileRows; ++a) xv[a] = load_at<A>(xr[a], k);
#pragma unroll
      for (int c = 0; c < kTileOutputs; ++c) wv[c] = load_at<A>(wo[c], k);
#pragma unroll
      for (int a = 0; a < kTileRows; ++a)
#pragma unroll
        for (int c = 0; c < kTileOutputs; ++c) acc[a][c] += xv[a] * wv[c];
    }
#pragma unroll
    for (int a = 0; a < kTileRows; ++a)
#pragma unroll
      for (int c = 0; c < kTileOutputs; ++c)
        if (r0 + a < nb && o0 + c < outputs)
          part[((r0 + a) * outputs + o0 + c) * split + chunk] = acc[a][c];
  }
}

// The same products on the tensor cores: warp item = (16 x 16 tile of outputs x
// rows, chunk c of the k steps), k steps c, c + split, ... accumulated in fp32
// (from what part holds when `accumulate`), stored to part[item][output % 16][row % 16].
template <typename S>
__device__ void persistent_mma(const S* w, int ldw, const S* x, int ldx, float* part, int nb,
                               int outputs, int K, int split, bool accumulate) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kHalfType<S>) {
    using namespace nvcuda;
    const int col_tiles = (outputs + kWmma - 1) / kWmma;
    const int n = col_tiles * ((nb + kWmma - 1) / kWmma) * split;
    const int ksteps = (K + kWmma - 1) / kWmma;
    for (int item = threadIdx.x / 32; item < n; item += kPersistentWarps) {
      const int tile = item / split, chunk = item - tile * split;
      const int to = tile % col_tiles, tr = tile / col_tiles;
      wmma::fragment<wmma::accumulator, kWmma, kWmma, kWmma, float> acc;
      if (accumulate)
        wmma::load_matrix_sync(acc, part + item * kWmma * kWmma, kWmma, wmma::mem_row_major);
      else
        wmma::fill_fragment(acc, 0.f);
      for (int ks = chunk; ks < ksteps; ks += split) {
        // A: W's rows (outputs x k); B: the staged rows read column-major (k x rows).
        wmma::fragment<wmma::matrix_a, kWmma, kWmma, kWmma, S, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, kWmma, kWmma, kWmma, S, wmma::col_major> fb;
        wmma::load_matrix_sync(fa, w + to * kWmma * ldw + ks * kWmma, ldw);
        wmma::load_matrix_sync(fb, x + tr * kWmma * ldx + ks * kWmma, ldx);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(part + item * kWmma * kWmma, acc, kWmma, wmma::mem_row_major);
    }
  }
#endif
}

// The products of a staged block, by whichever path this device code takes.
template <typename S>
__device__ __forceinline__ void persistent_products(const S* w, int ldw, const S* x, int ldx,
                                                    acc_t<S>* part, int nb, int outputs, int K,
                                                    int split, bool accumulate) {
  if constexpr (persistent_wmma<S>()) {
    persistent_mma(w, ldw, x, ldx, part, nb, outputs, K, split, accumulate);
  } else {
    persistent_dots(w, ldw, x, ldx, part, nb, outputs, K, split, accumulate);
  }
}

// Row r's product with output o: its chunks summed in order.
template <typename S>
__device__ __forceinline__ acc_t<S> persistent_result(const acc_t<S>* part, int r, int o,
                                                      int outputs, int split) {
  acc_t<S> sum = acc_t<S>(0);
  if constexpr (persistent_wmma<S>()) {
    const int tile = r / kWmma * ((outputs + kWmma - 1) / kWmma) + o / kWmma;
    const int at = (o % kWmma) * kWmma + r % kWmma;
    for (int c = 0; c < split; ++c) sum += part[(tile * split + c) * kWmma * kWmma + at];
  } else {
    for (int c = 0; c < split; ++c) sum += part[(r * outputs + o) * split + c];
  }
  return sum;
}

// 16 bytes moved as one load and one store (a global load of 128 bits).
struct alignas(16) Chunk16 {
  uint32_t word[4];
};

// A chunk's bytes from / to 16-byte aligned memory holding S values: one vector
// access on the GPU; memcpy in the emulated device's host compilation, where
// reading S objects through a Chunk16 would break C++'s aliasing rules.
__device__ __forceinline__ Chunk16 load_chunk(const void* p) {
#if defined(__CUDA_ARCH__)
  return *static_cast<const Chunk16*>(p);
#else
  Chunk16 c;
  std::memcpy(&c, p, sizeof(c));
  return c;
#endif
}

__device__ __forceinline__ void store_chunk(void* p, const Chunk16& c) {
#if defined(__CUDA_ARCH__)
  *static_cast<Chunk16*>(p) = c;
#else
  std::memcpy(p, &c, sizeof(c));
#endif
}

// The chunk's q-th S value.
template <typename S>
__device__ __forceinline__ S chunk_element(const Chunk16& c, int q) {
#if defined(__CUDA_ARCH__)
  return reinterpret_cast<const S*>(&c)[q];
#else
  S v;
  std::memcpy(&v, reinterpret_cast<const unsigned char*>(&c) + q * sizeof(S), sizeof(S));
  return v;
#endif
}

// Loads a thread keeps in flight while staging.  Staging is latency-bound: with
// one load at a time, each waiting an L2 round trip (~0.26 us on the H100, 8 warps
// an SM to hide it), a step cost 0.26 us per element a thread staged -- 70 us at
// B=64 H=1024 (bench/results/gpu-h100-2026-11-27-session5).  16-byte chunks, 8 in
// flight: one round trip per 64 half-type elements a thread, not per one.
constexpr int kStageDepth = 8;

// Copies n units (a row is per_row of them) with kStageDepth loads in flight per
// thread: load(i) reads unit i, store(r, c, v) writes it as column c of row r.
template <typename U, typename Load, typename Store>
__device__ __forceinline__ void stage_in_flight(int n, int per_row, const Load& load,
                                                const Store& store) {
  const int stride = int(blockDim.x);
  for (int base = threadIdx.x; base < n; base += kStageDepth * stride) {
    U v[kStageDepth];
#pragma unroll
    for (int d = 0; d < kStageDepth; ++d)
      if (base + d * stride < n) v[d] = load(base + d * stride);
#pragma unroll
    for (int d = 0; d < kStageDepth; ++d) {
      const int i = base + d * stride;
      if (i >= n) break;
      const int r = i / per_row;
      store(r, i - r * per_row, v[d]);
    }
  }
}

// Stages columns [k0, k0 + kn) of rows [b0, b0 + nb) of a [B, K] array (S) into x
// (row stride ldx): in 16-byte chunks where the rows allow it (K, k0 and kn
// multiples of a chunk's values, the array 16-byte aligned), elements otherwise;
// stored as chunks where x's rows are 16-byte aligned too (the half types' layout),
// element by element otherwise (float32's odd word stride).  Plain coherent
// loads: other CTAs wrote `rows` before the grid barrier.
template <typename S>
__device__ void persistent_stage(S* x, int ldx, const S* rows, int K, int64_t b0, int nb, int k0,
                                 int kn) {
  constexpr int V = int(sizeof(Chunk16) / sizeof(S));
  const S* src = rows + b0 * K + k0;
  if (K % V == 0 && k0 % V == 0 && kn % V == 0 &&
      reinterpret_cast<uintptr_t>(src) % sizeof(Chunk16) == 0) {
    const bool aligned_rows = (int64_t(ldx) * int64_t(sizeof(S))) % int64_t(sizeof(Chunk16)) == 0;
    const int per_row = kn / V;
    stage_in_flight<Chunk16>(
        nb * per_row, per_row,
        [&](int i) {
          const int r = i / per_row;
          return load_chunk(src + int64_t(r) * K + (i - r * per_row) * V);
        },
        [&](int r, int c, const Chunk16& v) {
          S* dst = x + r * ldx + c * V;
          if (aligned_rows) {
            store_chunk(dst, v);
          } else {
#pragma unroll
            for (int q = 0; q < V; ++q) dst[q] = chunk_element<S>(v, q);
          }
        });
  } else {
    stage_in_flight<S>(
        nb * kn, kn,
        [&](int i) {
          const int r = i / kn;
          return src[int64_t(r) * K + (i - r * kn)];
        },
        [&](int r, int c, S v) { x[r * ldx + c] = v; });
  }
}

template <typename S>
struct PersistentShared {
  S* w;
  S* x;
  acc_t<S>* part;
  __device__ PersistentShared(unsigned char* smem, const PersistentPlan& plan) {
    unsigned char* base = reinterpret_cast<unsigned char*>(
        (reinterpret_cast<uintptr_t>(smem) + kSmemAlign - 1) / kSmemAlign * kSmemAlign);
    w = reinterpret_cast<S*>(base);
    x = reinterpret_cast<S*>(base + round16(sizeof(S) * size_t(plan.w_rows) * size_t(plan.ld)));
    part = reinterpret_cast<acc_t<S>*>(
        reinterpret_cast<unsigned char*>(x) +
        round16(sizeof(S) * size_t(plan.x_rows) * size_t(plan.ld_x)));
  }
  // Zero W's slice and the staging rows, padding included (the tensor cores
  // multiply k up to a multiple of 16: what lies past K must be 0, not NaN).
  __device__ void zero(const PersistentPlan& plan) const {
    const S z = Storage<S>::store(acc_t<S>(0));
    for (int i = threadIdx.x; i < int(plan.w_rows * plan.ld); i += blockDim.x) w[i] = z;
    for (int i = threadIdx.x; i < int(plan.x_rows * plan.ld_x); i += blockDim.x) x[i] = z;
  }
};

// part = rows [b0, b0 + nb) of the [B, K] array `rows` times W's slice (`outputs`
// rows), staged into x first; where plan.k_piece < K, a piece of k at a time, each
// staged over the last and its products added on in order (the same bits however
// the threads run).  The caller's barrier follows before part is read.
template <typename S>
__device__ void persistent_stage_and_multiply(const PersistentShared<S>& sh,
                                              const PersistentPlan& plan, const S* rows,
                                              int64_t b0, int nb, int outputs) {
  const int K = int(plan.K), piece = int(plan.k_piece), ldx = int(plan.ld_x);
  for (int k0 = 0; k0 < K; k0 += piece) {
    const int kn = K - k0 < piece ? K - k0 : piece;
    if (k0 > 0) __syncthreads();  // the last piece's products are done with x
    persistent_stage(sh.x, ldx, rows, K, b0, nb, k0, kn);
    if (kHalfType<S> && kn < piece) {
      // The tensor cores multiply k up to a multiple of 16: past a short last piece x
      // holds the row's piece before, and W's columns there are 0 -- zeros too, as
      // whole rows have, so that an inf there gives no NaN (inf * 0).
      const int pad = int(round16(kn)) - kn;
      for (int i = threadIdx.x; i < nb * pad; i += blockDim.x)
        sh.x[(i / pad) * ldx + kn + i % pad] = Storage<S>::store(acc_t<S>(0));
    }
    __syncthreads();
    persistent_products(sh.w + k0, int(plan.ld), sh.x, ldx, sh.part, nb, outputs, kn, plan.split,
                        k0 > 0);
  }
}

// ------------------------------------------------------------ prefetch ----

// What a step's pointwise units read from the arrays laid out by time position
// -- the input projection in the forward; the output gradient, the workspace and
// the outputs in the backward -- is cold: written long before (T x B x G x H
// values: past L2 at long sequences), so each such load waits a round trip to
// HBM after the products, on every step's critical path.  Each CTA asks for the
// next step's values of its units into L2 just before the grid barrier, whose
// wait then covers that round trip.  A hint only (a missed or extra line costs
// time, never a value); these functions mirror the reads of the unit functions
// (pointwise_forward.cuh, pointwise_backward.cuh), units [j0, j0 + n) of row b
// at step `step`.  RNNKERN_CUDA_PREFETCH=0 turns it off (timing it).
inline bool persistent_prefetch() {
  const char* env = std::getenv("RNNKERN_CUDA_PREFETCH");
  if (env == nullptr || std::strcmp(env, "1") == 0) return true;
  if (std::strcmp(env, "0") == 0) return false;
  throw std::invalid_argument(std::string("RNNKERN_CUDA_PREFETCH must be 0 or 1, got '") + env + "'");
}

template <typename S, PersistentCell kCell, bool kZoneout>
__device__ void persistent_prefetch_forward(const ForwardStep<S>& st, int64_t step, int64_t b,
                                            int64_t j0, int n) {
  constexpr int G = persistent_gates(kCell);
  const int64_t p = position(st.lengths, st.T, st.reverse, b, step);
  if (p < 0) return;
  const int64_t bytes = int64_t(n) * int64_t(sizeof(S));
#pragma unroll
  for (int k = 0; k < G; ++k) prefetch_l2(st.x_row(p, b) + k * st.H + j0, bytes);
  if constexpr (kZoneout) {
    const S* mask = st.zo + p * st.zo_st + b * st.zo_sb;
    prefetch_l2(mask + j0, bytes);
    if constexpr (kCell == PersistentCell::Lstm) prefetch_l2(mask + st.P + j0, bytes);
  }
}

template <typename S, PersistentCell kCell, bool kZoneout>
__device__ void persistent_prefetch_backward(const BackwardStep<S>& st, int64_t step, int64_t b,
                                             int64_t j0, int n) {
  using A = acc_t<S>;
  const int64_t B = st.B, H = st.H, P = st.P;
  const int64_t p = position(st.lengths, st.T, st.reverse, b, step);
  if (p < 0) return;
  // The row's previous position (its h_{t-1}, c_{t-1}), -1 at its first step.
  const int64_t q = step == 0 ? -1 : position(st.lengths, st.T, st.reverse, b, step - 1);
  const int64_t s_bytes = int64_t(n) * int64_t(sizeof(S)), a_bytes = int64_t(n) * int64_t(sizeof(A));
  if (st.gout != nullptr) prefetch_l2(st.gout + p * st.g_st + b * st.g_sb + j0, s_bytes);
  const S* mask = kZoneout ? st.zo + p * st.zo_st + b * st.zo_sb : nullptr;
  if constexpr (kCell == PersistentCell::RnnTanh || kCell == PersistentCell::RnnRelu) {
    if constexpr (kZoneout) {
      prefetch_l2(mask + j0, s_bytes);
      prefetch_l2(st.ws + (p * B + b) * H + j0, a_bytes);
    } else {
      prefetch_l2(st.out + (p * B + b) * P + j0, s_bytes);
    }
  } else if constexpr (kCell == PersistentCell::Lstm) {
    const A* w = st.ws + (p * B + b) * 5 * H;
#pragma unroll
    for (int k = 0; k < 5; ++k) prefetch_l2(w + k * H + j0, a_bytes);
    if (q >= 0) prefetch_l2(st.ws + (q * B + b) * 5 * H + 4 * H + j0, a_bytes);
    if (st.gc_steps != nullptr) prefetch_l2(st.gc_steps + (p * B + b) * H + j0, s_bytes);
    if constexpr (kZoneout) {
      prefetch_l2(mask + j0, s_bytes);
      prefetch_l2(mask + P + j0, s_bytes);
    }
  } else {
    const A* w = st.ws + (p * B + b) * 4 * H;
#pragma unroll
    for (int k = 0; k < 4; ++k) prefetch_l2(w + k * H + j0, a_bytes);
    if (q >= 0) prefetch_l2(st.out + (q * B + b) * P + j0, s_bytes);
    if constexpr (kZoneout) prefetch_l2(mask + j0, s_bytes);
  }
}

// ------------------------------------------------------------- forward ----

// live_rows: device [T] or null (every step all B rows), as the host loop's
// (params.h): step s's products take rows [0, live_rows[s]), its pointwise units
// rows [0, live_rows[s - 1]) -- a row finishing at s is visited once more, which
// copies its state into the next slot, so both slots hold it -- and the rows
// past them (finished, their padding written before the launch) are not visited.
template <typename S, PersistentCell kCell, bool kResets, bool kZoneout>
__global__ void __launch_bounds__(kPersistentThreads, 1)
    persistent_forward_kernel(ForwardStep<S> st, const S* w_hh, S* h_state, acc_t<S>* c_state,
                              const int64_t* live_rows, const PersistentPlan plan) {
  using A = acc_t<S>;
  constexpr int G = persistent_gates(kCell);
  RNNKERN_DYNAMIC_SHARED(unsigned char, smem);
  const PersistentShared<S> sh(smem, plan);
  const int64_t T = st.T, B = st.B, H = st.H, P = st.P;
  const int64_t j0 = int64_t(blockIdx.x) * plan.units;
  const int units = int(H - j0 < plan.units ? H - j0 : plan.units);
  const int outputs = G * units;  // row o = g * units + u: gate g of unit j0 + u
  const bool slots = h_state != nullptr;

  // 32-bit index arithmetic (the plan keeps the slice and the batch under 2^31
  // elements): a 64-bit division is a subroutine call, whose saved registers spill.
  const int Pi = int(P);
  const int ld = int(plan.ld);
  sh.zero(plan);
  __syncthreads();
  for (int i = threadIdx.x; i < outputs * Pi; i += blockDim.x) {
    const int o = i / Pi, k = i - o * Pi;
    const int g = o / units, u = o - g * units;
    sh.w[o * ld + k] = w_hh[(g * H + j0 + u) * P + k];
  }

  for (int64_t s = 0; s < T; ++s) {
    st.s = s;
    st.h_prev = slots ? h_state + (s & 1) * B * P
                      : (s == 0 ? st.h0 : st.out + (st.reverse ? T - s : s - 1) * B * P);
    st.h_next = slots ? h_state + ((s + 1) & 1) * B * P : nullptr;
    if constexpr (kCell == PersistentCell::Lstm) {
      st.c_prev = c_state + (s & 1) * B * H;
      st.c_next = c_state + ((s + 1) & 1) * B * H;
    }
    const int64_t live = live_rows == nullptr ? B : live_rows[s];
    const int64_t visited = live_rows == nullptr || s == 0 ? B : live_rows[s - 1];
    for (int64_t b0 = 0; b0 < visited; b0 += plan.batch_tile) {
      const int nb = int(visited - b0 < plan.batch_tile ? visited - b0 : plan.batch_tile);
      // The tile's rows in the products (the rest are finished: their units ignore hh).
      const int np = int(live - b0 <= 0 ? 0 : live - b0 < nb ? live - b0 : nb);
      __syncthreads();  // the last tile's readers of x and part are done
      if (np > 0) {
        RNNKERN_EMU_COUNT_STAGED_ROWS(np);
        persistent_stage_and_multiply(sh, plan, st.h_prev, b0, np, outputs);
      }
      __syncthreads();
      for (int i = threadIdx.x; i < nb * units; i += blockDim.x) {
        const int r = i / units, u = i - r * units;
        A hh[G];
#pragma unroll
        for (int g = 0; g < G; ++g)
          hh[g] = r < np ? persistent_result<S>(sh.part, r, g * units + u, outputs, plan.split)
                         : A(0);
        if constexpr (kCell == PersistentCell::RnnTanh || kCell == PersistentCell::RnnRelu) {
          rnn_forward_unit<kCell == PersistentCell::RnnRelu, kResets, kZoneout>(st, b0 + r, j0 + u,
                                                                               hh);
        } else if constexpr (kCell == PersistentCell::Lstm) {
          lstm_forward_unit<kResets, kZoneout>(st, b0 + r, j0 + u, hh);
        } else {
          gru_forward_unit<kResets, kZoneout>(st, b0 + r, j0 + u, hh);
        }
      }
    }
    // Every CTA's h_t is written before any CTA stages it.
    if (s + 1 < T) {
      if (plan.prefetch)
        for (int64_t b = threadIdx.x; b < live; b += blockDim.x)
          persistent_prefetch_forward<S, kCell, kZoneout>(st, s + 1, b, j0, units);
      cooperative_groups::this_grid().sync();
    }
  }
}

// ------------------------------------------------------------ backward ----

// da_other: the second buffer of da, [B, da_width].  live_rows as the forward's:
// step s visits rows [0, live_rows[s]) (the rows past them have not started,
// backwards: their carried gradients wait untouched, their padding is written
// before the launch), and the carry of da_{s+1} takes the rows step s + 1 wrote.
template <typename S, PersistentCell kCell, bool kResets, bool kZoneout>
__global__ void __launch_bounds__(kPersistentThreads, 1)
    persistent_backward_kernel(BackwardStep<S> st, const S* w_hh, S* da_other,
                               const int64_t* live_rows, const PersistentPlan plan) {
  RNNKERN_DYNAMIC_SHARED(unsigned char, smem);
  const PersistentShared<S> sh(smem, plan);
  const int64_t T = st.T, B = st.B, H = st.H, P = st.P, K = st.da_width;
  const int64_t j0 = int64_t(blockIdx.x) * plan.units;
  const int units = int(H - j0 < plan.units ? H - j0 : plan.units);
  S* const da_even = st.da;  // steps 0, 2, ...: the caller's da holds step 0's at the end

  const int Ki = int(K), ld = int(plan.ld);
  sh.zero(plan);
  __syncthreads();
  for (int i = threadIdx.x; i < units * Ki; i += blockDim.x) {
    const int r = i / units, u = i - r * units;  // consecutive threads: one row of W_hh
    sh.w[u * ld + r] = w_hh[int64_t(r) * P + j0 + u];
  }

  auto live = [&](int64_t s) { return live_rows == nullptr ? B : live_rows[s]; };
  // dh[b, own units] += da W_hh[:, own units] for rows [0, rows), da of the step
  // just done.
  auto carry = [&](const S* da, int64_t rows) {
    for (int64_t b0 = 0; b0 < rows; b0 += plan.batch_tile) {
      const int nb = int(rows - b0 < plan.batch_tile ? rows - b0 : plan.batch_tile);
      __syncthreads();
      RNNKERN_EMU_COUNT_STAGED_ROWS(nb);
      persistent_stage_and_multiply(sh, plan, da, b0, nb, units);
      __syncthreads();
      for (int i = threadIdx.x; i < nb * units; i += blockDim.x) {
        const int r = i / units, u = i - r * units;
        st.dh[(b0 + r) * P + j0 + u] += persistent_result<S>(sh.part, r, u, units, plan.split);
      }
    }
  };

  for (int64_t s = T - 1; s >= 0; --s) {
    if (s + 1 < T) {
      carry((s + 1) % 2 == 0 ? da_even : da_other, live(s + 1));
      __syncthreads();  // the carry of a unit is complete before its pointwise thread reads it
    }
    st.start_at(s);
    st.da = s % 2 == 0 ? da_even : da_other;
    for (int i = threadIdx.x; i < int(live(s)) * units; i += blockDim.x) {
      const int b = i / units;
      const int64_t j = j0 + (i - b * units);
      if constexpr (kCell == PersistentCell::RnnTanh || kCell == PersistentCell::RnnRelu) {
        rnn_backward_unit<kCell == PersistentCell::RnnRelu, kResets, kZoneout>(st, b, j);
      } else if constexpr (kCell == PersistentCell::Lstm) {
        lstm_backward_unit<kResets, kZoneout>(st, b, j);
      } else {
        gru_backward_unit<kResets, kZoneout>(st, b, j);
      }
    }
    if (plan.prefetch && s > 0) {
      const int64_t rows = live(s - 1);
      for (int64_t b = threadIdx.x; b < rows; b += blockDim.x)
        persistent_prefetch_backward<S, kCell, kZoneout>(st, s - 1, b, j0, units);
    }
    // Every CTA's columns of da_s are written before any CTA reads its rows.
    cooperative_groups::this_grid().sync();
  }
  carry(da_even, live(0));  // after step 0: the gradient of the state step 0 started from
}

// ---------------------------------------------------------------- host ----

// The plan for `outputs_per_unit` dot products of length K per hidden unit and
// batch row, over the device's SMs; false when W's slice and one staged row do
// not fit a CTA's shared memory, or the device cannot launch cooperatively.
template <typename S>
bool persistent_plan(int64_t H, int64_t B, int64_t K, int outputs_per_unit, PersistentPlan& plan) {
  int device = 0, sms = 0, coop = 0, smem_optin = 0;
  RNNKERN_CUDA_CHECK(cudaGetDevice(&device));
  RNNKERN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  RNNKERN_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device));
  RNNKERN_CUDA_CHECK(
      cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (!coop || sms < 1 || H < 1 || B < 1 || K < 1) return false;
  const int64_t grid_max = H < sms ? H : sms;
  plan.units = int((H + grid_max - 1) / grid_max);
  // The kernels index a CTA's units of the whole batch and its slice of W in 32 bits.
  const int64_t limit = int64_t(1) << 31;
  if (B * plan.units * outputs_per_unit >= limit ||
      (K + 32) * (plan.units * outputs_per_unit + 16) >= limit || (B + 16) * (K + 32) >= limit)
    return false;
  plan.grid = int((H + plan.units - 1) / plan.units);
  plan.outputs = outputs_per_unit * plan.units;
  plan.K = K;
  plan.k_piece = K;
  // As many rows per stage as fit (fewer barriers per step), then the split of k
  // that gives every thread (register tiles) or every warp (tensor cores) work.
  auto fits = [&](int64_t tile, int split) {
    plan.batch_tile = int(tile), plan.split = split;
    persistent_layout<S>(plan);
    return plan.smem <= size_t(smem_optin);
  };
  const int workers = kHalfType<S> ? kPersistentWarps : kPersistentThreads;
  auto items = [&](int64_t tile) {  // the products' work items of a tile (warps' or threads')
    return kHalfType<S> ? round16(plan.outputs) / kWmma * (round16(tile) / kWmma)
                        : persistent_tiles(int(tile), plan.outputs);
  };
  int64_t tile = B;
  while (tile >= 1 && !fits(tile, 1)) tile = tile > 64 ? tile / 2 : tile - 1;
  if (tile < 1) {
    // W's slice and one K-long staged row do not fit together (the half types pad a
    // tile to 16 rows: the LSTM's backward, K = 4H, from H ~ 900 on 132 SMs): the
    // rows in pieces of k, as few as fit beside the partial sums of a split that
    // busies every worker, of equal length (multiples of 16).  A step stages the
    // same values either way, in more rounds.
    tile = B < kWmma ? B : kWmma;
    int want = 1;
    while (want < 32 && items(tile) * want * 2 <= workers) want *= 2;
    int64_t longest = 0;
    for (; want >= 1 && longest == 0; want /= 2)
      for (int64_t piece = (K - 1) / kWmma * kWmma; piece >= kWmma; piece -= kWmma) {
        plan.k_piece = piece;
        if (fits(tile, want)) {
          longest = piece;
          break;
        }
      }
    if (longest == 0) return false;
    const int64_t pieces = (K + longest - 1) / longest;
    plan.k_piece = round16((K + pieces - 1) / pieces);
  }
  const int64_t ksteps = kHalfType<S> ? round16(plan.k_piece) / kWmma : plan.k_piece;
  int split = 1;
  while (split < 32 && split * 2 <= ksteps && items(tile) * split * 2 <= workers &&
         fits(tile, split * 2))
    split *= 2;
  fits(tile, split);
  plan.prefetch = persistent_prefetch();
  return true;
}

// Sets the kernel's dynamic shared memory and checks that the whole grid can be
// resident at once (one CTA per SM at the least); false when not.
template <typename Kernel>
bool persistent_fits(Kernel kernel, const PersistentPlan& plan) {
  const void* k = reinterpret_cast<const void*>(kernel);
  if (plan.smem > 48 * 1024)
    RNNKERN_CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(plan.smem)));
  // The plan's grid is at most one CTA per SM: co-resident when one fits an SM.
  int per_sm = 0;
  RNNKERN_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kPersistentThreads, plan.smem));
  return per_sm >= 1;
}

// The persistent kernels' cell for a layer, or false: projection, the
// reset-before GRU and LSTM-LN stay on the host loop.
inline bool persistent_cell(Cell cell, bool projection, PersistentCell* out = nullptr) {
  PersistentCell c;
  switch (cell) {
    case Cell::RnnTanh: c = PersistentCell::RnnTanh; break;
    case Cell::RnnRelu: c = PersistentCell::RnnRelu; break;
    case Cell::Lstm: c = PersistentCell::Lstm; break;
    case Cell::Gru: c = PersistentCell::Gru; break;
    default: return false;
  }
  if (projection) return false;
  if (out != nullptr) *out = c;
  return true;
}

// f(std::integral_constant<PersistentCell, c>{}, resets, zoneout) with the three
// as compile-time constants.
template <typename F>
void persistent_switch(PersistentCell cell, bool resets, bool zoneout, const F& f) {
  using C = PersistentCell;
  bool_switch(resets, zoneout, [&](auto r, auto z) {
    switch (cell) {
      case C::RnnTanh: return f(std::integral_constant<C, C::RnnTanh>{}, r, z);
      case C::RnnRelu: return f(std::integral_constant<C, C::RnnRelu>{}, r, z);
      case C::Lstm: return f(std::integral_constant<C, C::Lstm>{}, r, z);
      case C::Gru: return f(std::integral_constant<C, C::Gru>{}, r, z);
    }
  });
}

// The forward as one persistent launch; false (nothing launched) when the
// layer or its size does not fit, and the caller runs the host loop.
// live_rows: device [T] or null, as the kernels take it.
template <typename S>
bool persistent_forward(const ForwardStep<S>& st, Cell cell, const S* w_hh, S* h_state,
                        acc_t<S>* c_state, const int64_t* live_rows, bool resets, bool zoneout,
                        cudaStream_t stream) {
  PersistentCell pc;
  PersistentPlan plan;
  if (!persistent_cell(cell, st.h_full != nullptr, &pc) ||
      !persistent_plan<S>(st.H, st.B, st.P, int(gate_count(cell)), plan))
    return false;
  bool launched = false;
  persistent_switch(pc, resets, zoneout, [&](auto c, auto r, auto z) {
    constexpr PersistentCell C = decltype(c)::value;
    constexpr bool R = decltype(r)::value, Z = decltype(z)::value;
    if (!persistent_fits(persistent_forward_kernel<S, C, R, Z>, plan)) return;
    RNNKERN_CUDA_CHECK(RNNKERN_LAUNCH_COOPERATIVE(plan.grid, kPersistentThreads, plan.smem, stream,
                                                  persistent_forward_kernel<S, C, R, Z>)(
        st, w_hh, h_state, c_state, live_rows, plan));
    launched = true;
  });
  return launched;
}

template <typename S>
bool persistent_backward(const BackwardStep<S>& st, Cell cell, const S* w_hh, S* da_other,
                         const int64_t* live_rows, bool resets, bool zoneout,
                         cudaStream_t stream) {
  PersistentCell pc;
  PersistentPlan plan;
  if (!persistent_cell(cell, st.dh_full != nullptr, &pc) ||
      !persistent_plan<S>(st.H, st.B, st.da_width, 1, plan))
    return false;
  bool launched = false;
  persistent_switch(pc, resets, zoneout, [&](auto c, auto r, auto z) {
    constexpr PersistentCell C = decltype(c)::value;
    constexpr bool R = decltype(r)::value, Z = decltype(z)::value;
    if (!persistent_fits(persistent_backward_kernel<S, C, R, Z>, plan)) return;
    RNNKERN_CUDA_CHECK(RNNKERN_LAUNCH_COOPERATIVE(plan.grid, kPersistentThreads, plan.smem, stream,
                                                  persistent_backward_kernel<S, C, R, Z>)(
        st, w_hh, da_other, live_rows, plan));
    launched = true;
  });
  return launched;
}

}  // namespace rnnkern::cuda
