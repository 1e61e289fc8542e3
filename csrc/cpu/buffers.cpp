#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include "buffers.h"

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <torch/library.h>
#include <sys/mman.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace rnnkern::cpu {
namespace {

constexpr size_t kMinPooledBytes = size_t(1) << 20;  // below this, malloc reuses memory itself
constexpr size_t kGranule = size_t(2) << 20;         // sizes are rounded up to 2 MiB

size_t cache_limit_bytes() {
  const char* env = std::getenv("RNNKERN_CPU_CACHE_MB");
  const long long mb = env ? std::atoll(env) : 1024;
  return mb > 0 ? size_t(mb) << 20 : 0;
}

// Blocks are mapped from the system directly rather than through malloc, so
// that a freed block leaves the process: glibc keeps freed blocks below its
// (self-raising, up to 32 MiB) mmap threshold in its heap, where the cache's
// evictions and empty_cpu_cache() did not lower the resident memory at all.
void* map_block(size_t size) {
  void* ptr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(ptr != MAP_FAILED, "rnnkern: out of CPU memory: could not map ", size >> 20,
              " MiB (", std::strerror(errno), ")");
  return ptr;
}

void unmap_block(void* ptr, size_t size) { munmap(ptr, size); }

class PoolAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    const size_t size = (nbytes + kGranule - 1) / kGranule * kGranule;
    Block block = take(size);
    if (block.ptr == nullptr) block = {map_block(size), size};
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_.emplace(block.ptr, block.size);
    }
    // The context is the data pointer itself (the block's size is looked up
    // in live_): torch can then make copy-on-write aliases of these tensors
    // (torch._lazy_clone, used by the autograd formulas in rnnkern/ops.py),
    // which it refuses for a DataPtr with any other context.
    return {block.ptr, block.ptr, &PoolAllocator::give_back, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  int64_t release_all() {
    std::lock_guard<std::mutex> lock(mu_);
    int64_t released = 0;
    for (const Cached& c : recent_) {
      unmap_block(c.ptr, c.size);
      released += static_cast<int64_t>(c.size);
    }
    recent_.clear();
    by_size_.clear();
    cached_ = 0;
    return released;
  }

  static PoolAllocator& get() {
    static PoolAllocator* pool = new PoolAllocator();  // never destroyed: tensors may outlive exit hooks
    return *pool;
  }

 private:
  struct Block {
    void* ptr;
    size_t size;
  };

  // A cached block for a request of `size` bytes, with its own size (which
  // it keeps: it goes back to the cache whole), or {nullptr, 0}.
  Block take(size_t size) {
    std::lock_guard<std::mutex> lock(mu_);
    // Exact size first, else the smallest block at most 25% larger: a large
    // block does not serve ever smaller requests, which would leave it
    // mostly idle while smaller blocks were mapped beside it.
    auto it = by_size_.lower_bound(size);
    if (it == by_size_.end() || it->first > size + size / 4) return {nullptr, 0};
    const Block block{it->second->ptr, it->first};
    cached_ -= block.size;
    recent_.erase(it->second);
    by_size_.erase(it);
    return block;
  }

  static void give_back(void* ptr) {
    PoolAllocator& pool = get();
    size_t size;
    {
      std::lock_guard<std::mutex> lock(pool.mu_);
      auto it = pool.live_.find(ptr);
      TORCH_INTERNAL_ASSERT(it != pool.live_.end(), "rnnkern: freeing a block it did not allocate");
      size = it->second;
      pool.live_.erase(it);
    }
    pool.keep_or_free(ptr, size);
  }

  // Keeps the block, first freeing the least recently returned ones when the
  // cache would outgrow its limit: the blocks in use change with the sizes a
  // program runs (a benchmark grid, evaluation after training), and stale
  // ones must not crowd out the current working set.
  void keep_or_free(void* ptr, size_t size) {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (size <= limit_) {
        while (cached_ + size > limit_) {
          const Cached& old = recent_.back();
          evicted.push_back({old.ptr, old.size});
          cached_ -= old.size;
          by_size_.erase(old.by_size);
          recent_.pop_back();
        }
        recent_.push_front(Cached{ptr, size, {}});
        recent_.front().by_size = by_size_.emplace(size, recent_.begin());
        cached_ += size;
        ptr = nullptr;
      }
    }
    for (const Block& b : evicted) unmap_block(b.ptr, b.size);
    if (ptr != nullptr) unmap_block(ptr, size);
  }

  struct Cached;
  using BySize = std::multimap<size_t, std::list<Cached>::iterator>;
  struct Cached {
    void* ptr;
    size_t size;
    BySize::iterator by_size;
  };

  std::mutex mu_;
  std::unordered_map<void*, size_t> live_;  // blocks in use -> their mapped size
  std::list<Cached> recent_;  // most recently returned first
  BySize by_size_;
  size_t cached_ = 0;
  const size_t limit_ = cache_limit_bytes();
};

}  // namespace

at::Tensor pooled_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const int64_t numel = c10::multiply_integers(sizes);
  const size_t nbytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  if (nbytes < kMinPooledBytes || cache_limit_bytes() == 0) return at::empty(sizes, options);
  at::Tensor t = at::detail::empty_generic(sizes, &PoolAllocator::get(),
                                           c10::DispatchKeySet(c10::DispatchKey::CPU),
                                           options.dtype().toScalarType(), std::nullopt);
  // at::empty's poisoning for tests (torch.utils.deterministic.fill_uninitialized_memory).
  auto& ctx = at::globalContext();
  if (ctx.deterministicAlgorithms() && ctx.deterministicFillUninitializedMemory() &&
      t.is_floating_point()) {
    t.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  return t;
}

at::Tensor pooled_to(const at::Tensor& t, at::ScalarType dtype) {
  if (t.scalar_type() == dtype) return t;
  return pooled_empty(t.sizes(), t.options().dtype(dtype)).copy_(t);
}

int64_t empty_cache() { return PoolAllocator::get().release_all(); }

at::Tensor grid_zeros_cpu(const at::Tensor& like, at::IntArrayRef size) {
  for (const int64_t n : size) TORCH_CHECK(n >= 0, "grid_zeros: size must be non-negative, got ", size);
  return pooled_empty(size, like.options()).zero_();
}

namespace {

// The permutation back from `order` (checked: each of x's dimensions once).
std::vector<int64_t> inverse_order(const at::Tensor& x, at::IntArrayRef order) {
  const int64_t n = x.dim();
  TORCH_CHECK(static_cast<int64_t>(order.size()) == n, "relayout: order must list each of x's ", n,
              " dimensions once, got ", order);
  std::vector<int64_t> inverse(n, -1);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t d = order[i];
    TORCH_CHECK(d >= 0 && d < n && inverse[d] < 0, "relayout: order must list each of x's ", n,
                " dimensions once, got ", order);
    inverse[d] = i;
  }
  return inverse;
}

}  // namespace

at::Tensor relayout_cpu(const at::Tensor& x, at::IntArrayRef order) {
  const std::vector<int64_t> inverse = inverse_order(x, order);
  std::vector<int64_t> sizes;
  for (const int64_t d : order) sizes.push_back(x.size(d));
  return pooled_empty(sizes, x.options()).permute(inverse).copy_(x);
}

}  // namespace rnnkern::cpu

TORCH_LIBRARY_IMPL(rnnkern, CPU, m) {
  m.impl("grid_zeros", &rnnkern::cpu::grid_zeros_cpu);
  m.impl("relayout", &rnnkern::cpu::relayout_cpu);
}
