// The device budget on its own: charges and refunds with a fake device call, the memory limit
// (fixed, lowered under what is reserved), the peak, the garbage-collection threshold, the
// budget's invariant check, and threads charging against a limit that none may pass.
#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "allocator/device_budget.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

using detail::device_budget;

/// A fake device: hands out numbered handles, or refuses when told to; counts its calls.
struct fake_device {
  int next = 1;
  int calls = 0;
  bool refuse = false;
  std::optional<int> create() {
    ++calls;
    if (refuse) return std::nullopt;
    return next++;
  }
};

std::uint64_t changes(const device_budget& b) {
  detail::lock_guard lock(b.mu);
  return b.changes_locked();
}

std::string violation(const device_budget& b, std::size_t counted) {
  try {
    b.check_invariants(counted);
  } catch (const std::logic_error& e) {
    return e.what();
  }
  return {};
}

TEST(DeviceBudget, ChargeCreatesThenCountsReservedPeakAndCalls) {
  device_budget b(GiB, 0, 0);
  fake_device dev;
  const std::optional<int> h = b.charge(2 * MiB, [&] { return dev.create(); });
  ASSERT_TRUE(h.has_value());
  EXPECT_EQ(*h, 1);
  EXPECT_EQ(dev.calls, 1);
  EXPECT_EQ(b.reserved_bytes(), 2 * MiB);
  EXPECT_EQ(b.peak_bytes(), 2 * MiB);
  EXPECT_EQ(b.device_allocs.load(), 1u);
  EXPECT_EQ(changes(b), 1u);
  EXPECT_EQ(violation(b, 2 * MiB), "");
}

TEST(DeviceBudget, ARefusedDeviceCallChargesNothing) {
  device_budget b(GiB, 0, 0);
  fake_device dev;
  dev.refuse = true;
  EXPECT_FALSE(b.charge(2 * MiB, [&] { return dev.create(); }).has_value());
  EXPECT_EQ(dev.calls, 1);
  EXPECT_EQ(b.reserved_bytes(), 0u);
  EXPECT_EQ(b.peak_bytes(), 0u);
  EXPECT_EQ(b.device_allocs.load(), 0u);
  EXPECT_EQ(changes(b), 0u);
}

TEST(DeviceBudget, TheLimitRefusesBeforeTheDeviceIsAsked) {
  device_budget b(GiB, 10 * MiB, 0);
  fake_device dev;
  EXPECT_TRUE(b.charge(6 * MiB, [&] { return dev.create(); }).has_value());
  EXPECT_TRUE(b.over_limit(4 * MiB + 1));
  EXPECT_FALSE(b.over_limit(4 * MiB));
  EXPECT_FALSE(b.charge(5 * MiB, [&] { return dev.create(); }).has_value());
  EXPECT_EQ(dev.calls, 1);  // not asked
  EXPECT_TRUE(b.charge(4 * MiB, [&] { return dev.create(); }).has_value());
  EXPECT_EQ(b.reserved_bytes(), 10 * MiB);
  {
    detail::lock_guard lock(b.mu);
    EXPECT_EQ(b.room_under_limit_locked(), 0u);
  }
  EXPECT_FALSE(b.charge(1, [&] { return dev.create(); }).has_value());
  EXPECT_EQ(dev.calls, 2);
  EXPECT_EQ(b.device_allocs.load(), 2u);
  EXPECT_EQ(violation(b, 10 * MiB), "");
}

TEST(DeviceBudget, RoomUnderNoLimitIsUnbounded) {
  device_budget b(GiB, 0, 0);
  fake_device dev;
  (void)b.charge(3 * MiB, [&] { return dev.create(); });
  detail::lock_guard lock(b.mu);
  EXPECT_EQ(b.room_under_limit_locked(), ~std::size_t{0});
  EXPECT_FALSE(b.over_limit_locked(100 * GiB));
}

TEST(DeviceBudget, NeverFitsPastTheDeviceOrTheLimit) {
  device_budget none(8 * GiB, 0, 0);
  EXPECT_FALSE(none.never_fits(8 * GiB));
  EXPECT_TRUE(none.never_fits(8 * GiB + 1));
  device_budget capped(8 * GiB, GiB, 0);
  EXPECT_FALSE(capped.never_fits(GiB));
  EXPECT_TRUE(capped.never_fits(GiB + 1));
}

TEST(DeviceBudget, RefundLowersReservedAndKeepsThePeak) {
  device_budget b(GiB, 0, 0);
  fake_device dev;
  (void)b.charge(6 * MiB, [&] { return dev.create(); });
  (void)b.charge(2 * MiB, [&] { return dev.create(); });
  int released = 0;
  b.refund(6 * MiB, [&] { ++released; });
  EXPECT_EQ(released, 1);
  EXPECT_EQ(b.reserved_bytes(), 2 * MiB);
  EXPECT_EQ(b.peak_bytes(), 8 * MiB);
  EXPECT_EQ(b.device_frees.load(), 1u);
  EXPECT_EQ(changes(b), 3u);
  b.reset_peak();
  EXPECT_EQ(b.peak_bytes(), 2 * MiB);
  EXPECT_EQ(changes(b), 4u);
  EXPECT_EQ(violation(b, 2 * MiB), "");
}

