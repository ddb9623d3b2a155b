// The caching rules of device_allocator, written once and run on every device and mode:
// {simulated device, real GPU} x {cudaMalloc segments, expandable segments}.
//
// This source is compiled into two executables (tests/CMakeLists.txt): allocator_suite_sim_test
// (CUCACHE_SUITE_BACKEND_CUDA=0, ctest label cpu) and allocator_suite_cuda_test
// (CUCACHE_SUITE_BACKEND_CUDA=1, label gpu; every test skips with a one-line reason where there is
// no usable GPU). What differs between the devices is in suite_devices.hpp; the mode is the test
// parameter. Three suites share one fixture:
//
//   Allocator           rules of both modes              <device>/Allocator.<Rule>/default
//                                                        <device>/Allocator.<Rule>/expandable
//   AllocatorSegments   rules of cudaMalloc'd segments   <device>/AllocatorSegments.<Rule>/default
//   AllocatorExpandable rules of expandable segments <device>/AllocatorExpandable.<Rule>/expandable
//
// The expectations are exact: sizes, the reuse of the same address, stats after a known
// sequence. Whatever depends on the device (its capacity, its VM granularity, how precisely it
// reports free memory) is read from the backend. Rules only one device can check stay in their
// own suites: exact simulated addresses, injected failures and host-visible contents in
// device_allocator_test.cpp and expandable_test.cpp; kernels writing and checking memory in
// tests/gpu/.
#include <gtest/gtest.h>

#include <fmt/format.h>
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "allocator/suite_devices.hpp"
#include "core/format_bytes.hpp"
#include "cucache/config.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

#ifndef CUCACHE_SUITE_BACKEND_CUDA
#error "compile with CUCACHE_SUITE_BACKEND_CUDA=0 (simulated device) or 1 (a real GPU)"
#endif

namespace cucache::test {
namespace {

#if CUCACHE_SUITE_BACKEND_CUDA
using device_type = cuda_device;
#define CUCACHE_SUITE_DEVICE cuda
#else
using device_type = sim_device;
#define CUCACHE_SUITE_DEVICE sim
#endif

/// The allocator's mode: cudaMalloc'd segments (the default) or expandable segments.
enum class mode : std::uint8_t { segments, expandable };

std::string mode_name(const ::testing::TestParamInfo<mode>& info) {
  return info.param == mode::expandable ? "expandable" : "default";
}

std::int64_t i64(std::size_t n) {
  return static_cast<std::int64_t>(n);
}
std::size_t abs_diff(std::size_t a, std::size_t b) {
  return a > b ? a - b : b - a;
}
char* at(void* p, std::size_t offset) {
  return static_cast<char*>(p) + offset;
}

// One allocator on a fresh device per test, in the instance's mode plus what the test adds.
class rules_fixture : public ::testing::TestWithParam<mode> {
 protected:
  [[nodiscard]] bool expandable() const { return GetParam() == mode::expandable; }

  void SetUp() override {
    if (const std::string why = device_type::unavailable(); !why.empty()) GTEST_SKIP() << why;
    if (expandable() && device_type::granularity() == 0) {
      GTEST_SKIP() << device_type::name << " device 0 has no virtual memory management support";
    }
    dev_ = std::make_unique<device_type>();
  }
  void TearDown() override {
    if (dev_ != nullptr) dev_->release_all();  // streams catch up before their blocks go
    alloc_.reset();
    dev_.reset();
  }

  /// The allocator under test: the mode's config with `conf` (a CUCACHE_CONF string) on top. A
  /// `leave_free` > 0 makes the device itself hold only that much free memory.
  device_allocator& make(std::string_view conf = {}, std::size_t leave_free = 0) {
    config cfg = parse_config(expandable() ? "expandable_segments:True" : "");
    cfg = parse_config(conf, cfg);
    alloc_ = std::make_unique<device_allocator>(dev_->open(leave_free), std::move(cfg));
    return *alloc_;
  }
  device_allocator& a() { return *alloc_; }
  [[nodiscard]] device_stats stats() const { return alloc_->stats(); }
  [[nodiscard]] std::int64_t reserved() const { return stats().reserved_bytes[0].current; }
  [[nodiscard]] std::int64_t allocated() const { return stats().allocated_bytes[0].current; }

  [[nodiscard]] stream_handle stream(int i) const { return dev_->stream(i); }
  void hold(stream_handle s, std::chrono::milliseconds open_after = k_hold_forever) {
    dev_->hold(s, open_after);
  }
  void complete_all() { dev_->complete_all(); }
  [[nodiscard]] bool runtime_error_clear() const { return dev_->runtime_error_clear(); }

  /// The device's page in expandable mode (its VM granularity).
  [[nodiscard]] std::size_t page() const { return alloc_->backend().vm_granularity(); }
  [[nodiscard]] std::size_t device_free() const {
    return alloc_->backend().mem_get_info().free_bytes;
  }
  /// How far the device's free-memory figure may be from the reservation after `allocations`
  /// device allocations.
  [[nodiscard]] static std::size_t slack(std::size_t allocations) {
    return device_type::slack_per_allocation() * allocations;
  }
  /// Device allocations that hold memory now: segments, or physical handles.
  [[nodiscard]] std::size_t device_allocations() const {
    const device_stats s = stats();
    return expandable() ? static_cast<std::size_t>(s.device_alloc_count - s.device_free_count)
                        : static_cast<std::size_t>(s.segment_count[0].current);
  }

  void check() {
    try {
      alloc_->check_invariants();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "check_invariants: " << e.what();
    }
  }
  /// After the device or the limit refused a request on the way: `live` bytes are reserved for
  /// blocks. In expandable mode the pager makes room for all the pages a block lacks before it
  /// creates any, so a refused attempt leaves nothing behind either.
  void expect_reserved_after_a_refusal(std::size_t live) {
    const device_stats s = stats();
    if (expandable()) {
      EXPECT_EQ(s.reserved_bytes[0].current, i64(live));
      EXPECT_EQ(s.mapped_bytes + s.unmapped_handle_bytes, live);
    } else {
      EXPECT_EQ(s.reserved_bytes[0].current, i64(live));
    }
  }
  /// What the device holds for the allocator equals its reservation.
  void expect_device_holds_the_reservation(std::size_t free_at_start) {
    const std::size_t taken = free_at_start - std::min(free_at_start, device_free());
    const auto res = static_cast<std::size_t>(reserved());
    EXPECT_LE(abs_diff(taken, res), slack(device_allocations()))
        << "the device gave " << taken << " bytes, the allocator reserves " << res;
    if (expandable()) {
      const device_stats s = stats();
      EXPECT_EQ(s.mapped_bytes + s.unmapped_handle_bytes, res);
    }
  }

