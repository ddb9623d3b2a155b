// tag_sleeper: which sleep domains are asleep, and what each sleeping one keeps to come back --
// the state of sleep and wake (docs/design.md, "Sleep and wake"). The walk itself (which pools,
// which blocks, the host copies, the pager's evict and back) is impl::sleep / impl::wake
// (sleep.cpp), written in terms of the parts; this part holds only their state.
//
// A sleep domain is a number in [1, k_max_sleep_domain]: the api layer gives a sleepable tag's
// id. In expandable mode an allocation made while the calling thread's domain (t_sleep_domain) is
// d goes to the pool of (stream, d) (pool_table::pool_for), whose ranges hold only d's blocks: a
// page of such a pool is never shared with another domain's or untagged blocks, so sleeping d can
// release every page its blocks touch.
//
// Locking: the asleep bits change only while every pool lock is held (impl::sleep / wake take
// lock_all) and are read under the reader's pool lock (allocate, free) or under lock_all
// (stats, the invariant check), so a reader sees a domain either wholly asleep or wholly awake.
// The records are guarded by the same rule: written under every pool lock (annotated:
// REQUIRES(every_pool), pool_mutex.hpp), read under any one pool lock.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "allocator/pool_mutex.hpp"

namespace cucache::detail {

/// The largest sleep domain: pool keys carry the domain in bits 48..61 (pool_table::domain_key).
inline constexpr std::uint32_t k_max_sleep_domain = (std::uint32_t{1} << 14) - 1;

/// The calling thread's sleep domain (0: none). Read on every allocation in expandable mode; set
/// by the api layer from the thread's current tag (device_allocator::set_thread_sleep_domain).
inline thread_local std::uint32_t t_sleep_domain = 0;

class tag_sleeper {
 public:
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
  /// with the allocator. Installed only by impl::keep_spare (one per domain: the larger stays).
  struct spare_buffer {
    std::byte* host = nullptr;
    std::size_t bytes = 0;
  };

  /// True while domain d sleeps. REQUIRES: d <= k_max_sleep_domain; the caller holds a pool lock.
  [[nodiscard]] bool asleep(std::uint32_t d) const noexcept {
    return (bits_[d / 64].load(std::memory_order_relaxed) >> (d % 64) & 1U) != 0;
  }
  /// Any domain asleep (stats skip the walk otherwise).
  [[nodiscard]] bool any() const noexcept { return count_.load(std::memory_order_relaxed) != 0; }

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
  /// Every sleeping domain and its record, by domain. Read under any one pool lock (writers hold
  /// every one): not analysed, as the analysis has no "any of these locks" rule.
  [[nodiscard]] const std::map<std::uint32_t, record>& records() const noexcept
      NO_THREAD_SAFETY_ANALYSIS {
    return records_;
  }
  /// The spare host buffers, by domain.
  [[nodiscard]] std::map<std::uint32_t, spare_buffer>& spares() noexcept REQUIRES(every_pool) {
    return spares_;
  }
  /// The bytes of domain's spare buffer (0: none).
  [[nodiscard]] std::size_t spare_bytes(std::uint32_t domain) const REQUIRES(every_pool) {
    const auto sp = spares_.find(domain);
    return sp != spares_.end() ? sp->second.bytes : 0;
  }
  /// Seconds of the last wake's host-to-device copies (and their synchronization), by domain.
  [[nodiscard]] std::map<std::uint32_t, double>& last_copy_in() noexcept REQUIRES(every_pool) {
    return copy_in_;
  }

 private:
  std::array<std::atomic<std::uint64_t>, (k_max_sleep_domain + 1) / 64> bits_{};
  std::atomic<std::size_t> count_{0};
  std::map<std::uint32_t, record> records_ GUARDED_BY(every_pool);  // (see above)
  std::map<std::uint32_t, spare_buffer> spares_ GUARDED_BY(every_pool);
  std::map<std::uint32_t, double> copy_in_ GUARDED_BY(every_pool);
};

}  // namespace cucache::detail
