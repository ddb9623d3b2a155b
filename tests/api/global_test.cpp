// Tests of the global C++ API (cucache.hpp) on the simulated device (CUCACHE_BACKEND=sim): lazy
// creation, routing of malloc/free, unique_device_ptr ownership, tracing through CUCACHE_CONF,
// environment errors, and concurrent use. What every front end must do alike (stream-ordered reuse,
// the owner search, environment errors reported on every call, stats, tracing) is in
// front_end_conformance_test.cpp.
#include "cucache/cucache.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "api/registry.hpp"
#include "cucache/cuda_backend.hpp"
#include "cucache/sim_backend.hpp"
#include "cucache/trace.hpp"
#include "support/sim_registry.hpp"

namespace cucache {
namespace {

using test::fake_stream;
using test::MiB;

// Every test starts and ends with fresh global allocators on the simulated device and no config.
class Global : public ::testing::Test {
 protected:
  void SetUp() override { restore(); }
  void TearDown() override { restore(); }
  static void restore() { test::use_sim_registry(); }
  static sim_backend& sim() { return dynamic_cast<sim_backend&>(get(0).backend()); }
};

TEST_F(Global, MallocAndFreeGoThroughTheCurrentDevicesAllocator) {
  void* p = cucache::malloc(1000);
  ASSERT_NE(p, nullptr);
  device_allocator& a = get();
  EXPECT_EQ(&a, &get(0));
  EXPECT_EQ(a.device(), 0);
  EXPECT_STREQ(a.backend().name(), "sim");
  EXPECT_EQ(a.allocation_size(p), 1024u);
  EXPECT_EQ(a.stats().allocation_count[0].current, 1);
  cucache::free(p);
  EXPECT_EQ(a.stats().allocation_count[0].current, 0);
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(2 * MiB));
  a.check_invariants();
}

TEST_F(Global, ZeroBytesGiveNullAndNullFreesAreNoOps) {
  EXPECT_EQ(cucache::malloc(0), nullptr);
  EXPECT_NO_THROW(cucache::free(nullptr));
  EXPECT_NO_THROW(cucache::free_async(nullptr, fake_stream(1)));
  EXPECT_EQ(get().stats().allocation_count[0].current, 0);
}

TEST_F(Global, FreeBeforeAnyAllocationIsAnInvalidArgument) {
  // No state exists yet: the pointer cannot be ours, and free must not create anything.
  int local = 0;
  EXPECT_THROW(cucache::free(&local), invalid_argument);
  EXPECT_THROW(cucache::free_async(&local, nullptr), invalid_argument);
  EXPECT_THROW(cucache::record_stream(&local, nullptr), invalid_argument);
  EXPECT_NO_THROW(cucache::empty_cache());
}

TEST_F(Global, BadPointersThrowAndLeaveTheAllocatorUnchanged) {
  auto* p = static_cast<std::byte*>(cucache::malloc(4096));
  try {
    cucache::free(p + 512);
    FAIL() << "freed an interior pointer";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("512 bytes into"), std::string::npos) << e.what();
  }
  EXPECT_THROW(cucache::record_stream(p + 512, fake_stream(2)), invalid_argument);
  EXPECT_THROW(cucache::record_stream(nullptr, fake_stream(2)), invalid_argument);
  cucache::free(p);
  try {
    cucache::free(p);
    FAIL() << "double free accepted";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("already freed"), std::string::npos) << e.what();
  }
  EXPECT_THROW(cucache::free(reinterpret_cast<void*>(0x1234)), invalid_argument);
  get().check_invariants();
  EXPECT_EQ(get().stats().allocation_count[0].current, 0);
}

TEST_F(Global, GetCreatesOneAllocatorPerDeviceAndRejectsOthers) {
  device_allocator& a = get(0);
  EXPECT_EQ(&a, &get(0));
  EXPECT_EQ(&a, &get());
  for (int bad : {-1, 1, 7}) {
    try {
      (void)get(bad);
      FAIL() << "device " << bad << " accepted";
    } catch (const cuda_error& e) {
      EXPECT_EQ(e.code(), 101);  // cudaErrorInvalidDevice
      EXPECT_NE(std::string(e.what()).find("invalid device ordinal"), std::string::npos);
    }
  }
  EXPECT_THROW((void)memory_summary(1), cuda_error);
}

