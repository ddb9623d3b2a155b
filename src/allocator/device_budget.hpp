// device_budget: the device-wide reservation -- the bytes cucache holds from the device (segments,
// or physical handles in expandable mode), their high-water mark, the caps on them (the memory
// limit, the garbage-collection threshold, the device's capacity) and the counters of device
// calls, out-of-memory errors and ladder retries. One per allocator, shared by its segment path
// and the pager, the two that create and release device memory.
//
// Locking: `mu` guards reserved and peak, and is held across the device call that changes them,
// so that the check against the limit and the charge are one step (and the pager's list of
// unmapped handles, whose bytes count in reserved), and a count of their changes (changes_locked).
// The counters are relaxed atomics; the memory limit is an atomic written under `mu`
// (set_limit), the other caps are fixed at construction.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>

#include "backend/thread_annotations.hpp"

namespace cucache::detail {

class device_budget {
 public:
  device_budget(std::size_t total_bytes, std::size_t limit_bytes,
                std::size_t gc_threshold_bytes) noexcept
      : device_total(total_bytes), limit(limit_bytes), gc_bytes(gc_threshold_bytes) {}
  device_budget(const device_budget&) = delete;
  device_budget& operator=(const device_budget&) = delete;

  const std::size_t device_total;  // the device's capacity
  /// Cap on reserved bytes; 0 = none. Written under `mu` (set_limit), read anywhere.
  std::atomic<std::size_t> limit;
  /// Garbage-collection threshold on reserved bytes; 0 = off. Changed at run time by
  /// device_allocator::set_size_rules (PyTorch's garbage_collection_threshold), read anywhere.
  std::atomic<std::size_t> gc_bytes;

  /// Changes the cap (0 = none): no growth passes it from now on. Memory reserved above a lowered
  /// cap is not given back here (the caller releases cached memory first if it wants to):
  /// reserved then stays at most what it was, and only falls until it is under the cap
  /// (allowed_above_limit() bounds it for the invariant check).
  void set_limit(std::size_t bytes) {
    detail::lock_guard lock(mu);
    limit.store(bytes, std::memory_order_relaxed);
    above_limit_ = bytes != 0 && reserved > bytes ? reserved : 0;
    ++changes_;  // a statistics read that saw the old cap is retried
  }
  /// The most reserved may be while above the cap (0 when it was never lowered under reserved).
  [[nodiscard]] std::size_t allowed_above_limit() const noexcept REQUIRES(mu) {
    return above_limit_;
  }

  /// A request of `bytes` can never be served: more than the device or the limit.
  [[nodiscard]] bool never_fits(std::size_t bytes) const noexcept {
    return bytes > device_total || (limit != 0 && bytes > limit);
  }

  /// Would `bytes` more pass the memory limit? (False when there is none.)
  [[nodiscard]] bool over_limit(std::size_t bytes) const {
    detail::lock_guard lock(mu);
    return over_limit_locked(bytes);
  }
  [[nodiscard]] bool over_limit_locked(std::size_t bytes) const noexcept REQUIRES(mu) {
    const std::size_t cap = limit.load(std::memory_order_relaxed);
    return cap != 0 && reserved + bytes > cap;
  }
  /// Would `bytes` more pass the memory limit or the garbage-collection threshold?
  [[nodiscard]] bool over_caps(std::size_t bytes) const {
    return room_for(bytes, 0) == room::over_caps;
  }
  /// The bytes the memory limit still lets reserved grow by (SIZE_MAX when there is none).
  [[nodiscard]] std::size_t room_under_limit_locked() const noexcept REQUIRES(mu) {
    const std::size_t cap = limit.load(std::memory_order_relaxed);
    if (cap == 0) return ~std::size_t{0};
    return cap > reserved ? cap - reserved : 0;
  }

  /// Creates `bytes` of device memory with create() (which returns something testable, empty
  /// when the device refuses) and charges it, unless it would pass the limit: then create is not
  /// called and an empty result is returned. The check, the device call and the charge are one
  /// step under `mu`.
  template <class F>
  auto charge(std::size_t bytes, F&& create) -> decltype(create()) {
    decltype(create()) made{};
    {
      detail::lock_guard lock(mu);
      if (over_limit_locked(bytes)) return made;
      made = create();
      if (!made) return made;
      reserved += bytes;
      peak = std::max(peak, reserved);
      ++changes_;
    }
    device_allocs.fetch_add(1, std::memory_order_relaxed);
    return made;
  }
  /// Gives `bytes` back with release(), which may throw: then nothing is refunded.
  template <class F>
  void refund(std::size_t bytes, F&& release) {
    detail::lock_guard lock(mu);
    release();
    refund_locked(bytes);
  }
  /// Refunds `bytes` whose device memory the caller released under `mu` (the pager, whose
  /// handle list is under `mu` too, and which keeps a handle it failed to release).
  void refund_locked(std::size_t bytes) noexcept REQUIRES(mu) {
    reserved -= bytes;
    ++changes_;
    device_frees.fetch_add(1, std::memory_order_relaxed);
  }

