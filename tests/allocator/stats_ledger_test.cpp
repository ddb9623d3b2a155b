// The statistics ledger (src/allocator/stats_ledger.hpp): device-wide totals kept as the sum of
// per-pool summaries, each taken again only when its pool was locked for a change. The ledger's
// arithmetic with exact expectations, and stats() over many pools after changes to a few, checked
// against what the pools hold. The invariant check (check_invariants) verifies after every
// operation of the randomized tests that the totals are the sum of the summaries and that a pool
// not marked stale holds the summary it would get now: a change that marks nothing fails there.
#include <gtest/gtest.h>

#include <vector>

#include "allocator/stats_ledger.hpp"
#include "allocator/stream_pool.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

using detail::pool_summary;
using detail::stats_ledger;

pool_summary summary(std::int64_t allocated, std::size_t free_blocks, std::size_t largest) {
  pool_summary s;
  s.part.allocated_bytes[0].current = allocated;
  s.part.allocated_bytes[0].peak = allocated;
  s.part.free_block_count = free_blocks;
  s.largest = largest;
  return s;
}

TEST(StatsLedger, ReplaceKeepsTheSumsAndTheLargestOfThePools) {
  stats_ledger l;
  std::lock_guard lock(l.mu);
  const pool_summary empty;
  const pool_summary a = summary(100, 2, 8 * MiB);
  const pool_summary b = summary(50, 1, 8 * MiB);
  l.replace(empty, a);
  l.replace(empty, b);
  EXPECT_EQ(l.totals.allocated_bytes[0].current, 150);
  EXPECT_EQ(l.totals.allocated_bytes[0].peak, 150);
  EXPECT_EQ(l.totals.free_block_count, 3u);
  EXPECT_EQ(l.largest_request(), 8 * MiB);
  // Pool a changes: its old share leaves, its new one comes in; the other 8 MiB pool remains.
  const pool_summary a2 = summary(30, 0, 2 * MiB);
  l.replace(a, a2);
  EXPECT_EQ(l.totals.allocated_bytes[0].current, 80);
  EXPECT_EQ(l.totals.free_block_count, 1u);
  EXPECT_EQ(l.largest_request(), 8 * MiB);
  l.replace(b, empty);
  EXPECT_EQ(l.largest_request(), 2 * MiB);
  EXPECT_EQ(l.totals.allocated_bytes[0].current, 30);
  l.replace(a2, empty);
  EXPECT_EQ(l.largest_request(), 0u);
  EXPECT_TRUE(detail::same_fields(l.totals, device_stats{}));
}

// A pool's part of the ledger: settle puts its new summary in the totals (its old share out) and
// clears its stale flag; only settle changes the summary.
TEST(StatsLedger, SettleReplacesThePoolsShareAndClearsStale) {
  stats_ledger l;
  detail::stream_pool p(nullptr, 1, 0);
  detail::stream_pool q(nullptr, 2, 1);
  detail::pool_ledger::stale_queue queue;
  {
    std::lock_guard lk(p.mu);
    queue.mark(p);
    EXPECT_TRUE(p.ledger.stale());
    p.ledger.settle(l, summary(100, 2, 8 * MiB));
    EXPECT_FALSE(p.ledger.stale());
    EXPECT_EQ(p.ledger.summary().part.allocated_bytes[0].current, 100);
  }
  {
    std::lock_guard lk(q.mu);
    q.ledger.settle(l, summary(40, 1, 2 * MiB));
  }
  {
    std::lock_guard lk(p.mu);
    p.ledger.settle(l, summary(10, 0, 0));
  }
  std::lock_guard lock(l.mu);
  EXPECT_EQ(l.totals.allocated_bytes[0].current, 50);
  EXPECT_EQ(l.totals.free_block_count, 1u);
  EXPECT_EQ(l.largest_request(), 2 * MiB);
}

