// Helpers shared by the CUDA kernel families: storage <-> accumulate type
// conversion, error checks, the per-row time position, launch shapes and the
// typed front of the row-major GEMM.  No torch headers.
//
// torch's extension flags define __CUDA_NO_HALF_CONVERSIONS__ and friends,
// so half types are converted only through the intrinsics below.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "gemm.h"
#include "params.h"

namespace rnnkern::cuda {

// ------------------------------------------------------------- errors ----

[[noreturn]] inline void throw_cuda_error(cudaError_t e, const char* what, const char* file,
                                          int line) {
  throw std::runtime_error(std::string("rnnkern CUDA error: ") + cudaGetErrorString(e) + " (" +
                           what + " at " + file + ":" + std::to_string(line) + ")");
}

#define RNNKERN_CUDA_CHECK(expr)                                                   \
  do {                                                                             \
    const cudaError_t rnnkern_err_ = (expr);                                       \
    if (rnnkern_err_ != cudaSuccess)                                               \
      ::rnnkern::cuda::throw_cuda_error(rnnkern_err_, #expr, __FILE__, __LINE__);  \
  } while (0)

// After every launch: a bad configuration is reported here, not at the next sync.
#define RNNKERN_LAUNCH_CHECK() RNNKERN_CUDA_CHECK(cudaGetLastError())

// At each entry point, before the first launch: an error an earlier runtime call left
// pending (another library's, unread by its caller) would otherwise be reported by this
// op's first launch check as rnnkern's.  A sticky error (a faulted context) is not
// cleared by this and still fails the next call.
inline void clear_earlier_error() { (void)cudaGetLastError(); }

// ------------------------------------------------------------- types ----

template <typename S>
struct Storage;

template <>
struct Storage<double> {
  using Acc = double;
  static constexpr DType dtype = DType::F64;
  static __device__ __forceinline__ double load(double v) { return v; }
  static __device__ __forceinline__ double store(double v) { return v; }
};

template <>
struct Storage<float> {
  using Acc = float;
  static constexpr DType dtype = DType::F32;
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float v) { return v; }
};

template <>
struct Storage<__half> {
  using Acc = float;
  static constexpr DType dtype = DType::F16;
  static __device__ __forceinline__ float load(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half store(float v) { return __float2half_rn(v); }
};

template <>
struct Storage<__nv_bfloat16> {
  using Acc = float;
  static constexpr DType dtype = DType::BF16;
  static __device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

template <typename S>
using acc_t = typename Storage<S>::Acc;

// p[i] as the accumulate type A (storage values converted, A values as they are).
template <typename A, typename T>
__device__ __forceinline__ A load_at(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, A>) {
    return p[i];
  } else {
    return Storage<T>::load(p[i]);
  }
}

// An optional vector (a bias): 0 where absent.
template <typename A, typename T>
__device__ __forceinline__ A load_or_zero(const T* p, int64_t i) {
  return p == nullptr ? A(0) : load_at<A>(p, i);
}

// p[i] = v, converted to p's type.
template <typename T, typename A>
__device__ __forceinline__ void store_at(T* p, int64_t i, A v) {
  if constexpr (std::is_same_v<T, A>) {
    p[i] = v;
  } else {
    p[i] = Storage<T>::store(v);
  }
}

// ------------------------------------------------------ time positions ----

// The time position sequence b works on at step s (steps count from each
// sequence's own start: its end when reversed), or -1 once it has ended.
__host__ __device__ __forceinline__ int64_t position(const int64_t* lengths, int64_t T,
                                                     bool reverse, int64_t b, int64_t s) {
  const int64_t n = lengths == nullptr ? T : lengths[b];
  return s < n ? (reverse ? n - 1 - s : s) : -1;
}

// --------------------------------------------------------------- launch ----

// The one launch syntax of the sources: RNNKERN_LAUNCH(grid, block, smem,
// stream, kernel)(args...).  The emulated device (csrc/cuda_emu/prelude.h)
// defines it first, to run the kernel on the CPU.
#ifndef RNNKERN_LAUNCH
#define RNNKERN_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
#endif

// A cooperative launch, for kernels that meet at cooperative_groups::this_grid().sync():
// RNNKERN_LAUNCH_COOPERATIVE(grid, block, smem, stream, kernel)(args...) returns the
// launch's error (cudaErrorCooperativeLaunchTooLarge when the blocks cannot all be
// resident at once: size the grid from cudaOccupancyMaxActiveBlocksPerMultiprocessor).
// The emulated device defines it first and runs every block of the grid at once.
#ifndef RNNKERN_LAUNCH_COOPERATIVE
template <typename... P>
struct CooperativeLaunch {
  void (*kernel)(P...);
  dim3 grid, block;
  size_t smem;
  cudaStream_t stream;
  template <typename... A>
  cudaError_t operator()(A&&... args) const {
    // The parameters converted to the kernel's types first: the runtime copies each
    // from its address with the size the kernel declares.
    std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
    return std::apply(
        [this](auto&... p) {
          void* addresses[] = {static_cast<void*>(&p)..., nullptr};
          return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), grid, block,
                                             addresses, smem, stream);
        },
        params);
  }
};
template <typename... P>
CooperativeLaunch<P...> cooperative_launcher(void (*kernel)(P...), dim3 grid, dim3 block,
                                             size_t smem, cudaStream_t stream) {
  return CooperativeLaunch<P...>{kernel, grid, block, smem, stream};
}
#define RNNKERN_LAUNCH_COOPERATIVE(grid, block, smem, stream, ...) \
  ::rnnkern::cuda::cooperative_launcher(&__VA_ARGS__, grid, block, smem, stream)