 private:
  std::unique_ptr<device_type> dev_;
  std::unique_ptr<device_allocator> alloc_;
};

class Allocator : public rules_fixture {};
class AllocatorSegments : public rules_fixture {};
class AllocatorExpandable : public rules_fixture {};

// === Allocator: rules of both modes ==============================================================

TEST_P(Allocator, SizeZeroIsNullWithoutTouchingTheDevice) {
  auto& a = make();
  EXPECT_EQ(a.allocate(0), nullptr);
  a.deallocate(nullptr);  // a no-op, like cudaFree(NULL)
  const device_stats s = stats();
  EXPECT_EQ(s.device_alloc_count, 0u);
  EXPECT_EQ(s.device_alloc_count, 0u);
  EXPECT_EQ(s.reserved_bytes[0].current, 0);
  EXPECT_EQ(s.allocation_count[0].allocated, 0);
  check();
}

TEST_P(Allocator, RequestsRoundUpToMultiplesOf512AndSitBackToBack) {
  auto& a = make();
  void* p1 = a.allocate(1);
  void* p2 = a.allocate(513);
  void* p3 = a.allocate(1024);
  EXPECT_EQ(a.allocation_size(p1), 512u);
  EXPECT_EQ(a.allocation_size(p2), 1024u);
  EXPECT_EQ(a.allocation_size(p3), 1024u);
  // Each takes the front of the remaining free block.
  EXPECT_EQ(addr(p2), addr(p1) + 512);
  EXPECT_EQ(addr(p3), addr(p1) + 1536);
  const device_stats s = stats();
  EXPECT_EQ(s.allocated_bytes[0].current, 2560);
  EXPECT_EQ(s.requested_bytes[0].current, 1 + 513 + 1024);
  EXPECT_EQ(s.allocation_count[0].current, 3);
  EXPECT_EQ(s.allocated_bytes[1].current, 2560);  // the small pool
  check();
}

TEST_P(Allocator, PowerOfTwoDivisions) {
  auto& a = make("roundup_power2_divisions:4");
  // 1,200,000 B lies between 1 MiB and 2 MiB; four divisions -> steps of 256 KiB.
  void* p = a.allocate(1'200'000);
  EXPECT_EQ(a.allocation_size(p), 1'310'720u);
  // Powers of two stay as they are; small sizes (<= 512 * divisions) use plain 512 B rounding.
  void* q = a.allocate(4 * MiB);
  EXPECT_EQ(a.allocation_size(q), 4 * MiB);
  void* r = a.allocate(1500);
  EXPECT_EQ(a.allocation_size(r), 1536u);
  check();
}

TEST_P(Allocator, BestFitPicksTheSmallestFittingBlockThenTheLowestAddress) {
  auto& a = make();
  // Free holes of 8 KiB, 4 KiB, 16 KiB, 4 KiB separated by live blocks.
  std::vector<void*> v;
  for (std::size_t sz : {8 * KiB, 512ul, 4 * KiB, 512ul, 16 * KiB, 512ul, 4 * KiB, 512ul}) {
    v.push_back(a.allocate(sz));
  }
  for (std::size_t i : {0u, 2u, 4u, 6u}) a.deallocate(v[i]);
  check();
  const std::int64_t before = reserved();
  EXPECT_EQ(a.allocate(4 * KiB), v[2]);  // two 4 KiB holes: the lower one
  EXPECT_EQ(a.allocate(4 * KiB), v[6]);  // then the other
  EXPECT_EQ(a.allocate(5 * KiB), v[0]);  // 8 KiB is the best fit for 5 KiB
  EXPECT_EQ(a.allocate(9 * KiB), v[4]);  // only the 16 KiB hole fits
  EXPECT_EQ(reserved(), before) << "the holes served every request";
  check();
}

TEST_P(Allocator, FreeMergesWithBothNeighbours) {
  auto& a = make();
  void* x = a.allocate(4 * KiB);
  void* y = a.allocate(4 * KiB);
  void* z = a.allocate(4 * KiB);
  a.deallocate(x);
  a.deallocate(z);  // merges with the free space behind it
  EXPECT_EQ(stats().free_block_count, 2u);
  a.deallocate(y);  // merges with both: one free block again
  const device_stats s = stats();
  EXPECT_EQ(s.free_block_count, 1u);
  EXPECT_EQ(s.inactive_split_count[0].current, 0);
  if (!expandable()) {
    // The whole 2 MiB segment is free, but the largest request it serves is 1 MiB: larger ones
    // go to the large pool, which holds nothing.
    EXPECT_EQ(s.free_bytes, 2 * MiB);
    EXPECT_EQ(s.largest_free_block, MiB);
  }
  check();
  EXPECT_EQ(a.allocate(MiB), x);  // the whole range is reusable
  EXPECT_EQ(a.allocate(MiB), at(x, MiB));
}

TEST_P(Allocator, FreeBlocksAreReusedOnlyOnTheirOwnStream) {
  auto& a = make();
  const stream_handle s1 = stream(1);
  const stream_handle s2 = stream(2);
  void* p = a.allocate(4 * KiB, s1);
  a.deallocate(p);
  void* q = a.allocate(4 * KiB, s2);
  EXPECT_NE(q, p);
  if (!expandable()) {
    EXPECT_EQ(stats().segment_count[0].current, 2);
  }
  void* r = a.allocate(4 * KiB, s1);
  EXPECT_EQ(r, p);  // at once reusable on its own stream
  check();
}

TEST_P(Allocator, RecordStreamDefersReuseUntilTheOtherStreamsWorkCompletes) {
  auto& a = make();
  const stream_handle s1 = stream(1);
  const stream_handle s2 = stream(2);
  hold(s2);  // s2 is still using the block when it is freed
  void* p = a.allocate(4 * KiB, s1);
  a.record_stream(p, s2);
  a.record_stream(p, s1);  // its own stream: nothing to wait for
  a.deallocate(p);
  device_stats s = stats();
  EXPECT_EQ(s.events_pending, 1u);
  EXPECT_EQ(s.allocation_count[0].current, 0);
  EXPECT_EQ(s.active_count[0].current, 1);  // still active while pending
  EXPECT_EQ(s.active_bytes[0].current, i64(4 * KiB));
  void* q = a.allocate(4 * KiB, s1);
  EXPECT_NE(q, p);  // s2 may still be reading p
  check();
  complete_all();
  void* r = a.allocate(4 * KiB, s1);  // polls the event, then reuses p
  EXPECT_EQ(r, p);
  s = stats();
  EXPECT_EQ(s.events_pending, 0u);
  EXPECT_EQ(s.active_count[0].current, 2);
  check();
}

TEST_P(Allocator, FreeOnAnotherStreamWaitsForThatStream) {
  auto& a = make();
  const stream_handle s1 = stream(1);
  const stream_handle s3 = stream(3);
  hold(s3);
  void* p = a.allocate(64 * KiB, s1);
  a.deallocate(p, s3);
  EXPECT_EQ(stats().events_pending, 1u);
  EXPECT_EQ(stats().active_bytes[0].current, i64(64 * KiB));
  EXPECT_NE(a.allocate(64 * KiB, s1), p);
  complete_all();
  EXPECT_EQ(a.allocate(64 * KiB, s1), p);
  EXPECT_EQ(stats().events_pending, 0u);
  check();
}

TEST_P(Allocator, FreeOnItsOwnStreamIsImmediate) {
  auto& a = make();
  const stream_handle s1 = stream(1);
  hold(s1);  // even with work queued: the stream's order protects the block
  void* p = a.allocate(64 * KiB, s1);
  a.deallocate(p, s1);
  EXPECT_EQ(stats().events_pending, 0u);
  EXPECT_EQ(a.allocate(64 * KiB, s1), p);
  complete_all();
}

TEST_P(Allocator, OutOfMemoryLadderReleasesOtherStreamsCacheAndRetries) {
  auto& a = make("", 100 * MiB);
  void* p = a.allocate(60 * MiB, stream(1));
  a.deallocate(p);                            // cached on stream 1
  void* q = a.allocate(60 * MiB, stream(2));  // misses, the device refuses, ladder frees
  EXPECT_NE(q, nullptr);
  const device_stats s = stats();
  // Expandable mode moves another stream's idle pages when memory is short, before the ladder,
  // and only until the rest may be created: 20 MiB moved, 40 created, to the device's 100 MiB
  // (stream 1 keeps 40 MiB mapped). Default mode gives stream 1's segment back first.
  // On a real device the free-memory figure is only near what cuMemCreate can still take (its
  // slack): a last page may be refused after the moves, and the ladder then runs once.
  if (expandable() && slack(1) != 0) {
    EXPECT_LE(s.alloc_retry_count, 1u);
    EXPECT_LE(s.reserved_bytes[0].current, i64(100 * MiB));
    EXPECT_GE(s.reserved_bytes[0].current, i64(60 * MiB));
  } else {
    EXPECT_EQ(s.alloc_retry_count, expandable() ? 0u : 1u);
    EXPECT_EQ(s.reserved_bytes[0].current, i64(expandable() ? 100 * MiB : 60 * MiB));
  }
  EXPECT_EQ(s.oom_count, 0u);
  if (!expandable()) {
    EXPECT_EQ(s.device_free_count, 1u);
  }
  EXPECT_TRUE(runtime_error_clear()) << "the refused device call left its error behind";
  check();
}

TEST_P(Allocator, OutOfMemoryLadderWaitsForPendingFrees) {
  auto& a = make("", 100 * MiB);
  const stream_handle s1 = stream(1);
  const stream_handle s2 = stream(2);
  // s2 finishes its work by itself half a second later (long after the poll below): the ladder
  // has to wait for it.
  hold(s2, std::chrono::milliseconds(500));
  void* p = a.allocate(60 * MiB, s1);
  a.record_stream(p, s2);
  a.deallocate(p);  // pending on s2's event
  void* q = a.allocate(60 * MiB, s1);
  EXPECT_NE(q, nullptr);
  const device_stats s = stats();
  if (expandable()) {
    EXPECT_EQ(q, p);  // the ladder synchronized the event; p's pages serve q where p was
  } else {
    EXPECT_EQ(s.device_free_count, 1u);  // and released p's segment, which the device gave again
  }
  EXPECT_EQ(s.alloc_retry_count, 1u);
  EXPECT_EQ(s.events_pending, 0u);
  expect_reserved_after_a_refusal(60 * MiB);
  EXPECT_TRUE(runtime_error_clear());
  check();
}

TEST_P(Allocator, OutOfMemoryErrorStatesTheFiguresAndTheAllocatorWorksAfterwards) {
  auto& a = make("", 100 * MiB);
  void* p = a.allocate(60 * MiB);
  void* small = a.allocate(4 * KiB);
  const std::string capacity =
      detail::format_bytes(static_cast<double>(stats().device_total_bytes));
  try {
    void* r = a.allocate(50 * MiB);
    ADD_FAILURE() << "expected out_of_memory, got " << r;
  } catch (const out_of_memory& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("out of memory"), std::string::npos) << what;
    EXPECT_NE(what.find("50.00 MiB (52428800 bytes"), std::string::npos) << what;
    EXPECT_NE(what.find("Device capacity " + capacity), std::string::npos) << what;
    EXPECT_NE(what.find("60.00 MiB allocated"), std::string::npos) << what;
    EXPECT_NE(what.find("largest"), std::string::npos) << what;
    EXPECT_NE(what.find("Fragmentation"), std::string::npos) << what;
  }
  EXPECT_EQ(stats().oom_count, 1u);
  EXPECT_EQ(stats().allocation_count[0].current, 2);
  EXPECT_TRUE(runtime_error_clear());
  check();
  void* r = a.allocate(20 * MiB);  // still works
  EXPECT_NE(r, nullptr);
  a.deallocate(p);
  a.deallocate(r);
  a.deallocate(small);
  check();
}

TEST_P(Allocator, OutOfMemoryFreedBlocksServeTheSameRequestsWithoutTheDevice) {
  auto& a = make("", 100 * MiB);
  std::vector<void*> blocks;
  std::string report;
  for (int i = 0; i < 20 && report.empty(); ++i) {
    try {
      blocks.push_back(a.allocate(16 * MiB));
    } catch (const out_of_memory& e) {
      report = e.what();
    }
  }
  ASSERT_FALSE(report.empty()) << "100 MiB held more than 20 blocks of 16 MiB";
  ASSERT_GE(blocks.size(), 4u) << report;
  const device_stats at_oom = stats();
  EXPECT_EQ(at_oom.oom_count, 1u);
  EXPECT_EQ(at_oom.alloc_retry_count, 1u);
  EXPECT_EQ(at_oom.allocation_count[0].current, i64(blocks.size()));
  EXPECT_TRUE(runtime_error_clear());
  check();
  // Free every other block: they stay cached and serve the same requests again.
  std::vector<void*> kept;
  std::size_t freed = 0;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (i % 2 == 0) {
      a.deallocate(blocks[i]);
      ++freed;
    } else {
      kept.push_back(blocks[i]);
    }
  }
  for (std::size_t i = 0; i < freed; ++i) kept.push_back(a.allocate(16 * MiB));
  const device_stats again = stats();
  EXPECT_EQ(again.device_alloc_count, at_oom.device_alloc_count);
  EXPECT_EQ(again.device_alloc_count, at_oom.device_alloc_count);
  EXPECT_EQ(again.reserved_bytes[0].current, at_oom.reserved_bytes[0].current);
  EXPECT_EQ(again.oom_count, 1u);
  for (void* p : kept) a.deallocate(p);
  a.empty_cache();
  EXPECT_EQ(reserved(), 0);
  check();
}

