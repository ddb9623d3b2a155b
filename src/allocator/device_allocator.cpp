// The allocation and free paths of device_allocator: cache lookup, splitting, coalescing, segment
// growth, the out-of-memory ladder, deferred frees and garbage collection.
#include "cucache/device_allocator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "allocator/allocator_impl.hpp"
#include "allocator/error_report.hpp"
#include "allocator/nvtx.hpp"
#include "allocator/placement.hpp"
#include "cucache/errors.hpp"

namespace cucache {

using detail::block;
using detail::block_state;
using detail::pool_kind;
using detail::segment;
using detail::stream_pool;
using detail::vm_range;

namespace {

/// For the analysis, inside a lambda the sleeper's walk calls under every pool lock (lambdas
/// are analysed on their own).
void every_pool_held() noexcept ASSERT_CAPABILITY(detail::every_pool) {}

/// `fraction` of `base` bytes, rounded down, for config key `key`; throws invalid_argument naming
/// the key and value when that is 0 bytes, which would mean `zero_means`.
std::size_t bytes_of_fraction(const device_backend& backend, const char* key, double fraction,
                              std::size_t base, const char* of_what, const char* zero_means) {
  // REQUIRES: 0 < fraction <= 1 (the parser's range). Rounded down; at most base (a product
  // that rounds up to 2^64 in double would not convert).
  const double product = fraction * static_cast<double>(base);
  const std::size_t bytes =
      product >= static_cast<double>(base) ? base : static_cast<std::size_t>(product);
  if (bytes == 0) {
    // 0 bytes is the "off" value: taking it would silently drop the setting.
    throw invalid_argument(fmt::format(
        "cucache config: key '{}': invalid value '{}': {} x {} ({} bytes, device {} ({})) is 0 "
        "bytes, which {}; use a larger value",
        key, fraction, fraction, of_what, base, backend.device(), backend.name(), zero_means));
  }
  return bytes;
}

/// The page size of expandable mode (0 otherwise), after the checks that come first: a backend,
/// and one that supports virtual memory management when expandable segments are asked for.
std::size_t checked_page_bytes(const std::shared_ptr<device_backend>& backend, const config& cfg) {
  if (!backend) throw invalid_argument("device_allocator: backend is null");
  if (!cfg.expandable_segments) return 0;
  const std::size_t page_bytes = backend->vm_granularity();
  if (page_bytes == 0) {
    throw invalid_argument(fmt::format(
        "expandable_segments:True needs virtual memory management, which device {} ({}) does "
        "not support; use expandable_segments:False",
        backend->device(), backend->name()));
  }
  return page_bytes;
}

/// The garbage-collection threshold in bytes: `fraction` of the limit (0: none), else of the
/// device; 0 (off) for fraction 0.
std::size_t gc_bytes_of(device_backend& backend, double fraction, std::size_t limit,
                        std::size_t device_total) {
  if (!(fraction > 0.0)) return 0;
  const std::size_t base = limit != 0 ? limit : device_total;
  return bytes_of_fraction(backend, "garbage_collection_threshold", fraction, base,
                           limit != 0 ? "the memory limit" : "the device's capacity",
                           "would turn garbage collection off");
}

/// The device budget's caps from the config: memory_fraction and memory_limit_mb (the lower
/// wins), the garbage-collection threshold as a fraction of the limit, else of the device.
detail::device_budget make_budget(device_backend& backend, const config& cfg) {
  const std::size_t device_total = backend.mem_get_info().total_bytes;
  std::size_t limit = 0;
  if (cfg.memory_fraction > 0.0) {
    limit = bytes_of_fraction(backend, "memory_fraction", cfg.memory_fraction, device_total,
                              "the device's capacity", "would mean no limit");
  }
  if (cfg.memory_limit_bytes > 0) {
    limit = limit == 0 ? cfg.memory_limit_bytes : std::min(limit, cfg.memory_limit_bytes);
  }
  return detail::device_budget(
      device_total, limit,
      gc_bytes_of(backend, cfg.garbage_collection_threshold, limit, device_total));
}

}  // namespace

device_allocator::impl::impl(std::shared_ptr<device_backend> b, config c,
                             std::shared_ptr<allocation_observer> o)
    : raw(std::move(b)),
      backend(raw ? std::make_shared<detail::capture_safe_backend>(raw) : nullptr),
      cfg(std::move(c)),
      observer(o.get()),
      observer_owner(std::move(o)),
      policy(cfg),
      page_bytes(checked_page_bytes(backend, cfg)),
      budget(make_budget(*backend, cfg)),
      pools(*raw),
      graphs(*raw, pools),
      events(*backend),
      sleeper(raw->device()) {
  pools.set_event_backend(backend.get());
  auto first_rules = std::make_unique<detail::rule_set>(detail::rule_set{policy, cfg});
  rules.store(first_rules.get(), std::memory_order_release);
  rules_kept.push_back(std::move(first_rules));
  memory_fraction.store(cfg.memory_fraction > 0.0 ? cfg.memory_fraction : -1.0,
                        std::memory_order_relaxed);
  if (cfg.expandable_segments) {
    // (The pager gets the capture-safe backend too, and may not move idle pages while a capture
    // is underway: unmapping waits for a device synchronization.)
    pager = std::make_unique<detail::pager>(*backend, budget, page_bytes, pools);
    pager->set_synchronization_gate([this] { return !sync_blocked(); });
    pager->set_observer(&observer);
    pager->nvtx = cfg.nvtx;
    pager->set_coarse_handles(cfg.coarse_handle_pages);  // docs/config.md: coarse_handles
    // Which devices every mapping is made accessible to, and whether its physical memory can be
    // exported (docs/config.md: peer_access, ipc_handles).
    backend->configure_peer_access(cfg.peer_access);
    if (cfg.ipc_handles) backend->enable_phys_export();
  }
}

device_allocator::impl::~impl() {
  // Return everything to the device. Errors here (a runtime already shut down) are swallowed:
  // destructors never throw.
  for (const auto& [domain, r] : sleeper.records()) {
    if (r.host == nullptr) continue;
    try {
      backend->host_free_pinned(r.host);
    } catch (...) {
    }
  }
  sleeper.free_spares(*backend);
  for (auto& p : pools) {
    if (const event_handle e = p->retirement.quiet_event(); e != nullptr) {
      try {
        backend->event_destroy(e);
      } catch (...) {
      }
    }
    p->pending.for_each([&](const detail::pending_free& pf) {
      try {
        backend->event_destroy(pf.event);
      } catch (...) {
      }
    });
    for (segment* s = p->segments; s != nullptr;) {
      segment* next = s->next;
      if (s->vm != nullptr) {
        pager->destroy_range(*s->vm);
        delete s->vm;
        s->vm = nullptr;
      } else {
        try {
          if (s->whole_vm) {
            graph_vm.destroy(*s);
          } else {
            backend->segment_free(reinterpret_cast<void*>(s->base));
          }
        } catch (...) {
        }
      }
      for (block* b = s->first; b != nullptr;) {
        block* nb = b->next;
        if (b->state != block_state::free) delete b->uses;
        p->block_arena.recycle(b);
        b = nb;
      }
      p->segment_arena.recycle(s);
      s = next;
    }
  }
}

// --- pending frees -----------------------------------------------------------------------------

void device_allocator::impl::poll_pending(stream_pool& p) {
  // Per recording stream, oldest first, up to the first event that has not completed: the later
  // ones on that stream cannot have completed either. A query that fails counts as incomplete
  // (the ladder and empty_cache synchronize it): a block is never lost, nor released early. At
  // most pending_frees::k_poll_queues queues per poll, in turn: behind many stalled streams an
  // allocation costs a bounded number of queries, and every queue is looked at within
  // queues / k_poll_queues polls.
  auto& queues = p.pending.queues();
  const auto [first, n] = p.pending.next_poll();
  for (std::size_t i = 0; i < n; ++i) {
    auto& q = queues[(first + i) % queues.size()];
    while (!q.empty()) {
      const detail::pending_free pf = q.front();
      bool done = false;
      try {
        done = backend->event_query(pf.event);
      } catch (...) {
        done = false;
      }
      if (!done) break;
      p.pending.pop_front(q);
      events.give_back(pf.event);
      if (--pf.b->uses->pending_events == 0) release_to_free(p, pf.b);
    }
  }
  p.pending.drop_drained_queues();
}

void device_allocator::impl::sync_pending(stream_pool& p) {
  // Waits for every pending event; a block is released only once all its events have completed.
  std::exception_ptr first_error;
  for (auto& q : p.pending.queues()) {
    p.pending.retain(q, [&](const detail::pending_free& pf) {
      p.mu.assert_held();  // a lambda: the analysis does not carry the caller's locks into it
      try {
        backend->event_synchronize(pf.event);
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
        return true;
      }
      events.give_back(pf.event);
      if (--pf.b->uses->pending_events == 0) release_to_free(p, pf.b);
      return false;
    });
  }
  p.pending.drop_drained_queues();
  if (first_error) std::rethrow_exception(first_error);
}

// --- blocks and segments ----------------------------------------------------------------------

block* device_allocator::impl::find_free(const stream_pool& p, pool_kind kind,
                                         std::size_t rounded) const {
  return detail::place_in_segments(p.index_of(kind), policy, rounded);
}

segment* device_allocator::impl::new_segment(stream_pool& p, pool_kind kind, std::size_t bytes) {
  if (graph_sleeps(p)) [[unlikely]] {
    // Graph memory of a sleepable tag: a whole-VM segment (whole_vm_segments.hpp), whole pages.
    bytes = (bytes + page_bytes - 1) / page_bytes * page_bytes;
    std::uint64_t phys = 0;
    void* va = graph_vm.create(bytes, phys);
    if (va == nullptr) return nullptr;
    segment* s = nullptr;
    try {
      s = add_segment(p, kind, reinterpret_cast<std::uintptr_t>(va), bytes, nullptr);
    } catch (...) {
      graph_vm.undo_create(va, bytes, phys);
      throw;
    }
    s->whole_vm = true;
    s->phys = phys;
    p.stats.reserved_bytes.inc(kind, static_cast<std::int64_t>(bytes));
    p.stats.segment_count.inc(kind, 1);
    if (policy.is_oversize(bytes)) ++p.stats.oversize_segments;
    return s;
  }
  void* ptr = budget.charge(bytes, [&] {
    const detail::nvtx_range range(cfg.nvtx, "cucache: cudaMalloc");
    return backend->segment_malloc(bytes);
  });
  if (ptr == nullptr) return nullptr;
  segment* s = nullptr;
  try {
    s = add_segment(p, kind, reinterpret_cast<std::uintptr_t>(ptr), bytes, nullptr);
  } catch (...) {
    // Nothing of it stays (no storage for it, or a backend that handed out memory cucache
    // holds already): the memory goes back to the device and out of the budget.
    try {
      budget.refund(bytes, [&] { backend->segment_free(ptr); });
    } catch (...) {
    }
    throw;
  }
  p.stats.reserved_bytes.inc(kind, static_cast<std::int64_t>(bytes));
  p.stats.segment_count.inc(kind, 1);
  if (policy.is_oversize(bytes)) ++p.stats.oversize_segments;
  return s;
}

segment* device_allocator::impl::add_segment(stream_pool& p, pool_kind kind, std::uintptr_t base,
                                             std::size_t bytes, detail::vm_range* vm) {
  // A new segment (or expandable range) of p: one free block covering it, indexed. The steps
  // that may throw come first, so that a failure leaves everything as it was.
  segment* s = p.segment_arena.make();
  block* b = nullptr;
  try {
    b = p.block_arena.make();
    directory.add(base, bytes, &p);
  } catch (...) {
    if (b != nullptr) p.block_arena.recycle(b);
    p.segment_arena.recycle(s);
    throw;
  }
  s->base = base;
  s->size = bytes;
  s->kind = kind;
  s->owner = &p;
  s->first = b;
  s->vm = vm;
  s->id = segment_ids.fetch_add(1, std::memory_order_relaxed);
  s->next = p.segments;
  if (p.segments != nullptr) p.segments->prev = s;
  p.segments = s;
  b->addr = base;
  b->size = bytes;
  b->seg = s;
  b->state = block_state::free;
  s->free_tick = ++p.tick;
  p.index_of(kind).insert(b);
  if (allocation_observer* o = observer.load(std::memory_order_acquire);
      o != nullptr && vm == nullptr) [[unlikely]]
    o->on_segment_alloc(base, bytes, p.stream);
  return s;
}

block* device_allocator::impl::split_off(stream_pool& p, block* b, std::size_t front_bytes) {
  // A new free block for b's bytes from front_bytes on, linked after b. b's size and both blocks'
  // places in the free index are the caller's to set.
  block* rest = p.block_arena.make();
  rest->addr = b->addr + front_bytes;
  rest->size = b->size - front_bytes;
  rest->seg = b->seg;
  rest->prev = b;
  rest->next = b->next;
  rest->state = block_state::free;
  if (b->next != nullptr) b->next->prev = rest;
  b->next = rest;
  return rest;
}

block* device_allocator::impl::split_off_outline(stream_pool& p, block* b,
                                                std::size_t front_bytes) {
  return split_off(p, b, front_bytes);
}

void device_allocator::impl::release_segment(stream_pool& p, segment* s) {
  // REQUIRES: s whole and free. Out of the directory first: once the device has the memory back,
  // another pool may get the same addresses and add them. Then the device call, before every
  // other change, so that a failure leaves every structure as it was (the directory's entry put
  // back).
  detail::segment_directory::taken_segment taken = directory.take_out(s->base);
  try {
    budget.refund(s->size, [&] {
      const detail::nvtx_range range(cfg.nvtx, "cucache: cudaFree");
      if (s->whole_vm) {
        graph_vm.destroy(*s);  // (never asleep here: whole_free is false while unmapped)
      } else {
        backend->segment_free(reinterpret_cast<void*>(s->base));
      }
    });
  } catch (...) {
    directory.put_back(std::move(taken));
    throw;
  }
  if (allocation_observer* o = observer.load(std::memory_order_acquire)) [[unlikely]]
    o->on_segment_free(s->base, s->size, p.stream);
  p.index_of(s->kind).erase(s->first);
  p.stats.reserved_bytes.dec(s->kind, static_cast<std::int64_t>(s->size));
  p.stats.segment_count.dec(s->kind, 1);
  if (policy.is_oversize(s->size)) --p.stats.oversize_segments;
  if (s->prev != nullptr) s->prev->next = s->next;
  if (s->next != nullptr) s->next->prev = s->prev;
  if (p.segments == s) p.segments = s->next;
  p.block_arena.recycle(s->first);
  p.segment_arena.recycle(s);
}

block* device_allocator::impl::carve(stream_pool& p, block* b, pool_kind kind, std::size_t rounded,
                                     std::size_t requested) {
  return carve_inline(p, b, kind, rounded, requested);
}

block* device_allocator::impl::carve_inline(stream_pool& p, block* b, pool_kind kind,
                                            std::size_t rounded, std::size_t requested) {
  if (policy.should_split(kind, b->size, rounded)) {
    block* rest = split_off(p, b, rounded);
    p.index_of(kind).replace(b, rest);
    b->size = rounded;
  } else {
    p.index_of(kind).erase(b);
  }
  if (b->seg->vm != nullptr) pager->touch_carved(p, b);
  mark_allocated(p, b, kind, requested);
  return b;
}

void device_allocator::impl::mark_allocated(stream_pool& p, block* b, pool_kind kind,
                                            std::size_t requested) {
  b->state = block_state::allocated;
  b->exported = false;
  b->requested = requested;
  b->uses = nullptr;
  p.stats.on_allocate(kind, static_cast<std::int64_t>(b->size),
                      static_cast<std::int64_t>(requested));
  if (policy.is_oversize(b->size)) ++p.stats.oversize_allocations;
}

bool device_allocator::impl::takes_back(stream_pool& p, const block* h, pool_kind kind,
                                        std::size_t rounded) const {
  // Without the deferral, h would have been merged with its free next block n (its previous one
  // is never free: hold_or_release) into m, h's address and `merged` bytes, and best fit would
  // run on the index with m instead of n. It carves h itself when:
  //  - h has the request's kind and exact size, and m is split there (or m is h);
  //  - the rules let the request take m (segments: place_in_segments; a range's placement,
  //    place_in_range, refuses no size, but allocate_expandable first refuses a request that
  //    never fits and any request of a sleeping domain);
  //  - m comes first in best-fit order among the blocks that fit: no other indexed block of at
  //    least `rounded` bytes comes before (merged, h's address).
  // (The pages of a range's block: pager::retake_pages, after this.)
  if (h->size != rounded || h->seg->kind != kind) return false;
  const block* n = h->next;
  const bool merge_next = n != nullptr && n->state == block_state::free;
  const std::size_t merged = merge_next ? h->size + n->size : h->size;
  if (merge_next && !policy.should_split(kind, merged, rounded)) return false;
  if (h->seg->vm == nullptr) {
    if (!policy.may_take(merged, rounded)) return false;
  } else if (budget.never_fits(rounded) || (p.domain != 0 && sleeper.asleep(p.domain))) {
    return false;
  }
  const std::uint64_t changes = p.index_changes();
  if (p.fit_memo.held == h && p.fit_memo.changes == changes)
    return true;  // the same test on the same indexes: it passed (stream_pool::fit_memo)
  const detail::free_index& index = p.index_of(kind);
  const block* c = index.best_fit(rounded);
  if (merge_next && c == n) c = index.next_after(n);  // n is part of m
  if (c == nullptr || merged < c->size || (merged == c->size && h->addr < c->addr)) {
    p.fit_memo = {h, changes};
    return true;
  }
  return false;
}

void device_allocator::impl::hold_or_release(stream_pool& p, block* b) {
  // REQUIRES: b freed on the fast path (allocated, used on its own stream only, no capture, no
  // observer), nothing held. A block whose previous block is free merges into it, at that
  // block's address, where no allocation could take b back: merged now. A range's block keeps
  // its pages touched while held (pager::hold_pages), or is released now where it cannot.
  if (p.graph == nullptr && (b->prev == nullptr || b->prev->state != block_state::free) &&
      (b->seg->vm == nullptr || pager->hold_pages(p, b))) {
    b->state = block_state::free;
    b->seg->free_tick = ++p.tick;
    p.mu.hold(b);
    return;
  }
  release_to_free_inline(p, b);
}

void device_allocator::impl::publish(stream_pool& p, block* b) {
  try {
    p.blocks.insert(b->addr, b);
  } catch (...) {
    undo_carve(p, b);
    throw;
  }
}

void device_allocator::impl::release_to_free(stream_pool& p, block* b) {
  release_to_free_inline(p, b);
}

void device_allocator::impl::release_to_free_inline(stream_pool& p, block* b) {
  // REQUIRES: b allocated-then-freed (allocation stats already taken off).
  const pool_kind kind = b->seg->kind;
  if (b->state == block_state::pending) {
    p.stats.pending_count.dec(kind, 1);
    p.stats.pending_bytes.dec(kind, static_cast<std::int64_t>(b->size));
  }
  if (b->seg->vm != nullptr) pager->touch_freed(p, b);
  if (b->uses != nullptr) [[unlikely]] {
    delete b->uses;
    b->uses = nullptr;
  }
  b->state = block_state::free;
  b->seg->free_tick = ++p.tick;
  p.coalesce(b);
}

void device_allocator::impl::release_oversize(stream_pool& p) {
  // Cached oversize blocks that are whole segments: the request that missed could not use any of
  // them (best fit found none within the waste tolerance), so keeping them only grows reserved
  // memory. This is what stops max_split_size from running away on dynamic shapes.
  std::vector<segment*> victims;
  for (segment* s = p.segments; s != nullptr; s = s->next) {
    if (s->kind == pool_kind::large && s->whole_free() && policy.is_oversize(s->size)) {
      victims.push_back(s);
    }
  }
  for (segment* s : victims) release_segment(p, s);
}

void device_allocator::impl::release_free_segments(std::size_t target_reserved, bool oldest_first) {
  // REQUIRES: no capture blocking (cudaFree synchronizes the device). Releases
  // whole free segments until reserved <= target. Graph pools keep theirs until released: a graph
  // replays on their addresses.
  std::vector<std::pair<stream_pool*, segment*>> victims;
  for (auto& p : pools) {
    detail::pool_table::assert_locked(*p);
    for (segment* s = p->segments; s != nullptr; s = s->next) {
      if (ladder_may_release(*p, *s)) victims.emplace_back(p.get(), s);
    }
  }
  if (oldest_first) {
    std::stable_sort(victims.begin(), victims.end(), [](const auto& a, const auto& b) {
      return a.second->free_tick < b.second->free_tick;
    });
  }
  for (auto [p, s] : victims) {
    if (budget.reserved_bytes() <= target_reserved) break;
    detail::pool_table::assert_locked(*p);
    release_segment(*p, s);
  }
}

void device_allocator::impl::collect_garbage(std::size_t incoming) {
  const std::size_t gc_bytes = budget.gc_bytes.load(std::memory_order_relaxed);
  const std::size_t target = gc_bytes > incoming ? gc_bytes - incoming : 0;
  release_free_segments(target, /*oldest_first=*/true);
  retire_empty_pools();
}

// --- pending blocks and graph pools ---------------------------------------------------------

namespace {
/// An allocation that unlocks its pool midway (the ladder, garbage collection) and locks it again
/// before going on, also when what it did meanwhile throws. Meanwhile the pool is not quiet, so
/// the pool table never hands it to another stream (pool_retirement::unlocked_allocation_began).
/// For the analysis, a scoped unlock: p.mu is not held while it lives.
class SCOPED_CAPABILITY unlocked_midway {
 public:
  unlocked_midway(detail::pool_table& pools, stream_pool& p, detail::pool_lock& lk) RELEASE(p.mu)
      : pools_(pools), p_(p), lk_(lk) {
    p_.retirement.unlocked_allocation_began();
    lk_.unlock(p.mu);
  }
  // Not analysed: it takes the lock again through a reference to the caller's scoped lock.
  ~unlocked_midway() RELEASE() NO_THREAD_SAFETY_ANALYSIS {
    if (!lk_.owns_lock()) lk_.lock();
    pools_.note_change(p_);  // the allocation goes on changing p
    p_.retirement.unlocked_allocation_ended();
  }
  unlocked_midway(const unlocked_midway&) = delete;
  unlocked_midway& operator=(const unlocked_midway&) = delete;

