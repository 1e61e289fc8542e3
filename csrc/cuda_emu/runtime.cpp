// The emulated CUDA device's runtime (see prelude.h): launches, fibers and
// barriers, WMMA's lane, and the CUDA runtime / cuBLAS calls of the sources.
//
// A launch runs its blocks one after another; a cooperative launch
// (RNNKERN_LAUNCH_COOPERATIVE) runs all of them at once, each thread a fiber,
// so that cooperative_groups::this_grid().sync() can hold every thread of the
// grid: after each round the scheduler releases a block whose threads all wait
// at the same __syncthreads(), and the grid barrier once every thread of every
// block waits there.  A thread that exits while others wait for it, or threads
// waiting at different barriers, is an error (on hardware: a hang or undefined
// behaviour).  Each block of a launch has its own dynamic shared memory.  The
// cooperative launch is refused, as cudaLaunchCooperativeKernel refuses it,
// when the grid exceeds what the device model holds at once: multiprocessors()
// x max_active_blocks() of sm_90's per-SM limits (threads, blocks, shared
// memory, and the register file at registers_per_thread()).
//
// Under the sanitizers this file is compiled without instrumentation; it tells
// them about fiber switches (ASan: __sanitizer_{start,finish}_switch_fiber;
// TSan: one TSan fiber per CUDA thread, created once and reused) and about the
// barriers (TSan: each barrier is a release by every arriving thread and an
// acquire by every leaving one, on one of two addresses alternating with the
// barrier's phase, so that a write after barrier n is not ordered before a
// read after barrier n - 1).
#define RNNKERN_CUDA_EMULATION 1
#include "prelude.h"

#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define RNNKERN_EMU_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__) || defined(RNNKERN_EMU_TSAN)
#undef RNNKERN_EMU_TSAN
#define RNNKERN_EMU_TSAN 1
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
void AnnotateIgnoreReadsBegin(const char* file, int line);
void AnnotateIgnoreReadsEnd(const char* file, int line);
}
#endif

// The emulator's own bookkeeping is not instrumented for TSan: its state
// passes between fibers at every switch, which is the scheduler's business,
// not a race of the emulated kernel.  (Fiber switches tell TSan nothing
// either, __tsan_switch_to_fiber_no_sync: only the barriers order the threads.)
#ifdef RNNKERN_EMU_TSAN
#define RNNKERN_EMU_OWN __attribute__((no_sanitize_thread))
constexpr unsigned kSwitchFlags = 1;  // __tsan_switch_to_fiber_no_sync
#else
#define RNNKERN_EMU_OWN
#endif

