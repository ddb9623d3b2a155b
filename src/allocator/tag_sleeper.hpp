// tag_sleeper: which sleep domains are asleep, what each sleeping one keeps to come back, and the
// walk that puts domains to sleep and wakes them (docs/design.md, "Sleep and wake").
//
// A sleep domain is a number in [1, k_max_sleep_domain]: the api layer gives a sleepable tag's
// id. In expandable mode an allocation made while the calling thread's domain (t_sleep_domain) is
// d goes to the pool of (stream, d) (pool_table::pool_for), whose ranges hold only d's blocks: a
// page of such a pool is never shared with another domain's or untagged blocks, so sleeping d can
// release every page its blocks touch.
//
// Contract of the walk (sleep / wake, tag_sleeper.cpp), in terms of the other parts' public
// calls (the `parts` it is handed):
//  - sleep(ps, requests): all of the requests or none pass the refusals (asleep already, a
//    capture blocking synchronization, a `check` that throws, a block exported by IPC, blocks
//    held for a CUDA graph, no pinned host memory for keep_contents); a refusal changes nothing
//    (pinned buffers taken go back: reused spares stay spares, new ones are freed). Then, per
//    domain in request order: the domain's non-graph pools are those of ps.pools whose domain is
//    d; pending frees complete (ps.sync_pending); with keep_contents the allocated blocks' bytes
//    (runs of adjacent blocks) are copied to one pinned buffer (the domain's spare when large
//    enough); every page of its pools is evicted (pager::evict: unmapped and released, ranges
//    and page-use counts kept), and d is marked asleep with its record: sleeping_bytes = pages
//    its live blocks touch x page size, released_bytes = what evict released. A sleep without
//    keep_contents frees the domain's spare buffer.
//    A device failure while evicting domain i: the domains before i stay asleep, those after it
//    are untouched (their pinned buffers kept as spares), and i is rolled back -- every page of
//    its live blocks mapped again (pager::back) and its kept bytes copied back, so it stays
//    awake; if mapping again fails too, the rest is evicted and i sleeps (wake maps what is
//    missing). Either way cuda_error with the failing call's code.
//  - wake(ps, requests): every domain named must be asleep (else nothing changes). The pages
//    its live blocks touch that no mapping backs are mapped again at the same addresses; when
//    the limit and the device lack room, pending frees complete and released graph pools settle
//    (ps.settle_graph_pools), then other domains' pools give back their idle pages, pool by
//    pool; if still short, out_of_memory and nothing of the domains is mapped. A failure while
//    mapping or copying back unmaps what this call mapped and releases handles down to the
//    reservation the call began with. Kept contents are copied back under one synchronization;
//    the pinned buffer becomes the domain's spare (keep_spare), and d is awake, its record gone.
//  - keep_spare(backend, d, host, bytes): (host, bytes) becomes d's spare pinned buffer; with
//    one there already the larger stays and the other is freed. Never throws.
//
// Locking: every pool lock (every_pool) for everything but asleep() and any(). The asleep bits
// change only while every pool lock is held and are read under the reader's pool lock
// (allocate, free) or under lock_all (stats, the invariant check), so a reader sees a domain
// either wholly asleep or wholly awake. The records are written under every pool lock and read
// under any one pool lock (records()).
//
// Invariants (check_invariants): a record for each asleep bit and none else; a record's
// sleeping_bytes is the pages the domain's blocks touch times the page size; its host bytes are
// the sum of its runs, and it holds a host buffer exactly when it holds host bytes.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "allocator/pool_mutex.hpp"
#include "cucache/device_allocator.hpp"

namespace cucache {
class device_backend;
}

namespace cucache::detail {

class device_budget;
class graph_pools;
class pager;
class pool_table;
class stream_pool;
struct segment;
class whole_vm_segments;

/// The largest sleep domain: pool keys carry the domain in bits 48..61 (pool_table::domain_key).
inline constexpr std::uint32_t k_max_sleep_domain = (std::uint32_t{1} << 14) - 1;

/// The calling thread's sleep domain (0: none). Read on every allocation in expandable mode; set
/// by the api layer from the thread's current tag (device_allocator::set_thread_sleep_domain).
inline thread_local std::uint32_t t_sleep_domain = 0;

class tag_sleeper {
 public:
  /// `device`: the device named in the refusals' messages.
  explicit tag_sleeper(int device = 0) noexcept : device_(device) {}

  /// What the walk works with: the allocator's parts, and the two steps of the allocation story
  /// it needs (impl::sync_pending, impl::settle_graph_pools). Built by the caller; the walk runs
  /// under every pool lock (the front doors take it).
  struct parts {
    pool_table& pools;
    pager* pg;  // null in default mode, where nothing sleeps (wake then refuses: not asleep)
    const device_budget& budget;
    device_backend& backend;
    const graph_pools& graphs;
    std::size_t page_bytes = 0;   // the pager's page
    std::function<void(stream_pool&)> sync_pending;  // REQUIRES: the pool's lock (held)
    std::function<void()> settle_graph_pools;        // REQUIRES: every pool lock (held)
    /// The domain's graph memory: its whole-VM segments, released by sleep and mapped again by
    /// wake and sleep's rollback.
    whole_vm_segments& graph_vm;
  };

