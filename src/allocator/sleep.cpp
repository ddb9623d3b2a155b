// Sleep and wake of a sleep domain (tag_sleeper.hpp; docs/design.md, "Sleep and wake"): the walk
// over the domain's pools, the host copies, and the pager's two operations -- evict (unmap and
// release every page of a pool, keeping the virtual range and the page-use counts) and back (map
// the pages a live block touches). Everything runs under every pool lock (lock_all): no block of
// the domain can be allocated or freed meanwhile, and allocate / free see the asleep bit under
// their pool's lock.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string_view>
#include <utility>

#include "allocator/allocator_impl.hpp"
#include "core/format_bytes.hpp"
#include "cucache/errors.hpp"

namespace cucache {

using detail::block;
using detail::block_state;
using detail::segment;
using detail::stream_pool;

namespace {

/// Host copies are queued in pieces of at most this size: large enough to run at the copy
/// engines' rate, small enough that no single call stands for many seconds.
constexpr std::size_t k_copy_chunk_bytes = std::size_t{256} << 20;

/// cudaErrorNotSupported's number: sleep outside expandable mode.
constexpr int k_not_supported = 801;

/// What a domain holds now: its pools, the pages its live (allocated or pending) blocks touch,
/// and the runs of allocated blocks (adjacent blocks merged) whose bytes keep_contents copies.
struct domain_walk {
  std::vector<stream_pool*> pools;
  std::size_t touched_pages = 0;
  std::size_t live_blocks = 0;
  std::vector<detail::tag_sleeper::copy_run> runs;
  std::size_t run_bytes = 0;
};

std::string bytes_text(std::size_t n) {
  return detail::format_bytes(static_cast<double>(n));
}

}  // namespace

namespace {

domain_walk walk_domain(const detail::pool_table& pools, std::uint32_t domain)
    REQUIRES(detail::every_pool) {
  domain_walk w;
  for (const auto& q : pools) {
    detail::pool_table::assert_locked(*q);
    if (q->domain != domain || q->graph != nullptr) continue;
    w.pools.push_back(q.get());
    for (const segment* seg : q->pages.ranges) {
      const detail::vm_range& r = *seg->vm;
      bool counted_any = false;
      std::size_t last_counted = 0;  // the last page counted in this range
      for (const block* b = seg->first; b != nullptr; b = b->next) {
        if (b->state == block_state::free) continue;
        ++w.live_blocks;
        const std::size_t first = r.page_of(b->addr);
        const std::size_t last = r.page_of(b->addr + b->size - 1);
        const std::size_t start = counted_any && first <= last_counted ? last_counted + 1 : first;
        if (start <= last) w.touched_pages += last - start + 1;
        last_counted = std::max(last_counted, last);
        counted_any = true;
        if (b->state != block_state::allocated) continue;
        if (!w.runs.empty() && w.runs.back().addr + w.runs.back().bytes == b->addr) {
          w.runs.back().bytes += b->size;
        } else {
          w.runs.push_back({b->addr, b->size, w.run_bytes});
        }
        w.run_bytes += b->size;
      }
    }
  }
  // Offsets in order of the runs (merging only grew the last one).
  std::size_t off = 0;
  for (auto& run : w.runs) {
    run.host_offset = off;
    off += run.bytes;
  }
  return w;
}

/// Queues the copies of `runs` between device and host (to_host: device -> host) in chunks.
void queue_copies(device_backend& backend, const std::vector<detail::tag_sleeper::copy_run>& runs,
                  std::byte* host, bool to_host) {
  for (const auto& run : runs) {
    for (std::size_t done = 0; done < run.bytes; done += k_copy_chunk_bytes) {
      const std::size_t n = std::min(k_copy_chunk_bytes, run.bytes - done);
      void* dev = reinterpret_cast<void*>(run.addr + done);
      std::byte* h = host + run.host_offset + done;
      if (to_host) {
        backend.copy_async(h, dev, n, nullptr);
      } else {
        backend.copy_async(dev, h, n, nullptr);
      }
    }
  }
}

std::string who(std::uint32_t domain, const std::string& label) {
  return label.empty() ? fmt::format("sleep domain {}", domain) : fmt::format("tag '{}'", label);
}

void check_domain(std::uint32_t domain, const char* what) {
  if (domain == 0 || domain > detail::k_max_sleep_domain) {
    throw invalid_argument(fmt::format("cucache: {}: sleep domain {} is not in [1, {}]", what,
                                       domain, detail::k_max_sleep_domain));
  }
}

}  // namespace

namespace {
std::string asleep_block_text(const std::string& name, int device, const void* ptr,
                              const char* what) {
  const bool free = std::string_view(what) == "free";
  return fmt::format(
      "cucache: {}({}) on device {}: the block belongs to {}, which is asleep; wake it before {} "
      "(nothing changed)",
      what, ptr, device, name, free ? "freeing its blocks" : "using its blocks");
}
}  // namespace

void device_allocator::impl::refuse_if_asleep(const stream_pool& p, const void* ptr,
                                              const char* what) const {
  // p locked (annotated): the records are read under a pool lock, and sleep and wake change
  // them under every pool lock.
  if (p.domain == 0 || !sleeper.asleep(p.domain)) return;
  const auto& records = sleeper.records();
  const auto it = records.find(p.domain);
  const std::string name = who(p.domain, it != records.end() ? it->second.label : std::string());
  if (ptr != nullptr) {
    throw invalid_argument(asleep_block_text(name, raw->device(), ptr, what));
  }
  throw invalid_argument(
      fmt::format("cucache: {} on device {}: {} is asleep; wake it before allocating under it "
                  "(nothing changed)",
                  what, raw->device(), name));
}

void device_allocator::impl::refuse_asleep_block(std::uint32_t d, const void* ptr,
                                                 const char* what) {
  std::string label;
  {
    detail::pool_table::all_locked all(pools);
    const auto& records = sleeper.records();
    if (const auto it = records.find(d); it != records.end()) label = it->second.label;
  }
  throw invalid_argument(asleep_block_text(who(d, label), raw->device(), ptr, what));
}

namespace {
/// The first live block of `pools` exported to another process, or nullptr.
const block* exported_block(const std::vector<stream_pool*>& pools) REQUIRES(detail::every_pool) {
  for (const stream_pool* q : pools) {
    detail::pool_table::assert_locked(*q);
    for (const segment* seg : q->pages.ranges) {
      for (const block* b = seg->first; b != nullptr; b = b->next) {
        if (b->state == block_state::allocated && b->exported) return b;
      }
    }
  }
  return nullptr;
}

/// The text of the exception in flight, and its CUDA error code (cudaErrorUnknown's 999 for
/// anything but a cuda_error).
std::pair<std::string, int> current_error() {
  try {
    throw;
  } catch (const cuda_error& e) {
    return {e.what(), e.code()};
  } catch (const std::exception& e) {
    return {e.what(), 999};
  } catch (...) {
    return {"unknown exception", 999};
  }
}
}  // namespace

void device_allocator::impl::sleep(std::uint32_t domain, bool keep_contents,
                                   const std::string& label,
                                   const std::function<void(std::size_t)>& check) {
  const std::string name = who(domain, label);
  if (!cfg.expandable_segments) {
    throw cuda_error("cucache sleep", k_not_supported,
                     fmt::format("{} on device {}: sleep needs expandable segments "
                                 "(CUCACHE_CONF=expandable_segments:True): in the default mode a "
                                 "block is part of a cudaMalloc'd segment, whose memory cannot be "
                                 "released while its addresses stay reserved; nothing changed",
                                 name, raw->device()));
  }
  check_domain(domain, "sleep");
  detail::pool_table::all_locked all(pools);
  if (sleeper.asleep(domain)) {
    throw invalid_argument(fmt::format(
        "cucache: sleep: {} on device {} is asleep already (wake it first); nothing changed", name,
        raw->device()));
  }
  if (sync_blocked()) graphs.throw_capture_blocks("sleep");
  if (check) {
    // Under every pool lock: no allocation or free of the domain is half done in its pools.
    std::int64_t placed = 0;
    for (const auto& q : pools) {
      detail::pool_table::assert_locked(*q);
      if (q->domain == domain && q->graph == nullptr) placed += q->stats.requested_bytes[0].current;
    }
    check(static_cast<std::size_t>(placed));
  }
  domain_walk w = walk_domain(pools, domain);
  if (const block* b = exported_block(w.pools)) {
    // Sleep would release the physical memory the importers map: after wake they would read
    // and write memory the exporter no longer sees.
    throw invalid_argument(fmt::format(
        "cucache: sleep: {} on device {} holds the block {:#x} ({}) exported to other processes "
        "by ipc_get_handle (cucacheIpcGetHandle); its importers map its physical memory, which "
        "sleep would release from under them. Free the block once every importer has closed it, "
        "then sleep; nothing changed",
        name, raw->device(), b->addr, bytes_text(b->size)));
  }
  // Work still queued on the domain's memory is waited for, not refused: unmapping must wait for
  // it anyway (the pager never unmaps before a device synchronization), and the allocator cannot
  // see a block's use on its own stream. Pending frees (used on other streams) complete first.
  for (stream_pool* q : w.pools) {
    detail::pool_table::assert_locked(*q);
    sync_pending(*q);
  }
  for (stream_pool* q : w.pools) {
    detail::pool_table::assert_locked(*q);
    if (q->retained != 0 || !q->pending.empty()) {
      throw invalid_argument(fmt::format(
          "cucache: sleep: {} on device {} has {} freed block(s) held for a CUDA graph that may "
          "still replay on them; release the graph's pool first (nothing changed)",
          name, raw->device(), q->retained + q->pending.size()));
    }
  }
  w = walk_domain(pools, domain);  // pending blocks became free
  backend->device_synchronize();
  detail::tag_sleeper::record rec;
  rec.label = label;
  rec.keep_contents = keep_contents;
  rec.sleeping_bytes = w.touched_pages * page_bytes;
  if (!keep_contents) {
    // A sleep that keeps nothing gives back the pinned buffer the domain's last wake kept.
    auto& spares = sleeper.spares();
    if (auto sp = spares.find(domain); sp != spares.end()) {
      backend->host_free_pinned(sp->second.host);
      spares.erase(sp);
    }
  }
  if (keep_contents && w.run_bytes != 0) {
    // The domain's buffer (prepare_sleep's, or its last wake's) when it is large enough; else a
    // new one, pinned while the smaller one is still held (so that a refusal changes nothing),
    // and only when the host refuses that, after freeing the smaller one.
    std::byte* host = nullptr;
    std::size_t host_capacity = w.run_bytes;
    auto& spares = sleeper.spares();
    auto sp = spares.find(domain);
    if (sp != spares.end() && sp->second.bytes >= w.run_bytes) {
      host = sp->second.host;
      host_capacity = sp->second.bytes;
      spares.erase(sp);
    } else {
      host = static_cast<std::byte*>(backend->host_alloc_pinned(w.run_bytes));
      std::string freed;  // the smaller buffer given up to make room, for the message
      if (host == nullptr && sp != spares.end()) {
        freed = fmt::format(" (its smaller pinned buffer of {} was freed to make room)",
                            bytes_text(sp->second.bytes));
        backend->host_free_pinned(sp->second.host);
        spares.erase(sp);
        sp = spares.end();
        host = static_cast<std::byte*>(backend->host_alloc_pinned(w.run_bytes));
      }
      if (host == nullptr) {
        throw out_of_memory(fmt::format(
            "cucache: sleep: {} on device {}: cannot pin {} of host memory for the contents of "
            "its live blocks (keep_contents); it stays awake with every byte in place{}",
            name, raw->device(), bytes_text(w.run_bytes),
            freed.empty() ? "; nothing changed" : freed));
      }
      if (sp != spares.end()) {
        std::byte* smaller = sp->second.host;
        spares.erase(sp);
        try {
          backend->host_free_pinned(smaller);
        } catch (...) {
          try {
            backend->host_free_pinned(host);
          } catch (...) {
          }
          throw;
        }
      }
    }
    const auto copy_start = std::chrono::steady_clock::now();
    try {
      queue_copies(*backend, w.runs, host, /*to_host=*/true);
      backend->device_synchronize();
    } catch (...) {
      try {
        backend->host_free_pinned(host);
      } catch (...) {
      }
      throw;
    }
    rec.copy_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - copy_start).count();
    rec.host = host;
    rec.host_bytes = w.run_bytes;
    rec.host_capacity = host_capacity;
    rec.runs = std::move(w.runs);
  }
  // The record goes in before anything is released (put_to_sleep then only sets bits): no
  // allocation can fail once pages are gone.
  sleeper.reserve_record(domain);
  std::size_t released = 0;
  try {
    bool first = true;
    for (stream_pool* q : w.pools) {
      detail::pool_table::assert_locked(*q);
      released += pager->evict(*q, /*synchronize=*/first);
      first = false;
    }
  } catch (...) {
    // A device failure part way: some pages released, the rest mapped. Rolled back to awake.
    const auto [why, code] = current_error();
    roll_back_sleep(domain, w.pools, rec, name, why, code);  // throws
  }
  rec.released_bytes = released;
  sleeper.put_to_sleep(domain, std::move(rec));
}

