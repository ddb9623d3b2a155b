// The allocation and free paths of device_allocator: cache lookup, splitting, coalescing, segment
// growth, the out-of-memory ladder, deferred frees and garbage collection.
#include "cucache/device_allocator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "allocator/allocator_impl.hpp"
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
  stream_handle stream = nullptr;
  stream_pool* pool = nullptr;
};
thread_local pool_cache_entry t_pool_cache;

}  // namespace

device_allocator::impl::impl(std::shared_ptr<device_backend> b, config c,
                             std::shared_ptr<allocation_observer> o)
    : backend(std::move(b)),
      cfg(std::move(c)),
      observer(std::move(o)),
      policy(cfg),
      id(g_allocator_ids.fetch_add(1)) {
  if (!backend) throw invalid_argument("device_allocator: backend is null");
  expandable = cfg.expandable_segments;
  if (expandable) {
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
  if (expandable) {
    pager = std::make_unique<detail::pager>(
        *backend,
        detail::device_budget{grow_mu_, reserved, reserved_peak, limit, gc_bytes,
                              device_alloc_count, device_free_count},
        page_bytes, device_total, pools_mu_, pools);
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
        p->blocks.recycle(b);
        b = nb;
      }
      p->segs.recycle(s);
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

stream_pool& device_allocator::impl::pool_for(stream_handle stream) {
  pool_cache_entry& c = t_pool_cache;
  if (c.owner == id && c.stream == stream) return *c.pool;
  stream_pool* p = nullptr;
  {
    std::shared_lock lock(pools_mu_);
    auto it = pool_by_stream.find(stream);
    if (it != pool_by_stream.end()) p = it->second;
  }
  if (p == nullptr) {
    std::unique_lock lock(pools_mu_);
    auto it = pool_by_stream.find(stream);
    if (it != pool_by_stream.end()) {
      p = it->second;
    } else {
      pools.push_back(std::make_unique<stream_pool>(stream, pools.size()));
      p = pools.back().get();
      pool_by_stream.emplace(stream, p);
    }
  }
  c = pool_cache_entry{id, stream, p};
  return *p;
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

block* device_allocator::impl::find_free(stream_pool& p, pool_kind kind, std::size_t rounded) {
  block* b = p.index_of(kind).best_fit(rounded);
  if (b == nullptr || !policy.may_take(b->size, rounded)) return nullptr;
  return b;
}

block* device_allocator::impl::new_segment(stream_pool& p, pool_kind kind, std::size_t bytes) {
  void* ptr = nullptr;
  {
    std::lock_guard lock(grow_mu_);
    if (limit != 0 && reserved + bytes > limit) return nullptr;
    ptr = backend->segment_malloc(bytes);
    if (ptr == nullptr) return nullptr;
    reserved += bytes;
    reserved_peak = std::max(reserved_peak, reserved);
  }
  device_alloc_count.fetch_add(1, std::memory_order_relaxed);
  segment* s = add_segment(p, kind, reinterpret_cast<std::uintptr_t>(ptr), bytes, nullptr);
  block* b = s->first;
  p.stats.reserved_bytes.inc(kind, static_cast<std::int64_t>(bytes));
  p.stats.segment_count.inc(kind, 1);
  if (policy.is_oversize(bytes)) ++p.stats.oversize_segments;
  return b;
}

segment* device_allocator::impl::add_segment(stream_pool& p, pool_kind kind, std::uintptr_t base,
                                             std::size_t bytes, detail::vm_range* vm) {
  // A new segment (or expandable range) of p: one free block covering it, indexed.
  segment* s = p.segs.make();
  block* b = p.blocks.make();
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
  return s;
}

block* device_allocator::impl::split_off(stream_pool& p, block* b, std::size_t front_bytes) {
  // A new free block for b's bytes from front_bytes on, linked after b. b's size and both blocks'
  // places in the free index are the caller's to set.
  block* rest = p.blocks.make();
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
    backend->segment_free(reinterpret_cast<void*>(s->base));
    reserved -= s->size;
  }
  device_free_count.fetch_add(1, std::memory_order_relaxed);
  p.index_of(s->kind).erase(s->first);
  p.stats.reserved_bytes.dec(s->kind, static_cast<std::int64_t>(s->size));
  p.stats.segment_count.dec(s->kind, 1);
  if (policy.is_oversize(s->size)) --p.stats.oversize_segments;
  if (s->prev != nullptr) s->prev->next = s->next;
  if (s->next != nullptr) s->next->prev = s->prev;
  if (p.segments == s) p.segments = s->next;
  p.blocks.recycle(s->first);
  p.segs.recycle(s);
}

block* device_allocator::impl::carve(stream_pool& p, block* b, pool_kind kind, std::size_t rounded,
                                     std::size_t requested) {
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
      p.blocks.recycle(n);
    }
    q->next = after;
    if (after != nullptr) after->prev = q;
    index.resize(q, size);
    p.blocks.recycle(b);
    return;
  }
  if (merge_next) {
    b->size += n->size;
    b->next = n->next;
    if (n->next != nullptr) n->next->prev = b;
    index.replace(n, b);
    p.blocks.recycle(n);
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
  // REQUIRES: all pools locked. Releases whole free segments until reserved <= target.
  std::vector<std::pair<stream_pool*, segment*>> victims;
  for (auto& p : pools) {
    for (segment* s = p->segments; s != nullptr; s = s->next) {
      if (s->whole_free()) victims.emplace_back(p.get(), s);
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

// --- allocate ---------------------------------------------------------------------------------

block* device_allocator::impl::grow(stream_pool& p, pool_kind kind, std::size_t rounded,
                                    std::unique_lock<detail::pool_mutex>& lk) {
  const std::size_t seg_bytes = policy.segment_size(rounded);
  if (seg_bytes > device_total || (limit != 0 && seg_bytes > limit)) return nullptr;  // never fits

  if (kind == pool_kind::large &&
      policy.max_split_size() != std::numeric_limits<std::size_t>::max()) {
    release_oversize(p);
  }
  if (gc_bytes != 0) {
    bool over = false;
    {
      std::lock_guard lock(grow_mu_);
      over = reserved + seg_bytes > gc_bytes;
    }
    if (over) {
      lk.unlock();
      {
        auto all = lock_all();
        collect_garbage(seg_bytes);
      }
      lk.lock();
      if (block* b = find_free(p, kind, rounded)) return b;
    }
  }
  if (block* b = new_segment(p, kind, seg_bytes)) return b;

  // Out-of-memory ladder: wait for every pending free, release every whole free segment of every
  // pool, and retry once.
  retry_count.fetch_add(1, std::memory_order_relaxed);
  lk.unlock();
  {
    auto all = lock_all();
    for (auto& q : pools) sync_pending(*q);
    release_free_segments(0, /*oldest_first=*/false);
  }
  lk.lock();
  if (block* b = find_free(p, kind, rounded)) return b;
  return new_segment(p, kind, seg_bytes);
}

void* device_allocator::impl::allocate(std::size_t bytes, stream_handle stream) {
  if (bytes == 0) return nullptr;
  const std::optional<std::size_t> rounded_or = policy.round_size(bytes);
  if (!rounded_or) throw_oom(bytes, 0, stream);  // its rounded size passes any device
  const std::size_t rounded = *rounded_or;
  const pool_kind kind = detail::size_policy::pool_for(rounded);
  stream_pool& p = pool_for(stream);
  std::unique_lock lk(p.mu);
  if (!p.pending.empty()) poll_pending(p);
  if (expandable) {
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
  b = carve(p, b, kind, rounded, bytes);
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
  // Before the block can be reused: a trace then lists this free before the next allocation of
  // the same address.
  if (observer != nullptr) [[unlikely]]
    observer->on_free(ptr, b->requested, ordered ? stream : p.stream);
  const pool_kind kind = b->seg->kind;
  p.stats.on_free(kind, static_cast<std::int64_t>(b->size),
                  static_cast<std::int64_t>(b->requested));
  if (policy.is_oversize(b->size)) --p.stats.oversize_allocations;
  b->requested = 0;
  if (ordered && stream != p.stream &&
      (b->uses == nullptr || std::find(b->uses->streams.begin(), b->uses->streams.end(), stream) ==
                                 b->uses->streams.end())) {
    try {
      if (b->uses == nullptr) b->uses = new detail::stream_uses;
      b->uses->streams.push_back(stream);
    } catch (...) {
      backend->stream_synchronize(stream);
    }
  }
  if (b->uses == nullptr || b->uses->streams.empty()) {
    release_to_free(p, b);
    return true;
  }
  // Used on other streams: reuse waits for an event on each of them.
  b->state = block_state::pending;
  b->uses->pending_events = 0;
  p.stats.pending_count.inc(kind, 1);
  p.stats.pending_bytes.inc(kind, static_cast<std::int64_t>(b->size));
  for (stream_handle s : b->uses->streams) {
    event_handle e = nullptr;
    try {
      e = take_event();
      backend->event_record(e, s);
      p.pending.push(s, b, e);
      ++b->uses->pending_events;
    } catch (...) {
      // Without an event the only safe reuse is after the work queued so far drains. The stream
      // itself may be why the record failed (destroyed since record_stream named it): wait
      // device-wide, which names no stream.
      if (e != nullptr) return_event(e);
      try {
        backend->device_synchronize();
      } catch (...) {
      }
    }
  }
  if (b->uses->pending_events == 0) release_to_free(p, b);
  return true;
}

bool device_allocator::impl::record_stream(void* ptr, stream_handle stream) {
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  bool found = blocks.with(addr, [&](block* b) {
    if (stream == b->seg->owner->stream) return;
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
  if (expandable) {
    for (auto& p : pools) pager->unmap_idle(*p, /*release_handles=*/true);
    pager->release_unmapped(0);
    return;
  }
  release_free_segments(0, /*oldest_first=*/false);
}

// --- public shell -----------------------------------------------------------------------------

device_allocator::device_allocator(std::shared_ptr<device_backend> backend, config cfg,
                                   std::shared_ptr<allocation_observer> observer)
    : impl_(std::make_unique<impl>(std::move(backend), std::move(cfg), std::move(observer))) {}
device_allocator::~device_allocator() = default;

void* device_allocator::allocate(std::size_t bytes, stream_handle stream) {
  if (impl_->observer == nullptr) [[likely]]
    return impl_->allocate(bytes, stream);
  void* ptr = nullptr;
  try {
    ptr = impl_->allocate(bytes, stream);
  } catch (...) {
    impl_->observer->on_failure(bytes, stream);
    throw;
  }
  if (ptr != nullptr) impl_->observer->on_allocate(ptr, bytes, stream);
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
const config& device_allocator::get_config() const noexcept {
  return impl_->cfg;
}
int device_allocator::device() const noexcept {
  return impl_->backend->device();
}
device_backend& device_allocator::backend() const noexcept {
  return *impl_->backend;
}

std::size_t device_allocator::allocation_size(const void* ptr) const {
  std::size_t size = 0;
  impl_->blocks.with(reinterpret_cast<std::uintptr_t>(ptr), [&](block* b) { size = b->size; });
  return size;
}

}  // namespace cucache