namespace rnnkern::emu {
namespace {

#if defined(RNNKERN_EMU_ASAN) || defined(RNNKERN_EMU_TSAN)
constexpr size_t kStackBytes = size_t(512) << 10;  // sanitizers' frames are larger
#else
constexpr size_t kStackBytes = size_t(128) << 10;
#endif

enum class State { Ready, AtBarrier, AtGridBarrier, Done };

struct Fiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
#ifdef RNNKERN_EMU_TSAN
  void* tsan = nullptr;
#endif
  ThreadCoords coords;
  State state = State::Ready;
  const char* barrier_file = nullptr;
  int barrier_line = 0;
  int64_t barriers_passed = 0;
  int64_t grid_barriers_passed = 0;
  int block = 0;  // index into Scheduler::blocks
};

// A block of the running launch: its dynamic shared memory and its TSan
// barrier addresses (fresh per block: blocks are not ordered by barriers).
struct Block {
  uint3 idx;
  std::unique_ptr<unsigned char[]> dynamic_smem;
  std::unique_ptr<char[]> barrier_phase;
};

struct Scheduler {
  ucontext_t context;
#ifdef RNNKERN_EMU_TSAN
  void* tsan = nullptr;
#endif
#ifdef RNNKERN_EMU_ASAN
  const void* stack_bottom = nullptr;
  size_t stack_size = 0;
#endif
  std::vector<Fiber> fibers;  // reused across blocks and launches
  Fiber* running = nullptr;
  void (*call)(void*) = nullptr;
  void* body = nullptr;
  std::exception_ptr error;
  Order order = Order::Forward;
  std::mt19937 rng{0};
  cudaError_t last_error = cudaSuccess;
  int64_t launches = 0;
  int64_t cooperative_launches = 0;
  int64_t gemm_multiply_adds = 0;
  int64_t staged_rows = 0;
  int64_t prefetched_bytes = 0;
  // TSan sync addresses: the launch's start (host writes before it happen
  // before every thread) and end (every thread's writes before what the host
  // does next, as a stream synchronisation gives), and the current block's
  // two barrier phases (fresh memory per block: blocks are not ordered).
  char launch_start, launch_end;
  std::vector<Block> blocks;  // the blocks running now
  bool cooperative = false;
  char grid_phase[2];
  // The device model (sm_90) and the kernels' opted-in dynamic shared memory.
  int multiprocessors = 132;
  int registers_per_thread = 64;
  size_t shared_per_block_optin = 227 * 1024;
  std::vector<std::pair<const void*, int>> max_dynamic_smem;
};

constexpr int kMaxThreadsPerSM = 2048, kMaxBlocksPerSM = 32, kRegistersPerSM = 65536;
constexpr size_t kSharedPerSM = 228 * 1024, kSharedReservedPerBlock = 1024;
constexpr size_t kDefaultDynamicSmem = 48 * 1024, kMaxDynamicSmem = 227 * 1024;
// Fibers a cooperative launch may use at once (each has its own stack).
constexpr uint64_t kMaxCooperativeThreads = 16384;

RNNKERN_EMU_OWN Scheduler& sched() {
  static Scheduler s;
  return s;
}

// ---- fiber switches

RNNKERN_EMU_OWN void switch_to_fiber(Scheduler& s, Fiber& f) {
  s.running = &f;
#ifdef RNNKERN_EMU_TSAN
  __tsan_switch_to_fiber(f.tsan, kSwitchFlags);
#endif
#ifdef RNNKERN_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack.get(), kStackBytes);
#endif
  swapcontext(&s.context, &f.context);
#ifdef RNNKERN_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  s.running = nullptr;
}

RNNKERN_EMU_OWN void switch_to_scheduler(Scheduler& s, Fiber& f, bool exiting) {
#ifdef RNNKERN_EMU_TSAN
  __tsan_switch_to_fiber(s.tsan, kSwitchFlags);
#endif
#ifdef RNNKERN_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(exiting ? nullptr : &fake, s.stack_bottom, s.stack_size);
#endif
  swapcontext(&f.context, &s.context);
#ifdef RNNKERN_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, &s.stack_bottom, &s.stack_size);
#endif
  (void)exiting;
}

RNNKERN_EMU_OWN void fiber_entry() {
  Scheduler& s = sched();
  Fiber& f = *s.running;
#ifdef RNNKERN_EMU_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &s.stack_bottom, &s.stack_size);
#endif
#ifdef RNNKERN_EMU_TSAN
  __tsan_acquire(&s.launch_start);
#endif
  try {
    s.call(s.body);
  } catch (...) {
    if (!s.error) s.error = std::current_exception();
#ifdef RNNKERN_EMU_TSAN
    __tsan_release(&s.error);  // the exception, to the scheduler that rethrows it
#endif
  }
#ifdef RNNKERN_EMU_TSAN
  __tsan_release(&s.launch_end);
#endif
  f.state = State::Done;
  switch_to_scheduler(s, f, true);
  std::abort();  // a finished fiber is never resumed
}

std::string where(const char* file, int line) {
  return std::string(file ? file : "?") + ":" + std::to_string(line);
}

std::string dim_str(const dim3& d) {
  return "(" + std::to_string(d.x) + ", " + std::to_string(d.y) + ", " + std::to_string(d.z) + ")";
}

// ---- blocks running together (one, or a cooperative grid's all)

// Whether the thread that just yielded failed.  TSan: the scheduler's checks of
// the slot, made after every switch while no thread has failed, are not ordered
// before a failing thread's write -- ignored, as the switches tell TSan nothing;
// a failure is then acquired from the thread's release, exception object and all.
bool has_error(Scheduler& s) {
#ifdef RNNKERN_EMU_TSAN
  AnnotateIgnoreReadsBegin(__FILE__, __LINE__);
  const bool failed = static_cast<bool>(s.error);
  AnnotateIgnoreReadsEnd(__FILE__, __LINE__);
  if (failed) __tsan_acquire(&s.error);
  return failed;
#else
  return static_cast<bool>(s.error);
#endif
}

[[noreturn]] void divergent(const LaunchSite& site, const std::string& what) {
  throw std::runtime_error("emulated CUDA: divergent barrier in the launch at " +
                           where(site.file, site.line) + ": " + what);
}

std::string thread_str(const Fiber& f) {
  return "thread " + std::to_string(f.coords.linear_tid) + " of block " +
         dim_str(dim3(f.coords.block_idx));
}

std::string barrier_str(const Fiber& f) {
  return std::string(f.state == State::AtGridBarrier ? "grid.sync() " : "__syncthreads() ") +
         where(f.barrier_file, f.barrier_line) + " (#" +
         std::to_string(f.state == State::AtGridBarrier ? f.grid_barriers_passed
                                                        : f.barriers_passed) +
         ")";
}

bool same_barrier(const Fiber& a, const Fiber& b) {
  return a.state == b.state && a.barrier_file == b.barrier_file &&
         a.barrier_line == b.barrier_line && a.barriers_passed == b.barriers_passed &&
         a.grid_barriers_passed == b.grid_barriers_passed;
}

RNNKERN_EMU_OWN void run_blocks(Scheduler& s, const LaunchSite& site, uint64_t first_block,
                                int nblocks, int threads) {
  const int total = nblocks * threads;
  if (static_cast<int>(s.fibers.size()) < total) {
    const size_t old = s.fibers.size();
    s.fibers.resize(total);
    for (size_t i = old; i < s.fibers.size(); ++i) {
      s.fibers[i].stack.reset(new char[kStackBytes]);
#ifdef RNNKERN_EMU_TSAN
      s.fibers[i].tsan = __tsan_create_fiber(0);
#endif
    }
  }
  const dim3 bd = site.block, gd = site.grid;
  s.blocks.clear();
  s.blocks.resize(nblocks);
  for (int b = 0; b < nblocks; ++b) {
    const uint64_t lin = first_block + b;
    Block& blk = s.blocks[b];
    blk.idx = make_uint3(unsigned(lin % gd.x), unsigned((lin / gd.x) % gd.y),
                         unsigned(lin / (uint64_t(gd.x) * gd.y)));
    blk.dynamic_smem.reset(new unsigned char[site.dynamic_smem]);
    std::memset(blk.dynamic_smem.get(), 0xFF, site.dynamic_smem);
    blk.barrier_phase.reset(new char[2]);
  }
  for (int i = 0; i < total; ++i) {
    const int b = i / threads, t = i % threads;
    Fiber& f = s.fibers[i];
    f.coords.thread_idx = make_uint3(t % bd.x, (t / bd.x) % bd.y, t / (bd.x * bd.y));
    f.coords.block_idx = s.blocks[b].idx;
    f.coords.block_dim = bd;
    f.coords.grid_dim = gd;
    f.coords.linear_tid = t;
    f.block = b;
    f.state = State::Ready;
    f.barriers_passed = 0;
    f.grid_barriers_passed = 0;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.get();
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_entry, 0);
  }
  std::vector<int> order(total);
  std::vector<char> resume(total, 1);
  std::vector<int> released;  // blocks whose threads all wait at a block barrier
#ifdef RNNKERN_EMU_TSAN
  __tsan_release(&s.launch_start);  // after the scheduler set up the threads
  // However the blocks end (all threads done, or an error out of a fiber while
  // others wait at barriers), what their threads wrote happens before what the
  // host does next -- freeing the blocks' shared memory first: every finished
  // thread released launch_end, every waiting one its barrier's address.
  struct AcquireAtEnd {
    Scheduler& s;
    RNNKERN_EMU_OWN ~AcquireAtEnd() {
      __tsan_acquire(&s.launch_end);
      for (Block& b : s.blocks) __tsan_acquire(b.barrier_phase.get()), __tsan_acquire(b.barrier_phase.get() + 1);
      __tsan_acquire(s.grid_phase), __tsan_acquire(s.grid_phase + 1);
    }
  } acquire_at_end{s};
#endif
  for (;;) {
    for (int i = 0; i < total; ++i) order[i] = i;
    if (s.order == Order::Reverse) std::reverse(order.begin(), order.end());
    if (s.order == Order::Shuffle) std::shuffle(order.begin(), order.end(), s.rng);
    for (int i : order) {
      Fiber& f = s.fibers[i];
      if (f.state == State::Done || !resume[i]) continue;
      f.state = State::Ready;
      switch_to_fiber(s, f);
      if (has_error(s)) std::rethrow_exception(std::exchange(s.error, nullptr));
    }
    // Every live thread waits at a barrier now.  A block's barrier opens when all
    // its threads wait at the same __syncthreads(); the grid's when every thread of
    // the grid waits at the same grid.sync().
    int live = 0;
    bool block_released = false;
    released.clear();
    const Fiber* at_grid = nullptr;
    const Fiber* exited = nullptr;
    for (int b = 0; b < nblocks; ++b) {
      const Fiber* first = nullptr;
      const Fiber* done = nullptr;
      for (int t = 0; t < threads; ++t) {
        const Fiber& f = s.fibers[b * threads + t];
        if (f.state == State::Done) {
          if (!done) done = &f;
          continue;
        }
        ++live;
        if (!first) first = &f;
        else if (!same_barrier(*first, f))
          divergent(site, thread_str(*first) + " waits at " + barrier_str(*first) + " and " +
                              thread_str(f) + " at " + barrier_str(f));
      }
      if (!first) {
        if (!exited) exited = done;
        continue;
      }
      if (done)
        divergent(site, thread_str(*done) + " exited while " + thread_str(*first) +
                            " waits at " + barrier_str(*first));
      const bool at_block_barrier = first->state == State::AtBarrier;
      for (int t = 0; t < threads; ++t) resume[b * threads + t] = at_block_barrier;
      block_released |= at_block_barrier;
      if (at_block_barrier) released.push_back(b);
      if (!at_block_barrier) {
        if (!at_grid) at_grid = first;
        else if (!same_barrier(*at_grid, *first))
          divergent(site, thread_str(*at_grid) + " waits at " + barrier_str(*at_grid) + " and " +
                              thread_str(*first) + " at " + barrier_str(*first));
      }
    }
    if (live == 0) return;
    if (block_released) {
      // The grid barrier waits for those blocks.  Blocks of a cooperative grid need
      // not run in step: out of the forward order one released block runs on alone
      // (the last, or one at random) until its next grid barrier, so that a block
      // reading another's data without the grid barrier between sees it unwritten
      // (NaN) or stale, as hardware may show it -- block barriers alone would
      // otherwise keep the blocks in lockstep and hide the missing grid barrier.
      if (s.cooperative && s.order != Order::Forward && released.size() > 1) {
        const int keep = s.order == Order::Reverse
                             ? released.back()
                             : released[std::uniform_int_distribution<size_t>(
                                   0, released.size() - 1)(s.rng)];
        for (int b : released)
          if (b != keep) std::fill_n(resume.begin() + size_t(b) * threads, threads, char(0));
      }
      continue;
    }
    if (exited)
      divergent(site, thread_str(*exited) + " exited while " + thread_str(*at_grid) +
                          " waits at " + barrier_str(*at_grid) + ": every thread of the grid " +
                          "must reach it (on hardware the grid hangs)");
    std::fill(resume.begin(), resume.end(), 1);
  }
}

}  // namespace

