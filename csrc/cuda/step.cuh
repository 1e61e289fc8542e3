// The step op: one fused kernel computes the product of the concatenations
// [x, h] [W_ih; W_hh]^T for a tile of rows and units, and the cell on it.
//
// A block owns 16 batch rows x 16 hidden units and all the gates of those
// units, so the gate math needs nothing from other blocks.  It walks K = I + H
// in chunks staged in shared memory: the chunk of [x, h] (zero-padded past
// the edges) and, per accumulator group, the chunk of the group's weight rows.
// Half types multiply on tensor cores (WMMA 16x16x16, fp32 accumulators; the
// four warps split each 64-wide chunk along K and their partial sums are
// added in shared memory); float and double use FMA, each thread owning two
// outputs of every group.
//
// Accumulator groups: one per gate where x and h enter the gate together
// (RNN, LSTM, the GRU's r and z); the GRU candidate keeps x W_in and h W_hn
// apart (two groups, each with the other's weights zeroed).  The reset-before
// GRU needs r for all units before its candidate's product, so it runs two
// kernels: r, z and r * h first, then [x, r * h] [W_in; W_hn]^T and n.
//
// The epilogue calls the same cells.h functions as every other backend.
#pragma once

#include <mma.h>

#include "common.cuh"

namespace rnnkern::cuda {

enum class StepPhase { RnnTanh, RnnRelu, Lstm, Gru, GruRbGates, GruRbCandidate };

constexpr int kStepTile = 16;     // batch rows and hidden units per block
constexpr int kStepThreads = 128;  // four warps

// The accumulator groups of a phase: how many, which gate's weight rows, and
// whether the x part and the h part of K contribute.
template <StepPhase kPhase>
struct StepGroups {
  static constexpr int count = kPhase == StepPhase::Lstm || kPhase == StepPhase::Gru ? 4
                               : kPhase == StepPhase::RnnTanh || kPhase == StepPhase::RnnRelu
                                   ? 1
                                   : 2;
  static __device__ __forceinline__ int gate(int g) {
    if constexpr (kPhase == StepPhase::Gru) return g < 2 ? g : 2;        // r, z, xn, hn
    if constexpr (kPhase == StepPhase::GruRbCandidate) return 2;         // xn, hn
    return g;
  }
  static __device__ __forceinline__ bool uses_x(int g) {
    if constexpr (kPhase == StepPhase::Gru) return g != 3;
    if constexpr (kPhase == StepPhase::GruRbCandidate) return g == 0;
    return true;
  }
  static __device__ __forceinline__ bool uses_h(int g) {
    if constexpr (kPhase == StepPhase::Gru) return g != 2;
    if constexpr (kPhase == StepPhase::GruRbCandidate) return g == 1;
    return true;
  }
};

template <typename S>
struct StepArgs {
  int64_t B, I, H;
  const S* x;     // [B, I]
  const S* a2;    // [B, H] second half of the A operand: h, or r * h (reset-before stage 2)
  const S* w_ih;  // [G*H, I]
  const S* w_hh;  // [G*H, H]
  const S* b_ih;  // or null
  const S* b_hh;  // or null
  const S* h;     // [B, H] h_{t-1} of the gate math
  const S* c;     // [B, H] (LSTM)
  S* h_new;
  S* c_new;
  acc_t<S>* ws;   // [B, W*H]
  S* rh;          // [B, H] (reset-before)
};

// The pointwise epilogue of one (b, j): pre[g] is the group sums of the unit.
template <typename S, StepPhase kPhase>
__device__ void step_epilogue(const StepArgs<S>& a, int64_t b, int64_t j,
                              const acc_t<S> (&pre)[StepGroups<kPhase>::count]) {
  using A = acc_t<S>;
  const int64_t H = a.H;
  auto bi = [&](int k) { return load_or_zero<A>(a.b_ih, k * H + j); };
  auto bh = [&](int k) { return load_or_zero<A>(a.b_hh, k * H + j); };
  const int64_t o = b * H + j;
  if constexpr (kPhase == StepPhase::RnnTanh || kPhase == StepPhase::RnnRelu) {
    store_at(a.h_new, o, RnnUnit<A, kPhase == StepPhase::RnnRelu>::forward(pre[0], bi(0) + bh(0)));
  } else if constexpr (kPhase == StepPhase::Lstm) {
    const auto r = LstmUnit<A>::forward(pre[0] + (bi(0) + bh(0)), pre[1] + (bi(1) + bh(1)),
                                        pre[2] + (bi(2) + bh(2)), pre[3] + (bi(3) + bh(3)),
                                        load_at<A>(a.c, o));
    store_at(a.h_new, o, r.h);
    store_at(a.c_new, o, r.c);
    A* w = a.ws + b * 5 * H + j;
    w[0] = r.i, w[H] = r.f, w[2 * H] = r.g, w[3 * H] = r.o, w[4 * H] = r.c;
  } else if constexpr (kPhase == StepPhase::Gru) {
    const A hn = pre[3] + bh(2);
    const auto r = GruUnit<A>::forward(pre[0] + bi(0), pre[1] + bi(1), pre[2] + bi(2), bh(0),
                                       bh(1), hn, load_at<A>(a.h, o));
    store_at(a.h_new, o, r.h);
    A* w = a.ws + b * 4 * H + j;
    w[0] = r.r, w[H] = r.z, w[2 * H] = r.n, w[3 * H] = hn;
  } else if constexpr (kPhase == StepPhase::GruRbGates) {
    const auto g = GruResetBeforeUnit<A>::gates(pre[0] + bi(0), pre[1] + bi(1), bh(0), bh(1),
                                                load_at<A>(a.h, o));
    A* w = a.ws + b * 3 * H + j;
    w[0] = g.r, w[H] = g.z;
    store_at(a.rh, o, g.rh);
  } else {  // GruRbCandidate
    A* w = a.ws + b * 3 * H + j;
    const auto c = GruResetBeforeUnit<A>::candidate(pre[0] + bi(2), pre[1] + bh(2), w[H],
                                                    load_at<A>(a.h, o));
    store_at(a.h_new, o, c.h);
    w[2 * H] = c.n;
  }
}

// Tile geometry per storage type: chunk width along K and the padded row
// length of the staged tiles (WMMA wants rows of a multiple of 8 half values;
// FMA wants an odd number of words to spread the banks).
template <typename S>
struct StepTiles {
  static constexpr bool kTensorCores = !std::is_same_v<S, acc_t<S>>;
  static constexpr int KC = kTensorCores ? 64 : 32;
  static constexpr int LD = kTensorCores ? KC + 8 : KC + 1;
};

// The multiply of one staged chunk, two ways.  Each accumulates the NG group
// sums of the block's 16 x 16 outputs, then leaves partial sums in shared
// memory (store) that sum() adds up for output (r, u) of group g.

// FMA: the thread owns row tid / 8, units 2 (tid % 8) and the next, of every group.
template <typename S, int NG>
struct FmaTile {
  using A = acc_t<S>;
  using Partial = A;
  static constexpr int kPartials = NG;
  static constexpr int KC = StepTiles<S>::KC, LD = StepTiles<S>::LD;
  A acc[NG][2];

