// The lock of one stream_pool. The fast path of allocate/free takes it once, almost always
// uncontended (threads on different streams use different pools), so its cost is the cost of an
// uncontended lock and unlock: inlined, one atomic read-modify-write each. std::mutex adds two
// out-of-line calls into the C library.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

#include "backend/thread_annotations.hpp"

namespace cucache::detail {

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
  void lock() noexcept ACQUIRE() {
    std::uint32_t expected = 0;
    if (state_.compare_exchange_strong(expected, 1, std::memory_order_acquire,
                                       std::memory_order_relaxed)) [[likely]] {
      return;
    }
    lock_contended();
  }
  bool try_lock() noexcept TRY_ACQUIRE(true) {
    std::uint32_t expected = 0;
    return state_.compare_exchange_strong(expected, 1, std::memory_order_acquire,
                                          std::memory_order_relaxed);
  }
  void unlock() noexcept RELEASE() {
    if (state_.exchange(0, std::memory_order_release) == 2) [[unlikely]] {
      futex(FUTEX_WAKE_PRIVATE, 1, nullptr);
    }
  }

  /// Tells the analysis that the caller holds this lock where it cannot see it (a pool found
  /// through a lookup that locked it, a walk under pool_table::all_locked). Checks nothing.
  void assert_held() const noexcept ASSERT_CAPABILITY(this) {}

 private:
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
};

/// The scoped lock of a pool (an annotated std::unique_lock).
using pool_lock = unique_lock<pool_mutex>;

/// The capability "every pool of the table locked", held while a pool_table::all_locked lives:
/// no state, a name for the analysis. One for every table: the analysis cannot tell two
/// allocators' tables apart, and no code holds two tables' locks at once.
class CAPABILITY("every pool lock") every_pool_lock {};
inline every_pool_lock every_pool;

}  // namespace cucache::detail
