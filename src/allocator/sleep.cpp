// Sleep and wake of a sleep domain (tag_sleeper.hpp; docs/design.md, "Sleep and wake"): the walk
// over the domain's pools, the host copies, and the pager's two operations -- evict (unmap and
// release every page of a pool, keeping the virtual range and the page-use counts) and back (map
// the pages a live block touches). Everything runs under every pool lock (lock_all): no block of
// the domain can be allocated or freed meanwhile, and allocate / free see the asleep bit under
// their pool's lock.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <span>
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
  // Graph memory captured under the domain (graph_sleep.cpp): whole segments, copied whole.
  std::vector<segment*> graph_segments;
  std::size_t graph_bytes = 0;
};

std::string bytes_text(std::size_t n) {
  return detail::format_bytes(static_cast<double>(n));
}

}  // namespace

namespace {

/// The whole-VM segments of the domain's graph parts (graph_sleep.cpp) join walk w: each one a
/// run of its own (a replay uses every byte of it, free blocks included).
void add_graph_segments(const detail::pool_table& pools, std::uint32_t domain, domain_walk& w)
    REQUIRES(detail::every_pool) {
  for (const auto& q : pools) {
    detail::pool_table::assert_locked(*q);
    if (q->domain != domain || q->graph == nullptr) continue;
    for (segment* s = q->segments; s != nullptr; s = s->next) {
      if (!s->whole_vm) continue;
      w.graph_segments.push_back(s);
      w.graph_bytes += s->size;
      w.runs.push_back({s->base, s->size, 0});
      w.run_bytes += s->size;
    }
  }
}

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
  add_graph_segments(pools, domain, w);
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
    throw invalid_argument(fmt::format("cucache: {}: sleep domain {} is not in [1, {}]; nothing "
                                       "changed",
                                       what, domain, detail::k_max_sleep_domain));
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

namespace {
/// One domain of a sleep call, as the call goes on.
struct sleep_plan {
  std::uint32_t domain = 0;
  bool keep = false;
  std::string name;
  const std::function<void(std::size_t)>* check = nullptr;
  domain_walk w;
  detail::tag_sleeper::record rec;
  /// rec.host stands for the domain's spare buffer (reused, or pinned in place of a smaller one
  /// already freed): a sleep that does not happen keeps it as the spare; else it is freed.
  bool host_is_spare = false;
  bool free_smaller = false;  // the domain's smaller spare goes once every buffer is pinned
};

/// For the analysis, inside a lambda of a function that holds every pool lock (lambdas are
/// analysed on their own).
void every_pool_held() noexcept ASSERT_CAPABILITY(detail::every_pool) {}

std::string names_text(const std::vector<std::string>& names) {
  return fmt::format("{}", fmt::join(names, ", "));
}

/// "the domain named twice" refusal, shared by sleep and wake.
template <class Request>
void refuse_duplicates(std::span<const Request> requests, const char* what, int device) {
  for (std::size_t i = 0; i < requests.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j) {
      if (requests[j].domain == requests[i].domain) {
        throw invalid_argument(fmt::format(
            "cucache: {}: {} on device {} is named twice in the list (entries {} and {}); "
            "nothing changed",
            what, who(requests[i].domain, std::string(requests[i].label)), device, j, i));
      }
    }
  }
}
}  // namespace

