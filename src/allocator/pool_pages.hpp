// pool_pages: the pager's state for one stream_pool in expandable mode -- its virtual ranges,
// its idle list and its storage. One member of the pool (stream_pool::pages), under the pool's
// mutex; only the pager and the allocator's placement of blocks in the ranges touch it.
#pragma once

#include <atomic>
#include <cstddef>
#include <vector>

#include "allocator/object_arena.hpp"
#include "core/block.hpp"
#include "core/vm_range.hpp"

namespace cucache::detail {

/// A byte count written by one thread at a time (under its pool's mutex) and read by others
/// without that mutex: relaxed loads and stores, plain moves on x86 -- no read-modify-write of a
/// line that other pools' threads write (a device-wide atomic sum did that on every expandable
/// cache hit).
class owned_bytes {
 public:
  owned_bytes& operator+=(std::size_t n) noexcept {
    v_.store(v_.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
    return *this;
  }
  owned_bytes& operator-=(std::size_t n) noexcept {
    v_.store(v_.load(std::memory_order_relaxed) - n, std::memory_order_relaxed);
    return *this;
  }
  operator std::size_t() const noexcept { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<std::size_t> v_{0};
};

struct pool_pages {
  /// The pool's virtual ranges, both kinds, oldest first: each the segment that owns its vm_range,
  /// also linked in the pool's segment list. A range is added when no free block of the pool's
  /// ranges of its kind holds a request (pager::next_range_bytes sizes it) and given back when it
  /// is empty (impl::retire_empty_ranges).
  std::vector<segment*> ranges;
  /// The address space those ranges span, per pool kind.
  std::size_t range_bytes[2] = {0, 0};
  /// The idle runs of this pool's ranges, most recently idle first: the order in which their
  /// pages went idle (within a run, lower pages first), kept when a carve splits a run.
  idle_run* idle_head = nullptr;
  idle_run* idle_tail = nullptr;  // least recently idle
  /// Bytes of the pages of the idle runs and the parked span. Written under the pool's mutex;
  /// read without it by idle_bytes_of_every_pool (reserve, max_allocatable).
  owned_bytes idle_bytes;
  /// The range holding the pool's parked span (vm_range::parked_first), or nullptr: the most
  /// recently idle pages, not linked in the idle list until something else needs the list.
  vm_range* parked = nullptr;
  [[nodiscard]] bool has_idle() const noexcept { return idle_head != nullptr || parked != nullptr; }
  object_arena<idle_run> runs;    // storage of this pool's idle runs
};

}  // namespace cucache::detail
