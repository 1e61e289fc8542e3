// rnnkern::linear and linear_backward on the CPU: the large products around
// the recurrence (the input projection X W_ih^T over all steps, and in the
// backward dX = dXproj W_ih and dW_ih = dXproj^T X), plus the blocked GEMM
// driver the recurrence's dW_hh also uses (blocked_gemm in linear.h).
//
// Blocking (Goto): K in chunks of kKC, B packed into column panels per chunk;
// each thread takes blocks of kMC rows of A, packs them (L2-resident) and runs
// the micro-kernel over every panel (each panel stays in L1 for the kMC / kMR
// micro-kernels of a block).  A B of K x N up to kWholeBBytes, or up to
// kWholeBBytesRowMajorA where A is row-major (every product here but the
// weight gradients), is packed whole first and each row block goes through
// all chunks of K at once; a long K goes chunk by chunk.
// A product of at most kMC rows splits B's panels between the threads instead.
// Outputs come from the buffer pool (buffers.h).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "linear.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <vector>

#include "../checks.h"
#include "buffers.h"
#include "gemm.h"
#include "pairs.h"
#include "parallel.h"

namespace rnnkern::cpu {

namespace gemm {

bool wide_vectors() {
#if defined(RNNKERN_CPU_WIDE_VECTORS)
  // RNNKERN_CPU_VECTOR_BITS=256 keeps the 256-bit kernels on an AVX-512 CPU
  // (tests and A/B timings run both widths in one build).
  static const bool wide = [] {
    const char* bits = std::getenv("RNNKERN_CPU_VECTOR_BITS");
    if (bits != nullptr && std::string(bits) == "256") return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v4") != 0;
  }();
  return wide;
#else
  return false;
#endif
}

int fma_pipe_bits() {
  static const int bits = [] {
    const char* env = std::getenv("RNNKERN_CPU_FMA_BITS");
    if (env != nullptr && (std::string(env) == "256" || std::string(env) == "512")) return std::atoi(env);
#if defined(__x86_64__)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return 256;
    const bool amd = ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u;  // "AuthenticAMD"
    if (!amd || __get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return 256;
    unsigned family = (eax >> 8) & 0xfu, model = (eax >> 4) & 0xfu;
    if (family == 0xfu) {
      family += (eax >> 20) & 0xffu;
      model |= ((eax >> 16) & 0xfu) << 4;
    }
    return family == 0x1au && (model <= 0x1fu || (model >= 0x40u && model <= 0x4fu)) ? 512 : 256;
#else
    return 256;
#endif
  }();
  return bits;
}

bool prefetches_panels() {
  static const bool prefetch = [] {
    const char* env = std::getenv("RNNKERN_CPU_PREFETCH_PANELS");
    if (env != nullptr && (std::string(env) == "0" || std::string(env) == "1")) return env[0] == '1';
    if (!wide_vectors()) return false;
#if defined(__x86_64__)
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return false;
    return ebx == 0x756e6547u && edx == 0x49656e69u && ecx == 0x6c65746eu;  // "GenuineIntel"
#else
    return false;
#endif
  }();
  return prefetch;
}

bool widens_half_natively() {
#if defined(RNNKERN_CPU_F16C)
  static const bool f16c = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("x86-64-v3") != 0;
  }();
  return f16c;
#else
  return false;
#endif
}

// The dot products with float16 rows of W (multiply_nt_impl's, W's vectors
// converted as they are loaded: load_w), compiled for the ISA levels that
// have F16C: 512-bit where the products run so, else 256-bit.
#if defined(RNNKERN_CPU_WIDE_VECTORS)
RNNKERN_CPU_WIDE_TARGET void multiply_nt_half_wide(int64_t M, const float* A, int64_t lda,
                                                   const uint16_t* W, int64_t ldw, int64_t N, int64_t K,
                                                   float* C, int64_t ldc, bool accumulate) {
  multiply_nt_impl<float, kWide, uint16_t>(M, A, lda, W, ldw, N, K, C, ldc, accumulate);
}
#endif
#if defined(RNNKERN_CPU_F16C)
__attribute__((target("arch=x86-64-v3"), noinline)) void multiply_nt_half_narrow(
    int64_t M, const float* A, int64_t lda, const uint16_t* W, int64_t ldw, int64_t N, int64_t K,
    float* C, int64_t ldc, bool accumulate) {
  multiply_nt_impl<float, kNarrow, uint16_t>(M, A, lda, W, ldw, N, K, C, ldc, accumulate);
}
#endif

void multiply_nt_half(int64_t M, const float* A, int64_t lda, const uint16_t* W, int64_t ldw, int64_t N,
                      int64_t K, float* C, int64_t ldc, bool accumulate) {
#if defined(RNNKERN_CPU_WIDE_VECTORS)
  if (wide_vectors()) return multiply_nt_half_wide(M, A, lda, W, ldw, N, K, C, ldc, accumulate);
#endif
#if defined(RNNKERN_CPU_F16C)
  if (widens_half_natively()) return multiply_nt_half_narrow(M, A, lda, W, ldw, N, K, C, ldc, accumulate);
#endif
  // (Not reached from the callers, which check widens_half_natively() first:
  // without F16C, a float32 copy of W.)
  std::vector<float> w(static_cast<size_t>(N * K));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) w[n * K + k] = c10::detail::fp16_ieee_to_fp32_value(W[n * ldw + k]);
  multiply_nt(M, A, lda, w.data(), K, N, K, C, ldc, accumulate);
}

// The float32 multiply-add rate of one core in the vectors the products use
// (fma_rate): fma_chains<Bytes> independent accumulators so that no FMA waits
// on the latency of the one before (4 cycles, up to 2 issued a cycle: at least
// 8 needed), multiplied by 1 - 2^-10 and offset so that they converge instead
// of overflowing.  All of them, with the two constants, must fit the vector
// registers: 16 chains on 256-bit vectors (16 registers) kept three on the
// stack, each FMA then waiting on a store and a load, and the loop read 55
// GFLOP/s on a Zen 3 whose products reach 95 (12 chains: 97-98).  Its result
// is the bench's FMA peak where the stated clock is below the core's
// (bench/fma_peak.py): a virtual machine states its nominal clock, and the GEMM
// the bench measured before (torch.mm) reached 80% of the loop (Zen 4: 92
// against 115 GFLOP/s), so %peak read above 100%.
template <int Bytes>
constexpr int fma_chains = Bytes == kWide ? 16 : 12;  // 32 or 16 vector registers

template <int Bytes>
RNNKERN_ALWAYS_INLINE double fma_loop_impl(int64_t iterations) {
  using V = typename Vec<float, Bytes>::type;
  constexpr int L = Vec<float, Bytes>::kLanes;
  constexpr int kChains = fma_chains<Bytes>;
  V acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = V{} + float(j) * 1e-3f;
  const V b = V{} + (1.f - 1.f / 1024.f), c = V{} + 1e-3f;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iterations; ++i) {
#pragma GCC unroll 16
    for (int j = 0; j < kChains; ++j) acc[j] = acc[j] * b + c;  // (no reassociation: each FMA runs)
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sum = 0.f;
  for (int j = 0; j < kChains; ++j)
    for (int l = 0; l < L; ++l) sum += acc[j][l];
  TORCH_CHECK(std::isfinite(sum), "rnnkern internal: the FMA loop diverged");
  return double(iterations) * kChains * L * 2 / seconds;
}

#if defined(RNNKERN_CPU_WIDE_VECTORS)
RNNKERN_CPU_WIDE_TARGET double fma_loop_wide(int64_t iterations) { return fma_loop_impl<kWide>(iterations); }
#endif
RNNKERN_CPU_CLONES double fma_loop_narrow(int64_t iterations) { return fma_loop_impl<kNarrow>(iterations); }

double fma_rate(int64_t iterations) {
  TORCH_CHECK(iterations > 0, "fma_rate: iterations must be positive, got ", iterations);
#if defined(RNNKERN_CPU_WIDE_VECTORS)
  if (wide_vectors()) return fma_loop_wide(iterations);
#endif
  return fma_loop_narrow(iterations);
}

}  // namespace gemm