RNNKERN_EMU_OWN const ThreadCoords& current() {
  Scheduler& s = sched();
  if (s.running == nullptr) throw std::logic_error("emulated CUDA: threadIdx read outside a kernel");
  return s.running->coords;
}

RNNKERN_EMU_OWN void syncthreads(const char* file, int line) {
  Scheduler& s = sched();
  Fiber& f = *s.running;
  f.state = State::AtBarrier;
  f.barrier_file = file;
  f.barrier_line = line;
#ifdef RNNKERN_EMU_TSAN
  __tsan_release(s.blocks[f.block].barrier_phase.get() + (f.barriers_passed & 1));
#endif
  switch_to_scheduler(s, f, false);
#ifdef RNNKERN_EMU_TSAN
  __tsan_acquire(s.blocks[f.block].barrier_phase.get() + (f.barriers_passed & 1));
#endif
  ++f.barriers_passed;
}

RNNKERN_EMU_OWN void grid_sync(const char* file, int line) {
  Scheduler& s = sched();
  if (s.running == nullptr) throw std::logic_error("emulated CUDA: grid.sync() outside a kernel");
  Fiber& f = *s.running;
  if (!s.cooperative)
    throw std::runtime_error("emulated CUDA: grid.sync() at " + where(file, line) +
                             " in a launch that is not cooperative (" + thread_str(f) +
                             "): launch it with RNNKERN_LAUNCH_COOPERATIVE");
  f.state = State::AtGridBarrier;
  f.barrier_file = file;
  f.barrier_line = line;
#ifdef RNNKERN_EMU_TSAN
  __tsan_release(s.grid_phase + (f.grid_barriers_passed & 1));
#endif
  switch_to_scheduler(s, f, false);
#ifdef RNNKERN_EMU_TSAN
  __tsan_acquire(s.grid_phase + (f.grid_barriers_passed & 1));
#endif
  ++f.grid_barriers_passed;
}

