// Rules of device_allocator that only the simulated device can check: its exact addresses, the
// device calls it counts, injected device failures, and host memory behind every block. The
// caching rules themselves (rounding, pools, splitting, best fit, streams, the out-of-memory
// ladder, limits, garbage collection, bad pointers, stats) are in the typed suite,
// allocator_suite.cpp, which runs them on the simulated device and on a real GPU, in both modes.
#include "cucache/device_allocator.hpp"

#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cucache/errors.hpp"
#include "cucache/forwarding_backend.hpp"
#include "cucache/sim_backend.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

TEST(SimAddresses, AScenarioStartsAtTheDevicesFirstAddress) {
  sim_allocator a;
  void* p1 = a.alloc.allocate(1);
  void* p2 = a.alloc.allocate(513);
  EXPECT_EQ(addr(p1), k_base);
  EXPECT_EQ(addr(p2), k_base + 512);
  EXPECT_EQ(a.mallocs(), 1u);
  a.alloc.check_invariants();
}

TEST(SimCalls, SizeZeroMakesNoDeviceCall) {
  sim_allocator a;
  EXPECT_EQ(a.alloc.allocate(0), nullptr);
  a.alloc.deallocate(nullptr);
  for (std::size_t k = 0; k < k_sim_call_kinds; ++k) {
    const auto kind = static_cast<sim_call>(k);
    // The constructor reads the capacity, in relaxed capture mode.
    if (kind == sim_call::mem_get_info || kind == sim_call::exchange_capture_mode) continue;
    EXPECT_EQ(a.sim->calls(kind), 0u) << to_string(kind);
  }
}

TEST(SimCalls, OnlyAnotherStreamGetsAnEvent) {
  sim_allocator a;
  void* p = a.alloc.allocate(4 * KiB, stream(1));
  a.alloc.record_stream(p, stream(2));
  a.alloc.record_stream(p, stream(1));  // its own stream: nothing to wait for
  a.alloc.deallocate(p);
  EXPECT_EQ(a.sim->calls(sim_call::event_record), 1u);
  EXPECT_EQ(a.sim->pending_events(), 1u);
  a.sim->complete_stream(stream(2));
  EXPECT_EQ(a.alloc.allocate(4 * KiB, stream(1)), p);
}

TEST(SimCalls, EventsAreRecycled) {
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

TEST(SimCalls, TheLadderSynchronizesThePendingEventAndTheDeviceGivesTheAddressBack) {
  sim_options o;
  o.capacity_bytes = 100 * MiB;
  sim_allocator a({}, o);
  void* p = a.alloc.allocate(60 * MiB, stream(1));
  a.alloc.record_stream(p, stream(2));
  a.alloc.deallocate(p);  // pending on stream 2's event
  void* q = a.alloc.allocate(60 * MiB, stream(1));
  EXPECT_EQ(a.sim->calls(sim_call::event_synchronize), 1u);
  EXPECT_EQ(a.frees(), 1u);  // p's segment was released...
  EXPECT_EQ(q, p);           // ...and the simulated device hands its first fit out again
  a.alloc.check_invariants();
}

TEST(SimCalls, EmptyCacheLeavesTheDeviceHoldingOnlyWhatIsLive) {
  sim_allocator a;
  void* keep = a.alloc.allocate(4 * KiB);
  void* gone = a.alloc.allocate(30 * MiB);
  a.alloc.deallocate(gone);
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 2 * MiB);
  EXPECT_EQ(a.sim->live_segments(), 1u);
  a.alloc.deallocate(keep);
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->live_segments(), 0u);
}

// --- injected failures --------------------------------------------------------------------------

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

// --- contents -----------------------------------------------------------------------------------

// A backend that hands out memory it handed out before (its second segment 1 MiB into its first):
// the allocation that got it fails with an error that says so, that memory goes back to the
// backend, and nothing else changes -- the first block, the statistics, the next allocation.
class overlapping_backend : public forwarding_backend {
 public:
  using forwarding_backend::forwarding_backend;
  void* segment_malloc(std::size_t bytes) override {
    void* p = forwarding_backend::segment_malloc(bytes);
    if (p == nullptr || ++calls_ != 2) return p;
    real_ = p;
    return static_cast<char*>(first_) + MiB;
  }
  void segment_free(void* ptr) override {
    if (ptr == static_cast<char*>(first_) + MiB && real_ != nullptr) {
      ptr = std::exchange(real_, nullptr);
      ++bogus_freed_;
    }
    forwarding_backend::segment_free(ptr);
  }
  void* first_ = nullptr;  // set by the test: the first segment
  void* real_ = nullptr;   // what the bogus answer stands for
  int bogus_freed_ = 0;

 private:
  int calls_ = 0;
};

TEST(BadBackend, MemoryHandedOutTwiceIsRefusedAndGivenBack) {
  auto sim = std::make_shared<sim_backend>();
  auto bad = std::make_shared<overlapping_backend>(sim);
  device_allocator alloc(bad, config{});
  void* a = alloc.allocate(MiB);  // a 2 MiB small segment
  bad->first_ = a;
  try {
    (void)alloc.allocate(4 * MiB);  // a large segment: the backend's bogus answer
    FAIL() << "the overlapping segment was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("overlaps the live segment"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(bad->bogus_freed_, 1);
  EXPECT_EQ(alloc.stats().reserved_bytes[0].current, static_cast<std::int64_t>(2 * MiB));
  EXPECT_EQ(sim->used_bytes(), 2 * MiB);
  EXPECT_EQ(alloc.allocation_size(a), MiB);
  alloc.check_invariants();
  void* b = alloc.allocate(4 * MiB);  // the backend behaves again
  alloc.check_invariants();
  alloc.deallocate(b);
  alloc.deallocate(a);
  alloc.empty_cache();
  EXPECT_EQ(sim->used_bytes(), 0u);
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