  /// One run of live blocks whose bytes sleep copied to host memory (keep_contents).
  struct copy_run {
    std::uintptr_t addr = 0;
    std::size_t bytes = 0;
    std::size_t host_offset = 0;
  };
  /// What a sleeping domain keeps until it wakes.
  struct record {
    std::size_t sleeping_bytes = 0;  // bytes of the pages its live blocks touch: wake maps them
    std::size_t released_bytes = 0;  // what sleep released, its cached pages included
    bool keep_contents = false;
    std::string label;  // the front end's name for the domain (a tag), for messages
    std::byte* host = nullptr;  // pinned host copy (keep_contents), host_bytes long
    std::size_t host_bytes = 0;
    std::size_t host_capacity = 0;  // the pinned buffer's size (a reused spare may be larger)
    std::vector<copy_run> runs;  // in address order, into `host`
    double copy_seconds = 0;     // the device-to-host copies and their synchronization
  };
  /// A pinned host buffer a domain used for its last sleep, or pinned ahead by prepare_sleep, kept
  /// for its next one (pinning costs far more than copying: cudaHostAlloc maps and locks every
  /// page). Freed when the domain sleeps without keep_contents, when a larger one is needed, and
  /// with the allocator. Installed only by keep_spare (one per domain: the larger stays).
  struct spare_buffer {
    std::byte* host = nullptr;
    std::size_t bytes = 0;
  };

  // --- the front doors (tag_sleeper.cpp): the argument checks, then every pool lock ---
  /// device_allocator::sleep. Refuses, before locking anything and changing nothing: an empty
  /// list, the default mode (cuda_error 801, cudaErrorNotSupported: a segment's memory cannot be
  /// released while its addresses stay reserved), a domain outside [1, k_max_sleep_domain] or
  /// named twice. Then the walk (sleep) under every pool lock.
  void sleep_requested(const parts& ps, bool expandable,
                       std::span<const device_allocator::sleep_request> requests)
      EXCLUDES(every_pool);
  /// device_allocator::wake: the same refusals (but the mode's), then the walk (wake).
  void wake_requested(const parts& ps, std::span<const device_allocator::wake_request> requests)
      EXCLUDES(every_pool);
  /// device_allocator::prepare_sleep: pins a buffer for the domain's next kept sleep -- `bytes`,
  /// or what its allocated blocks hold now if more -- unless its spare holds that already;
  /// returns the spare's bytes. Refuses the default mode, a domain out of range or asleep. The
  /// pinning runs outside the pool locks (cudaHostAlloc of gigabytes takes seconds).
  std::size_t prepare_sleep(const parts& ps, bool expandable, std::uint32_t domain,
                            std::size_t bytes, const std::string& label) EXCLUDES(every_pool);
  /// The bytes of domain's spare buffer, read under every pool lock.
  [[nodiscard]] std::size_t spare_bytes_locking(const pool_table& pools, std::uint32_t domain)
      EXCLUDES(every_pool);
  /// Throws invalid_argument when p's domain sleeps: `what`(ptr) on one of its blocks, or (ptr
  /// null) an allocation under it. REQUIRES: p's lock (the records are read under a pool lock).
  void refuse_if_asleep(const stream_pool& p, const void* ptr, const char* what) const;
  /// invalid_argument: `what`(ptr) on a block of sleeping domain d. Takes every pool lock (to
  /// read the domain's label).
  [[noreturn]] void refuse_asleep_block(const pool_table& pools, std::uint32_t d, const void* ptr,
                                        const char* what) const EXCLUDES(every_pool);
  /// invalid_argument naming `what` when domain is outside [1, k_max_sleep_domain].
  static void check_domain(std::uint32_t domain, const char* what);

  // --- the walk (tag_sleeper.cpp; the contract above) ---
  /// Puts the domains of `requests` to sleep. REQUIRES: the requests' domains in [1,
  /// k_max_sleep_domain], each named once, expandable mode (sleep_requested checks).
  void sleep(const parts& ps, std::span<const device_allocator::sleep_request> requests)
      REQUIRES(every_pool);
  /// Wakes the domains of `requests`. REQUIRES: as sleep.
  void wake(const parts& ps, std::span<const device_allocator::wake_request> requests)
      REQUIRES(every_pool);
  /// Makes (host, bytes) domain's spare buffer; when it has one already, the larger stays and the
  /// other is freed (a failure to free it, or to record the entry, is swallowed: nothing leaks
  /// that the allocator does not own).
  void keep_spare(device_backend& backend, std::uint32_t domain, std::byte* host,
                  std::size_t bytes) noexcept REQUIRES(every_pool);
  /// Frees every spare pinned buffer (the allocator's destruction).
  void free_spares(device_backend& backend) noexcept REQUIRES(every_pool);
  /// The bytes a kept sleep of `domain` would copy now: its allocated blocks' bytes.
  [[nodiscard]] static std::size_t copy_bytes(const pool_table& pools, std::uint32_t domain)
      REQUIRES(every_pool);
  /// The domain's name in messages: "tag 'label'", or "sleep domain d" without a label.
  [[nodiscard]] static std::string name_of(std::uint32_t domain, const std::string& label);
  /// The invariants above, against `touched_pages`: by domain, the pages its pools' blocks touch
  /// (counted by the caller's walk of every range), and `graph_bytes`: by domain, the bytes of
  /// its graph parts' whole-VM segments. Throws std::logic_error naming the first
  /// violation (check_invariants composes it).
  void check_invariants(const std::map<std::uint32_t, std::size_t>& touched_pages,
                        const std::map<std::uint32_t, std::size_t>& graph_bytes,
                        std::size_t page_bytes) const REQUIRES(every_pool);