TEST_F(Global, ConcurrentFirstUseCreatesExactlyOneAllocator) {
  std::vector<std::thread> threads;
  std::vector<device_allocator*> seen(16);
  std::atomic<bool> go{false};
  for (std::size_t i = 0; i < seen.size(); ++i) {
    threads.emplace_back([&, i] {
      while (!go.load()) {
      }
      seen[i] = &get();
    });
  }
  go = true;
  for (auto& t : threads) t.join();
  for (auto* a : seen) EXPECT_EQ(a, seen[0]);
}

TEST_F(Global, EmptyCacheTouchesOnlyCreatedAllocators) {
  EXPECT_NO_THROW(cucache::empty_cache());
  void* p = cucache::malloc(5 * MiB);
  void* q = cucache::malloc(1000);
  cucache::free(p);
  cucache::empty_cache();
  const device_stats s = get().stats();
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(2 * MiB));  // q's segment
  cucache::free(q);
}

TEST_F(Global, MemorySummaryIsTheAllocatorsTable) {
  void* p = cucache::malloc(3 * MiB);
  const std::string text = memory_summary(0);
  EXPECT_EQ(text, get(0).memory_summary());
  EXPECT_NE(text.find("Allocated memory"), std::string::npos) << text;
  cucache::free(p);
}

// --- unique_device_ptr
// ----------------------------------------------------------------------------

TEST_F(Global, UniqueDevicePtrOwnsAndFreesItsMemory) {
  {
    auto p = make_unique_device<float>(256, fake_stream(4));
    ASSERT_TRUE(p);
    EXPECT_EQ(p.size(), 256u);
    EXPECT_EQ(p.size_bytes(), 1024u);
    EXPECT_EQ(get().allocation_size(p.get()), 1024u);
    EXPECT_EQ(get().stats().allocation_count[0].current, 1);
  }
  EXPECT_EQ(get().stats().allocation_count[0].current, 0);
}

TEST_F(Global, UniqueDevicePtrMovesOwnership) {
  auto a = make_unique_device<int>(100);
  int* raw = a.get();
  unique_device_ptr<int> b(std::move(a));
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): moved-from is documented as empty
  EXPECT_EQ(a, nullptr);
  EXPECT_EQ(a.size(), 0u);
  EXPECT_EQ(b.get(), raw);
  EXPECT_EQ(b.size(), 100u);

  auto c = make_unique_device<int>(10);
  EXPECT_EQ(get().stats().allocation_count[0].current, 2);
  c = std::move(b);  // c's old memory is freed
  EXPECT_EQ(get().stats().allocation_count[0].current, 1);
  EXPECT_EQ(c.get(), raw);
  EXPECT_FALSE(b);  // NOLINT(bugprone-use-after-move)

  c = std::move(c);  // self-move keeps the memory
  EXPECT_EQ(c.get(), raw);

  unique_device_ptr<int> d;
  d.swap(c);
  EXPECT_EQ(d.get(), raw);
  EXPECT_FALSE(c);
  d.reset();
  EXPECT_FALSE(d);
  EXPECT_EQ(get().stats().allocation_count[0].current, 0);
}

TEST_F(Global, UniqueDevicePtrReleaseAndReset) {
  auto p = make_unique_device(64);  // std::byte
  std::byte* raw = p.release();
  EXPECT_FALSE(p);
  EXPECT_EQ(p.size(), 0u);
  EXPECT_EQ(get().stats().allocation_count[0].current, 1);
  p.reset(raw, 64);
  EXPECT_EQ(p.get(), raw);
  auto* other = static_cast<std::byte*>(cucache::malloc(128));
  p.reset(other, 128);  // frees raw
  EXPECT_EQ(get().stats().allocation_count[0].current, 1);
  EXPECT_EQ(get().allocation_size(raw), 0u);
  p = nullptr;
  EXPECT_EQ(get().stats().allocation_count[0].current, 0);
}