#endif

// The persistent kernels' rows staged per CTA (n at a time): the emulated device
// counts them (tests: a batch with lengths costs its live rows); nothing on a GPU.
#ifndef RNNKERN_EMU_COUNT_STAGED_ROWS
#define RNNKERN_EMU_COUNT_STAGED_ROWS(n) ((void)0)
#endif

// The emulated device's side of prefetch_l2 (csrc/cuda_emu/prelude.h): it reads each
// address a GPU would prefetch (RNNKERN_EMU_PREFETCH_AT, in the kernel's own code, so
// that its sanitizers check them) and counts the bytes asked for (tests: what the
// persistent kernels prefetch).
#ifndef RNNKERN_EMU_COUNT_PREFETCHED
#define RNNKERN_EMU_COUNT_PREFETCHED(bytes) ((void)0)
#endif

// A hint that [p, p + bytes) will be read soon: the GPU fetches each of its
// 32-byte sectors into L2 (prefetch.global.L2, which changes no value).  Every
// address asked for lies in the span, which the caller may read: the emulated
// device reads each one, so that its sanitizers hold the callers to that.
__device__ __forceinline__ void prefetch_l2(const void* p, int64_t bytes) {
  if (bytes <= 0) return;
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + uintptr_t(bytes);
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p); a < end; a = (a & ~uintptr_t(31)) + 32) {
#if defined(RNNKERN_EMU_PREFETCH_AT)  // the emulated device (whose __CUDA_ARCH__ is set too)
    RNNKERN_EMU_PREFETCH_AT(a);
#elif defined(__CUDA_ARCH__)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(a));
#endif
  }
  RNNKERN_EMU_COUNT_PREFETCHED(bytes);
}

