// The per-stream state of a device allocator: its segments, its two free indices (small and
// large pool), its freed-but-pending blocks and its statistics, all under one mutex. A block is
// reused only on its own stream, so pools never share blocks and threads on different streams
// never contend here.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "allocator/hot.hpp"
#include "allocator/object_arena.hpp"
#include "allocator/pending_frees.hpp"
#include "allocator/pool_mutex.hpp"
#include "allocator/pool_pages.hpp"
#include "allocator/pool_stats.hpp"
#include "allocator/stats_ledger.hpp"
#include "core/block.hpp"
#include "core/block_map.hpp"
#include "core/free_index.hpp"
#include "core/vm_range.hpp"
#include "cucache/backend.hpp"
#include "cucache/stats.hpp"

namespace cucache::detail {
struct graph_pool;

/// A stream pool's retirement state, kept in the pool under its mutex (read inline by quiet() on
/// every free). Its fields change only through these steps: the allocator's (count_quiet_free,
/// begin_record, unlocked_allocation_began/ended) and the pool table's (recorded through
/// pool_table::quiet_recorded; set_queued, restart and the proof in its queues and adoption);
/// docs/design.md "What a stream costs, and when its state goes".
class pool_retirement {
 public:
  static constexpr std::uint64_t k_never = ~std::uint64_t{0};
  /// Quiet events recorded for the first k_quiet_always ordered frees that leave the pool quiet,
  /// then for one in k_quiet_every: a loop of ordered pairs on one stream records one event per
  /// k_quiet_every pairs.
  static constexpr std::uint64_t k_quiet_always = 8;
  static constexpr std::uint64_t k_quiet_every = 256;

  /// Counts an ordered free that left the pool quiet; whether a quiet event is due for it.
  [[nodiscard]] bool count_quiet_free() noexcept {
    const std::uint64_t n = quiet_frees_++;
    return n < k_quiet_always || n % k_quiet_every == 0;
  }
  /// The quiet event, taken with take() the first time (then kept for the pool's life), about to
  /// be recorded: no proof until recorded() says the record is done.
  template <class Take>
  event_handle begin_record(Take&& take) {
    if (quiet_event_ == nullptr) quiet_event_ = take();
    quiet_tick_ = k_never;
    return quiet_event_;
  }
  /// The quiet event was recorded with the pool quiet at `tick`.
  void recorded(std::uint64_t tick) noexcept { quiet_tick_ = tick; }
  /// The quiet event, if one was ever taken (the allocator destroys it at the end).
  [[nodiscard]] event_handle quiet_event() const noexcept { return quiet_event_; }
  /// A quiet event was recorded with the pool quiet and nothing was allocated or freed since
  /// (`tick` still the one recorded): its completion proves every use of the pool's blocks on
  /// its stream has completed.
  [[nodiscard]] bool event_proves(std::uint64_t tick) const noexcept {
    return quiet_event_ != nullptr && quiet_tick_ == tick;
  }
  /// Handed to a new stream: no proof, and the record rate starts again.
  void restart() noexcept {
    quiet_tick_ = k_never;
    quiet_frees_ = 0;
  }
  /// In the pool table's queue of retirement candidates.
  [[nodiscard]] bool queued() const noexcept { return queued_; }
  void set_queued(bool q) noexcept { queued_ = q; }
  /// Allocations on this pool that unlocked it midway (the ladder, garbage collection) and will
  /// lock it again to go on: while any is, the pool is not quiet, so it keeps its stream.
  [[nodiscard]] std::uint32_t unlocked_allocations() const noexcept {
    return unlocked_allocations_;
  }
  void unlocked_allocation_began() noexcept { ++unlocked_allocations_; }
  void unlocked_allocation_ended() noexcept { --unlocked_allocations_; }

