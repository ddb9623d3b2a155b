// The caching rules of device_allocator on the simulated device, each test written from the rule
// with exact addresses, sizes, segment counts and stats.
#include "cucache/device_allocator.hpp"

#include <gtest/gtest.h>

#include <limits>
#include <nlohmann/json.hpp>
#include <vector>

#include "allocator/test_support.hpp"
#include "cucache/errors.hpp"

namespace cucache::test {
namespace {

// --- rounding and pools ------------------------------------------------------------------------

TEST(Rounding, SizeZeroIsNullWithoutTouchingTheDevice) {
  sim_allocator a;
  EXPECT_EQ(a.alloc.allocate(0), nullptr);
  EXPECT_EQ(a.mallocs(), 0u);
  a.alloc.deallocate(nullptr);  // a no-op, like cudaFree(NULL)
  a.alloc.check_invariants();
}

TEST(Rounding, RequestsRoundUpToMultiplesOf512) {
  sim_allocator a;
  void* p1 = a.alloc.allocate(1);
  void* p2 = a.alloc.allocate(513);
  void* p3 = a.alloc.allocate(1024);
  EXPECT_EQ(a.alloc.allocation_size(p1), 512u);
  EXPECT_EQ(a.alloc.allocation_size(p2), 1024u);
  EXPECT_EQ(a.alloc.allocation_size(p3), 1024u);
  // Each takes the front of the remaining free block, so they sit back to back.
  EXPECT_EQ(addr(p1), k_base);
  EXPECT_EQ(addr(p2), k_base + 512);
  EXPECT_EQ(addr(p3), k_base + 1536);
  const auto s = a.stats();
  EXPECT_EQ(s.allocated_bytes[0].current, 2560);
  EXPECT_EQ(s.requested_bytes[0].current, 1 + 513 + 1024);
  EXPECT_EQ(s.allocation_count[0].current, 3);
  a.alloc.check_invariants();
}

TEST(Rounding, PowerOfTwoDivisions) {
  config cfg = parse_config("roundup_power2_divisions:4");
  sim_allocator a(cfg);
  // 1,200,000 B lies between 1 MiB and 2 MiB; four divisions -> steps of 256 KiB.
  void* p = a.alloc.allocate(1'200'000);
  EXPECT_EQ(a.alloc.allocation_size(p), 1'310'720u);
  // Powers of two stay as they are; small sizes (<= 512 * divisions) use plain 512 B rounding.
  void* q = a.alloc.allocate(4 * MiB);
  EXPECT_EQ(a.alloc.allocation_size(q), 4 * MiB);
  void* r = a.alloc.allocate(1500);
  EXPECT_EQ(a.alloc.allocation_size(r), 1536u);
  a.alloc.check_invariants();
}

TEST(Pools, SmallRequestsShareTwoMebibyteSegments) {
  sim_allocator a;
  void* p1 = a.alloc.allocate(1 * MiB);
  void* p2 = a.alloc.allocate(1 * MiB);
  EXPECT_EQ(a.mallocs(), 1u);
  EXPECT_EQ(addr(p2), addr(p1) + MiB);
  void* p3 = a.alloc.allocate(1);
  EXPECT_EQ(a.mallocs(), 2u);  // the first segment is full
  const auto s = a.stats();
  EXPECT_EQ(s.reserved_bytes[1].current, static_cast<std::int64_t>(4 * MiB));  // small pool
  EXPECT_EQ(s.reserved_bytes[2].current, 0);
  EXPECT_EQ(s.segment_count[1].current, 2);
  (void)p3;
  a.alloc.check_invariants();
}

TEST(Pools, LargeSegmentSizes) {
  sim_allocator a;
  (void)a.alloc.allocate(MiB + 1);  // large pool, under 10 MiB: a 20 MiB segment
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(20 * MiB));
  // Other streams, so that the 20 MiB segment's free remainder is not reused.
  (void)a.alloc.allocate(10 * MiB, stream(2));  // at 10 MiB: its own segment, rounded to 2 MiB
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(30 * MiB));
  (void)a.alloc.allocate(11 * MiB + 1, stream(3));  // 11 MiB + 512 -> 12 MiB segment
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(42 * MiB));
  EXPECT_EQ(a.stats().segment_count[2].current, 3);
  EXPECT_EQ(a.stats().reserved_bytes[1].current, 0);
  a.alloc.check_invariants();
}

