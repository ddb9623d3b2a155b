// Memory statistics of one device allocator, in PyTorch's vocabulary (current, peak, total
// allocated, total freed; all / small pool / large pool), plus what PyTorch lacks: the largest
// request the cache can serve and two fragmentation rates; and the table of their fields.
#pragma once

#if (defined(_MSVC_LANG) ? _MSVC_LANG : __cplusplus) < 201709L
#error \
    "cucache/stats.hpp requires C++20: compile with -std=c++20 (CMake: link cucache::cucache, which asks for cxx_std_20; a .cu file needs CUDA_STANDARD 20). C++17 and older take cucache.h, thrust.hpp and memory_resource.hpp only (docs/api.md)."
#endif

#include <array>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <string_view>

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

/// A consistent picture of one device allocator, taken under all its locks. Every field is listed,
/// once, in the field table below (CUCACHE_STAT_*_FIELDS), from which the other shapes of these
/// figures are produced or checked.
struct device_stats {
  // Bytes. allocated: blocks handed to callers (rounded sizes). reserved: device memory held
  // (segments; in expandable mode every physical handle, mapped or not). active: allocated plus
  // freed blocks still waiting for other streams' events. requested: the sizes callers asked for.
  // inactive_split: free blocks that are parts of segments still in use (default mode only).
  stat_array allocated_bytes;
  stat_array reserved_bytes;
  stat_array active_bytes;
  stat_array requested_bytes;
  stat_array inactive_split_bytes;
  // Counts of the same things. segment_count: cudaMalloc'd segments; in expandable mode the
  // reserved virtual ranges (one per stream and pool kind) that have physical memory mapped --
  // what PyTorch calls an expandable segment -- not the mappings inside them.
  stat_array allocation_count;
  stat_array segment_count;
  stat_array active_count;
  stat_array inactive_split_count;

  // Physical device memory: allocations and releases that succeeded. Default mode: cudaMalloc and
  // cudaFree of segments. Expandable mode: cuMemCreate and cuMemRelease of physical handles (the
  // handles' mappings are counted by vm_map_count / vm_unmap_count).
  std::uint64_t device_alloc_count = 0;
  std::uint64_t device_free_count = 0;
  std::uint64_t oom_count = 0;             // out_of_memory errors raised
  std::uint64_t alloc_retry_count = 0;     // times the allocator flushed its cache and retried
  std::uint64_t oversize_allocations = 0;  // allocations of blocks >= max_split_size (current)
  std::uint64_t oversize_segments = 0;     // segments >= max_split_size (current)
  std::uint64_t events_pending = 0;        // freed blocks waiting on events
  // defer_coalescing:True: allocations that took back the block their stream's pool had freed
  // last, held unmerged, instead of carving best fit's block (the same block: docs/config.md).
  std::uint64_t take_back_count = 0;

  // Expandable segments: what the pager did. Its cuMemCreate and cuMemRelease calls are
  // device_alloc_count and device_free_count above.
  std::uint64_t vm_map_count = 0;    // cuMemMap (each followed by one cuMemSetAccess)
  std::uint64_t vm_unmap_count = 0;  // cuMemUnmap
  std::uint64_t stitched_pages = 0;  // pages moved from idle free space to where a request needed
  std::uint64_t shared_pages = 0;    // of those, pages taken from another stream's pool
  std::uint64_t vm_sync_count = 0;   // device synchronizations before unmapping idle pages
  std::uint64_t vm_split_count = 0;  // idle mappings released because a block used them in part
  std::uint64_t vm_reclaim_count = 0;  // times memory was short and idle memory was given back
  // Host time (steady clock, nanoseconds) spent inside the pager's driver calls: vm_host_ns in
  // cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap and cuMemRelease; sync_host_ns in the
  // device synchronizations counted by vm_sync_count. Reset with the accumulated stats.
  std::uint64_t vm_host_ns = 0;
  std::uint64_t sync_host_ns = 0;
  std::size_t mapped_bytes = 0;           // physical memory mapped into ranges
  std::size_t unmapped_handle_bytes = 0;  // physical memory held in unmapped handles (reusable)

