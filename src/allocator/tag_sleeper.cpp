// tag_sleeper's front doors and walk (tag_sleeper.hpp; docs/design.md, "Sleep and wake"): the
// argument checks and refusals of sleep, wake and prepare_sleep, then the walk over a domain's
// pools, the host copies, and the pager's two operations -- evict (unmap and release every page
// of a pool, keeping the virtual range and the page-use counts) and back (map the pages a live
// block touches). The walk runs under every pool lock, taken by the front doors after their
// checks: no block of the domain can be allocated or freed meanwhile, and allocate / free see the
// asleep bit under their pool's lock.
#include "allocator/tag_sleeper.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <span>
#include <stdexcept>
#include <string_view>
#include <utility>

#include "allocator/device_budget.hpp"
#include "allocator/graph_pools.hpp"
#include "allocator/pager.hpp"
#include "allocator/pool_table.hpp"
#include "allocator/stream_pool.hpp"
#include "allocator/whole_vm_segments.hpp"
#include "core/format_bytes.hpp"
#include "cucache/errors.hpp"

namespace cucache::detail {
namespace {

/// Host copies are queued in pieces of at most this size: large enough to run at the copy
/// engines' rate, small enough that no single call stands for many seconds.
constexpr std::size_t k_copy_chunk_bytes = std::size_t{256} << 20;

/// What a domain holds now: its pools, the pages its live (allocated or pending) blocks touch,
/// and the runs of allocated blocks (adjacent blocks merged) whose bytes keep_contents copies.
struct domain_walk {
  std::vector<stream_pool*> pools;
  std::size_t touched_pages = 0;
  std::size_t live_blocks = 0;
  std::vector<tag_sleeper::copy_run> runs;
  std::size_t run_bytes = 0;
  // Graph memory captured under the domain (whole_vm_segments.hpp): whole segments, copied whole.
  std::vector<segment*> graph_segments;
  std::size_t graph_bytes = 0;
};

std::string bytes_text(std::size_t n) {
  return format_bytes(static_cast<double>(n));
}

/// The whole-VM segments of the domain's graph parts (whole_vm_segments.hpp) join walk w: each one a
/// run of its own (a replay uses every byte of it, free blocks included).
void add_graph_segments(const pool_table& pools, std::uint32_t domain, domain_walk& w)
    REQUIRES(every_pool) {
  for (const auto& q : pools) {
    pool_table::assert_locked(*q);
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

/// The bytes of the unmapped segments of `segs`.
std::size_t unmapped_bytes(const std::vector<segment*>& segs) noexcept {
  std::size_t n = 0;
  for (const segment* s : segs) n += s->unmapped ? s->size : 0;
  return n;
}

domain_walk walk_domain(const pool_table& pools, std::uint32_t domain)
    REQUIRES(every_pool) {
  domain_walk w;
  for (const auto& q : pools) {
    pool_table::assert_locked(*q);
    if (q->domain != domain || q->graph != nullptr) continue;
    w.pools.push_back(q.get());
    for (const segment* seg : q->pages.ranges()) {
      const vm_range& r = *seg->vm;
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
void queue_copies(device_backend& backend, const std::vector<tag_sleeper::copy_run>& runs,
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

/// The first live block of `pools` exported to another process, or nullptr.
const block* exported_block(const std::vector<stream_pool*>& pools) REQUIRES(every_pool) {
  for (const stream_pool* q : pools) {
    pool_table::assert_locked(*q);
    for (const segment* seg : q->pages.ranges()) {
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

/// One domain of a sleep call, as the call goes on.
struct sleep_plan {
  std::uint32_t domain = 0;
  bool keep = false;
  std::string name;
  const std::function<void(std::size_t)>* check = nullptr;
  domain_walk w;
  tag_sleeper::record rec;
  /// rec.host stands for the domain's spare buffer (reused, or pinned in place of a smaller one
  /// already freed): a sleep that does not happen keeps it as the spare; else it is freed.
  bool host_is_spare = false;
  bool free_smaller = false;  // the domain's smaller spare goes once every buffer is pinned
};

/// For the analysis, inside a lambda of a function that holds every pool lock (lambdas are
/// analysed on their own).
void every_pool_held() noexcept ASSERT_CAPABILITY(every_pool) {}

std::string names_text(const std::vector<std::string>& names) {
  return fmt::format("{}", fmt::join(names, ", "));
}

}  // namespace

// --- the front doors ---

namespace {

/// cudaErrorNotSupported's number: sleep outside expandable mode.
constexpr int k_not_supported = 801;

std::string asleep_block_text(const std::string& name, int device, const void* ptr,
                              const char* what) {
  const bool free = std::string_view(what) == "free";
  return fmt::format(
      "cucache: {}({}) on device {}: the block belongs to {}, which is asleep; wake it before {} "
      "(nothing changed)",
      what, ptr, device, name, free ? "freeing its blocks" : "using its blocks");
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
            what, tag_sleeper::name_of(requests[i].domain, std::string(requests[i].label)),
            device, j, i));
      }
    }
  }
}

}  // namespace

void tag_sleeper::check_domain(std::uint32_t domain, const char* what) {
  if (domain == 0 || domain > k_max_sleep_domain) {
    throw invalid_argument(fmt::format("cucache: {}: sleep domain {} is not in [1, {}]; nothing "
                                       "changed",
                                       what, domain, k_max_sleep_domain));
  }
}

void tag_sleeper::sleep_requested(const parts& ps, bool expandable,
                                  std::span<const device_allocator::sleep_request> requests) {
  if (requests.empty()) {
    throw invalid_argument("cucache: sleep: the list of tags to put to sleep is empty");
  }
  if (!expandable) {
    throw cuda_error("cucache sleep", k_not_supported,
                     fmt::format("{} on device {}: sleep needs expandable segments "
                                 "(CUCACHE_CONF=expandable_segments:True): in the default mode a "
                                 "block is part of a cudaMalloc'd segment, whose memory cannot be "
                                 "released while its addresses stay reserved; nothing changed",
                                 name_of(requests[0].domain, std::string(requests[0].label)),
                                 device_));
  }
  for (const auto& r : requests) check_domain(r.domain, "sleep");
  refuse_duplicates(requests, "sleep", device_);
  pool_table::all_locked all(ps.pools);
  sleep(ps, requests);
}

void tag_sleeper::wake_requested(const parts& ps,
                                 std::span<const device_allocator::wake_request> requests) {
  if (requests.empty()) {
    throw invalid_argument("cucache: wake: the list of tags to wake is empty");
  }
  for (const auto& r : requests) check_domain(r.domain, "wake");
  refuse_duplicates(requests, "wake", device_);
  pool_table::all_locked all(ps.pools);
  wake(ps, requests);
}

std::size_t tag_sleeper::prepare_sleep(const parts& ps, bool expandable, std::uint32_t domain,
                                       std::size_t bytes, const std::string& label) {
  const std::string name = name_of(domain, label);
  if (!expandable) {
    throw cuda_error("cucache prepare_sleep", k_not_supported,
                     fmt::format("{} on device {}: sleep needs expandable segments "
                                 "(CUCACHE_CONF=expandable_segments:True); nothing pinned",
                                 name, device_));
  }
  check_domain(domain, "prepare_sleep");
  std::size_t want = 0;
  {
    pool_table::all_locked all(ps.pools);
    if (asleep(domain)) {
      throw invalid_argument(fmt::format(
          "cucache: prepare_sleep: {} on device {} is asleep (its contents already hold a pinned "
          "buffer, kept after wake); nothing changed",
          name, device_));
    }
    // What a kept sleep would copy now: the bytes of the domain's allocated blocks.
    want = std::max(bytes, copy_bytes(ps.pools, domain));
    if (const std::size_t have = spare_bytes(domain); have >= want && have != 0) return have;
    if (want == 0) return 0;
  }
  // Pinned outside the pool locks: cudaHostAlloc of gigabytes takes seconds (docs/benchmarks.md,
  // "Sleep and wake"), and allocations and frees of every pool go on meanwhile.
  auto* host = static_cast<std::byte*>(ps.backend.host_alloc_pinned(want));
  if (host == nullptr) {
    throw out_of_memory(fmt::format(
        "cucache: prepare_sleep: {} on device {}: cannot pin {} of host memory for the contents "
        "of its next sleep (keep_contents); nothing changed, the sleep would pin it itself",
        name, device_, bytes_text(want)));
  }
  pool_table::all_locked all(ps.pools);
  // Another thread may have prepared (or slept and woken) meanwhile: the larger buffer stays.
  keep_spare(ps.backend, domain, host, want);
  return spare_bytes(domain);
}

std::size_t tag_sleeper::spare_bytes_locking(const pool_table& pools, std::uint32_t domain) {
  pool_table::all_locked all(pools);
  return spare_bytes(domain);
}

void tag_sleeper::refuse_if_asleep(const stream_pool& p, const void* ptr,
                                   const char* what) const {
  // The records are read under a pool lock (p's, the caller's); sleep and wake change them under
  // every pool lock.
  if (p.domain == 0 || !asleep(p.domain)) return;
  const auto& recs = records();
  const auto it = recs.find(p.domain);
  const std::string name = name_of(p.domain, it != recs.end() ? it->second.label : std::string());
  if (ptr != nullptr) throw invalid_argument(asleep_block_text(name, device_, ptr, what));
  throw invalid_argument(
      fmt::format("cucache: {} on device {}: {} is asleep; wake it before allocating under it "
                  "(nothing changed)",
                  what, device_, name));
}

void tag_sleeper::refuse_asleep_block(const pool_table& pools, std::uint32_t d, const void* ptr,
                                      const char* what) const {
  std::string label;
  {
    pool_table::all_locked all(pools);
    if (const auto it = records_.find(d); it != records_.end()) label = it->second.label;
  }
  throw invalid_argument(asleep_block_text(name_of(d, label), device_, ptr, what));
}

// --- the walk ---

void tag_sleeper::sleep(const parts& ps,
                        std::span<const device_allocator::sleep_request> requests) {
  std::vector<sleep_plan> plans(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    plans[i].domain = requests[i].domain;
    plans[i].keep = requests[i].keep_contents;
    plans[i].name = name_of(requests[i].domain, std::string(requests[i].label));
    plans[i].check = requests[i].check ? &requests[i].check : nullptr;
    plans[i].rec.label = std::string(requests[i].label);
    plans[i].rec.keep_contents = requests[i].keep_contents;
  }
  // --- every refusal first: nothing changes for any domain until all requests pass ---
  for (const sleep_plan& p : plans) {
    if (asleep(p.domain)) {
      throw invalid_argument(fmt::format(
          "cucache: sleep: {} on device {} is asleep already (wake it first); nothing changed",
          p.name, device_));
    }
  }
  if (ps.graphs.sync_blocked()) ps.graphs.throw_capture_blocks("sleep");
  for (const sleep_plan& p : plans) {
    if (p.check == nullptr) continue;
    // Under every pool lock: no allocation or free of the domain is half done in its pools.
    std::int64_t placed = 0;
    for (const auto& q : ps.pools) {
      pool_table::assert_locked(*q);
      // The domain's graph parts too: graph memory captured under the tag sleeps with it.
      if (q->domain == p.domain) placed += q->stats.requested_bytes[0].current;
    }
    (*p.check)(static_cast<std::size_t>(placed));
  }
  for (sleep_plan& p : plans) {
    p.w = walk_domain(ps.pools, p.domain);
    if (const block* b = exported_block(p.w.pools)) {
      // Sleep would release the physical memory the importers map: after wake they would read
      // and write memory the exporter no longer sees.
      throw invalid_argument(fmt::format(
          "cucache: sleep: {} on device {} holds the block {:#x} ({}) exported to other "
          "processes by ipc_get_handle (cucacheIpcGetHandle); its importers map its physical "
          "memory, which sleep would release from under them. Free the block once every "
          "importer has closed it, then sleep; nothing changed",
          p.name, device_, b->addr, bytes_text(b->size)));
    }
  }
  // Work still queued on the domains' memory is waited for, not refused: unmapping must wait for
  // it anyway (the pager never unmaps before a device synchronization), and the allocator cannot
  // see a block's use on its own stream. Pending frees (used on other streams) complete first.
  for (sleep_plan& p : plans) {
    for (stream_pool* q : p.w.pools) {
      pool_table::assert_locked(*q);
      ps.sync_pending(*q);
    }
  }
  for (sleep_plan& p : plans) {
    for (stream_pool* q : p.w.pools) {
      pool_table::assert_locked(*q);
      if (q->retained != 0 || !q->pending.empty()) {
        throw invalid_argument(fmt::format(
            "cucache: sleep: {} on device {} has {} freed block(s) held for a CUDA graph that may "
            "still replay on them; release the graph's pool first (nothing changed)",
            p.name, device_, q->retained + q->pending.size()));
      }
    }
    p.w = walk_domain(ps.pools, p.domain);  // pending blocks became free
    p.rec.sleeping_bytes = p.w.touched_pages * ps.page_bytes + p.w.graph_bytes;
  }
  // --- the host buffers of the kept contents: all of them, or none (a refusal gives back what
  // the earlier requests took: reused spares become spares again, new buffers are freed) ---
  auto& spares = spares_;
  const auto give_back = [&](std::size_t from, std::size_t to, bool keep_all) noexcept {
    every_pool_held();  // called only below, under `all`
    for (std::size_t i = from; i < to; ++i) {
      sleep_plan& p = plans[i];
      if (p.rec.host == nullptr) continue;
      if (p.host_is_spare || keep_all) {
        keep_spare(ps.backend, p.domain, p.rec.host, p.rec.host_capacity);
      } else {
        try {
          ps.backend.host_free_pinned(p.rec.host);
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
    auto* host = static_cast<std::byte*>(ps.backend.host_alloc_pinned(p.w.run_bytes));
    std::string freed;  // the smaller buffer given up to make room, for the message
    if (host == nullptr && sp != spares.end()) {
      freed = fmt::format(" (its smaller pinned buffer of {} was freed to make room)",
                          bytes_text(sp->second.bytes));
      std::byte* smaller = sp->second.host;
      spares.erase(sp);
      sp = spares.end();
      try {
        ps.backend.host_free_pinned(smaller);
      } catch (...) {
      }
      host = static_cast<std::byte*>(ps.backend.host_alloc_pinned(p.w.run_bytes));
      p.host_is_spare = true;  // it stands in for the spare freed
    }
    if (host == nullptr) {
      give_back(0, i, false);
      throw out_of_memory(fmt::format(
          "cucache: sleep: {} on device {}: cannot pin {} of host memory for the contents of "
          "its live blocks (keep_contents); it stays awake with every byte in place{}{}",
          p.name, device_, bytes_text(p.w.run_bytes),
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
      ps.backend.host_free_pinned(smaller);
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
      ps.backend.device_synchronize();  // the work queued on the blocks, before reading them
      for (const sleep_plan& p : plans) {
        if (p.rec.host != nullptr) queue_copies(ps.backend, p.w.runs, p.rec.host, /*to_host=*/true);
      }
      ps.backend.device_synchronize();
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
    for (const sleep_plan& p : plans) reserve_record(p.domain);
  } catch (...) {
    for (const sleep_plan& p : plans) drop_record(p.domain);
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
        pool_table::assert_locked(*q);
        released += ps.pg->evict(*q, synchronize);
        synchronize = false;
      }
      released += ps.graph_vm.release(p.w.graph_segments, synchronize);
    } catch (...) {
      // A device failure part way: this domain rolled back to awake (roll_back_sleep), the ones
      // before it asleep, the ones after untouched (their copies kept as spare buffers).
      const auto [why, code] = current_error();
      std::vector<std::string> slept;
      std::vector<std::string> untouched;
      for (std::size_t j = 0; j < i; ++j) slept.push_back(plans[j].name);
      for (std::size_t j = i + 1; j < plans.size(); ++j) {
        drop_record(plans[j].domain);
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
      roll_back_sleep(ps, p.domain, p.w.pools, p.w.graph_segments, p.rec, p.name, why, code,
                      others);  // throws
    }
    p.rec.released_bytes = released;
    put_to_sleep(p.domain, std::move(p.rec));
    if (!p.keep) {
      // A sleep that keeps nothing gives back the pinned buffer the domain's last wake kept.
      if (auto sp = spares.find(p.domain); sp != spares.end()) {
        std::byte* h = sp->second.host;
        spares.erase(sp);
        try {
          ps.backend.host_free_pinned(h);
        } catch (...) {
        }
      }
    }
  }
}

void tag_sleeper::roll_back_sleep(const parts& ps, std::uint32_t domain,
                                  const std::vector<stream_pool*>& domain_pools,
                                  const std::vector<segment*>& graph_segments, record& rec,
                                  const std::string& name, const std::string& why, int code,
                                  const std::string& others) {
  // REQUIRES: the domain awake, its record reserved; sleep's evict failed
  // part way. Maps every page of the domain's live blocks again and copies the kept bytes back:
  // the domain stays awake. If that fails too, the rest is released instead and the domain
  // sleeps (wake maps what is missing). Throws cuda_error(code) either way.
  std::string rollback_failure;
  try {
    for (stream_pool* q : domain_pools) {
      pool_table::assert_locked(*q);
      for (segment* seg : q->pages.ranges()) {
        for (block* b = seg->first; b != nullptr; b = b->next) {
          if (b->state == block_state::free) continue;
          if (!ps.pg->back(*q, b)) {
            throw out_of_memory(fmt::format("no room to map {} again", bytes_text(b->size)));
          }
        }
      }
    }
    if (!ps.graph_vm.map(graph_segments)) {
      throw out_of_memory(fmt::format("no room to map {} of graph memory again",
                                      bytes_text(unmapped_bytes(graph_segments))));
    }
    if (rec.host != nullptr) {
      queue_copies(ps.backend, rec.runs, rec.host, /*to_host=*/false);
      ps.backend.device_synchronize();
    }
  } catch (...) {
    rollback_failure = current_error().first;
  }
  if (rollback_failure.empty()) {
    drop_record(domain);
    // The pinned buffer is kept for the next sleep.
    if (rec.host != nullptr) keep_spare(ps.backend, domain, rec.host, rec.host_capacity);
    throw cuda_error(
        "cucache sleep", code,
        fmt::format("{} on device {}: releasing its pages failed part way ({}); rolled back: it "
                    "stays awake, every page of its live blocks mapped again{}{}",
                    name, device_, why,
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
      pool_table::assert_locked(*q);
      rec.released_bytes += ps.pg->evict(*q, /*synchronize=*/first);
    } catch (...) {
      if (finish_failure.empty()) finish_failure = current_error().first;
    }
    first = false;
  }
  try {
    rec.released_bytes += ps.graph_vm.release(graph_segments, first);
  } catch (...) {
    if (finish_failure.empty()) finish_failure = current_error().first;
  }
  put_to_sleep(domain, std::move(rec));
  throw cuda_error(
      "cucache sleep", code,
      fmt::format("{} on device {}: releasing its pages failed part way ({}), and mapping them "
                  "again failed too ({}); {}: wake it (wake maps what is missing){}",
                  name, device_, why, rollback_failure,
                  finish_failure.empty()
                      ? "the rest was released instead, so it is asleep"
                      : "it is asleep with some pages still mapped (" + finish_failure + ")",
                  others));
}

void tag_sleeper::wake(const parts& ps,
                       std::span<const device_allocator::wake_request> requests) {
  struct wake_plan {
    std::uint32_t domain = 0;
    tag_sleeper::record* rec = nullptr;
    std::string name;
    domain_walk w;
  };
  std::vector<wake_plan> plans(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    const std::uint32_t domain = requests[i].domain;
    const std::string label(requests[i].label);
    if (!asleep(domain)) {
      throw invalid_argument(fmt::format("cucache: wake: {} on device {} is not asleep; nothing "
                                         "changed",
                                         name_of(domain, label), device_));
    }
    wake_plan& p = plans[i];
    p.domain = domain;
    p.rec = &of(domain);
    p.name = name_of(domain, p.rec->label.empty() ? label : p.rec->label);
  }
  if (ps.graphs.sync_blocked()) ps.graphs.throw_capture_blocks("wake");
  const auto waking = [&](std::uint32_t d) {
    return std::any_of(plans.begin(), plans.end(), [d](const wake_plan& p) { return p.domain == d; });
  };
  // What wake maps: the pages live blocks touch that no mapping backs now (all of them, unless a
  // device failure stopped sleep part way).
  std::size_t missing_pages = 0;
  std::vector<std::string> names;
  for (wake_plan& p : plans) {
    names.push_back(p.name);
    p.w = walk_domain(ps.pools, p.domain);
    for (stream_pool* q : p.w.pools) {
      pool_table::assert_locked(*q);
      for (const segment* seg : q->pages.ranges()) {
        const vm_range& r = *seg->vm;
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
  const std::size_t needed = missing_pages * ps.page_bytes + missing_graph_bytes;
  // Room: what the limit and the device allow plus the unmapped handles. When short, the other
  // ps.pools' idle (cached) pages are given back first, pool by pool -- the same memory the
  // out-of-memory ladder would take.
  std::size_t room = ps.pg->room_bytes();
  if (room < needed) {
    // As the out-of-memory ladder: the stream-ordered frees whose work is still queued hold
    // room an allocation would get by waiting; their blocks become free (their pages idle,
    // given back below), and released graph pools settle.
    for (const auto& q : ps.pools) {
      pool_table::assert_locked(*q);
      ps.sync_pending(*q);
    }
    ps.settle_graph_pools();
    room = ps.pg->room_bytes();
  }
  for (const auto& q : ps.pools) {
    pool_table::assert_locked(*q);
    if (room >= needed) break;
    if (waking(q->domain) || !q->pages.has_idle()) continue;
    ps.pg->unmap_idle(*q, /*release=*/true);
    room = ps.pg->room_bytes();
  }
  const auto no_room = [&](std::size_t have) {
    return out_of_memory(fmt::format(
        "cucache: wake: {} on device {} need{} {} of device memory to map {} {} page(s) again; "
        "the device and the memory limit have room for {}: {} missing. {} asleep and "
        "nothing of {} is mapped; free memory (or put another tag to sleep) and wake {} again",
        name, device_, one ? "s" : "", bytes_text(needed), one ? "its" : "their",
        missing_pages, bytes_text(have), bytes_text(needed > have ? needed - have : 0),
        one ? "It stays" : "They stay", one ? "it" : "them", one ? "it" : "them"));
  };
  if (room < needed) throw no_room(room);
  // Undo: every page mapped for the domains goes again, and handles a failed map left in the
  // unmapped list are released down to the reservation wake began with -- the device holds what
  // it held before (the other pools' idle pages given back above stay given back: cached memory).
  const std::size_t reserved_at_start = ps.budget.reserved_bytes();
  const auto undo = [&](bool synchronize) noexcept {
    every_pool_held();  // called only below, under every pool lock
    bool first = synchronize;
    for (wake_plan& p : plans) {
      for (stream_pool* q : p.w.pools) {
        try {
          pool_table::assert_locked(*q);
          ps.pg->evict(*q, first);
        } catch (...) {
        }
        first = false;
      }
      try {
        ps.graph_vm.release(p.w.graph_segments, first);
      } catch (...) {
      }
    }
    try {
      ps.pg->release_unmapped(reserved_at_start);
    } catch (...) {
    }
  };
  try {
    for (wake_plan& p : plans) {
      for (stream_pool* q : p.w.pools) {
        pool_table::assert_locked(*q);
        for (segment* seg : q->pages.ranges()) {
          for (block* b = seg->first; b != nullptr; b = b->next) {
            if (b->state == block_state::free) continue;
            if (!ps.pg->back(*q, b)) throw no_room(ps.pg->room_bytes());
          }
        }
      }
      if (!ps.graph_vm.map(p.w.graph_segments)) throw no_room(ps.pg->room_bytes());
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
          queue_copies(ps.backend, p.rec->runs, p.rec->host, /*to_host=*/false);
        }
      }
      ps.backend.device_synchronize();
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
    if (kept) keep_spare(ps.backend, p.domain, p.rec->host, p.rec->host_capacity);
    copy_in_[p.domain] = kept ? copy_in : 0.0;
    wake_up(p.domain);
  }
}

void tag_sleeper::keep_spare(device_backend& backend, std::uint32_t domain, std::byte* host,
                             std::size_t bytes) noexcept {
  std::byte* loser = host;
  try {
    auto& spares = spares_;
    auto [it, added] = spares.try_emplace(domain, tag_sleeper::spare_buffer{host, bytes});
    if (added) return;
    if (bytes > it->second.bytes) {
      loser = it->second.host;
      it->second = {host, bytes};
    }
  } catch (...) {
    // No room for the map node: `host` is freed (the next kept sleep pins again).
  }
  try {
    backend.host_free_pinned(loser);
  } catch (...) {
  }
}

std::size_t tag_sleeper::copy_bytes(const pool_table& pools, std::uint32_t domain) {
  return walk_domain(pools, domain).run_bytes;
}

std::string tag_sleeper::name_of(std::uint32_t domain, const std::string& label) {
  return label.empty() ? fmt::format("sleep domain {}", domain) : fmt::format("tag '{}'", label);
}

void tag_sleeper::free_spares(device_backend& backend) noexcept {
  for (const auto& [domain, sp] : spares_) {
    try {
      backend.host_free_pinned(sp.host);
    } catch (...) {
    }
  }
  spares_.clear();
}

void tag_sleeper::check_invariants(const std::map<std::uint32_t, std::size_t>& touched_pages,
                                   const std::map<std::uint32_t, std::size_t>& graph_bytes,
                                   std::size_t page_bytes) const {
  const auto violated = [](const std::string& what) {
    throw std::logic_error("cucache invariant violated: " + what);
  };
  std::size_t sleep_records = 0;
  for (const auto& [domain, r] : records_) {
    ++sleep_records;
    if (!asleep(domain)) {
      violated(fmt::format("sleep domain {} has a record but is not asleep", domain));
    }
    const auto t = touched_pages.find(domain);
    const std::size_t pages = t != touched_pages.end() ? t->second : 0;
    const auto g = graph_bytes.find(domain);
    const std::size_t graph = g != graph_bytes.end() ? g->second : 0;
    if (pages * page_bytes + graph != r.sleeping_bytes) {
      violated(fmt::format("sleep domain {}: record says {} sleeping bytes, its blocks touch {} "
                           "pages of {} and its graph segments hold {}",
                           domain, r.sleeping_bytes, pages, page_bytes, graph));
    }
    std::size_t run_bytes = 0;
    for (const auto& run : r.runs) run_bytes += run.bytes;
    if (run_bytes != r.host_bytes || (r.host == nullptr) != (r.host_bytes == 0)) {
      violated(fmt::format("sleep domain {}: {} host bytes for runs of {}", domain, r.host_bytes,
                           run_bytes));
    }
  }
  if (count_.load(std::memory_order_relaxed) != sleep_records) {
    violated(fmt::format("{} sleep domains counted asleep, {} records",
                         count_.load(std::memory_order_relaxed), sleep_records));
  }
  if (sleep_records != 0) {
    std::size_t asleep_bits = 0;
    for (std::uint32_t d = 1; d <= k_max_sleep_domain; ++d) asleep_bits += asleep(d);
    if (asleep_bits != sleep_records) {
      violated(fmt::format("{} sleep domains asleep, {} records", asleep_bits, sleep_records));
    }
  }
}

}  // namespace cucache::detail