  __device__ void zero() {
#pragma unroll
    for (int g = 0; g < NG; ++g) acc[g][0] = acc[g][1] = A(0);
  }
  __device__ void chunk(const S* As, const S* Ws, int tid) {
    const int r = tid / 8, u = (tid % 8) * 2;
#pragma unroll 8
    for (int k = 0; k < KC; ++k) {
      const A x = load_at<A>(As, r * LD + k);
#pragma unroll
      for (int g = 0; g < NG; ++g) {
        acc[g][0] += x * load_at<A>(Ws, (g * kStepTile + u) * LD + k);
        acc[g][1] += x * load_at<A>(Ws, (g * kStepTile + u + 1) * LD + k);
      }
    }
  }
  __device__ void store(Partial* Ps, int tid) const {
    const int r = tid / 8, u = (tid % 8) * 2;
#pragma unroll
    for (int g = 0; g < NG; ++g) {
      Ps[(g * kStepTile + r) * kStepTile + u] = acc[g][0];
      Ps[(g * kStepTile + r) * kStepTile + u + 1] = acc[g][1];
    }
  }
  static __device__ A sum(const Partial* Ps, int g, int r, int u) {
    return Ps[(g * kStepTile + r) * kStepTile + u];
  }
};

// Tensor cores (half types, sm_80+): warp w multiplies columns [16w, 16w + 16)
// of the 64-wide chunk into its own fp32 fragments; the four warps' partial
// sums are added at the end.
template <typename S, int NG>
struct WmmaTile;

#if defined(__CUDACC__) || defined(RNNKERN_CUDA_EMULATION)
template <typename S, int NG>
struct WmmaTile {
  using Partial = float;
  static constexpr int kWarps = kStepThreads / 32;
  static constexpr int kPartials = kWarps * NG;
  static constexpr int LD = StepTiles<S>::LD;
  static_assert(StepTiles<S>::KC == 16 * kWarps, "one 16-wide k slice per warp");
  nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> acc[NG];