RNNKERN_EMU_OWN bool in_cooperative_launch() {
  Scheduler& s = sched();
  return s.running != nullptr && s.cooperative;
}

RNNKERN_EMU_OWN void* dynamic_shared() {
  Scheduler& s = sched();
  if (s.running == nullptr) throw std::logic_error("emulated CUDA: shared memory outside a kernel");
  return s.blocks[s.running->block].dynamic_smem.get();
}

RNNKERN_EMU_OWN int multiprocessors() { return sched().multiprocessors; }

RNNKERN_EMU_OWN void set_device_model(int sms, int registers_per_thread, int shared_per_block) {
  if (sms < 1 || registers_per_thread < 1 || registers_per_thread > 255 || shared_per_block < 1 ||
      size_t(shared_per_block) > kMaxDynamicSmem)
    throw std::invalid_argument("emulated CUDA: 1 or more multiprocessors, 1 to 255 registers, "
                                "1 to 232448 bytes of shared memory per block");
  sched().multiprocessors = sms;
  sched().registers_per_thread = registers_per_thread;
  sched().shared_per_block_optin = size_t(shared_per_block);
  // A new device model is a fresh context: the kernels' attributes (the dynamic
  // shared memory opted in to) are back at their defaults, so what one test
  // opted in to cannot make another's launch or occupancy query pass.
  sched().max_dynamic_smem.clear();
}

