// pool_stats: the statistics of one stream_pool, updated under its mutex; the active figures are
// derived from the allocated and pending counters.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>

#include "allocator/counter.hpp"
#include "core/block.hpp"
#include "cucache/stats.hpp"

namespace cucache::detail {

/// Per-pool statistics, updated under the pool's mutex.
///
/// Active figures (allocated plus pending) are not kept as counters of their own: a cache-hit pair
/// would update them exactly as it updates the allocated ones. They are derived from the allocated
/// and the pending counters instead, exactly:
/// - current = allocated + pending;
/// - allocated total = allocated's (both grow only when a block is carved);
/// - freed total from the same identity as `counter`, with base = both bases;
/// - peak: active only grows when a block is carved. While nothing is pending it equals allocated,
///   so allocated's peak covers it; `active_*_peak` records the value whenever a block is carved
///   while something is pending. Both are lower bounds of the true peak and one of them reaches
///   it, so the maximum of the two is exact.
struct pool_stats {
  counter_array allocated_bytes, requested_bytes, allocation_count;
  counter_array reserved_bytes, segment_count;
  counter_array pending_bytes, pending_count;  // freed blocks waiting for events
  std::array<std::int64_t, k_stat_pools> active_bytes_peak{}, active_count_peak{};
  std::uint64_t oversize_allocations = 0;
  std::uint64_t oversize_segments = 0;
  std::uint64_t take_backs = 0;  // defer_coalescing: allocations that took back the held block

  static std::size_t slot(pool_kind k) noexcept { return k == pool_kind::small ? 1 : 2; }

  /// A block of `bytes` was carved: allocated, and active.
  void on_allocate(pool_kind k, std::int64_t bytes, std::int64_t requested) noexcept {
    allocation_count.inc(k, 1);
    allocated_bytes.inc(k, bytes);
    requested_bytes.inc(k, requested);
    if (pending_count[0].current != 0) [[unlikely]] {
      for (std::size_t i : {std::size_t{0}, slot(k)}) {
        active_bytes_peak[i] =
            std::max(active_bytes_peak[i], allocated_bytes[i].current + pending_bytes[i].current);
        active_count_peak[i] =
            std::max(active_count_peak[i], allocation_count[i].current + pending_count[i].current);
      }
    }
  }
  /// A block was freed by its caller (it may still be active, pending).
  void on_free(pool_kind k, std::int64_t bytes, std::int64_t requested) noexcept {
    allocation_count.dec(k, 1);
    allocated_bytes.dec(k, bytes);
    requested_bytes.dec(k, requested);
  }

  [[nodiscard]] static stat active(const counter& alloc, const counter& pend,
                                   std::int64_t pending_peak) noexcept {
    const std::int64_t current = alloc.current + pend.current;
    return {current, std::max(alloc.peak, pending_peak), alloc.allocated,
            alloc.base + pend.base + alloc.allocated - current};
  }
  [[nodiscard]] stat active_bytes(std::size_t i) const noexcept {
    return active(allocated_bytes[i], pending_bytes[i], active_bytes_peak[i]);
  }
  [[nodiscard]] stat active_count(std::size_t i) const noexcept {
    return active(allocation_count[i], pending_count[i], active_count_peak[i]);
  }
  void reset_peaks() noexcept {
    for (auto* arr : {&allocated_bytes, &requested_bytes, &allocation_count, &reserved_bytes,
                      &segment_count, &pending_bytes, &pending_count}) {
      arr->reset_peak();
    }
    for (std::size_t i = 0; i < k_stat_pools; ++i) {
      active_bytes_peak[i] = active_bytes(i).current;
      active_count_peak[i] = active_count(i).current;
    }
  }
  void reset_totals() noexcept {
    for (auto* arr : {&allocated_bytes, &requested_bytes, &allocation_count, &reserved_bytes,
                      &segment_count, &pending_bytes, &pending_count}) {
      arr->reset_totals();
    }
    take_backs = 0;
  }
};

}  // namespace cucache::detail
