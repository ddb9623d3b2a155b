// pool_mutex: mutual exclusion under contention, no lost wake-ups when a holder sleeps, and
// waiters that sleep instead of spinning while the lock is held for long.
#include "allocator/pool_mutex.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <ctime>
#include <mutex>
#include <thread>
#include <vector>

using cucache::detail::pool_mutex;

TEST(PoolMutex, ExcludesUnderContention) {
  pool_mutex mu;
  std::int64_t counter = 0;  // plain: a data race here would lose increments
  constexpr int k_threads = 8;
  constexpr int k_iters = 200000;
  std::vector<std::thread> threads;
  for (int t = 0; t < k_threads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < k_iters; ++i) {
        std::lock_guard lk(mu);
        ++counter;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(counter, std::int64_t{k_threads} * k_iters);
}

TEST(PoolMutex, TryLockFailsWhileHeld) {
  pool_mutex mu;
  std::unique_lock lk(mu);
  std::thread([&] { EXPECT_FALSE(mu.try_lock()); }).join();
  lk.unlock();
  EXPECT_TRUE(mu.try_lock());
  mu.unlock();
}

TEST(PoolMutex, WaitersSleepWhileTheHolderIsSlowAndAllWake) {
  pool_mutex mu;
  mu.lock();
  std::vector<std::thread> waiters;
  std::vector<double> cpu_ms(4, 0.0);
  int entered = 0;
  for (int t = 0; t < 4; ++t) {
    waiters.emplace_back([&, t] {
      timespec a{}, b{};
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
      mu.lock();
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
      ++entered;
      mu.unlock();
      cpu_ms[t] = static_cast<double>(b.tv_sec - a.tv_sec) * 1e3 +
                  static_cast<double>(b.tv_nsec - a.tv_nsec) / 1e6;
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // a slow device call
  mu.unlock();
  for (auto& t : waiters) t.join();
  EXPECT_EQ(entered, 4);
  // A spinning waiter would burn ~300 ms of CPU; a sleeping one a few.
  for (double ms : cpu_ms) EXPECT_LT(ms, 100.0);
}