RNNKERN_EMU_OWN int shared_per_block_optin() { return int(sched().shared_per_block_optin); }

RNNKERN_EMU_OWN size_t dynamic_smem_limit(const void* kernel) {
  for (const auto& [k, bytes] : sched().max_dynamic_smem)
    if (k == kernel) return size_t(bytes);
  return kDefaultDynamicSmem;
}

RNNKERN_EMU_OWN cudaError_t func_set_attribute(const void* kernel, cudaFuncAttribute attr, int value) {
  Scheduler& s = sched();
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      size_t(value) > s.shared_per_block_optin)
    return s.last_error = cudaErrorInvalidValue;
  for (auto& [k, bytes] : s.max_dynamic_smem)
    if (k == kernel) return bytes = value, cudaSuccess;
  s.max_dynamic_smem.emplace_back(kernel, value);
  return cudaSuccess;
}

// sm_90's per-SM limits: threads, blocks, shared memory (1 KiB reserved per block),
// and the register file, allocated per warp in units of 256 registers.
RNNKERN_EMU_OWN int max_active_blocks(const void* kernel, int block_threads, size_t dynamic_smem) {
  Scheduler& s = sched();
  if (block_threads < 1 || block_threads > 1024 || dynamic_smem > dynamic_smem_limit(kernel))
    return 0;
  const int warps = (block_threads + 31) / 32;
  const int by_threads = kMaxThreadsPerSM / (warps * 32);
  const int by_smem = int(kSharedPerSM / (dynamic_smem + kSharedReservedPerBlock));
  const int warp_registers = (s.registers_per_thread * 32 + 255) / 256 * 256;
  const int by_registers = kRegistersPerSM / (warps * warp_registers);
  return std::min({kMaxBlocksPerSM, by_threads, by_smem, by_registers});
}