void device_allocator::impl::sleep(std::span<const device_allocator::sleep_request> requests) {
  if (requests.empty()) {
    throw invalid_argument("cucache: sleep: the list of tags to put to sleep is empty");
  }
  std::vector<sleep_plan> plans(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    plans[i].domain = requests[i].domain;
    plans[i].keep = requests[i].keep_contents;
    plans[i].name = who(requests[i].domain, std::string(requests[i].label));
    plans[i].check = requests[i].check ? &requests[i].check : nullptr;
    plans[i].rec.label = std::string(requests[i].label);
    plans[i].rec.keep_contents = requests[i].keep_contents;
  }
  if (!cfg.expandable_segments) {
    throw cuda_error("cucache sleep", k_not_supported,
                     fmt::format("{} on device {}: sleep needs expandable segments "
                                 "(CUCACHE_CONF=expandable_segments:True): in the default mode a "
                                 "block is part of a cudaMalloc'd segment, whose memory cannot be "
                                 "released while its addresses stay reserved; nothing changed",
                                 plans[0].name, raw->device()));
  }
  for (const sleep_plan& p : plans) check_domain(p.domain, "sleep");
  refuse_duplicates(requests, "sleep", raw->device());
  detail::pool_table::all_locked all(pools);
  // --- every refusal first: nothing changes for any domain until all requests pass ---
  for (const sleep_plan& p : plans) {
    if (sleeper.asleep(p.domain)) {
      throw invalid_argument(fmt::format(
          "cucache: sleep: {} on device {} is asleep already (wake it first); nothing changed",
          p.name, raw->device()));
    }
  }
  if (sync_blocked()) graphs.throw_capture_blocks("sleep");
  for (const sleep_plan& p : plans) {
    if (p.check == nullptr) continue;
    // Under every pool lock: no allocation or free of the domain is half done in its pools.
    std::int64_t placed = 0;
    for (const auto& q : pools) {
      detail::pool_table::assert_locked(*q);
      // The domain's graph parts too: graph memory captured under the tag sleeps with it.
      if (q->domain == p.domain) placed += q->stats.requested_bytes[0].current;
    }
    (*p.check)(static_cast<std::size_t>(placed));
  }
  for (sleep_plan& p : plans) {
    p.w = walk_domain(pools, p.domain);
    if (const block* b = exported_block(p.w.pools)) {
      // Sleep would release the physical memory the importers map: after wake they would read
      // and write memory the exporter no longer sees.
      throw invalid_argument(fmt::format(
          "cucache: sleep: {} on device {} holds the block {:#x} ({}) exported to other "
          "processes by ipc_get_handle (cucacheIpcGetHandle); its importers map its physical "
          "memory, which sleep would release from under them. Free the block once every "
          "importer has closed it, then sleep; nothing changed",
          p.name, raw->device(), b->addr, bytes_text(b->size)));
    }
  }
  // Work still queued on the domains' memory is waited for, not refused: unmapping must wait for
  // it anyway (the pager never unmaps before a device synchronization), and the allocator cannot
  // see a block's use on its own stream. Pending frees (used on other streams) complete first.
  for (sleep_plan& p : plans) {
    for (stream_pool* q : p.w.pools) {
      detail::pool_table::assert_locked(*q);
      sync_pending(*q);
    }
  }
  for (sleep_plan& p : plans) {
    for (stream_pool* q : p.w.pools) {
      detail::pool_table::assert_locked(*q);
      if (q->retained != 0 || !q->pending.empty()) {
        throw invalid_argument(fmt::format(
            "cucache: sleep: {} on device {} has {} freed block(s) held for a CUDA graph that may "
            "still replay on them; release the graph's pool first (nothing changed)",
            p.name, raw->device(), q->retained + q->pending.size()));
      }
    }
    p.w = walk_domain(pools, p.domain);  // pending blocks became free
    p.rec.sleeping_bytes = p.w.touched_pages * page_bytes + p.w.graph_bytes;
  }
  // --- the host buffers of the kept contents: all of them, or none (a refusal gives back what
  // the earlier requests took: reused spares become spares again, new buffers are freed) ---
  auto& spares = sleeper.spares();
  const auto give_back = [&](std::size_t from, std::size_t to, bool keep_all) noexcept {
    every_pool_held();  // called only below, under `all`
    for (std::size_t i = from; i < to; ++i) {
      sleep_plan& p = plans[i];
      if (p.rec.host == nullptr) continue;
      if (p.host_is_spare || keep_all) {
        keep_spare(p.domain, p.rec.host, p.rec.host_capacity);
      } else {
        try {
          backend->host_free_pinned(p.rec.host);
        } catch (...) {
        }
      }
      p.rec.host = nullptr;
    }
  };
  for (std::size_t i = 0; i < plans.size(); ++i) {
    sleep_plan& p = plans[i];
    if (!p.keep || p.w.run_bytes == 0) continue;
    // The domain's buffer (prepare_sleep's, or its last wake's) when it is large enough; else a
    // new one, pinned while the smaller one is still held (so that a refusal changes nothing),
    // and only when the host refuses that, after freeing the smaller one.
    auto sp = spares.find(p.domain);
    if (sp != spares.end() && sp->second.bytes >= p.w.run_bytes) {
      p.rec.host = sp->second.host;
      p.rec.host_capacity = sp->second.bytes;
      p.host_is_spare = true;
      spares.erase(sp);
      continue;
    }
    auto* host = static_cast<std::byte*>(backend->host_alloc_pinned(p.w.run_bytes));
    std::string freed;  // the smaller buffer given up to make room, for the message
    if (host == nullptr && sp != spares.end()) {
      freed = fmt::format(" (its smaller pinned buffer of {} was freed to make room)",
                          bytes_text(sp->second.bytes));
      std::byte* smaller = sp->second.host;
      spares.erase(sp);
      sp = spares.end();
      try {
        backend->host_free_pinned(smaller);
      } catch (...) {
      }
      host = static_cast<std::byte*>(backend->host_alloc_pinned(p.w.run_bytes));
      p.host_is_spare = true;  // it stands in for the spare freed
    }
    if (host == nullptr) {
      give_back(0, i, false);
      throw out_of_memory(fmt::format(
          "cucache: sleep: {} on device {}: cannot pin {} of host memory for the contents of "
          "its live blocks (keep_contents); it stays awake with every byte in place{}{}",
          p.name, raw->device(), bytes_text(p.w.run_bytes),
          freed.empty() ? "; nothing changed" : freed,
          plans.size() > 1 ? " (and no tag of the call sleeps)" : ""));
    }
    p.rec.host = host;
    p.rec.host_capacity = p.w.run_bytes;
    p.free_smaller = sp != spares.end();
  }
  for (sleep_plan& p : plans) {
    if (!p.free_smaller) continue;
    const auto sp = spares.find(p.domain);
    std::byte* smaller = sp->second.host;
    spares.erase(sp);
    p.host_is_spare = true;
    try {
      backend->host_free_pinned(smaller);
    } catch (...) {
      give_back(0, plans.size(), false);
      throw;
    }
  }
  // --- the copies of every kept domain, under one synchronization after them ---
  bool copied = false;
  for (const sleep_plan& p : plans) copied = copied || p.rec.host != nullptr;
  if (copied) {
    const auto copy_start = std::chrono::steady_clock::now();
    try {
      backend->device_synchronize();  // the work queued on the blocks, before reading them
      for (const sleep_plan& p : plans) {
        if (p.rec.host != nullptr) queue_copies(*backend, p.w.runs, p.rec.host, /*to_host=*/true);
      }
      backend->device_synchronize();
    } catch (...) {
      give_back(0, plans.size(), false);
      throw;
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - copy_start).count();
    for (sleep_plan& p : plans) {
      if (p.rec.host == nullptr) continue;
      p.rec.copy_seconds = seconds;
      p.rec.host_bytes = p.w.run_bytes;
      p.rec.runs = std::move(p.w.runs);
    }
  }
  // The records go in before anything is released (put_to_sleep then only sets bits): no
  // allocation can fail once pages are gone.
  try {
    for (const sleep_plan& p : plans) sleeper.reserve_record(p.domain);
  } catch (...) {
    for (const sleep_plan& p : plans) sleeper.drop_record(p.domain);
    give_back(0, plans.size(), false);
    throw;
  }
  // --- release, domain by domain. Without copies, the first evict's synchronization is the
  // call's one; after the copies' synchronization no work has used the pages ---
  bool synchronize = !copied;
  for (std::size_t i = 0; i < plans.size(); ++i) {
    sleep_plan& p = plans[i];
    std::size_t released = 0;
    try {
      for (stream_pool* q : p.w.pools) {
        detail::pool_table::assert_locked(*q);
        released += pager->evict(*q, synchronize);
        synchronize = false;
      }
      released += release_graph_segments(p.w.graph_segments, synchronize);
    } catch (...) {
      // A device failure part way: this domain rolled back to awake (roll_back_sleep), the ones
      // before it asleep, the ones after untouched (their copies kept as spare buffers).
      const auto [why, code] = current_error();
      std::vector<std::string> slept;
      std::vector<std::string> untouched;
      for (std::size_t j = 0; j < i; ++j) slept.push_back(plans[j].name);
      for (std::size_t j = i + 1; j < plans.size(); ++j) {
        sleeper.drop_record(plans[j].domain);
        untouched.push_back(plans[j].name);
      }
      give_back(i + 1, plans.size(), /*keep_all=*/true);
      std::string others;
      if (!slept.empty()) {
        others += fmt::format("; of the same call, {} slept before the failure and stay{} asleep",
                              names_text(slept), slept.size() == 1 ? "s" : "");
      }
      if (!untouched.empty()) {
        others += fmt::format("; {} {} not touched and stay{} awake", names_text(untouched),
                              untouched.size() == 1 ? "was" : "were",
                              untouched.size() == 1 ? "s" : "");
      }
      roll_back_sleep(p.domain, p.w.pools, p.w.graph_segments, p.rec, p.name, why, code,
                      others);  // throws
    }
    p.rec.released_bytes = released;
    sleeper.put_to_sleep(p.domain, std::move(p.rec));
    if (!p.keep) {
      // A sleep that keeps nothing gives back the pinned buffer the domain's last wake kept.
      if (auto sp = spares.find(p.domain); sp != spares.end()) {
        std::byte* h = sp->second.host;
        spares.erase(sp);
        try {
          backend->host_free_pinned(h);
        } catch (...) {
        }
      }
    }
  }
}