 private:
  detail::pool_table& pools_;
  stream_pool& p_;
  detail::pool_lock& lk_;
};
}  // namespace

void device_allocator::impl::mark_pending(stream_pool& p, block* b) {
  const pool_kind kind = b->seg->kind;
  b->state = block_state::pending;
  b->uses->pending_events = 0;
  p.stats.pending_count.inc(kind, 1);
  p.stats.pending_bytes.inc(kind, static_cast<std::int64_t>(b->size));
}

void device_allocator::impl::settle_graph_pools() {
  // REQUIRES: !sync_blocked(). Every pool locked: no free can add a retention meanwhile.
  const detail::graph_pools::settled back = graphs.settle(*backend);
  for (auto [p, b] : back.blocks) {
    detail::pool_table::assert_locked(*p);
    --p->retained;
    if (--b->uses->pending_events == 0) release_to_free(*p, b);
  }
  for (stream_pool* part : back.parts) {
    detail::pool_table::assert_locked(*part);
    std::vector<segment*> victims;
    for (segment* s = part->segments; s != nullptr; s = s->next) {
      if (s->whole_free()) victims.push_back(s);
    }
    detail::pool_table::assert_locked(*part);
    for (segment* s : victims) release_segment(*part, s);
  }
}

// --- allocate ---------------------------------------------------------------------------------

block* device_allocator::impl::grow(stream_pool& p, pool_kind kind, std::size_t rounded,
                                    detail::pool_lock& lk, std::size_t segment_bytes) {
  const std::size_t seg_bytes = segment_bytes != 0 ? segment_bytes : policy.segment_size(rounded);
  if (budget.never_fits(seg_bytes)) return nullptr;

  // While a capture is underway nothing may be given back (cudaFree synchronizes the device): a
  // miss can only take new memory.
  const bool blocked = sync_blocked();
  if (kind == pool_kind::large && !blocked &&
      policy.max_split_size() != std::numeric_limits<std::size_t>::max()) {
    release_oversize(p);
  }
  if (!blocked && budget.over_gc(seg_bytes)) {
    {
      const unlocked_midway away(pools, p, lk);
      detail::pool_table::all_locked all(pools);
      if (!sync_blocked()) collect_garbage(seg_bytes);
    }
    {
      if (block* b = find_free(p, kind, rounded)) return b;
    }
  }
  if (segment* s = new_segment(p, kind, seg_bytes)) return s->first;

  run_ladder(p, lk, ladder_release::free_segments);
  if (block* b = find_free(p, kind, rounded)) return b;
  segment* s = new_segment(p, kind, seg_bytes);
  return s != nullptr ? s->first : nullptr;
}

void device_allocator::impl::throw_oom(std::size_t bytes, std::size_t rounded,
                                       stream_handle stream, oom_cause cause) {
  budget.oom_count.fetch_add(1, std::memory_order_relaxed);
  device_stats s;
  {
    detail::lock_guard reader(ledger.readers);
    detail::pool_table::all_locked all(pools);
    s = ledger.read_locked(ledger_parts());
  }
  detail::oom_facts f;
  f.device = backend->device();
  f.device_name = backend->name();
  f.bytes = bytes;
  f.rounded = rounded;
  f.stream = stream;
  f.device_total = budget.device_total;
  try {
    f.device_free = backend->mem_get_info().free_bytes;
  } catch (...) {
  }
  f.reserved = static_cast<std::size_t>(s.reserved_bytes[0].current);
  f.allocated = static_cast<std::size_t>(s.allocated_bytes[0].current);
  f.free_blocks = static_cast<std::size_t>(s.free_block_count);
  f.largest_free_block = static_cast<std::size_t>(s.largest_free_block);
  f.external_fragmentation = s.external_fragmentation();
  f.overhead_fragmentation = s.overhead_fragmentation();
  f.limit = budget.limit.load(std::memory_order_relaxed);
  f.address_space = cause == oom_cause::address_space;
  if (f.address_space) f.address_bytes = pager->reserved_address_bytes();
  f.capture_underway = sync_blocked();
  throw out_of_memory(detail::oom_message(f));
}

void device_allocator::impl::run_ladder(stream_pool& p, detail::pool_lock& lk,
                                        ladder_release what) {
  // Out-of-memory ladder: wait for every pending free, settle released graph pools, give back
  // every whole free segment of every pool (default mode) or unmap every idle page of every pool
  // into the reusable handle list (expandable mode); the caller retries once. Giving back
  // synchronizes the device: not while a capture is underway.
  budget.retry_count.fetch_add(1, std::memory_order_relaxed);
  const detail::nvtx_range range(cfg.nvtx, "cucache: out-of-memory ladder");
  {
    const unlocked_midway away(pools, p, lk);
    detail::pool_table::all_locked all(pools);
    for (auto& q : pools) {
      detail::pool_table::assert_locked(*q);
      sync_pending(*q);
    }
    if (!sync_blocked()) {
      settle_graph_pools();
      if (what == ladder_release::free_segments) {
        release_free_segments(0, /*oldest_first=*/false);
      } else {
        for (auto& q : pools) {
          detail::pool_table::assert_locked(*q);
          pager->unmap_idle(*q, /*release_handles=*/false);
        }
      }
      retire_empty_pools();
    }
  }
}

// --- expandable segments: ranges per pool, placement, the pager backs the pages ---------------

segment* device_allocator::impl::add_range(stream_pool& p, pool_kind kind, std::size_t need) {
  pager->make_room_for_range(p);  // nothing can fail once added below
  const std::size_t bytes = pager->next_range_bytes(kind, need, p.pages.range_bytes(kind));
  std::unique_ptr<vm_range> range = pager->reserve_range(kind, bytes);
  if (range == nullptr) return nullptr;
  segment* s = nullptr;
  try {
    s = add_segment(p, kind, range->base, range->size, range.get());
  } catch (...) {
    pager->destroy_range(*range);
    throw;
  }
  range.release();  // owned by the segment from here (drop_range or ~impl destroys it)
  pager->add_range(p, s);
  return s;
}

block* device_allocator::impl::grow_and_place(stream_pool& p, pool_kind kind, std::size_t rounded) {
  // No free block of p's ranges holds it (no range yet, or holes too small): a new range, whose
  // one free block the placement rule then finds.
  if (add_range(p, kind, rounded) == nullptr) return nullptr;
  return detail::place_in_range(p.index_of(kind), rounded);
}

void device_allocator::impl::drop_range(stream_pool& p, segment* s) noexcept {
  p.index_of(s->kind).erase(s->first);
  directory.remove(s->base);
  if (s->prev != nullptr) s->prev->next = s->next;
  if (s->next != nullptr) s->next->prev = s->prev;
  if (p.segments == s) p.segments = s->next;
  pager->drop_range(p, s);
  delete s->vm;
  p.block_arena.recycle(s->first);
  p.segment_arena.recycle(s);
}

void device_allocator::impl::undo_carve(stream_pool& p, block* b) {
  // Every count the carve made, taken back (the oversize one matters where a default-mode
  // allocation is undone: expandable mode has no oversize blocks).
  const pool_kind kind = b->seg->kind;
  p.stats.on_free(kind, static_cast<std::int64_t>(b->size),
                  static_cast<std::int64_t>(b->requested));
  if (policy.is_oversize(b->size)) --p.stats.oversize_allocations;
  b->requested = 0;
  release_to_free(p, b);
}

void* device_allocator::impl::allocate_expandable(stream_pool& p, pool_kind kind,
                                                  std::size_t rounded, std::size_t bytes,
                                                  detail::pool_lock& lk, bool& no_address_space) {
  if (budget.never_fits(rounded)) return nullptr;
  for (int attempt = 0; attempt < 2; ++attempt) {
    // The ladder below unlocks p: a sleep of p's tag may have run meanwhile.
    // Still under p's lock, so that the domain cannot wake between the check and the refusal
    // (which throws; the caller's lock is released as the exception leaves).
    if (attempt > 0 && p.domain != 0 && sleeper.asleep(p.domain)) [[unlikely]]
      sleeper.refuse_if_asleep(p, nullptr, "allocate");
    // place_or_grow and carve_inline are inline: a call each cost the expandable pair about 50
    // instructions of prologues.
    block* b = place_or_grow(p, kind, rounded);
    no_address_space = b == nullptr;
    if (b == nullptr) {  // the process's address space has no room for a range that holds it
      if (attempt == 1) break;
      run_ladder(p, lk, ladder_release::idle_pages);  // gives empty ranges back
      continue;
    }
    b = carve_inline(p, b, kind, rounded, bytes);
    bool mapped = false;
    try {
      mapped = pager->back(p, b);
    } catch (...) {
      undo_carve(p, b);
      throw;
    }
    if (mapped) {
      publish(p, b);
      return reinterpret_cast<void*>(b->addr);
    }
    undo_carve(p, b);
    if (attempt == 1) break;
    // The pager found no room even among the idle pages of the pools it could lock without
    // waiting: the ladder, and once more.
    run_ladder(p, lk, ladder_release::idle_pages);
  }
  return nullptr;
}

// --- allocate: the entry ----------------------------------------------------------------------

void* device_allocator::impl::allocate(std::size_t bytes, stream_handle stream) {
  if (bytes == 0) return nullptr;
  // No pool lock yet: the published rules (one load). Rules changed between here and the pool
  // lock only mean this request was rounded as just before the change.
  const std::size_t rounded =
      rules.load(std::memory_order_acquire)->policy.round_size(bytes).value_or(0);
  if (rounded == 0) throw_oom(bytes, 0, stream);  // its rounded size passes any device
  const pool_kind kind = detail::size_policy::pool_for(rounded);
  // A stream that is being captured allocates from its capture's pool: the graph keeps using the
  // address at every replay, so nobody else may get it. (The legacy stream -- nullptr or
  // cudaStreamLegacy -- cannot be captured nor destroyed: one fixed key, no backend call.)
  // One backend call asks both what the capture check and the pool key need: the capture status
  // first, and the stream id only when the stream is not being captured (asking the id of a
  // capturing stream would invalidate its capture).
  stream_pool* graph_part = nullptr;
  std::uint64_t key = detail::k_legacy_stream_key;
  // In the captures-announced mode (docs/design.md, "Announced captures"), while nothing may be
  // capturing, a created stream is asked its id only: no capture query.
  if (graphs.capture_query_skippable() && !is_special_stream(stream)) {
    key = announced_stream_key(stream);
  } else if (!is_legacy_stream(stream)) {
    const stream_identity who = raw->identify(stream);
    if (who.capture.state != capture_state::none || sync_blocked()) [[unlikely]] {
      graph_part = graphs.part_for(stream, who.capture);
    }
    key = who.id;  // valid unless capturing, and then graph_part is set
  } else if (graphs.any_route()) [[unlikely]] {
    graph_part = graphs.part_for(stream, {});
  }
  // In expandable mode the thread's sleep domain (a sleepable tag) picks the pool of (stream,
  // domain): its blocks share no page with anybody else's (tag_sleeper.hpp). (A pool found
  // through the thread's cache may have been handed to another stream since: its key, read under
  // its lock, then differs, and lock_pool_for looks again.)
  detail::pool_table::locked_pool lp =
      graph_part != nullptr
          ? detail::pool_table::locked_pool{graph_part, detail::pool_lock(graph_part->mu)}
          : pools.lock_pool_for(stream, key, cfg.expandable_segments ? detail::t_sleep_domain : 0,
                                /*keeping_held=*/true);
  stream_pool& p = *lp.pool;
  detail::pool_lock& lk = lp.lock;
  p.mu.assert_held();  // lp.lock holds it (the analysis cannot follow a lock out of a call)
  // defer_coalescing (pool_mutex.hpp): the pool's held block, taken back where best fit would
  // carve exactly it (a range's block: where its carve would change no mapping), else merged
  // before anything else looks at the pool.
  if (block* h = p.mu.held()) {
    if (p.pending.empty() && takes_back(p, h, kind, rounded) &&
        (h->seg->vm == nullptr || pager->retake_pages(p, h))) {
      p.mu.take_held();
      mark_allocated(p, h, kind, bytes);
      publish(p, h);
      ++p.stats.take_backs;
      return reinterpret_cast<void*>(h->addr);
    }
    p.mu.settle_held();
  }
  if (graph_part != nullptr) [[unlikely]]
    pools.note_change(p);  // (lock_pool_for notes the stream pools)
  if (!p.pending.empty()) poll_pending(p);
  if (graph_part != nullptr && p.domain != 0 && sleeper.asleep(p.domain)) [[unlikely]]
    // A capture into graph memory of a sleeping tag.
    sleeper.refuse_if_asleep(p, nullptr, "allocate");
  if (graph_part != nullptr && graph_part->graph->no_split) [[unlikely]]
    return allocate_unsplit(p, kind, rounded, bytes, stream, lk);
  if (cfg.expandable_segments && p.graph == nullptr) {
    // (Graph pools use segments in every mode: nothing of theirs may be unmapped or moved while
    // a graph may replay on it.)
    if (p.domain != 0 && sleeper.asleep(p.domain)) [[unlikely]]
      sleeper.refuse_if_asleep(p, nullptr, "allocate");
    bool no_address_space = false;
    void* ptr = allocate_expandable(p, kind, rounded, bytes, lk, no_address_space);
    if (ptr == nullptr) {
      lk.unlock(p.mu);
      throw_oom(bytes, rounded, stream,
                no_address_space ? oom_cause::address_space : oom_cause::memory);
    }
    return ptr;
  }
  block* b = find_free(p, kind, rounded);
  if (b == nullptr) b = grow(p, kind, rounded, lk);
  if (b == nullptr) {
    lk.unlock(p.mu);
    throw_oom(bytes, rounded, stream);
  }
  b = carve_inline(p, b, kind, rounded, bytes);
  publish(p, b);
  return reinterpret_cast<void*>(b->addr);
}

// An allocation into a graph pool that takes whole blocks (set_graph_pool_no_split: cudagraph
// trees' checkpoints need every block at its segment's size). Out of line: allocate's rare path.
void* device_allocator::impl::allocate_unsplit(stream_pool& p, detail::pool_kind kind,
                                               std::size_t rounded, std::size_t bytes,
                                               stream_handle stream, detail::pool_lock& lk) {
  block* b = find_free_outline(p, kind, rounded);
  if (b == nullptr) {
    const std::size_t granule = detail::k_large_segment_round_bytes;
    b = grow(p, kind, rounded, lk, (rounded + granule - 1) / granule * granule);
  }
  if (b == nullptr) {
    lk.unlock(p.mu);
    throw_oom(bytes, rounded, stream);
  }
  // Taken whole: the block keeps its segment's size (or the free block's), unsplit.
  p.index_of(kind).erase(b);
  b->state = block_state::allocated;
  b->requested = bytes;
  b->uses = nullptr;
  p.stats.on_allocate(kind, static_cast<std::int64_t>(b->size), static_cast<std::int64_t>(bytes));
  if (policy.is_oversize(b->size)) ++p.stats.oversize_allocations;
  publish(p, b);
  return reinterpret_cast<void*>(b->addr);
}

// The id query of the captures-announced mode, with its failure rule: a refusal because the
// stream is being captured after all becomes throw_if_unannounced's error.
CUCACHE_HOT std::uint64_t device_allocator::impl::asked_stream_id(stream_handle stream) {
  try {
    return raw->stream_id(stream);
  } catch (...) {
    throw_if_unannounced(stream);
    throw;
  }
}

CUCACHE_HOT std::uint64_t device_allocator::impl::announced_stream_key(stream_handle stream) {
  if (stream_ids.on()) {
    // Where stream destructions are announced too: the thread's cached id, no driver call.
    if (std::uint64_t id = 0; stream_ids.find(stream, id)) return id;
    return cached_stream_key(stream);
  }
  return asked_stream_id(stream);
}

std::uint64_t device_allocator::impl::cached_stream_key(stream_handle stream) {
  // The count before the question: a destruction announced meanwhile leaves the entry stale.
  const std::uint64_t count_before = detail::stream_id_cache::destructions();
  const std::uint64_t id = asked_stream_id(stream);
  stream_ids.fill(stream, id, count_before);
  return id;
}

void device_allocator::impl::throw_if_unannounced(stream_handle stream) {
  // The failure rule of the captures-announced mode: a capture nobody announced is found here,
  // by the driver's refusal of the stream id of a capturing stream -- a refusal that has
  // invalidated the capture already, so its graph can never run on memory of ordinary pools.
  capture_info cap{};
  try {
    cap = raw->capture_status(stream);
  } catch (...) {
    return;  // the stream id's own error stands
  }
  if (cap.state == capture_state::none) return;
  unannounced_captures.fetch_add(1, std::memory_order_relaxed);
  throw cuda_error(
      "cucache::allocate", 901,  // cudaErrorStreamCaptureInvalidated
      fmt::format("device {}: stream {} is being captured (capture {}), but the capture was not "
                  "announced while the captures-announced mode is on; the driver refused the "
                  "stream's id and invalidated the capture, and cucache allocated nothing. Begin "
                  "captures where the front end sees them (docs/design.md, \"Announced "
                  "captures\"), or turn the mode off (set_captures_announced(false))",
                  raw->device(), fmt::ptr(stream), cap.id));
}

// --- free -------------------------------------------------------------------------------------

bool device_allocator::impl::deallocate(void* ptr, stream_handle stream, bool ordered) {
  if (ptr == nullptr) return true;
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  // The pool first (the directory's lock-free lookup), then the block under the pool's lock.
  stream_pool* owner = directory.owner_of(addr);
  if (owner == nullptr) return false;
  stream_pool& p = *owner;
  p.mu.lock_keeping_held();
  detail::lock_guard lk(p.mu, std::adopt_lock);
  // (defer_coalescing: the pool's held block stays held until this free merges or holds its own
  // block, below or in deallocate_locked.)
  block* b = p.blocks.take(addr);
  if (b == nullptr) return false;
  pools.note_change(p);
  if (p.domain != 0 && sleeper.asleep(p.domain)) [[unlikely]] {
    p.blocks.insert(addr, b);  // nothing changed (right after the take: no growth, no throw)
    sleeper.refuse_if_asleep(p, ptr, "free");
  }
  // The common free: no capture known, nobody observing, the block used on its own stream only.
  // It is deallocate_locked's path for that case, step for step, without its tests.
  if (graphs.any_capture() || observer.load(std::memory_order_acquire) != nullptr ||
      b->uses != nullptr || (ordered && !pools.names_pool_stream(p, stream))) [[unlikely]] {
    return deallocate_locked(p, b, ptr, stream, ordered);
  }
  p.stats.on_free(b->seg->kind, static_cast<std::int64_t>(b->size),
                  static_cast<std::int64_t>(b->requested));
  if (policy.is_oversize(b->size)) --p.stats.oversize_allocations;
  b->requested = 0;
  if (defer_frees) {
    p.mu.settle_held();  // the last free's block, merged before this one
    hold_or_release(p, b);
  } else {
    release_to_free_inline(p, b);
  }
  // An ordered free on the pool's own stream names that stream, alive, in this call: the moment
  // a quiet event may be recorded on it (rate-limited, note_quiet).
  if (ordered && p.stats.allocation_count[0].current == 0) [[unlikely]]
    note_quiet(p);
  return true;
}

bool device_allocator::impl::deallocate_locked(stream_pool& p, block* b, void* ptr,
                                               stream_handle stream, bool ordered) {
  // REQUIRES: b taken out of p's block map.
  p.mu.settle_held();  // defer_coalescing: the last free's block, merged first
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  // A block of a stream pool freed while cucache knows that stream captures: the captured work
  // may use it at every replay, so it is held for that capture's graph pool, not reused.
  detail::graph_pool* own_capture = nullptr;
  if (graphs.any_capture() && p.graph == nullptr) [[unlikely]] {
    // By handle: captures are known by their streams' capture keys. A stale handle (p's stream
    // destroyed, its value now a capturing stream's) only retains a block longer than needed.
    own_capture = graphs.capture_of(detail::pool_table::capture_key(p.stream));
    if (own_capture != nullptr && b->uses == nullptr) {
      try {
        b->uses = new detail::stream_uses;
      } catch (...) {
        p.blocks.insert(addr, b);  // nothing changed (right after the take: no throw)
        throw;
      }
    }
  }
  // Before the block can be reused: a trace then lists this free before the next allocation of
  // the same address.
  if (allocation_observer* o = observer.load(std::memory_order_acquire)) [[unlikely]]
    o->on_free(ptr, b->requested, ordered ? stream : p.stream);
  const pool_kind kind = b->seg->kind;
  p.stats.on_free(kind, static_cast<std::int64_t>(b->size),
                  static_cast<std::int64_t>(b->requested));
  if (policy.is_oversize(b->size)) --p.stats.oversize_allocations;
  b->requested = 0;
  if (ordered && !pools.names_pool_stream(p, stream) &&
      (b->uses == nullptr || std::find(b->uses->streams.begin(), b->uses->streams.end(), stream) ==
                                 b->uses->streams.end())) {
    try {
      if (b->uses == nullptr) b->uses = new detail::stream_uses;
      b->uses->streams.push_back(stream);
    } catch (...) {
      backend->stream_synchronize(stream);
    }
  }
  const bool cross = b->uses != nullptr && !b->uses->streams.empty();
  if (!cross && own_capture == nullptr) {
    release_to_free(p, b);
    if (ordered && own_capture == nullptr && pools.names_pool_stream(p, stream) &&
        p.stats.allocation_count[0].current == 0) {
      note_quiet(p);
    }
    return true;
  }
  mark_pending(p, b);
  if (own_capture != nullptr) graphs.retain(*own_capture, p, b);
  if (cross) {
    // Used on other streams: reuse waits for an event on each of them -- or, for a stream being
    // captured, for the release of its capture's graph pool: an event recorded there would be a
    // node of the graph, which no query can ever see complete.
    for (stream_handle s : b->uses->streams) {
      capture_info cap{};
      std::uint64_t key = 0;
      try {
        cap = raw->capture_status(s);
        if (cap.state != capture_state::none) key = detail::pool_table::capture_key(s);
      } catch (...) {
        cap = {};  // the stream is gone: the record below fails and the fallback waits
      }
      if (cap.state != capture_state::none) {
        detail::graph_pool* g = graphs.capture_pool(s, key, cap);
        graphs.retain(*g, p, b);
        continue;
      }
      event_handle e = nullptr;
      try {
        e = events.take();
        backend->event_record(e, s);
        p.pending.push(s, b, e);
        ++b->uses->pending_events;
      } catch (...) {
        // Without an event the only safe reuse is after the work queued so far drains. The stream
        // itself may be why the record failed (destroyed since record_stream named it): wait
        // device-wide, which names no stream -- or, while a capture forbids that, hold the block
        // until the next device synchronization cucache makes.
        if (e != nullptr) events.give_back(e);
        if (sync_blocked()) {
          graphs.retain_until_sync(p, b);
        } else {
          try {
            backend->device_synchronize();
          } catch (...) {
          }
        }
      }
    }
  }
  if (b->uses->pending_events == 0) release_to_free(p, b);
  return true;
}

bool device_allocator::impl::record_stream(void* ptr, stream_handle stream) {
  std::uint32_t asleep = 0;
  const bool found =
      with_block(reinterpret_cast<std::uintptr_t>(ptr), [&](stream_pool& p, block* b) {
        p.mu.assert_held();  // with_block holds it (a lambda: the analysis cannot see that)
        // A block of a sleeping domain has no memory behind it: refused as a free is, nothing
        // changed. (The message's label is read below, under every pool lock.)
        if (p.domain != 0 && sleeper.asleep(p.domain)) [[unlikely]] {
          asleep = p.domain;
          return;
        }
        if (pools.names_pool_stream(p, stream)) return;
        // Under the pool's lock: the block cannot be freed meanwhile.
        if (b->uses == nullptr) b->uses = new detail::stream_uses;
        auto& rs = b->uses->streams;
        if (std::find(rs.begin(), rs.end(), stream) == rs.end()) rs.push_back(stream);
      });
  if (asleep != 0) [[unlikely]]
    sleeper.refuse_asleep_block(pools, asleep, ptr, "record_stream");
  return found;
}

void device_allocator::impl::empty_cache() {
  detail::pool_table::all_locked all(pools);
  for (auto& p : pools) {
    detail::pool_table::assert_locked(*p);
    sync_pending(*p);
  }
  if (sync_blocked()) graphs.throw_capture_blocks("empty_cache");
  settle_graph_pools();
  if (cfg.expandable_segments) {
    for (auto& p : pools) {
      detail::pool_table::assert_locked(*p);
      pager->unmap_idle(*p, /*release_handles=*/true);
    }
    pager->release_unmapped(0);
  }
  release_free_segments(0, /*oldest_first=*/false);
  retire_empty_pools();
}

// --- retirement: pools of streams that are gone ---------------------------------------------

void device_allocator::impl::note_quiet(stream_pool& p) {
  // REQUIRES: p's stream named alive by the caller in this call (an ordered free on
  // it), p.stats.allocation_count[0].current == 0. A quiet event recorded now follows, on p's
  // stream, every use of p's blocks there (each was queued before its block's free); once it has
  // completed, and nothing was allocated or freed in p since (p.tick unchanged), p may serve
  // another stream (pool_table::judge). Rate: the first k_quiet_always quiet frees of a pool,
  // then one in k_quiet_every, so that a loop of ordered pairs on one stream records one event
  // per k_quiet_every pairs (pool_retirement). A pool left unproven is retired by the device-wide
  // paths instead.
  if (!p.retirement.count_quiet_free()) return;
  if (!p.quiet() || graphs.any_capture() || sync_blocked()) return;
  // The legacy stream is never gone (its pool needs no retirement), and recording on it could
  // touch a capture of another thread; the per-thread handle names another stream per thread.
  if (is_special_stream(p.stream)) return;
  try {
    // The handle the caller named equals p's, but it may be a new stream that got a destroyed
    // one's handle value (names_pool_stream): only p's own stream, by id, is recorded on. An
    // event recorded on a capturing stream would be a node of its graph, never complete (and
    // asking a capturing stream's id would invalidate its capture: identify asks it only when
    // the stream is not captured).
    const stream_identity who = raw->identify(p.stream);
    if (who.capture.state != capture_state::none || who.id != p.key) return;
    // No proof while the record is not done.
    const event_handle e = p.retirement.begin_record([&] { return events.take(); });
    backend->event_record(e, p.stream);
  } catch (...) {
    return;  // no proof now; the pool is kept until a device-wide path retires it
  }
  pools.quiet_recorded(p);
}

void device_allocator::impl::retire_empty_pools() {
  // Address space is reserved on demand and returned when empty:
  // quiet pools that hold no device memory (the device-wide path that called this gave it back,
  // behind a device synchronization) give back every range and are queued for the next stream
  // that needs a pool; other pools give back their empty ranges but the newest of each kind
  // (the one their next growth would use).
  for (auto& p : pools) {
    detail::pool_table::assert_locked(*p);
    // A sleeping tag's pool keeps its ranges: wake maps its blocks' pages at their addresses.
    if (p->domain != 0 && sleeper.asleep(p->domain)) continue;
    const bool retire = p->quiet() && p->holds_no_memory();
    if (cfg.expandable_segments && p->graph == nullptr) {
      const auto& ranges = p->pages.ranges();
      for (std::size_t i = ranges.size(); i-- > 0;) {
        segment* s = ranges[i];
        // Empty: one free block, no page mapped (so nothing on the idle list either).
        if (s->vm->mapped_pages != 0 || s->first->next != nullptr ||
            s->first->state != block_state::free) {
          continue;
        }
        const bool newest_of_kind = std::none_of(
            ranges.begin() + static_cast<std::ptrdiff_t>(i) + 1, ranges.end(),
            [&](const segment* t) { return t->kind == s->kind; });
        if (retire || !newest_of_kind) drop_range(*p, s);
      }
    }
    if (retire) pools.queue_quiet(*p);
  }
}

// --- graph pools: the public calls --------------------------------------------------------------

void device_allocator::impl::begin_allocate_to_pool(graph_pool_id gid, stream_filter filter) {
  // All pools locked too: release_free_segments reads `released` under the pool locks.
  detail::pool_table::all_locked all(pools);
  graphs.begin_route(gid, std::move(filter));
}

void device_allocator::impl::end_allocate_to_pool(graph_pool_id gid) {
  detail::pool_table::all_locked all(pools);
  graphs.end_route(gid);
  if (!sync_blocked()) settle_graph_pools();
}

void device_allocator::impl::release_graph_pool(graph_pool_id gid) {
  detail::pool_table::all_locked all(pools);
  graphs.release(gid);
  if (!sync_blocked()) settle_graph_pools();
}

graph_pool_info device_allocator::impl::graph_pool_state(graph_pool_id gid) const {
  detail::pool_table::all_locked all(pools);
  return graphs.state(gid);
}

// --- public shell -----------------------------------------------------------------------------

device_allocator::device_allocator(std::shared_ptr<device_backend> backend, config cfg,
                                   std::shared_ptr<allocation_observer> observer)
    : impl_(std::make_unique<impl>(std::move(backend), std::move(cfg), std::move(observer))) {
  // reserve_mb: after the allocator is whole, so that a refusal destroys it cleanly.
  if (impl_->cfg.reserve_bytes != 0) impl_->reserve(impl_->cfg.reserve_bytes, nullptr);
}
device_allocator::~device_allocator() = default;

namespace {

// device_allocator::allocate with an observer, out of line: the unobserved call stays as short as
// it was before admission existed (cucache-pair-count).
[[gnu::noinline]] void* allocate_observed(device_allocator::impl& impl, allocation_observer* o,
                                          std::size_t bytes, stream_handle stream) {
  if (bytes == 0) return nullptr;
  // A refusal (a tag's limit) throws here, nothing changed.
  if (o->admits()) [[unlikely]]
    o->admit(bytes, stream);
  void* ptr = nullptr;
  try {
    ptr = impl.allocate(bytes, stream);
  } catch (...) {
    o->on_failure(bytes, stream);
    throw;
  }
  if (ptr != nullptr) o->on_allocate(ptr, bytes, stream);
  return ptr;
}

}  // namespace

/// The parts the sleeper's walk works with, and the allocation story's steps it needs.
detail::tag_sleeper::parts device_allocator::impl::sleeper_parts() {
  return detail::tag_sleeper::parts{
      pools,
      pager.get(),
      budget,
      *backend,
      graphs,
      page_bytes,
      [this](stream_pool& q) {
        detail::pool_table::assert_locked(q);  // the walk holds every pool lock
        sync_pending(q);
      },
      [this] {
        every_pool_held();
        settle_graph_pools();
      },
      graph_vm};
}

detail::stats_ledger::parts device_allocator::impl::ledger_parts() const {
  return detail::stats_ledger::parts{
      pools,
      budget,
      pager.get(),
      sleeper,
      cfg.expandable_segments,
      page_bytes,
      [this](const stream_pool& q) {
        q.mu.assert_held();  // the ledger summarizes q under its lock
        return largest_cached_request(q);
      }};
}

void* device_allocator::allocate(std::size_t bytes, stream_handle stream) {
  allocation_observer* const o = impl_->observer.load(std::memory_order_acquire);
  if (o == nullptr) [[likely]]
    return impl_->allocate(bytes, stream);
  return allocate_observed(*impl_, o, bytes, stream);
}

/// invalid_argument with error_report's diagnosis of ptr: out of line, off the free path.
[[noreturn, gnu::noinline, gnu::cold]] static void throw_bad_pointer(const device_allocator& a,
                                                                    const void* ptr,
                                                                    const char* what) {
  throw invalid_argument(a.explain_bad_pointer(ptr, what));
}

void device_allocator::deallocate(void* ptr) {
  if (!impl_->deallocate(ptr, nullptr, false)) throw_bad_pointer(*this, ptr, "free");
}
void device_allocator::deallocate(void* ptr, stream_handle stream) {
  if (!impl_->deallocate(ptr, stream, true)) throw_bad_pointer(*this, ptr, "free");
}
void device_allocator::record_stream(void* ptr, stream_handle stream) {
  if (!impl_->record_stream(ptr, stream)) throw_bad_pointer(*this, ptr, "record_stream");
}
bool device_allocator::try_deallocate(void* ptr, stream_handle stream, bool ordered) {
  return impl_->deallocate(ptr, stream, ordered);
}
bool device_allocator::try_record_stream(void* ptr, stream_handle stream) {
  return ptr != nullptr && impl_->record_stream(ptr, stream);
}
void device_allocator::empty_cache() {
  impl_->empty_cache();
}
void device_allocator::set_captures_announced(bool on) noexcept {
  impl_->graphs.set_announced(on);
}
bool device_allocator::captures_announced() const noexcept {
  return impl_->graphs.announced();
}
void device_allocator::announce_capture_begin() noexcept {
  impl_->graphs.announce_begin();
}
void device_allocator::announce_capture_end() {
  impl_->graphs.announce_end();
}
void device_allocator::set_stream_destructions_announced(bool on) noexcept {
  impl_->stream_ids.set_on(on);
}
bool device_allocator::stream_destructions_announced() const noexcept {
  return impl_->stream_ids.on();
}
void device_allocator::announce_stream_destruction() noexcept {
  detail::stream_id_cache::announce_destruction();
}
std::uint64_t device_allocator::announced_captures() const noexcept {
  return impl_->graphs.announced_active();
}
std::uint64_t device_allocator::unannounced_captures() const noexcept {
  return impl_->unannounced_captures.load(std::memory_order_relaxed);
}
void device_allocator::begin_allocate_to_pool(graph_pool_id pool, stream_filter filter) {
  impl_->begin_allocate_to_pool(pool, std::move(filter));
}
void device_allocator::end_allocate_to_pool(graph_pool_id pool) {
  impl_->end_allocate_to_pool(pool);
}
void device_allocator::release_graph_pool(graph_pool_id pool) {
  impl_->release_graph_pool(pool);
}
graph_pool_info device_allocator::graph_pool_state(graph_pool_id pool) const {
  return impl_->graph_pool_state(pool);
}
void device_allocator::set_memory_fraction(double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    throw invalid_argument(fmt::format(
        "cucache::set_memory_fraction: fraction {} is not in [0, 1] (device {})", fraction,
        impl_->backend->device()));
  }
  // Fraction 0 (PyTorch allows it): a cap of one byte, so that nothing more can be reserved (a
  // limit of 0 would mean none). A fraction so small that it rounds to 0 bytes is the same cap.
  std::size_t limit = 1;
  if (fraction > 0.0) {
    const double product = fraction * static_cast<double>(impl_->budget.device_total);
    limit = product >= static_cast<double>(impl_->budget.device_total)
                ? impl_->budget.device_total
                : std::max<std::size_t>(1, static_cast<std::size_t>(product));
  }
  if (impl_->cfg.memory_limit_bytes > 0) limit = std::min(limit, impl_->cfg.memory_limit_bytes);
  impl_->budget.set_limit(limit);
  impl_->memory_fraction.store(fraction, std::memory_order_relaxed);
}
double device_allocator::memory_fraction() const noexcept {
  const double f = impl_->memory_fraction.load(std::memory_order_relaxed);
  return f >= 0.0 ? f : 1.0;
}
const config& device_allocator::get_config() const noexcept {
  return impl_->rules.load(std::memory_order_acquire)->cfg;
}