TEST_F(Global, MakeUniqueDeviceOfNothingOrTooMuch) {
  auto empty = make_unique_device<double>(0);
  EXPECT_FALSE(empty);
  EXPECT_THROW((void)make_unique_device<double>(SIZE_MAX / 4), std::bad_array_new_length);
  EXPECT_THROW((void)make_unique_device<std::byte>(SIZE_MAX / 2), out_of_memory);
  EXPECT_EQ(get().stats().allocation_count[0].current, 0);
}

// --- environment --------------------------------------------------------------------------------

TEST_F(Global, UnknownBackendIsAnEnvironmentErrorAndNothingIsCached) {
  ::setenv("CUCACHE_BACKEND", "bogus", 1);
  detail::reset_for_testing();
  try {
    (void)cucache::malloc(16);
    FAIL() << "CUCACHE_BACKEND=bogus accepted";
  } catch (const environment_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("CUCACHE_BACKEND"), std::string::npos) << what;
    EXPECT_NE(what.find("'bogus'"), std::string::npos) << what;
    EXPECT_NE(what.find("cuda, sim"), std::string::npos) << what;
  }
  EXPECT_THROW((void)get(0), environment_error);
  ::setenv("CUCACHE_BACKEND", "sim", 1);  // fixed: the next call reads the environment again
  void* p = cucache::malloc(16);
  EXPECT_NE(p, nullptr);
  cucache::free(p);
}

TEST_F(Global, EmptyBackendMeansCuda) {
  if (cuda_available()) GTEST_SKIP() << "checks the no-GPU path; a GPU is present";
  ::setenv("CUCACHE_BACKEND", "", 1);
  detail::reset_for_testing();
  EXPECT_THROW((void)cucache::malloc(16), cuda_error);
}

TEST_F(Global, MalformedConfigIsAnEnvironmentError) {
  ::setenv("CUCACHE_CONF", "max_split_size_mb:banana", 1);
  detail::reset_for_testing();
  try {
    (void)cucache::malloc(16);
    FAIL() << "malformed CUCACHE_CONF accepted";
  } catch (const environment_error& e) {
    EXPECT_NE(std::string(e.what()).find("CUCACHE_CONF"), std::string::npos) << e.what();
  }
  // Expandable segments work through the global API (the simulated device models VM).
  ::setenv("CUCACHE_CONF", "expandable_segments:True", 1);
  detail::reset_for_testing();
  void* p = cucache::malloc(3 << 20);
  EXPECT_NE(p, nullptr);
  EXPECT_EQ(get().stats().device_alloc_count, 2u);
  cucache::free(p);
}

TEST_F(Global, ConfigFromTheEnvironmentReachesTheAllocator) {
  ::setenv("CUCACHE_CONF", "memory_limit:64MiB,max_split_size_mb:32", 1);
  detail::reset_for_testing();
  EXPECT_EQ(get().get_config().memory_limit_bytes, 64 * MiB);
  EXPECT_EQ(get().get_config().max_split_size, 32 * MiB);
  EXPECT_THROW((void)cucache::malloc(100 * MiB), out_of_memory);
  EXPECT_EQ(get().stats().oom_count, 1u);
}

TEST_F(Global, CudaBackendWithoutAGpuReportsTheRuntimesError) {
  if (cuda_available()) GTEST_SKIP() << "checks the no-GPU path; a GPU is present";
  ::setenv("CUCACHE_BACKEND", "cuda", 1);
  detail::reset_for_testing();
  try {
    (void)cucache::malloc(16);
    FAIL() << "allocated without a GPU";
  } catch (const cuda_error& e) {
    EXPECT_EQ(e.call(), "cudaGetDeviceCount");
    // 35 cudaErrorInsufficientDriver (no driver), 100 cudaErrorNoDevice (driver, no GPU).
    EXPECT_TRUE(e.code() == 35 || e.code() == 100) << e.what();
  }
  EXPECT_THROW((void)get(0), cuda_error);
  EXPECT_THROW((void)get(), cuda_error);
  EXPECT_NO_THROW(cucache::empty_cache());
  int local = 0;
  EXPECT_THROW(cucache::free(&local), invalid_argument);
  // No allocator was created, so dropping the state is allowed even on the cuda backend.
  EXPECT_NO_THROW(detail::reset_for_testing());
}

