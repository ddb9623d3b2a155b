// stats_ledger: the device-wide statistics as the sum of per-pool summaries, each taken again only
// when its pool may have changed since (docs/design.md, "What a stream costs"), so that stats()
// costs the pools that changed, not every pool in use.
//
// Contract. A pool_summary is a pool's share of device_stats: every per-pool field of the field
// table (its stat arrays and counters; device-wide counters stay 0 in it) and, apart, the largest
// request its cached memory serves. The ledger's totals are, at every moment its mutex is free, the
// field-wise sum of the summaries the pools hold, and `largest` counts their largest requests.
// A pool is marked stale (pool_ledger::stale, queued once in the stale queue) whenever it is
// locked for a change; its summary is only taken again while stale. So a summary of a pool not
// stale equals what summarizing it now would give -- except the largest request of an expandable
// pool, which also depends on the device-wide count of unmapped one-page handles: summaries are
// taken again for every pool when that count differs from `handles_seen`.
//
// Locking: `mu` guards totals, largest and handles_seen, and is taken inside a pool's mutex (a
// summary is replaced under both) and never around one, so read_locked, called with every pool
// locked, keeps the pool-table lock order.
//
// Ownership. A pool's part of the ledger -- its summary, its stale flag and its link in the stale
// queue -- is its pool_ledger (stream_pool::ledger): private, read through stale() and summary(),
// changed only by pool_ledger::settle (a new summary into the totals, under both mutexes) and by
// the stale queue (pool_ledger::stale_queue, a member of the pool table: every path that locks a
// pool to change it marks it there).
//
// Behaviour (stats_ledger.cpp). The ledger summarizes a pool (walking its blocks and counters),
// refreshes the stale pools' summaries, composes its totals with the device-wide figures (the
// budget, the pager's handles and counters, the sleeping domains) into device_stats, serves the
// validated read of docs/design.md "Statistics under concurrent readers", and checks its own
// invariants. What it reads of the allocator's other parts comes as `parts`; the one rule it
// asks of the allocator is the largest request a pool's cached memory serves (placement).
#pragma once

#include <cstddef>
#include <cstdint>
#include <atomic>
#include <map>
#include <mutex>
#include <vector>

#include <functional>

#include "allocator/pool_mutex.hpp"
#include "backend/thread_annotations.hpp"
#include "cucache/stats.hpp"