// The stale queue: each marked pool once, newest first; every mark counted; mark_all reported
// once by the next take; a take empties the queue and the pools may be queued again.
TEST(StatsLedger, StaleQueueListsEachMarkedPoolOnceAndCountsEveryMark) {
  detail::stream_pool a(nullptr, 1, 0);
  detail::stream_pool b(nullptr, 2, 1);
  detail::pool_ledger::stale_queue queue;
  auto t0 = queue.take();
  EXPECT_TRUE(t0.pools.empty());
  EXPECT_FALSE(t0.all);
  EXPECT_EQ(t0.changes, 0u);
  EXPECT_FALSE(queue.changed_since(0));
  {
    std::lock_guard la(a.mu);
    queue.mark(a);
  }
  {
    std::lock_guard lb(b.mu);
    queue.mark(b);
  }
  {
    std::lock_guard la(a.mu);
    queue.mark(a);  // queued already: counted, not listed twice
  }
  EXPECT_TRUE(queue.changed_since(0));
  EXPECT_FALSE(queue.all_marked());
  auto t1 = queue.take();
  EXPECT_EQ(t1.pools, (std::vector<detail::stream_pool*>{&b, &a}));
  EXPECT_FALSE(t1.all);
  EXPECT_EQ(t1.changes, 3u);
  EXPECT_FALSE(queue.changed_since(3));
  queue.mark_all();
  EXPECT_TRUE(queue.all_marked());
  EXPECT_TRUE(queue.changed_since(3));
  {
    std::lock_guard la(a.mu);
    queue.mark(a);  // taken before: queued again
  }
  auto t2 = queue.take();
  EXPECT_EQ(t2.pools, (std::vector<detail::stream_pool*>{&a}));
  EXPECT_TRUE(t2.all);
  EXPECT_EQ(t2.changes, 5u);
  EXPECT_FALSE(queue.all_marked());
  EXPECT_TRUE(queue.take().pools.empty());
}

class StatsOverPools : public ::testing::TestWithParam<const char*> {};

// 500 streams hold blocks; stats() after changes to a few of them counts exactly what the pools
// hold, in both modes, through every path that changes a pool: an allocation, a free on the
// block's own stream and on none, the ladder-free empty_cache, a block freed while another
// stream's work is pending.
TEST_P(StatsOverPools, StatsAfterChangesToAFewOfManyPoolsAreExact) {
  sim_allocator a(parse_config(GetParam()));
  std::vector<stream_handle> streams;
  std::vector<void*> held;
  for (int i = 0; i < 500; ++i) {
    streams.push_back(a.sim->create_stream());
    held.push_back(a.alloc.allocate(64 * KiB, streams.back()));
  }
  device_stats s = a.stats();
  EXPECT_EQ(s.allocation_count[0].current, 500);
  EXPECT_EQ(s.allocated_bytes[0].current, static_cast<std::int64_t>(500 * 64 * KiB));
  a.alloc.check_invariants();
  void* big = a.alloc.allocate(48 * MiB, streams[7]);
  s = a.stats();
  EXPECT_EQ(s.allocation_count[0].current, 501);
  EXPECT_EQ(s.allocated_bytes[0].current,
            static_cast<std::int64_t>(500 * 64 * KiB + 48 * MiB));
  a.alloc.deallocate(big, streams[7]);
  a.alloc.deallocate(held[3]);  // a free that names no stream
  held[3] = nullptr;
  s = a.stats();
  EXPECT_EQ(s.allocation_count[0].current, 499);
  EXPECT_GE(s.largest_free_block, 48 * MiB);  // the freed block is cached on stream 7
  a.alloc.check_invariants();
  // A block used on another stream: pending until that stream's work completes.
  a.alloc.record_stream(held[9], streams[10]);
  a.alloc.deallocate(held[9], streams[9]);
  held[9] = nullptr;
  s = a.stats();
  EXPECT_EQ(s.allocation_count[0].current, 498);
  EXPECT_EQ(s.events_pending, 1u);
  a.sim->complete_all();
  a.alloc.empty_cache();  // polls pending frees and gives cached memory back, every pool
  s = a.stats();
  EXPECT_EQ(s.events_pending, 0u);
  EXPECT_EQ(s.allocation_count[0].current, 498);
  EXPECT_EQ(static_cast<std::size_t>(s.reserved_bytes[0].current), a.sim->used_bytes());
  a.alloc.check_invariants();
  for (std::size_t i = 0; i < held.size(); ++i) {
    if (held[i] != nullptr) a.alloc.deallocate(held[i], streams[i]);
  }
  a.alloc.empty_cache();
  s = a.stats();
  EXPECT_EQ(s.allocation_count[0].current, 0);
  EXPECT_EQ(s.reserved_bytes[0].current, 0);
  EXPECT_EQ(s.largest_free_block, 0u);
  a.alloc.check_invariants();
  for (stream_handle st : streams) a.sim->destroy_stream(st);
}

INSTANTIATE_TEST_SUITE_P(Modes, StatsOverPools, ::testing::Values("", "expandable_segments:True"));

}  // namespace
}  // namespace cucache::test