  [[nodiscard]] std::size_t reserved_bytes() const {
    detail::lock_guard lock(mu);
    return reserved;
  }
  [[nodiscard]] std::size_t peak_bytes() const {
    detail::lock_guard lock(mu);
    return peak;
  }
  /// reserved and peak for readers that hold `mu` (with the pager's handle list).
  [[nodiscard]] std::size_t reserved_bytes_locked() const noexcept REQUIRES(mu) { return reserved; }
  [[nodiscard]] std::size_t peak_bytes_locked() const noexcept REQUIRES(mu) { return peak; }
  /// Would `extra` more bytes pass the garbage-collection threshold? (False when it is off.)
  [[nodiscard]] bool over_gc(std::size_t extra) const {
    const std::size_t gc = gc_bytes.load(std::memory_order_relaxed);
    if (gc == 0) return false;
    detail::lock_guard lock(mu);
    return reserved + extra > gc;
  }
  void reset_peak() {
    detail::lock_guard lock(mu);
    peak = reserved;
    ++changes_;
  }
  /// What room_for finds for `bytes` more.
  enum class room {
    over_caps,  // the memory limit or the garbage-collection threshold refuses them
    fits,       // the device's estimated free bytes hold them with `spare` to spare
    unknown,    // no estimate, or too little to spare by it: the device must be asked
  };
  /// The pager's question before it creates `bytes` (pager::fits), answered under one lock: the
  /// caps (as over_caps), then the device's free bytes without asking the device -- the last
  /// read (note_device_free) less what was charged since, plus what was refunded. That estimate
  /// is exact while nothing outside this allocator allocates on the device; there is none before
  /// a read or after forget_device_free (a creation the device refused), and it is trusted only
  /// with `spare` bytes left beyond `bytes`.
  [[nodiscard]] room room_for(std::size_t bytes, std::size_t spare) const {
    const std::size_t gc = gc_bytes.load(std::memory_order_relaxed);
    detail::lock_guard lock(mu);
    if (over_limit_locked(bytes) || (gc != 0 && reserved + bytes > gc)) return room::over_caps;
    if (!free_known_) return room::unknown;
    const std::size_t base = free_at_read_ + reserved_at_read_;
    const std::size_t estimate = base > reserved ? base - reserved : 0;
    return estimate >= bytes && estimate - bytes >= spare ? room::fits : room::unknown;
  }
  /// Records a read of the device's free bytes (cudaMemGetInfo), against reserved now.
  void note_device_free(std::size_t free_bytes) {
    detail::lock_guard lock(mu);
    free_at_read_ = free_bytes;
    reserved_at_read_ = reserved;
    free_known_ = true;
  }
  void forget_device_free() {
    detail::lock_guard lock(mu);
    free_known_ = false;
  }
  /// Counts the changes of what `mu` guards -- reserved, peak, the pager's unmapped handles --
  /// for the statistics' validated read (stats_ledger::read): equal counts read under `mu`
  /// mean nothing of it changed between the two reads. Bumped on the paths that change them,
  /// all slow paths under `mu` (a device call, a handle list change), never on a cache hit.
  [[nodiscard]] std::uint64_t changes_locked() const noexcept REQUIRES(mu) { return changes_; }
  void note_change_locked() noexcept REQUIRES(mu) { ++changes_; }
  /// The budget's own invariants, given `counted`, the bytes the caller found reserved (segments
  /// and the pager's mapped and unmapped handles): reserved equals it; reserved is within the
  /// memory limit (or within what it was when the limit was lowered under it); peak >= reserved.
  /// Throws std::logic_error naming the first violation.
  void check_invariants(std::size_t counted) const;
  void reset_counters() noexcept {
    for (auto* c : {&device_allocs, &device_frees, &oom_count, &retry_count}) {
      c->store(0, std::memory_order_relaxed);
    }
  }

  /// Held across a device call that changes reserved (and by the pager around its handle list).
  mutable mutex mu;

  // Relaxed counters.
  std::atomic<std::uint64_t> device_allocs{0};  // cudaMalloc / cuMemCreate calls that succeeded
  std::atomic<std::uint64_t> device_frees{0};   // cudaFree / cuMemRelease calls that succeeded
  std::atomic<std::uint64_t> oom_count{0};      // out-of-memory errors thrown
  std::atomic<std::uint64_t> retry_count{0};    // out-of-memory ladders run

 private:
  std::size_t reserved GUARDED_BY(mu) = 0;
  std::size_t peak GUARDED_BY(mu) = 0;
  std::size_t above_limit_ GUARDED_BY(mu) = 0;  // reserved when the cap was lowered under it
  std::uint64_t changes_ GUARDED_BY(mu) = 0;    // (changes_locked)
  // room_for's estimate: the last read of the device's free bytes and reserved at that read.
  std::size_t free_at_read_ GUARDED_BY(mu) = 0;
  std::size_t reserved_at_read_ GUARDED_BY(mu) = 0;
  bool free_known_ GUARDED_BY(mu) = false;
};

}  // namespace cucache::detail
