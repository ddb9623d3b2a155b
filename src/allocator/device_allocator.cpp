// The allocation and free paths of device_allocator: cache lookup, splitting, coalescing, segment
// growth, the out-of-memory ladder, deferred frees and garbage collection.
#include "cucache/device_allocator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "allocator/allocator_impl.hpp"
#include "allocator/nvtx.hpp"
#include "cucache/errors.hpp"

namespace cucache {

using detail::block;
using detail::block_state;
using detail::pool_kind;
using detail::segment;
using detail::stream_pool;

namespace {

std::atomic<std::uint64_t> g_allocator_ids{1};

struct pool_cache_entry {
  std::uint64_t owner = 0;
  std::uint64_t key = 0;  // the stream's id: a reused handle value never hits a dead stream's pool
  stream_pool* pool = nullptr;
};
thread_local pool_cache_entry t_pool_cache;

}  // namespace

device_allocator::impl::impl(std::shared_ptr<device_backend> b, config c,
                             std::shared_ptr<allocation_observer> o)
    : raw(std::move(b)),
      backend(raw ? std::make_shared<detail::capture_safe_backend>(raw) : nullptr),
      cfg(std::move(c)),
      observer(o.get()),
      observer_owner(std::move(o)),
      policy(cfg),
      id(g_allocator_ids.fetch_add(1)) {
  if (!raw) throw invalid_argument("device_allocator: backend is null");
  sync_waiters.released = true;
  if (cfg.expandable_segments) {
    page_bytes = backend->vm_granularity();
    if (page_bytes == 0) {
      throw invalid_argument(fmt::format(
          "expandable_segments:True needs virtual memory management, which device {} ({}) does "
          "not support; use expandable_segments:False",
          backend->device(), backend->name()));
    }
  }
  device_total = backend->mem_get_info().total_bytes;
  if (cfg.memory_fraction > 0.0) {
    limit = bytes_of_fraction("memory_fraction", cfg.memory_fraction, device_total,
                              "the device's capacity", "would mean no limit");
  }
  if (cfg.memory_limit_bytes > 0) {
    limit = limit == 0 ? cfg.memory_limit_bytes : std::min(limit, cfg.memory_limit_bytes);
  }
  if (cfg.garbage_collection_threshold > 0.0) {
    const std::size_t base = limit != 0 ? limit : device_total;
    gc_bytes = bytes_of_fraction("garbage_collection_threshold", cfg.garbage_collection_threshold,
                                 base, limit != 0 ? "the memory limit" : "the device's capacity",
                                 "would turn garbage collection off");
  }
  if (cfg.expandable_segments) {
    // (The pager gets the capture-safe backend too, and may not move idle pages while a capture
    // is underway: unmapping waits for a device synchronization.)
    pager = std::make_unique<detail::pager>(
        *backend,
        detail::device_budget{grow_mu_, reserved, reserved_peak, limit, gc_bytes,
                              device_alloc_count, device_free_count},
        page_bytes, device_total, pools_mu_, pools);
    pager->set_synchronization_gate([this] { return !sync_blocked(); });
    pager->nvtx = cfg.nvtx;
    // Which devices every mapping is made accessible to, and whether its physical memory can be
    // exported (docs/config.md: peer_access, ipc_handles).
    backend->configure_peer_access(cfg.peer_access);
    if (cfg.ipc_handles) backend->enable_phys_export();
  }
}

std::size_t device_allocator::impl::bytes_of_fraction(const char* key, double fraction,
                                                      std::size_t base, const char* of_what,
                                                      const char* zero_means) const {
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
        key, fraction, fraction, of_what, base, backend->device(), backend->name(), zero_means));
  }
  return bytes;
}