namespace {

/// The first key whose value differs between two configurations, by their CUCACHE_CONF strings
/// (to_string writes only what differs from the defaults).
std::string first_differing_key(const config& a, const config& b) {
  const auto ea = config_entries(to_string(a)), eb = config_entries(to_string(b));
  for (const auto* side : {&ea, &eb}) {
    const auto& other = side == &ea ? eb : ea;
    for (const auto& e : *side) {
      if (std::ranges::find(other, e) == other.end()) return e.first;
    }
  }
  return "a key";  // unreachable while to_string is exact
}

}  // namespace

void device_allocator::set_size_rules(const config& rules) {
  // Only the size rules may differ from the configuration in force.
  const config now = get_config();
  config expect = rules;
  expect.max_split_size = now.max_split_size;
  expect.max_non_split_rounding = now.max_non_split_rounding;
  expect.roundup_power2_divisions = now.roundup_power2_divisions;
  expect.garbage_collection_threshold = now.garbage_collection_threshold;
  if (!(expect == now)) {
    throw invalid_argument(fmt::format(
        "cucache::set_size_rules: '{}' cannot change at run time (device {}); only "
        "max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions and "
        "garbage_collection_threshold can",
        first_differing_key(expect, now), impl_->backend->device()));
  }
  // The checks parse_config makes, for a config built in code.
  (void)parse_config(to_string(rules));
  detail::pool_table::all_locked all(impl_->pools);
  const std::size_t gc =
      gc_bytes_of(*impl_->backend, rules.garbage_collection_threshold,
                  impl_->budget.limit.load(std::memory_order_relaxed), impl_->budget.device_total);
  impl_->set_size_rules(rules, gc);
}

