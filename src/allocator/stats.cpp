// Device-wide statistics: the per-stream pools' figures summed, plus what only a walk of the
// blocks can tell (inactive split blocks, free blocks) and the largest request cached memory
// serves.
#include <algorithm>
#include <mutex>
#include <shared_mutex>
#include <vector>

#include "allocator/allocator_impl.hpp"

using cucache::detail::pool_kind;
using cucache::detail::stream_pool;

namespace cucache {
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

detail::pool_summary device_allocator::impl::summarize(const stream_pool& p) const {
  // REQUIRES: p.mu held.
  detail::pool_summary out;
  device_stats& s = out.part;
  const auto& ps = p.stats;
  const bool asleep = p.domain != 0 && sleeper.asleep(p.domain);
  if (asleep) out.asleep_active = static_cast<std::size_t>(ps.active_bytes(0).current);
  s.allocated_bytes = copy_of(ps.allocated_bytes);
  s.reserved_bytes = copy_of(ps.reserved_bytes);
  s.requested_bytes = copy_of(ps.requested_bytes);
  s.allocation_count = copy_of(ps.allocation_count);
  s.segment_count = copy_of(ps.segment_count);
  for (std::size_t i = 0; i < k_stat_pools; ++i) {
    s.active_bytes[i] = ps.active_bytes(i);
    s.active_count[i] = ps.active_count(i);
  }
  s.oversize_allocations = ps.oversize_allocations;
  s.oversize_segments = ps.oversize_segments;
  s.events_pending = p.pending.size();
  for (const auto& idx : p.free) {
    s.free_block_count += idx.count();
    if (!cfg.expandable_segments) s.free_bytes += idx.bytes();
  }
  for (const detail::segment* seg = p.segments; seg != nullptr; seg = seg->next) {
    if (seg->vm != nullptr) {
      s.mapped_bytes += seg->vm->mapped_pages * page_bytes;
      continue;
    }
    // Inactive split: free blocks inside segments that are not wholly free.
    if (seg->whole_free()) continue;
    const std::size_t slot = seg->kind == detail::pool_kind::small ? 1 : 2;
    for (const detail::block* b = seg->first; b != nullptr; b = b->next) {
      if (b->state != detail::block_state::free) continue;
      for (std::size_t i : {std::size_t{0}, slot}) {
        s.inactive_split_bytes[i].current += static_cast<std::int64_t>(b->size);
        s.inactive_split_count[i].current += 1;
      }
    }
  }
  if (!asleep) out.largest = largest_cached_request(p);  // a sleeping pool refuses every request
  return out;
}

void device_allocator::impl::resummarize(stream_pool& p) const {
  // REQUIRES: p.mu held.
  detail::pool_summary now = summarize(p);
  {
    std::lock_guard lock(ledger.mu);
    ledger.replace(p.summary, now);
  }
  p.summary = std::move(now);
  p.stats_stale = false;
}

void device_allocator::impl::refresh_stats(bool all_locked) const {
  // The pools marked stale since the last refresh are summarized again, each under its own lock
  // (or the caller's lock_all); every pool when lock_all ran meanwhile or, in expandable mode,
  // the unmapped one-page handles changed (every expandable pool's largest request depends on
  // them).
  const std::size_t handles = pager ? pager->unmapped_page_handle_bytes() : 0;
  detail::pool_table::stale_pools stale = pools.take_stale();
  bool every = stale.all;
  {
    std::lock_guard lock(ledger.mu);
    if (ledger.handles_seen != handles) {
      every = true;
      ledger.handles_seen = handles;
    }
  }
  const auto one = [&](stream_pool& p) {
    if (all_locked) {
      resummarize(p);
    } else {
      std::lock_guard lk(p.mu);
      resummarize(p);
    }
  };
  if (every) {
    std::shared_lock<std::shared_mutex> list;
    if (!all_locked) list = std::shared_lock(pools.list_mutex());
    for (const auto& p : pools.list()) one(*p);
    return;
  }
  for (stream_pool* p : stale.pools) one(*p);
}

device_stats device_allocator::impl::compose_stats() const {
  device_stats s;
  std::size_t asleep_active = 0;
  {
    std::lock_guard lock(ledger.mu);
    s = ledger.totals;
    s.largest_free_block = ledger.largest_request();
    asleep_active = ledger.asleep_active;
  }
  for (auto* arr : {&s.inactive_split_bytes, &s.inactive_split_count}) {
    for (auto& st : *arr) st.peak = st.allocated = st.current;
  }
  std::size_t reserved = 0;
  {
    std::lock_guard lock(budget.mu);
    // The device-wide reservation is exact, peak included: it changes only under the budget's
    // lock.
    reserved = budget.reserved_bytes_locked();
    s.reserved_bytes[0].current = static_cast<std::int64_t>(reserved);
    s.reserved_bytes[0].peak = static_cast<std::int64_t>(budget.peak_bytes_locked());
    if (pager) s.unmapped_handle_bytes = pager->free_handle_bytes;
  }
  if (cfg.expandable_segments) {
    // Free memory is physical: mapped pages no block uses (idle or partly used) and unmapped
    // handles.
    // (A sleeping tag's blocks stay active while no page backs them: only awake blocks count.)
    const std::size_t active =
        static_cast<std::size_t>(s.active_bytes[0].current) - asleep_active;
    s.free_bytes = reserved > active ? reserved - active : 0;
  }
  if (pager) {
    const auto& c = pager->counters;
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
  s.device_alloc_count = budget.device_allocs.load(std::memory_order_relaxed);
  s.device_free_count = budget.device_frees.load(std::memory_order_relaxed);
  s.oom_count = budget.oom_count.load(std::memory_order_relaxed);
  s.alloc_retry_count = budget.retry_count.load(std::memory_order_relaxed);
  s.memory_limit = budget.limit;
  s.device_total_bytes = budget.device_total;
  for (const auto& [domain, r] : sleeper.records()) {
    s.sleeping_bytes += r.sleeping_bytes;
    s.sleeping_host_bytes += r.host_bytes;
  }
  return s;
}

device_stats device_allocator::impl::stats_locked() const {
  refresh_stats(/*all_locked=*/true);
  return compose_stats();
}

device_stats device_allocator::impl::stats_unlocked() const {
  refresh_stats(/*all_locked=*/false);
  return compose_stats();
}

std::size_t device_allocator::impl::largest_cached_request(const stream_pool& p) const {
  // The largest request p serves with no device allocation (docs/design.md, "Free memory").
  // Default mode, and graph pools in every mode: the block find_free() picks, under the
  // max_split_size rules; small requests stop at 1 MiB. Expandable mode: the pager's dry run of
  // its placement. REQUIRES: p.mu held.
  std::size_t best = 0;
  for (const pool_kind kind : {pool_kind::small, pool_kind::large}) {
    if (cfg.expandable_segments && p.graph == nullptr) {
      best = std::max(best, pager->largest_cached_request(p, kind, policy));
      continue;
    }
    const bool small = kind == pool_kind::small;
    p.index_of(kind).for_each([&](const detail::block* b) {
      const std::size_t r = policy.largest_rounded_within(
          small ? std::min(b->size, detail::k_small_request_max_bytes) : b->size);
      if (r <= best || (!small && r <= detail::k_small_request_max_bytes)) return;
      if (find_free_outline(p, kind, r) != nullptr) best = r;
    });
  }
  return best;
}

device_stats device_allocator::stats() const { return impl_->stats_unlocked(); }

void device_allocator::reset_peak_stats() {
  auto all = impl_->pools.lock_all();
  for (auto& p : impl_->pools) p->stats.reset_peaks();
  impl_->budget.reset_peak();
}

void device_allocator::reset_accumulated_stats() {
  auto all = impl_->pools.lock_all();
  for (auto& p : impl_->pools) p->stats.reset_totals();
  impl_->budget.reset_counters();
  if (impl_->pager) impl_->pager->counters.reset();
}

}  // namespace cucache