namespace cucache::detail {
class stream_pool;
class pool_table;
class device_budget;
class pager;
class tag_sleeper;

/// One pool's share of the device-wide statistics (stats_ledger::summarize).
struct pool_summary {
  device_stats part;               // per-pool fields only; largest_free_block unused (0)
  std::size_t asleep_active = 0;   // active bytes of a sleeping pool (no page backs them)
  std::size_t largest = 0;         // the largest request its cached memory serves
};

/// into += from (sign > 0) or into -= from, over every field of the field table (stat arrays:
/// current, peak, allocated, freed; counters).
inline void add_fields(device_stats& into, const device_stats& from, int sign) noexcept {
  const auto op = [sign](auto& a, auto b) {
    if (sign > 0) {
      a += b;
    } else {
      a -= b;
    }
  };
#define CUCACHE_LEDGER_ARRAY(member, torch_name, unit)  \
  for (std::size_t i = 0; i < k_stat_pools; ++i) {      \
    op(into.member[i].current, from.member[i].current); \
    op(into.member[i].peak, from.member[i].peak);       \
    op(into.member[i].allocated, from.member[i].allocated); \
    op(into.member[i].freed, from.member[i].freed);     \
  }
#define CUCACHE_LEDGER_COUNTER(member, torch_name, unit, kind) op(into.member, from.member);
  CUCACHE_STAT_ARRAY_FIELDS(CUCACHE_LEDGER_ARRAY)
  CUCACHE_STAT_COUNTER_FIELDS(CUCACHE_LEDGER_COUNTER)
#undef CUCACHE_LEDGER_ARRAY
#undef CUCACHE_LEDGER_COUNTER
}

/// Whether a and b agree in every field of the field table.
inline bool same_fields(const device_stats& a, const device_stats& b) noexcept {
  bool same = true;
#define CUCACHE_LEDGER_ARRAY(member, torch_name, unit)                             \
  for (std::size_t i = 0; i < k_stat_pools; ++i) {                                 \
    same = same && a.member[i].current == b.member[i].current &&                   \
           a.member[i].peak == b.member[i].peak &&                                 \
           a.member[i].allocated == b.member[i].allocated &&                       \
           a.member[i].freed == b.member[i].freed;                                 \
  }
#define CUCACHE_LEDGER_COUNTER(member, torch_name, unit, kind) same = same && a.member == b.member;
  CUCACHE_STAT_ARRAY_FIELDS(CUCACHE_LEDGER_ARRAY)
  CUCACHE_STAT_COUNTER_FIELDS(CUCACHE_LEDGER_COUNTER)
#undef CUCACHE_LEDGER_ARRAY
#undef CUCACHE_LEDGER_COUNTER
  return same;
}

class stats_ledger;

/// A pool's part of the ledger (stream_pool::ledger). The summary and the stale flag are under the
/// pool's mutex; the queue link (queued_, next_) under the stale queue's mutex.
class pool_ledger {
 public:
  /// Locked for a change since its summary was taken: queued in the stale queue for the ledger.
  [[nodiscard]] bool stale() const noexcept { return stale_; }
  /// The pool's share of the device-wide statistics, as last summarized.
  [[nodiscard]] const pool_summary& summary() const noexcept { return summary_; }
  /// The pool summarized again as `now` (stats_ledger.cpp): `now` replaces its summary in the ledger's
  /// totals and here, and the pool is no longer stale. REQUIRES: the pool's mutex.
  /// Throws only before it changes anything.
  void settle(stats_ledger& ledger, pool_summary now);

  /// The pools marked stale and not yet taken for a refresh, each once; whether every pool is
  /// stale (lock_all ran); the count of marks. Held by the pool table (pool_table::note_change,
  /// take_stale). Locking: its own leaf mutex.
  class stale_queue {
   public:
    /// p is locked for a change and was not stale: stale now, and queued unless it still is.
    void mark(stream_pool& p) noexcept;
    struct taken {
      std::vector<stream_pool*> pools;
      bool all = false;
      std::uint64_t changes = 0;
    };
    /// The pools queued since the last take (each once), whether mark_all ran meanwhile, and the
    /// count of marks now. Throws only before it takes anything (no memory for the list).
    [[nodiscard]] taken take();
    /// Every pool counts as stale (lock_all, or a refresh that failed part way).
    void mark_all() noexcept;
    [[nodiscard]] bool all_marked() const noexcept {
      return all_.load(std::memory_order_relaxed);
    }
    [[nodiscard]] bool changed_since(std::uint64_t changes) const;

   private:
    mutable mutex mu_;  // a leaf
    stream_pool* head_ GUARDED_BY(mu_) = nullptr;
    std::atomic<bool> all_{false};               // mark_all ran since the last take
    std::uint64_t changes_ GUARDED_BY(mu_) = 0;  // marks and mark_alls, ever
  };

 private:
  pool_summary summary_;
  bool stale_ = false;
  bool queued_ = false;          // in the stale queue (under its mutex)
  stream_pool* next_ = nullptr;  // the next pool in the stale queue (under its mutex)
};

class stats_ledger {
 public:
  /// What the ledger reads of the allocator's other parts.
  struct parts {
    const pool_table& pools;
    const device_budget& budget;
    const pager* pg;  // null in default mode
    const tag_sleeper& sleeper;
    bool expandable = false;
    std::size_t page_bytes = 0;
    /// The largest request a pool's cached memory serves with no device allocation (the
    /// allocator's placement rules; docs/design.md, "Free memory"). REQUIRES: the pool's lock.
    std::function<std::size_t(const stream_pool&)> largest_cached_request;
  };