// --- splitting, best fit, coalescing ------------------------------------------------------------

TEST(Split, LargeBlockSplitsOnlyWhenMoreThanOneMebibyteRemains) {
  sim_allocator a;
  void* p = a.alloc.allocate(19 * MiB);  // 1 MiB would remain: not split
  EXPECT_EQ(a.alloc.allocation_size(p), 20 * MiB);
  EXPECT_EQ(a.allocated(), static_cast<std::int64_t>(20 * MiB));
  a.alloc.deallocate(p);
  void* q = a.alloc.allocate(19 * MiB - 512);  // 1 MiB + 512 would remain: split
  EXPECT_EQ(addr(q), addr(p));
  EXPECT_EQ(a.alloc.allocation_size(q), 19 * MiB - 512);
  const auto s = a.stats();
  EXPECT_EQ(s.free_block_count, 1u);
  EXPECT_EQ(s.free_bytes, MiB + 512);
  EXPECT_EQ(s.inactive_split_bytes[0].current, static_cast<std::int64_t>(MiB + 512));
  a.alloc.check_invariants();
}

TEST(Split, SmallBlockSplitsWhenAtLeast512Remain) {
  sim_allocator a;
  void* p = a.alloc.allocate(2 * MiB - 1024);  // large pool (over 1 MiB)
  (void)p;
  void* s1 = a.alloc.allocate(MiB);
  void* s2 = a.alloc.allocate(MiB - 512);  // leaves exactly 512 B: split
  void* s3 = a.alloc.allocate(512);        // takes that last 512 B
  EXPECT_EQ(addr(s2), addr(s1) + MiB);
  EXPECT_EQ(addr(s3), addr(s1) + 2 * MiB - 512);
  EXPECT_EQ(a.stats().segment_count[1].current, 1);
  a.alloc.check_invariants();
}

TEST(BestFit, PicksTheSmallestFittingBlockThenTheLowestAddress) {
  sim_allocator a;
  // Carve one small segment into free holes of 8 KiB, 4 KiB, 16 KiB, 4 KiB separated by live
  // blocks.
  std::vector<void*> v;
  for (std::size_t sz : {8 * KiB, 512ul, 4 * KiB, 512ul, 16 * KiB, 512ul, 4 * KiB, 512ul}) {
    v.push_back(a.alloc.allocate(sz));
  }
  for (int i : {0, 2, 4, 6}) a.alloc.deallocate(v[static_cast<std::size_t>(i)]);
  a.alloc.check_invariants();
  EXPECT_EQ(a.alloc.allocate(4 * KiB), v[2]);  // two 4 KiB holes: the lower one
  EXPECT_EQ(a.alloc.allocate(4 * KiB), v[6]);  // then the other
  EXPECT_EQ(a.alloc.allocate(5 * KiB), v[0]);  // 8 KiB is the best fit for 5 KiB
  EXPECT_EQ(a.alloc.allocate(9 * KiB), v[4]);  // only the 16 KiB hole fits
  EXPECT_EQ(a.mallocs(), 1u);
  a.alloc.check_invariants();
}

TEST(Coalesce, FreeMergesWithBothNeighbours) {
  sim_allocator a;
  void* x = a.alloc.allocate(4 * KiB);
  void* y = a.alloc.allocate(4 * KiB);
  void* z = a.alloc.allocate(4 * KiB);
  a.alloc.deallocate(x);
  a.alloc.deallocate(z);  // merges with the segment's tail
  EXPECT_EQ(a.stats().free_block_count, 2u);
  a.alloc.deallocate(y);  // merges with both: the segment is one free block again
  const auto s = a.stats();
  EXPECT_EQ(s.free_block_count, 1u);
  EXPECT_EQ(s.largest_free_block, 2 * MiB);
  EXPECT_EQ(s.inactive_split_count[0].current, 0);
  a.alloc.check_invariants();
  EXPECT_EQ(a.alloc.allocate(MiB), x);  // the whole range is reusable
  EXPECT_EQ(a.alloc.allocate(MiB), static_cast<char*>(x) + MiB);
}