void device_allocator::impl::roll_back_sleep(std::uint32_t domain,
                                             const std::vector<stream_pool*>& domain_pools,
                                             const std::vector<segment*>& graph_segments,
                                             detail::tag_sleeper::record& rec,
                                             const std::string& name, const std::string& why,
                                             int code, const std::string& others) {
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
    if (!map_graph_segments(graph_segments)) {
      throw out_of_memory(fmt::format("no room to map {} of graph memory again",
                                      bytes_text(unmapped_bytes(graph_segments))));
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
                    "stays awake, every page of its live blocks mapped again{}{}",
                    name, raw->device(), why,
                    rec.keep_contents ? " with their contents"
                                      : ", but the contents of the pages released before the "
                                        "failure are lost (keep_contents was off)",
                    others));
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
  try {
    rec.released_bytes += release_graph_segments(graph_segments, first);
  } catch (...) {
    if (finish_failure.empty()) finish_failure = current_error().first;
  }
  sleeper.put_to_sleep(domain, std::move(rec));
  throw cuda_error(
      "cucache sleep", code,
      fmt::format("{} on device {}: releasing its pages failed part way ({}), and mapping them "
                  "again failed too ({}); {}: wake it (wake maps what is missing){}",
                  name, raw->device(), why, rollback_failure,
                  finish_failure.empty()
                      ? "the rest was released instead, so it is asleep"
                      : "it is asleep with some pages still mapped (" + finish_failure + ")",
                  others));
}