  /// True while domain d sleeps. REQUIRES: d <= k_max_sleep_domain; the caller holds a pool lock.
  [[nodiscard]] bool asleep(std::uint32_t d) const noexcept {
    return (bits_[d / 64].load(std::memory_order_relaxed) >> (d % 64) & 1U) != 0;
  }
  /// Any domain asleep (stats skip the walk otherwise).
  [[nodiscard]] bool any() const noexcept { return count_.load(std::memory_order_relaxed) != 0; }

  /// Every sleeping domain and its record, by domain. Read under any one pool lock (writers hold
  /// every one): not analysed, as the analysis has no "any of these locks" rule.
  [[nodiscard]] const std::map<std::uint32_t, record>& records() const noexcept
      NO_THREAD_SAFETY_ANALYSIS {
    return records_;
  }
  /// The spare host buffers, by domain.
  [[nodiscard]] const std::map<std::uint32_t, spare_buffer>& spares() const noexcept
      REQUIRES(every_pool) {
    return spares_;
  }
  /// The bytes of domain's spare buffer (0: none).
  [[nodiscard]] std::size_t spare_bytes(std::uint32_t domain) const REQUIRES(every_pool) {
    const auto sp = spares_.find(domain);
    return sp != spares_.end() ? sp->second.bytes : 0;
  }
  /// Seconds of the last wake's host-to-device copies (and their synchronization), by domain.
  [[nodiscard]] const std::map<std::uint32_t, double>& last_copy_in() const noexcept
      REQUIRES(every_pool) {
    return copy_in_;
  }

 private:
  // --- the records, changed only by the walk ---
  /// Makes room for d's record before anything of d is released, so that put_to_sleep cannot
  /// fail. REQUIRES: d awake.
  void reserve_record(std::uint32_t d) REQUIRES(every_pool) { records_.try_emplace(d); }
  /// Drops a record reserved for a sleep that did not happen. REQUIRES: d awake.
  void drop_record(std::uint32_t d) noexcept REQUIRES(every_pool) { records_.erase(d); }
  /// Marks d asleep with `r` (into its reserved record, if any). REQUIRES: d awake.
  void put_to_sleep(std::uint32_t d, record r) REQUIRES(every_pool) {
    records_[d] = std::move(r);
    bits_[d / 64].fetch_or(std::uint64_t{1} << (d % 64), std::memory_order_relaxed);
    count_.fetch_add(1, std::memory_order_relaxed);
  }
  /// d's record. REQUIRES: d asleep.
  [[nodiscard]] record& of(std::uint32_t d) REQUIRES(every_pool) { return records_.at(d); }
  /// Marks d awake and drops its record. REQUIRES: d asleep.
  void wake_up(std::uint32_t d) REQUIRES(every_pool) {
    records_.erase(d);
    bits_[d / 64].fetch_and(~(std::uint64_t{1} << (d % 64)), std::memory_order_relaxed);
    count_.fetch_sub(1, std::memory_order_relaxed);
  }
  /// sleep's failure part way through evicting `domain` (the contract above): rolls it back to
  /// awake, or failing that puts it to sleep; throws cuda_error(code) either way. `others`:
  /// appended to the message (what the call's other domains became). REQUIRES: domain awake,
  /// its record reserved.
  [[noreturn]] void roll_back_sleep(const parts& ps, std::uint32_t domain,
                                    const std::vector<stream_pool*>& domain_pools,
                                    const std::vector<segment*>& graph_segments, record& rec,
                                    const std::string& name, const std::string& why, int code,
                                    const std::string& others) REQUIRES(every_pool);

  int device_ = 0;
  std::array<std::atomic<std::uint64_t>, (k_max_sleep_domain + 1) / 64> bits_{};
  std::atomic<std::size_t> count_{0};
  std::map<std::uint32_t, record> records_ GUARDED_BY(every_pool);  // (see above)
  std::map<std::uint32_t, spare_buffer> spares_ GUARDED_BY(every_pool);
  std::map<std::uint32_t, double> copy_in_ GUARDED_BY(every_pool);
};

}  // namespace cucache::detail