// --- streams ------------------------------------------------------------------------------------

TEST(Streams, FreeBlocksAreReusedOnlyOnTheirOwnStream) {
  sim_allocator a;
  void* p = a.alloc.allocate(4 * KiB, stream(1));
  a.alloc.deallocate(p);
  void* q = a.alloc.allocate(4 * KiB, stream(2));
  EXPECT_NE(q, p);
  EXPECT_EQ(a.mallocs(), 2u);
  void* r = a.alloc.allocate(4 * KiB, stream(1));
  EXPECT_EQ(r, p);  // at once reusable on its own stream
  a.alloc.check_invariants();
}

TEST(Streams, RecordStreamDefersReuseUntilTheOtherStreamsEventCompletes) {
  sim_allocator a;
  void* p = a.alloc.allocate(4 * KiB, stream(1));
  a.alloc.record_stream(p, stream(2));
  a.alloc.record_stream(p, stream(1));  // its own stream: nothing to wait for
  a.alloc.deallocate(p);
  EXPECT_EQ(a.sim->calls(sim_call::event_record), 1u);
  EXPECT_EQ(a.stats().events_pending, 1u);
  EXPECT_EQ(a.stats().active_count[0].current, 1);  // still active while pending
  void* q = a.alloc.allocate(4 * KiB, stream(1));
  EXPECT_NE(q, p);  // stream 2 may still be reading p
  a.alloc.check_invariants();
  a.sim->complete_stream(stream(2));
  void* r = a.alloc.allocate(4 * KiB, stream(1));  // polls the event, then reuses p
  EXPECT_EQ(r, p);
  EXPECT_EQ(a.stats().events_pending, 0u);
  a.alloc.check_invariants();
}

TEST(Streams, FreeOnAnotherStreamWaitsForThatStream) {
  sim_allocator a;
  void* p = a.alloc.allocate(64 * KiB, stream(1));
  a.alloc.deallocate(p, stream(3));
  EXPECT_EQ(a.stats().events_pending, 1u);
  EXPECT_NE(a.alloc.allocate(64 * KiB, stream(1)), p);
  a.sim->complete_all();
  EXPECT_EQ(a.alloc.allocate(64 * KiB, stream(1)), p);
  a.alloc.check_invariants();
}

TEST(Streams, FreeOnItsOwnStreamIsImmediate) {
  sim_allocator a;
  void* p = a.alloc.allocate(64 * KiB, stream(1));
  a.alloc.deallocate(p, stream(1));
  EXPECT_EQ(a.stats().events_pending, 0u);
  EXPECT_EQ(a.alloc.allocate(64 * KiB, stream(1)), p);
}

TEST(Streams, EventsAreRecycled) {
  sim_allocator a;
  for (int i = 0; i < 5; ++i) {
    void* p = a.alloc.allocate(4 * KiB, stream(1));
    a.alloc.record_stream(p, stream(2));
    a.alloc.deallocate(p);
    a.sim->complete_all();
    (void)a.alloc.allocate(512, stream(1));  // polls and returns the event to the pool
  }
  EXPECT_EQ(a.sim->calls(sim_call::event_create), 1u);
  EXPECT_EQ(a.sim->calls(sim_call::event_record), 5u);
}

// --- max_split_size -----------------------------------------------------------------------------

TEST(MaxSplit, OversizeBlocksAreNeverSplitAndNotTakenByRequestsUnderTheCap) {
  sim_allocator a(parse_config("max_split_size_mb:64"));
  void* big = a.alloc.allocate(100 * MiB);
  a.alloc.deallocate(big);
  EXPECT_EQ(a.stats().oversize_segments, 1u);
  // A 30 MiB request may not take the cached 100 MiB block. Before growing, the allocator
  // releases that oversize block (no request can use it without splitting it).
  void* p = a.alloc.allocate(30 * MiB);
  EXPECT_EQ(a.frees(), 1u);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(30 * MiB));
  EXPECT_EQ(a.stats().oversize_segments, 0u);
  (void)p;
  a.alloc.check_invariants();
}

