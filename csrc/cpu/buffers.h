// Large CPU buffers of the rnnkern ops come from a cache of freed blocks.
//
// A training loop allocates the same large tensors every iteration (the input
// projection, outputs, workspace, gradients: tens of MB each).  Fresh memory
// from the system costs a page fault per 4 KiB on first touch, which on the
// machines measured here cost as much as a third of an LSTM step's GEMMs.
// Blocks of at least kMinPooledBytes freed by rnnkern tensors are kept (up to
// RNNKERN_CPU_CACHE_MB, default 1024, counted in the blocks' real sizes) and
// handed out again for requests of at least 80% of their size; the tensors
// are ordinary CPU tensors with a pooled allocator.  Blocks are mapped from
// and unmapped to the system directly, so eviction and
// rnnkern.ops.empty_cpu_cache() really lower the process's memory.
#pragma once

#include <ATen/core/Tensor.h>

namespace rnnkern::cpu {

// Like at::empty on the CPU (NaN-filled under torch's deterministic
// fill_uninitialized_memory, as at::empty), pooled when large.
at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

// t in `dtype` (t itself when it has it, as Tensor::to), a conversion into a
// pooled buffer: the half-type calls convert their results and gradients
// from float32, tens of MB a call, which in fresh memory cost more in page
// faults than in the conversion itself.
at::Tensor pooled_to(const at::Tensor& t, at::ScalarType dtype);

// Frees every cached block; returns the bytes released.
int64_t empty_cache();

}  // namespace rnnkern::cpu
