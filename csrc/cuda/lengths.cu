// Host lengths -> device memory through kernel parameters, and the padding
// positions past them set to 0 (see params.h).
//
// A copy from pageable host memory would synchronise (and is illegal during
// CUDA-graph capture); one from a pinned staging buffer would be captured as
// a read of that buffer at every replay, after the op has released it.  The
// values travel inside the launches instead, at most kChunk per launch
// (kernel parameters are limited to 4 KiB).
#include "common.cuh"

namespace rnnkern::cuda {
namespace {

constexpr int kChunk = 480;

struct LengthsChunk {
  int64_t* dst;
  int64_t n;
  int64_t values[kChunk];
};

__global__ void upload_lengths_kernel(const LengthsChunk chunk) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < chunk.n) chunk.dst[i] = chunk.values[i];
}

__global__ void __launch_bounds__(kPointwiseThreads)
    zero_padding_kernel(uint16_t* a, int64_t T, int64_t B, int64_t words,
                        const int64_t* lengths) {
  const int64_t n = T * B * words;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / words, t = row / B, b = row - t * B;
    if (t >= lengths[b]) a[i] = 0;
  }
}

}  // namespace

void upload_lengths(const int64_t* host, int64_t B, int64_t* device, cudaStream_t stream) {
  clear_earlier_error();
  for (int64_t b0 = 0; b0 < B; b0 += kChunk) {
    LengthsChunk chunk;
    chunk.dst = device + b0;
    chunk.n = B - b0 < kChunk ? B - b0 : kChunk;
    for (int64_t i = 0; i < chunk.n; ++i) chunk.values[i] = host[b0 + i];
    RNNKERN_LAUNCH((kChunk + 127) / 128, 128, 0, stream, upload_lengths_kernel)(chunk);
    RNNKERN_LAUNCH_CHECK();
  }
}

void zero_padding_words(void* a, int64_t T, int64_t B, int64_t words, const int64_t* lengths,
                        cudaStream_t stream) {
  RNNKERN_LAUNCH(pointwise_blocks(T * B * words), kPointwiseThreads, 0, stream,
                 zero_padding_kernel)(static_cast<uint16_t*>(a), T, B, words, lengths);
  RNNKERN_LAUNCH_CHECK();
}

}  // namespace rnnkern::cuda
