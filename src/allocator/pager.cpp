// The pager of expandable segments (see pager.hpp and docs/design.md, "Expandable segments").
#include "allocator/pager.hpp"

#include <algorithm>

#include "allocator/nvtx.hpp"
#include "cucache/errors.hpp"

namespace cucache::detail {

namespace {
/// Largest physical handle created at once. Larger handles cost the same to create and map, but
/// can only be moved or given back whole; 256 MiB keeps a 1 GiB request at four calls.
constexpr std::size_t k_max_handle_bytes = std::size_t{256} << 20;

/// While memory is plentiful, reserved memory may exceed the high-water mark of held memory (pages
/// a live or pending block touches) by this fraction of it: idle pages then stay mapped where they
/// went idle, and new ones are created, instead of being moved at every placement that lacks them.
/// Idle memory is always reclaimable, so the slack never costs the fit under a limit.
constexpr std::size_t k_idle_slack_divisor = 128;  // 0.8%

std::size_t round_up(std::size_t n, std::size_t m) {
  return (n + m - 1) / m * m;
}
}  // namespace

pager::pager(device_backend& backend, device_budget budget, std::size_t page_bytes,
             std::size_t device_total, std::shared_mutex& pools_mu,
             const std::vector<std::unique_ptr<stream_pool>>& pools)
    : backend_(backend),
      budget_(budget),
      page_bytes_(page_bytes),
      device_total_(device_total),
      pools_mu_(pools_mu),
      pools_(pools) {}

pager::~pager() {
  for (auto& [bytes, h] : free_handles) {
    try {
      backend_.phys_release(h);
    } catch (...) {
    }
  }
}

// --- ranges and the page table ------------------------------------------------------------------

std::unique_ptr<vm_range> pager::reserve_range(pool_kind kind) {
  // Virtual space is cheap: twice the device for the large pool, once for the small one, so that
  // holes between live blocks never exhaust it.
  const std::size_t bytes =
      round_up(kind == pool_kind::small ? device_total_ : 2 * device_total_, page_bytes_);
  void* va = backend_.va_reserve(bytes);
  auto r = std::make_unique<vm_range>();
  r->base = reinterpret_cast<std::uintptr_t>(va);
  r->size = bytes;
  r->page_bytes = page_bytes_;
  r->kind = kind;
  r->page_map.assign(bytes / page_bytes_, nullptr);
  r->page_use.assign(bytes / page_bytes_, 0);
  return r;
}

void pager::destroy_range(vm_range& r) noexcept {
  for (std::size_t pg = 0; pg < r.page_map.size(); ++pg) {
    vm_mapping* m = r.page_map[pg];
    if (m == nullptr || m->first_page != pg) continue;
    try {
      backend_.unmap(reinterpret_cast<void*>(r.page_addr(pg)), m->pages * page_bytes_);
      backend_.phys_release(m->handle);
    } catch (...) {
    }
  }
  try {
    backend_.va_free(reinterpret_cast<void*>(r.base), r.size);
  } catch (...) {
  }
}

void pager::idle_link(stream_pool& p, vm_mapping* m) {
  m->idle = true;
  m->idle_epoch = syncs_started_.load(std::memory_order_seq_cst);
  m->idle_prev = nullptr;
  m->idle_next = p.idle_head;
  if (p.idle_head != nullptr) {
    p.idle_head->idle_prev = m;
  } else {
    p.idle_tail = m;
  }
  p.idle_head = m;
  p.idle_bytes += m->pages * page_bytes_;
  idle_total_.fetch_add(m->pages * page_bytes_, std::memory_order_relaxed);
}

void pager::idle_unlink(stream_pool& p, vm_mapping* m) {
  if (m->idle_prev != nullptr) m->idle_prev->idle_next = m->idle_next;
  if (m->idle_next != nullptr) m->idle_next->idle_prev = m->idle_prev;
  if (p.idle_head == m) p.idle_head = m->idle_next;
  if (p.idle_tail == m) p.idle_tail = m->idle_prev;
  m->idle_prev = m->idle_next = nullptr;
  m->idle = false;
  p.idle_bytes -= m->pages * page_bytes_;
  idle_total_.fetch_sub(m->pages * page_bytes_, std::memory_order_relaxed);
}

void pager::touch(stream_pool& p, const block* b, int delta) {
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

// --- synchronization ----------------------------------------------------------------------------

void pager::synchronize_device() {
  const std::uint64_t ticket = syncs_started_.fetch_add(1, std::memory_order_seq_cst) + 1;
  backend_.device_synchronize();
  counters.synchronizations.fetch_add(1, std::memory_order_relaxed);
  std::uint64_t done = syncs_done_.load(std::memory_order_seq_cst);
  while (done < ticket && !syncs_done_.compare_exchange_weak(done, ticket)) {
  }
}

void pager::wait_until_unmappable(const vm_mapping& m) {
  // m became idle when syncs_started_ was m.idle_epoch: every synchronization with a ticket above
  // that started after the free, so once one has completed, the work that used m has too.
  if (syncs_done_.load(std::memory_order_seq_cst) > m.idle_epoch) return;
  synchronize_device();
}

// --- device calls and their bookkeeping ---------------------------------------------------------

void pager::keep_locked(phys_handle h, std::size_t bytes) {
  free_handles.emplace(bytes, h);
  free_handle_bytes += bytes;
}

void pager::keep(phys_handle h, std::size_t bytes) {
  std::lock_guard lock(budget_.mu);
  keep_locked(h, bytes);
}

void pager::release(phys_handle h, std::size_t bytes) {
  std::lock_guard lock(budget_.mu);
  try {
    backend_.phys_release(h);
  } catch (...) {
    keep_locked(h, bytes);  // still ours: keep it tracked, never leak it
    throw;
  }
  budget_.reserved -= bytes;
  counters.release.fetch_add(1, std::memory_order_relaxed);
  budget_.device_frees.fetch_add(1, std::memory_order_relaxed);
}

void pager::release_unmapped(std::size_t target_reserved) {
  std::lock_guard lock(budget_.mu);
  while (budget_.reserved > target_reserved && !free_handles.empty()) {
    auto it = std::prev(free_handles.end());
    const auto [bytes, h] = *it;
    backend_.phys_release(h);  // a failure leaves the handle listed
    free_handles.erase(it);
    free_handle_bytes -= bytes;
    budget_.reserved -= bytes;
    counters.release.fetch_add(1, std::memory_order_relaxed);
    budget_.device_frees.fetch_add(1, std::memory_order_relaxed);
  }
}

phys_handle pager::unmap(stream_pool& p, vm_mapping* m) {
  // REQUIRES: m idle, wait_until_unmappable(*m) done.
  vm_range& r = *m->range;
  const std::size_t bytes = m->pages * page_bytes_;
  backend_.unmap(reinterpret_cast<void*>(r.page_addr(m->first_page)), bytes);
  counters.unmap.fetch_add(1, std::memory_order_relaxed);
  for (std::size_t i = 0; i < m->pages; ++i) r.page_map[m->first_page + i] = nullptr;
  r.mapped_pages -= m->pages;
  if (m->idle) idle_unlink(p, m);
  p.stats.reserved_bytes.dec(r.kind, static_cast<std::int64_t>(bytes));
  p.stats.segment_count.dec(r.kind, 1);
  const phys_handle h = m->handle;
  p.maps.recycle(m);
  return h;
}

void pager::release_idle(stream_pool& q, vm_mapping* m) {
  wait_until_unmappable(*m);
  const std::size_t bytes = m->pages * page_bytes_;
  release(unmap(q, m), bytes);
}

void pager::record_mapping(stream_pool& p, vm_range& r, std::size_t first_page, std::size_t pages,
                           phys_handle h) {
  vm_mapping* m = p.maps.make();
  *m = vm_mapping{&r, first_page, pages, h, 0, nullptr, nullptr, false, 0};
  for (std::size_t i = 0; i < pages; ++i) {
    r.page_map[first_page + i] = m;
    m->used_pages += r.page_use[first_page + i] > 0;
  }
  r.mapped_pages += pages;
  p.stats.reserved_bytes.inc(r.kind, static_cast<std::int64_t>(pages * page_bytes_));
  p.stats.segment_count.inc(r.kind, 1);
  if (m->used_pages == 0) idle_link(p, m);
}

void pager::map(stream_pool& p, vm_range& r, std::size_t first_page, const piece& pc) {
  void* va = reinterpret_cast<void*>(r.page_addr(first_page));
  const std::size_t pages = pc.bytes / page_bytes_;
  try {
    backend_.map(va, pc.bytes, pc.handle);
  } catch (...) {
    keep(pc.handle, pc.bytes);
    throw;
  }
  counters.map.fetch_add(1, std::memory_order_relaxed);
  try {
    backend_.set_access(va, pc.bytes);
  } catch (...) {
    // Leave nothing half-mapped: undo the map, keep the handle for reuse.
    try {
      backend_.unmap(va, pc.bytes);
      counters.unmap.fetch_add(1, std::memory_order_relaxed);
      keep(pc.handle, pc.bytes);
    } catch (...) {
      // The mapping could not be undone: record it as mapped (idle unless used) so that it stays
      // tracked.
      record_mapping(p, r, first_page, pages, pc.handle);
    }
    throw;
  }
  if (pc.moved) counters.stitched_pages.fetch_add(pages, std::memory_order_relaxed);
  record_mapping(p, r, first_page, pages, pc.handle);
}

// --- physical-memory sources --------------------------------------------------------------------

std::optional<pager::piece> pager::take_unmapped(std::size_t want) {
  std::lock_guard lock(budget_.mu);
  auto it = free_handles.upper_bound(want);
  if (it == free_handles.begin()) return std::nullopt;
  --it;
  piece pc{it->second, it->first, false};
  free_handles.erase(it);
  free_handle_bytes -= pc.bytes;
  return pc;
}

namespace {
/// Idle mappings looked at, least recently idle first, when one is taken to be moved: a bounded
/// walk keeps the allocation path O(1) however long the idle list grows.
constexpr int k_idle_scan = 16;
}  // namespace

vm_mapping* pager::idle_within(const stream_pool& q, std::size_t want) const {
  // Least recently idle first: a steady loop is least likely to come back for those pages, and
  // they are the ones that went idle before the last device synchronization (no new one needed).
  // Among those looked at, the largest that fits and needs no synchronization, else the largest.
  const std::uint64_t done = syncs_done_.load(std::memory_order_seq_cst);
  vm_mapping* best = nullptr;
  bool best_synced = false;
  int seen = 0;
  for (vm_mapping* m = q.idle_tail; m != nullptr && seen < k_idle_scan; m = m->idle_prev, ++seen) {
    if (m->pages * page_bytes_ > want) continue;
    const bool synced = done > m->idle_epoch;
    if (best == nullptr || (synced && !best_synced) ||
        (synced == best_synced && m->pages > best->pages)) {
      best = m;
      best_synced = synced;
    }
  }
  return best;
}

std::optional<pager::piece> pager::take_idle(stream_pool& p, std::size_t want) {
  vm_mapping* m = idle_within(p, want);
  if (m == nullptr) return std::nullopt;
  wait_until_unmappable(*m);
  const std::size_t bytes = m->pages * page_bytes_;
  return piece{unmap(p, m), bytes, true};
}

std::optional<pager::piece> pager::take_peer_idle(stream_pool& p, std::size_t want) {
  std::shared_lock list(pools_mu_, std::try_to_lock);
  if (!list.owns_lock()) return std::nullopt;
  for (const auto& q : pools_) {
    if (q.get() == &p) continue;
    std::unique_lock lk(q->mu, std::try_to_lock);
    if (!lk.owns_lock()) continue;
    vm_mapping* m = idle_within(*q, want);
    if (m == nullptr) continue;
    wait_until_unmappable(*m);
    const std::size_t bytes = m->pages * page_bytes_;
    piece pc{unmap(*q, m), bytes, true};
    counters.shared_pages.fetch_add(bytes / page_bytes_, std::memory_order_relaxed);
    return pc;
  }
  return std::nullopt;
}

std::optional<pager::piece> pager::create(std::size_t bytes) {
  std::lock_guard lock(budget_.mu);
  if (budget_.limit != 0 && budget_.reserved + bytes > budget_.limit) return std::nullopt;
  std::optional<phys_handle> h = backend_.phys_create(bytes);
  if (!h) return std::nullopt;
  budget_.reserved += bytes;
  budget_.peak = std::max(budget_.peak, budget_.reserved);
  counters.create.fetch_add(1, std::memory_order_relaxed);
  budget_.device_allocs.fetch_add(1, std::memory_order_relaxed);
  return piece{*h, bytes, false};
}

// --- policy -------------------------------------------------------------------------------------

bool pager::may_grow(stream_pool& p, std::size_t extra) {
  // Moving a page costs an unmap, a map and a set-access, and perhaps a device synchronization;
  // creating costs about as much, but leaves idle pages mapped where a steady loop will want them
  // again. So while the device, the memory limit and the garbage-collection threshold have room,
  // new memory is created as long as reserved memory stays within the slack above the high-water
  // mark of held memory (reserved less idle and unmapped bytes, counting the pages being backed:
  // the same whether they are created or moved), or at or below the pool's active bytes. Beyond
  // that, idle pages are moved: only then does moving lower what the device must hold.
  if (!fits(extra)) return false;
  const auto active = static_cast<std::size_t>(p.stats.active_bytes(0).current);
  const std::size_t idle = idle_total_.load(std::memory_order_relaxed);
  std::lock_guard lock(budget_.mu);
  const std::size_t after = budget_.reserved + extra;
  const std::size_t unheld = idle + free_handle_bytes;
  const std::size_t held = after > unheld ? after - unheld : 0;
  held_peak_ = std::max(held_peak_, held);
  const std::size_t allowed = held_peak_ + held_peak_ / k_idle_slack_divisor;
  return after <= std::max({budget_.peak, allowed, active});
}

bool pager::over_caps(std::size_t bytes) {
  std::lock_guard lock(budget_.mu);
  return (budget_.limit != 0 && budget_.reserved + bytes > budget_.limit) ||
         (budget_.gc_bytes != 0 && budget_.reserved + bytes > budget_.gc_bytes);
}

bool pager::fits(std::size_t bytes) {
  return !over_caps(bytes) && backend_.mem_get_info().free_bytes >= bytes;
}

bool pager::reclaim(stream_pool& p, std::size_t bytes) {
  if (fits(bytes)) return true;
  counters.reclaims.fetch_add(1, std::memory_order_relaxed);
  const nvtx_range range(nvtx, "cucache: reclaim idle pages");
  // Unmapped handles first: no synchronization, and none of them fits the run (take_unmapped
  // would have taken it).
  for (;;) {
    std::size_t target = 0;
    {
      std::lock_guard lock(budget_.mu);
      if (free_handles.empty()) break;
      target = budget_.reserved - std::prev(free_handles.end())->first;
    }
    release_unmapped(target);  // the largest
    if (fits(bytes)) return true;
  }
  // Then idle mappings, least recently idle first: this pool's, then the other pools'.
  if (!may_synchronize_()) return false;
  while (p.idle_tail != nullptr) {
    release_idle(p, p.idle_tail);
    if (fits(bytes)) return true;
  }
  std::shared_lock list(pools_mu_, std::try_to_lock);
  if (!list.owns_lock()) return false;
  for (const auto& q : pools_) {
    if (q.get() == &p) continue;
    std::unique_lock lk(q->mu, std::try_to_lock);
    if (!lk.owns_lock()) continue;
    while (q->idle_tail != nullptr) {
      release_idle(*q, q->idle_tail);
      if (fits(bytes)) return true;
    }
  }
  return false;
}

void pager::make_room(stream_pool& p, std::size_t bytes) {
  // Unmapped handles too large for the run, smallest first, then this pool's idle mappings too
  // large for it (take_idle took any that fit), least recently idle first.
  while (!may_grow(p, bytes)) {
    std::optional<piece> pc;
    {
      std::lock_guard lock(budget_.mu);
      if (!free_handles.empty()) {
        auto it = free_handles.begin();
        pc = piece{it->second, it->first, false};
        free_handles.erase(it);
        free_handle_bytes -= pc->bytes;
      }
    }
    if (pc) {
      release(pc->handle, pc->bytes);
      continue;
    }
    if (p.idle_tail == nullptr) return;
    release_idle(p, p.idle_tail);
  }
}

void pager::split_overhang(stream_pool& p, vm_range& r, std::uintptr_t addr, std::size_t bytes) {
  // An idle mapping that the new block would use only in part would be pinned whole by it, and
  // the pages the block does not touch could not be given back or moved while it lives: a
  // handle is released whole or not at all. Release it instead; back() maps exactly the block's
  // pages. The remainder is not re-created: if the program comes back for it, back() creates it
  // then, and if memory is short meanwhile it is already free.
  if (!may_synchronize_()) return;  // the block pins the mapping whole until the capture ends
  const std::size_t first = r.page_of(addr);
  const std::size_t last = r.page_of(addr + bytes - 1);
  for (std::size_t pg : {first, last}) {
    vm_mapping* m = r.page_map[pg];
    if (m == nullptr || !m->idle) continue;
    // Inside the block's span it is kept (used in place), unless it is a multi-page mapping on a
    // page the block shares with a neighbour: a neighbour carved there later would pin all of it
    // after this block is freed (bert_serve: 1.0197 instead of its floor of 1.0138).
    const bool inside = m->first_page >= first && m->first_page + m->pages - 1 <= last;
    const bool shared = m->pages > 1 && ((pg == first && addr % page_bytes_ != 0) ||
                                         (pg == last && (addr + bytes) % page_bytes_ != 0));
    if (inside && !shared) continue;
    counters.splits.fetch_add(1, std::memory_order_relaxed);
    release_idle(p, m);
  }
}

std::size_t pager::piece_pages(const vm_range& r, const block* b, std::size_t pg) const {
  // A page the block shares with a neighbour -- its first page when it starts inside a page, its
  // last when it ends inside one -- gets a handle of its own: a handle a neighbour keeps in use
  // cannot be moved or given back. Every other page of an unmapped run goes in as few handles as
  // the sources allow (split_overhang keeps a multi-page mapping off a shared page later on).
  const std::size_t first = r.page_of(b->addr);
  const std::size_t last = r.page_of(b->addr + b->size - 1);
  if (pg == first && b->addr % page_bytes_ != 0) return 1;
  std::size_t run = 0;
  while (pg + run <= last && r.page_map[pg + run] == nullptr) ++run;
  if (run > 1 && pg + run - 1 == last && (b->addr + b->size) % page_bytes_ != 0) --run;
  return run;
}

std::size_t pager::missing_bytes(const vm_range& r, const block* b) const {
  std::size_t n = 0;
  for (std::size_t pg = r.page_of(b->addr); pg <= r.page_of(b->addr + b->size - 1); ++pg) {
    n += r.page_map[pg] == nullptr;
  }
  return n * page_bytes_;
}

bool pager::back(stream_pool& p, const block* b) {
  vm_range& r = *b->seg->vm;
  const std::size_t first = r.page_of(b->addr);
  const std::size_t last = r.page_of(b->addr + b->size - 1);
  std::size_t missing = missing_bytes(r, b);
  if (missing == 0) return true;
  const nvtx_range range(nvtx, "cucache: map pages");
  // One decision per block, for all the pages it lacks. While memory is plentiful (may_grow),
  // they are created and idle pages stay mapped where they went idle. Otherwise idle pages are
  // moved here first (this pool's, then another stream's), and only what is still missing is
  // created, after room was made for all of it: reserved memory never rises inside the call above
  // where it ends (nothing is created that a release in the same call then makes up for).
  // While a graph capture is underway nothing may synchronize the device, so nothing is moved or
  // given back: what is missing is created (may_synchronize_, set by the allocator).
  const bool plentiful = may_grow(p, missing) || !may_synchronize_();
  bool moved = false;
  for (int pass = plentiful ? 1 : 0; pass < 2; ++pass) {
    if (pass == 1) {
      missing = missing_bytes(r, b);
      if (missing == 0) return true;
      if (!plentiful) {
        make_room(p, missing);  // idle memory too large to move here
        if (!fits(missing)) (void)reclaim(p, missing);
      }
    }
    for (std::size_t pg = first; pg <= last;) {
      if (r.page_map[pg] != nullptr) {
        ++pg;
        continue;
      }
      const std::size_t pages = piece_pages(r, b, pg);
      const std::size_t want = pages * page_bytes_;
      // Pass 0 moves only until what is still missing may be created: as few moves as lower what
      // the device must hold, and the rest in new handles, as large as the run allows.
      if (pass == 0 && moved && may_grow(p, missing)) break;
      std::optional<piece> pc = take_unmapped(want);
      if (pass == 0) {
        if (!pc) pc = take_idle(p, want);
        if (!pc) pc = take_peer_idle(p, want);
        if (!pc) {
          pg += pages;  // created in pass 1
          continue;
        }
        missing -= pc->bytes;
        moved = true;
      } else if (!pc) {
        const std::size_t fresh = std::min(want, k_max_handle_bytes);
        pc = create(fresh);
        if (!pc && reclaim(p, fresh)) pc = create(fresh);
        if (!pc) return false;
      }
      map(p, r, pg, *pc);
      pg += pc->bytes / page_bytes_;
    }
  }
  return true;
}

bool pager::map_idle_pages(stream_pool& p, vm_range& r, std::uintptr_t addr, std::size_t bytes) {
  const nvtx_range range(nvtx, "cucache: reserve pages");
  for (std::size_t pg = r.page_of(addr); pg <= r.page_of(addr + bytes - 1); ++pg) {
    if (r.page_map[pg] != nullptr) continue;
    std::optional<piece> pc = take_unmapped(page_bytes_);  // only a one-page handle fits
    if (!pc) pc = create(page_bytes_);
    if (!pc) return false;
    map(p, r, pg, *pc);
  }
  return true;
}

void pager::unmap_idle(stream_pool& p, bool release_handles) {
  while (p.idle_head != nullptr) {
    vm_mapping* m = p.idle_head;
    wait_until_unmappable(*m);
    const std::size_t bytes = m->pages * page_bytes_;
    const phys_handle h = unmap(p, m);
    if (release_handles) {
      release(h, bytes);
    } else {
      keep(h, bytes);
    }
  }
}

}  // namespace cucache::detail