  __device__ void zero() {
#pragma unroll
    for (int g = 0; g < NG; ++g) nvcuda::wmma::fill_fragment(acc[g], 0.f);
  }
  __device__ void chunk(const S* As, const S* Ws, int tid) {
    using namespace nvcuda;
    const int warp = tid / 32;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, S, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, As + warp * 16, LD);
#pragma unroll
    for (int g = 0; g < NG; ++g) {
      // The B operand is W^T: B[k][u] = W[u][k], the staged rows read column-major.
      wmma::fragment<wmma::matrix_b, 16, 16, 16, S, wmma::col_major> fb;
      wmma::load_matrix_sync(fb, Ws + g * kStepTile * LD + warp * 16, LD);
      wmma::mma_sync(acc[g], fa, fb, acc[g]);
    }
  }
  __device__ void store(Partial* Ps, int tid) const {
    const int warp = tid / 32;
#pragma unroll
    for (int g = 0; g < NG; ++g)
      nvcuda::wmma::store_matrix_sync(Ps + (warp * NG + g) * kStepTile * kStepTile, acc[g],
                                      kStepTile, nvcuda::wmma::mem_row_major);
  }
  static __device__ float sum(const Partial* Ps, int g, int r, int u) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += Ps[((w * NG + g) * kStepTile + r) * kStepTile + u];
    return total;
  }
};
#endif

template <typename S, StepPhase kPhase>
__global__ void __launch_bounds__(kStepThreads) step_kernel(const StepArgs<S> a) {
  using A = acc_t<S>;
  using Groups = StepGroups<kPhase>;
  constexpr int NG = Groups::count;
  constexpr int T16 = kStepTile;
  constexpr int KC = StepTiles<S>::KC, LD = StepTiles<S>::LD;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr bool kWmma = StepTiles<S>::kTensorCores;
#else
  constexpr bool kWmma = false;  // no bf16 WMMA before sm_80: FMA on the same tiles
#endif
  using Tile = std::conditional_t<kWmma, WmmaTile<S, NG>, FmaTile<S, NG>>;
  using Partial = typename Tile::Partial;

  __shared__ __align__(32) unsigned char smem_a[T16 * LD * sizeof(S)];
  __shared__ __align__(32) unsigned char smem_w[NG * T16 * LD * sizeof(S)];
  __shared__ __align__(32) unsigned char smem_p[Tile::kPartials * T16 * T16 * sizeof(Partial)];
  S* As = reinterpret_cast<S*>(smem_a);              // [16 rows][LD]: chunk of [x, a2]
  S* Ws = reinterpret_cast<S*>(smem_w);              // [NG][16 units][LD]: chunk of the weight rows
  Partial* Ps = reinterpret_cast<Partial*>(smem_p);  // partial sums of the 16 x 16 outputs

  const int tid = threadIdx.x;
  const int64_t B = a.B, I = a.I, H = a.H, K = I + H;
  const int64_t j0 = int64_t(blockIdx.x) * T16;
  const S zero = Storage<S>::store(A(0));

  for (int64_t b0 = int64_t(blockIdx.y) * T16; b0 < B; b0 += int64_t(gridDim.y) * T16) {
    Tile tile;
    tile.zero();
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      // Stage the chunk of [x, a2] and of each group's weight rows, zero past the edges.
      for (int e = tid; e < T16 * KC; e += kStepThreads) {
        const int r = e / KC, k = e % KC;
        const int64_t b = b0 + r, kk = k0 + k;
        S v = zero;
        if (b < B && kk < K) v = kk < I ? a.x[b * I + kk] : a.a2[b * H + (kk - I)];
        As[r * LD + k] = v;
      }
      for (int e = tid; e < NG * T16 * KC; e += kStepThreads) {
        const int g = e / (T16 * KC), rem = e % (T16 * KC);
        const int u = rem / KC, k = rem % KC;
        const int64_t j = j0 + u, kk = k0 + k;
        S v = zero;
        if (j < H && kk < K) {
          const int64_t row = Groups::gate(g) * H + j;
          if (kk < I) {
            if (Groups::uses_x(g)) v = a.w_ih[row * I + kk];
          } else if (Groups::uses_h(g)) {
            v = a.w_hh[row * H + (kk - I)];
          }
        }
        Ws[(g * T16 + u) * LD + k] = v;
      }
      __syncthreads();
      tile.chunk(As, Ws, tid);
      __syncthreads();  // before the next chunk overwrites the tiles
    }
    tile.store(Ps, tid);
    __syncthreads();

    for (int e = tid; e < T16 * T16; e += kStepThreads) {
      const int r = e / T16, u = e % T16;
      const int64_t b = b0 + r, j = j0 + u;
      if (b < B && j < H) {
        A pre[NG];
#pragma unroll
        for (int g = 0; g < NG; ++g) pre[g] = Tile::sum(Ps, g, r, u);
        step_epilogue<S, kPhase>(a, b, j, pre);
      }
    }
    __syncthreads();  // before the next row tile reuses shared memory
  }
}

