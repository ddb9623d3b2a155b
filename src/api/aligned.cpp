// Over-aligned allocations (cucache/aligned.hpp), which cucache::memory_resource (cuda::mr) is
// built on: a block over-allocated by alignment - 512 B, and a side record from the aligned
// pointer handed out to the start of its block.
#include <atomic>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "backend/thread_annotations.hpp"
#include "cucache/aligned.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/errors.hpp"

namespace cucache {

namespace {

// Which allocator handed the block out is part of the key: simulated devices reuse addresses.
using record_key = std::pair<const device_allocator*, std::uintptr_t>;

struct over_aligned_records {
  detail::mutex mu;
  std::map<record_key, void*> block_of
      GUARDED_BY(mu);  // aligned pointer handed out -> start of its block
  // Read without the lock by every deallocation, so that the common case (nothing over-aligned is
  // live) takes no lock.
  std::atomic<std::size_t> live{0};
};

// Leaked on purpose, as the global allocators are: frees may come from static destructors.
over_aligned_records& records() {
  static auto* r = new over_aligned_records;
  return *r;
}

constexpr bool is_power_of_two(std::size_t x) noexcept {
  return x != 0 && (x & (x - 1)) == 0;
}

}  // namespace

void* allocate_aligned(device_allocator& alloc, std::size_t bytes, std::size_t alignment,
                       stream_handle stream) {
  if (!is_power_of_two(alignment)) {
    throw invalid_argument("cucache: alignment " + std::to_string(alignment) +
                           " is not a power of two");
  }
  if (alignment <= k_block_alignment || bytes == 0) return alloc.allocate(bytes, stream);
  const std::size_t pad = alignment - k_block_alignment;
  if (bytes > std::numeric_limits<std::size_t>::max() - pad) {
    throw invalid_argument("cucache: " + std::to_string(bytes) + " bytes aligned to " +
                           std::to_string(alignment) + " overflow size_t");
  }
  void* block = alloc.allocate(bytes + pad, stream);
  const auto start = reinterpret_cast<std::uintptr_t>(block);
  const std::uintptr_t aligned = (start + alignment - 1) & ~(std::uintptr_t{alignment} - 1);
  if (aligned - start > pad) {  // a block not 512-B aligned: never, but never write past it
    alloc.deallocate(block);
    throw error("cucache: block " + std::to_string(start) + " is not " +
                std::to_string(k_block_alignment) + "-B aligned");
  }
  if (aligned == start) return block;  // aligned by chance: nothing to remember
  over_aligned_records& r = records();
  try {
    detail::lock_guard lock(r.mu);
    r.block_of.emplace(record_key{&alloc, aligned}, block);
    r.live.fetch_add(1, std::memory_order_release);
  } catch (...) {
    alloc.deallocate(block);
    throw;
  }
  return reinterpret_cast<void*>(aligned);
}

void deallocate_aligned(device_allocator& alloc, void* ptr, stream_handle stream, bool ordered) {
  if (ptr == nullptr) return;
  over_aligned_records& r = records();
  void* block = ptr;
  bool recorded = false;
  const record_key key{&alloc, reinterpret_cast<std::uintptr_t>(ptr)};
  if (r.live.load(std::memory_order_acquire) != 0) {
    // Taken out before the free: once the block is free another thread may get it back at once,
    // and with it the same aligned pointer and a new record.
    detail::lock_guard lock(r.mu);
    if (auto it = r.block_of.find(key); it != r.block_of.end()) {
      block = it->second;
      r.block_of.erase(it);
      r.live.fetch_sub(1, std::memory_order_relaxed);
      recorded = true;
    }
  }
  try {
    if (ordered) {
      alloc.deallocate(block, stream);
    } else {
      alloc.deallocate(block);
    }
  } catch (...) {
    if (recorded) {  // nothing was freed: the record stands
      detail::lock_guard lock(r.mu);
      r.block_of.emplace(key, block);
      r.live.fetch_add(1, std::memory_order_relaxed);
    }
    throw;
  }
}

}  // namespace cucache
