// The per-stream state of a device allocator: its segments, its two free indices (small and
// large pool), its freed-but-pending blocks and its statistics, all under one mutex. A block is
// reused only on its own stream, so pools never share blocks and threads on different streams
// never contend here.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "allocator/pool_mutex.hpp"
#include "cucache/backend.hpp"
#include "cucache/detail/block.hpp"
#include "cucache/detail/free_index.hpp"
#include "cucache/detail/vm_range.hpp"
#include "cucache/stats.hpp"

namespace cucache::detail {

/// Recycles objects of one type without touching the heap in steady state. Not thread-safe:
/// each stream_pool owns one, used under the pool's mutex.
template <class T>
class object_arena {
 public:
  T* make() {
    if (free_ == nullptr) refill();
    T* t = free_;
    free_ = *reinterpret_cast<T**>(t);
    return new (t) T{};
  }
  void recycle(T* t) noexcept {
    t->~T();
    *reinterpret_cast<T**>(t) = free_;
    free_ = t;
  }

 private:
  static constexpr std::size_t k_chunk = 256;
  void refill() {
    auto& chunk = chunks_.emplace_back(std::make_unique<storage[]>(k_chunk));
    for (std::size_t i = 0; i < k_chunk; ++i) {
      T* t = reinterpret_cast<T*>(&chunk[i]);
      *reinterpret_cast<T**>(t) = free_;
      free_ = t;
    }
  }
  struct storage {
    alignas(T) unsigned char bytes[sizeof(T)];
  };
  std::vector<std::unique_ptr<storage[]>> chunks_;
  T* free_ = nullptr;
};

/// A freed block waiting for one event.
struct pending_free {
  block* b;
  event_handle event;
};

/// Per-pool statistics, updated under the pool's mutex.
struct pool_stats {
  stat_array allocated_bytes, reserved_bytes, active_bytes, requested_bytes;
  stat_array allocation_count, segment_count, active_count;
  std::uint64_t oversize_allocations = 0;
  std::uint64_t oversize_segments = 0;

  static std::size_t slot(pool_kind k) noexcept { return k == pool_kind::small ? 1 : 2; }
  static void add(stat_array& s, pool_kind k, std::int64_t delta) noexcept {
    s[0].add(delta);
    s[slot(k)].add(delta);
  }
};

class stream_pool {
 public:
  stream_pool(stream_handle s, std::size_t idx) : stream(s), index(idx) {}

  const stream_handle stream;
  const std::size_t index;  // creation order; pools are always locked in this order
  alignas(64) pool_mutex mu;
  free_index free[2];                // [pool_kind]
  segment* segments = nullptr;       // doubly linked, newest first
  std::vector<pending_free> pending;  // freed blocks waiting on events
  pool_stats stats;
  std::uint64_t tick = 0;            // free order, for garbage collection
  object_arena<block> blocks;
  object_arena<segment> segs;

  // Expandable segments: one range per pool kind, created on first use.
  segment* ranges[2] = {nullptr, nullptr};
  vm_mapping* idle_head = nullptr;  // mappings no block touches, most recently idle first
  std::size_t idle_bytes = 0;
  object_arena<vm_mapping> maps;

  free_index& index_of(pool_kind k) noexcept { return free[static_cast<int>(k)]; }
};

}  // namespace cucache::detail