TEST(DeviceBudget, AFailedReleaseRefundsNothing) {
  device_budget b(GiB, 0, 0);
  fake_device dev;
  (void)b.charge(4 * MiB, [&] { return dev.create(); });
  EXPECT_THROW(b.refund(4 * MiB, [] { throw std::runtime_error("device says no"); }),
               std::runtime_error);
  EXPECT_EQ(b.reserved_bytes(), 4 * MiB);
  EXPECT_EQ(b.device_frees.load(), 0u);
  EXPECT_EQ(changes(b), 1u);
  // The pager's step: released under the mutex, then refunded there.
  {
    detail::lock_guard lock(b.mu);
    b.refund_locked(4 * MiB);
  }
  EXPECT_EQ(b.reserved_bytes(), 0u);
  EXPECT_EQ(b.device_frees.load(), 1u);
}

TEST(DeviceBudget, GarbageCollectionThresholdAndCaps) {
  device_budget b(GiB, 0, 0);
  fake_device dev;
  (void)b.charge(40 * MiB, [&] { return dev.create(); });
  EXPECT_FALSE(b.over_gc(GiB));  // off
  EXPECT_FALSE(b.over_caps(GiB));
  b.gc_bytes.store(50 * MiB);
  EXPECT_FALSE(b.over_gc(10 * MiB));
  EXPECT_TRUE(b.over_gc(10 * MiB + 1));
  EXPECT_FALSE(b.over_caps(10 * MiB));
  EXPECT_TRUE(b.over_caps(10 * MiB + 1));
  // The threshold refuses nothing: a charge past it succeeds.
  EXPECT_TRUE(b.charge(20 * MiB, [&] { return dev.create(); }).has_value());
  b.gc_bytes.store(0);
  b.set_limit(64 * MiB);
  EXPECT_FALSE(b.over_caps(4 * MiB));
  EXPECT_TRUE(b.over_caps(4 * MiB + 1));
}

TEST(DeviceBudget, RoomForAnswersTheCapsThenTheEstimateInOneLook) {
  using room = device_budget::room;
  device_budget b(GiB, 0, 0);
  fake_device dev;
  (void)b.charge(40 * MiB, [&] { return dev.create(); });
  EXPECT_EQ(b.room_for(MiB, 0), room::unknown);  // the device was never read
  b.note_device_free(100 * MiB);                 // read with 40 MiB reserved
  EXPECT_EQ(b.room_for(90 * MiB, 10 * MiB), room::fits);
  EXPECT_EQ(b.room_for(90 * MiB, 10 * MiB + 1), room::unknown);  // too little to spare
  EXPECT_EQ(b.room_for(100 * MiB + 1, 0), room::unknown);
  // The allocator's own creations and releases since the read move the estimate exactly.
  (void)b.charge(30 * MiB, [&] { return dev.create(); });
  EXPECT_EQ(b.room_for(70 * MiB, 0), room::fits);
  EXPECT_EQ(b.room_for(70 * MiB + 1, 0), room::unknown);
  b.refund(20 * MiB, [] {});
  EXPECT_EQ(b.room_for(90 * MiB, 0), room::fits);
  EXPECT_EQ(b.room_for(90 * MiB + 1, 0), room::unknown);
  // The caps come first, whatever the device has.
  b.gc_bytes.store(60 * MiB);
  EXPECT_EQ(b.room_for(10 * MiB, 0), room::fits);
  EXPECT_EQ(b.room_for(10 * MiB + 1, 0), room::over_caps);
  b.gc_bytes.store(0);
  b.set_limit(64 * MiB);
  EXPECT_EQ(b.room_for(14 * MiB, 0), room::fits);
  EXPECT_EQ(b.room_for(14 * MiB + 1, 0), room::over_caps);
  EXPECT_TRUE(b.over_caps(14 * MiB + 1));
  // A creation the device refused forgets the estimate.
  b.forget_device_free();
  EXPECT_EQ(b.room_for(MiB, 0), room::unknown);
}

