// The per-stream state of a device allocator: its segments, its two free indices (small and
// large pool), its freed-but-pending blocks and its statistics, all under one mutex. A block is
// reused only on its own stream, so pools never share blocks and threads on different streams
// never contend here.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "allocator/object_arena.hpp"
#include "allocator/pending_frees.hpp"
#include "allocator/pool_mutex.hpp"
#include "allocator/pool_pages.hpp"
#include "allocator/pool_stats.hpp"
#include "allocator/stats_ledger.hpp"
#include "core/block.hpp"
#include "core/free_index.hpp"
#include "core/vm_range.hpp"
#include "cucache/backend.hpp"
#include "cucache/stats.hpp"

namespace cucache::detail {
struct graph_pool;

class stream_pool {
 public:
  stream_pool(stream_handle s, std::uint64_t k, std::size_t idx, graph_pool* g = nullptr,
              std::uint32_t d = 0)
      : stream(s), key(k), index(idx), graph(g), domain(d) {}

  /// The handle the pool serves. Another stream may have this value now (the runtime hands a
  /// destroyed stream's handle to the next one it creates); `key` tells them apart. `stream` and
  /// `key` change only when the pool table hands a retired pool to a new stream (pool_table::
  /// pool_for_key), under both the table's list lock (exclusive) and `mu`: read them under either.
  stream_handle stream;
  /// The stream's id (device_backend::stream_id), never reused: what pools are looked up by.
  std::uint64_t key;
  const std::size_t index;  // creation order; pools are always locked in this order
  /// Non-null for a part of a graph pool: only allocations routed to that pool reach it.
  graph_pool* const graph;
  /// The sleep domain whose blocks this pool holds (tag_sleeper.hpp): 0 for a stream's own pool,
  /// else a sleepable tag's id -- the pool then holds that tag's blocks on this stream alone, in
  /// ranges of its own, so that no page of it is shared with another tag's or untagged blocks.
  const std::uint32_t domain;
  /// Blocks of this pool held pending by graph pools (each also counts in uses->pending_events).
  std::size_t retained GUARDED_BY(mu) = 0;
  alignas(64) pool_mutex mu;
  free_index free[2] GUARDED_BY(mu);           // [pool_kind]
  segment* segments GUARDED_BY(mu) = nullptr;  // doubly linked, newest first
  pending_frees pending GUARDED_BY(mu);        // freed blocks waiting on events
  pool_stats stats GUARDED_BY(mu);
  std::uint64_t tick GUARDED_BY(mu) = 0;  // free order, for garbage collection
  // storage of this pool's blocks (the pointer map is impl::blocks)
  object_arena<block> block_arena GUARDED_BY(mu);
  object_arena<segment> segment_arena GUARDED_BY(mu);

  /// Expandable segments: the pager's state for this pool (its ranges, idle mappings).
  pool_pages pages GUARDED_BY(mu);

  // --- statistics (stats_ledger.hpp), under mu ------------------------------------------------
  /// The pool's share of the device-wide statistics, as last summarized.
  pool_summary summary GUARDED_BY(mu);
  /// Locked for a change since `summary` was taken: queued in the pool table for the ledger
  /// (pool_table::note_change).
  bool stats_stale GUARDED_BY(mu) = false;
  // The pool table's queue of stale pools, under its stale_mu_ (not mu).
  bool stale_queued = false;
  stream_pool* next_stale = nullptr;

  // --- retirement (pool_table, docs/design.md "What a stream costs"), under mu ---------------
  static constexpr std::uint64_t k_never = ~std::uint64_t{0};
  /// Recorded on `stream` while the program named it in a call (an ordered free on it that left
  /// the pool quiet); nullptr until first needed, then kept for the pool's life.
  event_handle quiet_event GUARDED_BY(mu) = nullptr;
  /// `tick` when quiet_event was last recorded with the pool quiet: while tick still equals it,
  /// nothing was allocated or freed since, so the event's completion proves that every use of
  /// the pool's blocks on its stream has completed.
  std::uint64_t quiet_tick GUARDED_BY(mu) = k_never;
  std::uint64_t quiet_frees GUARDED_BY(mu) =
      0;                               // ordered frees that left the pool quiet (the record's rate)
  bool queued GUARDED_BY(mu) = false;  // in the pool table's queue of retirement candidates
  /// Allocations on this pool that unlocked it midway (the ladder, garbage collection) and will
  /// lock it again to go on: while any is, the pool is not quiet, so it keeps its stream.
  std::uint32_t unlocked_allocations GUARDED_BY(mu) = 0;

  /// No block of the pool is allocated, pending or held for a graph, and it is a stream's own
  /// pool: its cached memory is all free, and it may be retired once its stream's work on it is
  /// proven complete.
  [[nodiscard]] bool quiet() const noexcept REQUIRES(mu) {
    return graph == nullptr && stats.allocation_count[0].current == 0 &&
           stats.pending_count[0].current == 0 && retained == 0 && unlocked_allocations == 0;
  }
  /// The pool holds no device memory (no segment; in expandable mode, no mapped page).
  [[nodiscard]] bool holds_no_memory() const noexcept REQUIRES(mu) {
    return stats.reserved_bytes[0].current == 0;
  }

  free_index& index_of(pool_kind k) noexcept REQUIRES(mu) { return free[static_cast<int>(k)]; }
  const free_index& index_of(pool_kind k) const noexcept REQUIRES(mu) {
    return free[static_cast<int>(k)];
  }
};

}  // namespace cucache::detail