TEST_P(Allocator, ImpossibleSizesFailAtOnceWithoutFlushingTheCache) {
  auto& a = make();
  void* p = a.allocate(30 * MiB);
  a.deallocate(p);
  const device_stats before = stats();
  EXPECT_THROW((void)a.allocate(std::numeric_limits<std::size_t>::max()), out_of_memory);
  EXPECT_THROW((void)a.allocate(std::size_t{1} << 50), out_of_memory);
  const device_stats after = stats();
  EXPECT_EQ(after.oom_count, 2u);
  // "At once": nothing was synchronized, released or retried.
  EXPECT_EQ(after.alloc_retry_count, 0u);
  EXPECT_EQ(after.device_free_count, before.device_free_count);
  EXPECT_EQ(after.device_free_count, before.device_free_count);
  EXPECT_EQ(after.vm_unmap_count, before.vm_unmap_count);
  EXPECT_EQ(after.reserved_bytes[0].current, i64(30 * MiB));  // the cached 30 MiB stayed
  EXPECT_TRUE(runtime_error_clear());
  check();
  void* q = a.allocate(64 * MiB);
  EXPECT_NE(q, nullptr);
  a.deallocate(q);
}

TEST_P(Allocator, EmptyCacheWaitsForPendingFreesFirst) {
  auto& a = make();
  // Not held: the real stream may be done already; either way empty_cache releases the block.
  void* p = a.allocate(4 * KiB, stream(1));
  a.record_stream(p, stream(2));
  a.deallocate(p);
  a.empty_cache();
  const device_stats s = stats();
  EXPECT_EQ(s.reserved_bytes[0].current, 0);
  EXPECT_EQ(s.events_pending, 0u);
  EXPECT_EQ(s.active_bytes[0].current, 0);
  check();
}