std::pair<std::uint64_t, std::uint64_t> device_allocator::impl::recount_oversize(
    const detail::stream_pool& p) const {
  std::uint64_t segments = 0, allocations = 0;
  for (const segment* s = p.segments; s != nullptr; s = s->next) {
    if (s->vm == nullptr && policy.is_oversize(s->size)) ++segments;
    for (const block* b = s->first; b != nullptr; b = b->next) {
      if (b->state == detail::block_state::allocated && policy.is_oversize(b->size)) ++allocations;
    }
  }
  return {segments, allocations};
}

void device_allocator::impl::set_size_rules(const config& next, std::size_t gc) {
  // Everything that may throw first; then nothing can fail half way.
  auto published = std::make_unique<detail::rule_set>(
      detail::rule_set{detail::size_policy(next), next});
  detail::size_policy copy = published->policy;
  rules_kept.reserve(rules_kept.size() + 1);
  policy = std::move(copy);
  rules.store(published.get(), std::memory_order_release);
  rules_kept.push_back(std::move(published));
  budget.gc_bytes.store(gc, std::memory_order_relaxed);
  // Which blocks and segments are oversize follows max_split_size: recount (all_locked marked
  // every pool's summary stale, so the statistics take the new counts).
  for (auto& p : pools) {
    detail::pool_table::assert_locked(*p);
    const auto [segments, allocations] = recount_oversize(*p);
    p->stats.oversize_segments = segments;
    p->stats.oversize_allocations = allocations;
  }
}
int device_allocator::device() const noexcept {
  return impl_->backend->device();
}
device_backend& device_allocator::backend() const noexcept {
  return *impl_->raw;
}

std::size_t device_allocator::allocation_size(const void* ptr) const {
  std::size_t size = 0;
  impl_->with_block(reinterpret_cast<std::uintptr_t>(ptr),
                    [&](const stream_pool&, const block* b) { size = b->size; });
  return size;
}

detail::block* device_allocator::impl::find_free_outline(const detail::stream_pool& p,
                                                         detail::pool_kind kind,
                                                         std::size_t rounded) const {
  return find_free(p, kind, rounded);
}

void device_allocator::attach_observer(std::shared_ptr<allocation_observer> observer) {
  if (observer == nullptr) throw invalid_argument("cucache: attach_observer: no observer given");
  detail::lock_guard lock(impl_->observer_mu_);
  if (impl_->observer.load(std::memory_order_acquire) != nullptr) {
    throw invalid_argument("cucache: attach_observer: this allocator already has an observer");
  }
  impl_->observer_owner = std::move(observer);
  impl_->observer.store(impl_->observer_owner.get(), std::memory_order_release);
}

}  // namespace cucache