RNNKERN_EMU_OWN void set_order(Order order, unsigned seed) {
  sched().order = order;
  sched().rng.seed(seed);
}

RNNKERN_EMU_OWN int64_t launches() { return sched().launches; }
RNNKERN_EMU_OWN int64_t cooperative_launches() { return sched().cooperative_launches; }
RNNKERN_EMU_OWN int64_t gemm_multiply_adds() { return sched().gemm_multiply_adds; }
RNNKERN_EMU_OWN int64_t staged_rows() { return sched().staged_rows; }
RNNKERN_EMU_OWN void count_staged_rows(int n) {
  if (current().linear_tid == 0) sched().staged_rows += n;
}
RNNKERN_EMU_OWN int64_t prefetched_bytes() { return sched().prefetched_bytes; }
RNNKERN_EMU_OWN void count_prefetched(int64_t bytes) { sched().prefetched_bytes += bytes; }

[[noreturn]] RNNKERN_EMU_OWN void wmma_precondition_failed(const std::string& what) {
  const ThreadCoords& c = current();
  throw std::runtime_error("emulated CUDA: " + what + " (thread " + std::to_string(c.linear_tid) +
                           " of block " + dim_str(dim3(c.block_idx)) + ")");
}

RNNKERN_EMU_OWN void run_grid_erased(const LaunchSite& site, void (*call)(void*), void* body) {
  Scheduler& s = sched();
  if (s.running != nullptr) throw std::logic_error("emulated CUDA: a launch from inside a kernel");
  const dim3 g = site.grid, b = site.block;
  const uint64_t threads = uint64_t(b.x) * b.y * b.z;
  // The hardware's launch limits (sm_90): a launch outside them fails with
  // cudaErrorInvalidConfiguration and runs nothing.
  if (threads == 0 || threads > 1024 || b.z > 64 || g.x == 0 || g.y == 0 || g.z == 0 ||
      g.x > 2147483647u || g.y > 65535 || g.z > 65535 || site.dynamic_smem > kDefaultDynamicSmem) {
    s.last_error = cudaErrorInvalidConfiguration;
    return;
  }
  ++s.launches;
#ifdef RNNKERN_EMU_TSAN
  if (s.tsan == nullptr) s.tsan = __tsan_get_current_fiber();
#endif
  s.call = call;
  s.body = body;
  s.cooperative = false;
  const uint64_t blocks = uint64_t(g.x) * g.y * g.z;
  for (uint64_t lin = 0; lin < blocks; ++lin) run_blocks(s, site, lin, 1, int(threads));
  s.blocks.clear();
}