void device_allocator::impl::roll_back_sleep(std::uint32_t domain,
                                             const std::vector<stream_pool*>& domain_pools,
                                             detail::tag_sleeper::record& rec,
                                             const std::string& name, const std::string& why,
                                             int code) {
  // REQUIRES: the domain awake, its record reserved; sleep's evict failed
  // part way. Maps every page of the domain's live blocks again and copies the kept bytes back:
  // the domain stays awake. If that fails too, the rest is released instead and the domain
  // sleeps (wake maps what is missing). Throws cuda_error(code) either way.
  std::string rollback_failure;
  try {
    for (stream_pool* q : domain_pools) {
      detail::pool_table::assert_locked(*q);
      for (segment* seg : q->pages.ranges) {
        for (block* b = seg->first; b != nullptr; b = b->next) {
          if (b->state == block_state::free) continue;
          if (!pager->back(*q, b)) {
            throw out_of_memory(fmt::format("no room to map {} again", bytes_text(b->size)));
          }
        }
      }
    }
    if (rec.host != nullptr) {
      queue_copies(*backend, rec.runs, rec.host, /*to_host=*/false);
      backend->device_synchronize();
    }
  } catch (...) {
    rollback_failure = current_error().first;
  }
  if (rollback_failure.empty()) {
    sleeper.drop_record(domain);
    if (rec.host != nullptr) keep_spare(domain, rec.host, rec.host_capacity);  // next sleep's
    throw cuda_error(
        "cucache sleep", code,
        fmt::format("{} on device {}: releasing its pages failed part way ({}); rolled back: it "
                    "stays awake, every page of its live blocks mapped again{}",
                    name, raw->device(), why,
                    rec.keep_contents ? " with their contents"
                                      : ", but the contents of the pages released before the "
                                        "failure are lost (keep_contents was off)"));
  }
  // Could not map them again: the rest is released too, and the domain sleeps.
  std::string finish_failure;
  bool first = true;
  for (stream_pool* q : domain_pools) {
    try {
      detail::pool_table::assert_locked(*q);
      rec.released_bytes += pager->evict(*q, /*synchronize=*/first);
    } catch (...) {
      if (finish_failure.empty()) finish_failure = current_error().first;
    }
    first = false;
  }
  sleeper.put_to_sleep(domain, std::move(rec));
  throw cuda_error(
      "cucache sleep", code,
      fmt::format("{} on device {}: releasing its pages failed part way ({}), and mapping them "
                  "again failed too ({}); {}: wake it (wake maps what is missing)",
                  name, raw->device(), why, rollback_failure,
                  finish_failure.empty()
                      ? "the rest was released instead, so it is asleep"
                      : "it is asleep with some pages still mapped (" + finish_failure + ")"));
}

