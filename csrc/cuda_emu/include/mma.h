// WMMA (nvcuda::wmma) for the emulated device: the subset the kernels use,
// with the hardware's preconditions checked.
//
// A fragment here holds the whole tile in every lane (a real one spreads it
// over the warp's 32 lanes); each lane loads and multiplies the full tile,
// and a store writes only the elements of its own lane (index % 32), so a
// read of another lane's elements without a barrier shows up as a wrong
// result or a ThreadSanitizer report, as it could on hardware.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace rnnkern::emu {
const struct ThreadCoords& current();
[[noreturn]] void wmma_precondition_failed(const std::string& what);
}  // namespace rnnkern::emu

namespace nvcuda::wmma {

struct row_major {};
struct col_major {};
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
enum layout_t { mem_row_major, mem_col_major };

namespace detail {

template <typename Use, int M, int N, int K>
struct Shape;
template <int M, int N, int K>
struct Shape<matrix_a, M, N, K> {
  static constexpr int rows = M, cols = K;
};
template <int M, int N, int K>
struct Shape<matrix_b, M, N, K> {
  static constexpr int rows = K, cols = N;
};
template <int M, int N, int K>
struct Shape<accumulator, M, N, K> {
  static constexpr int rows = M, cols = N;
};

template <typename T>
float to_float(T v) {
  if constexpr (std::is_same_v<T, __half>) return __half2float(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
  else return static_cast<float>(v);
}

// load/store_matrix_sync: mptr 256-bit (32-byte) aligned, ldm a multiple of
// 16 bytes (8 half values, 4 floats).
template <typename T>
void check_pointer(const T* p, unsigned ldm, const char* what) {
  if (reinterpret_cast<std::uintptr_t>(p) % 32 != 0)
    rnnkern::emu::wmma_precondition_failed(std::string(what) +
                                           ": pointer is not 32-byte aligned");
  if ((ldm * sizeof(T)) % 16 != 0)
    rnnkern::emu::wmma_precondition_failed(std::string(what) + ": ldm = " + std::to_string(ldm) +
                                           " elements is not a multiple of 16 bytes");
}

int lane();

}  // namespace detail

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static constexpr int rows = detail::Shape<Use, M, N, K>::rows;
  static constexpr int cols = detail::Shape<Use, M, N, K>::cols;
  static constexpr int num_elements = rows * cols;
  T x[rows * cols];  // row-major tile (the emulation's layout, not the hardware's)
};

template <typename Use, int M, int N, int K, typename T, typename Layout>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, T v) {
  for (int i = 0; i < f.num_elements; ++i) f.x[i] = v;
}

template <typename Use, int M, int N, int K, typename T, typename Layout>
void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f, const T* p, unsigned ldm) {
  detail::check_pointer(p, ldm, "wmma::load_matrix_sync");
  using F = fragment<Use, M, N, K, T, Layout>;
  for (int r = 0; r < F::rows; ++r)
    for (int c = 0; c < F::cols; ++c)
      f.x[r * F::cols + c] = std::is_same_v<Layout, col_major> ? p[c * ldm + r] : p[r * ldm + c];
}

// An accumulator from memory, laid out as `layout` says: each lane reads only its own
// elements, those store_matrix_sync writes (a real lane holds no others; mma_sync's
// result at an element depends on the accumulator's there only, so the zeros the
// others get here never reach memory).  Reading the whole tile would race with the
// other lanes' stores of the same tile, which the hardware's warp-wide layout has not.
template <int M, int N, int K, typename T>
void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const T* p, unsigned ldm,
                      layout_t layout) {
  detail::check_pointer(p, ldm, "wmma::load_matrix_sync");
  const int lane = detail::lane();
  for (int i = 0; i < M * N; ++i) {
    const int r = i / N, c = i % N;
    f.x[i] = i % 32 != lane ? T(0) : layout == mem_col_major ? p[c * ldm + r] : p[r * ldm + c];
  }
}

template <int M, int N, int K, typename T>
void store_matrix_sync(T* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm,
                       layout_t layout) {
  detail::check_pointer(p, ldm, "wmma::store_matrix_sync");
  const int lane = detail::lane();
  for (int i = lane; i < M * N; i += 32) {
    const int r = i / N, c = i % N;
    p[layout == mem_col_major ? c * ldm + r : r * ldm + c] = f.x[i];
  }
}

// d = a b + c, products and sums in float (tensor cores: fp32 accumulation).
template <int M, int N, int K, typename T, typename LA, typename LB>
void mma_sync(fragment<accumulator, M, N, K, float>& d,
              const fragment<matrix_a, M, N, K, T, LA>& a,
              const fragment<matrix_b, M, N, K, T, LB>& b,
              const fragment<accumulator, M, N, K, float>& c) {
  float out[M * N];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float s = c.x[i * N + j];
      for (int k = 0; k < K; ++k)
        s += detail::to_float(a.x[i * K + k]) * detail::to_float(b.x[k * N + j]);
      out[i * N + j] = s;
    }
  for (int i = 0; i < M * N; ++i) d.x[i] = out[i];
}

}  // namespace nvcuda::wmma
