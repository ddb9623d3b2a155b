// Pending frees at scale: 10,000 blocks freed while other streams still use them. Correctness --
// no pending block is handed out again before every one of its events completed, each is handed
// out once they all have, stats and invariants hold throughout -- and the bound on the work an
// allocation does: events on one stream complete in order, so an allocation queries at most one
// event per stream that still has pending frees (plus one per free it completes), never all of
// them.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <map>
#include <vector>

#include "allocator/pending_frees.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

constexpr int k_pending = 10'000;

/// Ranges of blocks that are freed but not yet reusable: nothing may be handed out inside them.
struct pending_ranges {
  std::map<std::uintptr_t, std::size_t> ranges;  // start -> bytes

  void expect_outside(const void* p, std::size_t bytes) const {
    const std::uintptr_t a = addr(p);
    auto it = ranges.upper_bound(a);
    if (it != ranges.begin()) {
      auto prev = std::prev(it);
      EXPECT_LE(prev->first + prev->second, a) << p << " lies in a pending block";
    }
    if (it != ranges.end()) {
      EXPECT_LE(a + bytes, it->first) << p << " overlaps a pending block";
    }
  }
};

struct freed_block {
  std::uintptr_t start;
  std::size_t bytes;
  int waits_on;  // bit i: stream side[i] used it
};

TEST(PendingFrees, TenThousandPendingFreesAreReleasedExactlyWhenTheirStreamsComplete) {
  for (const char* mode : {"", "expandable_segments:True"}) {
    SCOPED_TRACE(mode);
    sim_allocator a(parse_config(mode));
    const stream_handle own = stream(1);
    const stream_handle side[3] = {stream(2), stream(3), stream(4)};
    std::vector<freed_block> freed;
    pending_ranges pending;
    std::int64_t pending_bytes = 0;
    for (int i = 0; i < k_pending; ++i) {
      const std::size_t bytes = 512 * static_cast<std::size_t>(1 + (i * 37) % 64);
      void* p = a.alloc.allocate(bytes, own);
      // Every block is used on one or two side streams; the events interleave across streams.
      const int mask = i % 5 == 0 ? 0b011 : 1 << (i % 3);
      for (int s = 0; s < 3; ++s) {
        if ((mask & (1 << s)) != 0) a.alloc.record_stream(p, side[s]);
      }
      const std::size_t size = a.alloc.allocation_size(p);
      a.alloc.deallocate(p);
      freed.push_back({addr(p), size, mask});
      pending.ranges.emplace(addr(p), size);
      pending_bytes += static_cast<std::int64_t>(size);
    }
    auto s = a.stats();
    EXPECT_EQ(s.allocation_count[0].current, 0);
    EXPECT_EQ(s.active_count[0].current, k_pending);
    EXPECT_EQ(s.active_bytes[0].current, pending_bytes);
    a.alloc.check_invariants();

    // Completes the side streams one by one, not in the order their events were recorded. After
    // each, one allocation polls; a block is released exactly when all its streams completed.
    int done_mask = 0;
    for (int s_index : {2, 0, 1}) {
      a.sim->complete_stream(side[s_index]);
      done_mask |= 1 << s_index;
      void* q = a.alloc.allocate(512, own);
      std::int64_t still_bytes = 0;
      std::int64_t still_count = 0;
      std::uint64_t still_events = 0;  // one per stream a still-pending block waits on
      for (const freed_block& f : freed) {
        still_events += static_cast<std::uint64_t>(
            std::popcount(static_cast<unsigned>(f.waits_on & ~done_mask)));
        if ((f.waits_on & ~done_mask) != 0) {
          still_bytes += static_cast<std::int64_t>(f.bytes);
          ++still_count;
        } else {
          pending.ranges.erase(f.start);
        }
      }
      pending.expect_outside(q, 512);
      s = a.stats();
      EXPECT_EQ(s.active_count[0].current - s.allocation_count[0].current, still_count);
      EXPECT_EQ(s.active_bytes[0].current - s.allocated_bytes[0].current, still_bytes);
      EXPECT_EQ(s.events_pending, still_events);
      a.alloc.check_invariants();
      // Many allocations while blocks are still pending: none lands inside a pending block.
      std::vector<void*> live;
      for (int i = 0; i < 200; ++i) {
        void* r = a.alloc.allocate(512 * static_cast<std::size_t>(1 + i % 16), own);
        pending.expect_outside(r, a.alloc.allocation_size(r));
        live.push_back(r);
      }
      for (void* r : live) a.alloc.deallocate(r);
      a.alloc.deallocate(q);
      a.alloc.check_invariants();
    }
    s = a.stats();
    EXPECT_EQ(s.events_pending, 0u);
    EXPECT_EQ(s.active_bytes[0].current, 0);
    a.alloc.empty_cache();
    EXPECT_EQ(a.sim->used_bytes(), 0u);
    a.alloc.check_invariants();
  }
}