namespace {

using gemm::kKC;  // (the projection tiles of forward_from_input sum in the same chunks)
constexpr int64_t kMC = 16 * gemm::kMR;
// Up to this size B is packed whole (see blocked_gemm).  With a row-major A
// (the input projection, dX) up to the larger size: chunk by chunk, each
// block of C went to memory and back once per chunk of K (the speech
// encoder's projections, 3200 x 640 x 2048 and 3200 x 1024 x 2048, C of 26
// MB); packed whole they ran 2-5% faster at one thread and 5-10% at two
// (Zen 5, alternating builds; dX = dY W of the same sizes too).  A weight
// gradient's transposed A keeps 2 MiB: its 2048 x 3200 x 640 ran 3% slower.
constexpr int64_t kWholeBBytes = int64_t(2) << 20;
constexpr int64_t kWholeBBytesRowMajorA = int64_t(16) << 20;

// Up to this many panels of B, a transposed A is read where it lies too (see
// multiply_rows): with 256-bit vectors 4, with 512-bit ones 1.
int64_t max_panels_unpacked_a(bool wide) { return wide ? 1 : 4; }

// One block of rows of C, for one chunk of K.  A is packed only where that
// pays: a row-major A (the input projection, dX) is read where it lies, its
// kMR rows of the chunk stay in L1 while the panels of B go by, and packing
// cost more than it saved (M=8192 K=256 N=64, dX of an LSTM at H=64: 57 ->
// 73 GFLOP/s; M=4096 K=128 N=512, the input projection at H=128: 75 -> 79,
// Zen 4 at AVX2).  A transposed A (the weight gradients dW = dY^T X: A[m][k]
// at A[m + k * ld]) is packed, as its reads jump ld per k, unless B has so few
// panels that each packed element would serve too few of them (256-bit
// vectors, Zen 3: M=256 K=8192 N=64: 58 -> 70 GFLOP/s; at 16 panels, M=1024
// K=8192 N=256, packing wins: 77 against 64; at 8 the two are level).  With
// 512-bit vectors (panels of 32 columns, micro-panels of 8 rows) packing wins
// from two panels: one thread, Intel Xeon with two 512-bit FMA pipes,
// separate processes alternated five times, medians, dW_ih of an LSTM at
// H=256 with 64 inputs (M=1024 K=8192 N=64) 15.4 -> 11.2 ms (1.37x; two
// threads 1.41x), N=128 1.16x, M=2048 K=2048 N=128 1.27x, M=512 K=4096
// N=64 1.03x, M=768 K=3200 N=40 1.06x; one panel (M=256 K=8192 N=32) 1.00x
// either way, so a single panel stays read in place.  (Not yet measured on a
// Zen 4 or 5, where the in-place reads' prefetch was tuned: micro_kernel.)
// pack_transposed: packed at any panel count (a large dW on 256-bit vectors,
// see blocked_gemm).  Each element of C sums in the same order either way.
template <typename T>
RNNKERN_CPU_CLONES void multiply_rows(int64_t m0, int64_t m, int64_t M, const T* A,
                                      gemm::StridesA sa, int64_t k0, const gemm::PackedB<T>& b,
                                      T* C, int64_t ldc, bool accumulate, T* a_packed,
                                      bool pack_transposed = false, int64_t p0 = 0,
                                      int64_t p1 = -1) {
  if (p1 < 0) p1 = b.panels();
  if (sa.ks == 1 || (b.panels() <= max_panels_unpacked_a(b.wide()) && !pack_transposed)) {
    gemm::multiply(m, A + m0 * sa.rows + k0 * sa.ks, sa, b, C + m0 * ldc, ldc, accumulate, p0, p1);
    return;
  }
  gemm::pack_a_block(A, sa, m0, m, M, k0, b.K, a_packed, b);
  gemm::multiply_packed(m, a_packed, b, C + m0 * ldc, ldc, accumulate, p0, p1);
}

// Products of at most kInPlace rows of A (the input projection of a one-step
// call at batch 1, and its gradient dX), or of a K that short (the weight
// gradients of a one-step call: K = the batch), read B where it lies:
// packing B costs about two passes over it, four times the product of one
// row (rnnkern::linear at M = 1, LSTM H = 256: 72 us packed, 15 us for
// torch's mm).
constexpr int64_t kInPlace = 4;

// C (+)= A B for a K of at most kInPlace and a row-major B: each row of C is
// the sum of K rows of B scaled by that row's A (outer products: the weight
// gradients of a one-step call, K = the batch).  A plain row loop that the
// compiler vectorises writes C once; the micro-kernel's tiles cost as much
// setting up as multiplying at K = 1 (dW_ih of a GRU step at H = 256: 16.6 us,
// against 11.4 us for torch's mm).
template <typename T>
RNNKERN_CPU_CLONES void sum_of_scaled_rows(int64_t M, int64_t N, int64_t K, const T* A,
                                           gemm::StridesA sa, const T* B, int64_t b_ks, T* C,
                                           int64_t ldc, bool accumulate) {
  for (int64_t m = 0; m < M; ++m) {
    T* __restrict c = C + m * ldc;
    const T a0 = A[m * sa.rows];
    const T* __restrict b0 = B;
    if (accumulate)
      for (int64_t n = 0; n < N; ++n) c[n] += a0 * b0[n];
    else
      for (int64_t n = 0; n < N; ++n) c[n] = a0 * b0[n];
    for (int64_t k = 1; k < K; ++k) {
      const T ak = A[m * sa.rows + k * sa.ks];
      const T* __restrict bk = B + k * b_ks;
      for (int64_t n = 0; n < N; ++n) c[n] += ak * bk[n];
    }
  }
}

template <typename T>
RNNKERN_CPU_CLONES void multiply_in_place(int64_t M, int64_t N, int64_t K, const T* A,
                                          gemm::StridesA sa, const T* B, int64_t b_ks,
                                          int64_t b_ns, T* C, int64_t ldc, bool accumulate) {
  if (b_ns == 1 && K <= kInPlace)
    sum_of_scaled_rows(M, N, K, A, sa, B, b_ks, C, ldc, accumulate);
  else if (b_ns == 1)  // B row-major: the micro-kernel reads its panels in place
    gemm::multiply(M, A, sa, gemm::PackedB<T>::view_rows(B, K, N, b_ks), C, ldc, accumulate);
  else  // B transposed (x W^T), A row-major: dot products with the rows of W
    gemm::multiply_nt(M, A, sa.rows, B, b_ns, N, K, C, ldc, accumulate);
}

}  // namespace