// --- tracing ------------------------------------------------------------------------------------

struct temp_file {
  std::filesystem::path path;
  explicit temp_file(const std::string& stem)
      : path(std::filesystem::temp_directory_path() /
             (stem + "." + std::to_string(::getpid()) + ".csv")) {}
  ~temp_file() { std::filesystem::remove(path); }
};

TEST_F(Global, TraceRecordsEveryAllocationFreeAndFailure) {
  temp_file trace("cucache-global-trace");
  ::setenv("CUCACHE_CONF", ("trace:" + trace.path.string() + ",memory_limit:64MiB").c_str(), 1);
  detail::reset_for_testing();

  void* a = cucache::malloc(1000, fake_stream(1));
  void* b = cucache::malloc(3 * MiB);
  EXPECT_EQ(cucache::malloc(0), nullptr);  // not recorded: nothing to replay
  cucache::free(a);
  cucache::free_async(b, fake_stream(2));
  EXPECT_THROW((void)cucache::malloc(100 * MiB, fake_stream(3)), out_of_memory);
  int local = 0;
  EXPECT_THROW(cucache::free(&local), invalid_argument);  // not recorded: nothing was freed
  { auto u = make_unique_device<float>(4); }
  flush_trace();

  const auto events = read_trace(trace.path);
  using act = trace_event::action;
  ASSERT_EQ(events.size(), 7u);
  const auto ptr = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  const auto str = [](stream_handle s) { return reinterpret_cast<std::uintptr_t>(s); };
  EXPECT_EQ(events[0].act, act::allocate);
  EXPECT_EQ(events[0].pointer, ptr(a));
  EXPECT_EQ(events[0].size, 1000u);
  EXPECT_EQ(events[0].stream, str(fake_stream(1)));
  EXPECT_EQ(events[1].act, act::allocate);
  EXPECT_EQ(events[1].pointer, ptr(b));
  EXPECT_EQ(events[1].size, 3 * MiB);
  EXPECT_EQ(events[1].stream, 0u);
  EXPECT_EQ(events[2].act, act::free);  // a plain free repeats the allocation's size and stream
  EXPECT_EQ(events[2].pointer, ptr(a));
  EXPECT_EQ(events[2].size, 1000u);
  EXPECT_EQ(events[2].stream, str(fake_stream(1)));
  EXPECT_EQ(events[3].act, act::free);  // a stream-ordered free names its stream
  EXPECT_EQ(events[3].pointer, ptr(b));
  EXPECT_EQ(events[3].size, 3 * MiB);
  EXPECT_EQ(events[3].stream, str(fake_stream(2)));
  EXPECT_EQ(events[4].act, act::allocate_failure);
  EXPECT_EQ(events[4].pointer, 0u);
  EXPECT_EQ(events[4].size, 100 * MiB);
  EXPECT_EQ(events[4].stream, str(fake_stream(3)));
  EXPECT_EQ(events[5].act, act::allocate);
  EXPECT_EQ(events[5].size, 16u);
  EXPECT_EQ(events[6].act, act::free);
  EXPECT_EQ(events[6].pointer, events[5].pointer);
  EXPECT_EQ(summarize(events).live_at_end, 0u);
}

TEST_F(Global, TraceIsFlushedWhenTheStateIsDropped) {
  temp_file trace("cucache-global-trace-reset");
  ::setenv("CUCACHE_CONF", ("trace:" + trace.path.string()).c_str(), 1);
  detail::reset_for_testing();
  void* p = cucache::malloc(512);
  detail::reset_for_testing();  // no flush_trace(): dropping the recorder writes the rows
  static_cast<void>(p);         // gone with its allocator
  const auto events = read_trace(trace.path);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].act, trace_event::action::allocate);
}

TEST_F(Global, TraceFileThatCannotBeCreatedIsAnEnvironmentError) {
  ::setenv("CUCACHE_CONF", "trace:/nonexistent-dir/for/cucache/trace.csv", 1);
  detail::reset_for_testing();
  try {
    (void)cucache::malloc(16);
    FAIL() << "opened a trace in a directory that does not exist";
  } catch (const environment_error& e) {
    EXPECT_NE(std::string(e.what()).find("nonexistent-dir"), std::string::npos) << e.what();
  }
}