TEST_P(Allocator, EmptyCacheGivesTheMemoryBackToTheDevice) {
  auto& a = make();
  const std::size_t free_at_start = device_free();
  void* keep = a.allocate(4 * KiB);
  std::vector<void*> v;
  for (std::size_t mib : {3, 30, 7, 64}) v.push_back(a.allocate(mib * MiB));
  for (void* p : v) a.deallocate(p);
  const auto cached = static_cast<std::size_t>(reserved() - allocated());
  const std::size_t allocations_before = device_allocations();
  const std::size_t free_before = device_free();
  a.empty_cache();
  const std::size_t free_after = device_free();
  EXPECT_GE(free_after, free_before);
  // Everything but the page or segment `keep` lives in went back.
  const std::size_t held = expandable() ? page() : 2 * MiB;
  EXPECT_EQ(reserved(), i64(held));
  EXPECT_LE(abs_diff(free_after - free_before, cached - (held - 4 * KiB)),
            slack(allocations_before))
      << "the device got " << (free_after - free_before) << " bytes back; " << cached
      << " were cached";
  expect_device_holds_the_reservation(free_at_start);
  a.deallocate(keep);
  a.empty_cache();
  EXPECT_EQ(reserved(), 0);
  EXPECT_LE(abs_diff(device_free(), free_at_start), slack(allocations_before));
  check();
}

TEST_P(Allocator, ReservedMatchesWhatTheDeviceGave) {
  auto& a = make();
  const std::size_t free_at_start = device_free();
  std::vector<void*> v;
  for (int i = 0; i < 20; ++i) v.push_back(a.allocate(3 * MiB));
  for (int i = 0; i < 50; ++i) v.push_back(a.allocate(100 * KiB));
  for (int i = 0; i < 2; ++i) v.push_back(a.allocate(300 * MiB));
  EXPECT_LE(allocated(), reserved());
  expect_device_holds_the_reservation(free_at_start);
  check();
  for (std::size_t i = 0; i < v.size(); i += 2) a.deallocate(v[i]);
  expect_device_holds_the_reservation(free_at_start);
  for (std::size_t i = 1; i < v.size(); i += 2) a.deallocate(v[i]);
  a.empty_cache();
  EXPECT_EQ(reserved(), 0);
  expect_device_holds_the_reservation(free_at_start);
  check();
}

TEST_P(Allocator, MemoryLimitCapsReserved) {
  auto& a = make("memory_limit:50MiB");
  void* p = a.allocate(40 * MiB);
  EXPECT_THROW((void)a.allocate(20 * MiB), out_of_memory);
  expect_reserved_after_a_refusal(40 * MiB);
  a.deallocate(p);
  void* q = a.allocate(50 * MiB);  // the cached 40 MiB is released or reused first
  EXPECT_NE(q, nullptr);
  EXPECT_EQ(reserved(), i64(50 * MiB));
  EXPECT_EQ(stats().reserved_bytes[0].peak, i64(50 * MiB));
  EXPECT_EQ(stats().memory_limit, 50 * MiB);
  EXPECT_TRUE(runtime_error_clear());
  check();
}

TEST_P(Allocator, MemoryFractionIsOfTheDevicesCapacity) {
  // A fraction that caps this device at about 100 MiB, whatever its size.
  const std::size_t total = [&] {
    make();
    return stats().device_total_bytes;
  }();
  const double fraction = static_cast<double>(100 * MiB) / static_cast<double>(total);
  auto& a = make(fmt::format("memory_fraction:{:.17g}", fraction));
  const std::size_t limit = stats().memory_limit;
  EXPECT_EQ(limit, static_cast<std::size_t>(fraction * static_cast<double>(total)));
  EXPECT_LE(abs_diff(limit, 100 * MiB), 1u);
  void* p = a.allocate(64 * MiB);
  EXPECT_THROW((void)a.allocate(64 * MiB), out_of_memory);
  EXPECT_LE(static_cast<std::size_t>(stats().reserved_bytes[0].peak), limit);
  a.deallocate(p);
  check();
}

