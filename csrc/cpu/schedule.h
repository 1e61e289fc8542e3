// The CPU recurrence's thread split and time loop: which worker runs which
// batch rows or hidden units, and the order of a call's phases and steps.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../checks.h"
#include "parallel.h"

namespace rnnkern::cpu {

// ------------------------------------------------------------------------
// Work split, one of two ways:
//  * by hidden units: each thread owns a slice of the units (or of the
//    projected outputs) for the whole call and per step runs its slice of the
//    recurrent GEMM (single-threaded) and of the gate math on data still in
//    its cache; the threads meet at the end of every phase of every step
//    (they read the previous step's full state from ping-pong buffers);
//  * by batch rows: the sequences are independent, so each thread runs the
//    whole recurrence of its rows, with all units, and the threads meet once,
//    at the end.  Each thread then reads all of W_hh every step, so this is
//    chosen when every thread gets rows enough for an efficient GEMM and
//    either W_hh is small enough to stay in cache or a step has too little
//    work to split by units.  Without the per-step meetings a thread that is
//    slowed down (a shared machine) no longer stalls the others at every
//    step: at B=32 H=256 the threads waited for each other 10-13% of the
//    time.
//  Otherwise by units only when each worker's share of a step is large
//  (kMinStepMacsPerWorker), else one thread runs the recurrence: with a
//  `while 1: pass` neighbour on one of two cores, per-step meetings made a
//  GRU on two threads 3x (B=8 H=1024) to 27x (B=1 H=1024) slower than on one.

struct Slice {
  int64_t j0, n;  // units [j0, j0 + n)
};

struct Rows {
  int64_t b0, nb;  // batch rows [b0, b0 + nb)
};

// At most max_parts slices, each at least 32 units, boundaries on
// multiples of 16 so each slice starts on a vector boundary.
inline std::vector<Slice> split_units(int64_t H, int64_t max_parts) {
  const int64_t parts = std::clamp<int64_t>(H / 32, 1, std::max<int64_t>(max_parts, 1));
  std::vector<Slice> slices;
  int64_t j0 = 0;
  for (int64_t t = 0; t < parts; ++t) {
    const int64_t j1 = t + 1 == parts ? H : (H * (t + 1) / parts) / 16 * 16;
    slices.push_back({j0, j1 - j0});
    j0 = j1;
  }
  return slices;
}

// Split by rows, each worker reads all of W_hh every step for its own rows (one
// parallel region per call, no meeting per step): worth it down to 2 rows a
// worker.  LSTM B=4 T=2048 H=128, 2 threads, Zen 3, vs torch.nn: one thread (the
// step too small to split by units) 0.87x fwd / 1.35x fwd+bwd; by rows of 2,
// 1.07x / 1.54x.
constexpr int64_t kMinRowsPerThread = 2;
constexpr int64_t kMaxSharedWeightBytes = int64_t(2) << 20;
// Split by units, the threads meet at every phase of every step: a worker
// takes a slice only if its share of a step's recurrent GEMM has this many
// multiply-adds.  Below, one thread runs the step faster than two that wait
// for each other, and on a machine where a core is taken by another process
// each meeting can cost a scheduler time slice (parallel.h).
constexpr int64_t kMinStepMacsPerWorker = int64_t(1) << 24;
// The weights of the per-step products are packed once per call when its
// steps reuse them, and read where they lie when the call has a single step.
// Packing costs about two passes over a weight: at T = 1 more than the
// product itself (GRU B=1 H=256 T=1 ran at 0.35x torch.nn's speed).  The
// forward packs W_hh^T at any batch when T > 1: with one or two rows a step
// (a matrix-vector product) the packed kernel's two-panel form beats dot
// products with the rows of W_hh, which end in a horizontal sum per output
// (LSTM H = 128: 1.1 us against 2.5 us a step on Zen 5).  The backward's
// W_hh is row-major already, so with at most kMaxInPlaceRows rows a step it
// reads its panels in place.  Not cached between calls: a weight can change
// without its version counter noticing (writes through .data or numpy), and a
// stale cache would be a silently wrong answer.
constexpr int64_t kMaxInPlaceRows = 2;

inline std::vector<Rows> equal_rows(int64_t B, int64_t parts) {
  std::vector<Rows> rows;
  for (int64_t t = 0; t < parts; ++t) rows.push_back({B * t / parts, B * (t + 1) / parts - B * t / parts});
  return rows;
}

// Contiguous blocks of at least kMinRowsPerThread rows (parts * kMinRowsPerThread
// <= B) whose costs, a row's length plus one (a finished row still costs its
// carry), are as even as the rows allow: a block ends at the first row that
// brings it to its share of what is left.
inline std::vector<Rows> balanced_rows(const int64_t* lengths, int64_t B, int64_t parts) {
  int64_t left = 0;
  for (int64_t b = 0; b < B; ++b) left += lengths[b] + 1;
  std::vector<Rows> rows;
  int64_t b0 = 0;
  for (int64_t t = 0; t < parts; ++t) {
    const int64_t blocks_left = parts - t;
    if (blocks_left == 1) {
      rows.push_back({b0, B - b0});
      break;
    }
    const int64_t share = (left + blocks_left - 1) / blocks_left;
    const int64_t last = B - (blocks_left - 1) * kMinRowsPerThread;  // room for the rest
    int64_t b = b0, cost = 0;
    while (b < last && (b - b0 < kMinRowsPerThread || cost < share)) cost += lengths[b++] + 1;
    rows.push_back({b0, b - b0});
    left -= cost;
    b0 = b;
  }
  return rows;
}

struct Split {
  bool by_rows = false;
  std::vector<Rows> rows;    // per worker (by rows), else {0, B}
  std::vector<Slice> units;  // per worker (by units), else {0, H}
  std::vector<Slice> outs;   // the projection's outputs, likewise; empty without one