void device_allocator::impl::wake(std::uint32_t domain, const std::string& label) {
  check_domain(domain, "wake");
  detail::pool_table::all_locked all(pools);
  if (!sleeper.asleep(domain)) {
    throw invalid_argument(fmt::format("cucache: wake: {} on device {} is not asleep; nothing "
                                       "changed",
                                       who(domain, label), raw->device()));
  }
  detail::tag_sleeper::record& rec = sleeper.of(domain);
  const std::string name = who(domain, rec.label.empty() ? label : rec.label);
  if (sync_blocked()) graphs.throw_capture_blocks("wake");
  const domain_walk w = walk_domain(pools, domain);
  // What wake maps: the pages live blocks touch that no mapping backs now (all of them, unless a
  // device failure stopped sleep part way).
  std::size_t missing_pages = 0;
  for (stream_pool* q : w.pools) {
    detail::pool_table::assert_locked(*q);
    for (const segment* seg : q->pages.ranges) {
      const detail::vm_range& r = *seg->vm;
      bool counted_any = false;
      std::size_t last_counted = 0;  // a page two blocks share is counted once
      for (const block* b = seg->first; b != nullptr; b = b->next) {
        if (b->state == block_state::free) continue;
        const std::size_t first = r.page_of(b->addr);
        const std::size_t last = r.page_of(b->addr + b->size - 1);
        const std::size_t start = counted_any && first <= last_counted ? last_counted + 1 : first;
        if (start <= last) missing_pages += r.unmapped_in(start, last);
        last_counted = std::max(last_counted, last);
        counted_any = true;
      }
    }
  }
  const std::size_t needed = missing_pages * page_bytes;
  // Room: what the limit and the device allow plus the unmapped handles. When short, the other
  // pools' idle (cached) pages are given back first, pool by pool -- the same memory the
  // out-of-memory ladder would take.
  std::size_t room = pager->room_bytes();
  if (room < needed) {
    // As the out-of-memory ladder: the stream-ordered frees whose work is still queued hold
    // room an allocation would get by waiting; their blocks become free (their pages idle,
    // given back below), and released graph pools settle.
    for (const auto& q : pools) {
      detail::pool_table::assert_locked(*q);
      sync_pending(*q);
    }
    settle_graph_pools();
    room = pager->room_bytes();
  }
  for (const auto& q : pools) {
    detail::pool_table::assert_locked(*q);
    if (room >= needed) break;
    if (q->domain == domain || !q->pages.has_idle()) continue;
    pager->unmap_idle(*q, /*release=*/true);
    room = pager->room_bytes();
  }
  const auto no_room = [&](std::size_t have) {
    return out_of_memory(fmt::format(
        "cucache: wake: {} on device {} needs {} of device memory to map its {} page(s) again; "
        "the device and the memory limit have room for {}: {} missing. It stays asleep and "
        "nothing of it is mapped; free memory (or put another tag to sleep) and wake it again",
        name, raw->device(), bytes_text(needed), missing_pages, bytes_text(have),
        bytes_text(needed > have ? needed - have : 0)));
  };
  if (room < needed) throw no_room(room);
  // Undo: every page mapped for the domain goes again, and handles a failed map left in the
  // unmapped list are released down to the reservation wake began with -- the device holds what
  // it held before (the other pools' idle pages given back above stay given back: cached memory).
  const std::size_t reserved_at_start = budget.reserved_bytes();
  const auto undo = [&](bool synchronize) noexcept {
    bool first = synchronize;
    for (stream_pool* q : w.pools) {
      try {
        detail::pool_table::assert_locked(*q);
        pager->evict(*q, first);
      } catch (...) {
      }
      first = false;
    }
    try {
      pager->release_unmapped(reserved_at_start);
    } catch (...) {
    }
  };
  try {
    for (stream_pool* q : w.pools) {
      detail::pool_table::assert_locked(*q);
      for (segment* seg : q->pages.ranges) {
        for (block* b = seg->first; b != nullptr; b = b->next) {
          if (b->state == block_state::free) continue;
          if (!pager->back(*q, b)) throw no_room(pager->room_bytes());
        }
      }
    }
  } catch (...) {
    undo(false);  // nothing has used the new pages: no synchronization needed
    throw;
  }
  double copy_in = 0;
  if (rec.host != nullptr) {
    const auto copy_start = std::chrono::steady_clock::now();
    try {
      queue_copies(*backend, rec.runs, rec.host, /*to_host=*/false);
      backend->device_synchronize();
    } catch (...) {
      undo(true);  // copies may be in flight: the pages go only after a synchronization
      throw;
    }
    copy_in = std::chrono::duration<double>(std::chrono::steady_clock::now() - copy_start).count();
    // Kept for the domain's next sleep. A spare can be there already (prepare_sleep pinned one
    // while the domain fell asleep): the larger of the two stays, the other is freed.
    keep_spare(domain, rec.host, rec.host_capacity);
  }
  sleeper.last_copy_in()[domain] = copy_in;
  sleeper.wake_up(domain);
}

