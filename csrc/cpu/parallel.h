// The parallel regions of the CPU kernels, and how many they have opened.
//
// Every region is a meeting of the threads: each waits for the slowest.  On
// a machine where another process holds a core, a thread of the team can sit
// in the run queue for a scheduler time slice (milliseconds) while the other
// spins at the barrier (libgomp, torch's OpenMP, spins up to GOMP_SPINCOUNT,
// 300000 rounds by default, before it sleeps) — so a region costs up to a
// time slice there, where it costs microseconds on an idle machine.  The
// kernels therefore open regions whose number does not grow with the
// sequence length unless each region has work enough to pay for such a wait:
// a GRU at T=20000 B=1 H=32 ran 42x slower on two threads than on one with a
// neighbour holding a core, through two regions per chunk of 256 steps in
// its weight-gradient GEMMs.  The spinning is most of the damage: with the
// old per-step split at B=1 H=256 and other jobs on the machine, two threads
// took 254x as long as one, and 1.4x with OMP_WAIT_POLICY=passive (set by
// the user before torch starts; a library cannot change it afterwards).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace rnnkern::cpu {

// The number of parallel regions opened so far (rnnkern._C.cpu_parallel_regions,
// for tests that check what a call costs in meetings of the threads).
inline std::atomic<int64_t> parallel_regions{0};

// The threads the kernels may plan for: torch's, or one inside a parallel
// region (run_concurrently's, cpu/module.cpp), where ATen runs a nested
// parallel_for inline on the calling thread: planned for two, a recurrence
// ran its two blocks of rows one after the other (LSTM B=4 H=512: 3x the
// time of one thread).
inline int64_t threads() {
  return at::in_parallel_region() ? 1 : at::get_num_threads();
}

// f(0), ..., f(workers - 1), each on its own thread; no region for one worker.
template <typename F>
void for_each_worker(int64_t workers, const F& f) {
  if (workers <= 0) return;
  if (workers == 1) return f(int64_t(0));
  parallel_regions.fetch_add(1, std::memory_order_relaxed);
  at::parallel_for(0, workers, 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) f(t);
  });
}

// The large products (rnnkern::linear, its gradients, the weight gradients:
// linear.cpp's blocked_gemm and pairs.h's gemm) split C's rows between
// threads.  A thread takes a share only if it has this many multiply-adds
// (some 50 us of one core): below, meeting the other threads costs more than
// it saves.
constexpr int64_t kMinMacsPerThread = int64_t(1) << 20;

// The threads a product of `macs` multiply-adds may use.
inline int64_t product_threads(int64_t macs) {
  return std::min<int64_t>(threads(), std::max<int64_t>(1, macs / kMinMacsPerThread));
}

// Rows [0, M) in whole blocks of `block` rows (a micro-kernel's), split
// between at most `threads` workers as evenly as the blocks allow: worker t
// takes [begin(t), begin(t + 1)).  Whole blocks, not whole cache blocks:
// splitting those left one thread a block more than the other (6 of 11 for
// the M = 4H = 1024 of the weight gradients).  Which rows a thread takes never
// changes an element's sum.
struct RowSplit {
  int64_t M, block, workers;
  RowSplit(int64_t M_, int64_t block_, int64_t threads)
      : M(M_), block(block_), workers(std::max<int64_t>(1, std::min(threads, (M_ + block_ - 1) / block_))) {}
  int64_t begin(int64_t t) const { return std::min(M, (M + block - 1) / block * t / workers * block); }
};

}  // namespace rnnkern::cpu