TEST(MaxSplit, RequestsOverTheCapTakeOversizeBlocksWithinTheWasteTolerance) {
  sim_allocator a(parse_config("max_split_size_mb:64"));
  void* big = a.alloc.allocate(100 * MiB);
  a.alloc.deallocate(big);
  void* p = a.alloc.allocate(90 * MiB);  // wastes 10 MiB < 20 MiB: taken whole, not split
  EXPECT_EQ(p, big);
  EXPECT_EQ(a.alloc.allocation_size(p), 100 * MiB);
  EXPECT_EQ(a.stats().oversize_allocations, 1u);
  a.alloc.deallocate(p);
  void* q = a.alloc.allocate(70 * MiB);  // would waste 30 MiB: released, a new segment instead
  EXPECT_EQ(a.alloc.allocation_size(q), 70 * MiB);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(70 * MiB));
  a.alloc.check_invariants();
}

TEST(MaxSplit, ReservedDoesNotRunAwayOnDynamicShapes) {
  // Growing and shrinking requests over the cap: PyTorch keeps every oversize block it ever
  // cached; cucache releases the ones the next request cannot use, so reserved stays at the
  // live peak.
  sim_allocator a(parse_config("max_split_size_mb:128"));
  std::size_t peak_live = 0;
  for (std::size_t mib : {200, 300, 250, 400, 150, 350, 220, 500, 260}) {
    void* p = a.alloc.allocate(mib * MiB);
    peak_live = std::max(peak_live, mib * MiB);
    a.alloc.deallocate(p);
    a.alloc.check_invariants();
  }
  EXPECT_EQ(a.stats().reserved_bytes[0].peak, static_cast<std::int64_t>(peak_live));
  EXPECT_LE(a.reserved(), static_cast<std::int64_t>(peak_live));
}

// --- out of memory ------------------------------------------------------------------------------

TEST(OutOfMemory, LadderReleasesOtherStreamsCacheAndRetries) {
  sim_options o;
  o.capacity_bytes = 100 * MiB;
  sim_allocator a({}, o);
  void* p = a.alloc.allocate(60 * MiB, stream(1));
  a.alloc.deallocate(p);                            // cached on stream 1
  void* q = a.alloc.allocate(60 * MiB, stream(2));  // misses, the device refuses, ladder frees
  EXPECT_NE(q, nullptr);
  const auto s = a.stats();
  EXPECT_EQ(s.alloc_retry_count, 1u);
  EXPECT_EQ(s.oom_count, 0u);
  EXPECT_EQ(a.frees(), 1u);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(60 * MiB));
  a.alloc.check_invariants();
}

TEST(OutOfMemory, LadderWaitsForPendingFrees) {
  sim_options o;
  o.capacity_bytes = 100 * MiB;
  sim_allocator a({}, o);
  void* p = a.alloc.allocate(60 * MiB, stream(1));
  a.alloc.record_stream(p, stream(2));
  a.alloc.deallocate(p);  // pending on stream 2's event
  void* q = a.alloc.allocate(60 * MiB, stream(1));
  EXPECT_EQ(q, p);  // the ladder synchronized the event and reused the block
  EXPECT_EQ(a.sim->calls(sim_call::event_synchronize), 1u);
  EXPECT_EQ(a.stats().alloc_retry_count, 1u);
  a.alloc.check_invariants();
}

TEST(OutOfMemory, ErrorStatesTheFiguresAndTheAllocatorWorksAfterwards) {
  sim_options o;
  o.capacity_bytes = 100 * MiB;
  sim_allocator a({}, o);
  void* p = a.alloc.allocate(60 * MiB);
  void* small = a.alloc.allocate(4 * KiB);
  try {
    (void)a.alloc.allocate(50 * MiB);
    FAIL() << "expected out_of_memory";
  } catch (const out_of_memory& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("out of memory"), std::string::npos) << what;
    EXPECT_NE(what.find("50.00 MiB (52428800 bytes"), std::string::npos) << what;
    EXPECT_NE(what.find("Device capacity 100.00 MiB"), std::string::npos) << what;
    EXPECT_NE(what.find("60.00 MiB allocated"), std::string::npos) << what;
    EXPECT_NE(what.find("largest"), std::string::npos) << what;
    EXPECT_NE(what.find("Fragmentation"), std::string::npos) << what;
  }
  EXPECT_EQ(a.stats().oom_count, 1u);
  a.alloc.check_invariants();
  void* r = a.alloc.allocate(20 * MiB);  // still works
  EXPECT_NE(r, nullptr);
  a.alloc.deallocate(p);
  a.alloc.deallocate(r);
  a.alloc.deallocate(small);
  a.alloc.check_invariants();
}