device_allocator::impl::~impl() {
  // Return everything to the device. Errors here (a runtime already shut down) are swallowed:
  // destructors never throw.
  for (auto& p : pools) {
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
          backend->segment_free(reinterpret_cast<void*>(s->base));
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
  for (event_handle e : free_events) {
    try {
      backend->event_destroy(e);
    } catch (...) {
    }
  }
}

stream_pool& device_allocator::impl::pool_for(stream_handle stream, std::uint64_t key) {
  // By stream id, not handle: once the program destroys a stream, the runtime hands its handle
  // value to the next stream it creates, while work queued on the dead one may still run. A pool
  // keyed by the value would give the new stream blocks whose last use is that work.
  const pool_cache_entry& c = t_pool_cache;
  if (c.owner == id && c.key == key) [[likely]]
    return *c.pool;
  return pool_for_key(stream, key);
}

stream_pool& device_allocator::impl::pool_for_key(stream_handle stream, std::uint64_t key) {
  // pool_for's miss of the thread's one-entry cache: out of line, so that the hit stays small.
  pool_cache_entry& c = t_pool_cache;
  stream_pool* p = nullptr;
  {
    std::shared_lock lock(pools_mu_);
    auto it = pool_by_stream.find(key);
    if (it != pool_by_stream.end()) p = it->second;
  }
  if (p == nullptr) {
    std::unique_lock lock(pools_mu_);
    auto it = pool_by_stream.find(key);
    if (it != pool_by_stream.end()) {
      p = it->second;
    } else {
      pools.push_back(std::make_unique<stream_pool>(stream, key, pools.size()));
      p = pools.back().get();
      pool_by_stream.emplace(key, p);
    }
  }
  c = pool_cache_entry{id, key, p};
  return *p;
}

stream_pool& device_allocator::impl::new_pool(stream_handle stream, std::uint64_t key,
                                              detail::graph_pool* g) {
  // REQUIRES: pools_mu_ held exclusively.
  pools.push_back(std::make_unique<stream_pool>(stream, key, pools.size(), g));
  return *pools.back();
}

device_allocator::impl::all_locked device_allocator::impl::lock_all() const {
  all_locked a{std::shared_lock(pools_mu_), {}};
  a.locks.reserve(pools.size());
  for (const auto& p : pools) a.locks.emplace_back(p->mu);
  return a;
}

// --- events -----------------------------------------------------------------------------------

event_handle device_allocator::impl::take_event() {
  {
    std::lock_guard lock(events_mu_);
    if (!free_events.empty()) {
      event_handle e = free_events.back();
      free_events.pop_back();
      return e;
    }
  }
  return backend->event_create();
}

void device_allocator::impl::return_event(event_handle e) noexcept {
  std::lock_guard lock(events_mu_);
  try {
    free_events.push_back(e);
  } catch (...) {
    try {
      backend->event_destroy(e);
    } catch (...) {
    }
  }
}

void device_allocator::impl::poll_pending(stream_pool& p) {
  // Per recording stream, oldest first, up to the first event that has not completed: the later
  // ones on that stream cannot have completed either. A query that fails counts as incomplete
  // (the ladder and empty_cache synchronize it): a block is never lost, nor released early.
  for (auto& q : p.pending.queues()) {
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
      return_event(pf.event);
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
      try {
        backend->event_synchronize(pf.event);
      } catch (...) {
        if (!first_error) first_error = std::current_exception();
        return true;
      }
      return_event(pf.event);
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
  block* b = p.index_of(kind).best_fit(rounded);
  if (b == nullptr || !policy.may_take(b->size, rounded)) return nullptr;
  return b;
}

segment* device_allocator::impl::new_segment(stream_pool& p, pool_kind kind, std::size_t bytes) {
  void* ptr = nullptr;
  {
    std::lock_guard lock(grow_mu_);
    if (limit != 0 && reserved + bytes > limit) return nullptr;
    const detail::nvtx_range range(cfg.nvtx, "cucache: cudaMalloc");
    ptr = backend->segment_malloc(bytes);
    if (ptr == nullptr) return nullptr;
    reserved += bytes;
    reserved_peak = std::max(reserved_peak, reserved);
  }
  device_alloc_count.fetch_add(1, std::memory_order_relaxed);
  segment* s = add_segment(p, kind, reinterpret_cast<std::uintptr_t>(ptr), bytes, nullptr);
  p.stats.reserved_bytes.inc(kind, static_cast<std::int64_t>(bytes));
  p.stats.segment_count.inc(kind, 1);
  if (policy.is_oversize(bytes)) ++p.stats.oversize_segments;
  return s;
}

segment* device_allocator::impl::add_segment(stream_pool& p, pool_kind kind, std::uintptr_t base,
                                             std::size_t bytes, detail::vm_range* vm) {
  // A new segment (or expandable range) of p: one free block covering it, indexed.
  segment* s = p.segment_arena.make();
  block* b = p.block_arena.make();
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
  if (allocation_observer* o = observer.load(std::memory_order_acquire); o != nullptr && vm == nullptr)
      [[unlikely]]
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

void device_allocator::impl::release_segment(stream_pool& p, segment* s) {
  // REQUIRES: p.mu held, s whole and free. The device call comes first so that a failure leaves
  // every structure as it was.
  {
    std::lock_guard lock(grow_mu_);
    const detail::nvtx_range range(cfg.nvtx, "cucache: cudaFree");
    backend->segment_free(reinterpret_cast<void*>(s->base));
    reserved -= s->size;
  }
  device_free_count.fetch_add(1, std::memory_order_relaxed);
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
  b->state = block_state::allocated;
  b->requested = requested;
  b->uses = nullptr;
  if (b->seg->vm != nullptr) pager->touch(p, b, +1);
  p.stats.on_allocate(kind, static_cast<std::int64_t>(b->size),
                      static_cast<std::int64_t>(requested));
  if (policy.is_oversize(b->size)) ++p.stats.oversize_allocations;
  return b;
}

void device_allocator::impl::release_to_free(stream_pool& p, block* b) {
  release_to_free_inline(p, b);
}

void device_allocator::impl::release_to_free_inline(stream_pool& p, block* b) {
  // REQUIRES: p.mu held; b allocated-then-freed (allocation stats already taken off).
  const pool_kind kind = b->seg->kind;
  if (b->state == block_state::pending) {
    p.stats.pending_count.dec(kind, 1);
    p.stats.pending_bytes.dec(kind, static_cast<std::int64_t>(b->size));
  }
  if (b->seg->vm != nullptr) pager->touch(p, b, -1);
  if (b->uses != nullptr) [[unlikely]] {
    delete b->uses;
    b->uses = nullptr;
  }
  b->state = block_state::free;
  b->seg->free_tick = ++p.tick;
  // Coalesce with free neighbours. The merged block often stays in the bin, and at the place, of
  // the neighbour it absorbs; the index then re-links it without a walk.
  auto& index = p.index_of(kind);
  block* n = b->next;
  const bool merge_next = n != nullptr && n->state == block_state::free;
  if (block* q = b->prev; q != nullptr && q->state == block_state::free) {
    std::size_t size = q->size + b->size;
    block* after = b->next;
    if (merge_next) {
      index.erase(n);
      size += n->size;
      after = n->next;
      p.block_arena.recycle(n);
    }
    q->next = after;
    if (after != nullptr) after->prev = q;
    index.resize(q, size);
    p.block_arena.recycle(b);
    return;
  }
  if (merge_next) {
    b->size += n->size;
    b->next = n->next;
    if (n->next != nullptr) n->next->prev = b;
    index.replace(n, b);
    p.block_arena.recycle(n);
    return;
  }
  index.insert(b);
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
  // REQUIRES: all pools locked, no capture blocking (cudaFree synchronizes the device). Releases
  // whole free segments until reserved <= target. Graph pools keep theirs until released: a graph
  // replays on their addresses.
  std::vector<std::pair<stream_pool*, segment*>> victims;
  for (auto& p : pools) {
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
    {
      std::lock_guard lock(grow_mu_);
      if (reserved <= target_reserved) break;
    }
    release_segment(*p, s);
  }
}

void device_allocator::impl::collect_garbage(std::size_t incoming) {
  // REQUIRES: all pools locked.
  const std::size_t target = gc_bytes > incoming ? gc_bytes - incoming : 0;
  release_free_segments(target, /*oldest_first=*/true);
}

// --- graph capture ----------------------------------------------------------------------------

detail::graph_pool* device_allocator::impl::find_graph_pool(graph_pool_id gid) const {
  auto it = graph_pools.find(gid);
  return it == graph_pools.end() ? nullptr : it->second.get();
}

void device_allocator::impl::update_blockers_locked() {
  routes_n.store(static_cast<std::uint32_t>(routes.size()), std::memory_order_release);
  captures_n.store(static_cast<std::uint32_t>(captures.size()), std::memory_order_release);
}

detail::graph_pool* device_allocator::impl::known_capture_locked(std::uint64_t key) const {
  for (const detail::known_capture& c : captures) {
    if (c.stream_key == key) return c.pool;
  }
  return nullptr;
}

detail::graph_pool* device_allocator::impl::capture_pool_locked(stream_handle stream,
                                                                std::uint64_t key,
                                                                capture_info cap) {
  detail::graph_pool* g = nullptr;
  for (detail::graph_route& r : routes) {
    if (r.filter(stream)) {
      g = r.pool;
      break;
    }
  }
  if (g == nullptr) {
    const graph_pool_id gid = graph_pool_id::of_capture(cap.id);
    g = find_graph_pool(gid);
    if (g == nullptr) {
      auto owned = std::make_unique<detail::graph_pool>();
      owned->id = gid;
      owned->uses = 1;  // the capture's graph; release_graph_pool(of_capture(id)) drops it
      g = owned.get();
      graph_pools.emplace(gid, std::move(owned));
    }
  }
  // One entry per stream: an entry of an earlier capture on this stream has ended.
  bool noted = false;
  for (detail::known_capture& c : captures) {
    if (c.stream_key == key) {
      c.capture_id = cap.id;
      c.pool = g;
      noted = true;
    }
  }
  if (!noted) captures.push_back({cap.id, key, g});
  update_blockers_locked();
  return g;
}

stream_pool* device_allocator::impl::graph_part_for(stream_handle stream, capture_info cap) {
  if (cap.state == capture_state::invalidated) {
    throw cuda_error(
        "cucache::allocate", 901,  // cudaErrorStreamCaptureInvalidated
        fmt::format("stream {} is in a CUDA graph capture that an illegal call invalidated; the "
                    "graph can never run, and cucache allocates nothing for it (end the capture)",
                    fmt::ptr(stream)));
  }
  // A capturing stream's part is keyed by its capture key (its id cannot be asked); a stream
  // routed to a graph pool outside a capture by its id, as everywhere else.
  const std::uint64_t ckey = capture_key(stream);
  const std::uint64_t key = cap.state == capture_state::active ? ckey : stream_key(stream);
  detail::graph_pool* g = nullptr;
  {
    std::lock_guard lock(graph_mu_);
    if (cap.state == capture_state::active) {
      g = capture_pool_locked(stream, ckey, cap);
    } else {
      for (detail::graph_route& r : routes) {
        if (r.filter(stream)) {
          g = r.pool;
          break;
        }
      }
      // Not capturing now: a capture cucache noted on this stream has ended.
      if (std::erase_if(captures, [&](const auto& c) { return c.stream_key == ckey; }) != 0) {
        update_blockers_locked();
      }
    }
    if (g == nullptr) return nullptr;
    if (g->released) {
      throw invalid_argument(fmt::format(
          "cucache: graph pool ({:#x}, {:#x}) on device {} was released while a capture still "
          "allocates from it",
          g->id.first, g->id.second, backend->device()));
    }
    if (auto it = g->parts.find(key); it != g->parts.end()) return it->second;
  }
  std::unique_lock list(pools_mu_);
  std::lock_guard lock(graph_mu_);
  if (auto it = g->parts.find(key); it != g->parts.end()) return it->second;
  stream_pool& part = new_pool(stream, key, g);
  g->parts.emplace(key, &part);
  return &part;
}

void device_allocator::impl::mark_pending(stream_pool& p, block* b) {
  const pool_kind kind = b->seg->kind;
  b->state = block_state::pending;
  b->uses->pending_events = 0;
  p.stats.pending_count.inc(kind, 1);
  p.stats.pending_bytes.inc(kind, static_cast<std::int64_t>(b->size));
}

void device_allocator::impl::retain(detail::graph_pool& g, stream_pool& p, block* b) {
  {
    std::lock_guard lock(graph_mu_);
    g.retained.push_back({&p, b});
  }
  ++b->uses->pending_events;
  ++p.retained;
}

void device_allocator::impl::settle_graph_pools() {
  // REQUIRES: all pools locked (no free can add a retention meanwhile), !sync_blocked().
  std::vector<detail::graph_pool*> released;
  bool wait = false;
  {
    std::lock_guard lock(graph_mu_);
    for (auto& [gid, g] : graph_pools) {
      if (!g->released) continue;
      released.push_back(g.get());
      wait = wait || !g->settled || !g->retained.empty();
    }
    wait = wait || !sync_waiters.retained.empty();
  }
  if (released.empty() && !wait) return;
  // The last replay of a released graph may still run, on any stream: only a device-wide
  // synchronization proves that its memory is idle. A failure changes nothing.
  if (wait) backend->device_synchronize();
  std::vector<detail::retained_block> back;
  {
    std::lock_guard lock(graph_mu_);
    back.swap(sync_waiters.retained);
    for (detail::graph_pool* g : released) {
      back.insert(back.end(), g->retained.begin(), g->retained.end());
      g->retained.clear();
      g->settled = true;
    }
  }
  for (auto [p, b] : back) {
    --p->retained;
    if (--b->uses->pending_events == 0) release_to_free(*p, b);
  }
  for (detail::graph_pool* g : released) {
    for (auto [key, part] : g->parts) {
      std::vector<segment*> victims;
      for (segment* s = part->segments; s != nullptr; s = s->next) {
        if (s->whole_free()) victims.push_back(s);
      }
      for (segment* s : victims) release_segment(*part, s);
    }
  }
}

void device_allocator::impl::throw_capture_blocks(const char* what) const {
  std::string who;
  {
    std::lock_guard lock(graph_mu_);
    for (const detail::known_capture& c : captures) {
      who += fmt::format("{}capture {} (stream id {:#x})", who.empty() ? "" : ", ", c.capture_id,
                         c.stream_key);
    }
    for (const detail::graph_route& r : routes) {
      who += fmt::format("{}the route to graph pool ({:#x}, {:#x})", who.empty() ? "" : ", ",
                         r.pool->id.first, r.pool->id.second);
    }
  }
  throw cuda_error(
      fmt::format("cucache::{}", what), 900,  // cudaErrorStreamCaptureUnsupported
      fmt::format("device {}: a CUDA graph capture may be underway ({}); returning memory to the "
                  "device synchronizes it, which is illegal during a capture. End the capture "
                  "and tell cucache (end_allocate_to_pool, release_graph_pool), or allocate on "
                  "the stream again once its capture has ended",
                  backend->device(), who));
}

// --- allocate ---------------------------------------------------------------------------------

block* device_allocator::impl::grow(stream_pool& p, pool_kind kind, std::size_t rounded,
                                    std::unique_lock<detail::pool_mutex>& lk) {
  const std::size_t seg_bytes = policy.segment_size(rounded);
  if (seg_bytes > device_total || (limit != 0 && seg_bytes > limit)) return nullptr;  // never fits

  // While a capture is underway nothing may be given back (cudaFree synchronizes the device): a
  // miss can only take new memory.
  const bool blocked = sync_blocked();
  if (kind == pool_kind::large && !blocked &&
      policy.max_split_size() != std::numeric_limits<std::size_t>::max()) {
    release_oversize(p);
  }
  if (gc_bytes != 0 && !blocked) {
    bool over = false;
    {
      std::lock_guard lock(grow_mu_);
      over = reserved + seg_bytes > gc_bytes;
    }
    if (over) {
      lk.unlock();
      {
        auto all = lock_all();
        if (!sync_blocked()) collect_garbage(seg_bytes);
      }
      lk.lock();
      if (block* b = find_free(p, kind, rounded)) return b;
    }
  }
  if (segment* s = new_segment(p, kind, seg_bytes)) return s->first;

  // Out-of-memory ladder: wait for every pending free, release every whole free segment of every
  // pool (and what released graph pools hold), and retry once.
  retry_count.fetch_add(1, std::memory_order_relaxed);
  const detail::nvtx_range range(cfg.nvtx, "cucache: out-of-memory ladder");
  lk.unlock();
  {
    auto all = lock_all();
    for (auto& q : pools) sync_pending(*q);
    if (!sync_blocked()) {
      settle_graph_pools();
      release_free_segments(0, /*oldest_first=*/false);
    }
  }
  lk.lock();
  if (block* b = find_free(p, kind, rounded)) return b;
  segment* s = new_segment(p, kind, seg_bytes);
  return s != nullptr ? s->first : nullptr;
}

void* device_allocator::impl::allocate(std::size_t bytes, stream_handle stream) {
  if (bytes == 0) return nullptr;
  const std::optional<std::size_t> rounded_or = policy.round_size(bytes);
  if (!rounded_or) throw_oom(bytes, 0, stream);  // its rounded size passes any device
  const std::size_t rounded = *rounded_or;
  const pool_kind kind = detail::size_policy::pool_for(rounded);
  // A stream that is being captured allocates from its capture's pool: the graph keeps using the
  // address at every replay, so nobody else may get it. (The legacy stream cannot be captured.)
  // One backend call asks both what the capture check and the pool key need: the capture status
  // first, and the stream id only when the stream is not being captured (asking the id of a
  // capturing stream would invalidate its capture).
  stream_pool* graph_part = nullptr;
  std::uint64_t key = detail::k_legacy_stream_key;
  if (stream != nullptr) {
    const stream_identity who = raw->identify(stream);
    if (who.capture.state != capture_state::none || sync_blocked()) [[unlikely]] {
      graph_part = graph_part_for(stream, who.capture);
    }
    key = who.id;  // valid unless capturing, and then graph_part is set
  } else if (routes_n.load(std::memory_order_acquire) != 0) [[unlikely]] {
    graph_part = graph_part_for(stream, {});
  }
  stream_pool& p = graph_part != nullptr ? *graph_part : pool_for(stream, key);
  std::unique_lock lk(p.mu);
  if (!p.pending.empty()) poll_pending(p);
  if (cfg.expandable_segments && p.graph == nullptr) {
    // (Graph pools use segments in every mode: nothing of theirs may be unmapped or moved while
    // a graph may replay on it.)
    void* ptr = allocate_expandable(p, kind, rounded, bytes, lk);
    if (ptr == nullptr) {
      lk.unlock();
      throw_oom(bytes, rounded, stream);
    }
    return ptr;
  }
  block* b = find_free(p, kind, rounded);
  if (b == nullptr) b = grow(p, kind, rounded, lk);
  if (b == nullptr) {
    lk.unlock();
    throw_oom(bytes, rounded, stream);
  }
  b = carve_inline(p, b, kind, rounded, bytes);
  blocks.insert(b->addr, b);
  return reinterpret_cast<void*>(b->addr);
}

// --- free -------------------------------------------------------------------------------------

bool device_allocator::impl::deallocate(void* ptr, stream_handle stream, bool ordered) {
  if (ptr == nullptr) return true;
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  block* b = blocks.take(addr);
  if (b == nullptr) return false;
  stream_pool& p = *b->seg->owner;
  std::lock_guard lk(p.mu);
  // The common free: no capture known, nobody observing, the block used on its own stream only.
  // It is deallocate_locked's path for that case, step for step, without its tests.
  if (captures_n.load(std::memory_order_acquire) != 0 ||
      observer.load(std::memory_order_acquire) != nullptr ||
      b->uses != nullptr || (ordered && !names_pool_stream(p, stream))) [[unlikely]] {
    return deallocate_locked(p, b, ptr, stream, ordered);
  }
  p.stats.on_free(b->seg->kind, static_cast<std::int64_t>(b->size),
                  static_cast<std::int64_t>(b->requested));
  if (policy.is_oversize(b->size)) --p.stats.oversize_allocations;
  b->requested = 0;
  release_to_free_inline(p, b);
  return true;
}

bool device_allocator::impl::deallocate_locked(stream_pool& p, block* b, void* ptr,
                                               stream_handle stream, bool ordered) {
  // REQUIRES: p.mu held; b taken out of the block map.
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  // A block of a stream pool freed while cucache knows that stream captures: the captured work
  // may use it at every replay, so it is held for that capture's graph pool, not reused.
  detail::graph_pool* own_capture = nullptr;
  if (captures_n.load(std::memory_order_acquire) != 0 && p.graph == nullptr) [[unlikely]] {
    std::lock_guard lock(graph_mu_);
    // By handle: captures are known by their streams' capture keys. A stale handle (p's stream
    // destroyed, its value now a capturing stream's) only retains a block longer than needed.
    own_capture = known_capture_locked(capture_key(p.stream));
    if (own_capture != nullptr && b->uses == nullptr) {
      try {
        b->uses = new detail::stream_uses;
      } catch (...) {
        blocks.insert(addr, b);  // nothing changed
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
  if (ordered && !names_pool_stream(p, stream) &&
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
    return true;
  }
  mark_pending(p, b);
  if (own_capture != nullptr) retain(*own_capture, p, b);
  if (cross) {
    // Used on other streams: reuse waits for an event on each of them -- or, for a stream being
    // captured, for the release of its capture's graph pool: an event recorded there would be a
    // node of the graph, which no query can ever see complete.
    for (stream_handle s : b->uses->streams) {
      capture_info cap{};
      std::uint64_t key = 0;
      try {
        cap = raw->capture_status(s);
        if (cap.state != capture_state::none) key = capture_key(s);
      } catch (...) {
        cap = {};  // the stream is gone: the record below fails and the fallback waits
      }
      if (cap.state != capture_state::none) {
        detail::graph_pool* g = nullptr;
        {
          std::lock_guard lock(graph_mu_);
          g = capture_pool_locked(s, key, cap);
        }
        retain(*g, p, b);
        continue;
      }
      event_handle e = nullptr;
      try {
        e = take_event();
        backend->event_record(e, s);
        p.pending.push(s, b, e);
        ++b->uses->pending_events;
      } catch (...) {
        // Without an event the only safe reuse is after the work queued so far drains. The stream
        // itself may be why the record failed (destroyed since record_stream named it): wait
        // device-wide, which names no stream -- or, while a capture forbids that, hold the block
        // until the next device synchronization cucache makes.
        if (e != nullptr) return_event(e);
        if (sync_blocked()) {
          retain(sync_waiters, p, b);
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
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  bool found = blocks.with(addr, [&](block* b) {
    if (names_pool_stream(*b->seg->owner, stream)) return;
    // Under the map's shard lock only: the block cannot be freed meanwhile, and nothing else
    // touches its uses while it is allocated.
    if (b->uses == nullptr) b->uses = new detail::stream_uses;
    auto& rs = b->uses->streams;
    if (std::find(rs.begin(), rs.end(), stream) == rs.end()) rs.push_back(stream);
  });
  return found;
}

void device_allocator::impl::empty_cache() {
  auto all = lock_all();
  for (auto& p : pools) sync_pending(*p);
  if (sync_blocked()) throw_capture_blocks("empty_cache");
  settle_graph_pools();
  if (cfg.expandable_segments) {
    for (auto& p : pools) pager->unmap_idle(*p, /*release_handles=*/true);
    pager->release_unmapped(0);
  }
  release_free_segments(0, /*oldest_first=*/false);
}

// --- graph pools: the public calls --------------------------------------------------------------

void device_allocator::impl::begin_allocate_to_pool(graph_pool_id gid, stream_filter filter) {
  if (gid == graph_pool_id{}) {
    throw invalid_argument("cucache::begin_allocate_to_pool: pool id (0, 0) names no pool");
  }
  if (!filter) throw invalid_argument("cucache::begin_allocate_to_pool: the filter is empty");
  // All pools locked too: release_free_segments reads `released` under the pool locks.
  auto all = lock_all();
  std::lock_guard lock(graph_mu_);
  detail::graph_pool* g = find_graph_pool(gid);
  if (g != nullptr && g->routed) {
    throw invalid_argument(
        fmt::format("cucache::begin_allocate_to_pool: graph pool ({:#x}, {:#x}) is routed already",
                    gid.first, gid.second));
  }
  if (g != nullptr && g->released && !g->settled) {
    throw invalid_argument(fmt::format(
        "cucache::begin_allocate_to_pool: graph pool ({:#x}, {:#x}) was released and a replay "
        "of its last graph may still run (no device synchronization since: a capture is "
        "underway)",
        gid.first, gid.second));
  }
  routes.reserve(routes.size() + 1);
  if (g == nullptr) {
    auto owned = std::make_unique<detail::graph_pool>();
    owned->id = gid;
    g = owned.get();
    graph_pools.emplace(gid, std::move(owned));
  }
  ++g->uses;
  g->released = false;
  g->settled = false;
  g->routed = true;
  routes.push_back({g, std::move(filter)});
  update_blockers_locked();
}

void device_allocator::impl::end_allocate_to_pool(graph_pool_id gid) {
  auto all = lock_all();
  {
    std::lock_guard lock(graph_mu_);
    detail::graph_pool* g = find_graph_pool(gid);
    bool found = false;
    if (g != nullptr) {
      found = std::erase_if(routes, [&](const auto& r) { return r.pool == g; }) != 0;
      g->routed = false;
      found = std::erase_if(captures, [&](const auto& c) { return c.pool == g; }) != 0 || found;
      update_blockers_locked();
    }
    if (!found) {
      throw invalid_argument(fmt::format(
          "cucache::end_allocate_to_pool: nothing allocates to graph pool ({:#x}, {:#x})",
          gid.first, gid.second));
    }
  }
  if (!sync_blocked()) settle_graph_pools();
}

void device_allocator::impl::release_graph_pool(graph_pool_id gid) {
  auto all = lock_all();
  {
    std::lock_guard lock(graph_mu_);
    detail::graph_pool* g = find_graph_pool(gid);
    if (g == nullptr || g->uses == 0) {
      throw invalid_argument(fmt::format(
          "cucache::release_graph_pool: graph pool ({:#x}, {:#x}) {}", gid.first, gid.second,
          g == nullptr ? "does not exist" : "has no owner left (released already)"));
    }
    if (g->routed) {
      throw invalid_argument(
          fmt::format("cucache::release_graph_pool: graph pool ({:#x}, {:#x}) is still routed "
                      "(end_allocate_to_pool first)",
                      gid.first, gid.second));
    }
    if (--g->uses == 0) {
      g->released = true;
      g->settled = false;
      // A graph that is released has been captured: its capture has ended.
      std::erase_if(captures, [&](const auto& c) { return c.pool == g; });
      update_blockers_locked();
    }
  }
  if (!sync_blocked()) settle_graph_pools();
}

graph_pool_info device_allocator::impl::graph_pool_state(graph_pool_id gid) const {
  auto all = lock_all();
  std::lock_guard lock(graph_mu_);
  graph_pool_info info;
  const detail::graph_pool* g = find_graph_pool(gid);
  if (g == nullptr) return info;
  info.exists = true;
  info.uses = g->uses;
  info.routed = g->routed;
  info.released = g->released;
  info.retained_blocks = g->retained.size();
  for (auto [key, part] : g->parts) {
    info.reserved_bytes += static_cast<std::size_t>(part->stats.reserved_bytes[0].current);
    info.allocated_bytes += static_cast<std::size_t>(part->stats.allocated_bytes[0].current);
  }
  return info;
}

// --- public shell -----------------------------------------------------------------------------

device_allocator::device_allocator(std::shared_ptr<device_backend> backend, config cfg,
                                   std::shared_ptr<allocation_observer> observer)
    : impl_(std::make_unique<impl>(std::move(backend), std::move(cfg), std::move(observer))) {
  // reserve_mb: after the allocator is whole, so that a refusal destroys it cleanly.
  if (impl_->cfg.reserve_bytes != 0) impl_->reserve(impl_->cfg.reserve_bytes, nullptr);
}
device_allocator::~device_allocator() = default;

void* device_allocator::allocate(std::size_t bytes, stream_handle stream) {
  allocation_observer* const o = impl_->observer.load(std::memory_order_acquire);
  if (o == nullptr) [[likely]]
    return impl_->allocate(bytes, stream);
  void* ptr = nullptr;
  try {
    ptr = impl_->allocate(bytes, stream);
  } catch (...) {
    o->on_failure(bytes, stream);
    throw;
  }
  if (ptr != nullptr) o->on_allocate(ptr, bytes, stream);
  return ptr;
}
void device_allocator::deallocate(void* ptr) {
  if (!impl_->deallocate(ptr, nullptr, false)) impl_->throw_bad_pointer(ptr, "free");
}
void device_allocator::deallocate(void* ptr, stream_handle stream) {
  if (!impl_->deallocate(ptr, stream, true)) impl_->throw_bad_pointer(ptr, "free");
}
void device_allocator::record_stream(void* ptr, stream_handle stream) {
  if (!impl_->record_stream(ptr, stream)) impl_->throw_bad_pointer(ptr, "record_stream");
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
const config& device_allocator::get_config() const noexcept {
  return impl_->cfg;
}
int device_allocator::device() const noexcept {
  return impl_->backend->device();
}
device_backend& device_allocator::backend() const noexcept {
  return *impl_->raw;
}

std::size_t device_allocator::allocation_size(const void* ptr) const {
  std::size_t size = 0;
  impl_->blocks.with(reinterpret_cast<std::uintptr_t>(ptr), [&](block* b) { size = b->size; });
  return size;
}

detail::stream_pool& device_allocator::impl::pool_for_outline(stream_handle stream) {
  return pool_for(stream, stream_key(stream));
}
detail::block* device_allocator::impl::find_free_outline(const detail::stream_pool& p,
                                                        detail::pool_kind kind,
                                                        std::size_t rounded) const {
  return find_free(p, kind, rounded);
}

void device_allocator::attach_observer(std::shared_ptr<allocation_observer> observer) {
  if (observer == nullptr) throw invalid_argument("cucache: attach_observer: no observer given");
  std::lock_guard lock(impl_->observer_mu_);
  if (impl_->observer.load(std::memory_order_acquire) != nullptr) {
    throw invalid_argument("cucache: attach_observer: this allocator already has an observer");
  }
  impl_->observer_owner = std::move(observer);
  impl_->observer.store(impl_->observer_owner.get(), std::memory_order_release);
}

}  // namespace cucache