template <typename T>
void blocked_gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t a_rows, int64_t a_ks,
                  const T* B, int64_t b_ks, int64_t b_ns, T* C, int64_t ldc, bool accumulate) {
  if (gemm::settle_empty_product(M, N, K, C, ldc, accumulate)) return;
  if ((b_ns == 1 && (M <= kInPlace || K <= kInPlace)) || (b_ks == 1 && a_ks == 1 && M <= kInPlace)) {
    multiply_in_place<T>(M, N, K, A, gemm::StridesA{a_rows, a_ks}, B, b_ks, b_ns, C, ldc,
                         accumulate);
    return;
  }
  // Rows split between the threads in whole micro-kernel rows (parallel.h),
  // each thread's share in blocks of kMC.
  const RowSplit split(M, gemm::kMR, product_threads(M * N * K));
  const int64_t threads = split.workers;
  const gemm::StridesA sa{a_rows, a_ks};
  const int64_t chunks = (K + kKC - 1) / kKC;
  // A large transposed A (a weight gradient's dY^T past kWholeBBytes) on
  // 256-bit vectors takes the long-K order below whatever B's size, and is
  // packed at any panel count.  Block of rows by block of rows over all of
  // K, each block walked dY down 96 of its columns, a 1-4 KB jump per k
  // through all T*B rows: dY came from memory once per block, each line for
  // 6 of its values, and a micro-panel's 256 k values read in place fell in
  // a few sets of L1 and L2, coming back from L3 for each panel.  Chunk by
  // chunk, a chunk's rows of dY serve every block while they are in the
  // caches.  dW, one thread, a Zen 3 (512 KB of L2), alternating builds,
  // against torch's mm in the same process: M=4096 K=128 N=512 (LSTM B=64
  // T=64 H=128) 0.74-0.75x -> 0.90-0.94x, 8192 x 64 x 1024 0.78-0.82x ->
  // 1.11-1.38x, 8192 x 64 x 256 0.71-0.75x -> 0.78-0.85x.  (Up to 2 MB of
  // dY, which the caches hold, the order below stays: 1024 x 32 x 128
  // read in place ran 1.02-1.20x, packed 0.98-1.00x.  The 512-bit kernel
  // prefetches A instead, measured on a Zen 4 in the order below: see
  // micro_kernel.)  Same sums either way.
  const bool pack_transposed = sa.rows == 1 && sa.ks != 1 && !gemm::wide_vectors() && chunks > 1 &&
                               M * K * static_cast<int64_t>(sizeof(T)) > kWholeBBytes;
  const int64_t whole_b_bytes = sa.ks == 1 ? kWholeBBytesRowMajorA : kWholeBBytes;
  if (!pack_transposed && K * N * static_cast<int64_t>(sizeof(T)) <= whole_b_bytes) {
    // B packed whole, then each block of rows runs through every chunk of K
    // while its block of C stays in L2: C is written once, where chunk by
    // chunk it went to memory and back K / kKC times (dX = dY W: 8 MB, 4x).
    std::vector<gemm::PackedB<T>> b(static_cast<size_t>(chunks));
    for (int64_t c = 0; c < chunks; ++c) b[c].resize(std::min(kKC, K - c * kKC), N);
    const int64_t panels = b[0].panels();
    // A few rows (up to one cache block, kMC): the threads split B's panels
    // instead, each packing its own and multiplying every row by them, in one
    // parallel region.  Split by rows, each thread read all of B, half of it
    // packed by the other core, after a region of its own for the packing,
    // for a share of 6 or 2 rows (rnnkern::linear, 2 threads, Zen 4, one
    // process alternating the two: M=8 K=256 N=1024 100 -> 56 us, M=32 168 ->
    // 127, M=64 237 -> 204, M=96 level; M=32 K=128 N=512 39 -> 29): the
    // input projection of a short call.  Each element of C sums as before.
    const int64_t workers = std::min<int64_t>(product_threads(M * N * K), panels);
    if (M <= kMC && workers > 1) {  // (from 5 rows: up to kInPlace they are read in place)
      for_each_worker(workers, [&](int64_t t) {
        const int64_t p0 = panels * t / workers, p1 = panels * (t + 1) / workers;
        for (int64_t c = 0; c < chunks; ++c)
          gemm::pack_panels<T>(b[c], B + c * kKC * b_ks, b_ks, b_ns, p0, p1);
        std::vector<T> a_packed(static_cast<size_t>(kMC * kKC));
        for (int64_t i = 0; i < M; i += kMC)
          for (int64_t c = 0; c < chunks; ++c)
            multiply_rows<T>(i, std::min(kMC, M - i), M, A, sa, c * kKC, b[c], C, ldc,
                             accumulate || c > 0, a_packed.data(), false, p0, p1);
      });
      return;
    }
    for_each_worker(threads, [&](int64_t t) {
      for (int64_t i = chunks * panels * t / threads; i < chunks * panels * (t + 1) / threads; ++i) {
        const int64_t c = i / panels, p = i % panels;
        gemm::pack_panels<T>(b[c], B + c * kKC * b_ks, b_ks, b_ns, p, p + 1);
      }
    });
    for_each_worker(threads, [&](int64_t t) {
      std::vector<T> a_packed(static_cast<size_t>(kMC * kKC));
      const int64_t r1 = split.begin(t + 1);
      for (int64_t i = split.begin(t); i < r1; i += kMC)
        for (int64_t c = 0; c < chunks; ++c)
          multiply_rows<T>(i, std::min(kMC, r1 - i), M, A, sa, c * kKC, b[c], C, ldc,
                           accumulate || c > 0, a_packed.data());
    });
    return;
  }
  // A long K (the weight gradients: K = T * B): chunk by chunk, each thread
  // packing its own copy of B's chunk (the rows it multiplies by it are
  // many more), so that the threads meet once, not twice per chunk.
  for_each_worker(threads, [&](int64_t t) {
    gemm::PackedB<T> b;
    std::vector<T> a_packed(static_cast<size_t>(kMC * kKC));
    const int64_t r0 = split.begin(t), r1 = split.begin(t + 1);
    for (int64_t k0 = 0; k0 < K; k0 += kKC) {
      b.resize(std::min(kKC, K - k0), N);
      gemm::pack_panels<T>(b, B + k0 * b_ks, b_ks, b_ns, 0, b.panels());
      for (int64_t i = r0; i < r1; i += kMC)
        multiply_rows<T>(i, std::min(kMC, r1 - i), M, A, sa, k0, b, C, ldc, accumulate || k0 > 0,
                         a_packed.data(), pack_transposed);
    }
  });
}