TEST(OutOfMemory, ImpossibleSizesFailAtOnceWithoutFlushingTheCache) {
  sim_allocator a;
  void* p = a.alloc.allocate(30 * MiB);
  a.alloc.deallocate(p);
  EXPECT_THROW((void)a.alloc.allocate(std::numeric_limits<std::size_t>::max()), out_of_memory);
  EXPECT_THROW((void)a.alloc.allocate(std::size_t{1} << 50), out_of_memory);
  EXPECT_EQ(a.frees(), 0u);  // the cached 30 MiB stayed
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(30 * MiB));
  EXPECT_EQ(a.stats().oom_count, 2u);
  a.alloc.check_invariants();
}

TEST(OutOfMemory, InjectedDeviceFailureIsRetriedOnce) {
  sim_allocator a;
  a.sim->fail_nth(sim_call::segment_malloc, 1);
  void* p = a.alloc.allocate(4 * KiB);
  EXPECT_NE(p, nullptr);
  EXPECT_EQ(a.stats().alloc_retry_count, 1u);
  EXPECT_EQ(a.mallocs(), 2u);
  a.alloc.check_invariants();
}

TEST(OutOfMemory, FailedSegmentFreeLeavesTheAllocatorIntact) {
  sim_allocator a;
  void* p = a.alloc.allocate(4 * KiB);
  a.alloc.deallocate(p);
  a.sim->fail_nth(sim_call::segment_free, 1);
  EXPECT_THROW(a.alloc.empty_cache(), cuda_error);
  a.alloc.check_invariants();
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(2 * MiB));
  a.alloc.empty_cache();
  EXPECT_EQ(a.reserved(), 0);
  a.alloc.check_invariants();
}

// --- empty_cache, limits, garbage collection -----------------------------------------------------

TEST(EmptyCache, ReleasesWholeFreeSegmentsOnly) {
  sim_allocator a;
  void* keep = a.alloc.allocate(4 * KiB);   // small segment stays (partly used)
  void* gone = a.alloc.allocate(30 * MiB);  // large segment, freed below
  void* gone2 = a.alloc.allocate(4 * KiB, stream(7));
  a.alloc.deallocate(gone);
  a.alloc.deallocate(gone2);
  a.alloc.empty_cache();
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(2 * MiB));
  EXPECT_EQ(a.frees(), 2u);
  EXPECT_EQ(a.sim->used_bytes(), 2 * MiB);
  a.alloc.deallocate(keep);
  a.alloc.empty_cache();
  EXPECT_EQ(a.reserved(), 0);
  EXPECT_EQ(a.sim->live_segments(), 0u);
  a.alloc.check_invariants();
}

TEST(EmptyCache, WaitsForPendingFreesFirst) {
  sim_allocator a;
  void* p = a.alloc.allocate(4 * KiB, stream(1));
  a.alloc.record_stream(p, stream(2));
  a.alloc.deallocate(p);
  a.alloc.empty_cache();
  EXPECT_EQ(a.reserved(), 0);
  EXPECT_EQ(a.stats().events_pending, 0u);
  a.alloc.check_invariants();
}

TEST(Limits, MemoryLimitCapsReserved) {
  sim_allocator a(parse_config("memory_limit:50MiB"));
  void* p = a.alloc.allocate(40 * MiB);
  EXPECT_THROW((void)a.alloc.allocate(20 * MiB), out_of_memory);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(40 * MiB));
  a.alloc.deallocate(p);
  void* q = a.alloc.allocate(50 * MiB);  // the ladder releases the cached 40 MiB first
  EXPECT_NE(q, nullptr);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(50 * MiB));
  EXPECT_EQ(a.stats().memory_limit, 50 * MiB);
  a.alloc.check_invariants();
}

