// Statistics under concurrent readers (issue 30; docs/design.md, "Statistics under concurrent
// readers"): 8 threads allocate and free on 4 streams -- now and then one of them empties the
// cache (lock_all) or runs the device out of memory (the out-of-memory report takes the exact
// statistics under every pool lock) -- while 2 threads read stats() (one also takes snapshots,
// whose statistics are taken under every pool lock). Every read must satisfy every relation of
// the field table (violated_stats_relation), a writer's own read must count at least the blocks
// it holds (every allocation that returned before the read began), and once every free has
// returned, reads taken while the readers still run are exact: nothing allocated, nothing
// active. In both modes, on the simulated device.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "allocator/stats_ledger.hpp"
#include "cucache/errors.hpp"
#include "cucache/stats.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

/// The first violation any thread saw, and how many reads violated something.
class violations {
 public:
  void check(const device_stats& s, bool expandable, const char* who) {
    std::string why = violated_stats_relation(s, expandable);
    if (why.empty()) return;
    note(std::string(who) + ": " + why);
  }
  void note(std::string why) {
    count_.fetch_add(1, std::memory_order_relaxed);
    std::lock_guard lock(mu_);
    if (first_.empty()) first_ = std::move(why);
  }
  [[nodiscard]] std::size_t count() const { return count_.load(); }
  [[nodiscard]] std::string first() const {
    std::lock_guard lock(mu_);
    return first_;
  }

 private:
  std::atomic<std::size_t> count_{0};
  mutable std::mutex mu_;
  std::string first_;
};

class StatsConcurrency : public ::testing::TestWithParam<const char*> {};

TEST_P(StatsConcurrency, EveryReadIsConsistentAndQuiescentReadsAreExact) {
  sim_options o;
  o.capacity_bytes = 2 * GiB;  // tight enough for the ladder and, now and then, out of memory
  sim_allocator a(parse_config(GetParam()), o);
  const bool expandable = a.alloc.get_config().expandable_segments;
  constexpr int k_writers = 8;
  const std::size_t ops = scaled_ops(12000, 1500);
  std::vector<stream_handle> streams;
  for (int i = 0; i < 4; ++i) streams.push_back(a.sim->create_stream());

  violations bad;
  std::atomic<bool> stop{false};
  std::atomic<std::size_t> reads{0};
  std::vector<std::thread> readers;
  for (int r = 0; r < 2; ++r) {
    readers.emplace_back([&, r] {
      for (std::size_t i = 0; !stop.load(std::memory_order_relaxed); ++i) {
        if (r == 1 && i % 64 == 63) {
          bad.check(a.alloc.take_snapshot().stats, expandable, "snapshot");
        } else {
          bad.check(a.alloc.stats(), expandable, "reader");
        }
        reads.fetch_add(1, std::memory_order_relaxed);
      }
    });
  }

  std::vector<std::thread> writers;
  for (int t = 0; t < k_writers; ++t) {
    writers.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) * 7919 + 1);
      const stream_handle s = streams[static_cast<std::size_t>(t) % streams.size()];
      struct held {
        void* ptr;
        std::size_t bytes;
      };
      std::vector<held> live;
      std::size_t live_bytes = 0;
      for (std::size_t i = 0; i < ops; ++i) {
        if (t == 0 && i % 2000 == 1999) a.alloc.empty_cache();
        if (i % 128 == 0) {
          // Every block this thread holds was allocated before this read began.
          const device_stats st = a.alloc.stats();
          bad.check(st, expandable, "writer");
          if (st.allocation_count[0].current < static_cast<std::int64_t>(live.size()) ||
              st.requested_bytes[0].current < static_cast<std::int64_t>(live_bytes)) {
            bad.note("writer: a read counts " + std::to_string(st.allocation_count[0].current) +
                     " blocks / " + std::to_string(st.requested_bytes[0].current) +
                     " requested bytes; this thread alone holds " + std::to_string(live.size()) +
                     " / " + std::to_string(live_bytes));
          }
        }
        if (live.size() < 24 && (live.empty() || rng() % 2 == 0)) {
          // Small-pool and large-pool sizes; now and then one far too large for the device.
          std::size_t bytes = rng() % 3 == 0 ? 1 + rng() % (32 * MiB) : 1 + rng() % MiB;
          if (rng() % 997 == 0) bytes = 4 * GiB;
          try {
            live.push_back({a.alloc.allocate(bytes, s), bytes});
            live_bytes += bytes;
          } catch (const out_of_memory&) {
          }
        } else {
          const std::size_t j = rng() % live.size();
          a.alloc.deallocate(live[j].ptr, s);
          live_bytes -= live[j].bytes;
          live[j] = live.back();
          live.pop_back();
        }
      }
      for (const held& h : live) a.alloc.deallocate(h.ptr, s);
    });
  }
  for (auto& w : writers) w.join();

  // Every free has returned; the readers still run. Every read from here is exact.
  for (int i = 0; i < 200; ++i) {
    const device_stats s = a.stats();
    bad.check(s, expandable, "quiescent");
    if (s.allocation_count[0].current != 0 || s.allocated_bytes[0].current != 0 ||
        s.requested_bytes[0].current != 0 || s.active_bytes[0].current != 0 ||
        s.active_count[0].current != 0) {
      bad.note("quiescent: a read after every free returned counts " +
               std::to_string(s.allocation_count[0].current) + " allocations of " +
               std::to_string(s.allocated_bytes[0].current) + " bytes, " +
               std::to_string(s.active_count[0].current) + " active blocks of " +
               std::to_string(s.active_bytes[0].current) + " bytes");
    }
  }
  stop = true;
  for (auto& r : readers) r.join();

  EXPECT_EQ(bad.count(), 0u) << "first: " << bad.first();
  EXPECT_GT(reads.load(), 0u);
  a.alloc.check_invariants();
  // At rest the validated read and the read under every pool lock agree field by field.
  const device_stats optimistic = a.stats();
  const device_stats exact = a.alloc.take_snapshot().stats;
  EXPECT_TRUE(detail::same_fields(optimistic, exact));
  EXPECT_EQ(optimistic.largest_free_block, exact.largest_free_block);
  EXPECT_EQ(optimistic.allocation_count[0].current, 0);
  expect_no_leak(a);
}

INSTANTIATE_TEST_SUITE_P(Modes, StatsConcurrency,
                         ::testing::Values("", "expandable_segments:True"),
                         [](const auto& param_info) {
                           return std::string(param_info.param[0] == '\0' ? "default" : "expandable");
                         });

}  // namespace
}  // namespace cucache::test
