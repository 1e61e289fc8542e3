// The emulated device's cooperative-grid model checked on a real GPU, on a lent
// GPU: bash bench/cooperative_check.sh OUT.json (it compiles this file with nvcc).
//
// It runs the test kernel of tests/test_cuda_emulated_cooperative.py
// (csrc/cuda_emu/grid_exchange.cuh) on the GPU through the same launch helper
// (RNNKERN_LAUNCH_COOPERATIVE, nvcc's form), and prints one JSON object: for each
// case the largest error against a float64 host reference (relative to max(1, |value|)); the occupancy the
// CUDA runtime reports next to the emulator's model for the kernel's real
// register count; the error codes of a grid one block too large and of dynamic
// shared memory beyond 48 KiB without the opt-in.  The emulator must agree.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "grid_exchange.cuh"

using rnnkern::cuda_emu::grid_exchange;
using rnnkern::cuda_emu::grid_exchange_kernel;

namespace {

// The emulator's model (csrc/cuda_emu/runtime.cpp: max_active_blocks), sm_90.
int modelled_blocks_per_sm(int threads, size_t smem, int registers) {
  const int warps = (threads + 31) / 32;
  const int by_threads = 2048 / (warps * 32);
  const int by_smem = int((228 * 1024) / (smem + 1024));
  const int by_regs = 65536 / (warps * ((registers * 32 + 255) / 256 * 256));
  int n = 32;
  for (int v : {by_threads, by_smem, by_regs}) n = v < n ? v : n;
  return n;
}

double run_case(int blocks, int threads, int per_block, int shift, int steps, int* code) {
  const int n = blocks * per_block;
  std::mt19937 rng(blocks * 100 + steps);
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  std::vector<float> w(n), x(n);
  for (auto& v : w) v = u(rng);
  for (auto& v : x) v = 2 * u(rng);
  float *dw, *d0, *d1;
  cudaMalloc(&dw, n * 4); cudaMalloc(&d0, n * 4); cudaMalloc(&d1, n * 4);
  cudaMemcpy(dw, w.data(), n * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(d0, x.data(), n * 4, cudaMemcpyHostToDevice);
  cudaMemset(d1, 0xFF, n * 4);
  *code = grid_exchange(dw, d0, d1, blocks, threads, per_block, shift, steps, 0, true, true);
  const cudaError_t sync = cudaDeviceSynchronize();
  if (*code == 0) *code = sync;
  std::vector<float> out(n);
  cudaMemcpy(out.data(), steps % 2 == 0 ? d0 : d1, n * 4, cudaMemcpyDeviceToHost);
  cudaFree(dw); cudaFree(d0); cudaFree(d1);
  std::vector<double> ref(x.begin(), x.end()), next(n);
  for (int s = 0; s < steps; ++s) {
    for (int i = 0; i < n; ++i) next[i] = double(w[i]) * ref[(i + shift) % n] + ref[i];
    ref.swap(next);
  }
  double err = 0;  // relative to the value's size (values grow up to 1.5x a step)
  for (int i = 0; i < n; ++i) err = std::fmax(err, std::fabs(out[i] - ref[i]) / std::fmax(1.0, std::fabs(ref[i])));
  return err;
}

}  // namespace

int main() {
  cudaFuncAttributes attr{};
  cudaFuncGetAttributes(&attr, grid_exchange_kernel);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  std::printf("{\"registers\": %d, \"static_shared\": %zu, \"multiprocessors\": %d,\n", attr.numRegs,
              attr.sharedSizeBytes, sms);
  std::printf(" \"cases\": [");
  const int cases[][5] = {{4, 32, 32, 37, 5}, {3, 64, 40, 1, 4}, {6, 16, 48, 100, 3},
                          {2, 96, 7, 13, 6}, {132, 256, 1024, 77, 50}, {264, 128, 512, 5, 20},
                          {3, 128, 13000, 5, 2}};
  bool first = true;
  for (const auto& c : cases) {
    int code = 0;
    const double err = run_case(c[0], c[1], c[2], c[3], c[4], &code);
    std::printf("%s\n  {\"blocks\": %d, \"threads\": %d, \"per_block\": %d, \"shift\": %d, \"steps\": %d, "
                "\"error\": %d, \"max_rel_err\": %.3g}", first ? "" : ",", c[0], c[1], c[2], c[3], c[4],
                code, err);
    first = false;
  }
  std::printf("],\n \"occupancy\": [");
  const int occ[][2] = {{32, 1}, {1024, 1}, {64, 16384}, {256, 1}, {128, 13000}, {512, 4096}};
  first = true;
  for (const auto& o : occ) {
    const size_t smem = sizeof(float) * size_t(o[1]);
    if (smem > 48 * 1024)
      cudaFuncSetAttribute(grid_exchange_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    int per_sm = 0;
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, grid_exchange_kernel, o[0], smem);
    std::printf("%s\n  {\"threads\": %d, \"smem\": %zu, \"cuda\": %d, \"emulator_model\": %d}",
                first ? "" : ",", o[0], smem, per_sm, modelled_blocks_per_sm(o[0], smem, attr.numRegs));
    first = false;
  }
  // One block more than fits: 256 threads, 64 KiB each -> blocks per SM x SMs + 1.
  int per_sm = 0;
  cudaFuncSetAttribute(grid_exchange_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 65536);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, grid_exchange_kernel, 256, 65536);
  int too_large = 0;
  run_case(per_sm * sms + 1, 256, 16384, 1, 1, &too_large);
  cudaGetLastError();
  std::printf("],\n \"too_large\": {\"blocks\": %d, \"error\": %d},\n", per_sm * sms + 1, too_large);
  // Beyond 48 KiB without the opt-in, on a fresh kernel attribute state is not possible
  // (the attribute persists), so ask for more than the opt-in allows instead.
  const cudaError_t e = cudaFuncSetAttribute(grid_exchange_kernel,
                                             cudaFuncAttributeMaxDynamicSharedMemorySize, 240000);
  cudaGetLastError();
  std::printf(" \"opt_in_240000\": %d}\n", int(e));
  return 0;
}