 private:
  /// Recorded on the pool's stream while the program named it in a call (an ordered free on it
  /// that left the pool quiet); nullptr until first needed, then kept for the pool's life.
  event_handle quiet_event_ = nullptr;
  /// The pool's `tick` when quiet_event_ was last recorded with the pool quiet.
  std::uint64_t quiet_tick_ = k_never;
  std::uint64_t quiet_frees_ = 0;  // ordered frees that left the pool quiet (the record's rate)
  bool queued_ = false;
  std::uint32_t unlocked_allocations_ = 0;
};

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
  /// defer_coalescing: the last held block whose best-fit test passed (impl::takes_back), with
  /// index_changes() then. While the pool's indexes have not changed, the test passes again for
  /// the same block held again: they hold the same blocks in the same order, and the block's
  /// size and free neighbour are as they were (changing either changes an index). A block
  /// recycled and made anew is never mistaken for it: recycling a block changes an index.
  struct fit_memo_t {
    const block* held = nullptr;
    std::uint64_t changes = 0;
  } fit_memo GUARDED_BY(mu);
  /// The pool's allocated blocks by address (the free path finds the pool through the segment
  /// directory, impl::directory). Beside what a cache-hit pair writes anyway (tick, the block
  /// arena), off mu's line, where threads waiting for mu spin.
  block_map blocks GUARDED_BY(mu);
  // storage of this pool's blocks and segments
  object_arena<block> block_arena GUARDED_BY(mu);
  object_arena<segment> segment_arena GUARDED_BY(mu);

  /// Expandable segments: the pager's state for this pool (its ranges, idle mappings).
  pool_pages pages GUARDED_BY(mu);

  // --- statistics (stats_ledger.hpp) ---------------------------------------------------------
  /// The pool's part of the ledger: its summary and stale flag (under mu), its link in the pool
  /// table's stale queue (under the queue's mutex). Private to the ledger: read here, changed by
  /// pool_ledger::settle and the stale queue only. Not annotated as a whole: its queue link is
  /// not under mu (its readers and writers are in stats_ledger.cpp; note_change holds mu).
  pool_ledger ledger;

  // --- retirement (pool_table, docs/design.md "What a stream costs"), under mu ---------------
  /// The state for handing this pool on: changed only through pool_retirement's steps (the
  /// allocator's, and pool_table's quiet_recorded, queue_quiet and pool_for_key's adoption).
  pool_retirement retirement GUARDED_BY(mu);

  /// No block of the pool is allocated, pending or held for a graph, and it is a stream's own
  /// pool: its cached memory is all free, and it may be retired once its stream's work on it is
  /// proven complete.
  [[nodiscard]] bool quiet() const noexcept REQUIRES(mu) {
    return graph == nullptr && stats.allocation_count[0].current == 0 &&
           stats.pending_count[0].current == 0 && retained == 0 &&
           retirement.unlocked_allocations() == 0;
  }
  /// The pool holds no device memory (no segment; in expandable mode, no mapped page).
  [[nodiscard]] bool holds_no_memory() const noexcept REQUIRES(mu) {
    return stats.reserved_bytes[0].current == 0;
  }

  /// Merges b -- freed, its state set to free, not indexed -- with its free neighbours, and
  /// indexes the result (the free path's last step; a held block's settling). The merged block
  /// often stays in the bin, and at the place, of the neighbour it absorbs; the index then
  /// re-links it without a walk.
  CUCACHE_HOT void coalesce(block* b) noexcept REQUIRES(mu) {
    auto& idx = index_of(b->seg->kind);
    block* n = b->next;
    const bool merge_next = n != nullptr && n->state == block_state::free;
    if (block* q = b->prev; q != nullptr && q->state == block_state::free) {
      std::size_t size = q->size + b->size;
      block* after = b->next;
      if (merge_next) {
        idx.erase(n);
        size += n->size;
        after = n->next;
        block_arena.recycle(n);
      }
      q->next = after;
      if (after != nullptr) after->prev = q;
      idx.resize(q, size);
      block_arena.recycle(b);
      return;
    }
    if (merge_next) {
      b->size += n->size;
      b->next = n->next;
      if (n->next != nullptr) n->next->prev = b;
      idx.replace(n, b);
      block_arena.recycle(n);
      return;
    }
    idx.insert(b);
  }

  free_index& index_of(pool_kind k) noexcept REQUIRES(mu) { return free[static_cast<int>(k)]; }
  const free_index& index_of(pool_kind k) const noexcept REQUIRES(mu) {
    return free[static_cast<int>(k)];
  }
  /// Changes of both kinds' indexes (free_index::changes): equal readings, the same contents.
  [[nodiscard]] std::uint64_t index_changes() const noexcept REQUIRES(mu) {
    return free[0].changes() + free[1].changes();
  }
};

}  // namespace cucache::detail