void device_allocator::impl::keep_spare(std::uint32_t domain, std::byte* host,
                                        std::size_t bytes) noexcept {
  std::byte* loser = host;
  try {
    auto& spares = sleeper.spares();
    auto [it, added] = spares.try_emplace(domain, detail::tag_sleeper::spare_buffer{host, bytes});
    if (added) return;
    if (bytes > it->second.bytes) {
      loser = it->second.host;
      it->second = {host, bytes};
    }
  } catch (...) {
    // No room for the map node: `host` is freed (the next kept sleep pins again).
  }
  try {
    backend->host_free_pinned(loser);
  } catch (...) {
  }
}

std::size_t device_allocator::impl::prepare_sleep(std::uint32_t domain, std::size_t bytes,
                                                  const std::string& label) {
  const std::string name = who(domain, label);
  if (!cfg.expandable_segments) {
    throw cuda_error("cucache prepare_sleep", k_not_supported,
                     fmt::format("{} on device {}: sleep needs expandable segments "
                                 "(CUCACHE_CONF=expandable_segments:True); nothing pinned",
                                 name, raw->device()));
  }
  check_domain(domain, "prepare_sleep");
  std::size_t want = 0;
  {
    detail::pool_table::all_locked all(pools);
    if (sleeper.asleep(domain)) {
      throw invalid_argument(fmt::format(
          "cucache: prepare_sleep: {} on device {} is asleep (its contents already hold a pinned "
          "buffer, kept after wake); nothing changed",
          name, raw->device()));
    }
    // What a kept sleep would copy now: the bytes of the domain's allocated blocks.
    want = std::max(bytes, walk_domain(pools, domain).run_bytes);
    if (const std::size_t have = sleeper.spare_bytes(domain); have >= want && have != 0) return have;
    if (want == 0) return 0;
  }
  // Pinned outside the pool locks: cudaHostAlloc of gigabytes takes seconds (docs/benchmarks.md,
  // "Sleep and wake"), and allocations and frees of every pool go on meanwhile.
  auto* host = static_cast<std::byte*>(backend->host_alloc_pinned(want));
  if (host == nullptr) {
    throw out_of_memory(fmt::format(
        "cucache: prepare_sleep: {} on device {}: cannot pin {} of host memory for the contents "
        "of its next sleep (keep_contents); nothing changed, the sleep would pin it itself",
        name, raw->device(), bytes_text(want)));
  }
  detail::pool_table::all_locked all(pools);
  // Another thread may have prepared (or slept and woken) meanwhile: the larger buffer stays.
  keep_spare(domain, host, want);
  return sleeper.spare_bytes(domain);
}