TEST_P(Allocator, BadPointersAreClearErrorsThatChangeNothing) {
  auto& a = make();
  void* p = a.allocate(4 * KiB);
  void* q = a.allocate(4 * KiB);
  a.deallocate(q);
  const std::string before = a.snapshot_json();
  auto expect_error = [&](auto&& f, const char* needle) {
    try {
      f();
      ADD_FAILURE() << "expected invalid_argument containing " << needle;
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(a.snapshot_json(), before);
    check();
  };
  // Host memory the device never maps: a static (in the binary's data, far from any virtual
  // range). A stack variable is not: under AddressSanitizer the stack is a fake stack mapped next
  // to the simulated device's ranges, and one landed inside its small range.
  static int host = 0;
  expect_error([&] { a.deallocate(&host); }, "not allocated by cucache");
  expect_error([&] { a.deallocate(at(p, 512)); }, "512 bytes into the live allocation");
  expect_error([&] { a.deallocate(q); }, "already freed");
  expect_error([&] { a.deallocate(q, stream(1)); }, "already freed");
  expect_error([&] { a.record_stream(q, stream(2)); }, "record_stream");
  expect_error([&] { a.deallocate(at(q, 1024)); }, "free memory");
  EXPECT_FALSE(a.try_deallocate(q, nullptr, false));
  EXPECT_FALSE(a.try_record_stream(at(p, 512), stream(2)));
  EXPECT_EQ(a.snapshot_json(), before);
  a.deallocate(p);
  check();
}

TEST_P(Allocator, FragmentationIsZeroWhenNothingIsFreeOrReserved) {
  make();
  EXPECT_EQ(stats().external_fragmentation(), 0.0);
  EXPECT_EQ(stats().overhead_fragmentation(), 0.0);
}

// === AllocatorSegments: cudaMalloc'd segments (the default mode) ================================

TEST_P(AllocatorSegments, SmallRequestsShareTwoMebibyteSegments) {
  auto& a = make();
  void* p1 = a.allocate(1 * MiB);
  void* p2 = a.allocate(1 * MiB);
  EXPECT_EQ(stats().device_alloc_count, 1u);
  EXPECT_EQ(addr(p2), addr(p1) + MiB);
  (void)a.allocate(1);
  EXPECT_EQ(stats().device_alloc_count, 2u);  // the first segment is full
  const device_stats s = stats();
  EXPECT_EQ(s.reserved_bytes[1].current, i64(4 * MiB));  // small pool
  EXPECT_EQ(s.reserved_bytes[2].current, 0);
  EXPECT_EQ(s.segment_count[1].current, 2);
  check();
}

TEST_P(AllocatorSegments, LargeSegmentSizes) {
  auto& a = make();
  (void)a.allocate(MiB + 1);  // large pool, under 10 MiB: a 20 MiB segment
  EXPECT_EQ(reserved(), i64(20 * MiB));
  // Other streams, so that the 20 MiB segment's free remainder is not reused.
  (void)a.allocate(10 * MiB, stream(2));  // at 10 MiB: its own segment, rounded to 2 MiB
  EXPECT_EQ(reserved(), i64(30 * MiB));
  (void)a.allocate(11 * MiB + 1, stream(3));  // 11 MiB + 512 -> 12 MiB segment
  EXPECT_EQ(reserved(), i64(42 * MiB));
  EXPECT_EQ(stats().segment_count[2].current, 3);
  EXPECT_EQ(stats().reserved_bytes[1].current, 0);
  check();
}

TEST_P(AllocatorSegments, LargeBlockSplitsOnlyWhenMoreThanOneMebibyteRemains) {
  auto& a = make();
  void* p = a.allocate(19 * MiB);  // 1 MiB would remain: not split
  EXPECT_EQ(a.allocation_size(p), 20 * MiB);
  EXPECT_EQ(allocated(), i64(20 * MiB));
  a.deallocate(p);
  void* q = a.allocate(19 * MiB - 512);  // 1 MiB + 512 would remain: split
  EXPECT_EQ(q, p);
  EXPECT_EQ(a.allocation_size(q), 19 * MiB - 512);
  const device_stats s = stats();
  EXPECT_EQ(s.free_block_count, 1u);
  EXPECT_EQ(s.free_bytes, MiB + 512);
  EXPECT_EQ(s.inactive_split_bytes[0].current, i64(MiB + 512));
  check();
}

TEST_P(AllocatorSegments, SmallBlockSplitsWhenAtLeast512Remain) {
  auto& a = make();
  (void)a.allocate(2 * MiB - 1024);  // large pool (over 1 MiB)
  void* s1 = a.allocate(MiB);
  void* s2 = a.allocate(MiB - 512);  // leaves exactly 512 B: split
  void* s3 = a.allocate(512);        // takes that last 512 B
  EXPECT_EQ(addr(s2), addr(s1) + MiB);
  EXPECT_EQ(addr(s3), addr(s1) + 2 * MiB - 512);
  EXPECT_EQ(stats().segment_count[1].current, 1);
  check();
}

TEST_P(AllocatorSegments, OversizeBlocksAreNeverSplitAndNotTakenByRequestsUnderTheCap) {
  auto& a = make("max_split_size_mb:64");
  void* big = a.allocate(100 * MiB);
  a.deallocate(big);
  EXPECT_EQ(stats().oversize_segments, 1u);
  // A 30 MiB request may not take the cached 100 MiB block. Before growing, the allocator
  // releases that oversize block (no request can use it without splitting it).
  (void)a.allocate(30 * MiB);
  EXPECT_EQ(stats().device_free_count, 1u);
  EXPECT_EQ(reserved(), i64(30 * MiB));
  EXPECT_EQ(stats().oversize_segments, 0u);
  check();
}

TEST_P(AllocatorSegments, RequestsOverTheCapTakeOversizeBlocksWithinTheWasteTolerance) {
  auto& a = make("max_split_size_mb:64");
  void* big = a.allocate(100 * MiB);
  a.deallocate(big);
  void* p = a.allocate(90 * MiB);  // wastes 10 MiB < 20 MiB: taken whole, not split
  EXPECT_EQ(p, big);
  EXPECT_EQ(a.allocation_size(p), 100 * MiB);
  EXPECT_EQ(stats().oversize_allocations, 1u);
  a.deallocate(p);
  void* q = a.allocate(70 * MiB);  // would waste 30 MiB: released, a new segment instead
  EXPECT_EQ(a.allocation_size(q), 70 * MiB);
  EXPECT_EQ(reserved(), i64(70 * MiB));
  check();
}

TEST_P(AllocatorSegments, MaxSplitKeepsReservedAtTheLivePeakOnDynamicShapes) {
  // Growing and shrinking requests over the cap: PyTorch keeps every oversize block it ever
  // cached; cucache releases the ones the next request cannot use.
  auto& a = make("max_split_size_mb:128");
  std::size_t peak_live = 0;
  for (std::size_t mib : {200, 300, 250, 400, 150, 350, 220, 500, 260}) {
    void* p = a.allocate(mib * MiB);
    peak_live = std::max(peak_live, mib * MiB);
    a.deallocate(p);
    check();
  }
  EXPECT_EQ(stats().reserved_bytes[0].peak, i64(peak_live));
  EXPECT_LE(reserved(), i64(peak_live));
}

TEST_P(AllocatorSegments, GarbageCollectionReleasesTheOldestFreeSegmentsAboveTheThreshold) {
  // 0.5 of the 100 MiB limit: 50 MiB.
  auto& a = make("garbage_collection_threshold:0.5,memory_limit:100MiB");
  void* x = a.allocate(20 * MiB);
  void* y = a.allocate(22 * MiB);
  a.deallocate(x);  // older
  a.deallocate(y);  // newer
  // 42 MiB reserved; a new 24 MiB segment would reach 66 MiB > 50 MiB: the oldest free segment
  // (x, 20 MiB) goes first, which brings it to 46 MiB.
  (void)a.allocate(24 * MiB);
  EXPECT_EQ(stats().device_free_count, 1u);
  EXPECT_EQ(reserved(), i64(46 * MiB));
  EXPECT_EQ(a.allocate(22 * MiB), y);  // the newer one stayed cached
  check();
}

TEST_P(AllocatorSegments, EmptyCacheReleasesWholeFreeSegmentsOnly) {
  auto& a = make();
  void* keep = a.allocate(4 * KiB);   // small segment stays (partly used)
  void* gone = a.allocate(30 * MiB);  // large segment, freed below
  void* gone2 = a.allocate(4 * KiB, stream(1));
  a.deallocate(gone);
  a.deallocate(gone2);
  a.empty_cache();
  EXPECT_EQ(reserved(), i64(2 * MiB));
  EXPECT_EQ(stats().device_free_count, 2u);
  EXPECT_EQ(stats().segment_count[0].current, 1);
  a.deallocate(keep);
  a.empty_cache();
  EXPECT_EQ(reserved(), 0);
  EXPECT_EQ(stats().segment_count[0].current, 0);
  check();
}

TEST_P(AllocatorSegments, ExactStatsPeaksAndResets) {
  auto& a = make();
  void* s1 = a.allocate(1000);                 // small: 1024
  void* l1 = a.allocate(3 * MiB);              // large: 20 MiB segment, split
  void* l2 = a.allocate(12 * MiB, stream(2));  // large: own 12 MiB segment
  device_stats s = stats();
  EXPECT_EQ(s.allocated_bytes[0].current, i64(1024 + 15 * MiB));
  EXPECT_EQ(s.allocated_bytes[1].current, 1024);
  EXPECT_EQ(s.allocated_bytes[2].current, i64(15 * MiB));
  EXPECT_EQ(s.reserved_bytes[0].current, i64(34 * MiB));
  EXPECT_EQ(s.segment_count[0].current, 3);
  EXPECT_EQ(s.requested_bytes[0].current, i64(1000 + 15 * MiB));
  EXPECT_EQ(s.device_alloc_count, 3u);
  a.deallocate(l2);
  a.deallocate(l1);
  s = stats();
  EXPECT_EQ(s.allocated_bytes[0].current, 1024);
  EXPECT_EQ(s.allocated_bytes[0].peak, i64(1024 + 15 * MiB));
  EXPECT_EQ(s.allocated_bytes[0].allocated, i64(1024 + 15 * MiB));
  EXPECT_EQ(s.allocated_bytes[0].freed, i64(15 * MiB));
  EXPECT_EQ(s.allocation_count[0].allocated, 3);
  EXPECT_EQ(s.allocation_count[0].freed, 2);
  // Free: 2 MiB - 1 KiB in the small segment, 20 MiB and 12 MiB whole large segments.
  EXPECT_EQ(s.free_bytes, 34 * MiB - 1024);
  EXPECT_EQ(s.largest_free_block, 20 * MiB);
  EXPECT_EQ(s.free_block_count, 3u);
  EXPECT_DOUBLE_EQ(s.external_fragmentation(),
                   1.0 - static_cast<double>(20 * MiB) / static_cast<double>(34 * MiB - 1024));
  EXPECT_DOUBLE_EQ(s.overhead_fragmentation(), 1.0 - 1024.0 / static_cast<double>(34 * MiB));
  a.reset_peak_stats();
  s = stats();
  EXPECT_EQ(s.allocated_bytes[0].peak, 1024);
  EXPECT_EQ(s.reserved_bytes[0].peak, i64(34 * MiB));
  a.reset_accumulated_stats();
  s = stats();
  EXPECT_EQ(s.allocated_bytes[0].allocated, 0);
  EXPECT_EQ(s.allocated_bytes[0].freed, 0);
  EXPECT_EQ(s.device_alloc_count, 0u);
  a.empty_cache();
  s = stats();
  EXPECT_EQ(s.reserved_bytes[0].current, i64(2 * MiB));
  EXPECT_EQ(s.reserved_bytes[0].peak, i64(34 * MiB));
  EXPECT_EQ(s.device_free_count, 2u);
  a.deallocate(s1);
}

TEST_P(AllocatorSegments, MemorySummaryAndSnapshot) {
  auto& a = make();
  void* p = a.allocate(3 * MiB);
  const std::string summary = a.memory_summary();
  for (const char* row :
       {"Allocated memory", "Reserved memory", "Active memory", "Requested memory", "Segments",
        "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed", "from large pool", "from small pool",
        "Fragmentation", "20.00 MiB", "3.00 MiB"}) {
    EXPECT_NE(summary.find(row), std::string::npos) << row << "\n" << summary;
  }
  const nlohmann::json snap = nlohmann::json::parse(a.snapshot_json());
  ASSERT_EQ(snap["segments"].size(), 1u);
  EXPECT_EQ(snap["segments"][0]["size"], 20 * MiB);
  ASSERT_EQ(snap["segments"][0]["blocks"].size(), 2u);
  EXPECT_EQ(snap["segments"][0]["blocks"][0]["state"], "allocated");
  EXPECT_EQ(snap["segments"][0]["blocks"][0]["address"], addr(p));
  EXPECT_EQ(snap["segments"][0]["blocks"][1]["state"], "free");
  a.deallocate(p);
}

// === AllocatorExpandable: expandable segments, in pages of the device's granularity =============
// The tests that count handles ask for one handle per page (coarse_handles:0), where an idle page
// pins nothing but itself; the others run the default (coarse handles). `pg` below is the
// device's page.

TEST_P(AllocatorExpandable, MapsOnlyTheMissingPagesOneHandlePerPage) {
  auto& a = make("coarse_handles:0");
  const std::size_t pg = page();
  void* p = a.allocate(pg + pg / 2);  // pages 0-1 of the large range
  device_stats s = stats();
  EXPECT_EQ(s.device_alloc_count, 2u);
  EXPECT_EQ(s.vm_map_count, 2u);
  EXPECT_EQ(s.reserved_bytes[0].current, i64(2 * pg));
  void* q = a.allocate(pg + pg / 2);  // [1.5, 3) pages: page 1 is mapped, page 2 is not
  EXPECT_EQ(addr(q), addr(p) + pg + pg / 2);
  s = stats();
  EXPECT_EQ(s.device_alloc_count, 3u);
  EXPECT_EQ(s.reserved_bytes[0].current, i64(3 * pg));
  a.deallocate(p);
  void* r = a.allocate(3 * pg / 4);  // into the hole at page 0: no device call at all
  EXPECT_EQ(r, p);
  EXPECT_EQ(stats().device_alloc_count, 3u);
  EXPECT_EQ(stats().vm_map_count, 3u);
  // A 10-page run at pages [3, 13): ten handles.
  void* big = a.allocate(10 * pg);
  EXPECT_EQ(addr(big), addr(q) + pg + pg / 2);
  EXPECT_EQ(stats().device_alloc_count, 13u);
  EXPECT_EQ(reserved(), i64(13 * pg));
  check();
}

TEST_P(AllocatorExpandable, AnIdlePageIsUsedInPlaceAndTheRestStayMapped) {
  auto& a = make();
  const std::size_t pg = page();
  void* x = a.allocate(10 * pg);  // pages 0-9: ten handles
  void* y = a.allocate(pg);       // page 10
  a.deallocate(x);
  // Pages 0-1 at the hole's front, used in place; pages 2-9 stay mapped, idle: no VM call.
  const std::uint64_t maps = stats().vm_map_count;
  void* z = a.allocate(2 * pg);
  EXPECT_EQ(z, x);
  const device_stats s = stats();
  EXPECT_EQ(s.vm_map_count, maps);
  EXPECT_EQ(s.device_free_count, 0u);
  EXPECT_EQ(s.vm_split_count, 0u);
  EXPECT_EQ(s.stitched_pages, 0u);
  EXPECT_EQ(s.reserved_bytes[0].current, i64(11 * pg));
  (void)y;
  check();
}

TEST_P(AllocatorExpandable, SplitsFreelyAndIgnoresTheSplitCap) {
  auto& a = make("max_split_size_mb:64");
  void* p = a.allocate(19 * MiB);  // a cudaMalloc'd segment would waste 1 MiB here
  EXPECT_EQ(a.allocation_size(p), 19 * MiB);
  a.deallocate(p);
  void* q = a.allocate(100 * MiB);
  a.deallocate(q);
  void* r = a.allocate(30 * MiB);  // takes the front of the 100 MiB hole
  EXPECT_EQ(r, p);
  EXPECT_EQ(stats().oversize_segments, 0u);
  check();
}

TEST_P(AllocatorExpandable, UnderALimitStitchesIdlePagesInsteadOfCreatingMemory) {
  const std::size_t pg = [&] {
    make("coarse_handles:0");
    return page();
  }();
  auto& a = make(fmt::format("coarse_handles:0,memory_limit:{}MiB", 12 * pg / MiB));
  void* x = a.allocate(4 * pg);  // pages 0-3
  void* y = a.allocate(4 * pg);  // pages 4-7
  a.deallocate(x);               // pages 0-3 idle
  void* z = a.allocate(8 * pg);  // pages 8-15: 4 moved from the hole, 4 created
  EXPECT_EQ(addr(z), addr(y) + 4 * pg);
  const device_stats s = stats();
  // 8 new pages would pass the limit (8 + 8 > 12), so x's idle pages are moved, one by one,
  // until the rest may be created: all four, then 4 created.
  EXPECT_EQ(s.stitched_pages, 4u);
  EXPECT_EQ(s.vm_unmap_count, 4u);
  EXPECT_EQ(s.device_alloc_count, 12u);
  EXPECT_EQ(s.reserved_bytes[0].current, i64(12 * pg));
  EXPECT_EQ(s.reserved_bytes[0].peak, i64(12 * pg));  // = the live peak
  check();
}

TEST_P(AllocatorExpandable, EmptyCacheUnmapsAndReleasesIdleMemory) {
  auto& a = make();
  const std::size_t free_at_start = device_free();
  void* keep = a.allocate(5 * MiB);
  void* drop = a.allocate(40 * MiB);
  a.deallocate(drop);
  a.empty_cache();
  // What keep's pages need stays mapped; every idle page goes.
  device_stats s = stats();
  EXPECT_EQ(s.mapped_bytes, static_cast<std::size_t>(s.reserved_bytes[0].current));
  EXPECT_EQ(s.unmapped_handle_bytes, 0u);
  EXPECT_LE(s.reserved_bytes[0].current, i64(5 * MiB + 2 * page()));
  expect_device_holds_the_reservation(free_at_start);
  a.deallocate(keep);
  a.empty_cache();
  s = stats();
  EXPECT_EQ(s.reserved_bytes[0].current, 0);
  EXPECT_EQ(s.mapped_bytes, 0u);
  EXPECT_EQ(s.device_alloc_count, s.device_free_count);
  EXPECT_EQ(s.vm_map_count, s.vm_unmap_count);
  expect_device_holds_the_reservation(free_at_start);
  check();
}

TEST_P(AllocatorExpandable, OutOfMemoryIsReportedAndRecoveredFromByMovingIdlePages) {
  auto& a = make("", 64 * MiB);
  void* p = a.allocate(40 * MiB);
  EXPECT_THROW((void)a.allocate(30 * MiB), out_of_memory);
  EXPECT_TRUE(runtime_error_clear());
  check();
  EXPECT_EQ(stats().mapped_bytes + stats().unmapped_handle_bytes,
            static_cast<std::size_t>(reserved()));
  EXPECT_THROW((void)a.allocate(std::size_t{1} << 40), out_of_memory);
  a.deallocate(p);
  void* q = a.allocate(60 * MiB);  // the idle 40 MiB is moved, 20 MiB is created
  EXPECT_NE(q, nullptr);
  EXPECT_EQ(reserved(), i64(60 * MiB));
  EXPECT_EQ(stats().oom_count, 2u);
  check();
}

TEST_P(AllocatorExpandable, SmallRequestsPackIntoTheSmallRange) {
  auto& a = make();
  const std::size_t pg = page();
  std::vector<void*> v;
  const std::size_t n = pg / 512;  // one page of 512 B blocks
  for (std::size_t i = 0; i < n; ++i) v.push_back(a.allocate(512));
  EXPECT_EQ(addr(v.back()), addr(v.front()) + (n - 1) * 512);
  EXPECT_EQ(reserved(), i64(pg));
  EXPECT_EQ(stats().reserved_bytes[1].current, i64(pg));
  for (void* p : v) a.deallocate(p);
  check();
}

TEST_P(AllocatorExpandable, MemoryLimitMovesIdleMemoryBeforeRefusing) {
  auto& a = make("memory_limit:32MiB");
  void* p = a.allocate(20 * MiB, stream(1));
  a.deallocate(p);
  void* q = a.allocate(30 * MiB, stream(2));  // the ladder moves stream 1's idle pages
  EXPECT_NE(q, nullptr);
  EXPECT_LE(stats().reserved_bytes[0].peak, i64(32 * MiB));
  EXPECT_THROW((void)a.allocate(4 * MiB, stream(2)), out_of_memory);
  check();
}

TEST_P(AllocatorExpandable, AGrowingBufferFitsInTwoBuffersUnderALimit) {
  // A KV cache grown by concatenation: the new buffer is allocated while the old one is live,
  // then the old one is freed. Best fit leapfrogs; under a limit of two buffers (plus the pin
  // and boundary pages) the pages each new buffer lacks are moved from the hole the one before
  // left, and nothing runs out of memory.
  const std::size_t pg = [&] {
    make();
    return page();
  }();
  auto& a = make(fmt::format("memory_limit:{}MiB", (2 * 12 * pg + 4 * pg) / MiB));
  void* pin = a.allocate(pg / 2 + 512);  // something live below, as in a real program
  void* cache = a.allocate(10 * pg);
  for (std::size_t step = 1; step <= 64; ++step) {
    void* grown = a.allocate(10 * pg + step * pg / 32);
    a.deallocate(cache);
    cache = grown;
  }
  check();
  const device_stats s = stats();
  EXPECT_EQ(s.oom_count, 0u);
  EXPECT_LE(s.reserved_bytes[0].peak, i64(2 * 12 * pg + 4 * pg));
  EXPECT_GT(s.stitched_pages, 0u);
  a.deallocate(cache);
  a.deallocate(pin);
}

TEST_P(AllocatorExpandable, ExactStatsAfterAKnownSequence) {
  auto& a = make("coarse_handles:0");
  const std::size_t pg = page();
  void* s1 = a.allocate(1000);               // small range: 1024 B on its first page
  void* l1 = a.allocate(3 * pg / 2);         // large range: pages 0-1
  void* l2 = a.allocate(4 * pg, stream(2));  // stream 2's range: 4 pages
  device_stats s = stats();
  EXPECT_EQ(s.allocated_bytes[0].current, i64(1024 + 3 * pg / 2 + 4 * pg));
  EXPECT_EQ(s.allocated_bytes[1].current, 1024);
  EXPECT_EQ(s.requested_bytes[0].current, i64(1000 + 3 * pg / 2 + 4 * pg));
  EXPECT_EQ(s.reserved_bytes[0].current, i64(7 * pg));
  EXPECT_EQ(s.reserved_bytes[1].current, i64(pg));
  EXPECT_EQ(s.mapped_bytes, 7 * pg);
  EXPECT_EQ(s.allocation_count[0].current, 3);
  // One handle per page: 1 small, 2 for l1, 4 for l2.
  EXPECT_EQ(s.device_alloc_count, 1u + 2u + 4u);
  EXPECT_EQ(s.vm_map_count, 7u);
  a.deallocate(l2);
  a.deallocate(l1);
  s = stats();
  EXPECT_EQ(s.allocated_bytes[0].current, 1024);
  EXPECT_EQ(s.allocated_bytes[0].peak, i64(1024 + 3 * pg / 2 + 4 * pg));
  EXPECT_EQ(s.allocated_bytes[0].freed, i64(3 * pg / 2 + 4 * pg));
  EXPECT_EQ(s.allocation_count[0].freed, 2);
  EXPECT_EQ(s.reserved_bytes[0].current, i64(7 * pg));  // idle pages stay mapped
  EXPECT_EQ(s.free_bytes, 7 * pg - 1024);
  a.reset_peak_stats();
  EXPECT_EQ(stats().allocated_bytes[0].peak, 1024);
  EXPECT_EQ(stats().reserved_bytes[0].peak, i64(7 * pg));
  a.empty_cache();
  s = stats();
  EXPECT_EQ(s.reserved_bytes[0].current, i64(pg));  // the page s1 lives on
  EXPECT_EQ(s.device_free_count, 6u);
  EXPECT_EQ(s.vm_unmap_count, 6u);
  a.deallocate(s1);
  check();
}

TEST_P(AllocatorExpandable, SnapshotAndSummaryShowMappedAndUnmappedParts) {
  auto& a = make();
  const std::size_t pg = page();
  void* x = a.allocate(3 * pg / 2);  // pages 0-1: two one-page handles
  void* y = a.allocate(pg);          // [1.5, 2.5) pages: page 2 added
  a.deallocate(y);                   // page 2 idle (page 1 is shared with x)
  const nlohmann::json snap = nlohmann::json::parse(a.snapshot_json());
  ASSERT_EQ(snap["segments"].size(), 1u);
  const nlohmann::json& range = snap["segments"][0];
  EXPECT_TRUE(range["expandable"].get<bool>());
  EXPECT_EQ(range["mapped_bytes"], 3 * pg);
  EXPECT_EQ(range["unmapped_bytes"], range["size"].get<std::size_t>() - 3 * pg);
  ASSERT_EQ(range["mappings"].size(), 3u);
  EXPECT_EQ(range["mappings"][0]["address"], addr(x));
  EXPECT_EQ(range["mappings"][2]["idle"], true);
  EXPECT_EQ(snap["stats"]["device_alloc_count"], 3u);
  const std::string summary = a.memory_summary();
  const std::string mapped = detail::format_bytes(static_cast<double>(3 * pg));
  EXPECT_NE(summary.find("Expandable: " + mapped + " mapped"), std::string::npos) << summary;
  EXPECT_NE(summary.find("device allocs: 3 "), std::string::npos) << summary;  // cuMemCreate
  EXPECT_NE(summary.find("Pager host time: "), std::string::npos) << summary;
  a.deallocate(x);
}

// === instances ===================================================================================

INSTANTIATE_TEST_SUITE_P(CUCACHE_SUITE_DEVICE, Allocator,
                         ::testing::Values(mode::segments, mode::expandable), mode_name);
INSTANTIATE_TEST_SUITE_P(CUCACHE_SUITE_DEVICE, AllocatorSegments, ::testing::Values(mode::segments),
                         mode_name);
INSTANTIATE_TEST_SUITE_P(CUCACHE_SUITE_DEVICE, AllocatorExpandable,
                         ::testing::Values(mode::expandable), mode_name);

}  // namespace
}  // namespace cucache::test