template void blocked_gemm<float>(int64_t, int64_t, int64_t, const float*, int64_t, int64_t,
                                  const float*, int64_t, int64_t, float*, int64_t, bool);
template void blocked_gemm<double>(int64_t, int64_t, int64_t, const double*, int64_t, int64_t,
                                   const double*, int64_t, int64_t, double*, int64_t, bool);

namespace {

// In the accumulate dtype: a conversion into a pooled buffer (pooled_to), as
// every call of a half-type step converts its weights (fresh memory cost a
// float16 LSTMCell at B=16 H=256 more in page faults than its products).
at::Tensor to_acc_2d(const at::Tensor& t, at::ScalarType acc) {
  return pooled_to(t, acc);
}

// Whether x W^T and its gradients run on bf16 pairs (pairs.h): every
// operand bfloat16 and a CPU (or a test) that runs them.
bool on_pairs(std::initializer_list<const at::Tensor*> ts) {
  if (pairs::mode() == pairs::Mode::Float32) return false;
  for (const at::Tensor* t : ts)
    if (t->scalar_type() != at::kBFloat16) return false;
  return true;
}

// C[M, N] = A B of bf16 operands (A[m][k] = a[m*a_rows + k*a_ks], B likewise)
// into c, row-major: float32 sums, or where c is bf16 rounded block of rows by
// block as they finish (pairs::gemm_to_bf16: the same values, no float32 C).
void pair_product(int64_t M, int64_t N, int64_t K, const at::Tensor& a, int64_t a_rows,
                  int64_t a_ks, const at::Tensor& b, int64_t b_ks, int64_t b_ns, at::Tensor& c) {
  if (c.scalar_type() == at::kBFloat16)
    pairs::gemm_to_bf16<uint16_t>(M, N, K, pairs::bf16_bits(a), a_rows, a_ks, pairs::bf16_bits(b),
                                  b_ks, b_ns, reinterpret_cast<uint16_t*>(c.data_ptr()), N);
  else
    pairs::gemm<uint16_t>(M, N, K, pairs::bf16_bits(a), a_rows, a_ks, pairs::bf16_bits(b), b_ks,
                          b_ns, c.data_ptr<float>(), N, false);
}

// grad_x = grad_y W and grad_w = grad_y^T x on bf16 pairs read as the tensors
// lie, into grad_x [M, K] and grad_w [N, K] of either dtype (pair_product).
void pair_gradients(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
                    bool need_x, bool need_weight, at::Tensor& grad_x, at::Tensor& grad_w) {
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  if (need_x)
    pair_product(M, K, N, grad_y, grad_y.stride(0), grad_y.stride(1), weight, weight.stride(0),
                 weight.stride(1), grad_x);
  if (need_weight)
    pair_product(N, K, M, grad_y, grad_y.stride(1), grad_y.stride(0), x, x.stride(0),
                 x.stride(1), grad_w);
}

}  // namespace