  // Cached memory (docs/design.md, "Free memory"). free_bytes: reserved - active, the bytes held
  // and not in use. free_block_count: the free blocks of the pools' free indices (in expandable
  // mode, free spans of virtual ranges). largest_free_block: the largest request the allocator
  // serves from cached memory alone -- no device allocation (cudaMalloc, cuMemCreate) -- on the
  // stream of the pool that holds it: a request of that many bytes on that stream is served so.
  // 0 when no request is.
  std::size_t free_bytes = 0;
  std::size_t free_block_count = 0;
  std::size_t largest_free_block = 0;
  std::size_t memory_limit = 0;  // effective cap on reserved bytes; 0 = none
  std::size_t device_total_bytes = 0;
  // Sleep and wake (docs/api.md): sleeping_bytes, the device bytes of the pages that sleeping
  // tags' live blocks touch (released; wake maps them again); sleeping_host_bytes, the pinned
  // host bytes holding their contents (keep_contents).
  std::size_t sleeping_bytes = 0;
  std::size_t sleeping_host_bytes = 0;

  /// External fragmentation: 1 - largest free block / free bytes (0 when nothing is free).
  /// How much of the cached memory a single large request cannot use.
  [[nodiscard]] double external_fragmentation() const noexcept {
    return free_bytes == 0
               ? 0.0
               : 1.0 - static_cast<double>(largest_free_block) / static_cast<double>(free_bytes);
  }
  /// Overhead: the share of device memory held by the allocator (reserved) that no caller's block
  /// is using -- cached free memory, split remainders, and freed blocks still waiting for other
  /// streams' events: (free_bytes + active - allocated) / reserved, 0 when nothing is reserved.
  /// While no tag sleeps this is 1 - allocated / reserved. A sleeping tag's blocks stay allocated
  /// (and active) while no reserved memory backs them: they count on neither side, so the rate
  /// stays in [0, 1] and describes the memory that is held (issue 30).
  [[nodiscard]] double overhead_fragmentation() const noexcept {
    const auto reserved = reserved_bytes[0].current;
    if (reserved <= 0) return 0.0;
    const double waiting =
        static_cast<double>(active_bytes[0].current - allocated_bytes[0].current);
    return (static_cast<double>(free_bytes) + waiting) / static_cast<double>(reserved);
  }
};

// --- The field table --------------------------------------------------------------------------
//
// The one list of device_stats' fields, in the order every flat copy lays them out. Produced from
// it: the fill of the plug-in struct cucache_torch_stats (src/integrations/torch, whose layout is
// checked against it by static_asserts and exported as cucache_torch_stats_layout() for the
// Python module to check its ctypes copy), the fill of the C struct cucacheStats
// (src/api/c_api.cpp, a documented subset, also checked by static_asserts), stats_json (the
// snapshot's and the replay's JSON) and k_stat_fields / for_each_stat below. A member added to
// device_stats but not here fails the static_assert below; one added here fails to compile in the
// plug-in until cucache_torch_stats carries it in the same place.
//
// X(member, torch_name, unit): member of device_stats; torch_name: its name in PyTorch's
// memory_stats() vocabulary, used by the plug-in struct and the Python module's keys; unit: bytes,
// count or ns (host nanoseconds).

/// Per-pool statistics (stat_array: all, small pool, large pool).
#define CUCACHE_STAT_ARRAY_FIELDS(X)                   \
  X(allocated_bytes, allocated_bytes, bytes)           \
  X(reserved_bytes, reserved_bytes, bytes)             \
  X(active_bytes, active_bytes, bytes)                 \
  X(requested_bytes, requested_bytes, bytes)           \
  X(inactive_split_bytes, inactive_split_bytes, bytes) \
  X(allocation_count, allocation, count)               \
  X(segment_count, segment, count)                     \
  X(active_count, active, count)                       \
  X(inactive_split_count, inactive_split, count)