std::size_t device_allocator::impl::spare_bytes(std::uint32_t domain) {
  detail::pool_table::all_locked all(pools);
  return sleeper.spare_bytes(domain);
}

// --- public shell -------------------------------------------------------------------------------

void device_allocator::set_thread_sleep_domain(std::uint32_t domain) {
  check_domain(domain == 0 ? 1 : domain, "set_thread_sleep_domain");
  detail::t_sleep_domain = domain;
}
std::uint32_t device_allocator::thread_sleep_domain() noexcept {
  return detail::t_sleep_domain;
}
void device_allocator::sleep(std::uint32_t domain, bool keep_contents, std::string_view label,
                             const std::function<void(std::size_t)>& check) {
  impl_->sleep(domain, keep_contents, std::string(label), check);
}
std::size_t device_allocator::prepare_sleep(std::uint32_t domain, std::size_t bytes,
                                            std::string_view label) {
  return impl_->prepare_sleep(domain, bytes, std::string(label));
}
std::size_t device_allocator::sleep_buffer_bytes(std::uint32_t domain) const {
  if (domain == 0 || domain > detail::k_max_sleep_domain) return 0;
  return impl_->spare_bytes(domain);
}
void device_allocator::wake(std::uint32_t domain, std::string_view label) {
  impl_->wake(domain, std::string(label));
}
std::vector<device_allocator::sleep_state> device_allocator::sleeping() const {
  detail::pool_table::all_locked all(impl_->pools);
  std::vector<sleep_state> out;
  for (const auto& [domain, r] : impl_->sleeper.records()) {
    out.push_back({domain, r.sleeping_bytes, r.host_bytes, r.copy_seconds});
  }
  return out;
}
double device_allocator::last_wake_copy_seconds(std::uint32_t domain) const {
  detail::pool_table::all_locked all(impl_->pools);
  const auto& m = impl_->sleeper.last_copy_in();
  const auto it = m.find(domain);
  return it != m.end() ? it->second : 0.0;
}

void device_allocator::impl::free_spare_host_buffers() noexcept {
  for (const auto& [domain, sp] : sleeper.spares()) {
    try {
      backend->host_free_pinned(sp.host);
    } catch (...) {
    }
  }
  sleeper.spares().clear();
}

bool device_allocator::is_asleep(std::uint32_t domain) const {
  if (domain == 0 || domain > detail::k_max_sleep_domain) return false;
  detail::pool_table::all_locked all(impl_->pools);
  return impl_->sleeper.asleep(domain);
}

std::size_t device_allocator::domain_requested_bytes(std::uint32_t domain) const {
  if (domain == 0) return 0;
  detail::pool_table::all_locked all(impl_->pools);
  std::int64_t n = 0;
  for (const auto& q : impl_->pools) {
    detail::pool_table::assert_locked(*q);
    if (q->domain == domain && q->graph == nullptr) n += q->stats.requested_bytes[0].current;
  }
  return static_cast<std::size_t>(n);
}

}  // namespace cucache