TEST(DeviceBudget, ALimitLoweredUnderReservedIsAllowedUntilSetAgain) {
  device_budget b(GiB, 0, 0);
  fake_device dev;
  (void)b.charge(8 * MiB, [&] { return dev.create(); });
  const std::uint64_t before = changes(b);
  b.set_limit(4 * MiB);
  EXPECT_EQ(changes(b), before + 1);
  {
    detail::lock_guard lock(b.mu);
    EXPECT_EQ(b.allowed_above_limit(), 8 * MiB);
  }
  EXPECT_EQ(violation(b, 8 * MiB), "");
  EXPECT_FALSE(b.charge(1, [&] { return dev.create(); }).has_value());
  b.refund(6 * MiB, [] {});
  EXPECT_TRUE(b.charge(2 * MiB, [&] { return dev.create(); }).has_value());
  EXPECT_EQ(b.reserved_bytes(), 4 * MiB);
  b.set_limit(2 * MiB);  // under reserved again: 4 MiB allowed from now on
  {
    detail::lock_guard lock(b.mu);
    EXPECT_EQ(b.allowed_above_limit(), 4 * MiB);
  }
  b.set_limit(0);
  {
    detail::lock_guard lock(b.mu);
    EXPECT_EQ(b.allowed_above_limit(), 0u);
  }
  EXPECT_EQ(violation(b, 4 * MiB), "");
}

TEST(DeviceBudget, TheInvariantCheckNamesAMiscount) {
  device_budget b(GiB, 0, 0);
  fake_device dev;
  (void)b.charge(2 * MiB, [&] { return dev.create(); });
  EXPECT_EQ(violation(b, 2 * MiB), "");
  EXPECT_EQ(violation(b, 4 * MiB),
            "cucache invariant violated: device reserved 2097152 != sum of segments 4194304");
}

TEST(DeviceBudget, ResetCountersZeroesTheCallCounts) {
  device_budget b(GiB, 0, 0);
  fake_device dev;
  (void)b.charge(2 * MiB, [&] { return dev.create(); });
  b.refund(2 * MiB, [] {});
  b.oom_count.fetch_add(3);
  b.retry_count.fetch_add(2);
  b.reset_counters();
  EXPECT_EQ(b.device_allocs.load(), 0u);
  EXPECT_EQ(b.device_frees.load(), 0u);
  EXPECT_EQ(b.oom_count.load(), 0u);
  EXPECT_EQ(b.retry_count.load(), 0u);
  EXPECT_EQ(b.peak_bytes(), 2 * MiB);  // the peak is not a counter
}

// Threads charge one unit at a time against a limit of 64 units: exactly 64 charges succeed
// whatever the interleaving, and the device is never asked for a unit past the limit.
TEST(DeviceBudget, ThreadsNeverChargePastTheLimit) {
  constexpr std::size_t unit = 2 * MiB;
  constexpr int threads = 8;
  constexpr int attempts = 100;
  device_budget b(GiB, 64 * unit, 0);
  std::atomic<std::size_t> held{0};  // what the fake device handed out
  std::atomic<std::size_t> most{0};
  std::atomic<int> device_calls{0};
  std::atomic<int> granted{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&] {
      for (int i = 0; i < attempts; ++i) {
        const std::optional<int> h = b.charge(unit, [&]() -> std::optional<int> {
          device_calls.fetch_add(1);
          const std::size_t now = held.fetch_add(unit) + unit;
          std::size_t m = most.load();
          while (now > m && !most.compare_exchange_weak(m, now)) {
          }
          return 1;
        });
        if (h) granted.fetch_add(1);
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(granted.load(), 64);
  EXPECT_EQ(device_calls.load(), 64);
  EXPECT_EQ(most.load(), 64 * unit);
  EXPECT_EQ(b.reserved_bytes(), 64 * unit);
  EXPECT_EQ(b.peak_bytes(), 64 * unit);
  EXPECT_EQ(b.device_allocs.load(), 64u);
  EXPECT_EQ(violation(b, 64 * unit), "");
}

// Threads charge and refund in turn against a limit of 16 units: what the device holds never
// passes the limit, and everything charged is refunded at the end.
TEST(DeviceBudget, ThreadsChargingAndRefundingStayUnderTheLimit) {
  constexpr std::size_t unit = 2 * MiB;
  constexpr int threads = 8;
  constexpr int rounds = 500;
  device_budget b(GiB, 16 * unit, 0);
  std::atomic<std::size_t> held{0};
  std::atomic<bool> passed{false};
  std::atomic<std::uint64_t> granted{0};
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&] {
      int mine = 0;
      for (int i = 0; i < rounds; ++i) {
        if (mine < 3 && b.charge(unit, [&]() -> std::optional<int> {
              if (held.fetch_add(unit) + unit > 16 * unit) passed.store(true);
              return 1;
            })) {
          ++mine;
          granted.fetch_add(1);
        } else if (mine > 0) {
          b.refund(unit, [&] { held.fetch_sub(unit); });
          --mine;
        }
      }
      while (mine-- > 0) b.refund(unit, [&] { held.fetch_sub(unit); });
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_FALSE(passed.load());
  EXPECT_EQ(held.load(), 0u);
  EXPECT_EQ(b.reserved_bytes(), 0u);
  EXPECT_LE(b.peak_bytes(), 16 * unit);
  EXPECT_EQ(b.device_allocs.load(), granted.load());
  EXPECT_EQ(b.device_frees.load(), granted.load());
  EXPECT_EQ(violation(b, 0), "");
}

}  // namespace
}  // namespace cucache::test