TEST_F(Global, TracedConcurrentUseGivesAValidTrace) {
  temp_file trace("cucache-global-trace-mt");
  ::setenv("CUCACHE_CONF", ("trace:" + trace.path.string()).c_str(), 1);
  detail::reset_for_testing();
  constexpr int k_threads = 8;
  // Enough rows (~300 KiB per thread) that buffers fill and flush while other threads record.
  constexpr int k_rounds = 3000;
  std::vector<std::thread> threads;
  for (int t = 0; t < k_threads; ++t) {
    threads.emplace_back([t] {
      // Every thread shares stream 0 half the time, so addresses move between threads.
      std::vector<void*> mine;
      for (int i = 0; i < k_rounds; ++i) {
        const stream_handle s = (i % 2 == 0) ? nullptr : fake_stream(static_cast<unsigned>(t) + 1);
        mine.push_back(cucache::malloc(512 * static_cast<std::size_t>(1 + (i % 7)), s));
        if (mine.size() > 4) {
          cucache::free(mine.front());
          mine.erase(mine.begin());
        }
      }
      for (void* p : mine) cucache::free(p);
    });
  }
  for (auto& th : threads) th.join();
  flush_trace();
  // read_trace validates liveness: no free before its allocate, no allocate of a live pointer.
  const auto events = read_trace(trace.path);
  const trace_summary sum = summarize(events);
  EXPECT_EQ(sum.allocations, static_cast<std::size_t>(k_threads * k_rounds));
  EXPECT_EQ(sum.frees, static_cast<std::size_t>(k_threads * k_rounds));
  EXPECT_EQ(sum.live_at_end, 0u);
  EXPECT_EQ(sum.threads, static_cast<std::size_t>(k_threads));
}

// --- threads ------------------------------------------------------------------------------------

TEST_F(Global, EightThreadsWithTheirOwnStreams) {
  constexpr int k_threads = 8;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < k_threads; ++t) {
    threads.emplace_back([t, &failures] {
      std::mt19937 rng(static_cast<unsigned>(t));
      std::uniform_int_distribution<std::size_t> size(1, 3 * MiB);
      const stream_handle s = fake_stream(static_cast<unsigned>(t) + 1);
      std::vector<void*> live;
      // A failure is an exception (malloc never returns null for a nonzero size); count it here,
      // since one escaping a thread would end the process instead of failing the test.
      try {
        for (int i = 0; i < 2000; ++i) {
          if (live.size() < 16 && (rng() % 3 != 0 || live.empty())) {
            void* p = cucache::malloc(size(rng), s);
            if (p == nullptr) ++failures;
            live.push_back(p);
          } else {
            const std::size_t k = rng() % live.size();
            cucache::free(live[k]);
            live[k] = live.back();
            live.pop_back();
          }
        }
        for (void* p : live) cucache::free(p);
      } catch (const std::exception&) {
        ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  const device_stats s = get().stats();
  EXPECT_EQ(s.allocation_count[0].current, 0);
  EXPECT_EQ(s.allocated_bytes[0].current, 0);
  EXPECT_EQ(s.requested_bytes[0].current, 0);
  get().check_invariants();
}

TEST_F(Global, ResetForTestingDropsEverything) {
  void* p = cucache::malloc(1000);
  ASSERT_EQ(get().stats().device_alloc_count, 1u);
  detail::reset_for_testing();
  // A fresh allocator on a fresh device: it never allocated, and p means nothing to it.
  EXPECT_EQ(get().stats().allocation_count[0].current, 0);
  EXPECT_EQ(get().stats().device_alloc_count, 0u);
  EXPECT_EQ(sim().live_segments(), 0u);
  EXPECT_THROW(cucache::free(p), invalid_argument);
  EXPECT_NO_THROW(detail::reset_for_testing());
  EXPECT_NO_THROW(detail::reset_for_testing());  // nothing to drop
}

}  // namespace
}  // namespace cucache
