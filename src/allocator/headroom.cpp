// Headroom and reserve: max_allocatable, the largest request allocate would serve now;
// largest_cached_request, the largest one a pool serves from its cache alone (the statistics'
// largest free block); and reserve, which fills the cache ahead of the first requests. They sit
// beside the paths that serve requests and are written in their terms -- find_free (best fit and
// the max_split_size rules), the size policy's rounding and segment sizes, the ladder's own
// release rule (ladder_may_release), new_segment, and the pager's backing -- so that the answer
// cannot drift from what allocate does. See docs/api.md ("Headroom and reserve") and
// docs/design.md.
#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "allocator/allocator_impl.hpp"
#include "allocator/nvtx.hpp"
#include "allocator/placement.hpp"
#include "cucache/errors.hpp"

namespace cucache {

using detail::block;
using detail::block_state;
using detail::pool_kind;
using detail::segment;
using detail::stream_pool;

namespace {
constexpr std::size_t k_granule = detail::k_min_block_bytes;

std::size_t round_down(std::size_t n, std::size_t m) {
  return n / m * m;
}
}  // namespace

std::size_t device_allocator::impl::largest_request_within(std::size_t rounded) const {
  // round_size is monotonic: bisect for the largest n with round_size(n) <= rounded.
  if (rounded == 0) return 0;
  auto ok = [&](std::size_t n) {
    const std::optional<std::size_t> r = policy.round_size(n);
    return r && *r <= rounded;
  };
  if (!ok(1)) return 0;
  std::size_t lo = 1;            // ok
  std::size_t hi = rounded + 1;  // round_size(n) >= n: not ok
  while (hi - lo > 1) {
    const std::size_t mid = lo + (hi - lo) / 2;
    (ok(mid) ? lo : hi) = mid;
  }
  return lo;
}

std::size_t device_allocator::impl::max_allocatable(stream_handle stream) {
  // The pool before the locks: pool_for may create it (under pools_mu_, which lock_all shares).
  // Until every pool is locked another stream may be handed it: then look again.
  // In expandable mode the thread's sleep domain picks the pool, as in allocate.
  const std::uint64_t key = pools.stream_key(stream);
  const std::uint32_t domain = cfg.expandable_segments ? detail::t_sleep_domain : 0;
  stream_pool* own_pool = &pools.pool_for(stream, key, domain);
  detail::pool_table::all_locked all(pools);
  while (own_pool->key != key) {
    all.unlock();
    own_pool = &pools.pool_for(stream, key, domain);
    all.lock();
  }
  stream_pool& own = *own_pool;
  // An allocation under a sleeping tag is refused: nothing would be served.
  if (own.domain != 0 && sleeper.asleep(own.domain)) return 0;
  // The ladder's first step, taken now: pending frees become free blocks (and may coalesce).
  for (auto& q : pools) {
    detail::pool_table::assert_locked(*q);
    sync_pending(*q);
  }
  own.mu.assert_held();
  const bool blocked = sync_blocked();  // the ladder then releases nothing
  const std::size_t device_free = backend->mem_get_info().free_bytes;
  const std::size_t reserved_now = budget.reserved_bytes();
  const std::size_t device_total = budget.device_total;
  const std::size_t limit = budget.limit;
  std::size_t best = 0;

  if (!cfg.expandable_segments) {
    // 1. A cached free block of the stream's own pool that find_free would hand out.
    for (segment* s = own.segments; s != nullptr; s = s->next) {
      for (block* b = s->first; b != nullptr; b = b->next) {
        if (b->state != block_state::free) continue;
        const std::size_t cap = s->kind == pool_kind::small
                                    ? std::min(b->size, detail::k_small_request_max_bytes)
                                    : b->size;
        const std::size_t n = largest_request_within(cap);
        if (n <= best) continue;
        const std::optional<std::size_t> r = policy.round_size(n);
        if (!r || detail::size_policy::pool_for(*r) != s->kind) continue;
        if (find_free_outline(own, s->kind, *r) != nullptr) best = n;
      }
    }
    // 2. A new segment after the ladder released every whole free segment it may release.
    std::size_t releasable = 0;
    if (!blocked) {
      for (auto& q : pools) {
        detail::pool_table::assert_locked(*q);
        for (segment* s = q->segments; s != nullptr; s = s->next) {
          if (ladder_may_release(*q, *s)) releasable += s->size;
        }
      }
    }
    std::size_t room = std::min(device_free + releasable, device_total);
    if (limit != 0) room = std::min(room, limit - std::min(limit, reserved_now - releasable));
    // The largest request a new segment within `room` serves, per pool: asked of the rule that
    // sizes segments (size_policy::largest_growable_within), as grow() sizes them.
    for (const pool_kind kind : {pool_kind::small, pool_kind::large}) {
      best = std::max(best, largest_request_within(policy.largest_growable_within(room, kind)));
    }
    return best;
  }

  // Expandable segments: a request goes to the best fit among the free blocks of the pool's
  // virtual ranges of its kind, else to a new range (place_or_grow), and needs physical memory
  // for the pages of its span that no other block touches. The pager finds it on the device, in
  // unmapped handles and -- the ladder unmapping every idle page of every pool -- in idle
  // mappings, under the memory limit.
  // The idle pages of straddled chunks (a block touches part of the chunk) stay mapped through
  // the ladder: not reclaimable, but a request placed over them uses them in place (needed).
  std::size_t straddled = 0;
  for (auto& q : pools) {
    detail::pool_table::assert_locked(*q);
    straddled += pager->straddled_idle_bytes(*q);
  }
  const std::size_t reclaimable = pager->reclaimable_bytes(
      blocked ? 0 : pager->idle_bytes_of_every_pool_locked() - straddled);
  std::size_t avail = std::min(device_free + reclaimable, device_total);
  if (limit != 0) avail = std::min(avail, limit - std::min(limit, reserved_now - reclaimable));
  const std::size_t cap_all = limit != 0 ? std::min(device_total, limit) : device_total;
  for (pool_kind kind : {pool_kind::small, pool_kind::large}) {
    // The pages a request of `bytes` placed at `addr` of hole h needs: those its carve touches
    // anew, asked of the rule the carve (pager::touch_carved) uses, less the idle pages of
    // straddled chunks among them, which it uses in place (such a chunk holds a page a block
    // touches, so it meets a hole that starts at addr only at the request's first or last page); a
    // new range's one block (h == nullptr) shares no page.
    auto needed = [&](const block* h, std::uintptr_t addr, std::size_t bytes) {
      if (h == nullptr) return detail::round_up(bytes, page_bytes);
      const detail::vm_range& r = *h->seg->vm;
      std::size_t pages = detail::pager::fresh_pages(r, addr, bytes);
      if (r.chunks != 0 && pages != 0) {
        const std::size_t first = r.page_of(addr);
        const std::size_t last = r.page_of(addr + bytes - 1);
        const detail::page_span a = r.mapping_of(first);
        const detail::page_span z = r.mapping_of(last);
        pages -= r.straddled_idle_pages(a, first, last + 1);
        if (z.first != a.first) pages -= r.straddled_idle_pages(z, first, last + 1);
      }
      return pages * page_bytes;
    };
    std::vector<const block*> holes;
    for (const segment* range : own.pages.ranges()) {
      if (range->kind != kind) continue;
      for (const block* b = range->first; b != nullptr; b = b->next) {
        if (b->state == block_state::free) holes.push_back(b);
      }
    }
    std::sort(holes.begin(), holes.end(), [](const block* a, const block* b) {
      return a->size != b->size ? a->size < b->size : a->addr < b->addr;
    });
    holes.push_back(nullptr);  // what no hole holds goes to a new range, as large as need be
    const std::size_t kind_lo = kind == pool_kind::small ? 0 : detail::k_small_request_max_bytes;
    const std::size_t kind_hi =
        kind == pool_kind::small ? detail::k_small_request_max_bytes : cap_all;
    std::size_t lo = 0;  // rounded sizes up to lo land in a smaller hole
    for (const block* h : holes) {
      const std::size_t size = h == nullptr ? kind_hi : h->size;
      if (size <= lo) continue;  // an equal hole at a higher address never gets the request
      // Rounded sizes in (lo, size] land in h: the largest of them whose pages fit.
      const std::size_t from = std::max(lo, kind_lo);
      const std::size_t to = std::min(size, kind_hi);
      lo = size;
      if (to <= from) continue;
      const std::uintptr_t addr = h == nullptr ? 0 : h->addr;
      std::size_t good = 0;
      std::size_t a = round_down(from, k_granule) / k_granule;  // in granules; a*g <= from
      std::size_t z = round_down(to, k_granule) / k_granule;
      if (z * k_granule <= from) continue;
      if (needed(h, addr, z * k_granule) <= avail) {
        good = z * k_granule;
      } else {
        while (z - a > 1) {  // invariant: z fails; a*g <= from or a passes
          const std::size_t mid = a + (z - a) / 2;
          (needed(h, addr, mid * k_granule) <= avail ? a : z) = mid;
        }
        if (a * k_granule > from) good = a * k_granule;
      }
      if (good == 0) continue;
      const std::size_t n = largest_request_within(good);
      if (n <= best) continue;
      const std::optional<std::size_t> r = policy.round_size(n);
      if (r && *r > from && *r <= to && detail::size_policy::pool_for(*r) == kind) best = n;
    }
  }
  return best;
}

void device_allocator::impl::reserve(std::size_t bytes, stream_handle stream) {
  if (bytes == 0) return;
  // In expandable mode the thread's sleep domain picks the pool, as in allocate: the pages
  // reserved under a sleepable tag are that tag's, given back by its sleep.
  // Every pool's idle bytes (what the ladder could unmap), read before this pool's lock is held,
  // under every pool's: each lock settles its pool's held block (defer_coalescing), whose pages
  // count as idle as after any free.
  std::size_t idle_now = 0;
  if (cfg.expandable_segments) {
    const detail::pool_table::all_locked all(pools, detail::pool_table::purpose::read);
    idle_now = pager->idle_bytes_of_every_pool_locked();
  }
  detail::pool_table::locked_pool lp = pools.lock_pool_for(
      stream, pools.stream_key(stream), cfg.expandable_segments ? detail::t_sleep_domain : 0);
  stream_pool& p = *lp.pool;
  detail::pool_lock& lk = lp.lock;
  p.mu.assert_held();  // lp.lock holds it (the analysis cannot follow a lock out of a call)
  sleeper.refuse_if_asleep(p, nullptr, "reserve");
  if (!cfg.expandable_segments) {
    // One large-pool segment, through the path a request that misses the cache takes.
    const std::size_t seg = bytes > detail::k_max_request_bytes
                                ? 0
                                : (bytes + detail::k_large_segment_round_bytes - 1) /
                                      detail::k_large_segment_round_bytes *
                                      detail::k_large_segment_round_bytes;
    if (seg != 0 && seg <= budget.device_total &&
        new_segment(p, pool_kind::large, seg) != nullptr) {
      return;
    }
    lk.unlock(p.mu);
    if (seg == 0) {
      // Its rounding to a segment size would overflow: no device can hold it.
      throw out_of_memory(fmt::format(
          "cucache: reserve({} bytes) on device {} ({}): larger than any segment can be (the "
          "largest request cucache accepts is {} bytes; the device has {} bytes)",
          bytes, backend->device(), backend->name(), detail::k_max_request_bytes,
          budget.device_total));
    }
    throw out_of_memory(fmt::format(
        "cucache: reserve({} bytes) on device {} ({}): the device (or the memory limit) has no "
        "room for a segment of {} bytes",
        bytes, backend->device(), backend->name(), seg));
  }
  // Expandable: back the pages at the front of the large ranges' best fit (a new range when no
  // free block holds them), as a block there would be placed, without carving one: the new
  // mappings are idle from the start, cached memory that the first requests placed there use in
  // place, one handle per page as back() makes them.
  const std::size_t want =
      bytes > budget.device_total ? 0 : (bytes + page_bytes - 1) / page_bytes * page_bytes;
  bool room = want != 0;
  if (room) {
    // Nothing partial: refuse before reserving or mapping anything when the device or the limit
    // lacks room.
    const std::size_t device_free = backend->mem_get_info().free_bytes;
    const std::size_t reclaimable = pager->reclaimable_bytes(sync_blocked() ? 0 : idle_now);
    const std::size_t reserved_now = budget.reserved_bytes();
    room = want <= device_free + reclaimable &&
           (budget.limit == 0 || reserved_now - reclaimable + want <= budget.limit);
  }
  block* hole = room ? place_or_grow(p, pool_kind::large, want) : nullptr;
  if (hole != nullptr) {
    bool mapped = false;
    try {
      mapped = pager->map_idle_pages(p, *hole->seg->vm, hole->addr, want);
    } catch (...) {
      pager->unmap_idle(p, /*release=*/true);
      throw;
    }
    if (mapped) return;
    pager->unmap_idle(p, /*release=*/true);
  }
  lk.unlock(p.mu);
  if (want == 0) {
    throw out_of_memory(fmt::format(
        "cucache: reserve({} bytes) on device {} ({}): larger than the device ({} bytes)", bytes,
        backend->device(), backend->name(), budget.device_total));
  }
  if (room) {
    throw out_of_memory(fmt::format(
        "cucache: reserve({} bytes) on device {} ({}): no virtual address space left for a "
        "range of {} bytes",
        bytes, backend->device(), backend->name(), want));
  }
  throw out_of_memory(fmt::format(
      "cucache: reserve({} bytes) on device {} ({}): the device (or the memory limit) has no "
      "room for {} bytes of pages",
      bytes, backend->device(), backend->name(), want));
}

// --- public shell -----------------------------------------------------------------------------

std::size_t device_allocator::max_allocatable(stream_handle stream) {
  return impl_->max_allocatable(stream);
}

std::size_t device_allocator::impl::largest_cached_request(const stream_pool& p) const {
  // The largest request p serves with no device allocation (docs/design.md, "Free memory").
  // Default mode, and graph pools in every mode: the block find_free() picks, under the
  // max_split_size rules; small requests stop at 1 MiB. Expandable mode: the pager's dry run of
  // its placement.
  std::size_t best = 0;
  for (const pool_kind kind : {pool_kind::small, pool_kind::large}) {
    if (cfg.expandable_segments && p.graph == nullptr) {
      best = std::max(best, pager->largest_cached_request(p, kind, policy));
      continue;
    }
    const bool small = kind == pool_kind::small;
    p.index_of(kind).for_each([&](const detail::block* b) {
      p.mu.assert_held();  // a lambda: the analysis does not carry the caller's locks into it
      const std::size_t r = policy.largest_rounded_within(
          small ? std::min(b->size, detail::k_small_request_max_bytes) : b->size);
      if (r <= best || (!small && r <= detail::k_small_request_max_bytes)) return;
      if (find_free_outline(p, kind, r) != nullptr) best = r;
    });
  }
  return best;
}

void device_allocator::reserve(std::size_t bytes, stream_handle stream) {
  impl_->reserve(bytes, stream);
}

}  // namespace cucache
