// The lock of one stream_pool. The fast path of allocate/free takes it once, almost always
// uncontended (threads on different streams use different pools), so its cost is the cost of an
// uncontended lock and unlock: inlined, one atomic read-modify-write each. std::mutex adds two
// out-of-line calls into the C library.
//
// It also keeps the pool's held block (defer_coalescing:True): the block the pool's last free
// left unmerged, for the next allocation to take back without the merge and the split. Every
// lock but the two fast paths' (lock_keeping_held) merges it first, so that no other code --
// statistics, release, invariant checks, reserve, a pool handed on -- ever sees a held block:
// the deferral is visible to the allocation and free paths alone, which take it back or merge it
// before anything else (docs/decisions/0031-held-block-as-a-setting.md).
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <utility>

#include "backend/thread_annotations.hpp"

namespace cucache::detail {

struct block;
/// Merges a pool's held block into its free neighbours and the pool's free index, as the free
/// that held it would have (stream_pool::coalesce on the block's segment's pool), after the
/// free's page step for a range's block (pager::settle_pages). REQUIRES: that pool's lock held,
/// b its held block (already taken out of the lock). Out of line: the settling locks are not the
/// fast paths'.
void settle_held_block(block* b) noexcept;

/// A futex mutex: 0 free, 1 held, 2 held and a waiter may sleep. Under contention it spins
/// briefly -- critical sections are usually short -- and then sleeps in the kernel, because a
/// holder may be inside a slow device call (cudaMalloc, the out-of-memory ladder's
/// synchronizations) for milliseconds. Meets Lockable; a capability for clang's thread-safety
/// analysis, held through pool_lock (or lock_guard) so that the analysis sees it.
///
/// Unlock is an atomic exchange, so a sleeper that announced itself (2) is always woken. An
/// unlock without one (a plain store with an asymmetric membarrier fence, wake-ups still exact)
/// was measured on the H200's host: no gain on a cache-hit pair within the spread, contention on
/// one stream 13-18% slower (docs/decisions/0024-pool-lock-keeps-its-exchange.md).
class CAPABILITY("mutex") pool_mutex {
 public:
  /// Locks, and merges the held block if there is one.
  void lock() noexcept ACQUIRE() {
    lock_keeping_held();
    settle();
  }
  /// Locks if free (never waits), and then merges the held block if there is one.
  bool try_lock() noexcept TRY_ACQUIRE(true) {
    std::uint32_t expected = 0;
    if (!state_.compare_exchange_strong(expected, 1, std::memory_order_acquire,
                                        std::memory_order_relaxed)) {
      return false;
    }
    settle();
    return true;
  }
  /// lock_keeping_held() or lock(), as `keeping_held` says (one spelling for a caller that
  /// serves both).
  void lock(bool keeping_held) noexcept ACQUIRE() {
    lock_keeping_held();
    if (!keeping_held) settle();
  }
  /// The allocation and free fast paths' lock: the held block stays held. The caller takes it
  /// back (take_held) or merges it (settle_held) before any other step on the pool.
  void lock_keeping_held() noexcept ACQUIRE() {
    std::uint32_t expected = 0;
    if (state_.compare_exchange_strong(expected, 1, std::memory_order_acquire,
                                       std::memory_order_relaxed)) [[likely]] {
      return;
    }
    lock_contended();
  }
  void unlock() noexcept RELEASE() {
    if (state_.exchange(0, std::memory_order_release) == 2) [[unlikely]] {
      futex(FUTEX_WAKE_PRIVATE, 1, nullptr);
    }
  }

  /// Tells the analysis that the caller holds this lock where it cannot see it (a pool found
  /// through a lookup that locked it, a walk under pool_table::all_locked). Checks nothing.
  void assert_held() const noexcept ASSERT_CAPABILITY(this) {}

  // --- the held block (defer_coalescing), read and changed under this lock -------------------
  /// The pool's held block, or nullptr: free (block_state::free), in neither the free index nor
  /// the block map, its free neighbours not merged with it, its previous block not free.
  [[nodiscard]] block* held() const noexcept REQUIRES(this) { return held_; }
  /// Holds b (set up as held() describes). REQUIRES: nothing held.
  void hold(block* b) noexcept REQUIRES(this) { held_ = b; }
  /// The held block, no longer held (the allocation that takes it back).
  block* take_held() noexcept REQUIRES(this) { return std::exchange(held_, nullptr); }
  /// Merges the held block, if any.
  void settle_held() noexcept REQUIRES(this) { settle(); }

 private:
  void settle() noexcept {
    if (held_ != nullptr) [[unlikely]]
      settle_held_block(std::exchange(held_, nullptr));
  }
  void lock_contended() noexcept {
    for (int i = 0; i < k_spins; ++i) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      std::uint32_t expected = 0;
      if (state_.load(std::memory_order_relaxed) == 0 &&
          state_.compare_exchange_weak(expected, 1, std::memory_order_acquire,
                                       std::memory_order_relaxed)) {
        return;
      }
    }
    // Announce a sleeper: whoever holds the lock now (or takes it through this exchange, which
    // then keeps state 2 -- at worst one needless wake-up) wakes one sleeper on unlock.
    while (state_.exchange(2, std::memory_order_acquire) != 0) {
      futex(FUTEX_WAIT_PRIVATE, 2, nullptr);  // returns at once if the state is no longer 2
    }
  }
  void futex(int op, std::uint32_t value, const timespec* timeout) noexcept {
    static_assert(sizeof(state_) == sizeof(std::uint32_t));
    syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(&state_), op, value, timeout, nullptr, 0);
  }

  static constexpr int k_spins = 128;
  std::atomic<std::uint32_t> state_{0};
  block* held_ = nullptr;  // under this lock (see held())
};

/// The scoped lock of a pool (an annotated std::unique_lock).
using pool_lock = unique_lock<pool_mutex>;

/// The capability "every pool of the table locked", held while a pool_table::all_locked lives:
/// no state, a name for the analysis. One for every table: the analysis cannot tell two
/// allocators' tables apart, and no code holds two tables' locks at once.
class CAPABILITY("every pool lock") every_pool_lock {};
inline every_pool_lock every_pool;

}  // namespace cucache::detail
