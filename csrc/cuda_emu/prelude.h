// The emulated CUDA device: what the CUDA sources in csrc/cuda need to compile
// with g++ as C++ and run on the CPU.  Test-only (built with
// RNNKERN_CUDA_EMULATION=1, never part of a normal install).
//
// Force-included (-include) before every translation unit of the emulated
// build.  The real CUDA headers are included first, in host mode, for the
// half/bf16 types and their conversions and the runtime/cuBLAS declarations;
// then __CUDA_ARCH__ is defined, so the kernels take the device code paths of
// the architecture under test (RNNKERN_EMU_ARCH: 900 = sm_90 with WMMA, or
// 700 for the FMA path of the half types).
//
// Model (runtime.cpp): a launch runs its blocks one after another; each CUDA
// thread of a block is a fiber; __syncthreads() yields to the block's
// scheduler, which resumes the threads in a selectable order and checks after
// every round that all live threads wait at the same barrier.  Blocks running
// one at a time make __shared__ a per-kernel static.  The runtime and cuBLAS
// entry points the sources call are renamed to the emulator's (rnnkern_emu_*)
// so that they never bind to a real libcudart loaded in the same process.
#pragma once

#if defined(__CUDACC__)
#error "prelude.h is for the emulated (g++) build of the CUDA sources only"
#endif

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

#include "prelude_api.h"

#ifndef RNNKERN_EMU_ARCH
#define RNNKERN_EMU_ARCH 900
#endif

namespace rnnkern::emu {

// ---- the running thread, as the kernels see it

struct ThreadCoords {
  uint3 thread_idx, block_idx;
  dim3 block_dim, grid_dim;
  int linear_tid;  // threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)
};

// The coordinates of the fiber that runs now (runtime.cpp).
const ThreadCoords& current();

// __syncthreads(): yields to the block's scheduler.
void syncthreads(const char* file, int line);

// A launch of `body` on grid x block (checked like a real launch: a bad
// configuration sets the error cudaGetLastError returns and runs nothing).
struct LaunchSite {
  dim3 grid, block;
  size_t dynamic_smem;
  const char* file;
  int line;
};
template <typename F>
void run_grid(const LaunchSite& site, F&& body);

// The typed front of a launch: RNNKERN_LAUNCH(grid, block, smem, stream, kernel)(args...)
template <typename... P>
struct Launch {
  void (*kernel)(P...);
  LaunchSite site;
  template <typename... A>
  void operator()(A&&... args) const {
    // Kernel parameters are copied at the launch, as the hardware does.
    const std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
    auto* k = kernel;
    run_grid(site, [k, &params] { std::apply(k, params); });
  }
};

template <typename... P>
Launch<P...> launcher(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t,
                      const char* file, int line) {
  return Launch<P...>{kernel, LaunchSite{grid, block, smem, file, line}};
}

// Type-erased core of run_grid (runtime.cpp); cooperative: every block of the grid
// at once (returns the launch's error instead of running what cannot be co-resident).
void run_grid_erased(const LaunchSite& site, void (*call)(void*), void* body);
cudaError_t run_cooperative_grid_erased(const LaunchSite& site, const void* kernel,
                                        void (*call)(void*), void* body);

// A cooperative launch: RNNKERN_LAUNCH_COOPERATIVE(grid, block, smem, stream, kernel)(args...)
template <typename... P>
struct CooperativeLaunch {
  void (*kernel)(P...);
  LaunchSite site;
  template <typename... A>
  cudaError_t operator()(A&&... args) const {
    const std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
    auto* k = kernel;
    auto body = [k, &params] { std::apply(k, params); };
    using Body = decltype(body);
    return run_cooperative_grid_erased(
        site, reinterpret_cast<const void*>(kernel), [](void* b) { (*static_cast<Body*>(b))(); },
        &body);
  }
};
template <typename... P>
CooperativeLaunch<P...> cooperative_launcher(void (*kernel)(P...), dim3 grid, dim3 block,
                                             size_t smem, cudaStream_t, const char* file, int line) {
  return CooperativeLaunch<P...>{kernel, LaunchSite{grid, block, smem, file, line}};
}

// The running block's dynamic shared memory (its own buffer, the launch's smem bytes,
// 0xFF-filled as fresh shared memory holds garbage).
void* dynamic_shared();

// RNNKERN_EMU_COUNT_STAGED_ROWS (common.cuh): the running block's thread 0 adds n.
void count_staged_rows(int n);

// RNNKERN_EMU_PREFETCH_AT / RNNKERN_EMU_COUNT_PREFETCHED (common.cuh's prefetch_l2):
// the address is read as a byte in the kernel's code (instrumented: ASan checks it
// lies in an allocation, TSan that no other thread writes it unordered); the
// running thread adds the bytes asked for.
inline void prefetch_at(uintptr_t address) {
  const volatile unsigned char* p = reinterpret_cast<const volatile unsigned char*>(address);
  (void)*p;
}
void count_prefetched(int64_t bytes);

// cooperative_groups::this_grid().sync(): every thread of the grid meets here.
void grid_sync(const char* file, int line);
bool in_cooperative_launch();

// The device model behind the occupancy query and the cooperative launch's check.
int multiprocessors();
int max_active_blocks(const void* kernel, int block_threads, size_t dynamic_smem);
cudaError_t func_set_attribute(const void* kernel, cudaFuncAttribute attr, int value);

template <typename F>
void run_grid(const LaunchSite& site, F&& body) {
  using Body = std::remove_reference_t<F>;
  run_grid_erased(site, [](void* b) { (*static_cast<Body*>(b))(); },
                  const_cast<void*>(static_cast<const void*>(&body)));
}

}  // namespace rnnkern::emu