  // --- reads (the allocator's stats()) ---
  /// The statistics as one consistent view: a validated read -- the stale pools summarized
  /// again, composed with the device-wide figures, valid when nothing was marked and the budget
  /// did not change meanwhile -- tried k_optimistic_reads times, else read_locked under lock_all.
  /// No pool lock held, nor `readers`.
  [[nodiscard]] device_stats read(const parts& ps) EXCLUDES(readers, every_pool);
  /// The statistics, exact. `readers` held, then every pool locked.
  [[nodiscard]] device_stats read_locked(const parts& ps) REQUIRES(readers, every_pool);
  /// The invariants (check_invariants composes it): the totals are the sum of the pools'
  /// summaries; a pool not marked stale holds the summary it would get now; the statistics
  /// recounted now keep the field table's relations (violated_stats_relation). Throws
  /// std::logic_error naming the violation.
  void check(const parts& ps) const REQUIRES(every_pool);

  // --- steps (exposed for tests) ---
  /// p's share of the statistics, from its counters, free indexes and segments. REQUIRES: p's
  /// lock (asserted inside: stream_pool is incomplete here, so the annotation cannot be).
  [[nodiscard]] static pool_summary summarize(const parts& ps, const stream_pool& p);
  /// The summaries of the pools marked stale since the last call taken again (every pool's when
  /// lock_all ran meanwhile or the pager's largest-request key differs from `handles`, the
  /// caller's read of it), each under its pool's lock -- the caller's when `all_locked`. Returns
  /// the count of marks when the queue was taken (pool_table::changed_since).
  std::uint64_t refresh(const parts& ps, bool all_locked, std::size_t handles) REQUIRES(readers);
  /// The totals given (the ledger's, or a recount) with the device-wide figures as device_stats;
  /// `budget_changes`, when given, receives the budget's count of changes read with them.
  /// `all_locked`: the caller holds every pool lock. REQUIRES: `readers`, or every pool locked.
  [[nodiscard]] static device_stats compose(const parts& ps, const device_stats& totals,
                                            std::size_t largest, std::size_t asleep_active,
                                            bool all_locked, std::uint64_t* budget_changes);

  /// The ledger's totals, taken under its mutex, composed as above.
  [[nodiscard]] device_stats compose_totals(const parts& ps, bool all_locked,
                                            std::uint64_t* budget_changes) EXCLUDES(mu);
  /// What every expandable pool's largest request depends on besides the pool
  /// (pager::largest_request_key; 0 in default mode).
  [[nodiscard]] static std::size_t handles_key(const parts& ps);

  /// Serializes the readers (read, and the callers of read_locked, who take it before lock_all):
  /// one refresh at a time. First in the allocator's lock order.
  mutable mutex readers;

  /// Replaces the summary `old` of a pool by `now` in the totals.
  /// Throws only before it changes anything (no memory for a new entry of `largest`).
  void replace(const pool_summary& old, const pool_summary& now) REQUIRES(mu) {
    if (now.largest != 0) ++largest[now.largest];
    if (old.largest != 0) {
      if (auto it = largest.find(old.largest); it != largest.end() && --it->second == 0) {
        largest.erase(it);
      }
    }
    add_fields(totals, old.part, -1);
    add_fields(totals, now.part, +1);
    asleep_active += now.asleep_active;
    asleep_active -= old.asleep_active;
  }
  /// The largest request any pool's cached memory serves.
  [[nodiscard]] std::size_t largest_request() const noexcept REQUIRES(mu) {
    return largest.empty() ? 0 : largest.rbegin()->first;
  }

  mutable mutex mu;
  device_stats totals GUARDED_BY(mu);            // the sum of the pools' summaries
  std::size_t asleep_active GUARDED_BY(mu) = 0;  // the sum of their asleep_active
  // largest request -> pools with it (nonzero only)
  std::map<std::size_t, std::size_t> largest GUARDED_BY(mu);
  /// The unmapped one-page handles' bytes when every pool was last summarized (expandable mode).
  std::size_t handles_seen GUARDED_BY(mu) = 0;
};

}  // namespace cucache::detail