TEST(Limits, MemoryFractionOfDeviceCapacity) {
  sim_options o;
  o.capacity_bytes = 1000 * MiB;
  sim_allocator a(parse_config("memory_fraction:0.1"), o);
  EXPECT_EQ(a.stats().memory_limit, 100 * MiB);
  void* p = a.alloc.allocate(100 * MiB);
  EXPECT_THROW((void)a.alloc.allocate(MiB), out_of_memory);
  a.alloc.deallocate(p);
}

TEST(GarbageCollection, ReleasesOldestFreeSegmentsAboveTheThresholdWithoutAFraction) {
  sim_options o;
  o.capacity_bytes = 100 * MiB;
  sim_allocator a(parse_config("garbage_collection_threshold:0.5"), o);  // 50 MiB
  void* x = a.alloc.allocate(20 * MiB);
  void* y = a.alloc.allocate(22 * MiB);
  a.alloc.deallocate(x);  // older
  a.alloc.deallocate(y);  // newer
  // 42 MiB reserved; a new 24 MiB segment would reach 66 MiB > 50 MiB: the oldest free segment
  // (x, 20 MiB) goes first, which brings it to 46 MiB.
  void* z = a.alloc.allocate(24 * MiB);
  EXPECT_EQ(a.frees(), 1u);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(46 * MiB));
  EXPECT_EQ(a.alloc.allocate(22 * MiB), y);  // the newer one stayed cached
  (void)z;
  a.alloc.check_invariants();
}

// --- bad input ----------------------------------------------------------------------------------

TEST(BadInput, UnknownInteriorAndDoubleFreedPointersAreClearErrorsThatChangeNothing) {
  sim_allocator a;
  void* p = a.alloc.allocate(4 * KiB);
  void* q = a.alloc.allocate(4 * KiB);
  a.alloc.deallocate(q);
  const std::string before = a.alloc.snapshot_json();
  auto expect_error = [&](auto&& f, const char* needle) {
    try {
      f();
      ADD_FAILURE() << "expected invalid_argument containing " << needle;
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(a.alloc.snapshot_json(), before);
    a.alloc.check_invariants();
  };
  int host = 0;
  expect_error([&] { a.alloc.deallocate(&host); }, "not allocated by cucache");
  expect_error([&] { a.alloc.deallocate(static_cast<char*>(p) + 512); },
               "512 bytes into the live allocation");
  expect_error([&] { a.alloc.deallocate(q); }, "already freed");
  expect_error([&] { a.alloc.record_stream(q, stream(2)); }, "record_stream");
  expect_error([&] { a.alloc.deallocate(static_cast<char*>(q) + 1024); }, "free memory");
  a.alloc.deallocate(p);
  a.alloc.check_invariants();
}

// --- stats --------------------------------------------------------------------------------------

TEST(Stats, ExactFiguresPeaksAndResets) {
  sim_allocator a;
  void* s1 = a.alloc.allocate(1000);                 // small: 1024
  void* l1 = a.alloc.allocate(3 * MiB);              // large: 20 MiB segment, split
  void* l2 = a.alloc.allocate(12 * MiB, stream(2));  // large: own 12 MiB segment
  auto s = a.stats();
  EXPECT_EQ(s.allocated_bytes[0].current, static_cast<std::int64_t>(1024 + 15 * MiB));
  EXPECT_EQ(s.allocated_bytes[1].current, 1024);
  EXPECT_EQ(s.allocated_bytes[2].current, static_cast<std::int64_t>(15 * MiB));
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(34 * MiB));
  EXPECT_EQ(s.segment_count[0].current, 3);
  EXPECT_EQ(s.requested_bytes[0].current, static_cast<std::int64_t>(1000 + 15 * MiB));
  EXPECT_EQ(s.device_alloc_count, 3u);
  a.alloc.deallocate(l2);
  a.alloc.deallocate(l1);
  s = a.stats();
  EXPECT_EQ(s.allocated_bytes[0].current, 1024);
  EXPECT_EQ(s.allocated_bytes[0].peak, static_cast<std::int64_t>(1024 + 15 * MiB));
  EXPECT_EQ(s.allocated_bytes[0].allocated, static_cast<std::int64_t>(1024 + 15 * MiB));
  EXPECT_EQ(s.allocated_bytes[0].freed, static_cast<std::int64_t>(15 * MiB));
  EXPECT_EQ(s.allocation_count[0].allocated, 3);
  EXPECT_EQ(s.allocation_count[0].freed, 2);
  // Free: 2 MiB - 1 KiB in the small segment, 20 MiB and 12 MiB whole large segments.
  EXPECT_EQ(s.free_bytes, 34 * MiB - 1024);
  EXPECT_EQ(s.largest_free_block, 20 * MiB);
  EXPECT_EQ(s.free_block_count, 3u);
  EXPECT_DOUBLE_EQ(s.external_fragmentation(),
                   1.0 - static_cast<double>(20 * MiB) / static_cast<double>(34 * MiB - 1024));
  EXPECT_DOUBLE_EQ(s.overhead_fragmentation(), 1.0 - 1024.0 / static_cast<double>(34 * MiB));
  a.alloc.reset_peak_stats();
  s = a.stats();
  EXPECT_EQ(s.allocated_bytes[0].peak, 1024);
  EXPECT_EQ(s.reserved_bytes[0].peak, static_cast<std::int64_t>(34 * MiB));
  a.alloc.reset_accumulated_stats();
  s = a.stats();
  EXPECT_EQ(s.allocated_bytes[0].allocated, 0);
  EXPECT_EQ(s.allocated_bytes[0].freed, 0);
  EXPECT_EQ(s.device_alloc_count, 0u);
  a.alloc.empty_cache();
  s = a.stats();
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(2 * MiB));
  EXPECT_EQ(s.reserved_bytes[0].peak, static_cast<std::int64_t>(34 * MiB));
  EXPECT_EQ(s.device_free_count, 2u);
  a.alloc.deallocate(s1);
}