RNNKERN_EMU_OWN cudaError_t run_cooperative_grid_erased(const LaunchSite& site, const void* kernel,
                                                        void (*call)(void*), void* body) {
  Scheduler& s = sched();
  if (s.running != nullptr) throw std::logic_error("emulated CUDA: a launch from inside a kernel");
  const dim3 g = site.grid, b = site.block;
  const uint64_t threads = uint64_t(b.x) * b.y * b.z, blocks = uint64_t(g.x) * g.y * g.z;
  // cudaLaunchCooperativeKernel's checks: the launch limits, the kernel's dynamic
  // shared memory limit, then co-residency of the whole grid.
  if (threads == 0 || threads > 1024 || b.z > 64 || blocks == 0 || g.y > 65535 || g.z > 65535)
    return s.last_error = cudaErrorInvalidConfiguration;
  if (site.dynamic_smem > dynamic_smem_limit(kernel)) return s.last_error = cudaErrorInvalidValue;
  if (blocks > uint64_t(max_active_blocks(kernel, int(threads), site.dynamic_smem)) * s.multiprocessors)
    return s.last_error = cudaErrorCooperativeLaunchTooLarge;
  if (blocks * threads > kMaxCooperativeThreads)
    throw std::runtime_error("emulated CUDA: a cooperative launch of " + std::to_string(blocks) +
                             " x " + std::to_string(threads) + " threads at " +
                             where(site.file, site.line) + ": the emulator runs at most " +
                             std::to_string(kMaxCooperativeThreads) +
                             " at once (set_device_model: fewer multiprocessors)");
  ++s.launches;
  ++s.cooperative_launches;
#ifdef RNNKERN_EMU_TSAN
  if (s.tsan == nullptr) s.tsan = __tsan_get_current_fiber();
#endif
  s.call = call;
  s.body = body;
  s.cooperative = true;
  try {
    run_blocks(s, site, 0, int(blocks), int(threads));
  } catch (...) {
    s.cooperative = false;
    s.blocks.clear();
    throw;
  }
  s.cooperative = false;
  s.blocks.clear();
  return cudaSuccess;
}

}  // namespace rnnkern::emu

namespace nvcuda::wmma::detail {
RNNKERN_EMU_OWN int lane() { return rnnkern::emu::current().linear_tid % 32; }
}  // namespace nvcuda::wmma::detail

// ------------------------------------------------------- runtime calls ----

extern "C" RNNKERN_EMU_OWN cudaError_t rnnkern_emu_cudaGetLastError(void) {
  return std::exchange(rnnkern::emu::sched().last_error, cudaSuccess);
}

extern "C" RNNKERN_EMU_OWN cudaError_t rnnkern_emu_cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

extern "C" RNNKERN_EMU_OWN cudaError_t rnnkern_emu_cudaDeviceGetAttribute(int* value,
                                                                         cudaDeviceAttr attr,
                                                                         int device) {
  if (device != 0) return rnnkern::emu::sched().last_error = cudaErrorInvalidDevice;
  switch (attr) {
    case cudaDevAttrMultiProcessorCount: *value = rnnkern::emu::multiprocessors(); return cudaSuccess;
    case cudaDevAttrCooperativeLaunch: *value = 1; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = rnnkern::emu::shared_per_block_optin(); return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *value = RNNKERN_EMU_ARCH / 100; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = RNNKERN_EMU_ARCH / 10 % 10; return cudaSuccess;
    default: return rnnkern::emu::sched().last_error = cudaErrorInvalidValue;
  }
}

extern "C" const char* rnnkern_emu_cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error (emulated)";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument (emulated)";
    case cudaErrorInvalidValue: return "invalid argument (emulated)";
    case cudaErrorInvalidDevice: return "invalid device ordinal (emulated)";
    case cudaErrorCooperativeLaunchTooLarge:
      return "too many blocks in cooperative launch (emulated)";
    default: return "unknown error (emulated)";
  }
}

extern "C" cudaError_t rnnkern_emu_cudaMemset2DAsync(void* ptr, size_t pitch, int value,
                                                     size_t width, size_t height, cudaStream_t) {
  if (width > pitch && height > 1) return cudaErrorInvalidValue;
  if (height > 0 && width > 0 && ptr == nullptr) return cudaErrorInvalidValue;
  for (size_t r = 0; r < height; ++r) std::memset(static_cast<char*>(ptr) + r * pitch, value, width);
  return cudaSuccess;
}

// ------------------------------------------------------------- cuBLAS ----