template <typename S, StepPhase kPhase>
void launch_step(const StepArgs<S>& a, cudaStream_t stream) {
  const int64_t unit_tiles = (a.H + kStepTile - 1) / kStepTile;
  const int64_t row_tiles = (a.B + kStepTile - 1) / kStepTile;
  const dim3 grid(static_cast<unsigned int>(unit_tiles),
                  static_cast<unsigned int>(row_tiles < 65535 ? row_tiles : 65535));
  RNNKERN_LAUNCH(grid, kStepThreads, 0, stream, step_kernel<S, kPhase>)(a);
  RNNKERN_LAUNCH_CHECK();
}

template <typename S>
void step_forward(const StepParams& p, const Context& ctx) {
  clear_earlier_error();
  if (p.B == 0) return;
  StepArgs<S> a{};
  a.B = p.B, a.I = p.I, a.H = p.H;
  a.x = static_cast<const S*>(p.x);
  a.a2 = static_cast<const S*>(p.h);
  a.w_ih = static_cast<const S*>(p.w_ih);
  a.w_hh = static_cast<const S*>(p.w_hh);
  a.b_ih = static_cast<const S*>(p.b_ih);
  a.b_hh = static_cast<const S*>(p.b_hh);
  a.h = static_cast<const S*>(p.h);
  a.c = static_cast<const S*>(p.c);
  a.h_new = static_cast<S*>(p.h_new);
  a.c_new = static_cast<S*>(p.c_new);
  a.ws = static_cast<acc_t<S>*>(p.workspace);
  a.rh = static_cast<S*>(p.rh);
  switch (p.cell) {
    case Cell::RnnTanh: return launch_step<S, StepPhase::RnnTanh>(a, ctx.stream);
    case Cell::RnnRelu: return launch_step<S, StepPhase::RnnRelu>(a, ctx.stream);
    case Cell::Lstm: return launch_step<S, StepPhase::Lstm>(a, ctx.stream);
    case Cell::Gru: return launch_step<S, StepPhase::Gru>(a, ctx.stream);
    case Cell::GruResetBefore:
      launch_step<S, StepPhase::GruRbGates>(a, ctx.stream);
      a.a2 = a.rh;  // stage 2 multiplies [x, r * h]
      return launch_step<S, StepPhase::GruRbCandidate>(a, ctx.stream);
    case Cell::LstmLn:  // its layer norms need whole rows: bindings_impl.h's lstm_ln_step
      throw std::invalid_argument("rnnkern step_forward: lstm_ln runs as the recurrence, T = 1");
  }
}

}  // namespace rnnkern::cuda

// Explicit instantiation of the entry point (params.h) for one storage type.
#define RNNKERN_INSTANTIATE_STEP(S)               \
  template void rnnkern::cuda::step_forward<S>( \
      const rnnkern::cuda::StepParams&, const rnnkern::cuda::Context&);