/// Scalars, read as std::uint64_t. The fourth column says how a monotonic scraper reads it:
/// counter (only grows, between resets of the accumulated stats: Prometheus' counter, exported
/// with a _total suffix) or gauge (goes up and down).
#define CUCACHE_STAT_COUNTER_FIELDS(X)                                \
  X(device_alloc_count, num_device_alloc, count, counter)       \
  X(device_free_count, num_device_free, count, counter)         \
  X(oom_count, num_ooms, count, counter)                        \
  X(alloc_retry_count, num_alloc_retries, count, counter)       \
  X(oversize_allocations, oversize_allocations, count, gauge)   \
  X(oversize_segments, oversize_segments, count, gauge)         \
  X(events_pending, events_pending, count, gauge)               \
  X(take_back_count, take_back_count, count, counter)           \
  X(vm_map_count, vm_map_count, count, counter)                 \
  X(vm_unmap_count, vm_unmap_count, count, counter)             \
  X(stitched_pages, stitched_pages, count, counter)             \
  X(shared_pages, shared_pages, count, counter)                 \
  X(vm_sync_count, vm_sync_count, count, counter)               \
  X(vm_split_count, vm_split_count, count, counter)             \
  X(vm_reclaim_count, vm_reclaim_count, count, counter)         \
  X(vm_host_ns, vm_host_ns, ns, counter)                        \
  X(sync_host_ns, sync_host_ns, ns, counter)                    \
  X(mapped_bytes, mapped_bytes, bytes, gauge)                   \
  X(unmapped_handle_bytes, unmapped_handle_bytes, bytes, gauge) \
  X(free_bytes, free_bytes, bytes, gauge)                       \
  X(free_block_count, free_block_count, count, gauge)           \
  X(largest_free_block, largest_free_block, bytes, gauge)       \
  X(memory_limit, memory_limit, bytes, gauge)                   \
  X(device_total_bytes, device_total_bytes, bytes, gauge)       \
  X(sleeping_bytes, sleeping_bytes, bytes, gauge)               \
  X(sleeping_host_bytes, sleeping_host_bytes, bytes, gauge)

/// Rates in [0, 1], computed by a member function: X(function, torch_name).
#define CUCACHE_STAT_RATE_FIELDS(X)                 \
  X(external_fragmentation, fragmentation_external) \
  X(overhead_fragmentation, fragmentation_overhead)

enum class stat_shape : std::uint8_t { per_pool, counter, rate };
enum class stat_unit : std::uint8_t { bytes, count, ns, ratio };
/// How a scraper reads a value: counter (monotonic between resets of the accumulated stats) or
/// gauge. A per-pool field's current and peak are gauges, its allocated and freed sums counters.
enum class stat_kind : std::uint8_t { gauge, counter };

/// One entry of the field table.
struct stat_field {
  std::string_view name;        // the device_stats member (or function, for rates)
  std::string_view torch_name;  // PyTorch's name: the plug-in struct's field, the Python key
  stat_shape shape;
  stat_unit unit;
  stat_kind kind;  // counter fields only: gauge for per-pool fields (see stat_kind) and rates
};

/// Key of each stat_array slot in PyTorch's vocabulary ("allocated_bytes.large_pool.peak").
inline constexpr std::array<std::string_view, k_stat_pools> k_stat_pool_names = {
    "all", "small_pool", "large_pool"};

