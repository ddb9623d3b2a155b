// Memory statistics of one device allocator, in PyTorch's vocabulary (current, peak, total
// allocated, total freed; all / small pool / large pool), plus what PyTorch lacks: the largest
// free block and two fragmentation rates.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace cucache {

/// One statistic: its current value, the highest it reached since the last peak reset, and the
/// sums of all increases and decreases since the last reset of totals.
struct stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;
  std::int64_t freed = 0;

  void add(std::int64_t delta) noexcept {
    current += delta;
    if (delta > 0) {
      allocated += delta;
      if (current > peak) peak = current;
    } else {
      freed -= delta;
    }
  }
  void reset_peak() noexcept { peak = current; }
  void reset_totals() noexcept { allocated = freed = 0; }
};

/// Index into the per-pool arrays of device_stats.
enum class stat_pool : std::uint8_t { all = 0, small = 1, large = 2 };
inline constexpr std::size_t k_stat_pools = 3;
using stat_array = std::array<stat, k_stat_pools>;

/// A consistent picture of one device allocator, taken under all its locks.
struct device_stats {
  // Bytes. allocated: blocks handed to callers (rounded sizes). reserved: device memory held
  // (segments). active: allocated plus freed blocks still waiting for other streams' events.
  // requested: the sizes callers asked for. inactive_split: free blocks that are parts of
  // segments still in use.
  stat_array allocated_bytes;
  stat_array reserved_bytes;
  stat_array active_bytes;
  stat_array requested_bytes;
  stat_array inactive_split_bytes;
  // Counts of the same things (segments for reserved).
  stat_array allocation_count;
  stat_array segment_count;
  stat_array active_count;
  stat_array inactive_split_count;

  std::uint64_t device_alloc_count = 0;  // segment_malloc (or physical handle) calls that succeeded
  std::uint64_t device_free_count = 0;   // segment_free (or handle release) calls
  std::uint64_t oom_count = 0;           // out_of_memory errors raised
  std::uint64_t alloc_retry_count = 0;   // times the allocator flushed its cache and retried
  std::uint64_t oversize_allocations = 0;  // allocations of blocks >= max_split_size (current)
  std::uint64_t oversize_segments = 0;     // segments >= max_split_size (current)
  std::uint64_t events_pending = 0;        // freed blocks waiting on events

  // Expandable segments: driver virtual-memory calls and pages moved instead of created.
  std::uint64_t vm_create_count = 0;   // cuMemCreate
  std::uint64_t vm_release_count = 0;  // cuMemRelease
  std::uint64_t vm_map_count = 0;      // cuMemMap (each followed by one cuMemSetAccess)
  std::uint64_t vm_unmap_count = 0;    // cuMemUnmap
  std::uint64_t stitched_pages =
      0;  // pages moved from idle free space to where a request needed them
  std::uint64_t shared_pages = 0;      // of those, pages taken from another stream's pool
  std::uint64_t vm_sync_count = 0;     // device synchronizations before unmapping idle pages
  std::uint64_t vm_split_count = 0;    // idle mappings released because a block used them in part
  std::uint64_t vm_reclaim_count = 0;  // times memory was short and idle memory was given back
  std::size_t mapped_bytes = 0;        // physical memory mapped into ranges
  std::size_t unmapped_handle_bytes = 0;  // physical memory held in unmapped handles (reusable)

  std::size_t free_bytes = 0;  // reserved - active: cached, reusable bytes
  std::size_t free_block_count = 0;
  std::size_t largest_free_block = 0;
  std::size_t memory_limit = 0;  // effective cap on reserved bytes; 0 = none
  std::size_t device_total_bytes = 0;

  /// External fragmentation: 1 - largest free block / total free bytes (0 when nothing is free).
  /// How much of the cached memory a single large request cannot use.
  [[nodiscard]] double external_fragmentation() const noexcept {
    return free_bytes == 0
               ? 0.0
               : 1.0 - static_cast<double>(largest_free_block) / static_cast<double>(free_bytes);
  }
  /// Overhead: 1 - allocated / reserved (0 when nothing is reserved). The share of device memory
  /// held by the allocator that no caller is using (cache, rounding, split remainders).
  [[nodiscard]] double overhead_fragmentation() const noexcept {
    const auto reserved = reserved_bytes[0].current;
    return reserved == 0 ? 0.0
                         : 1.0 - static_cast<double>(allocated_bytes[0].current) /
                                     static_cast<double>(reserved);
  }
};

}  // namespace cucache
