// Tests of the C API (cucache.h) on the simulated device (CUCACHE_BACKEND=sim): every function,
// every error code it documents, exact statistics after a known sequence, the thread-local error
// message, the C++ template overloads, and the header compiled as C (c_header_check.c). What every
// front end must do alike is in front_end_conformance_test.cpp.
#include "cucache/cucache.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "api/registry.hpp"
#include "cucache/cucache.hpp"
#include "cucache/cuda_backend.hpp"
#include "cucache/sim_backend.hpp"
#include "support/sim_registry.hpp"

extern "C" int cucache_c_header_check(void);

namespace {

using cucache::test::MiB;
constexpr std::size_t k_sim_capacity = std::size_t{80} << 30;  // sim_options' default

constexpr auto fake_stream = &cucache::test::fake_stream<cudaStream_t>;

class CApi : public ::testing::Test {
 protected:
  void SetUp() override { restore(); }
  void TearDown() override { restore(); }
  static void restore() { cucache::test::use_sim_registry(); }
  static cucacheStats stats(int device = 0) {
    cucacheStats s{};
    EXPECT_EQ(cucacheGetStats(device, &s), cudaSuccess) << cucacheGetLastErrorMessage();
    return s;
  }
  static std::string message() { return cucacheGetLastErrorMessage(); }
};

TEST_F(CApi, HeaderCompilesAndWorksAsC) {
  EXPECT_EQ(cucache_c_header_check(), 0);
}

TEST_F(CApi, RuntimeShapedEdgeCases) {
  EXPECT_EQ(cucacheMalloc(nullptr, 16), cudaErrorInvalidValue);
  EXPECT_NE(message().find("devPtr is NULL"), std::string::npos) << message();
  EXPECT_EQ(cucacheMallocAsync(nullptr, 16, nullptr), cudaErrorInvalidValue);

  void* p = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(cucacheMalloc(&p, 0), cudaSuccess);
  EXPECT_EQ(p, nullptr);
  p = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(cucacheMallocAsync(&p, 0, fake_stream(1)), cudaSuccess);
  EXPECT_EQ(p, nullptr);

  EXPECT_EQ(cucacheFree(nullptr), cudaSuccess);
  EXPECT_EQ(cucacheFreeAsync(nullptr, fake_stream(1)), cudaSuccess);
  EXPECT_EQ(cucacheRecordStream(nullptr, fake_stream(1)), cudaErrorInvalidValue);
}

TEST_F(CApi, BadPointersAreInvalidValues) {
  int local = 0;
  // Before anything was allocated.
  EXPECT_EQ(cucacheFree(&local), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheFreeAsync(&local, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheRecordStream(&local, nullptr), cudaErrorInvalidValue);

  char* p = nullptr;
  ASSERT_EQ(cucacheMalloc(&p, 4096), cudaSuccess);        // the C++ template overload
  EXPECT_EQ(cucacheFree(&local), cudaErrorInvalidValue);  // unknown
  EXPECT_NE(message().find("cucacheFree: "), std::string::npos) << message();
  EXPECT_EQ(cucacheFree(p + 1024), cudaErrorInvalidValue);  // interior
  EXPECT_NE(message().find("1024 bytes into"), std::string::npos) << message();
  EXPECT_EQ(cucacheFreeAsync(p + 1024, fake_stream(1)), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheRecordStream(p + 1024, fake_stream(1)), cudaErrorInvalidValue);
  EXPECT_EQ(stats().allocationCount, 1u);  // untouched by the failures
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
  EXPECT_EQ(cucacheFree(p), cudaErrorInvalidValue);  // double free
  EXPECT_NE(message().find("already freed"), std::string::npos) << message();
  EXPECT_EQ(cucacheFreeAsync(p, fake_stream(1)), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheRecordStream(p, fake_stream(1)), cudaErrorInvalidValue);
  cucache::get().check_invariants();
}

TEST_F(CApi, OutOfMemoryIsMemoryAllocationWithTheReport) {
  ::setenv("CUCACHE_CONF", "memory_limit:64MiB", 1);
  cucache::detail::reset_for_testing();
  void* p = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(cucacheMalloc(&p, 100 * MiB), cudaErrorMemoryAllocation);
  EXPECT_EQ(p, nullptr);  // cleared on failure
  const std::string report = message();
  EXPECT_EQ(report.rfind("cucacheMalloc: cucache: out of memory", 0), 0u) << report;
  EXPECT_NE(report.find("memory limit"), std::string::npos) << report;
  EXPECT_EQ(cucacheMallocAsync(&p, k_sim_capacity * 2, fake_stream(2)), cudaErrorMemoryAllocation);
  EXPECT_EQ(stats().oomCount, 2u);
}

TEST_F(CApi, HugeSizesAreMemoryAllocationErrorsWithNothingChangedInEveryModeAndConfig) {
  // The sizes and the top of the size_t range: with roundup_power2_divisions the rounding
  // once wrapped to 0, so cucacheMalloc succeeded and the next cucacheMalloc(512) returned the
  // same address.
  constexpr std::size_t max = SIZE_MAX;
  const std::size_t sizes[] = {max,
                               max - 1,
                               max - 512,
                               std::size_t{1} << 63,
                               (std::size_t{1} << 63) + 1,
                               0xf000000000000000ULL,
                               0xe000000000000001ULL,
                               0xc000000000000001ULL,
                               0xfffffffffd7fffffULL,
                               0xfffffffffd7fffffULL - 511,
                               0xfffffffffd800000ULL,
                               k_sim_capacity + 1};
  const std::string trace = ::testing::TempDir() + "cucache_c_api_huge_trace.csv";
  const std::string keys[] = {"",
                              "roundup_power2_divisions:4",
                              "roundup_power2_divisions:[1:2,>:2147483648]",
                              "max_split_size_mb:20,max_non_split_rounding_mb:40",
                              "garbage_collection_threshold:0.5,memory_fraction:0.5",
                              "memory_limit:1GiB,roundup_power2_divisions:4",
                              "trace:" + trace + ",roundup_power2_divisions:4"};
  for (const char* mode : {"", "expandable_segments:True"}) {
    for (const std::string& key : keys) {
      std::string conf = mode;
      if (!key.empty()) conf += (conf.empty() ? "" : ",") + key;
      SCOPED_TRACE(conf);
      ::setenv("CUCACHE_CONF", conf.c_str(), 1);
      cucache::detail::reset_for_testing();
      std::vector<std::pair<std::uintptr_t, std::size_t>> live;
      const auto add_live = [&](void* p, std::size_t bytes) {
        const auto a = reinterpret_cast<std::uintptr_t>(p);
        for (const auto& [start, size] : live) {
          EXPECT_TRUE(a + bytes <= start || start + size <= a)
              << p << " overlaps a live allocation at " << reinterpret_cast<void*>(start);
        }
        live.emplace_back(a, bytes);
      };
      for (std::size_t bytes : {std::size_t{512}, 3 * MiB}) {
        void* p = nullptr;
        ASSERT_EQ(cucacheMalloc(&p, bytes), cudaSuccess) << message();
        add_live(p, bytes);
      }
      for (std::size_t bytes : sizes) {
        SCOPED_TRACE(::testing::Message() << "size 0x" << std::hex << bytes);
        const cucacheStats before = stats();
        void* p = reinterpret_cast<void*>(0x1);
        EXPECT_EQ(cucacheMalloc(&p, bytes), cudaErrorMemoryAllocation);
        EXPECT_EQ(p, nullptr);
        EXPECT_NE(message().find("out of memory"), std::string::npos) << message();
        p = reinterpret_cast<void*>(0x1);
        EXPECT_EQ(cucacheMallocAsync(&p, bytes, fake_stream(3)), cudaErrorMemoryAllocation);
        EXPECT_EQ(p, nullptr);
        const cucacheStats after = stats();
        EXPECT_EQ(after.oomCount, before.oomCount + 2);
        EXPECT_EQ(after.allocatedBytes, before.allocatedBytes);
        EXPECT_EQ(after.requestedBytes, before.requestedBytes);
        EXPECT_EQ(after.requestedBytesPeak, before.requestedBytesPeak);
        EXPECT_EQ(after.activeBytes, before.activeBytes);
        EXPECT_EQ(after.allocationCount, before.allocationCount);
        EXPECT_EQ(after.reservedBytes, before.reservedBytes);
        EXPECT_EQ(after.segmentCount, before.segmentCount);
        EXPECT_EQ(after.deviceAllocCount, before.deviceAllocCount);
        EXPECT_EQ(after.allocRetryCount, before.allocRetryCount);
        void* q = nullptr;
        ASSERT_EQ(cucacheMalloc(&q, 512), cudaSuccess) << message();
        add_live(q, 512);
      }
      cucache::get().check_invariants();
    }
  }
  std::remove(trace.c_str());
}

TEST_F(CApi, SettingsThatCannotBeHonouredAreInitializationErrorsNamingTheKey) {
  // memory_fraction:1e-12 of 80 GiB is a limit of 0 bytes (0 means no limit); the same threshold
  // turns garbage collection off. Both are refused when the allocator is built.
  for (const char* conf : {"memory_fraction:1e-12", "garbage_collection_threshold:1e-12",
                           "expandable_segments:True,memory_fraction:1e-12"}) {
    SCOPED_TRACE(conf);
    ::setenv("CUCACHE_CONF", conf, 1);
    cucache::detail::reset_for_testing();
    void* p = reinterpret_cast<void*>(0x1);
    EXPECT_EQ(cucacheMalloc(&p, 512), cudaErrorInitializationError);
    EXPECT_EQ(p, nullptr);
    const std::string key = std::string(conf).find("memory_fraction") != std::string::npos
                                ? "'memory_fraction'"
                                : "'garbage_collection_threshold'";
    EXPECT_NE(message().find("CUCACHE_CONF"), std::string::npos) << message();
    EXPECT_NE(message().find(key), std::string::npos) << message();
    EXPECT_NE(message().find("1e-12"), std::string::npos) << message();
  }
}

TEST_F(CApi, EnvironmentErrorsAreInitializationErrors) {
  ::setenv("CUCACHE_BACKEND", "bogus", 1);
  cucache::detail::reset_for_testing();
  void* p = nullptr;
  EXPECT_EQ(cucacheMalloc(&p, 16), cudaErrorInitializationError);
  EXPECT_NE(message().find("CUCACHE_BACKEND: unknown backend 'bogus'"), std::string::npos)
      << message();
  EXPECT_EQ(cucacheMallocAsync(&p, 16, nullptr), cudaErrorInitializationError);
  size_t f = 0;
  size_t t = 0;
  EXPECT_EQ(cucacheMemGetInfo(&f, &t), cudaErrorInitializationError);
  cucacheStats s{};
  EXPECT_EQ(cucacheGetStats(0, &s), cudaErrorInitializationError);
  EXPECT_EQ(cucacheResetPeakStats(0), cudaErrorInitializationError);
  EXPECT_EQ(cucacheMemorySummary(0, nullptr, 0), 0u);
  EXPECT_EQ(cucacheEmptyCache(), cudaSuccess);  // nothing created: nothing to empty
  EXPECT_EQ(cucacheFree(nullptr), cudaSuccess);

  ::setenv("CUCACHE_BACKEND", "sim", 1);
  ::setenv("CUCACHE_CONF", "garbage_collection_threshold:2", 1);
  EXPECT_EQ(cucacheMalloc(&p, 16), cudaErrorInitializationError);
  EXPECT_NE(message().find("CUCACHE_CONF"), std::string::npos) << message();
  ::unsetenv("CUCACHE_CONF");
  EXPECT_EQ(cucacheMalloc(&p, 16), cudaSuccess);  // fixed environment, next call works
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
}

TEST_F(CApi, CudaBackendWithoutAGpuAnswersWithTheRuntimesCode) {
  if (cucache::cuda_available()) GTEST_SKIP() << "checks the no-GPU path; a GPU is present";
  ::setenv("CUCACHE_BACKEND", "cuda", 1);
  cucache::detail::reset_for_testing();
  void* p = reinterpret_cast<void*>(0x1);
  const cudaError_t err = cucacheMalloc(&p, 1024);
  EXPECT_NE(err, cudaSuccess);
  // No driver: cudaErrorInsufficientDriver (this CI machine); a driver without a GPU:
  // cudaErrorNoDevice.
  EXPECT_TRUE(err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice)
      << err << ": " << message();
  EXPECT_EQ(p, nullptr);
  EXPECT_NE(message().find("cudaGetDeviceCount"), std::string::npos) << message();
  EXPECT_EQ(cucacheMallocAsync(&p, 1024, nullptr), err);
  size_t f = 0;
  size_t t = 0;
  EXPECT_EQ(cucacheMemGetInfo(&f, &t), err);
  cucacheStats s{};
  EXPECT_EQ(cucacheGetStats(0, &s), err);
  EXPECT_EQ(cucacheEmptyCache(), cudaSuccess);
  EXPECT_EQ(cucacheFree(nullptr), cudaSuccess);
  int local = 0;
  EXPECT_EQ(cucacheFree(&local), cudaErrorInvalidValue);
}

TEST_F(CApi, ExactStatisticsAfterAKnownSequence) {
  void* small = nullptr;
  void* large = nullptr;
  // 1000 B rounds to 1024 in a 2 MiB small-pool segment.
  ASSERT_EQ(cucacheMalloc(&small, 1000), cudaSuccess);
  // 5 MiB takes a shared 20 MiB large-pool segment, split into 5 MiB + 15 MiB.
  ASSERT_EQ(cucacheMallocAsync(&large, 5 * MiB, nullptr), cudaSuccess);
  cucacheStats s = stats();
  EXPECT_EQ(s.allocatedBytes, 1024 + 5 * MiB);
  EXPECT_EQ(s.allocatedBytesPeak, 1024 + 5 * MiB);
  EXPECT_EQ(s.reservedBytes, 22 * MiB);
  EXPECT_EQ(s.reservedBytesPeak, 22 * MiB);
  EXPECT_EQ(s.activeBytes, 1024 + 5 * MiB);
  EXPECT_EQ(s.requestedBytes, 1000 + 5 * MiB);
  EXPECT_EQ(s.requestedBytesPeak, 1000 + 5 * MiB);
  EXPECT_EQ(s.cachedFreeBytes, 22 * MiB - 1024 - 5 * MiB);
  EXPECT_EQ(s.largestFreeBlock, 15 * MiB);
  EXPECT_EQ(s.allocationCount, 2u);
  EXPECT_EQ(s.segmentCount, 2u);
  EXPECT_EQ(s.deviceAllocCount, 2u);
  EXPECT_EQ(s.deviceFreeCount, 0u);
  EXPECT_EQ(s.oomCount, 0u);
  EXPECT_EQ(s.allocRetryCount, 0u);
  EXPECT_DOUBLE_EQ(s.externalFragmentation,
                   1.0 - static_cast<double>(15 * MiB) / static_cast<double>(s.cachedFreeBytes));
  EXPECT_DOUBLE_EQ(s.overheadFragmentation,
                   1.0 - static_cast<double>(1024 + 5 * MiB) / static_cast<double>(22 * MiB));
  EXPECT_EQ(s.memoryLimit, 0u);
  EXPECT_EQ(s.deviceTotalBytes, k_sim_capacity);

  // Freeing the large block coalesces its segment back into one 20 MiB free block.
  ASSERT_EQ(cucacheFree(large), cudaSuccess);
  s = stats();
  EXPECT_EQ(s.allocatedBytes, 1024u);
  EXPECT_EQ(s.allocatedBytesPeak, 1024 + 5 * MiB);
  EXPECT_EQ(s.reservedBytes, 22 * MiB);
  EXPECT_EQ(s.cachedFreeBytes, 22 * MiB - 1024);
  EXPECT_EQ(s.largestFreeBlock, 20 * MiB);
  EXPECT_EQ(s.allocationCount, 1u);

  // Emptying the cache returns the wholly free 20 MiB segment, not the one holding `small`.
  ASSERT_EQ(cucacheEmptyCache(), cudaSuccess);
  s = stats();
  EXPECT_EQ(s.reservedBytes, 2 * MiB);
  EXPECT_EQ(s.reservedBytesPeak, 22 * MiB);
  EXPECT_EQ(s.segmentCount, 1u);
  EXPECT_EQ(s.deviceFreeCount, 1u);
  EXPECT_EQ(s.cachedFreeBytes, 2 * MiB - 1024);
  // One free block of 2 MiB - 1 KiB in the small pool, whose requests stop at 1 MiB.
  EXPECT_EQ(s.largestFreeBlock, MiB);
  EXPECT_DOUBLE_EQ(s.externalFragmentation,
                   1.0 - static_cast<double>(MiB) / static_cast<double>(2 * MiB - 1024));

  // Peaks come down to the current values.
  ASSERT_EQ(cucacheResetPeakStats(0), cudaSuccess);
  s = stats();
  EXPECT_EQ(s.allocatedBytesPeak, 1024u);
  EXPECT_EQ(s.reservedBytesPeak, 2 * MiB);
  EXPECT_EQ(s.activeBytesPeak, 1024u);
  EXPECT_EQ(s.requestedBytesPeak, 1000u);

  ASSERT_EQ(cucacheFree(small), cudaSuccess);
  s = stats();
  EXPECT_EQ(s.allocatedBytes, 0u);
  EXPECT_EQ(s.activeBytes, 0u);
  EXPECT_EQ(s.requestedBytes, 0u);
  EXPECT_DOUBLE_EQ(s.overheadFragmentation, 1.0);
}

TEST_F(CApi, StatsArgumentErrors) {
  cucacheStats s{};
  EXPECT_EQ(cucacheGetStats(0, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheGetStats(1, &s), cudaErrorInvalidDevice);
  EXPECT_NE(message().find("invalid device ordinal 1"), std::string::npos) << message();
  EXPECT_EQ(cucacheGetStats(-1, &s), cudaErrorInvalidDevice);
  EXPECT_EQ(cucacheResetPeakStats(1), cudaErrorInvalidDevice);
  EXPECT_EQ(cucacheResetPeakStats(-3), cudaErrorInvalidDevice);
}

TEST_F(CApi, MemGetInfoCountsCachedMemoryAsFree) {
  size_t f = 0;
  size_t t = 0;
  EXPECT_EQ(cucacheMemGetInfo(nullptr, &t), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheMemGetInfo(&f, nullptr), cudaErrorInvalidValue);
  ASSERT_EQ(cucacheMemGetInfo(&f, &t), cudaSuccess);
  EXPECT_EQ(t, k_sim_capacity);
  EXPECT_EQ(f, k_sim_capacity);

  void* p = nullptr;
  ASSERT_EQ(cucacheMalloc(&p, 5 * MiB), cudaSuccess);
  ASSERT_EQ(cucacheMemGetInfo(&f, &t), cudaSuccess);
  // The device sees the 20 MiB segment as used; 15 MiB of it is cucache's cached free memory.
  EXPECT_EQ(f, k_sim_capacity - 5 * MiB);
  ASSERT_EQ(cucacheFree(p), cudaSuccess);
  ASSERT_EQ(cucacheMemGetInfo(&f, &t), cudaSuccess);
  EXPECT_EQ(f, k_sim_capacity);  // all of it reusable, although still reserved
  EXPECT_EQ(stats().reservedBytes, 20 * MiB);
}

TEST_F(CApi, MemGetInfoHonoursTheMemoryLimit) {
  ::setenv("CUCACHE_CONF", "memory_limit:100MiB", 1);
  cucache::detail::reset_for_testing();
  size_t f = 0;
  size_t t = 0;
  ASSERT_EQ(cucacheMemGetInfo(&f, &t), cudaSuccess);
  EXPECT_EQ(t, 100 * MiB);
  EXPECT_EQ(f, 100 * MiB);
  void* p = nullptr;
  ASSERT_EQ(cucacheMalloc(&p, 30 * MiB), cudaSuccess);
  ASSERT_EQ(cucacheMemGetInfo(&f, &t), cudaSuccess);
  EXPECT_EQ(t, 100 * MiB);
  EXPECT_EQ(f, 70 * MiB);
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
}

TEST_F(CApi, MemorySummaryIsSnprintfLike) {
  void* p = nullptr;
  ASSERT_EQ(cucacheMalloc(&p, 3 * MiB), cudaSuccess);
  const std::string expected = cucache::memory_summary(0);
  const size_t n = cucacheMemorySummary(0, nullptr, 0);
  ASSERT_EQ(n, expected.size());
  ASSERT_GT(n, 0u);

  std::vector<char> buf(n + 1, 'x');
  EXPECT_EQ(cucacheMemorySummary(0, buf.data(), buf.size()), n);
  EXPECT_EQ(std::string(buf.data()), expected);

  char small[11];
  std::fill(std::begin(small), std::end(small), 'x');
  EXPECT_EQ(cucacheMemorySummary(0, small, 10), n);
  EXPECT_EQ(std::string(small), expected.substr(0, 9));
  EXPECT_EQ(small[10], 'x');  // nothing beyond len

  char one = 'x';
  EXPECT_EQ(cucacheMemorySummary(0, &one, 1), n);
  EXPECT_EQ(one, '\0');

  EXPECT_EQ(cucacheMemorySummary(0, nullptr, 5), 0u);
  EXPECT_NE(message().find("buf"), std::string::npos) << message();
  EXPECT_EQ(cucacheMemorySummary(1, buf.data(), buf.size()), 0u);
  EXPECT_NE(message().find("invalid device ordinal"), std::string::npos) << message();
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
}

TEST_F(CApi, LastErrorMessageIsPerThreadAndSticky) {
  std::string fresh = "unset";
  std::thread([&] { fresh = cucacheGetLastErrorMessage(); }).join();
  EXPECT_EQ(fresh, "");

  int local = 0;
  ASSERT_EQ(cucacheFree(&local), cudaErrorInvalidValue);
  const std::string failed = message();
  EXPECT_FALSE(failed.empty());
  void* p = nullptr;
  ASSERT_EQ(cucacheMalloc(&p, 64), cudaSuccess);
  EXPECT_EQ(message(), failed);  // success leaves it, as errno

  std::string other = "unset";
  std::thread([&] { other = cucacheGetLastErrorMessage(); }).join();
  EXPECT_EQ(other, "");  // another thread's failure is not this one's
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
}

TEST_F(CApi, AGraphCaptureThroughTheCApi) {
  // A program on the raw CUDA graph API: capture, allocate and free through cucache, end the
  // capture, tell cucache, release the pool when the graph is gone.
  auto* sim = dynamic_cast<cucache::sim_backend*>(&cucache::get(0).backend());
  ASSERT_NE(sim, nullptr);
  auto* s = static_cast<cudaStream_t>(sim->create_stream());
  void* cached = nullptr;
  ASSERT_EQ(cucacheMallocAsync(&cached, MiB, s), cudaSuccess);
  ASSERT_EQ(cucacheFreeAsync(cached, s), cudaSuccess);
  const unsigned long long id = sim->begin_capture(s);
  void* g = nullptr;
  ASSERT_EQ(cucacheMallocAsync(&g, MiB, s), cudaSuccess) << message();
  EXPECT_NE(g, cached);
  EXPECT_EQ(cucacheFreeAsync(g, s), cudaSuccess);
  EXPECT_EQ(cucacheEmptyCache(), cudaErrorStreamCaptureUnsupported);
  EXPECT_NE(message().find("graph capture"), std::string::npos) << message();
  EXPECT_EQ(sim->end_capture(s), id);
  EXPECT_EQ(cucacheGraphCaptureEnded(id), cudaSuccess) << message();
  EXPECT_EQ(cucacheGraphCaptureEnded(id), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheEmptyCache(), cudaSuccess) << message();
  EXPECT_EQ(stats().reservedBytes, 2 * MiB);  // the graph's pool: kept until released
  EXPECT_EQ(cucacheGraphPoolRelease(id), cudaSuccess) << message();
  EXPECT_EQ(cucacheGraphPoolRelease(id), cudaErrorInvalidValue);
  EXPECT_EQ(stats().reservedBytes, 0u);
  EXPECT_EQ(sim->capture_violations(), 0u);
  sim->destroy_stream(s);
}

TEST_F(CApi, TemplateOverloadsTakeTypedPointers) {
  float* f = nullptr;
  double* d = nullptr;
  ASSERT_EQ(cucacheMalloc(&f, 256 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cucacheMallocAsync(&d, 256 * sizeof(double), fake_stream(5)), cudaSuccess);
  EXPECT_NE(f, nullptr);
  EXPECT_NE(d, nullptr);
  EXPECT_EQ(cucacheFree(f), cudaSuccess);
  EXPECT_EQ(cucacheFreeAsync(d, fake_stream(5)), cudaSuccess);
  EXPECT_EQ(stats().allocationCount, 0u);
}

TEST_F(CApi, EightThreadsWithTheirOwnStreams) {
  constexpr int k_threads = 8;
  std::vector<std::thread> threads;
  std::vector<int> errors(k_threads, 0);
  for (int t = 0; t < k_threads; ++t) {
    threads.emplace_back([t, &errors] {
      const cudaStream_t s = fake_stream(static_cast<std::uintptr_t>(t) + 1);
      std::vector<void*> live;
      for (int i = 0; i < 3000; ++i) {
        void* p = nullptr;
        const std::size_t bytes = 256 * static_cast<std::size_t>(1 + (i * 7 + t) % 64);
        if (cucacheMallocAsync(&p, bytes, s) != cudaSuccess) ++errors[static_cast<std::size_t>(t)];
        live.push_back(p);
        if (live.size() > 8) {
          if (cucacheFreeAsync(live.front(), s) != cudaSuccess) {
            ++errors[static_cast<std::size_t>(t)];
          }
          live.erase(live.begin());
        }
      }
      for (void* p : live) {
        if (cucacheFree(p) != cudaSuccess) ++errors[static_cast<std::size_t>(t)];
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int e : errors) EXPECT_EQ(e, 0);
  const cucacheStats s = stats();
  EXPECT_EQ(s.allocationCount, 0u);
  EXPECT_EQ(s.activeBytes, 0u);
  cucache::get().check_invariants();
}

}  // namespace