/// The field table, in order.
// clang-format off
inline constexpr stat_field k_stat_fields[] = {
#define CUCACHE_STAT_ENTRY_(member, torch, unit) \
  {#member, #torch, stat_shape::per_pool, stat_unit::unit, stat_kind::gauge},
  CUCACHE_STAT_ARRAY_FIELDS(CUCACHE_STAT_ENTRY_)
#undef CUCACHE_STAT_ENTRY_
#define CUCACHE_STAT_ENTRY_(member, torch, unit, kind) \
  {#member, #torch, stat_shape::counter, stat_unit::unit, stat_kind::kind},
  CUCACHE_STAT_COUNTER_FIELDS(CUCACHE_STAT_ENTRY_)
#undef CUCACHE_STAT_ENTRY_
#define CUCACHE_STAT_ENTRY_(fn, torch) \
  {#fn, #torch, stat_shape::rate, stat_unit::ratio, stat_kind::gauge},
  CUCACHE_STAT_RATE_FIELDS(CUCACHE_STAT_ENTRY_)
#undef CUCACHE_STAT_ENTRY_
};
// clang-format on

// Every data member of device_stats is in the table (their sizes add up to the struct's; each
// scalar is 8 bytes, so there is no padding to hide one).
#define CUCACHE_STAT_SIZE_(member, ...) +sizeof(device_stats::member)
static_assert(sizeof(device_stats) == 0 CUCACHE_STAT_ARRAY_FIELDS(CUCACHE_STAT_SIZE_)
                                          CUCACHE_STAT_COUNTER_FIELDS(CUCACHE_STAT_SIZE_),
              "a member of device_stats is missing from the field table (CUCACHE_STAT_*_FIELDS)");
#undef CUCACHE_STAT_SIZE_
#define CUCACHE_STAT_SCALAR_(member, ...) \
  static_assert(sizeof(device_stats::member) == sizeof(std::uint64_t), #member);
CUCACHE_STAT_COUNTER_FIELDS(CUCACHE_STAT_SCALAR_)
#undef CUCACHE_STAT_SCALAR_

inline constexpr std::size_t k_stat_field_count = std::size(k_stat_fields);

/// Calls f(field, value) for every entry of k_stat_fields, in order: value is a const stat_array&
/// for per-pool fields, a std::uint64_t for counters and a double for rates.
template <class F>
void for_each_stat(const device_stats& s, F&& f) {
  std::size_t i = 0;
#define CUCACHE_STAT_VISIT_(member, torch, unit) f(k_stat_fields[i++], s.member);
  CUCACHE_STAT_ARRAY_FIELDS(CUCACHE_STAT_VISIT_)
#undef CUCACHE_STAT_VISIT_
#define CUCACHE_STAT_VISIT_(member, torch, unit, kind) \
  f(k_stat_fields[i++], static_cast<std::uint64_t>(s.member));
  CUCACHE_STAT_COUNTER_FIELDS(CUCACHE_STAT_VISIT_)
#undef CUCACHE_STAT_VISIT_
#define CUCACHE_STAT_VISIT_(fn, torch) f(k_stat_fields[i++], s.fn());
  CUCACHE_STAT_RATE_FIELDS(CUCACHE_STAT_VISIT_)
#undef CUCACHE_STAT_VISIT_
}

/// The relations between the fields of a device_stats that every read of an allocator's
/// statistics satisfies (device_allocator::stats() is one consistent view: docs/design.md,
/// "Statistics under concurrent readers"), `expandable_segments` saying which mode it was taken
/// in. Returns the first relation violated -- its name, then the values that break it -- or an
/// empty string when all hold. The relations, for every stat_array field and slot where it
/// applies (slots: all, small_pool, large_pool):
///   nonnegative          current, peak, allocated and freed are >= 0
///   peak_covers_current  peak >= current
///   all_is_the_sum       all == small_pool + large_pool (current); for reserved_bytes, all ==
///                        small_pool + large_pool + unmapped_handle_bytes (the pools' shares are
///                        the memory in their segments or mapped into their ranges)
///   requested_within_allocated   requested_bytes <= allocated_bytes
///   allocated_within_active      allocated_bytes <= active_bytes, allocation_count <=
///                                active_count
///   active_within_reserved       active_bytes <= reserved_bytes + sleeping_bytes (a sleeping
///                                tag's blocks stay active with nothing reserved behind them)
///   free_is_reserved_minus_active  free_bytes == reserved - active (default mode); expandable
///                                mode: reserved - active <= free_bytes <= reserved - active +
///                                sleeping_bytes (only awake blocks use reserved memory)
///   largest_within_free          largest_free_block <= free_bytes
///   largest_needs_a_free_block   largest_free_block > 0 implies free_block_count > 0
///   free_blocks_hold_free_bytes  (default mode) free_block_count == 0 iff free_bytes == 0
///   inactive_split_within_free   inactive_split_bytes <= free_bytes, inactive_split_count <=
///                                free_block_count
///   segments_hold_reserved       segment_count == 0 iff the pools' reserved share is 0
///   oversize_within_counts       oversize_allocations <= allocation_count, oversize_segments
///                                <= segment_count
///   pending_needs_active         events_pending > 0 implies active_count > allocation_count
///   pages_within_reserved        mapped_bytes + unmapped_handle_bytes <= reserved, mapped_bytes
///                                <= the pools' reserved share; default mode: both 0, nothing
///                                sleeping
///   within_limit                 reserved <= device_total_bytes when known (not reserved <=
///                                memory_limit: the limit may be lowered under it at run time)
///   rates_in_unit_interval       both fragmentation rates are in [0, 1]
[[nodiscard]] std::string violated_stats_relation(const device_stats& s,
                                                  bool expandable_segments);

/// Every field of k_stat_fields as one JSON object, keyed by name: per-pool fields as
/// {"all"|"small_pool"|"large_pool": {"current", "peak", "allocated", "freed"}}, the others as
/// numbers. The statistics part of snapshot_json() and of cucache-replay --json.
[[nodiscard]] std::string stats_json(const device_stats& s);

}  // namespace cucache