TEST(PendingFrees, AnAllocationBehindABusyStreamQueriesOneEventNotTenThousand) {
  sim_allocator a;
  const stream_handle own = stream(1);
  const stream_handle busy = stream(2);
  const stream_handle done = stream(3);
  for (int i = 0; i < k_pending; ++i) {
    void* p = a.alloc.allocate(4 * KiB, own);
    a.alloc.record_stream(p, i % 100 == 0 ? done : busy);
    a.alloc.deallocate(p);
  }
  ASSERT_EQ(a.stats().events_pending, static_cast<std::uint64_t>(k_pending));
  // The busy stream never completes (a long kernel); the other one has.
  a.sim->complete_stream(done);
  const std::uint64_t before = a.sim->calls(sim_call::event_query);
  void* first = a.alloc.allocate(4 * KiB, own);
  // First poll: the 100 completed events of `done`, and the oldest, incomplete event of `busy`.
  EXPECT_LE(a.sim->calls(sim_call::event_query) - before, 100u + 1u);
  EXPECT_EQ(a.stats().events_pending, static_cast<std::uint64_t>(k_pending - 100));
  const std::uint64_t after_first = a.sim->calls(sim_call::event_query);
  constexpr int k_allocs = 1000;
  std::vector<void*> live;
  for (int i = 0; i < k_allocs; ++i) live.push_back(a.alloc.allocate(4 * KiB, own));
  EXPECT_LE(a.sim->calls(sim_call::event_query) - after_first, static_cast<std::uint64_t>(k_allocs))
      << "each allocation should query only the oldest event of the busy stream";
  for (void* p : live) a.alloc.deallocate(p);
  a.alloc.deallocate(first);
  a.alloc.check_invariants();
  a.sim->complete_stream(busy);
  a.alloc.deallocate(a.alloc.allocate(512, own));
  EXPECT_EQ(a.stats().events_pending, 0u);
  a.alloc.check_invariants();
}

TEST(PendingFrees, AFailedQueryStopsOnlyItsStreamAndTheLadderStillSynchronizes) {
  sim_allocator a;
  const stream_handle own = stream(1);
  for (int i = 0; i < 100; ++i) {
    void* p = a.alloc.allocate(4 * KiB, own);
    a.alloc.record_stream(p, stream(static_cast<std::uintptr_t>(2 + i % 2)));
    a.alloc.deallocate(p);
  }
  a.sim->complete_all();
  a.sim->fail_nth(sim_call::event_query, 1);  // the first query, of stream 2's oldest event
  void* q = a.alloc.allocate(512, own);
  // Stream 2's queue stopped at the failed query; stream 3's 50 were released.
  EXPECT_EQ(a.stats().events_pending, 50u);
  a.alloc.check_invariants();
  a.alloc.empty_cache();  // synchronizes the rest
  EXPECT_EQ(a.stats().events_pending, 0u);
  a.alloc.deallocate(q);
  a.alloc.check_invariants();
}

TEST(PendingFrees, ANewStreamsQueueGrowsTheQueueTableGeometrically) {
  // Issue 30 item 7: a push for a new stream reserved size() + 1 queues, so every new stream
  // moved the whole table -- 100,000 stalled streams took 80 s. The table must grow
  // geometrically: its storage moves O(log n) times for n new streams, never once per stream.
  detail::pending_frees pf;
  constexpr std::uintptr_t k_streams = 100'000;
  std::size_t moves = 0;
  const void* storage = nullptr;
  std::size_t capacity = 0;
  for (std::uintptr_t i = 0; i < k_streams; ++i) {
    pf.push(reinterpret_cast<stream_handle>((i + 1) << 8), reinterpret_cast<detail::block*>(i + 1),
            reinterpret_cast<event_handle>((i + 1) << 4));
    const auto& q = pf.queues();
    if (q.data() != storage || q.capacity() != capacity) ++moves;
    storage = q.data();
    capacity = q.capacity();
  }
  EXPECT_EQ(pf.size(), k_streams);
  EXPECT_EQ(pf.queues().size(), k_streams);
  EXPECT_LE(moves, 40u) << "the queue table was reallocated " << moves << " times for "
                        << k_streams << " new streams";
  // Each queue holds its own stream's one entry, in order.
  for (std::uintptr_t i = 0; i < k_streams; i += 9'973) {
    const auto& q = pf.queues()[i];
    ASSERT_EQ(q.items.size() - q.head, 1u);
    EXPECT_EQ(q.stream, reinterpret_cast<stream_handle>((i + 1) << 8));
    EXPECT_EQ(q.front().b, reinterpret_cast<detail::block*>(i + 1));
  }
}

}  // namespace
}  // namespace cucache::test