at::Tensor linear_acc(const at::Tensor& x, const at::Tensor& weight) {
  const auto acc = acc_type(x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor y = pooled_empty({M, N}, x.options().dtype(acc));
  if (on_pairs({&x, &weight})) {  // bf16 pairs of x and W as they lie, float32 sums
    pairs::gemm<uint16_t>(M, N, K, pairs::bf16_bits(x), x.stride(0), x.stride(1), pairs::bf16_bits(weight),
                          weight.stride(1), weight.stride(0), y.data_ptr<float>(), N, false);
    return y;
  }
  if (x.scalar_type() == at::kHalf && weight.scalar_type() == at::kHalf && M <= kInPlace &&
      weight.stride(1) == 1 && gemm::widens_half_natively()) {
    // float16 rows of W converted as the dot products load them
    // (gemm::multiply_nt_half): blocked_gemm's in-place product on a float32
    // copy of W, without the copy.
    static_assert(kInPlace < gemm::kMinBroadcastRows, "multiply_nt_half runs the dot products");
    const at::Tensor xa = to_acc_2d(x, acc);
    const auto* w_bits = reinterpret_cast<const uint16_t*>(weight.const_data_ptr());
    gemm::multiply_nt_half(M, xa.const_data_ptr<float>(), xa.stride(0), w_bits, weight.stride(0), N, K,
                           y.data_ptr<float>(), N, false);
    return y;
  }
  const at::Tensor xa = to_acc_2d(x, acc), wa = to_acc_2d(weight, acc);
  AT_DISPATCH_FLOATING_TYPES(acc, "rnnkern_linear_cpu", [&] {
    blocked_gemm<scalar_t>(M, N, K, xa.const_data_ptr<scalar_t>(), xa.stride(0), xa.stride(1),
                           wa.const_data_ptr<scalar_t>(), wa.stride(1), wa.stride(0),
                           y.data_ptr<scalar_t>(), N, false);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> linear_backward_acc(const at::Tensor& grad_y, const at::Tensor& x,
                                                       const at::Tensor& weight, bool need_x,
                                                       bool need_weight) {
  const auto acc = acc_type(x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor grad_x = need_x ? pooled_empty({M, K}, x.options().dtype(acc))
                             : empty_like_options(x, acc);
  at::Tensor grad_w = need_weight ? pooled_empty({N, K}, x.options().dtype(acc))
                                  : empty_like_options(x, acc);
  if (on_pairs({&grad_y, &x, &weight})) {  // bf16 pairs read from the tensors as they lie
    pair_gradients(grad_y, x, weight, need_x, need_weight, grad_x, grad_w);
    return {grad_x, grad_w};
  }
  const at::Tensor g = to_acc_2d(grad_y, acc), xa = to_acc_2d(x, acc), wa = to_acc_2d(weight, acc);
  AT_DISPATCH_FLOATING_TYPES(acc, "rnnkern_linear_backward_cpu", [&] {
    if (need_x)
      blocked_gemm<scalar_t>(M, K, N, g.const_data_ptr<scalar_t>(), g.stride(0), g.stride(1),
                             wa.const_data_ptr<scalar_t>(), wa.stride(0), wa.stride(1),
                             grad_x.data_ptr<scalar_t>(), K, false);
    if (need_weight)
      blocked_gemm<scalar_t>(N, K, M, g.const_data_ptr<scalar_t>(), g.stride(1), g.stride(0),
                             xa.const_data_ptr<scalar_t>(), xa.stride(0), xa.stride(1),
                             grad_w.data_ptr<scalar_t>(), K, false);
  });
  return {grad_x, grad_w};
}

namespace {

// y[M, N] = x[M, K] w[N, K]^T, in x's dtype.
at::Tensor linear_cpu(const at::Tensor& x, const at::Tensor& weight) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_linear(x, weight);
  if (on_pairs({&x, &weight})) {
    // y rounded to bf16 block of rows by block (pairs::gemm_to_bf16): no
    // float32 y to convert afterwards.
    const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
    const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
    at::Tensor y = pooled_empty({M, N}, x.options());
    pairs::gemm_to_bf16<uint16_t>(M, N, K, pairs::bf16_bits(xc), K, 1, pairs::bf16_bits(wc), 1, K,
                                  reinterpret_cast<uint16_t*>(y.data_ptr()), N);
    return y;
  }
  return pooled_to(linear_acc(x, weight), x.scalar_type());
}

// grad_x[M, K] = grad_y[M, N] w[N, K];  grad_w[N, K] = grad_y^T x, in x's dtype.
std::tuple<at::Tensor, at::Tensor> linear_backward_cpu(const at::Tensor& grad_y,
                                                       const at::Tensor& x,
                                                       const at::Tensor& weight, bool need_x,
                                                       bool need_weight) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_linear_backward(grad_y, x, weight);
  const auto dtype = x.scalar_type();
  if (on_pairs({&grad_y, &x, &weight})) {
    // The gradients rounded to bf16 block of rows by block (pairs::gemm_to_bf16),
    // as linear_cpu's y: no float32 copy of dX (a call's input, T*B rows) to
    // convert afterwards.  The same bits as linear_backward_acc's then rounding.
    const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
    at::Tensor grad_x = need_x ? pooled_empty({M, K}, x.options()) : empty_like_options(x, dtype);
    at::Tensor grad_w = need_weight ? pooled_empty({N, K}, x.options()) : empty_like_options(x, dtype);
    pair_gradients(grad_y, x, weight, need_x, need_weight, grad_x, grad_w);
    return {grad_x, grad_w};
  }
  auto [grad_x, grad_w] = linear_backward_acc(grad_y, x, weight, need_x, need_weight);
  return {need_x ? pooled_to(grad_x, dtype) : empty_like_options(x, dtype),
          need_weight ? pooled_to(grad_w, dtype) : empty_like_options(x, dtype)};
}

}  // namespace
}  // namespace rnnkern::cpu

TORCH_LIBRARY_IMPL(rnnkern, CPU, m) {
  m.impl("linear", &rnnkern::cpu::linear_cpu);
  m.impl("linear_backward", &rnnkern::cpu::linear_backward_cpu);
}