namespace {

using rnnkern::emu::Order;

float tf32_round(float v) {
  // TF32 keeps 10 mantissa bits: round to nearest, ties away (as the hardware's cvt.rna).
  if (!std::isfinite(v)) return v;
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u = (u + 0x1000u) & 0xFFFFE000u;
  std::memcpy(&v, &u, 4);
  return v;
}

template <typename T>
double load(const void* p, int64_t i) {
  const T v = static_cast<const T*>(p)[i];
  if constexpr (std::is_same_v<T, __half>) return __half2float(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
  else return static_cast<double>(v);
}

double load_as(cudaDataType t, const void* p, int64_t i) {
  switch (t) {
    case CUDA_R_64F: return load<double>(p, i);
    case CUDA_R_32F: return load<float>(p, i);
    case CUDA_R_16F: return load<__half>(p, i);
    case CUDA_R_16BF: return load<__nv_bfloat16>(p, i);
    default: return NAN;
  }
}

void store_as(cudaDataType t, void* p, int64_t i, double v) {
  switch (t) {
    case CUDA_R_64F: static_cast<double*>(p)[i] = v; break;
    case CUDA_R_32F: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case CUDA_R_16F: static_cast<__half*>(p)[i] = __float2half_rn(static_cast<float>(v)); break;
    case CUDA_R_16BF:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(static_cast<float>(v));
      break;
    default: break;
  }
}

// The type combinations of cublasGemmEx the sources may use (cuBLAS's table,
// restricted to real types): A = B type, C type, compute type.
bool supported_types(cudaDataType ab, cudaDataType c, cublasComputeType_t compute) {
  if (ab == CUDA_R_64F) return c == CUDA_R_64F && compute == CUBLAS_COMPUTE_64F;
  if (ab == CUDA_R_32F)
    return c == CUDA_R_32F &&
           (compute == CUBLAS_COMPUTE_32F || compute == CUBLAS_COMPUTE_32F_FAST_TF32);
  if (ab == CUDA_R_16F || ab == CUDA_R_16BF)
    return (c == ab || c == CUDA_R_32F) && compute == CUBLAS_COMPUTE_32F;
  return false;
}

}  // namespace

// Column-major C[m, n] = alpha op(A)[m, k] op(B)[k, n] + beta C, checked as cuBLAS checks.
extern "C" cublasStatus_t rnnkern_emu_cublasGemmEx(
    cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n, int k,
    const void* alpha, const void* A, cudaDataType Atype, int lda, const void* B,
    cudaDataType Btype, int ldb, const void* beta, void* C, cudaDataType Ctype, int ldc,
    cublasComputeType_t compute, cublasGemmAlgo_t) {
  if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
  if ((transa != CUBLAS_OP_N && transa != CUBLAS_OP_T) ||
      (transb != CUBLAS_OP_N && transb != CUBLAS_OP_T) || m < 0 || n < 0 || k < 0 ||
      lda < std::max(1, ta ? k : m) || ldb < std::max(1, tb ? n : k) || ldc < std::max(1, m))
    return CUBLAS_STATUS_INVALID_VALUE;
  if (Atype != Btype || !supported_types(Atype, Ctype, compute)) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  rnnkern::emu::sched().gemm_multiply_adds += int64_t(m) * n * k;
  const bool f64 = compute == CUBLAS_COMPUTE_64F;
  const double al = f64 ? *static_cast<const double*>(alpha) : *static_cast<const float*>(alpha);
  const double be = f64 ? *static_cast<const double*>(beta) : *static_cast<const float*>(beta);
  const bool tf32 = compute == CUBLAS_COMPUTE_32F_FAST_TF32;
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      double s64 = 0;
      float s32 = 0.f;
      for (int l = 0; l < k; ++l) {
        double a = load_as(Atype, A, ta ? int64_t(i) * lda + l : int64_t(l) * lda + i);
        double b = load_as(Btype, B, tb ? int64_t(l) * ldb + j : int64_t(j) * ldb + l);
        if (f64) {
          s64 += a * b;
        } else {
          if (tf32) a = tf32_round(float(a)), b = tf32_round(float(b));
          s32 += float(a) * float(b);
        }
      }
      const double s = f64 ? s64 : double(s32);
      const int64_t ci = int64_t(j) * ldc + i;
      // beta == 0: C is not read (it may hold NaN), as cuBLAS guarantees.
      const double v = be == 0.0 ? al * s : al * s + be * load_as(Ctype, C, ci);
      store_as(Ctype, C, ci, f64 ? v : double(float(v)));
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

extern "C" const char* rnnkern_emu_cublasGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS (emulated)";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED (emulated)";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE (emulated)";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED (emulated)";
    default: return "cuBLAS error (emulated)";
  }
}