// ---- CUDA's built-ins, device model

#define threadIdx (::rnnkern::emu::current().thread_idx)
#define blockIdx (::rnnkern::emu::current().block_idx)
#define blockDim (::rnnkern::emu::current().block_dim)
#define gridDim (::rnnkern::emu::current().grid_dim)
#define __syncthreads() ::rnnkern::emu::syncthreads(__FILE__, __LINE__)
#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)

// The one launch syntax of the sources (common.cuh defines the nvcc form).
#define RNNKERN_LAUNCH(grid, block, smem, stream, ...) \
  ::rnnkern::emu::launcher(&__VA_ARGS__, grid, block, smem, stream, __FILE__, __LINE__)
#define RNNKERN_LAUNCH_COOPERATIVE(grid, block, smem, stream, ...) \
  ::rnnkern::emu::cooperative_launcher(&__VA_ARGS__, grid, block, smem, stream, __FILE__, __LINE__)
#define RNNKERN_DYNAMIC_SHARED(T, name) T* const name = static_cast<T*>(::rnnkern::emu::dynamic_shared())
#define RNNKERN_EMU_COUNT_STAGED_ROWS(n) ::rnnkern::emu::count_staged_rows(n)
#define RNNKERN_EMU_PREFETCH_AT(address) ::rnnkern::emu::prefetch_at(address)
#define RNNKERN_EMU_COUNT_PREFETCHED(bytes) ::rnnkern::emu::count_prefetched(bytes)

// ---- the runtime and cuBLAS calls of the sources, renamed to the emulator's

extern "C" {
cudaError_t rnnkern_emu_cudaGetLastError(void);
const char* rnnkern_emu_cudaGetErrorString(cudaError_t error);
cudaError_t rnnkern_emu_cudaMemset2DAsync(void* ptr, size_t pitch, int value, size_t width,
                                          size_t height, cudaStream_t stream);
cublasStatus_t rnnkern_emu_cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                                        cublasOperation_t transb, int m, int n, int k,
                                        const void* alpha, const void* A, cudaDataType Atype,
                                        int lda, const void* B, cudaDataType Btype, int ldb,
                                        const void* beta, void* C, cudaDataType Ctype, int ldc,
                                        cublasComputeType_t computeType, cublasGemmAlgo_t algo);
const char* rnnkern_emu_cublasGetStatusString(cublasStatus_t status);
cudaError_t rnnkern_emu_cudaGetDevice(int* device);
cudaError_t rnnkern_emu_cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
}
template <typename T>
cudaError_t rnnkern_emu_cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attr, int value) {
  return ::rnnkern::emu::func_set_attribute(reinterpret_cast<const void*>(kernel), attr, value);
}
template <typename T>
cudaError_t rnnkern_emu_cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, T* kernel,
                                                                      int block_threads,
                                                                      size_t dynamic_smem) {
  *blocks = ::rnnkern::emu::max_active_blocks(reinterpret_cast<const void*>(kernel), block_threads,
                                              dynamic_smem);
  return cudaSuccess;
}
#define cudaGetDevice rnnkern_emu_cudaGetDevice
#define cudaDeviceGetAttribute rnnkern_emu_cudaDeviceGetAttribute
#define cudaFuncSetAttribute rnnkern_emu_cudaFuncSetAttribute
#define cudaOccupancyMaxActiveBlocksPerMultiprocessor rnnkern_emu_cudaOccupancyMaxActiveBlocksPerMultiprocessor
#define cudaGetLastError rnnkern_emu_cudaGetLastError
#define cudaGetErrorString rnnkern_emu_cudaGetErrorString
#define cudaMemset2DAsync rnnkern_emu_cudaMemset2DAsync
#define cublasGemmEx rnnkern_emu_cublasGemmEx
#define cublasGetStatusString rnnkern_emu_cublasGetStatusString

// Last: the sources below take the device paths of the emulated architecture.
#define __CUDA_ARCH__ RNNKERN_EMU_ARCH
