// The pager of expandable segments (see pager.hpp and docs/design.md, "Expandable segments").
#include "allocator/pager.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "allocator/nvtx.hpp"
#include "allocator/placement.hpp"
#include "cucache/errors.hpp"

namespace cucache::detail {

pager::pager(device_backend& backend, device_budget& budget, std::size_t page_bytes,
             pool_table& pools)
    : backend_(backend),
      budget_(budget),
      page_bytes_(page_bytes),
      device_total_(budget.device_total),
      table_(pools),
      pools_mu_(pools.list_mutex()),
      pools_(pools.list()) {}

pager::~pager() {
  for (const auto& entry : free_handles) {
    try {
      timed(counters.vm_ns, [&] { backend_.phys_release(entry.second); });
    } catch (...) {
    }
  }
}

// --- ranges and the page table ------------------------------------------------------------------

std::size_t pager::next_range_bytes(pool_kind kind, std::size_t need,
                                    std::size_t held) const noexcept {
  // Virtual space is cheap but not endless: the process's address space holds a few hundred
  // ranges of a large device's size (the H200 refused cuMemAddressReserve after ~935 of 141 GB,
  // 128 TiB in all). So full-size ranges -- the layout every program with a few streams gets --
  // only while the device's ranges stay within the budget, and small ones that double after it.
  // The page table's storage follows what is mapped and used, not a range's size (vm_range.hpp).
  const std::size_t full =
      round_up(kind == pool_kind::small ? device_total_ : 2 * device_total_, page_bytes_);
  const std::size_t needed = round_up(need, page_bytes_);
  if (held == 0 && reserved_address_bytes() + full <= k_address_budget_devices * device_total_) {
    return std::max(full, needed);
  }
  const std::size_t grown = std::max(k_first_small_range_pages * page_bytes_, 2 * held);
  return std::max(std::min(grown, full), needed);
}

std::unique_ptr<vm_range> pager::reserve_range(pool_kind kind, std::size_t bytes) {
  void* va = backend_.va_reserve(bytes);
  if (va == nullptr) return nullptr;  // no address space left
  std::unique_ptr<vm_range> r;
  try {
    r = std::make_unique<vm_range>(reinterpret_cast<std::uintptr_t>(va), bytes, page_bytes_, kind);
  } catch (...) {
    try {
      backend_.va_free(va, bytes);
    } catch (...) {
    }
    throw;
  }
  address_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  return r;
}

void pager::destroy_range(vm_range& r) noexcept {
  // Its idle runs leave their pool's list (the pool may outlive the range), its parked span the
  // pool.
  if (pool_pages* owner = r.idle_owner) {
    if (owner->parked() == &r) {
      const std::size_t bytes = (r.parked_end - r.parked_first) * page_bytes_;
      owner->sub_idle_bytes(bytes);
      owner->set_parked(nullptr);
      r.parked_first = r.parked_end = 0;
    }
    for (idle_run* u = r.idle_runs.front(); u != nullptr;) {
      idle_run* n = r.idle_runs.next(u);
      r.idle_runs.erase(u);
      owner->unlink(u);
      owner->sub_idle_bytes(u->pages() * page_bytes_);
      owner->recycle_run(u);
      u = n;
    }
  }
  r.pages.for_each([&](std::size_t pg, const vm_page& e) {
    if (e.chunk_index != 0) return;  // a chunk is unmapped and released at its first page
    const std::size_t pages = e.chunk_pages != 0 ? e.chunk_pages : 1;
    try {
      timed(counters.vm_ns, [&] {
        backend_.unmap(reinterpret_cast<void*>(r.page_addr(pg)), pages * page_bytes_);
        backend_.phys_release(e.handle);
      });
    } catch (...) {
    }
  });
  try {
    backend_.va_free(reinterpret_cast<void*>(r.base), r.size);
  } catch (...) {
  }
  address_bytes_.fetch_sub(r.size, std::memory_order_relaxed);
}

// --- the idle runs ------------------------------------------------------------------------------

// The helpers of a cache hit's touch are inlined into it (CUCACHE_HOT; used in this file only).
CUCACHE_HOT void pager::add_idle_bytes(stream_pool& p, std::size_t pages, bool add) noexcept {
  const std::size_t bytes = pages * page_bytes_;
  if (add) {
    p.pages.add_idle_bytes(bytes);
  } else {
    p.pages.sub_idle_bytes(bytes);
  }
}

void pager::list_unlink(stream_pool& p, idle_run* u) noexcept {
  p.pages.unlink(u);
  u->newer = u->older = nullptr;
}

void pager::idle_add(stream_pool& p, vm_range& r, std::size_t first, std::size_t end,
                     std::uint64_t epoch) {
  // REQUIRES: every page of [first, end) mapped, touched by no block, in no idle run.
  unpark(p);  // the parked pages went idle before these
  link_run(p, r, first, end, epoch);
  add_idle_bytes(p, end - first, true);
}

CUCACHE_HOT void pager::park(stream_pool& p, vm_range& r, std::size_t first, std::size_t end,
                             std::uint64_t epoch) {
  // REQUIRES: as idle_add.
  if (p.pages.parked() == &r && r.parked_end == first && r.parked_epoch == epoch) {
    r.parked_end = end;  // continues the parked span, as idle_add joins the head run
    add_idle_bytes(p, end - first, true);
    return;
  }
  if (p.pages.parked() != nullptr) unpark(p);
  r.idle_owner = &p.pages;
  r.parked_first = first;
  r.parked_end = end;
  r.parked_epoch = epoch;
  p.pages.set_parked(&r);
  add_idle_bytes(p, end - first, true);
}

void pager::unpark(stream_pool& p) {
  vm_range* r = p.pages.parked();
  if (r == nullptr) [[likely]]
    return;
  link_run(p, *r, r->parked_first, r->parked_end, r->parked_epoch);  // may throw: nothing changed
  r->parked_first = r->parked_end = 0;
  p.pages.set_parked(nullptr);
}

void pager::link_run(stream_pool& p, vm_range& r, std::size_t first, std::size_t end,
                     std::uint64_t epoch) {
  r.idle_owner = &p.pages;
  idle_run* h = p.pages.idle_head();
  if (h != nullptr && h->range == &r && h->end == first && h->epoch == epoch) {
    h->end = end;  // the head's pages went idle just before, in address order: one run
    return;
  }
  idle_run* u = p.pages.make_run();
  u->first = first;
  try {
    r.idle_runs.insert(u);
  } catch (...) {
    p.pages.recycle_run(u);
    throw;
  }
  u->range = &r;
  u->end = end;
  u->epoch = epoch;
  p.pages.push_newest(u);
}

CUCACHE_HOT void pager::make_idle(stream_pool& p, vm_range& r, std::size_t first, std::size_t last,
                                  std::uint64_t epoch) {
  if (r.all_mapped(first, last)) [[likely]] {
    park(p, r, first, last + 1, epoch);
    return;
  }
  r.for_each_mapped_run(first, last, [&](std::size_t a, std::size_t e) {
    p.mu.assert_held();  // a lambda: the caller's locks are not carried in
    idle_add(p, r, a, e, epoch);
  });
}

CUCACHE_HOT bool pager::take_parked(stream_pool& p, vm_range& r, std::size_t first,
                                    std::size_t last) noexcept {
  // A carve of the block just freed (a cache hit): the span, or one end of it, leaves.
  if (r.parked_first == first && r.parked_end > last) {
    add_idle_bytes(p, last + 1 - first, false);
    r.parked_first = last + 1;
    if (r.parked_first == r.parked_end) {
      r.parked_first = r.parked_end = 0;
      p.pages.set_parked(nullptr);
    }
    return true;
  }
  if (r.parked_first < first && r.parked_end == last + 1) {
    add_idle_bytes(p, last + 1 - first, false);
    r.parked_end = first;
    return true;
  }
  return false;
}

void pager::idle_remove(stream_pool& p, vm_range& r, std::size_t first, std::size_t last) {
  if (r.parked_end > first && r.parked_first <= last) {  // [first, last] meets the parked span
    if (take_parked(p, r, first, last)) return;
    unpark(p);  // a split of the span, or pages beyond it: the runs' general path
  }
  idle_run* u = nullptr;
  if (idle_run* h = p.pages.idle_head();
      h != nullptr && h->range == &r && h->first <= first && h->end > last) {
    u = h;  // the most recently idle run holds the span (a loop's carve): the only one
  } else {
    u = r.idle_runs.first_meeting(first);
  }
  while (u != nullptr && u->first <= last) {
    if (u->first < first && u->end > last + 1) {
      // [first, last] inside u: u keeps its lower part, a run of the upper part goes just newer
      // than it (the upper pages went idle after the lower ones, before every newer run's).
      idle_run* hi = p.pages.make_run();
      hi->first = last + 1;
      try {
        r.idle_runs.insert(hi);
      } catch (...) {
        p.pages.recycle_run(hi);
        throw;
      }
      hi->range = &r;
      hi->end = u->end;
      hi->epoch = u->epoch;
      p.pages.insert_newer(u, hi);
      u->end = first;
      add_idle_bytes(p, last + 1 - first, false);
      return;
    }
    if (u->first < first) {  // u's upper part
      add_idle_bytes(p, u->end - first, false);
      u->end = first;
      u = r.idle_runs.next(u);
      continue;
    }
    if (u->end > last + 1) {  // u's lower part: u starts after last now
      const std::size_t taken = last + 1 - u->first;
      r.idle_runs.move_first(u, last + 1);  // may throw: nothing changed
      add_idle_bytes(p, taken, false);
      return;
    }
    add_idle_bytes(p, u->pages(), false);  // all of u
    list_unlink(p, u);
    idle_run* n = r.idle_runs.next(u);
    r.idle_runs.erase(u);
    p.pages.recycle_run(u);
    u = n;
  }
}

void pager::touch_carved(stream_pool& p, const block* b) {
  // Blocks are disjoint: only b's first and last pages can be shared with a neighbour (as that
  // neighbour's edge page), and a page is touched iff its edge count is nonzero or a live block
  // covers it strictly inside its span. So a carve makes all of b's span touched, and a free makes
  // untouched the pages strictly inside it and each edge page whose count drops to 0.
  vm_range& r = *b->seg->vm;
  const std::size_t first = r.page_of(b->addr);
  const std::size_t last = r.page_of(b->addr + b->size - 1);
  // A chunk is touched as a whole by one block: one that b would touch in part goes first --
  // unless coarse handles are plentiful: then every such chunk stays as it is (straddled),
  // counted only. That test is one load (a warm pass carves into straddled chunks at every
  // step).
  if (r.chunks != 0) {
    if (const std::size_t cut = r.cut_chunks(b->addr, b->size, first, last); cut != 0) {
      if (coarse_now_.load(std::memory_order_relaxed)) {
        p.pages.add_straddles(cut);
      } else {
        convert_cut_chunks(p, r, b, first, last);
      }
    }
  }
  const std::uint32_t first_use = r.edge(first);
  r.edge_use.set(first, first_use + 1);
  std::uint32_t last_use = first_use;
  if (last != first) {
    last_use = r.edge(last);
    r.edge_use.set(last, last_use + 1);
  }
  // An edge page with a nonzero count was touched already (not idle): when b touches no page
  // anew (fresh_pages: a block of one or two pages with both edges touched), nothing leaves
  // the idle runs (a small block carved beside live ones: no lookup).
  if (fresh_pages(first, last, first_use != 0, last_use != 0) == 0) return;
  if (take_parked(p, r, first, last)) [[likely]]
    return;
  idle_remove(p, r, first, last);
}

void pager::touch_freed(stream_pool& p, const block* b) {
  touch_freed_at(p, b, syncs_started_.load(std::memory_order_seq_cst));
}

CUCACHE_HOT void pager::touch_freed_at(stream_pool& p, const block* b, std::uint64_t epoch) {
  // (touch_carved says which pages a block touches.)
  vm_range& r = *b->seg->vm;
  const std::size_t first = r.page_of(b->addr);
  const std::size_t last = r.page_of(b->addr + b->size - 1);
  const std::uint32_t first_use = r.edge(first) - 1;
  r.edge_use.set(first, first_use);
  std::uint32_t last_use = first_use;
  if (last != first) {
    last_use = r.edge(last) - 1;
    r.edge_use.set(last, last_use);
  }
  if (last == first && first_use != 0) return;
  const std::size_t lo = first_use == 0 ? first : first + 1;
  const std::size_t hi = last_use == 0 ? last : last - 1;
  if (lo <= hi) make_idle(p, r, lo, hi, epoch);
}

// --- the held block (defer_coalescing) ----------------------------------------------------------

bool pager::hold_pages(stream_pool& p, const block* b) {
  // Its pages stay touched while b is held; settle_pages makes idle what touch_freed would have,
  // with the epoch of now (the free's). Parking then must not need host memory: nothing may be
  // parked (the span parked now is linked here -- the idle order is the same: it went idle
  // first) and every page must be mapped (no runs to link).
  const vm_range& r = *b->seg->vm;
  if (!r.all_mapped(r.page_of(b->addr), r.page_of(b->addr + b->size - 1))) return false;
  if (p.pages.parked() != nullptr) unpark(p);  // may throw: nothing changed
  p.pages.note_hold(this, syncs_started_.load(std::memory_order_seq_cst));
  return true;
}

void pager::settle_pages(stream_pool& p, const block* b) noexcept {
  // Nothing parked and every page mapped since hold_pages (every lock of p settles before it
  // returns): make_idle parks, which then links nothing -- no allocation, nothing that throws.
  touch_freed_at(p, b, p.pages.held_epoch());
}

// --- synchronization ----------------------------------------------------------------------------

void pager::synchronize_device() {
  const std::uint64_t ticket = syncs_started_.fetch_add(1, std::memory_order_seq_cst) + 1;
  timed(counters.sync_ns, [&] { backend_.device_synchronize(); });
  counters.synchronizations.fetch_add(1, std::memory_order_relaxed);
  std::uint64_t done = syncs_done_.load(std::memory_order_seq_cst);
  while (done < ticket && !syncs_done_.compare_exchange_weak(done, ticket)) {
  }
}

void pager::wait_until_unmappable(std::uint64_t idle_epoch) {
  // The page became idle when syncs_started_ was idle_epoch: every synchronization with a ticket
  // above that started after the free, so once one has completed, the work that used the page
  // has too.
  if (syncs_done_.load(std::memory_order_seq_cst) > idle_epoch) return;
  synchronize_device();
}

// --- device calls and their bookkeeping ---------------------------------------------------------

void pager::keep_locked(phys_handle h, std::size_t bytes) {
  free_handles.emplace(bytes, h);
  free_handle_bytes += bytes;
  budget_.note_change_locked();
}

void pager::keep(phys_handle h, std::size_t bytes) {
  detail::lock_guard lock(budget_.mu);
  keep_locked(h, bytes);
}

void pager::release(phys_handle h, std::size_t bytes) {
  detail::lock_guard lock(budget_.mu);
  try {
    timed(counters.vm_ns, [&] { backend_.phys_release(h); });
  } catch (...) {
    keep_locked(h, bytes);  // still ours: keep it tracked, never leak it
    throw;
  }
  budget_.refund_locked(bytes);
}

void pager::release_unmapped(std::size_t target_reserved) {
  detail::lock_guard lock(budget_.mu);
  while (budget_.reserved_bytes_locked() > target_reserved && !free_handles.empty()) {
    auto it = std::prev(free_handles.end());
    const std::size_t bytes = it->first;
    const phys_handle h = it->second;
    timed(counters.vm_ns, [&] { backend_.phys_release(h); });  // a failure leaves it listed
    free_handles.erase(it);
    free_handle_bytes -= bytes;
    budget_.refund_locked(bytes);
  }
}

pager::piece pager::unmap(stream_pool& p, vm_range& r, std::size_t pg) {
  const page_span m = r.mapping_of(pg);
  const std::size_t bytes = m.pages() * page_bytes_;
  if (allocation_observer* o = observer(); o != nullptr && r.pages.get(m.first).accessible)
      [[unlikely]]
    o->on_segment_unmap(r.page_addr(m.first), bytes, p.stream);
  timed(counters.vm_ns,
        [&] { backend_.unmap(reinterpret_cast<void*>(r.page_addr(m.first)), bytes); });
  counters.unmap.fetch_add(1, std::memory_order_relaxed);
  idle_remove(p, r, m.first, m.end - 1);
  phys_handle h = 0;
  for (std::size_t q = m.first; q < m.end; ++q) h = r.remove_page(q);
  if (m.pages() > 1) --r.chunks;
  p.stats.reserved_bytes.dec(r.kind, static_cast<std::int64_t>(bytes));
  if (r.mapped_pages == 0) p.stats.segment_count.dec(r.kind, 1);  // a range holding memory
  return piece{h, bytes, false};
}

void pager::keep_or_release(const piece& pc) {
  if (pc.bytes == page_bytes_) {
    keep(pc.handle, pc.bytes);
  } else {
    release(pc.handle, pc.bytes);  // a failure keeps it listed
  }
}

std::optional<pager::idle_page> pager::oldest_unmappable(const stream_pool& q) const {
  for (const idle_run* u = q.pages.idle_tail(); u != nullptr; u = u->newer) {
    for (std::size_t pg = u->first; pg < u->end;) {
      const page_span m = u->range->mapping_of(pg);
      if (m.pages() == 1 || u->range->all_idle(m)) return idle_page{u->range, pg};
      pg = m.end;  // a straddled chunk: some block still touches part of it
    }
  }
  return std::nullopt;
}

std::optional<pager::idle_page> pager::newest_unmappable(const stream_pool& q) const {
  for (const idle_run* u = q.pages.idle_head(); u != nullptr; u = u->older) {
    for (std::size_t pg = u->end; pg > u->first;) {
      const page_span m = u->range->mapping_of(pg - 1);
      if (m.pages() == 1 || u->range->all_idle(m)) return idle_page{u->range, pg - 1};
      pg = m.first;
    }
  }
  return std::nullopt;
}

std::size_t pager::straddled_idle_bytes(const stream_pool& p) const {
  std::size_t pages = 0;
  for (const segment* s : p.pages.ranges()) {
    const vm_range& r = *s->vm;
    if (r.chunks == 0) continue;
    r.pages.for_each([&](std::size_t pg, const vm_page& e) {
      if (e.chunk_pages > 1 && e.chunk_index == 0) {
        pages += r.straddled_idle_pages(r.mapping_of(pg), pg, pg + e.chunk_pages);
      }
    });
  }
  return pages * page_bytes_;
}

bool pager::release_oldest_idle(stream_pool& q) {
  unpark(q);
  const std::optional<idle_page> at = oldest_unmappable(q);
  if (!at) return false;
  wait_until_unmappable(at->range->idle_epoch(at->range->mapping_of(at->page)));
  const piece pc = unmap(q, *at->range, at->page);
  release(pc.handle, pc.bytes);
  return true;
}

void pager::convert_cut_chunks(stream_pool& p, vm_range& r, const block* b, std::size_t first,
                               std::size_t last) noexcept {
  const page_span whole = r.whole_pages(b->addr, b->size);
  std::size_t seen = r.page_count;  // the first page of the chunk handled at b's first page
  for (const std::size_t pg : {first, last}) {
    const page_span m = r.mapping_of(pg);
    if (m.pages() == 1 || m.first == seen || (m.first >= whole.first && m.end <= whole.end)) {
      continue;
    }
    seen = m.first;
    // Touched by no block unless a carve straddled it before: then it stays as it is.
    bool converted = false;
    try {
      if (may_synchronize_() && r.all_idle(m)) {
        wait_until_unmappable(r.idle_epoch(m));
        const piece pc = unmap(p, r, m.first);
        counters.splits.fetch_add(1, std::memory_order_relaxed);
        converted = true;
        release(pc.handle, pc.bytes);  // a failure keeps it listed
      }
    } catch (...) {
    }
    if (!converted) p.pages.add_straddles(1);
  }
}

void pager::map(stream_pool& p, vm_range& r, std::size_t pg, const piece& pc,
                std::vector<std::size_t>& batch, mapping_use use) {
  // REQUIRES, for mapping_use::touched: the pages lie inside the span of the carved block being
  // backed (a chunk's: pages it covers whole); for mapping_use::idle: no block touches them, and
  // pc is one page. Every page of [pg, pg + pages) is unmapped.
  void* va = reinterpret_cast<void*>(r.page_addr(pg));
  const std::size_t pages = pc.bytes / page_bytes_;
  try {
    batch.reserve(batch.size() + pages);
    timed(counters.vm_ns, [&] { backend_.map(va, pc.bytes, pc.handle); });
  } catch (...) {
    keep_or_release(pc);
    throw;
  }
  counters.map.fetch_add(1, std::memory_order_relaxed);
  if (pc.moved) counters.stitched_pages.fetch_add(1, std::memory_order_relaxed);
  // Not accessible yet: grant_access sets access over the whole batch of back() at once.
  if (r.mapped_pages == 0) p.stats.segment_count.inc(r.kind, 1);  // a range holding memory
  const auto chunk_pages = static_cast<std::uint16_t>(pages > 1 ? pages : 0);
  std::size_t added = 0;
  try {
    for (; added < pages; ++added) {
      r.add_page(pg + added, pc.handle, chunk_pages, static_cast<std::uint16_t>(added));
    }
  } catch (...) {  // no host memory for the page table: undo the map, keep or release the handle
    for (std::size_t q = 0; q < added; ++q) (void)r.remove_page(pg + q);
    try {
      timed(counters.vm_ns, [&] { backend_.unmap(va, pc.bytes); });
      keep_or_release(pc);
    } catch (...) {
    }
    if (r.mapped_pages == 0) p.stats.segment_count.dec(r.kind, 1);
    throw;
  }
  if (pages > 1) ++r.chunks;
  p.stats.reserved_bytes.inc(r.kind, static_cast<std::int64_t>(pc.bytes));
  for (std::size_t q = 0; q < pages; ++q) batch.push_back(pg + q);
  if (use == mapping_use::idle) {
    idle_add(p, r, pg, pg + pages, syncs_started_.load(std::memory_order_seq_cst));
  }
}

void pager::grant_access(stream_pool& p, vm_range& r, std::size_t first, std::size_t last,
                         const std::vector<std::size_t>& batch) {
  // One cuMemSetAccess per run of adjacent mapped pages without access in [first, last]: the
  // driver takes any fully mapped range made of whole mappings (PyTorch's expandable segments set
  // access over several handles at once too). Pages that already have access break a run: they
  // may be in use by running work, and are not touched again. Runs only on the way from VM calls
  // (or a failed undo): one step per page of the span.
  if (r.no_access_pages == 0) return;
  std::size_t pg = first;
  while (pg <= last) {
    const vm_page e = r.pages.get(pg);
    if (!e.mapped || e.accessible) {
      ++pg;
      continue;
    }
    // A run holds whole mappings: a chunk without access (a failed undo) that a straddling block
    // meets in part is covered whole.
    pg = r.mapping_of(pg).first;
    std::size_t run_end = pg + 1;
    while (run_end <= last) {
      const vm_page n = r.pages.get(run_end);
      if (!n.mapped || n.accessible) break;
      ++run_end;
    }
    run_end = r.mapping_of(run_end - 1).end;
    try {
      backend_.set_access(reinterpret_cast<void*>(r.page_addr(pg)), (run_end - pg) * page_bytes_);
    } catch (...) {
      revoke(p, r, batch);
      throw;
    }
    counters.set_access.fetch_add(1, std::memory_order_relaxed);
    for (std::size_t q = pg; q < run_end; ++q) r.grant(q);
    if (allocation_observer* o = observer()) [[unlikely]]
      o->on_segment_map(r.page_addr(pg), (run_end - pg) * page_bytes_, p.stream);
    pg = run_end;
  }
}

void pager::revoke(stream_pool& p, vm_range& r, const std::vector<std::size_t>& batch) noexcept {
  // Leave nothing half-mapped: the mappings this call made that have no access yet (no work has
  // seen them: no synchronization needed; only the block being backed touches them, or none) are
  // unmapped again, one-page handles kept for reuse, chunks released. One whose unmap fails too
  // stays recorded, without access, so that it stays tracked; the next back() over it grants
  // access. (A chunk's later pages are unmapped with its first.)
  for (std::size_t pg : batch) {
    const vm_page e = r.pages.get(pg);
    if (!e.mapped || e.accessible) continue;
    try {
      keep_or_release(unmap(p, r, pg));
    } catch (...) {
    }
  }
}

// --- physical-memory sources --------------------------------------------------------------------

std::optional<pager::piece> pager::take_unmapped(std::size_t want) {
  detail::lock_guard lock(budget_.mu);
  auto it = free_handles.upper_bound(want);
  if (it == free_handles.begin()) return std::nullopt;
  --it;
  piece pc{it->second, it->first, false};
  free_handles.erase(it);
  free_handle_bytes -= pc.bytes;
  budget_.note_change_locked();
  return pc;
}

std::optional<pager::piece> pager::take_oldest_idle(stream_pool& q, std::size_t want) {
  // Least recently idle first: a steady loop is least likely to come back for that page, and it
  // is the one that went idle before the last device synchronization if any did (epochs never
  // rise toward the tail). A chunk cannot move (it maps whole only), so one found there is
  // released: room for what is missing, nothing to map.
  if (want < page_bytes_) return std::nullopt;
  unpark(q);
  const std::optional<idle_page> at = oldest_unmappable(q);
  if (!at) return std::nullopt;
  wait_until_unmappable(at->range->idle_epoch(at->range->mapping_of(at->page)));
  piece pc = unmap(q, *at->range, at->page);
  if (pc.bytes != page_bytes_) {
    release(pc.handle, pc.bytes);
    return piece{0, 0, false};
  }
  pc.moved = true;
  return pc;
}

std::optional<pager::piece> pager::take_idle(stream_pool& p, std::size_t want) {
  return take_oldest_idle(p, want);
}

std::optional<pager::piece> pager::take_peer_idle(stream_pool& p, std::size_t want) {
  if (!pools_mu_.try_lock_shared()) return std::nullopt;
  detail::shared_lock list(pools_mu_, std::adopt_lock);
  for (const auto& q : pools_) {
    if (q.get() == &p) continue;
    if (!q->mu.try_lock()) continue;
    pool_lock lk(q->mu, std::adopt_lock);
    table_.note_change(*q);  // its idle pages may go
    std::optional<piece> pc = take_oldest_idle(*q, want);
    if (!pc) continue;
    if (pc->bytes != 0) counters.shared_pages.fetch_add(1, std::memory_order_relaxed);
    return pc;
  }
  return std::nullopt;
}

std::optional<pager::piece> pager::create(std::size_t bytes) {
  const std::optional<phys_handle> h = budget_.charge(
      bytes, [&] { return timed(counters.vm_ns, [&] { return backend_.phys_create(bytes); }); });
  if (!h) {
    budget_.forget_device_free();  // the next fits() asks the device
    return std::nullopt;
  }
  return piece{*h, bytes, false};
}

// --- policy -------------------------------------------------------------------------------------

bool pager::may_grow(stream_pool& /*p*/, std::size_t extra) {
  // A handle is one page, or a chunk that one block touches as a whole or none does, so idle
  // memory pins nothing a block touches: keeping it mapped where it went idle costs no fit,
  // because it can be given back, page by page or chunk by chunk, the moment memory is short
  // (reclaim). So memory is plentiful exactly while the device, the memory limit and the
  // garbage-collection threshold have room for `extra` more: then the missing pages are created
  // and idle pages stay where a steady loop comes back for them, so that once the loop has
  // touched its pages it makes no VM call and no synchronization (PyTorch's expandable segments
  // behave the same way, never unmapping idle memory unasked). Otherwise idle pages are moved
  // and reclaimed: only then does moving lower what the device must hold. Reserved memory
  // without a limit is then the union of the pages the program touched (measured: below
  // PyTorch's expandable mode on every shared trace, docs/design.md).
  return fits(extra);
}

bool pager::coarse_room(std::size_t extra) {
  if (coarse_pages_ < 2) return false;
  std::size_t capacity = device_total_;
  if (const std::size_t limit = budget_.limit.load(std::memory_order_relaxed);
      limit != 0 && limit < capacity) {
    capacity = limit;
  }
  return fits(extra + capacity / 2);
}

bool pager::fits(std::size_t bytes) {
  // The device is asked (cudaMemGetInfo, microseconds) only when the estimate from its last
  // answer and this allocator's own creations since leaves less than a sixteenth of the device
  // beyond `bytes`: what other allocators took meanwhile is unknown, and a creation the device
  // refuses forgets the estimate (create), so a wrong "fits" costs one refused creation, never
  // a reclaim skipped twice. The caps and the estimate: one look under the budget's lock.
  switch (budget_.room_for(bytes, device_total_ / 16)) {
    case device_budget::room::over_caps:
      return false;
    case device_budget::room::fits:
      return true;
    case device_budget::room::unknown:
      break;
  }
  const std::size_t free_bytes = backend_.mem_get_info().free_bytes;
  budget_.note_device_free(free_bytes);
  return free_bytes >= bytes;
}

bool pager::reclaim(stream_pool& p, std::size_t bytes) {
  if (fits(bytes)) return true;
  counters.reclaims.fetch_add(1, std::memory_order_relaxed);
  coarse_now_.store(false, std::memory_order_relaxed);
  const nvtx_range range(nvtx, "cucache: reclaim idle pages");
  // Unmapped handles are not given back: each is one page (a chunk's is released when unmapped),
  // and back() takes them before it creates anything, so releasing one only to create another would gain no room. Idle pages,
  // least recently idle first (a chunk's page: the whole chunk): this pool's, then the other
  // pools'.
  if (!may_synchronize_()) return false;
  while (release_oldest_idle(p)) {
    if (fits(bytes)) return true;
  }
  if (!pools_mu_.try_lock_shared()) return false;
  detail::shared_lock list(pools_mu_, std::adopt_lock);
  for (const auto& q : pools_) {
    if (q.get() == &p) continue;
    if (!q->mu.try_lock()) continue;
    pool_lock lk(q->mu, std::adopt_lock);
    table_.note_change(*q);  // its idle pages may go
    while (release_oldest_idle(*q)) {
      if (fits(bytes)) return true;
    }
  }
  return false;
}

pager::span_state pager::scan(const vm_range& r, const block* b) const {
  // O(log runs) when every page is mapped and every mapped page has access (a cache hit); the
  // count of missing pages walks the runs of mapped pages (only when VM calls follow).
  span_state st;
  const std::size_t first = r.page_of(b->addr);
  const std::size_t last = r.page_of(b->addr + b->size - 1);
  if (!r.all_mapped(first, last)) st.missing_bytes = r.unmapped_in(first, last) * page_bytes_;
  if (r.no_access_pages != 0) {  // only after a failed undo
    for (std::size_t pg = first; pg <= last && !st.needs_access; ++pg) {
      const vm_page e = r.pages.get(pg);
      st.needs_access = e.mapped && !e.accessible;
    }
  }
  return st;
}

bool pager::back_slow(stream_pool& p, const block* b) {
  vm_range& r = *b->seg->vm;
  const std::size_t first = r.page_of(b->addr);
  const std::size_t last = r.page_of(b->addr + b->size - 1);
  const span_state st = scan(r, b);
  std::vector<std::size_t> batch;  // the pages this call maps
  if (st.missing_bytes == 0) {
    if (st.needs_access) grant_access(p, r, first, last, batch);  // only after a failed undo
    return true;
  }
  const nvtx_range range(nvtx, "cucache: map pages");
  // Every page mapped here gets access in one batch at the end (grant_access): a failure before
  // that unmaps the batch again (revoke), so no block is left half-mapped and every handle stays
  // tracked.
  bool ok = false;
  try {
    ok = back_pages(p, r, b, st.missing_bytes, batch);
  } catch (...) {
    revoke(p, r, batch);
    throw;
  }
  grant_access(p, r, first, last, batch);  // also when !ok: what was mapped stays, usable
  return ok;
}

bool pager::back_pages(stream_pool& p, vm_range& r, const block* b, std::size_t missing,
                       std::vector<std::size_t>& batch) {
  const std::size_t first = r.page_of(b->addr);
  const std::size_t last = r.page_of(b->addr + b->size - 1);
  // One decision per block, for all the pages it lacks. While memory is plentiful (may_grow), they
  // are created and idle pages stay mapped where they went idle.
  // Otherwise idle pages are moved here first (this pool's, then another stream's), and only what
  // is still missing is created, after room was made for all of it: reserved memory never rises
  // inside the call above where it ends (nothing is created that a release in the same call then
  // makes up for). While a graph capture is underway nothing may synchronize the device, so
  // nothing is moved or given back: what is missing is created (may_synchronize_, set by the
  // allocator).
  // While memory is plentiful, a run of missing pages that b covers whole (no neighbour can touch
  // them) gets one handle, a chunk of up to max_chunk_pages_ pages: one cuMemCreate and one
  // cuMemMap instead of one per page. Its pages are touched by b alone, and once idle the chunk
  // is released whole the moment a carve, a move or a reclaim needs any of its pages.
  const bool grow = may_grow(p, missing);
  const bool plentiful = grow || !may_synchronize_();
  const page_span whole = r.whole_pages(b->addr, b->size);
  // Coarse handles (set_coarse_handles): with half the capacity to spare beyond this growth,
  // every block's whole pages get chunks, and cut idle chunks stay (convert_cut_chunks).
  const bool coarse = grow && coarse_room(missing);
  if (coarse_pages_ != 0) coarse_now_.store(coarse, std::memory_order_relaxed);
  const bool big = max_chunk_pages_ > 1 && whole.pages() >= min_chunked_pages_;
  const bool chunked = grow && (big || coarse);
  const std::size_t chunk_cap = big ? max_chunk_pages_ : coarse_pages_;
  bool moved = false;
  for (int pass = plentiful ? 1 : 0; pass < 2; ++pass) {
    if (pass == 1) {
      missing = scan(r, b).missing_bytes;
      if (missing == 0) return true;
      // Nothing is created unless all of it can be, so a refused request leaves nothing
      // reserved: the pages the unmapped handles cannot back must fit under the limit and on the
      // device, after a reclaim if need be (the garbage-collection threshold asks for a reclaim
      // but refuses nothing). When memory was plentiful, may_grow has just found room for all.
      std::size_t kept = 0;
      {
        detail::lock_guard lock(budget_.mu);
        kept = page_handle_bytes_locked();
      }
      const std::size_t fresh = missing > kept ? missing - kept : 0;
      if (!plentiful && fresh != 0 && !fits(fresh)) {
        (void)reclaim(p, fresh);
        if (budget_.over_limit(fresh) || backend_.mem_get_info().free_bytes < fresh) return false;
      }
    }
    for (std::size_t pg = first; pg <= last;) {
      if (r.mapped(pg)) {
        pg = r.mapped_run_end(pg);
        continue;
      }
      const std::size_t want = page_bytes_;
      // Pass 0 moves only until what is still missing may be created: as few moves as lower what
      // the device must hold, and the rest in new handles, as large as the run allows.
      if (pass == 0 && moved && may_grow(p, missing)) break;
      std::optional<piece> pc = take_unmapped(want);
      if (pass == 0) {
        if (!pc) pc = take_idle(p, want);
        if (!pc) pc = take_peer_idle(p, want);
        if (!pc) {
          ++pg;  // created in pass 1
          continue;
        }
        moved = true;
        if (pc->bytes == 0) continue;  // an idle chunk released: room made, pg still missing
        missing -= pc->bytes;
      } else if (!pc) {
        if (chunked && pg >= whole.first && pg < whole.end) {
          std::size_t run = 1;  // missing pages from pg that b covers whole
          while (run < chunk_cap && pg + run < whole.end && !r.mapped(pg + run)) ++run;
          if (run > 1 && (pc = create(run * page_bytes_))) {
            counters.chunks.fetch_add(1, std::memory_order_relaxed);
          }
        }
        if (!pc) pc = create(want);
        if (!pc && reclaim(p, want)) pc = create(want);
        if (!pc) return false;
      }
      map(p, r, pg, *pc, batch);
      pg += pc->bytes / page_bytes_;
    }
  }
  return true;
}

bool pager::map_idle_pages(stream_pool& p, vm_range& r, std::uintptr_t addr, std::size_t bytes) {
  const nvtx_range range(nvtx, "cucache: reserve pages");
  const std::size_t first = r.page_of(addr);
  const std::size_t last = r.page_of(addr + bytes - 1);
  std::vector<std::size_t> batch;
  bool ok = true;
  try {
    for (std::size_t pg = first; pg <= last; ++pg) {
      if (r.mapped(pg)) continue;
      std::optional<piece> pc = take_unmapped(page_bytes_);  // only a one-page handle fits
      if (!pc) pc = create(page_bytes_);
      if (!pc) {
        ok = false;
        break;
      }
      map(p, r, pg, *pc, batch, mapping_use::idle);  // no block touches it
    }
  } catch (...) {
    revoke(p, r, batch);
    throw;
  }
  grant_access(p, r, first, last, batch);  // also when !ok: what was mapped stays, usable
  return ok;
}

void pager::unmap_idle(stream_pool& p, bool release_handles) {
  // Most recently idle first: the head run's last page (a chunk's: the whole chunk, released
  // either way; a straddled chunk stays).
  unpark(p);
  while (const std::optional<idle_page> at = newest_unmappable(p)) {
    wait_until_unmappable(at->range->idle_epoch(at->range->mapping_of(at->page)));
    const piece pc = unmap(p, *at->range, at->page);
    if (release_handles) {
      release(pc.handle, pc.bytes);
    } else {
      keep_or_release(pc);
    }
  }
}

// --- sleep ---------------------------------------------------------------------------------------

std::size_t pager::evict(stream_pool& p, bool synchronize) {
  unpark(p);
  if (synchronize) synchronize_device();
  std::size_t released = 0;
  for (segment* seg : p.pages.ranges()) {
    vm_range& r = *seg->vm;
    // The mapped pages first: unmapping frees the page table's chunks that empty, which a walk
    // over the table must not see.
    std::vector<std::size_t> mapped;
    mapped.reserve(r.mapped_pages);
    r.pages.for_each([&](std::size_t pg, const vm_page&) { mapped.push_back(pg); });
    for (const std::size_t pg : mapped) {
      if (!r.mapped(pg)) continue;  // a chunk's later page, gone with its first
      // unmap: out of the idle runs, page table and stats
      const piece pc = unmap(p, r, pg);
      release(pc.handle, pc.bytes);
      released += pc.bytes;
    }
  }
  return released;
}

std::size_t pager::room_bytes() {
  const std::size_t device_free = backend_.mem_get_info().free_bytes;
  detail::lock_guard lock(budget_.mu);
  const std::size_t room = std::min(device_free, budget_.room_under_limit_locked());
  return room + page_handle_bytes_locked();  // the unmapped handles back() reuses
}

// --- what cached memory can serve ---------------------------------------------------------------

std::size_t pager::largest_cached_request(const stream_pool& p, pool_kind kind,
                                          const size_policy& policy) const {
  // A request placed in p's ranges (best fit, at the front of the free block: impl's placement)
  // is served from cached memory when back() finds every page it touches mapped or backed by an
  // unmapped one-page handle: nothing is created. The pages of an idle chunk that the request
  // would touch in part (one holding its first or last page that it does not cover whole) count
  // as unmapped: the carve releases that chunk (touch) and back() backs them page by page --
  // unless coarse handles are plentiful, when the carve keeps the chunk (straddled). Idle
  // mappings elsewhere are not counted: back() moves them only when memory is not plentiful,
  // which depends on the device's free memory at the time of the request; while it is plentiful
  // it creates instead.
  const std::size_t lo = kind == pool_kind::small ? 0 : k_small_request_max_bytes;
  const std::size_t hi = kind == pool_kind::small ? k_small_request_max_bytes : ~std::size_t{0};
  std::size_t handles = 0;  // unmapped one-page handles
  {
    detail::lock_guard lock(budget_.mu);
    handles = page_handle_bytes_locked() / page_bytes_;
  }
  const bool coarse = coarse_now_.load(std::memory_order_relaxed);
  std::size_t best = 0;
  const auto consider = [&](std::size_t bytes) {
    const std::size_t r = policy.largest_rounded_within(std::min(bytes, hi));
    return r > lo && r > best ? r : 0;
  };
  const free_index& index = p.index_of(kind);
  index.for_each([&](const block* f) {
    if (consider(f->size) == 0) return;
    const vm_range& range = *f->seg->vm;
    const std::size_t fp = range.page_of(f->addr);
    const std::size_t fl = range.page_of(f->addr + f->size - 1);
    // The pages a request placed in f may end on: no further than the handles can back.
    // unmapped_upto[j]: the unmapped pages of [fp, fp + j] (not built when all are mapped, the
    // usual cached span: every count is 0).
    const bool all_mapped = range.all_mapped(fp, fl);
    std::vector<std::size_t> unmapped_upto;
    if (!all_mapped) {
      for (std::size_t pg = fp, unmapped = 0; pg <= fl; ++pg) {
        unmapped += !range.mapped(pg);
        if (unmapped > handles) break;
        unmapped_upto.push_back(unmapped);
      }
    }
    const std::size_t end_pages = all_mapped ? fl - fp + 1 : unmapped_upto.size();
    // The pages of [fp, lp] in chunks that a request of r bytes at f would touch in part.
    // While coarse handles are plentiful (coarse_now_) a cut chunk stays mapped: nothing counts.
    const auto cut_pages = [&](std::size_t r, std::size_t lp) {
      if (range.chunks == 0 || coarse) return std::size_t{0};
      const page_span whole = range.whole_pages(f->addr, r);
      std::size_t n = 0;
      std::size_t counted = range.page_count;  // the first page of the chunk counted, if any
      for (const std::size_t pg : {fp, lp}) {
        const page_span m = range.mapping_of(pg);
        // A chunk some block touches already is kept by the carve (straddled): mapped.
        if (m.pages() == 1 || m.first == counted ||
            (m.first >= whole.first && m.end <= whole.end) || !range.all_idle(m)) {
          continue;
        }
        n += std::min(m.end, lp + 1) - std::max(m.first, fp);
        counted = m.first;
      }
      return n;
    };
    // From the largest request down; the first one placed in f is this block's largest.
    // consider() never grows as `end` falls: once it is 0 no smaller request of f counts, and
    // once its request r ends below this page, every page from here down to r's last one gives
    // r or less, which ends below it too -- the search goes on at r's last page (with rounding
    // steps of many pages, as roundup_power2_divisions makes, this skips all but one page per
    // step; issue 30).
    for (std::size_t j = end_pages; j-- > 0;) {
      const std::size_t boundary = range.page_addr(fp + j + 1) - f->addr;
      const std::size_t below = j == 0 ? 0 : range.page_addr(fp + j) - f->addr;
      for (std::size_t end : {std::min(boundary, f->size), std::min(boundary - 1, f->size)}) {
        const std::size_t r = consider(end);
        if (r == 0) return;  // no request of f beats `best`
        if (r <= below) {    // none left ending on this page: on at the page r ends on
          j = range.page_of(f->addr + r - 1) - fp + 1;  // < j + 1 (r ends below page fp + j)
          break;
        }
        if (place_in_range(index, r) != f) continue;  // a request of r is placed elsewhere
        if ((all_mapped ? 0 : unmapped_upto[j]) + cut_pages(r, fp + j) > handles) continue;
        best = r;
        return;
      }
    }
  });
  // A request larger than every free block goes to a new range (no range yet, or holes too
  // small), whose pages the unmapped handles alone back.
  const block* top = index.largest();
  if (const std::size_t r = consider(handles * page_bytes_); r > (top == nullptr ? 0 : top->size)) {
    best = r;
  }
  return best;
}

// --- invariants ----------------------------------------------------------------------------------

void pager::check_invariants(const stream_pool& p) const {
  const auto violated = [](const std::string& what) {
    throw std::logic_error("cucache invariant violated: " + what);
  };
  const pool_pages& pp = p.pages;
  // The range list: exactly the pool's segments that own a vm_range, each once, their sizes
  // summed per kind.
  std::size_t range_bytes[2] = {0, 0};
  std::size_t ranges_seen = 0;
  for (const segment* s = p.segments; s != nullptr; s = s->next) {
    if (s->vm == nullptr) continue;
    ++ranges_seen;
    range_bytes[static_cast<int>(s->kind)] += s->size;
    if (std::count(pp.ranges().begin(), pp.ranges().end(), s) != 1) {
      violated(fmt::format("pool {}: range {:#x} is not listed once in its pool's ranges", p.index,
                           s->base));
    }
  }
  const std::size_t listed_bytes[2] = {pp.range_bytes(static_cast<pool_kind>(0)),
                                       pp.range_bytes(static_cast<pool_kind>(1))};
  if (ranges_seen != pp.ranges().size() || range_bytes[0] != listed_bytes[0] ||
      range_bytes[1] != listed_bytes[1]) {
    violated(fmt::format("pool {}: {} ranges of {} + {} bytes listed as {} of {} + {} bytes",
                         p.index, ranges_seen, range_bytes[0], range_bytes[1], pp.ranges().size(),
                         listed_bytes[0], listed_bytes[1]));
  }
  // The idle runs and parked pages the ranges' tables hold (each range's own table is checked
  // with its pages: check_invariants.cpp).
  std::size_t runs_seen = 0;
  std::size_t pages_seen = 0;
  for (const segment* s : pp.ranges()) {
    const vm_range& r = *s->vm;
    runs_seen += r.idle_runs.size();
    r.idle_runs.for_each([&](const idle_run* u) { pages_seen += u->pages(); });
    pages_seen += r.parked_end - r.parked_first;
  }
  // The idle list: every idle run of the pool's ranges once, linked both ways, epochs never
  // rising toward the tail (the least recently idle page needs a synchronization only if every
  // idle page does).
  std::size_t listed = 0;
  std::size_t listed_pages = 0;
  const idle_run* last = nullptr;
  for (const idle_run* u = pp.idle_head(); u != nullptr; u = u->older) {
    if (u->newer != last) violated(fmt::format("pool {}: idle list links are inconsistent", p.index));
    if (last != nullptr && u->epoch > last->epoch) {
      violated(fmt::format("pool {}: an older idle run has a later epoch", p.index));
    }
    if (u->range->idle_runs.at(u->first) != u || u->range->idle_owner != &pp) {
      violated(fmt::format("pool {}: a listed idle run is not in its range's table", p.index));
    }
    last = u;
    ++listed;
    listed_pages += u->pages();
    if (listed > runs_seen) break;  // a cycle, or runs of another pool
  }
  if (last != pp.idle_tail()) {
    violated(fmt::format("pool {}: idle list tail is not its last run", p.index));
  }
  // The parked span went idle after every listed run.
  std::size_t parked_pages = 0;
  if (const vm_range* pr = pp.parked()) {
    parked_pages = pr->parked_end - pr->parked_first;
    const bool own = std::any_of(pp.ranges().begin(), pp.ranges().end(),
                                 [&](const segment* s) { return s != nullptr && s->vm == pr; });
    if (!own) violated(fmt::format("pool {}: parked span in a range not its own", p.index));
    if (pp.idle_head() != nullptr && pp.idle_head()->epoch > pr->parked_epoch) {
      violated(fmt::format("pool {}: the parked span has an earlier epoch than the idle list's "
                           "head",
                           p.index));
    }
  }
  if (listed != runs_seen || listed_pages + parked_pages != pages_seen ||
      (listed_pages + parked_pages) * page_bytes_ != pp.idle_bytes()) {
    violated(fmt::format("pool {}: idle list holds {} runs / {} pages, page tables show {} runs / "
                         "{} pages, pool says {} bytes ({} pages parked)",
                         p.index, listed, listed_pages, runs_seen, pages_seen, pp.idle_bytes(),
                         parked_pages));
  }
}

std::size_t pager::check_device_wide(std::size_t ranges_bytes) const {
  if (reserved_address_bytes() != ranges_bytes) {
    throw std::logic_error(
        fmt::format("cucache invariant violated: the pager counts {} bytes of address space, the "
                    "ranges span {}",
                    reserved_address_bytes(), ranges_bytes));
  }
  detail::lock_guard lock(budget_.mu);
  std::size_t handle_bytes = 0;
  for (const auto& [bytes, h] : free_handles) handle_bytes += bytes;
  if (handle_bytes != free_handle_bytes) {
    throw std::logic_error(
        fmt::format("cucache invariant violated: unmapped handle list holds {} bytes, counter "
                    "says {}",
                    handle_bytes, free_handle_bytes));
  }
  return handle_bytes;
}

}  // namespace cucache::detail
