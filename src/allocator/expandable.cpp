// Expandable segments: allocation on reserved virtual ranges backed on demand by physical handles.
// What a request needs comes, in order, from unmapped handles kept for reuse, from idle mappings
// of the same pool moved to where they are needed (stitching: the data there is dead), and only
// then from new physical memory -- in one handle per contiguous run (up to k_max_handle_bytes),
// so a large request costs one create+map instead of hundreds.
#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "allocator/allocator_impl.hpp"
#include "cucache/errors.hpp"

namespace cucache {

using detail::block;
using detail::block_state;
using detail::pool_kind;
using detail::segment;
using detail::stream_pool;
using detail::vm_mapping;
using detail::vm_range;

namespace {
/// Largest physical handle created at once. Larger handles cost the same to create and map, but
/// can only be moved whole; 256 MiB keeps a 1 GiB request at four calls.
constexpr std::size_t k_max_handle_bytes = std::size_t{256} << 20;
/// Free blocks examined, in best-fit order, for a placement whose pages are already mapped.
constexpr int k_placement_probes = 4;
// Measured on the seven traces of ../shared/traces (sim, peak reserved / peak requested, VM calls):
// moving pages whenever possible gave a geometric mean of 1.005 with 8.6k-282k VM calls per
// trace; moving only above the high-water mark gives 1.009 with 4.6k-165k (docs/benchmarks.md).

std::size_t round_up(std::size_t n, std::size_t m) {
  return (n + m - 1) / m * m;
}
}  // namespace

segment* device_allocator::impl::ensure_range(stream_pool& p, pool_kind kind) {
  const int k = static_cast<int>(kind);
  if (p.ranges[k] != nullptr) return p.ranges[k];
  // Virtual space is cheap: twice the device for the large pool, once for the small one, so that
  // holes between live blocks never exhaust it.
  const std::size_t bytes =
      round_up(kind == pool_kind::small ? device_total : 2 * device_total, page_bytes);
  void* va = backend->va_reserve(bytes);
  auto range = std::make_unique<vm_range>();
  range->base = reinterpret_cast<std::uintptr_t>(va);
  range->size = bytes;
  range->page_bytes = page_bytes;
  range->kind = kind;
  range->page_map.assign(bytes / page_bytes, nullptr);
  range->page_use.assign(bytes / page_bytes, 0);
  segment* s = add_segment(p, kind, range->base, bytes, range.get());
  range.release();  // owned by the segment from here (destroy_range deletes it)
  p.ranges[k] = s;
  return s;
}

void device_allocator::impl::idle_link(stream_pool& p, vm_mapping* m) {
  m->idle = true;
  m->idle_prev = nullptr;
  m->idle_next = p.idle_head;
  if (p.idle_head != nullptr) p.idle_head->idle_prev = m;
  p.idle_head = m;
  p.idle_bytes += m->pages * page_bytes;
}

void device_allocator::impl::idle_unlink(stream_pool& p, vm_mapping* m) {
  if (m->idle_prev != nullptr) m->idle_prev->idle_next = m->idle_next;
  if (m->idle_next != nullptr) m->idle_next->idle_prev = m->idle_prev;
  if (p.idle_head == m) p.idle_head = m->idle_next;
  m->idle_prev = m->idle_next = nullptr;
  m->idle = false;
  p.idle_bytes -= m->pages * page_bytes;
}

void device_allocator::impl::touch_pages(stream_pool& p, const block* b, int delta) {
  vm_range& r = *b->seg->vm;
  const std::size_t first = r.page_of(b->addr);
  const std::size_t last = r.page_of(b->addr + b->size - 1);
  for (std::size_t pg = first; pg <= last; ++pg) {
    vm_mapping* m = r.page_map[pg];
    if (delta > 0) {
      if (r.page_use[pg]++ == 0 && m != nullptr && m->used_pages++ == 0) idle_unlink(p, m);
    } else {
      if (--r.page_use[pg] == 0 && m != nullptr && --m->used_pages == 0) idle_link(p, m);
    }
  }
}

void device_allocator::impl::release_handle(phys_handle h, std::size_t bytes) {
  std::lock_guard lock(grow_mu_);
  try {
    backend->phys_release(h);
  } catch (...) {
    keep_handle_locked(h, bytes);  // still ours: keep it tracked, never leak it
    throw;
  }
  reserved -= bytes;
  vm_release_count.fetch_add(1, std::memory_order_relaxed);
  device_free_count.fetch_add(1, std::memory_order_relaxed);
}

void device_allocator::impl::release_free_handles(std::size_t target_reserved) {
  std::lock_guard lock(grow_mu_);
  while (reserved > target_reserved && !free_handles.empty()) {
    auto it = std::prev(free_handles.end());
    const auto [bytes, h] = *it;
    backend->phys_release(h);  // a failure leaves the handle listed
    free_handles.erase(it);
    free_handle_bytes -= bytes;
    reserved -= bytes;
    vm_release_count.fetch_add(1, std::memory_order_relaxed);
    device_free_count.fetch_add(1, std::memory_order_relaxed);
  }
}

phys_handle device_allocator::impl::unmap_mapping(stream_pool& p, vm_mapping* m) {
  vm_range& r = *m->range;
  const std::size_t bytes = m->pages * page_bytes;
  backend->unmap(reinterpret_cast<void*>(r.page_addr(m->first_page)), bytes);
  vm_unmap_count.fetch_add(1, std::memory_order_relaxed);
  for (std::size_t i = 0; i < m->pages; ++i) r.page_map[m->first_page + i] = nullptr;
  r.mapped_pages -= m->pages;
  if (m->idle) idle_unlink(p, m);
  p.stats.reserved_bytes.dec(r.kind, static_cast<std::int64_t>(bytes));
  p.stats.segment_count.dec(r.kind, 1);
  const phys_handle h = m->handle;
  p.maps.recycle(m);
  return h;
}

void device_allocator::impl::map_handle(stream_pool& p, vm_range& r, std::size_t first_page,
                                        std::size_t pages, phys_handle h, bool stitched) {
  void* va = reinterpret_cast<void*>(r.page_addr(first_page));
  const std::size_t bytes = pages * page_bytes;
  try {
    backend->map(va, bytes, h);
  } catch (...) {
    keep_handle(h, bytes);
    throw;
  }
  vm_map_count.fetch_add(1, std::memory_order_relaxed);
  try {
    backend->set_access(va, bytes);
  } catch (...) {
    // Leave nothing half-mapped: undo the map, keep the handle for reuse.
    try {
      backend->unmap(va, bytes);
      vm_unmap_count.fetch_add(1, std::memory_order_relaxed);
      keep_handle(h, bytes);
    } catch (...) {
      // The mapping could not be undone: record it as mapped (idle unless used) so it stays
      // tracked.
      record_mapping(p, r, first_page, pages, h);
    }
    throw;
  }
  if (stitched) stitched_pages.fetch_add(pages, std::memory_order_relaxed);
  record_mapping(p, r, first_page, pages, h);
}

void device_allocator::impl::record_mapping(stream_pool& p, vm_range& r, std::size_t first_page,
                                            std::size_t pages, phys_handle h) {
  vm_mapping* m = p.maps.make();
  *m = vm_mapping{&r, first_page, pages, h, 0, nullptr, nullptr, false};
  for (std::size_t i = 0; i < pages; ++i) {
    r.page_map[first_page + i] = m;
    m->used_pages += r.page_use[first_page + i] > 0;
  }
  r.mapped_pages += pages;
  p.stats.reserved_bytes.inc(r.kind, static_cast<std::int64_t>(pages * page_bytes));
  p.stats.segment_count.inc(r.kind, 1);
  if (m->used_pages == 0) idle_link(p, m);
}

void device_allocator::impl::keep_handle_locked(phys_handle h, std::size_t bytes) {
  free_handles.emplace(bytes, h);
  free_handle_bytes += bytes;
}

void device_allocator::impl::keep_handle(phys_handle h, std::size_t bytes) {
  std::lock_guard lock(grow_mu_);
  keep_handle_locked(h, bytes);
}

std::optional<phys_handle> device_allocator::impl::create_handle(stream_pool& p,
                                                                 std::size_t bytes) {
  auto over = [&](std::size_t cap) { return cap != 0 && reserved + bytes > cap; };
  bool need_room = false;
  {
    std::lock_guard lock(grow_mu_);
    need_room = over(limit) || over(gc_bytes);
  }
  if (need_room) {
    // Under a limit or the garbage-collection threshold: give back unused physical memory first.
    const std::size_t cap = limit != 0 && (gc_bytes == 0 || limit < gc_bytes) ? limit : gc_bytes;
    release_free_handles(cap > bytes ? cap - bytes : 0);
    bool still = false;
    {
      std::lock_guard lock(grow_mu_);
      still = over(cap);
    }
    if (still && p.idle_head != nullptr) {
      wait_until_idle_pages_unused();
      while (p.idle_head != nullptr) {
        {
          std::lock_guard lock(grow_mu_);
          if (!over(cap)) break;
        }
        const std::size_t mbytes = p.idle_head->pages * page_bytes;
        release_handle(unmap_mapping(p, p.idle_head), mbytes);
      }
    }
  }
  std::lock_guard lock(grow_mu_);
  if (over(limit)) return std::nullopt;
  std::optional<phys_handle> h = backend->phys_create(bytes);
  if (!h) return std::nullopt;
  reserved += bytes;
  reserved_peak = std::max(reserved_peak, reserved);
  vm_create_count.fetch_add(1, std::memory_order_relaxed);
  device_alloc_count.fetch_add(1, std::memory_order_relaxed);
  return h;
}

bool device_allocator::impl::ensure_mapped(stream_pool& p, block* b) {
  vm_range& r = *b->seg->vm;
  const std::size_t first = r.page_of(b->addr);
  const std::size_t last = r.page_of(b->addr + b->size - 1);
  bool synced = false;
  for (std::size_t pg = first; pg <= last;) {
    if (r.page_map[pg] != nullptr) {
      ++pg;
      continue;
    }
    std::size_t run = 0;
    while (pg + run <= last && r.page_map[pg + run] == nullptr) ++run;
    const std::size_t run_start = pg;
    while (run > 0) {
      // The first and last page of a run get handles of their own: they may be shared with a
      // neighbouring block, and a handle that a neighbour keeps in use cannot be moved.
      const std::size_t want_pages = pg == run_start || run == 1 ? 1 : run - 1;
      const std::size_t want = want_pages * page_bytes;
      std::optional<phys_handle> h;
      std::size_t got = 0;
      bool stitched = false;
      // 1. An unmapped handle kept for reuse: the largest that fits the run.
      {
        std::lock_guard lock(grow_mu_);
        auto it = free_handles.upper_bound(want);
        if (it != free_handles.begin()) {
          --it;
          got = it->first;
          h = it->second;
          free_handles.erase(it);
          free_handle_bytes -= got;
        }
      }
      // 2. Stitch: move the largest idle mapping of this pool that fits the run -- unless new
      //    memory can be created without raising the peak (may_grow_in_place).
      if (!h && !may_grow_in_place(p, std::min(want, k_max_handle_bytes))) {
        vm_mapping* best = nullptr;
        for (vm_mapping* m = p.idle_head; m != nullptr; m = m->idle_next) {
          if (m->pages * page_bytes <= want && (best == nullptr || m->pages > best->pages)) {
            best = m;
          }
        }
        if (best != nullptr) {
          if (!synced) {
            // Unmapping is not stream-ordered: work queued before the free may still read the
            // page at its old address.
            wait_until_idle_pages_unused();
            synced = true;
          }
          got = best->pages * page_bytes;
          h = unmap_mapping(p, best);
          stitched = true;
        }
      }
      // 3. New physical memory, after giving back an idle or unmapped handle too large to reuse
      //    here, so that reserved memory does not grow while unused memory sits elsewhere.
      if (!h) {
        const std::size_t bytes = std::min(want, k_max_handle_bytes);
        bool released = false;
        {
          std::unique_lock lock(grow_mu_);
          auto it = free_handles.lower_bound(want + 1);
          if (it != free_handles.end()) {
            const auto [hb, hh] = *it;
            free_handles.erase(it);
            free_handle_bytes -= hb;
            lock.unlock();
            release_handle(hh, hb);
            released = true;
          }
        }
        if (!released && p.idle_head != nullptr && !may_grow_in_place(p, bytes)) {
          vm_mapping* big = nullptr;
          for (vm_mapping* m = p.idle_head; m != nullptr; m = m->idle_next) {
            if (big == nullptr || m->pages < big->pages) big = m;
          }
          if (!synced) {
            wait_until_idle_pages_unused();
            synced = true;
          }
          const std::size_t hb = big->pages * page_bytes;
          release_handle(unmap_mapping(p, big), hb);
        }
        h = create_handle(p, bytes);
        if (!h) return false;
        got = bytes;
      }
      const std::size_t pages = got / page_bytes;
      map_handle(p, r, pg, pages, *h, stitched);
      pg += pages;
      run -= pages;
    }
  }
  return true;
}

void device_allocator::impl::split_idle_overhang(stream_pool& p, vm_range& r, std::uintptr_t addr,
                                                 std::size_t bytes) {
  // An idle mapping that the new block would use only in part would be pinned whole by it: the
  // rest could no longer be moved. Release it instead; ensure_mapped backs exactly the block.
  // Only in eager mode: otherwise the churn of release and re-creation costs more than the
  // memory it frees is worth.
  if (!cfg.eager_stitching) return;
  const std::size_t first = r.page_of(addr);
  const std::size_t last = r.page_of(addr + bytes - 1);
  bool synced = false;
  for (std::size_t pg : {first, last}) {
    vm_mapping* m = r.page_map[pg];
    if (m == nullptr || !m->idle) continue;
    if (m->first_page >= first && m->first_page + m->pages - 1 <= last) continue;
    if (!synced) {
      wait_until_idle_pages_unused();
      synced = true;
    }
    const std::size_t mbytes = m->pages * page_bytes;
    release_handle(unmap_mapping(p, m), mbytes);
  }
}

namespace {
std::size_t unmapped_pages(const vm_range& r, std::uintptr_t addr, std::size_t bytes) {
  // A span outside the page table is never a placement (a request that cannot fit was refused
  // before; this keeps a bad size from reading past the table).
  if (!r.holds(addr, bytes)) return std::numeric_limits<std::size_t>::max();
  std::size_t n = 0;
  for (std::size_t pg = r.page_of(addr), last = r.page_of(addr + bytes - 1); pg <= last; ++pg) {
    n += r.page_map[pg] == nullptr;
  }
  return n;
}
}  // namespace

std::pair<block*, bool> device_allocator::impl::place(detail::free_index& index,
                                                      std::size_t rounded) const {
  // Best fit at the front of the block, unless that needs VM calls: then, among the first
  // k_placement_probes candidates in best-fit order, the front or back placement with the fewest
  // unmapped pages. Freed blocks keep their pages, so a request that fits a freed block's place
  // moves nothing; and a buffer that grows step by step (a KV cache) is placed at the back of the
  // hole it leaves, on its own mapped pages, instead of leapfrogging and moving them every step.
  block* best = index.best_fit(rounded);
  if (best == nullptr || !best->seg->vm->holds(best->addr, rounded)) return {nullptr, false};
  std::size_t best_cost = unmapped_pages(*best->seg->vm, best->addr, rounded);
  if (best_cost == 0) return {best, false};
  block* choice = best;
  bool back = false;
  block* cand = best;
  for (int i = 0; cand != nullptr && i < k_placement_probes; ++i, cand = index.next_fit(cand)) {
    const vm_range& r = *cand->seg->vm;
    const std::size_t front = i == 0 ? best_cost : unmapped_pages(r, cand->addr, rounded);
    if (front < best_cost) {
      best_cost = front;
      choice = cand;
      back = false;
    }
    if (cand->size > rounded && cand->size - rounded < r.size / 2) {  // not the open tail
      const std::size_t tail = unmapped_pages(r, cand->addr + cand->size - rounded, rounded);
      if (tail < best_cost) {
        best_cost = tail;
        choice = cand;
        back = true;
      }
    }
    if (best_cost == 0) break;
  }
  return {choice, back};
}

block* device_allocator::impl::split_for_back(stream_pool& p, pool_kind kind, block* b,
                                              std::size_t rounded) {
  // REQUIRES: b free and indexed, b->size > rounded. Leaves b's front free and indexed, returns
  // its last `rounded` bytes as a free, indexed block.
  auto& index = p.index_of(kind);
  index.erase(b);
  block* back = split_off(p, b, b->size - rounded);
  b->size -= rounded;
  index.insert(b);
  index.insert(back);
  return back;
}

bool device_allocator::impl::may_grow_in_place(stream_pool& p, std::size_t extra) {
  // Moving a page costs an unmap, a map and a set-access (~100 us on an H200) plus a stream
  // synchronization. Creating instead costs about as much and is harmless while reserved memory
  // stays at or below its high-water mark (the peak does not move), or at or below the pool's
  // active bytes -- which, during ensure_mapped, already count the block being backed (no memory
  // would sit idle). Idle pages then stay where steady loops will want them again.
  const auto active = static_cast<std::size_t>(p.stats.active_bytes(0).current);
  std::lock_guard lock(grow_mu_);
  return reserved + extra <= std::max(reserved_peak, active);
}

void device_allocator::impl::undo_carve(stream_pool& p, block* b) {
  const pool_kind kind = b->seg->kind;
  p.stats.on_free(kind, static_cast<std::int64_t>(b->size),
                  static_cast<std::int64_t>(b->requested));
  b->requested = 0;
  release_to_free(p, b);
}

void device_allocator::impl::wait_until_idle_pages_unused() {
  // An idle page belonged to freed blocks. Work queued on the pool's stream before a free may
  // still read or write it (other streams' uses were waited for, by events, before the block
  // became free), and unmapping is not stream-ordered. The pool's stream cannot be named: the
  // program may have destroyed it since (the driver crashes on the dangling handle, or, once the
  // handle is reused, waits on somebody else's stream). A device-wide synchronization names no
  // stream and waits for the work of every stream, destroyed ones included.
  backend->device_synchronize();
}

void device_allocator::impl::unmap_idle(stream_pool& p, bool release) {
  if (p.idle_head == nullptr) return;
  wait_until_idle_pages_unused();
  while (p.idle_head != nullptr) {
    const std::size_t bytes = p.idle_head->pages * page_bytes;
    const phys_handle h = unmap_mapping(p, p.idle_head);
    if (release) {
      release_handle(h, bytes);
    } else {
      keep_handle(h, bytes);
    }
  }
}

void device_allocator::impl::destroy_range(stream_pool& p, segment* s) noexcept {
  vm_range* r = s->vm;
  for (std::size_t pg = 0; pg < r->page_map.size(); ++pg) {
    vm_mapping* m = r->page_map[pg];
    if (m == nullptr || m->first_page != pg) continue;
    try {
      backend->unmap(reinterpret_cast<void*>(r->page_addr(pg)), m->pages * page_bytes);
      backend->phys_release(m->handle);
    } catch (...) {
    }
  }
  try {
    backend->va_free(reinterpret_cast<void*>(r->base), r->size);
  } catch (...) {
  }
  (void)p;
  delete r;
  s->vm = nullptr;
}

void* device_allocator::impl::allocate_expandable(stream_pool& p, pool_kind kind,
                                                  std::size_t rounded, std::size_t bytes,
                                                  std::unique_lock<detail::pool_mutex>& lk) {
  if (rounded > device_total || (limit != 0 && rounded > limit)) return nullptr;  // never fits
  for (int attempt = 0; attempt < 2; ++attempt) {
    ensure_range(p, kind);
    auto [b, at_back] = place(p.index_of(kind), rounded);
    if (b == nullptr) return nullptr;  // the virtual range itself is exhausted
    // May throw (a failed unmap): before any block changes, so nothing is left half done.
    split_idle_overhang(p, *b->seg->vm, at_back ? b->addr + b->size - rounded : b->addr, rounded);
    if (at_back) b = split_for_back(p, kind, b, rounded);
    b = carve(p, b, kind, rounded, bytes);
    bool mapped = false;
    try {
      mapped = ensure_mapped(p, b);
    } catch (...) {
      undo_carve(p, b);
      throw;
    }
    if (mapped) {
      blocks.insert(b->addr, b);
      return reinterpret_cast<void*>(b->addr);
    }
    undo_carve(p, b);
    if (attempt == 1) break;
    // Out-of-memory ladder: wait for pending frees everywhere, move every idle page of every
    // pool into the reusable handle list, and try once more.
    retry_count.fetch_add(1, std::memory_order_relaxed);
    lk.unlock();
    {
      auto all = lock_all();
      for (auto& q : pools) sync_pending(*q);
      for (auto& q : pools) unmap_idle(*q, /*release=*/false);
    }
    lk.lock();
  }
  return nullptr;
}

}  // namespace cucache
