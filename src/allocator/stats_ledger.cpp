// The statistics ledger's behaviour (stats_ledger.hpp): device-wide statistics as the per-stream
// pools' figures summed, plus what only a walk of the blocks can tell (inactive split blocks, free
// blocks) and the largest request cached memory serves; the stale queue's steps; the validated
// read; the ledger's invariants. And the allocator's statistics front doors.
#include "allocator/stats_ledger.hpp"

#include <algorithm>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "allocator/allocator_impl.hpp"
#include "allocator/device_budget.hpp"
#include "allocator/pager.hpp"
#include "allocator/pool_table.hpp"
#include "allocator/stream_pool.hpp"
#include "allocator/tag_sleeper.hpp"

using cucache::detail::pool_kind;
using cucache::detail::stream_pool;

namespace cucache {
namespace detail {

// --- the pools' part of the ledger (stats_ledger.hpp) --------------------------------------------

void pool_ledger::settle(stats_ledger& ledger, pool_summary now) {
  {
    lock_guard lock(ledger.mu);
    ledger.replace(summary_, now);
  }
  summary_ = std::move(now);
  stale_ = false;
}

void pool_ledger::stale_queue::mark(stream_pool& p) noexcept {
  // Queue membership is queued_'s, under mu_, apart from stale_ (p.mu): a refresh that walks
  // every pool clears stale_ of pools still queued.
  p.ledger.stale_ = true;
  lock_guard lock(mu_);
  ++changes_;  // before the change itself (the caller holds p.mu): a validated read sees it
  if (p.ledger.queued_) return;
  p.ledger.queued_ = true;
  p.ledger.next_ = head_;
  head_ = &p;
}

void pool_ledger::stale_queue::mark_all() noexcept {
  lock_guard lock(mu_);
  all_.store(true, std::memory_order_relaxed);  // read under mu_ by take
  ++changes_;
}

bool pool_ledger::stale_queue::changed_since(std::uint64_t changes) const {
  lock_guard lock(mu_);
  return changes_ != changes;
}

pool_ledger::stale_queue::taken pool_ledger::stale_queue::take() {
  taken out;
  lock_guard lock(mu_);
  std::size_t n = 0;
  for (const stream_pool* p = head_; p != nullptr; p = p->ledger.next_) ++n;
  out.pools.reserve(n);  // may throw: nothing taken yet
  for (stream_pool* p = head_; p != nullptr;) {
    stream_pool* next = p->ledger.next_;
    p->ledger.next_ = nullptr;
    p->ledger.queued_ = false;
    out.pools.push_back(p);
    p = next;
  }
  head_ = nullptr;
  out.all = all_.exchange(false, std::memory_order_relaxed);
  out.changes = changes_;
  return out;
}

}  // namespace detail

namespace {

/// A pool's counters as a stat_array (its share; the ledger sums the shares -- device-wide peaks
/// are then sums of per-stream peaks, exact with one stream and an upper bound with several:
/// an exact device-wide peak would put a shared atomic on every allocation and free).
stat_array copy_of(const detail::counter_array& from) {
  stat_array out;
  for (std::size_t i = 0; i < k_stat_pools; ++i) out[i] = from[i].get();
  return out;
}

}  // namespace

namespace detail {

pool_summary stats_ledger::summarize(const parts& ps, const stream_pool& p) {
  p.mu.assert_held();  // the caller's (stats_ledger.hpp)
  pool_summary out;
  device_stats& s = out.part;
  const auto& st = p.stats;
  const bool asleep = p.domain != 0 && ps.sleeper.asleep(p.domain);
  if (asleep) out.asleep_active = static_cast<std::size_t>(st.active_bytes(0).current);
  s.allocated_bytes = copy_of(st.allocated_bytes);
  s.reserved_bytes = copy_of(st.reserved_bytes);
  s.requested_bytes = copy_of(st.requested_bytes);
  s.allocation_count = copy_of(st.allocation_count);
  s.segment_count = copy_of(st.segment_count);
  for (std::size_t i = 0; i < k_stat_pools; ++i) {
    s.active_bytes[i] = st.active_bytes(i);
    s.active_count[i] = st.active_count(i);
  }
  s.oversize_allocations = st.oversize_allocations;
  s.oversize_segments = st.oversize_segments;
  s.take_back_count = st.take_backs;
  s.events_pending = p.pending.size();
  for (const auto& idx : p.free) {
    const free_index::totals_t t = idx.totals();
    s.free_block_count += t.count;
    if (!ps.expandable) s.free_bytes += t.bytes;
  }
  for (const segment* seg = p.segments; seg != nullptr; seg = seg->next) {
    if (seg->vm != nullptr) {
      s.mapped_bytes += seg->vm->mapped_pages * ps.page_bytes;
      continue;
    }
    // Inactive split: free blocks inside segments that are not wholly free (a sleeping graph
    // segment, whole_vm_segments.hpp, holds no memory: nothing of it is inactive).
    if (seg->whole_free() || seg->unmapped) continue;
    const std::size_t slot = seg->kind == pool_kind::small ? 1 : 2;
    for (const block* b = seg->first; b != nullptr; b = b->next) {
      if (b->state != block_state::free) continue;
      for (std::size_t i : {std::size_t{0}, slot}) {
        s.inactive_split_bytes[i].current += static_cast<std::int64_t>(b->size);
        s.inactive_split_count[i].current += 1;
      }
    }
  }
  // A sleeping pool refuses every request.
  if (!asleep) out.largest = ps.largest_cached_request(p);
  return out;
}

std::uint64_t stats_ledger::refresh(const parts& ps, bool all_locked, std::size_t handles) {
  // The pools marked stale since the last refresh are summarized again, each under its own lock
  // (or the caller's lock_all); every pool when lock_all ran meanwhile or, in expandable mode,
  // the unmapped one-page handles and whether coarse handles are plentiful (`handles`:
  // pager::largest_request_key, read by the caller) differ from those the ledger last saw (every
  // expandable pool's largest request depends on them).
  pool_table::stale_pools stale = ps.pools.take_stale();
  bool every = stale.all;
  {
    lock_guard lock(mu);
    if (handles_seen != handles) {
      every = true;
      handles_seen = handles;
    }
  }
  const auto one = [&](stream_pool& p) {
    if (all_locked) {
      pool_table::assert_locked(p);
      p.ledger.settle(*this, summarize(ps, p));
    } else {
      lock_guard lk(p.mu);
      p.ledger.settle(*this, summarize(ps, p));
    }
  };
  try {
    if (every) {
      // Taken on one branch: a std lock, which the analysis does not follow.
      std::shared_lock<shared_mutex> list;
      if (!all_locked) list = std::shared_lock(ps.pools.list_mutex());
      for (const auto& p : ps.pools.list()) one(*p);
    } else {
      for (stream_pool* p : stale.pools) one(*p);
    }
  } catch (...) {
    // Out of memory part way: the pools taken from the queue and not summarized again would be
    // forgotten (still stale, no longer queued). Every pool counts as stale instead.
    ps.pools.mark_all_stale();
    throw;
  }
  return stale.changes;
}

device_stats stats_ledger::compose(const parts& ps, const device_stats& totals,
                                   std::size_t largest, std::size_t asleep_active,
                                   bool all_locked, std::uint64_t* budget_changes) {
  device_stats s = totals;
  s.largest_free_block = largest;
  for (auto* arr : {&s.inactive_split_bytes, &s.inactive_split_count}) {
    for (auto& st : *arr) st.peak = st.allocated = st.current;
  }
  std::size_t reserved = 0;
  {
    lock_guard lock(ps.budget.mu);
    // The device-wide reservation is exact, peak included: it changes only under the budget's
    // lock.
    reserved = ps.budget.reserved_bytes_locked();
    s.reserved_bytes[0].current = static_cast<std::int64_t>(reserved);
    s.reserved_bytes[0].peak = static_cast<std::int64_t>(ps.budget.peak_bytes_locked());
    if (ps.pg != nullptr) s.unmapped_handle_bytes = ps.pg->free_handle_bytes;
    if (budget_changes != nullptr) *budget_changes = ps.budget.changes_locked();
  }
  if (ps.expandable) {
    // Free memory is physical: mapped pages no block uses (idle or partly used) and unmapped
    // handles. (A sleeping tag's blocks stay active while no page backs them: only awake blocks
    // count.)
    const std::size_t active =
        static_cast<std::size_t>(s.active_bytes[0].current) - asleep_active;
    s.free_bytes = reserved > active ? reserved - active : 0;
  }
  if (ps.pg != nullptr) {
    const auto& c = ps.pg->counters;
    constexpr auto relaxed = std::memory_order_relaxed;
    s.vm_map_count = c.map.load(relaxed);
    s.vm_unmap_count = c.unmap.load(relaxed);
    s.stitched_pages = c.stitched_pages.load(relaxed);
    s.shared_pages = c.shared_pages.load(relaxed);
    s.vm_sync_count = c.synchronizations.load(relaxed);
    s.vm_split_count = c.splits.load(relaxed);
    s.vm_reclaim_count = c.reclaims.load(relaxed);
    s.vm_host_ns = c.vm_ns.load(relaxed);
    s.sync_host_ns = c.sync_ns.load(relaxed);
  }
  s.device_alloc_count = ps.budget.device_allocs.load(std::memory_order_relaxed);
  s.device_free_count = ps.budget.device_frees.load(std::memory_order_relaxed);
  s.oom_count = ps.budget.oom_count.load(std::memory_order_relaxed);
  s.alloc_retry_count = ps.budget.retry_count.load(std::memory_order_relaxed);
  s.memory_limit = ps.budget.limit;
  s.device_total_bytes = ps.budget.device_total;
  if (ps.sleeper.any() || all_locked) {
    // The records change only under every pool lock, which lock_all takes with the pool list
    // shared: the list held exclusively keeps them still as well (and never waits for a pool).
    std::unique_lock<shared_mutex> list;  // on one branch: not followed by the analysis
    if (!all_locked) list = std::unique_lock(ps.pools.list_mutex());
    for (const auto& [domain, r] : ps.sleeper.records()) {
      s.sleeping_bytes += r.sleeping_bytes;
      s.sleeping_host_bytes += r.host_bytes;
    }
  }
  return s;
}

std::size_t stats_ledger::handles_key(const parts& ps) {
  return ps.pg != nullptr ? ps.pg->largest_request_key() : 0;
}

device_stats stats_ledger::compose_totals(const parts& ps, bool all_locked,
                                          std::uint64_t* budget_changes) {
  device_stats totals_now;
  std::size_t largest_now = 0;
  std::size_t asleep_now = 0;
  {
    lock_guard lock(mu);
    totals_now = totals;
    largest_now = largest_request();
    asleep_now = asleep_active;
  }
  return compose(ps, totals_now, largest_now, asleep_now, all_locked, budget_changes);
}

device_stats stats_ledger::read_locked(const parts& ps) {
  refresh(ps, /*all_locked=*/true, handles_key(ps));
  return compose_totals(ps, /*all_locked=*/true, nullptr);
}

device_stats stats_ledger::read(const parts& ps) {
  // A validated read (docs/design.md, "Statistics under concurrent readers"). Readers are
  // serialized (`readers`): one refreshes the ledger at a time, and none sees another's refresh
  // half done. Each try takes the queue of stale pools (`changes`, the count of marks, with it),
  // summarizes those pools again, and composes the ledger's totals with the device-wide figures
  // (the budget, the pager's handles, the sleeping domains). The result is the state at one
  // instant -- the moment the budget was read -- when no pool was marked since the queue was
  // taken and the budget's count of changes is the one read before the refresh:
  //  - a pool is marked (queue_stale) when it is locked for a change while its summary is
  //    current, before the change, and lock_all counts as marking every pool; so with no mark
  //    since the queue was taken, every pool held, from the moment its summary was last taken
  //    (by this try, for the pools of the queue) until the check, the state its summary in the
  //    ledger describes: the ledger's totals are those of every instant of that window;
  //  - the budget's reservation and peak, and the unmapped handles, change only under its mutex,
  //    with its count: they are those of the instant they were read (within the window), and
  //    the handles are those the refresh judged the pools' largest requests by;
  //  - the sleeping records change only under lock_all, a mark.
  // A pool locked for a change already when the queue is taken is in the queue (it was marked
  // when locked), and its summary is taken under its lock, after that change. An operation that
  // returned before stats() was called marked its pool before its change, so its change is in
  // this read. A try that fails (a writer marked a pool meanwhile) is repeated; after
  // k_optimistic_reads the read is taken with every pool locked, which is exact.
  constexpr int k_optimistic_reads = 3;
  lock_guard reader(readers);
  for (int attempt = 0; attempt < k_optimistic_reads; ++attempt) {
    std::uint64_t budget_before = 0;
    {
      lock_guard lock(ps.budget.mu);
      budget_before = ps.budget.changes_locked();
    }
    const std::uint64_t marks = refresh(ps, /*all_locked=*/false, handles_key(ps));
    std::uint64_t budget_after = 0;
    device_stats s = compose_totals(ps, /*all_locked=*/false, &budget_after);
    if (budget_after == budget_before && !ps.pools.changed_since(marks)) return s;
  }
  // Nothing changes while every pool is locked.
  pool_table::all_locked all(ps.pools, pool_table::purpose::read);
  return read_locked(ps);
}

}  // namespace detail

device_stats device_allocator::stats() const { return impl_->ledger.read(impl_->ledger_parts()); }

std::string violated_stats_relation(const device_stats& s, bool expandable_segments) {
  using i64 = std::int64_t;
  const auto i = [](std::size_t v) { return static_cast<i64>(v); };
  const char* const slot_name[k_stat_pools] = {"all", "small_pool", "large_pool"};
  std::string why;
  const auto fail = [&](std::string text) {
    if (why.empty()) why = std::move(text);
  };
  // Per field and slot: signs and peaks; every slot's sum.
  const auto each = [&](const char* name, const stat_array& a, i64 extra_in_all) {
    for (std::size_t k = 0; k < k_stat_pools; ++k) {
      const stat& v = a[k];
      if (v.current < 0 || v.peak < 0 || v.allocated < 0 || v.freed < 0) {
        fail(fmt::format("nonnegative: {}.{} is {{current {}, peak {}, allocated {}, freed {}}}",
                         name, slot_name[k], v.current, v.peak, v.allocated, v.freed));
      }
      if (v.peak < v.current) {
        fail(fmt::format("peak_covers_current: {}.{} peak {} < current {}", name, slot_name[k],
                         v.peak, v.current));
      }
    }
    if (a[0].current != a[1].current + a[2].current + extra_in_all) {
      fail(fmt::format("all_is_the_sum: {}.all {} != small_pool {} + large_pool {}{}", name,
                       a[0].current, a[1].current, a[2].current,
                       extra_in_all != 0 ? fmt::format(" + {}", extra_in_all) : std::string()));
    }
  };
#define CUCACHE_RELATION_ARRAY_(member, torch, unit) \
  each(#member, s.member,                            \
       std::string_view(#member) == "reserved_bytes" ? i(s.unmapped_handle_bytes) : 0);
  CUCACHE_STAT_ARRAY_FIELDS(CUCACHE_RELATION_ARRAY_)
#undef CUCACHE_RELATION_ARRAY_
  const i64 sleeping = i(s.sleeping_bytes);
  for (std::size_t k = 0; k < k_stat_pools; ++k) {
    const char* slot = slot_name[k];
    if (s.requested_bytes[k].current > s.allocated_bytes[k].current) {
      fail(fmt::format("requested_within_allocated: {}: requested {} > allocated {}", slot,
                       s.requested_bytes[k].current, s.allocated_bytes[k].current));
    }
    if (s.allocated_bytes[k].current > s.active_bytes[k].current ||
        s.allocation_count[k].current > s.active_count[k].current) {
      fail(fmt::format("allocated_within_active: {}: allocated {} bytes / {} blocks, active {} / {}",
                       slot, s.allocated_bytes[k].current, s.allocation_count[k].current,
                       s.active_bytes[k].current, s.active_count[k].current));
    }
    if (s.active_bytes[k].current > s.reserved_bytes[k].current + sleeping) {
      fail(fmt::format("active_within_reserved: {}: active {} > reserved {} + sleeping {}", slot,
                       s.active_bytes[k].current, s.reserved_bytes[k].current, sleeping));
    }
  }
  const i64 reserved = s.reserved_bytes[0].current;
  const i64 pools_reserved = s.reserved_bytes[1].current + s.reserved_bytes[2].current;
  const i64 unused = reserved - s.active_bytes[0].current;  // reserved - active
  const i64 free_bytes = i(s.free_bytes);
  if (expandable_segments ? (free_bytes < unused || free_bytes > unused + sleeping)
                          : free_bytes != unused) {
    fail(fmt::format("free_is_reserved_minus_active: free {} with reserved {}, active {}, "
                     "sleeping {} ({} mode)",
                     free_bytes, reserved, s.active_bytes[0].current, sleeping,
                     expandable_segments ? "expandable" : "default"));
  }
  if (free_bytes > reserved) {
    fail(fmt::format("free_is_reserved_minus_active: free {} > reserved {}", free_bytes,
                     reserved));
  }
  if (s.largest_free_block > s.free_bytes) {
    fail(fmt::format("largest_within_free: largest free block {} > free {}",
                     s.largest_free_block, s.free_bytes));
  }
  if (s.largest_free_block > 0 && s.free_block_count == 0) {
    fail(fmt::format("largest_needs_a_free_block: largest free block {} with no free block",
                     s.largest_free_block));
  }
  if (!expandable_segments && (s.free_block_count == 0) != (s.free_bytes == 0)) {
    fail(fmt::format("free_blocks_hold_free_bytes: {} free blocks hold {} bytes",
                     s.free_block_count, s.free_bytes));
  }
  if (s.inactive_split_bytes[0].current > free_bytes ||
      s.inactive_split_count[0].current > i(s.free_block_count)) {
    fail(fmt::format("inactive_split_within_free: inactive split {} bytes / {} blocks, free {} / "
                     "{}",
                     s.inactive_split_bytes[0].current, s.inactive_split_count[0].current,
                     s.free_bytes, s.free_block_count));
  }
  if ((s.segment_count[0].current == 0) != (pools_reserved == 0)) {
    fail(fmt::format("segments_hold_reserved: {} segments hold {} bytes of the pools",
                     s.segment_count[0].current, pools_reserved));
  }
  if (i(s.oversize_allocations) > s.allocation_count[0].current ||
      i(s.oversize_segments) > s.segment_count[0].current) {
    fail(fmt::format("oversize_within_counts: {} oversize allocations of {}, {} oversize "
                     "segments of {}",
                     s.oversize_allocations, s.allocation_count[0].current, s.oversize_segments,
                     s.segment_count[0].current));
  }
  if (s.events_pending > 0 && s.active_count[0].current <= s.allocation_count[0].current) {
    fail(fmt::format("pending_needs_active: {} events pending, {} active blocks of which {} "
                     "allocated",
                     s.events_pending, s.active_count[0].current, s.allocation_count[0].current));
  }
  if (expandable_segments) {
    if (i(s.mapped_bytes) + i(s.unmapped_handle_bytes) > reserved ||
        i(s.mapped_bytes) > pools_reserved) {
      fail(fmt::format("pages_within_reserved: mapped {} + unmapped handles {} with reserved {} "
                       "({} in the pools)",
                       s.mapped_bytes, s.unmapped_handle_bytes, reserved, pools_reserved));
    }
  } else if (s.mapped_bytes != 0 || s.unmapped_handle_bytes != 0 || s.sleeping_bytes != 0 ||
             s.sleeping_host_bytes != 0) {
    fail(fmt::format("pages_within_reserved: default mode with {} mapped, {} in unmapped "
                     "handles, {} sleeping",
                     s.mapped_bytes, s.unmapped_handle_bytes, s.sleeping_bytes));
  }
  // (Not reserved <= memory_limit: the limit may be lowered under what is reserved at any time,
  // set_memory_fraction, and reserved then only falls towards it.)
  if (s.device_total_bytes != 0 && reserved > i(s.device_total_bytes)) {
    fail(fmt::format("within_limit: reserved {} (peak {}), device {}", reserved,
                     s.reserved_bytes[0].peak, s.device_total_bytes));
  }
  for (const double rate : {s.external_fragmentation(), s.overhead_fragmentation()}) {
    if (!(rate >= 0.0 && rate <= 1.0)) {
      fail(fmt::format("rates_in_unit_interval: external {}, overhead {}",
                       s.external_fragmentation(), s.overhead_fragmentation()));
    }
  }
  return why;
}

void device_allocator::reset_peak_stats() {
  detail::pool_table::all_locked all(impl_->pools);
  for (auto& p : impl_->pools) {
    detail::pool_table::assert_locked(*p);
    p->stats.reset_peaks();
  }
  impl_->budget.reset_peak();
}

void device_allocator::reset_accumulated_stats() {
  detail::pool_table::all_locked all(impl_->pools);
  for (auto& p : impl_->pools) {
    detail::pool_table::assert_locked(*p);
    p->stats.reset_totals();
  }
  impl_->budget.reset_counters();
  if (impl_->pager) impl_->pager->counters.reset();
}

namespace detail {

void stats_ledger::check(const parts& ps) const {
  const auto violated = [](const std::string& what) {
    throw std::logic_error("cucache invariant violated: " + what);
  };
  // The statistics ledger (stats_ledger.hpp): its totals are the sum of the pools' summaries, and
  // a pool not marked stale holds the summary it would get now -- its largest request only while
  // the unmapped one-page handles are those the ledger last saw -- unless lock_all ran since the
  // last refresh (every pool then counts as stale).
  device_stats sum;
  std::size_t asleep_sum = 0;
  std::map<std::size_t, std::size_t> largest_sum;
  for (const auto& p : ps.pools) {
    pool_table::assert_locked(*p);
    add_fields(sum, p->ledger.summary().part, +1);
    asleep_sum += p->ledger.summary().asleep_active;
    if (p->ledger.summary().largest != 0) ++largest_sum[p->ledger.summary().largest];
  }
  bool same_handles = false;
  {
    lock_guard lock(mu);
    if (!same_fields(sum, totals) || asleep_sum != asleep_active || largest_sum != largest) {
      violated("the statistics ledger's totals are not the sum of the pools' summaries");
    }
    same_handles = handles_seen == handles_key(ps);
  }
  // The relations of the field table (violated_stats_relation) on the statistics recounted now:
  // every pool summarized again, composed with the device-wide figures as stats() composes them.
  const bool all_stale = ps.pools.all_stale();
  device_stats now_sum;
  std::size_t now_largest = 0;
  std::size_t now_asleep = 0;
  for (const auto& p : ps.pools) {
    pool_table::assert_locked(*p);
    const pool_summary now = summarize(ps, *p);
    add_fields(now_sum, now.part, +1);
    now_largest = std::max(now_largest, now.largest);
    now_asleep += now.asleep_active;
    if (all_stale || p->ledger.stale()) continue;
    if (!same_fields(now.part, p->ledger.summary().part) ||
        now.asleep_active != p->ledger.summary().asleep_active ||
        (same_handles && now.largest != p->ledger.summary().largest)) {
      violated(fmt::format("pool {} changed since its statistics were summarized, and is not "
                           "marked stale",
                           p->index));
    }
  }
  const device_stats now =
      compose(ps, now_sum, now_largest, now_asleep, /*all_locked=*/true, nullptr);
  if (const std::string why = violated_stats_relation(now, ps.expandable);
      !why.empty()) {
    violated("statistics: " + why);
  }
}

}  // namespace detail
}  // namespace cucache