TEST(Stats, FragmentationIsZeroWhenNothingIsFreeOrReserved) {
  sim_allocator a;
  EXPECT_EQ(a.stats().external_fragmentation(), 0.0);
  EXPECT_EQ(a.stats().overhead_fragmentation(), 0.0);
}

TEST(Observe, MemorySummaryAndSnapshot) {
  sim_allocator a;
  void* p = a.alloc.allocate(3 * MiB);
  const std::string summary = a.alloc.memory_summary();
  for (const char* row :
       {"Allocated memory", "Reserved memory", "Active memory", "Requested memory", "Segments",
        "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed", "from large pool", "from small pool",
        "Fragmentation", "20.00 MiB", "3.00 MiB"}) {
    EXPECT_NE(summary.find(row), std::string::npos) << row << "\n" << summary;
  }
  const auto snap = nlohmann::json::parse(a.alloc.snapshot_json());
  ASSERT_EQ(snap["segments"].size(), 1u);
  EXPECT_EQ(snap["segments"][0]["size"], 20 * MiB);
  ASSERT_EQ(snap["segments"][0]["blocks"].size(), 2u);
  EXPECT_EQ(snap["segments"][0]["blocks"][0]["state"], "allocated");
  EXPECT_EQ(snap["segments"][0]["blocks"][1]["state"], "free");
  a.alloc.deallocate(p);
}

TEST(Contents, BlocksAreBackedByDistinctMemory) {
  sim_options o;
  o.host_memory = true;
  o.capacity_bytes = 256 * MiB;
  sim_allocator a({}, o);
  std::vector<std::pair<void*, std::size_t>> live;
  for (std::size_t i = 0; i < 64; ++i) {
    const std::size_t size = 1000 + i * 37'000;
    void* p = a.alloc.allocate(size);
    std::byte* h = a.sim->host_view(p, size);
    ASSERT_NE(h, nullptr);
    std::fill(h, h + size, static_cast<std::byte>(i));
    live.emplace_back(p, size);
  }
  for (std::size_t i = 0; i < live.size(); ++i) {
    const std::byte* h = a.sim->host_view(live[i].first, live[i].second);
    for (std::size_t j = 0; j < live[i].second; ++j) {
      ASSERT_EQ(h[j], static_cast<std::byte>(i)) << "block " << i << " byte " << j;
    }
  }
  for (auto& [p, size] : live) a.alloc.deallocate(p);
  a.alloc.check_invariants();
}

}  // namespace
}  // namespace cucache::test
