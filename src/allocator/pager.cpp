// The pager of expandable segments (see pager.hpp and docs/design.md, "Expandable segments").
#include "allocator/pager.hpp"

#include <algorithm>

#include "allocator/nvtx.hpp"
#include "allocator/placement.hpp"
#include "cucache/errors.hpp"

namespace cucache::detail {

pager::pager(device_backend& backend, device_budget& budget, std::size_t page_bytes,
             const pool_table& pools)
    : backend_(backend),
      budget_(budget),
      page_bytes_(page_bytes),
      device_total_(budget.device_total),
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
  r->edge_use.assign(bytes / page_bytes_, 0);
  return r;
}

void pager::destroy_range(vm_range& r) noexcept {
  for (std::size_t pg = 0; pg < r.page_map.size(); ++pg) {
    vm_mapping* m = r.page_map[pg];
    if (m == nullptr || m->first_page != pg) continue;
    try {
      timed(counters.vm_ns, [&] {
        backend_.unmap(reinterpret_cast<void*>(r.page_addr(pg)), m->pages * page_bytes_);
        backend_.phys_release(m->handle);
      });
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
  m->idle_next = p.pages.idle_head;
  if (p.pages.idle_head != nullptr) {
    p.pages.idle_head->idle_prev = m;
  } else {
    p.pages.idle_tail = m;
  }
  p.pages.idle_head = m;
  p.pages.idle_bytes += m->pages * page_bytes_;
  idle_total_.fetch_add(m->pages * page_bytes_, std::memory_order_relaxed);
}

void pager::idle_unlink(stream_pool& p, vm_mapping* m) {
  if (m->idle_prev != nullptr) m->idle_prev->idle_next = m->idle_next;
  if (m->idle_next != nullptr) m->idle_next->idle_prev = m->idle_prev;
  if (p.pages.idle_head == m) p.pages.idle_head = m->idle_next;
  if (p.pages.idle_tail == m) p.pages.idle_tail = m->idle_prev;
  m->idle_prev = m->idle_next = nullptr;
  m->idle = false;
  p.pages.idle_bytes -= m->pages * page_bytes_;
  idle_total_.fetch_sub(m->pages * page_bytes_, std::memory_order_relaxed);
}

void pager::touch(stream_pool& p, const block* b, int delta) {
  // Pages in address order, so that mappings go idle in the order a per-page walk would link
  // them: the first page and the last by their edge counts (a neighbour may share them), the
  // pages strictly between in one step per mapping (only b touches them). O(mappings crossed):
  // on a cache hit every page is mapped; unmapped pages are stepped over one by one only on the
  // way to back(), which then makes VM calls.
  vm_range& r = *b->seg->vm;
  const std::size_t first = r.page_of(b->addr);
  const std::size_t last = r.page_of(b->addr + b->size - 1);
  auto edge = [&](std::size_t pg) {
    vm_mapping* m = r.page_map[pg];
    if (delta > 0) {
      if (r.edge_use[pg]++ == 0 && m != nullptr && m->used_pages++ == 0) idle_unlink(p, m);
    } else {
      if (--r.edge_use[pg] == 0 && m != nullptr && --m->used_pages == 0) idle_link(p, m);
    }
  };
  edge(first);
  if (last == first) return;
  for (std::size_t pg = first + 1; pg < last;) {
    vm_mapping* m = r.page_map[pg];
    if (m == nullptr) {
      ++pg;
      continue;
    }
    const std::size_t end = std::min(m->first_page + m->pages, last);
    const std::size_t n = end - pg;
    if (delta > 0) {
      if (m->used_pages == 0) idle_unlink(p, m);
      m->used_pages += n;
    } else {
      m->used_pages -= n;
      if (m->used_pages == 0) idle_link(p, m);
    }
    pg = end;
  }
  edge(last);
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
    timed(counters.vm_ns, [&] { backend_.phys_release(h); });
  } catch (...) {
    keep_locked(h, bytes);  // still ours: keep it tracked, never leak it
    throw;
  }
  budget_.reserved -= bytes;
  budget_.device_frees.fetch_add(1, std::memory_order_relaxed);
}

void pager::release_unmapped(std::size_t target_reserved) {
  std::lock_guard lock(budget_.mu);
  while (budget_.reserved > target_reserved && !free_handles.empty()) {
    auto it = std::prev(free_handles.end());
    const std::size_t bytes = it->first;
    const phys_handle h = it->second;
    timed(counters.vm_ns, [&] { backend_.phys_release(h); });  // a failure leaves it listed
    free_handles.erase(it);
    free_handle_bytes -= bytes;
    budget_.reserved -= bytes;
    budget_.device_frees.fetch_add(1, std::memory_order_relaxed);
  }
}

phys_handle pager::unmap(stream_pool& p, vm_mapping* m) {
  // REQUIRES: m idle, wait_until_unmappable(*m) done.
  vm_range& r = *m->range;
  const std::size_t bytes = m->pages * page_bytes_;
  timed(counters.vm_ns,
        [&] { backend_.unmap(reinterpret_cast<void*>(r.page_addr(m->first_page)), bytes); });
  counters.unmap.fetch_add(1, std::memory_order_relaxed);
  for (std::size_t i = 0; i < m->pages; ++i) r.page_map[m->first_page + i] = nullptr;
  r.mapped_pages -= m->pages;
  if (m->idle) idle_unlink(p, m);
  p.stats.reserved_bytes.dec(r.kind, static_cast<std::int64_t>(bytes));
  if (r.mapped_pages == 0) p.stats.segment_count.dec(r.kind, 1);  // a range holding memory
  const phys_handle h = m->handle;
  p.pages.maps.recycle(m);
  return h;
}

void pager::release_idle(stream_pool& q, vm_mapping* m) {
  wait_until_unmappable(*m);
  const std::size_t bytes = m->pages * page_bytes_;
  release(unmap(q, m), bytes);
}

vm_mapping* pager::record_mapping(stream_pool& p, vm_range& r, std::size_t first_page,
                                  std::size_t pages, phys_handle h, mapping_use use) {
  // REQUIRES, for mapping_use::touched: [first_page, first_page + pages) lies inside the span of
  // the carved block being backed, so every page of it is touched; for mapping_use::idle: no
  // block touches any of them.
  vm_mapping* m = p.pages.maps.make();
  *m = vm_mapping{};
  m->range = &r;
  m->first_page = first_page;
  m->pages = pages;
  m->handle = h;
  m->used_pages = use == mapping_use::touched ? pages : 0;
  if (use == mapping_use::idle) idle_link(p, m);
  for (std::size_t i = 0; i < pages; ++i) r.page_map[first_page + i] = m;
  if (r.mapped_pages == 0) p.stats.segment_count.inc(r.kind, 1);  // a range holding memory
  r.mapped_pages += pages;
  p.stats.reserved_bytes.inc(r.kind, static_cast<std::int64_t>(pages * page_bytes_));
  return m;
}

void pager::map(stream_pool& p, vm_range& r, std::size_t first_page, const piece& pc,
                std::vector<vm_mapping*>& batch, mapping_use use) {
  void* va = reinterpret_cast<void*>(r.page_addr(first_page));
  const std::size_t pages = pc.bytes / page_bytes_;
  try {
    timed(counters.vm_ns, [&] { backend_.map(va, pc.bytes, pc.handle); });
  } catch (...) {
    keep(pc.handle, pc.bytes);
    throw;
  }
  counters.map.fetch_add(1, std::memory_order_relaxed);
  if (pc.moved) counters.stitched_pages.fetch_add(pages, std::memory_order_relaxed);
  // Not accessible yet: grant_access sets access over the whole batch of back() at once.
  batch.push_back(record_mapping(p, r, first_page, pages, pc.handle, use));
}

void pager::grant_access(stream_pool& p, vm_range& r, std::size_t first, std::size_t last,
                         const std::vector<vm_mapping*>& batch) {
  // One cuMemSetAccess per run of adjacent mappings without access in [first, last]: the driver
  // takes any fully mapped range made of whole mappings (PyTorch's expandable segments set access
  // over several handles at once too). Mappings that already have access break a run: their
  // pages may be in use by running work, and are not touched again.
  std::size_t pg = first;
  while (pg <= last) {
    vm_mapping* m = r.page_map[pg];
    if (m == nullptr || m->accessible) {
      pg = m == nullptr ? pg + 1 : m->first_page + m->pages;
      continue;
    }
    const std::size_t run_first = m->first_page;
    std::size_t run_end = m->first_page + m->pages;
    while (run_end <= last && r.page_map[run_end] != nullptr && !r.page_map[run_end]->accessible) {
      run_end = r.page_map[run_end]->first_page + r.page_map[run_end]->pages;
    }
    try {
      backend_.set_access(reinterpret_cast<void*>(r.page_addr(run_first)),
                          (run_end - run_first) * page_bytes_);
    } catch (...) {
      revoke(p, batch);
      throw;
    }
    counters.set_access.fetch_add(1, std::memory_order_relaxed);
    for (std::size_t q = run_first; q < run_end; q += r.page_map[q]->pages) {
      r.page_map[q]->accessible = true;
    }
    pg = run_end;
  }
}

void pager::revoke(stream_pool& p, const std::vector<vm_mapping*>& batch) noexcept {
  // Leave nothing half-mapped: the mappings this back() made that have no access yet (no work
  // has seen them: no synchronization needed; only the block being backed touches them) are
  // unmapped again, their handles kept for reuse. One whose unmap fails too stays recorded,
  // without access, so that it stays tracked; the next back() over it grants access.
  for (vm_mapping* m : batch) {
    if (m->accessible) continue;
    const std::size_t bytes = m->pages * page_bytes_;
    try {
      const phys_handle h = unmap(p, m);
      keep(h, bytes);
    } catch (...) {
    }
  }
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
  for (vm_mapping* m = q.pages.idle_tail; m != nullptr && seen < k_idle_scan; m = m->idle_prev, ++seen) {
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
  std::optional<phys_handle> h = timed(counters.vm_ns, [&] { return backend_.phys_create(bytes); });
  if (!h) return std::nullopt;
  budget_.reserved += bytes;
  budget_.peak = std::max(budget_.peak, budget_.reserved);
  budget_.device_allocs.fetch_add(1, std::memory_order_relaxed);
  return piece{*h, bytes, false};
}

// --- policy -------------------------------------------------------------------------------------

bool pager::may_grow(stream_pool& /*p*/, std::size_t extra) {
  // Every handle is one page, so an idle page pins nothing but itself: keeping it mapped where it
  // went idle costs no fit, because it can be given back, page by page, the moment memory is
  // short (reclaim). So memory is plentiful exactly while the device, the memory limit and the
  // garbage-collection threshold have room for `extra` more: then the missing pages are created
  // and idle pages stay where a steady loop comes back for them, so that once the loop has
  // touched its pages it makes no VM call and no synchronization (PyTorch's expandable segments
  // behave the same way, never unmapping idle memory unasked). Otherwise idle pages are moved
  // and reclaimed: only then does moving lower what the device must hold. Reserved memory
  // without a limit is then the union of the pages the program touched (measured: below
  // PyTorch's expandable mode on every shared trace, docs/design.md).
  return fits(extra);
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
  // Unmapped handles are not given back: each is one page, and back() takes them before it
  // creates anything, so releasing one only to create another would gain no room. Idle pages,
  // least recently idle first: this pool's, then the other pools'.
  if (!may_synchronize_()) return false;
  while (p.pages.idle_tail != nullptr) {
    release_idle(p, p.pages.idle_tail);
    if (fits(bytes)) return true;
  }
  std::shared_lock list(pools_mu_, std::try_to_lock);
  if (!list.owns_lock()) return false;
  for (const auto& q : pools_) {
    if (q.get() == &p) continue;
    std::unique_lock lk(q->mu, std::try_to_lock);
    if (!lk.owns_lock()) continue;
    while (q->pages.idle_tail != nullptr) {
      release_idle(*q, q->pages.idle_tail);
      if (fits(bytes)) return true;
    }
  }
  return false;
}

pager::span_state pager::scan(const vm_range& r, const block* b) const {
  // One step per mapping, one per unmapped page (only when VM calls follow).
  span_state st;
  const std::size_t last = r.page_of(b->addr + b->size - 1);
  for (std::size_t pg = r.page_of(b->addr); pg <= last;) {
    const vm_mapping* m = r.page_map[pg];
    if (m == nullptr) {
      st.missing_bytes += page_bytes_;
      ++pg;
      continue;
    }
    st.needs_access |= !m->accessible;
    pg = m->first_page + m->pages;
  }
  return st;
}

bool pager::back(stream_pool& p, const block* b) {
  vm_range& r = *b->seg->vm;
  const std::size_t first = r.page_of(b->addr);
  const std::size_t last = r.page_of(b->addr + b->size - 1);
  const span_state st = scan(r, b);
  std::vector<vm_mapping*> batch;  // what this call maps
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
    batch.reserve(4);
    ok = back_pages(p, r, b, st.missing_bytes, batch);
  } catch (...) {
    revoke(p, batch);
    throw;
  }
  grant_access(p, r, first, last, batch);  // also when !ok: what was mapped stays, usable
  return ok;
}

bool pager::back_pages(stream_pool& p, vm_range& r, const block* b, std::size_t missing,
                       std::vector<vm_mapping*>& batch) {
  const std::size_t first = r.page_of(b->addr);
  const std::size_t last = r.page_of(b->addr + b->size - 1);
  // One decision per block, for all the pages it lacks, one handle per page. While memory is
  // plentiful (may_grow), they are created and idle pages stay mapped where they went idle.
  // Otherwise idle pages are moved here first (this pool's, then another stream's), and only what
  // is still missing is created, after room was made for all of it: reserved memory never rises
  // inside the call above where it ends (nothing is created that a release in the same call then
  // makes up for). While a graph capture is underway nothing may synchronize the device, so
  // nothing is moved or given back: what is missing is created (may_synchronize_, set by the
  // allocator).
  const bool plentiful = may_grow(p, missing) || !may_synchronize_();
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
        std::lock_guard lock(budget_.mu);
        kept = free_handle_bytes;
      }
      const std::size_t fresh = missing > kept ? missing - kept : 0;
      if (!plentiful && fresh != 0 && !fits(fresh)) {
        (void)reclaim(p, fresh);
        bool room = false;
        {
          std::lock_guard lock(budget_.mu);
          room = budget_.limit == 0 || budget_.reserved + fresh <= budget_.limit;
        }
        if (!room || backend_.mem_get_info().free_bytes < fresh) return false;
      }
    }
    for (std::size_t pg = first; pg <= last;) {
      if (r.page_map[pg] != nullptr) {
        ++pg;
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
        missing -= pc->bytes;
        moved = true;
      } else if (!pc) {
        pc = create(want);
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
  std::vector<vm_mapping*> batch;
  bool ok = true;
  try {
    for (std::size_t pg = first; pg <= last; ++pg) {
      if (r.page_map[pg] != nullptr) continue;
      std::optional<piece> pc = take_unmapped(page_bytes_);  // only a one-page handle fits
      if (!pc) pc = create(page_bytes_);
      if (!pc) {
        ok = false;
        break;
      }
      map(p, r, pg, *pc, batch, mapping_use::idle);  // no block touches it
    }
  } catch (...) {
    revoke(p, batch);
    throw;
  }
  grant_access(p, r, first, last, batch);  // also when !ok: what was mapped stays, usable
  return ok;
}

void pager::unmap_idle(stream_pool& p, bool release_handles) {
  while (p.pages.idle_head != nullptr) {
    vm_mapping* m = p.pages.idle_head;
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

// --- sleep ---------------------------------------------------------------------------------------

std::size_t pager::evict(stream_pool& p, bool synchronize) {
  if (synchronize) synchronize_device();
  std::size_t released = 0;
  for (segment* seg : p.pages.ranges) {
    if (seg == nullptr) continue;
    vm_range& r = *seg->vm;
    for (std::size_t pg = 0; pg < r.page_map.size() && r.mapped_pages != 0; ++pg) {
      vm_mapping* m = r.page_map[pg];
      if (m == nullptr || m->first_page != pg) continue;
      const std::size_t bytes = m->pages * page_bytes_;
      release(unmap(p, m), bytes);  // unmap: off the idle list, out of the page table and stats
      released += bytes;
    }
  }
  return released;
}

std::size_t pager::room_bytes() {
  const std::size_t device_free = backend_.mem_get_info().free_bytes;
  std::lock_guard lock(budget_.mu);
  std::size_t room = device_free;
  if (budget_.limit != 0) {
    room = std::min(room, budget_.limit > budget_.reserved ? budget_.limit - budget_.reserved : 0);
  }
  return room + free_handle_bytes;
}

// --- what cached memory can serve ---------------------------------------------------------------

std::size_t pager::largest_cached_request(const stream_pool& p, pool_kind kind,
                                          const size_policy& policy) const {
  // A request placed in p's range (best fit, at the front of the free block: impl's placement)
  // is served from cached memory when back() finds every page it touches mapped or backed by an
  // unmapped handle (each one page): nothing is created. Idle mappings elsewhere are not counted:
  // back() moves them only when memory is not plentiful, which depends on the device's free
  // memory at the time of the request; while it is plentiful it creates instead.
  const std::size_t lo = kind == pool_kind::small ? 0 : k_small_request_max_bytes;
  const std::size_t hi = kind == pool_kind::small ? k_small_request_max_bytes : ~std::size_t{0};
  std::size_t handles = 0;  // unmapped one-page handles
  {
    std::lock_guard lock(budget_.mu);
    handles = free_handle_bytes / page_bytes_;
  }
  std::size_t best = 0;
  const auto consider = [&](std::size_t bytes) {
    const std::size_t r = policy.largest_rounded_within(std::min(bytes, hi));
    return r > lo && r > best ? r : 0;
  };
  const segment* seg = p.pages.ranges[static_cast<int>(kind)];
  if (seg == nullptr) return consider(handles * page_bytes_);  // reserved, backed from handles
  const vm_range& range = *seg->vm;
  const free_index& index = p.index_of(kind);
  index.for_each([&](const block* f) {
    if (consider(f->size) == 0) return;
    const std::size_t fp = range.page_of(f->addr);
    const std::size_t fl = range.page_of(f->addr + f->size - 1);
    // The pages a request placed in f may end on: no further than the handles can back.
    std::size_t reach = 0;  // pages from fp
    for (std::size_t pg = fp, unmapped = 0; pg <= fl; ++pg, ++reach) {
      unmapped += range.page_map[pg] == nullptr;
      if (unmapped > handles) break;
    }
    // From the largest request down; the first one placed in f is this block's largest.
    for (std::size_t j = reach; j-- > 0;) {
      const std::size_t boundary = range.page_addr(fp + j + 1) - f->addr;
      const std::size_t below = j == 0 ? 0 : range.page_addr(fp + j) - f->addr;
      for (std::size_t end : {std::min(boundary, f->size), std::min(boundary - 1, f->size)}) {
        const std::size_t r = consider(end);
        if (r == 0 || r <= below) continue;    // none left ending on this page
        if (place_in_range(index, r) != f) continue;  // a request of r is placed elsewhere
        best = r;
        return;
      }
    }
  });
  return best;
}

}  // namespace cucache::detail