// A kernel's dynamic shared memory as an array of T: RNNKERN_DYNAMIC_SHARED(float, w);
// its size is the launch's smem argument (beyond 48 KiB only after cudaFuncSetAttribute's
// cudaFuncAttributeMaxDynamicSharedMemorySize).  A cooperatively launched kernel keeps all
// its shared memory here: the emulated device runs that grid's blocks at once and gives
// each block its own dynamic buffer, where a static __shared__ array would be one for all.
#ifndef RNNKERN_DYNAMIC_SHARED
#define RNNKERN_DYNAMIC_SHARED(T, name)                              \
  extern __shared__ __align__(16) unsigned char name##_dynamic_bytes_[]; \
  T* const name = reinterpret_cast<T*>(name##_dynamic_bytes_)
#endif

constexpr int kPointwiseThreads = 256;

// Blocks of a grid-stride loop over n elements.
inline unsigned int pointwise_blocks(int64_t n) {
  const int64_t blocks = (n + kPointwiseThreads - 1) / kPointwiseThreads;
  return static_cast<unsigned int>(blocks < (int64_t(1) << 20) ? blocks : (int64_t(1) << 20));
}

// ------------------------------------------------------------ live rows ----

// With lengths, step s's products cover only rows [0, live_rows[s]): up to the
// last row still running (params.h).  The rows past them are finished at s, and
// a [T, B, width] array (the output, the workspace, the gate gradients) wants 0
// at their padding position s, which the finished-row branches of the step
// kernels write for the rows they visit.  For the rest, one launch before the
// time loop sets every padding position (t >= lengths[b]) of the array to 0
// (params.h's zero_padding_words).
template <typename V>
void zero_padding(V* a, int64_t T, int64_t B, int64_t width, const int64_t* lengths,
                  cudaStream_t stream) {
  static_assert(sizeof(V) % sizeof(uint16_t) == 0, "zero_padding: a storage or accumulate type");
  if (a == nullptr || T * B * width == 0) return;
  zero_padding_words(a, T, B, width * int64_t(sizeof(V) / sizeof(uint16_t)), lengths, stream);
}

// Runtime flags as template parameters (mamba's BOOL_SWITCH, without the
// macro): f(std::bool_constant<a>{}, std::bool_constant<b>{}), so that
// `decltype(x)::value` is a constant in f and every combination is compiled.
template <typename F>
void bool_switch(bool a, bool b, const F& f) {
  if (a) {
    if (b) return f(std::true_type{}, std::true_type{});
    return f(std::true_type{}, std::false_type{});
  }
  if (b) return f(std::false_type{}, std::true_type{});
  return f(std::false_type{}, std::false_type{});
}

// ------------------------------------------------------ row reductions ----

// The row kernels (LSTM-LN's layer norms): one block per batch row, its
// threads striding over the row's values, reductions over the block.
constexpr int kRowThreads = 128;

// Blocks of a row kernel: one per row (gridDim.x allows 2^31 - 1; a batch
// of more rows would not fit in memory anyway: each has 14 H workspace values).
inline unsigned int row_blocks(int64_t rows) { return static_cast<unsigned int>(rows); }

// The workspace row of LSTM-LN at (position p, row b): cells.h's 14 blocks
// of H (i f g o c, x^ of the 4 gates, h^ of the 4 gates, c^) and the 3 row
// statistics (reciprocal standard deviations of x W_ih^T, h W_hh^T, c~).
template <typename A>
__device__ __forceinline__ A* ln_ws_row(A* ws, int64_t p, int64_t b, int64_t B, int64_t H) {
  return ws + (p * B + b) * workspace_size(Cell::LstmLn, H);
}

// A sum, as a reduction value.
template <typename A>
struct RowSum {
  A v;
  static __device__ __forceinline__ RowSum combine(const RowSum& a, const RowSum& b) {
    return RowSum{a.v + b.v};
  }
};

// Count, mean and sum of squared deviations (Welford), merged as Chan et al.:
// a layer norm's statistics in one reduction, without the cancellation of
// E[v^2] - E[v]^2.
template <typename A>
struct RowMoments {
  A n, mean, m2;
  __device__ __forceinline__ void add(A v) {
    n += A(1);
    const A delta = v - mean;
    mean += delta / n;
    m2 += delta * (v - mean);
  }
  // The population variance (a layer norm's; 0 for an empty row).
  __device__ __forceinline__ A variance() const { return n > A(0) ? m2 / n : A(0); }
  static __device__ __forceinline__ RowMoments combine(const RowMoments& a, const RowMoments& b) {
    const A n = a.n + b.n;
    if (n == A(0)) return a;
    const A delta = b.mean - a.mean;
    return RowMoments{n, a.mean + delta * (b.n / n),
                      a.m2 + b.m2 + delta * delta * (a.n * b.n / n)};
  }
};

// Reduces N values of every thread of the block (kThreads of them, a power
// of two) with V::combine, a tree in shared memory `smem` (N * kThreads
// values); every thread gets the results in v.  Barriers only (no warp
// shuffles): every thread of the block must call it.  smem is free again on
// return.
template <int kThreads, int N, typename V>
__device__ __forceinline__ void block_allreduce(V (&v)[N], V* smem) {
  static_assert((kThreads & (kThreads - 1)) == 0, "a power of two");
  const int tid = threadIdx.x;
#pragma unroll
  for (int i = 0; i < N; ++i) smem[i * kThreads + tid] = v[i];
  __syncthreads();
  // Not unrolled: the levels' predicates, hoisted, crowd out the kernels' own.
#pragma unroll 1
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (tid < stride) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        V* s = smem + i * kThreads + tid;
        *s = V::combine(*s, s[stride]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < N; ++i) v[i] = smem[i * kThreads];
  __syncthreads();  // every thread has read the results before smem is reused
}

// ----------------------------------------------------------------- GEMM ----

// Row-major C[M, N] = op(A)[M, K] op(B)[K, N] + beta C on the context's
// stream, A and B of storage type S, C of type SC (S, or A for the fp32
// results of half inputs).  See gemm.h.
template <typename S, typename SC>
void gemm(const Context& ctx, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
          const S* a, int64_t lda, const S* b, int64_t ldb, float beta, SC* c, int64_t ldc) {
  gemm_rowmajor(ctx.blas, ctx.stream, Storage<S>::dtype, Storage<SC>::dtype, ctx.allow_tf32,
                trans_a, trans_b, M, N, K, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace rnnkern::cuda