void device_allocator::impl::wake(std::span<const device_allocator::wake_request> requests) {
  if (requests.empty()) {
    throw invalid_argument("cucache: wake: the list of tags to wake is empty");
  }
  for (const auto& r : requests) check_domain(r.domain, "wake");
  refuse_duplicates(requests, "wake", raw->device());
  detail::pool_table::all_locked all(pools);
  struct wake_plan {
    std::uint32_t domain = 0;
    detail::tag_sleeper::record* rec = nullptr;
    std::string name;
    domain_walk w;
  };
  std::vector<wake_plan> plans(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const std::uint32_t domain = requests[i].domain;
    const std::string label(requests[i].label);
    if (!sleeper.asleep(domain)) {
      throw invalid_argument(fmt::format("cucache: wake: {} on device {} is not asleep; nothing "
                                         "changed",
                                         who(domain, label), raw->device()));
    }
    wake_plan& p = plans[i];
    p.domain = domain;
    p.rec = &sleeper.of(domain);
    p.name = who(domain, p.rec->label.empty() ? label : p.rec->label);
  }
  if (sync_blocked()) graphs.throw_capture_blocks("wake");
  const auto waking = [&](std::uint32_t d) {
    return std::any_of(plans.begin(), plans.end(), [d](const wake_plan& p) { return p.domain == d; });
  };
  // What wake maps: the pages live blocks touch that no mapping backs now (all of them, unless a
  // device failure stopped sleep part way).
  std::size_t missing_pages = 0;
  std::vector<std::string> names;
  for (wake_plan& p : plans) {
    names.push_back(p.name);
    p.w = walk_domain(pools, p.domain);
    for (stream_pool* q : p.w.pools) {
      detail::pool_table::assert_locked(*q);
      for (const segment* seg : q->pages.ranges) {
        const detail::vm_range& r = *seg->vm;
        bool counted_any = false;
        std::size_t last_counted = 0;  // a page two blocks share is counted once
        for (const block* b = seg->first; b != nullptr; b = b->next) {
          if (b->state == block_state::free) continue;
          const std::size_t first = r.page_of(b->addr);
          const std::size_t last = r.page_of(b->addr + b->size - 1);
          const std::size_t start =
              counted_any && first <= last_counted ? last_counted + 1 : first;
          if (start <= last) missing_pages += r.unmapped_in(start, last);
          last_counted = std::max(last_counted, last);
          counted_any = true;
        }
      }
    }
  }
  std::size_t missing_graph_bytes = 0;
  for (const wake_plan& p : plans) missing_graph_bytes += unmapped_bytes(p.w.graph_segments);
  const bool one = plans.size() == 1;
  const std::string name = one ? plans[0].name : names_text(names);
  const std::size_t needed = missing_pages * page_bytes + missing_graph_bytes;
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
    if (waking(q->domain) || !q->pages.has_idle()) continue;
    pager->unmap_idle(*q, /*release=*/true);
    room = pager->room_bytes();
  }
  const auto no_room = [&](std::size_t have) {
    return out_of_memory(fmt::format(
        "cucache: wake: {} on device {} need{} {} of device memory to map {} {} page(s) again; "
        "the device and the memory limit have room for {}: {} missing. {} asleep and "
        "nothing of {} is mapped; free memory (or put another tag to sleep) and wake {} again",
        name, raw->device(), one ? "s" : "", bytes_text(needed), one ? "its" : "their",
        missing_pages, bytes_text(have), bytes_text(needed > have ? needed - have : 0),
        one ? "It stays" : "They stay", one ? "it" : "them", one ? "it" : "them"));
  };
  if (room < needed) throw no_room(room);
  // Undo: every page mapped for the domains goes again, and handles a failed map left in the
  // unmapped list are released down to the reservation wake began with -- the device holds what
  // it held before (the other pools' idle pages given back above stay given back: cached memory).
  const std::size_t reserved_at_start = budget.reserved_bytes();
  const auto undo = [&](bool synchronize) noexcept {
    every_pool_held();  // called only below, under `all`
    bool first = synchronize;
    for (wake_plan& p : plans) {
      for (stream_pool* q : p.w.pools) {
        try {
          detail::pool_table::assert_locked(*q);
          pager->evict(*q, first);
        } catch (...) {
        }
        first = false;
      }
      try {
        release_graph_segments(p.w.graph_segments, first);
      } catch (...) {
      }
    }
    try {
      pager->release_unmapped(reserved_at_start);
    } catch (...) {
    }
  };
  try {
    for (wake_plan& p : plans) {
      for (stream_pool* q : p.w.pools) {
        detail::pool_table::assert_locked(*q);
        for (segment* seg : q->pages.ranges) {
          for (block* b = seg->first; b != nullptr; b = b->next) {
            if (b->state == block_state::free) continue;
            if (!pager->back(*q, b)) throw no_room(pager->room_bytes());
          }
        }
      }
      if (!map_graph_segments(p.w.graph_segments)) throw no_room(pager->room_bytes());
    }
  } catch (...) {
    undo(false);  // nothing has used the new pages: no synchronization needed
    throw;
  }
  // The kept contents of every domain, copied back under one synchronization.
  double copy_in = 0;
  bool copied = false;
  for (const wake_plan& p : plans) copied = copied || p.rec->host != nullptr;
  if (copied) {
    const auto copy_start = std::chrono::steady_clock::now();
    try {
      for (const wake_plan& p : plans) {
        if (p.rec->host != nullptr) {
          queue_copies(*backend, p.rec->runs, p.rec->host, /*to_host=*/false);
        }
      }
      backend->device_synchronize();
    } catch (...) {
      undo(true);  // copies may be in flight: the pages go only after a synchronization
      throw;
    }
    copy_in = std::chrono::duration<double>(std::chrono::steady_clock::now() - copy_start).count();
  }
  for (wake_plan& p : plans) {
    const bool kept = p.rec->host != nullptr;
    // Kept for the domain's next sleep. A spare can be there already (prepare_sleep pinned one
    // while the domain fell asleep): the larger of the two stays, the other is freed.
    if (kept) keep_spare(p.domain, p.rec->host, p.rec->host_capacity);
    sleeper.last_copy_in()[p.domain] = kept ? copy_in : 0.0;
    sleeper.wake_up(p.domain);
  }
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
  const sleep_request one{domain, keep_contents, label, check};
  impl_->sleep(std::span<const sleep_request>(&one, 1));
}
void device_allocator::sleep(std::span<const sleep_request> requests) { impl_->sleep(requests); }
std::size_t device_allocator::prepare_sleep(std::uint32_t domain, std::size_t bytes,
                                            std::string_view label) {
  return impl_->prepare_sleep(domain, bytes, std::string(label));
}
std::size_t device_allocator::sleep_buffer_bytes(std::uint32_t domain) const {
  if (domain == 0 || domain > detail::k_max_sleep_domain) return 0;
  return impl_->spare_bytes(domain);
}
void device_allocator::wake(std::uint32_t domain, std::string_view label) {
  const wake_request one{domain, label};
  impl_->wake(std::span<const wake_request>(&one, 1));
}
void device_allocator::wake(std::span<const wake_request> requests) { impl_->wake(requests); }
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
