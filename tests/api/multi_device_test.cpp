// Several devices through the global APIs, on two simulated devices (CUCACHE_SIM_DEVICES=2):
// a free and a record_stream of another device's pointer through the C API, per-device stats and
// memory summaries, out of memory on one device leaving the other untouched, and 8 threads on 2
// devices checking block contents on host-backed simulated memory. (The owner search itself is
// front_end_conformance_test's FreeFindsTheOwnerOfAnotherDevicesPointer; the caller's current
// device, which the sim does not have, is tests/gpu/multi_gpu_test.cu's.)
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "api/registry.hpp"
#include "cucache/cucache.h"
#include "cucache/cucache.hpp"
#include "cucache/errors.hpp"
#include "cucache/sim_backend.hpp"
#include "support/sim_registry.hpp"

namespace cucache {
namespace {

using test::fake_stream;
using test::MiB;

class MultiDevice : public ::testing::Test {
 protected:
  void SetUp() override {
    ::setenv("CUCACHE_SIM_DEVICES", "2", 1);
    ::setenv("CUCACHE_SIM_HOST_MEMORY", "1", 1);
    test::use_sim_registry();
  }
  void TearDown() override {
    detail::reset_for_testing();
    ::unsetenv("CUCACHE_SIM_DEVICES");
    ::unsetenv("CUCACHE_SIM_HOST_MEMORY");
  }
  static sim_backend& sim(int d) { return dynamic_cast<sim_backend&>(get(d).backend()); }
  static cucacheStats stats(int d) {
    cucacheStats s{};
    EXPECT_EQ(cucacheGetStats(d, &s), cudaSuccess) << cucacheGetLastErrorMessage();
    return s;
  }
};

bool same(const cucacheStats& a, const cucacheStats& b) {
  return a.allocatedBytes == b.allocatedBytes && a.allocatedBytesPeak == b.allocatedBytesPeak &&
         a.reservedBytes == b.reservedBytes && a.reservedBytesPeak == b.reservedBytesPeak &&
         a.activeBytes == b.activeBytes && a.requestedBytes == b.requestedBytes &&
         a.cachedFreeBytes == b.cachedFreeBytes && a.allocationCount == b.allocationCount &&
         a.segmentCount == b.segmentCount && a.deviceAllocCount == b.deviceAllocCount &&
         a.deviceFreeCount == b.deviceFreeCount && a.oomCount == b.oomCount &&
         a.allocRetryCount == b.allocRetryCount;
}

TEST_F(MultiDevice, RecordStreamAndFreeOfAnotherDevicesPointerThroughTheCApi) {
  // The sim's current device is always 0: device 1's block comes from its allocator.
  void* p = get(1).allocate(4 * MiB, fake_stream(1));
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(cucacheRecordStream(p, reinterpret_cast<cudaStream_t>(fake_stream(2))), cudaSuccess)
      << cucacheGetLastErrorMessage();
  EXPECT_EQ(cucacheFree(p), cudaSuccess) << cucacheGetLastErrorMessage();
  cucacheStats s1 = stats(1);
  EXPECT_EQ(s1.allocationCount, 0u);
  EXPECT_EQ(s1.activeBytes, 4 * MiB) << "pending until stream 2 catches up";
  EXPECT_EQ(sim(1).pending_events(), 1u);
  EXPECT_EQ(sim(0).calls(sim_call::event_record), 0u) << "device 0 recorded nothing";
  // Not reusable on its stream until then.
  void* q = get(1).allocate(4 * MiB, fake_stream(1));
  EXPECT_NE(q, p);
  sim(1).complete_stream(fake_stream(2));
  void* r = get(1).allocate(4 * MiB, fake_stream(1));
  EXPECT_EQ(r, p);
  // A stream-ordered free of device 1's pointer, through the C API as well.
  EXPECT_EQ(cucacheFreeAsync(q, reinterpret_cast<cudaStream_t>(fake_stream(3))), cudaSuccess)
      << cucacheGetLastErrorMessage();
  EXPECT_EQ(cucacheFree(r), cudaSuccess);
  EXPECT_EQ(cucacheFree(r), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheRecordStream(r, nullptr), cudaErrorInvalidValue);
  s1 = stats(1);
  EXPECT_EQ(s1.allocationCount, 0u);
  EXPECT_EQ(s1.activeBytes, 4 * MiB) << "q waits for stream 3";
  const cucacheStats s0 = stats(0);
  EXPECT_EQ(s0.allocationCount, 0u);
  EXPECT_EQ(s0.reservedBytes, 0u);
  EXPECT_EQ(s0.deviceAllocCount, 0u);
  get(0).check_invariants();
  get(1).check_invariants();
}

TEST_F(MultiDevice, ABadFreeOfAnotherDevicesPointerNamesThatDevice) {
  // The current device is 0 (its allocator exists); the pointer is device 1's, already freed.
  get(0).deallocate(get(0).allocate(MiB));
  void* p = get(1).allocate(4 * MiB, fake_stream(1));
  ASSERT_EQ(cucacheFree(p), cudaSuccess) << cucacheGetLastErrorMessage();
  EXPECT_EQ(cucacheFree(p), cudaErrorInvalidValue);
  std::string why = cucacheGetLastErrorMessage();
  EXPECT_NE(why.find("on device 1: it was already freed"), std::string::npos) << why;
  EXPECT_NE(why.find("device 1's memory"), std::string::npos) << why;
  EXPECT_EQ(why.find("not allocated by cucache"), std::string::npos) << why;
  // cucacheFree takes no device: the text names the current device as such, never "the call was
  // for device 0" (issue 30 item 10).
  EXPECT_EQ(why.find("the call was for device"), std::string::npos) << why;
  EXPECT_NE(why.find("the current device is 0"), std::string::npos) << why;
  // An interior pointer of device 1's live allocation, through the C++ API.
  void* q = get(1).allocate(4 * MiB, fake_stream(1));
  try {
    cucache::free(static_cast<char*>(q) + 256);
    ADD_FAILURE() << "an interior free succeeded";
  } catch (const invalid_argument& e) {
    why = e.what();
    EXPECT_NE(why.find("on device 1: it points 256 bytes into the live allocation"),
              std::string::npos)
        << why;
  }
  // Memory of no device: said so, without claiming the call was for the current device.
  int host = 0;
  EXPECT_EQ(cucacheFree(&host), cudaErrorInvalidValue);
  why = cucacheGetLastErrorMessage();
  EXPECT_NE(why.find("is not a live allocation of any device"), std::string::npos) << why;
  EXPECT_EQ(why.find("on device 0"), std::string::npos) << why;
  EXPECT_EQ(cucacheRecordStream(&host, nullptr), cudaErrorInvalidValue);
  why = cucacheGetLastErrorMessage();
  EXPECT_NE(why.find("record_stream("), std::string::npos) << why;
  EXPECT_NE(why.find("is not a live allocation of any device"), std::string::npos) << why;
  get(1).deallocate(q);
}

TEST_F(MultiDevice, StatsAndSummariesArePerDevice) {
  void* a = get(0).allocate(1000);
  void* b = get(1).allocate(5 * MiB);
  void* c = get(1).allocate(5 * MiB);
  const cucacheStats s0 = stats(0);
  const cucacheStats s1 = stats(1);
  EXPECT_EQ(s0.allocatedBytes, 1024u);
  EXPECT_EQ(s0.reservedBytes, 2 * MiB);
  EXPECT_EQ(s0.allocationCount, 1u);
  EXPECT_EQ(s0.segmentCount, 1u);
  EXPECT_EQ(s1.allocatedBytes, 10 * MiB);
  EXPECT_EQ(s1.reservedBytes, 20 * MiB);
  EXPECT_EQ(s1.allocationCount, 2u);
  EXPECT_EQ(s1.segmentCount, 1u);
  std::array<char, 8192> text{};
  ASSERT_GT(cucacheMemorySummary(1, text.data(), text.size()), 0u);
  const std::string t1 = text.data();
  EXPECT_NE(t1.find("device 1 (sim)"), std::string::npos) << t1;
  EXPECT_NE(t1.find("device allocs: 1 "), std::string::npos) << t1;
  ASSERT_GT(cucacheMemorySummary(0, text.data(), text.size()), 0u);
  EXPECT_NE(std::string(text.data()).find("device 0 (sim)"), std::string::npos);
  EXPECT_EQ(cucacheMemorySummary(2, text.data(), text.size()), 0u);
  EXPECT_NE(std::string(cucacheGetLastErrorMessage()).find("invalid device ordinal 2"),
            std::string::npos)
      << cucacheGetLastErrorMessage();
  // Resetting one device's peaks leaves the other's.
  cucache::free(c);
  EXPECT_EQ(cucacheResetPeakStats(1), cudaSuccess);
  EXPECT_EQ(stats(1).allocatedBytesPeak, 5 * MiB);
  EXPECT_EQ(stats(0).allocatedBytesPeak, 1024u);
  cucache::free(a);
  cucache::free(b);
}

TEST_F(MultiDevice, OutOfMemoryOnOneDeviceLeavesTheOtherUntouched) {
  void* a = get(0).allocate(8 * MiB);
  void* b = get(1).allocate(8 * MiB);
  sim(1).set_capacity(64 * MiB);
  const cucacheStats before0 = stats(0);
  const cucacheStats before1 = stats(1);
  EXPECT_THROW((void)get(1).allocate(100 * MiB), out_of_memory);
  EXPECT_TRUE(same(stats(0), before0)) << "device 0's statistics changed";
  EXPECT_EQ(sim(0).calls(sim_call::segment_malloc), 1u) << "device 0 was asked for nothing";
  EXPECT_EQ(sim(0).calls(sim_call::segment_free), 0u);
  const cucacheStats after1 = stats(1);
  EXPECT_EQ(after1.oomCount, before1.oomCount + 1);
  EXPECT_EQ(after1.allocationCount, 1u) << "device 1's live block survives its OOM";
  EXPECT_EQ(get(1).allocation_size(b), 8 * MiB);
  // Device 0 still serves what device 1 cannot.
  void* big = get(0).allocate(100 * MiB);
  EXPECT_NE(big, nullptr);
  EXPECT_EQ(stats(1).oomCount, before1.oomCount + 1);
  cucache::free(big);
  cucache::free(a);
  cucache::free(b);
  get(0).check_invariants();
  get(1).check_invariants();
}

TEST_F(MultiDevice, EightThreadsOnTwoDevicesKeepEveryBlocksContents) {
  constexpr int k_threads = 8;
  constexpr int k_ops = 3000;
  // Create both allocators first, so every thread's backend exists.
  (void)get(0);
  (void)get(1);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < k_threads; ++t) {
    threads.emplace_back([t, &failures] {
      const int device = t % 2;
      sim_backend& s = sim(device);
      device_allocator& a = get(device);
      const stream_handle stream = fake_stream(static_cast<std::uintptr_t>(t + 1));
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) * 7919 + 1);
      struct live {
        void* p;
        std::size_t n;
        unsigned char tag;
      };
      std::vector<live> held;
      const auto check_and_free = [&](std::size_t i, int op) {
        const live l = held[i];
        const std::byte* h = s.host_view(l.p, l.n);
        if (h == nullptr || h[0] != std::byte{l.tag} || h[l.n / 2] != std::byte{l.tag} ||
            h[l.n - 1] != std::byte{l.tag}) {
          failures.fetch_add(1);
        }
        // Alternate the front ends: the C API's free and the C++ one find the owner themselves.
        if (op % 2 == 0) {
          if (cucacheFree(l.p) != cudaSuccess) failures.fetch_add(1);
        } else {
          cucache::free(l.p);
        }
        held[i] = held.back();
        held.pop_back();
      };
      for (int op = 0; op < k_ops; ++op) {
        if (held.size() >= 16 || (!held.empty() && rng() % 3 == 0)) {
          check_and_free(static_cast<std::size_t>(rng() % held.size()), op);
          continue;
        }
        const std::size_t n = 1 + rng() % (rng() % 4 == 0 ? 12 * MiB : 64 * 1024);
        void* p = a.allocate(n, stream);
        const auto tag = static_cast<unsigned char>((t << 5) ^ op);
        std::byte* h = s.host_view(p, n);
        if (h == nullptr) {
          failures.fetch_add(1);
          cucache::free(p);
          continue;
        }
        std::memset(h, tag, n);
        held.push_back({p, n, tag});
      }
      while (!held.empty()) check_and_free(held.size() - 1, 0);
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  for (int d = 0; d < 2; ++d) {
    get(d).check_invariants();
    EXPECT_EQ(stats(d).allocationCount, 0u) << "device " << d;
    EXPECT_EQ(stats(d).allocatedBytes, 0u) << "device " << d;
    EXPECT_GT(stats(d).deviceAllocCount, 0u) << "device " << d << " was used";
  }
}

}  // namespace
}  // namespace cucache