  // lengths (null: every row runs T steps): by rows, the blocks split the
  // rows' real steps evenly rather than their count.  A packed batch is
  // sorted longest first, so equal blocks gave the first worker most of the
  // work (LSTM, 232 rows of skewed lengths, 2 threads: 1.8x the time of a
  // dense batch of the same steps).  A row's result does not depend on its
  // block, so any split gives the same bits.  elem_bytes: of the packed
  // weights the steps read (2 for bf16 pairs: an LSTM's W_hh at H = 512 is
  // 2 MB there, and split by rows two threads ran 3-5% faster than by units).
  // also_streamed: bytes of other weights each step reads beside W_hh (the
  // forward's W_ih where the input projection runs inside the steps on AMX's
  // tiles, forward.cpp).  min_rows: the fewest rows a worker split by rows
  // takes (products.h, min_rows_per_worker).
  Split(const RecurrenceSizes& z, size_t elem_bytes, const int64_t* lengths = nullptr,
        int64_t also_streamed = 0, int64_t min_rows = kMinRowsPerThread) {
    const int64_t threads = cpu::threads();
    const int64_t step_macs = z.B * (z.G * z.H * z.P + (z.has_proj ? z.P * z.H : 0));
    const int64_t step_workers = std::min<int64_t>(threads, step_macs / kMinStepMacsPerWorker);
    const int64_t parts = std::min<int64_t>(threads, z.B / std::max<int64_t>(min_rows, 1));
    const int64_t weight_bytes =
        (z.G * z.H * z.P + (z.has_proj ? z.P * z.H : 0)) * elem_bytes + also_streamed;
    // By rows when W_hh stays in cache, or when a step has too little work
    // to split by units.
    by_rows = parts > 1 && (weight_bytes <= kMaxSharedWeightBytes || step_workers < 2);
    if (by_rows) {
      rows = lengths ? balanced_rows(lengths, z.B, parts) : equal_rows(z.B, parts);
      units = {{0, z.H}};
      if (z.has_proj) outs = {{0, z.P}};
    } else {
      rows = {{0, z.B}};
      units = split_units(z.H, step_workers);
      if (z.has_proj) outs = split_units(z.P, step_workers);
    }
  }
  // Workers of the phases over units and over projected outputs; worker t's
  // rows and the index of its unit (output) slice.
  size_t unit_workers() const { return by_rows ? rows.size() : units.size(); }
  size_t out_workers() const { return outs.empty() ? 0 : by_rows ? rows.size() : outs.size(); }
  const Rows& rows_of(size_t t) const { return rows[by_rows ? t : 0]; }
  size_t slice_of(size_t t) const { return by_rows ? 0 : t; }
  // What worker t of a phase covers: its rows, and its slice with the
  // slice's index (for the per-slice packed weights).
  struct Work {
    Rows r;
    size_t i;
    Slice sl;
  };
  Work unit_work(size_t t) const { return {rows_of(t), slice_of(t), units[slice_of(t)]}; }
  // Whether the backward's per-step products read W_hh in place (kMaxInPlaceRows).
  bool weights_in_place(int64_t T) const {
    int64_t most = 0;
    for (const Rows& r : rows) most = std::max(most, r.nb);
    return T == 1 || most <= kMaxInPlaceRows;
  }
  Work out_work(size_t t) const { return {rows_of(t), slice_of(t), outs[slice_of(t)]}; }
};

// One phase of a step: run(t, s) on workers 0 .. workers - 1 (none: skipped).
template <typename F>
struct Phase {
  size_t workers;
  F run;
};
template <typename F>
Phase<F> phase(bool active, size_t workers, F run) {
  return {active ? workers : 0, run};
}

// The time loop: by rows, each worker runs every step of its rows; by units,
// every step runs each phase on all workers before the next phase.
template <typename... F>
void run_steps(const Split& split, int64_t T, bool reverse_steps, const Phase<F>&... phases) {
  auto step_at = [&](int64_t i) { return reverse_steps ? T - 1 - i : i; };
  if (split.by_rows) {
    for_each_worker(split.rows.size(), [&](size_t t) {
      for (int64_t i = 0; i < T; ++i) ((phases.workers ? phases.run(t, step_at(i)) : void()), ...);
    });
  } else {
    for (int64_t i = 0; i < T; ++i)
      (for_each_worker(phases.workers, [&](size_t t) { phases.run(t, step_at(i)); }), ...);
  }
}

}  // namespace rnnkern::cpu
