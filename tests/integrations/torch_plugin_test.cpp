// libcucache_torch.so through its C interface, on the simulated device (CUCACHE_BACKEND=sim, 16
// devices): the calls torch makes, the statistics the Python module reads, the buffer contract, and
// bad frees that must be reported and survived. Each test uses its own device ordinal, so the tests
// stay exact whether they run in one process or one each. What every front end must do alike
// (allocate/free/reuse, bad frees, stream-ordered reuse, the owner search, environment errors,
// stats, empty_cache, tracing) is in tests/api/front_end_conformance_test.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "cucache_torch.h"

namespace {

// Before main, hence before the plug-in's first call reads the environment.
const bool k_sim_env = [] {
  ::setenv("CUCACHE_BACKEND", "sim", 1);
  ::setenv("CUCACHE_SIM_DEVICES", "16", 1);
  ::unsetenv("CUCACHE_CONF");
  ::unsetenv("CUCACHE_TORCH_OOM");
  return true;
}();

constexpr std::size_t KiB = 1024;
constexpr std::size_t MiB = KiB * 1024;

cucache_torch_stream stream(std::uintptr_t id) {
  return reinterpret_cast<cucache_torch_stream>(id);
}

cucache_torch_stats stats(int device) {
  cucache_torch_stats s{};
  EXPECT_EQ(cucache_torch_get_stats(device, &s), 0) << cucache_torch_last_error();
  return s;
}

TEST(TorchPlugin, RunsOnTheSimulatedDevice) {
  ASSERT_TRUE(k_sim_env);
  EXPECT_STREQ(cucache_torch_backend_name(), "sim");
  EXPECT_EQ(cucache_torch_stats_size(), sizeof(cucache_torch_stats));
}

TEST(TorchPlugin, StatsExactAfterAKnownSequence) {
  const int dev = 2;
  const cucache_torch_stats zero = stats(dev);
  EXPECT_EQ(zero.reserved_bytes[0].current, 0);  // an unused device reads as all zero

  void* a = cucache_torch_alloc(1000, dev, stream(0));     // 1 KiB block, small pool
  void* b = cucache_torch_alloc(3 * MiB, dev, stream(0));  // large pool: a 20 MiB segment
  void* c = cucache_torch_alloc(512, dev, stream(0));
  ASSERT_TRUE(a && b && c);
  cucache_torch_free(a, 1000, dev, stream(0));

  const cucache_torch_stats s = stats(dev);
  EXPECT_EQ(s.allocated_bytes[0].current, static_cast<int64_t>(3 * MiB + 512));
  EXPECT_EQ(s.allocated_bytes[0].peak, static_cast<int64_t>(3 * MiB + 1024 + 512));
  EXPECT_EQ(s.allocated_bytes[0].allocated, static_cast<int64_t>(3 * MiB + 1024 + 512));
  EXPECT_EQ(s.allocated_bytes[0].freed, 1024);
  EXPECT_EQ(s.allocated_bytes[1].current, 512);  // small pool
  EXPECT_EQ(s.allocated_bytes[2].current, static_cast<int64_t>(3 * MiB));
  EXPECT_EQ(s.requested_bytes[0].current, static_cast<int64_t>(3 * MiB + 512));
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<int64_t>(2 * MiB + 20 * MiB));
  EXPECT_EQ(s.segment[0].current, 2);
  EXPECT_EQ(s.allocation[0].current, 2);
  EXPECT_EQ(s.num_device_alloc, 2u);
  EXPECT_EQ(s.num_ooms, 0u);
  EXPECT_DOUBLE_EQ(s.fragmentation_overhead,
                   1.0 - static_cast<double>(3 * MiB + 512) / static_cast<double>(22 * MiB));

  ASSERT_EQ(cucache_torch_reset_peak_stats(dev), 0);
  EXPECT_EQ(stats(dev).allocated_bytes[0].peak, static_cast<int64_t>(3 * MiB + 512));
  ASSERT_EQ(cucache_torch_reset_accumulated_stats(dev), 0);
  EXPECT_EQ(stats(dev).allocated_bytes[0].freed, 0);

  cucache_torch_free(b, 3 * MiB, dev, stream(0));
  cucache_torch_free(c, 512, dev, stream(0));
  ASSERT_EQ(cucache_torch_empty_cache(), 0);
  const cucache_torch_stats e = stats(dev);
  EXPECT_EQ(e.reserved_bytes[0].current, 0);
  EXPECT_EQ(e.num_device_free, 2u);
}

TEST(TorchPlugin, SummaryAndSnapshotBufferContract) {
  const int dev = 3;
  void* p = cucache_torch_alloc(4096, dev, stream(0));
  ASSERT_NE(p, nullptr);
  using text_fn = int64_t (*)(int, char*, size_t);
  for (text_fn fn : {&cucache_torch_memory_summary, &cucache_torch_snapshot_json}) {
    const int64_t n = fn(dev, nullptr, 0);
    ASSERT_GT(n, 16);
    char small[8];
    std::memset(small, 'x', sizeof small);
    EXPECT_EQ(fn(dev, small, sizeof small), n);  // too small: truncated, still the full length
    EXPECT_EQ(std::strlen(small), sizeof small - 1);
    std::vector<char> buf(static_cast<std::size_t>(n) + 1, 'x');
    EXPECT_EQ(fn(dev, buf.data(), buf.size()), n);
    EXPECT_EQ(std::strlen(buf.data()), static_cast<std::size_t>(n));
  }
  std::vector<char> json(static_cast<std::size_t>(cucache_torch_snapshot_json(dev, nullptr, 0)) +
                         1);
  cucache_torch_snapshot_json(dev, json.data(), json.size());
  EXPECT_EQ(json[0], '{');
  // A device that exists but allocated nothing still answers; one that does not exist is refused
  // (DevicesThatDoNotExistAreRefusedNotAnsweredWithZeros).
  EXPECT_GT(cucache_torch_memory_summary(14, nullptr, 0), 0);
  EXPECT_EQ(cucache_torch_memory_summary(50, nullptr, 0), -1);
  cucache_torch_free(p, 4096, dev, stream(0));
}

TEST(TorchPlugin, BadFreesAreReportedAndCounted) {
  const int dev = 4;
  void* p = cucache_torch_alloc(4096, dev, stream(0));
  ASSERT_NE(p, nullptr);
  const uint64_t before = cucache_torch_bad_free_count();

  auto* foreign = reinterpret_cast<void*>(std::uintptr_t{0x1234});
  testing::internal::CaptureStderr();
  cucache_torch_free(foreign, 16, dev, stream(0));
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(cucache_torch_bad_free_count(), before + 1);
  EXPECT_NE(err.find("0x1234"), std::string::npos) << err;
  EXPECT_NE(err.find("not allocated by cucache"), std::string::npos) << err;

  cucache_torch_free(p, 4096, dev, stream(0));
  testing::internal::CaptureStderr();
  cucache_torch_free(p, 4096, dev, stream(0));  // double free
  err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(cucache_torch_bad_free_count(), before + 2);
  EXPECT_NE(err.find("already freed"), std::string::npos) << err;
  EXPECT_NE(std::string(cucache_torch_last_error()).find("already freed"), std::string::npos);

  // The checked free (Python's cucache.free raises with its message): -1, the message stored,
  // counted, nothing printed; a good free returns 0.
  void* r = cucache_torch_alloc(4096, dev, stream(0));
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(cucache_torch_free_checked(r, 4096, dev, stream(0)), 0);
  testing::internal::CaptureStderr();
  EXPECT_EQ(cucache_torch_free_checked(r, 4096, dev, stream(0)), -1);
  EXPECT_EQ(cucache_torch_free_checked(foreign, 16, dev, stream(0)), -1);
  err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(err, "") << "the checked free printed";
  EXPECT_EQ(cucache_torch_bad_free_count(), before + 4);
  EXPECT_NE(std::string(cucache_torch_last_error()).find("0x1234"), std::string::npos);
  EXPECT_EQ(cucache_torch_free_checked(nullptr, 0, dev, stream(0)), 0);

  // A device that never allocated, and a device ordinal torch could not have passed.
  testing::internal::CaptureStderr();
  cucache_torch_free(foreign, 16, 60, stream(0));
  cucache_torch_free(foreign, 16, -3, stream(0));
  err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(cucache_torch_bad_free_count(), before + 6);
  EXPECT_NE(err.find("no cucache allocator holds it"), std::string::npos) << err;

  // The allocator is unharmed.
  void* q = cucache_torch_alloc(4096, dev, stream(0));
  EXPECT_EQ(q, p);
  cucache_torch_free(q, 4096, dev, stream(0));
}

TEST(TorchPlugin, FreeWithTheWrongDeviceStillFrees) {
  void* p = cucache_torch_alloc(4096, 11, stream(0));
  ASSERT_NE(p, nullptr);
  const uint64_t before = cucache_torch_bad_free_count();
  cucache_torch_free(p, 4096, 12, stream(0));
  EXPECT_EQ(cucache_torch_bad_free_count(), before);
  EXPECT_EQ(stats(11).allocated_bytes[0].current, 0);
}

TEST(TorchPlugin, SizeZeroAndNull) {
  const uint64_t before = cucache_torch_bad_free_count();
  EXPECT_EQ(cucache_torch_alloc(0, 5, stream(0)), nullptr);
  cucache_torch_free(nullptr, 0, 5, stream(0));
  EXPECT_EQ(cucache_torch_bad_free_count(), before);
  EXPECT_EQ(stats(5).allocation[0].current, 0);
}

TEST(TorchPlugin, RecordStreamDefersReuse) {
  const int dev = 7;
  void* p = cucache_torch_alloc(4096, dev, stream(1));
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(cucache_torch_record_stream(p, stream(3)), 0) << cucache_torch_last_error();
  cucache_torch_free(p, 4096, dev, stream(1));
  void* q = cucache_torch_alloc(4096, dev, stream(1));
  EXPECT_NE(q, p);
  cucache_torch_free(q, 4096, dev, stream(1));

  EXPECT_EQ(cucache_torch_record_stream(reinterpret_cast<void*>(std::uintptr_t{0x40}), stream(3)),
            -1);
  const std::string why = cucache_torch_last_error();
  EXPECT_NE(why.find("record_stream(0x40): it is not a live allocation of any device"),
            std::string::npos)
      << why;
}

TEST(TorchPlugin, FailuresReturnNullWithAMessage) {
  testing::internal::CaptureStderr();
  EXPECT_EQ(cucache_torch_alloc(std::size_t{1} << 40, 8, stream(0)), nullptr);  // > 80 GiB device
  std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("out of memory"), std::string::npos) << err;
  EXPECT_NE(std::string(cucache_torch_last_error()).find("out of memory"), std::string::npos);
  EXPECT_EQ(stats(8).num_ooms, 1u);

  testing::internal::CaptureStderr();
  EXPECT_EQ(cucache_torch_alloc(16, -1, stream(0)), nullptr);
  EXPECT_EQ(cucache_torch_alloc(16, 64, stream(0)), nullptr);
  err = testing::internal::GetCapturedStderr();
  // The registry's words, as the C and C++ APIs say them.
  EXPECT_NE(err.find("invalid device ordinal -1 (16 sim devices)"), std::string::npos) << err;
  EXPECT_NE(err.find("invalid device ordinal 64 (16 sim devices)"), std::string::npos) << err;
  EXPECT_EQ(cucache_torch_get_stats(0, nullptr), -1);
}

TEST(TorchPlugin, DevicesThatDoNotExistAreRefusedNotAnsweredWithZeros) {
  // Every per-device query names the device instead of answering an empty one (16 devices).
  cucache_torch_stats s{};
  char buf[256];
  for (const int device : {16, 99}) {
    EXPECT_EQ(cucache_torch_get_stats(device, &s), -1);
    const std::string why = cucache_torch_last_error();
    EXPECT_NE(why.find("invalid device ordinal " + std::to_string(device) + " (16 sim devices)"),
              std::string::npos)
        << why;
    EXPECT_EQ(cucache_torch_memory_summary(device, buf, sizeof buf), -1);
    EXPECT_EQ(cucache_torch_snapshot_json(device, buf, sizeof buf), -1);
    EXPECT_EQ(cucache_torch_tag_stats(device, buf, sizeof buf), -1);
    EXPECT_EQ(cucache_torch_reset_peak_stats(device), -1);
    EXPECT_EQ(cucache_torch_reset_accumulated_stats(device), -1);
    EXPECT_EQ(cucache_torch_check_device(device), CUCACHE_TORCH_INVALID_DEVICE);
  }
  EXPECT_EQ(cucache_torch_get_stats(-2, &s), -1);
  // Negative: every device, for the resets.
  EXPECT_EQ(cucache_torch_reset_peak_stats(-1), 0) << cucache_torch_last_error();
  EXPECT_EQ(cucache_torch_reset_accumulated_stats(-1), 0) << cucache_torch_last_error();
  EXPECT_EQ(cucache_torch_check_device(15), CUCACHE_TORCH_READY);
  EXPECT_EQ(cucache_torch_check_device(-1), CUCACHE_TORCH_READY);
  EXPECT_EQ(cucache_torch_device_count(), 16);
}

TEST(TorchPlugin, CanonicalConfigurationChecksTheText) {
  char buf[256];
  ASSERT_GE(cucache_torch_canonical_conf("max_split_size_mb:64", buf, sizeof buf), 0)
      << cucache_torch_last_error();
  EXPECT_STREQ(buf, "max_split_size_mb:64");
  ASSERT_GE(cucache_torch_canonical_conf(" ", buf, sizeof buf), 0);
  EXPECT_STREQ(buf, "");
  EXPECT_EQ(cucache_torch_canonical_conf("expandable_segment:True", buf, sizeof buf), -1);
  EXPECT_NE(std::string(cucache_torch_last_error()).find("expandable_segment"), std::string::npos)
      << cucache_torch_last_error();
  // The process's own (CUCACHE_CONF unset: the defaults).
  ASSERT_GE(cucache_torch_canonical_conf(nullptr, buf, sizeof buf), 0);
  EXPECT_STREQ(buf, "");
}

TEST(TorchPlugin, MemoryFractionBeforeAndAfterFirstUse) {
  const int dev = 9;
  ASSERT_EQ(cucache_torch_set_memory_fraction(dev, 0.001), 0) << cucache_torch_last_error();
  EXPECT_EQ(cucache_torch_set_memory_fraction(dev, 1.5), -1);
  testing::internal::CaptureStderr();
  EXPECT_EQ(cucache_torch_alloc(100 * MiB, dev, stream(0)), nullptr);  // cap: 0.1% of 80 GiB
  (void)testing::internal::GetCapturedStderr();
  void* p = cucache_torch_alloc(10 * MiB, dev, stream(0));
  ASSERT_NE(p, nullptr);
  // In use already: the cap changes at once (torch.cuda.set_per_process_memory_fraction).
  ASSERT_EQ(cucache_torch_set_memory_fraction(dev, 0.5), 0) << cucache_torch_last_error();
  void* q = cucache_torch_alloc(100 * MiB, dev, stream(0));
  EXPECT_NE(q, nullptr);
  cucache_torch_free(q, 100 * MiB, dev, stream(0));
  EXPECT_EQ(cucache_torch_set_memory_fraction(dev, 1.5), -1);
  EXPECT_NE(std::string(cucache_torch_last_error()).find("not in [0, 1]"), std::string::npos)
      << cucache_torch_last_error();
  cucache_torch_free(p, 10 * MiB, dev, stream(0));
}

TEST(TorchPlugin, GraphPoolHooksRouteReleaseAndFreeTheFiltersContext) {
  // What torch.cuda.graph does through the hooks library: begin (with torch's capture filter),
  // allocations on the capture's stream, end, and release when the graph goes. Here the filter
  // takes one stream by handle (torch's use_mem_pool); the capture rules are tested in
  // tests/allocator/graph_capture_test.cpp.
  const int dev = 13;
  static int freed = 0;
  static int asked = 0;
  int token = 0;
  const auto filter = [](void* ctx, cucache_torch_stream s) -> int {
    ++asked;
    return ctx != nullptr && s == stream(0x77) ? 1 : 0;
  };
  ASSERT_EQ(cucache_torch_begin_allocate_to_pool(dev, 5, 0, filter, &token, [](void*) { ++freed; }),
            0)
      << cucache_torch_last_error();
  void* routed = cucache_torch_alloc(2 * MiB, dev, stream(0x77));
  void* own = cucache_torch_alloc(2 * MiB, dev, stream(0x78));
  ASSERT_TRUE(routed && own);
  EXPECT_GE(asked, 2);
  cucache_torch_free(routed, 2 * MiB, dev, stream(0x77));
  cucache_torch_free(own, 2 * MiB, dev, stream(0x78));
  // Routed twice: refused (the second context is freed all the same).
  EXPECT_EQ(cucache_torch_begin_allocate_to_pool(dev, 5, 0, filter, &token, [](void*) { ++freed; }),
            -1);
  EXPECT_EQ(freed, 1);
  EXPECT_EQ(cucache_torch_end_allocate_to_pool(dev, 5, 0), 0) << cucache_torch_last_error();
  EXPECT_EQ(freed, 2);  // the route's filter is gone
  EXPECT_EQ(cucache_torch_end_allocate_to_pool(dev, 5, 0), -1);
  EXPECT_NE(std::string(cucache_torch_last_error()).find("nothing allocates"), std::string::npos);
  // The pool keeps its 20 MiB segment until it is released; then empty_cache gives all back.
  EXPECT_EQ(stats(dev).reserved_bytes[0].current, static_cast<int64_t>(40 * MiB));
  EXPECT_EQ(cucache_torch_release_pool(dev, 5, 0), 0) << cucache_torch_last_error();
  EXPECT_EQ(stats(dev).reserved_bytes[0].current, static_cast<int64_t>(20 * MiB));
  EXPECT_EQ(cucache_torch_release_pool(dev, 6, 0), 0);  // a pool cucache never saw: nothing
  EXPECT_EQ(cucache_torch_begin_allocate_to_pool(dev, 0, 0, filter, nullptr, nullptr), -1);
  EXPECT_EQ(cucache_torch_begin_allocate_to_pool(dev, 7, 0, nullptr, nullptr, nullptr), -1);
  EXPECT_EQ(cucache_torch_empty_cache(), 0);
  EXPECT_EQ(stats(dev).reserved_bytes[0].current, 0);
}

TEST(TorchPlugin, CapturesAnnouncedModeTurnsOnAndOff) {
  // The mode's effect (no capture query outside routes, the failure rule) is counted on the
  // simulated device in tests/allocator/announced_capture_test.cpp; here the call and routes.
  const int dev = 14;
  ASSERT_EQ(cucache_torch_set_captures_announced(1), 0) << cucache_torch_last_error();
  const auto filter = [](void*, cucache_torch_stream s) -> int { return s == stream(0x91); };
  void* own = cucache_torch_alloc(1 * MiB, dev, stream(0x92));
  ASSERT_NE(own, nullptr) << cucache_torch_last_error();
  ASSERT_EQ(cucache_torch_begin_allocate_to_pool(dev, 9, 0, filter, nullptr, nullptr), 0)
      << cucache_torch_last_error();
  void* routed = cucache_torch_alloc(1 * MiB, dev, stream(0x91));
  ASSERT_NE(routed, nullptr) << cucache_torch_last_error();
  EXPECT_EQ(cucache_torch_end_allocate_to_pool(dev, 9, 0), 0) << cucache_torch_last_error();
  cucache_torch_free(routed, 1 * MiB, dev, stream(0x91));
  cucache_torch_free(own, 1 * MiB, dev, stream(0x92));
  EXPECT_EQ(cucache_torch_release_pool(dev, 9, 0), 0) << cucache_torch_last_error();
  EXPECT_EQ(cucache_torch_set_captures_announced(0), 0) << cucache_torch_last_error();
}

// --- the torch extension's calls (torch_allocator.cpp) -----------------------------------------

TEST(TorchExtensionCalls, TryAllocSaysOutOfMemoryAndFreeCheckedRefusesWithoutPrinting) {
  const int dev = 6;
  void* p = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(cucache_torch_try_alloc(0, dev, stream(0), &p), CUCACHE_TORCH_ALLOC_OK);
  EXPECT_EQ(p, nullptr);
  EXPECT_EQ(cucache_torch_try_alloc(std::size_t{1} << 40, dev, stream(0), &p),
            CUCACHE_TORCH_ALLOC_OUT_OF_MEMORY);
  EXPECT_EQ(p, nullptr);
  EXPECT_NE(std::string(cucache_torch_last_error()).find("out of memory"), std::string::npos);
  EXPECT_EQ(cucache_torch_try_alloc(64, 99, stream(0), &p), CUCACHE_TORCH_ALLOC_OTHER_ERROR);
  ASSERT_EQ(cucache_torch_try_alloc(3 * MiB, dev, stream(0), &p), CUCACHE_TORCH_ALLOC_OK);
  ASSERT_NE(p, nullptr);
  const uint64_t bad_before = cucache_torch_bad_free_count();
  testing::internal::CaptureStderr();
  EXPECT_EQ(cucache_torch_delete(static_cast<char*>(p) + 256), -1);  // interior
  EXPECT_NE(std::string(cucache_torch_last_error()).find("free"), std::string::npos);
  EXPECT_EQ(cucache_torch_delete(p), 0) << cucache_torch_last_error();
  EXPECT_EQ(cucache_torch_delete(p), -1);  // already freed
  EXPECT_EQ(cucache_torch_delete(nullptr), 0);
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(cucache_torch_bad_free_count(), bad_before);  // the caller reports, not the plug-in
  EXPECT_EQ(stats(dev).allocated_bytes[0].current, 0);
}

TEST(TorchExtensionCalls, SegmentsBaseAllocationAndListener) {
  const int dev = 10;
  static std::vector<std::pair<int, uint64_t>> events;  // (freed, bytes) of device 10
  ASSERT_EQ(cucache_torch_set_segment_listener(
                [](void*, int device, int freed, uint64_t, uint64_t bytes, cucache_torch_stream) {
                  if (device == 10) events.emplace_back(freed, bytes);
                },
                nullptr),
            0)
      << cucache_torch_last_error();
  void* a = cucache_torch_alloc(3 * MiB, dev, stream(0));
  void* b = cucache_torch_alloc(5 * MiB, dev, stream(0));
  ASSERT_TRUE(a && b);
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0], (std::pair<int, uint64_t>{0, 20 * MiB}));
  struct seen {
    int segments = 0;
    uint64_t base = 0, size = 0;
    int allocated = 0, free_blocks = 0;
    uint64_t requested = 0;
  } got;
  ASSERT_EQ(cucache_torch_segments(
                dev,
                [](void* ctx, const cucache_torch_segment_info* s) {
                  auto& g = *static_cast<seen*>(ctx);
                  ++g.segments;
                  g.base = s->address;
                  g.size = s->size;
                  for (size_t i = 0; i < s->block_count; ++i) {
                    if (s->blocks[i].state == CUCACHE_TORCH_BLOCK_ALLOCATED) {
                      ++g.allocated;
                      g.requested += s->blocks[i].requested;
                    } else if (s->blocks[i].state == CUCACHE_TORCH_BLOCK_FREE) {
                      ++g.free_blocks;
                    }
                  }
                  return 0;
                },
                &got),
            0)
      << cucache_torch_last_error();
  EXPECT_EQ(got.segments, 1);
  EXPECT_EQ(got.size, 20 * MiB);
  EXPECT_EQ(got.allocated, 2);
  EXPECT_EQ(got.free_blocks, 1);
  EXPECT_EQ(got.requested, 8 * MiB);
  void* base = nullptr;
  size_t size = 0;
  ASSERT_EQ(cucache_torch_base_allocation(static_cast<char*>(b) + 100, &base, &size), 0)
      << cucache_torch_last_error();
  EXPECT_EQ(reinterpret_cast<uint64_t>(base), got.base);
  EXPECT_EQ(size, 20 * MiB);
  int stack = 0;
  EXPECT_EQ(cucache_torch_base_allocation(&stack, &base, &size), -1);
  EXPECT_NE(std::string(cucache_torch_last_error()).find("not in memory"), std::string::npos);
  cucache_torch_free(a, 3 * MiB, dev, stream(0));
  cucache_torch_free(b, 5 * MiB, dev, stream(0));
  EXPECT_EQ(cucache_torch_empty_cache(), 0);
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1], (std::pair<int, uint64_t>{1, 20 * MiB}));
  EXPECT_EQ(cucache_torch_set_segment_listener(nullptr, nullptr), 0);
  void* c = cucache_torch_alloc(3 * MiB, dev, stream(0));
  EXPECT_EQ(events.size(), 2u);  // cleared
  cucache_torch_free(c, 3 * MiB, dev, stream(0));
}

TEST(TorchExtensionCalls, MemoryFractionReadsBack) {
  const int dev = 1;
  double f = -1;
  ASSERT_EQ(cucache_torch_get_memory_fraction(dev, &f), 0) << cucache_torch_last_error();
  EXPECT_EQ(f, 1.0);  // none set: PyTorch's answer
  ASSERT_EQ(cucache_torch_set_memory_fraction(dev, 0.25), 0) << cucache_torch_last_error();
  ASSERT_EQ(cucache_torch_get_memory_fraction(dev, &f), 0);
  EXPECT_EQ(f, 0.25);
  // 0 is a cap too (torch.cuda.set_per_process_memory_fraction(0.0)): nothing can be reserved.
  ASSERT_EQ(cucache_torch_set_memory_fraction(dev, 0.0), 0) << cucache_torch_last_error();
  ASSERT_EQ(cucache_torch_get_memory_fraction(dev, &f), 0);
  EXPECT_EQ(f, 0.0);
  void* p = nullptr;
  EXPECT_EQ(cucache_torch_try_alloc(4096, dev, stream(0), &p), CUCACHE_TORCH_ALLOC_OUT_OF_MEMORY);
  ASSERT_EQ(cucache_torch_set_memory_fraction(dev, 1.0), 0);
  ASSERT_EQ(cucache_torch_try_alloc(4096, dev, stream(0), &p), CUCACHE_TORCH_ALLOC_OK);
  EXPECT_EQ(cucache_torch_delete(p), 0);
  EXPECT_EQ(cucache_torch_set_memory_fraction(dev, -0.5), -1);
  EXPECT_EQ(cucache_torch_get_memory_fraction(99, &f), -1);
}

TEST(TorchExtensionCalls, PoolUseCountLiveAllocationsAndCheckpoints) {
  const int dev = 0;
  uint64_t uses = 99;
  ASSERT_EQ(cucache_torch_pool_use_count(dev, 3, 4, &uses), 0) << cucache_torch_last_error();
  EXPECT_EQ(uses, 0u);  // unknown pool: 0, as PyTorch answers
  std::vector<void*> live;
  const auto collect = [](void* ctx, void* p) { static_cast<std::vector<void*>*>(ctx)->push_back(p); };
  EXPECT_EQ(cucache_torch_pool_live_allocations(dev, 3, 4, collect, &live), -1);
  EXPECT_NE(std::string(cucache_torch_last_error()).find("no graph pool (3, 4)"), std::string::npos);

  const auto filter = [](void*, cucache_torch_stream s) -> int { return s == stream(0x55) ? 1 : 0; };
  ASSERT_EQ(cucache_torch_begin_allocate_to_pool(dev, 3, 4, filter, nullptr, nullptr), 0)
      << cucache_torch_last_error();
  void* x = cucache_torch_alloc(1 * MiB + 1, dev, stream(0x55));
  void* y = cucache_torch_alloc(4 * MiB, dev, stream(0x55));
  ASSERT_TRUE(x && y);
  ASSERT_EQ(cucache_torch_pool_use_count(dev, 3, 4, &uses), 0);
  EXPECT_EQ(uses, 1u);
  ASSERT_EQ(cucache_torch_pool_live_allocations(dev, 3, 4, collect, &live), 0)
      << cucache_torch_last_error();
  EXPECT_EQ(live.size(), 2u);

  // createOrIncrefPool (a MemPool's owner): one more owner, which may go while the route lasts.
  ASSERT_EQ(cucache_torch_create_or_incref_pool(dev, 3, 4), 0) << cucache_torch_last_error();
  ASSERT_EQ(cucache_torch_pool_use_count(dev, 3, 4, &uses), 0);
  EXPECT_EQ(uses, 2u);
  EXPECT_EQ(cucache_torch_release_pool(dev, 3, 4), 0) << cucache_torch_last_error();

  cucache_torch_checkpoint* cp = cucache_torch_checkpoint_pool(dev, 3, 4);
  ASSERT_NE(cp, nullptr) << cucache_torch_last_error();
  EXPECT_EQ(cucache_torch_checkpoint_live_count(cp), 2u);
  cucache_torch_free(y, 4 * MiB, dev, stream(0x55));
  std::vector<void*> freed, allocd;
  struct both {
    std::vector<void*>* freed;
    std::vector<void*>* allocd;
  } ctx{&freed, &allocd};
  ASSERT_EQ(cucache_torch_restore_pool(
                dev, cp, [](void* c, void* p) { static_cast<both*>(c)->freed->push_back(p); },
                [](void* c, void* p, size_t, size_t, cucache_torch_stream) {
                  static_cast<both*>(c)->allocd->push_back(p);
                },
                &ctx),
            0)
      << cucache_torch_last_error();
  EXPECT_EQ(freed, std::vector<void*>{x});
  std::sort(allocd.begin(), allocd.end());
  std::vector<void*> both_live{x, y};
  std::sort(both_live.begin(), both_live.end());
  EXPECT_EQ(allocd, both_live);  // x and y live again, at their addresses
  EXPECT_EQ(cucache_torch_restore_pool(dev + 1, cp, nullptr, nullptr, nullptr), -1);
  cucache_torch_checkpoint_free(cp);
  EXPECT_EQ(cucache_torch_delete(y), 0) << cucache_torch_last_error();
  EXPECT_EQ(cucache_torch_delete(x), 0) << cucache_torch_last_error();
  EXPECT_EQ(cucache_torch_delete(x), -1);  // twice: refused, named
  EXPECT_NE(std::string(cucache_torch_last_error()).find("free"), std::string::npos);
  EXPECT_EQ(cucache_torch_end_allocate_to_pool(dev, 3, 4), 0) << cucache_torch_last_error();
  EXPECT_EQ(cucache_torch_empty_pool_cache(dev, 3, 4), 0) << cucache_torch_last_error();
  ASSERT_EQ(cucache_torch_pool_live_allocations(dev, 3, 4, collect, &live), 0);
  EXPECT_EQ(cucache_torch_release_pool(dev, 3, 4), 0) << cucache_torch_last_error();
  ASSERT_EQ(cucache_torch_pool_use_count(dev, 3, 4, &uses), 0);
  EXPECT_EQ(uses, 0u);
}

TEST(TorchExtensionCalls, PoolNoSplitMakesOneBlockPerSegment) {
  // setNoSplit's call: a device that does not exist and a pool that does not exist are refused
  // by name; a MemPool(no_split=True) then holds one block per segment.
  EXPECT_EQ(cucache_torch_set_pool_no_split(99, 0, 41), -1);
  EXPECT_NE(std::string(cucache_torch_last_error()).find("invalid device ordinal 99"),
            std::string::npos)
      << cucache_torch_last_error();
  EXPECT_EQ(cucache_torch_set_pool_no_split(0, 0, 41), -1);
  EXPECT_NE(std::string(cucache_torch_last_error()).find("does not exist"), std::string::npos)
      << cucache_torch_last_error();
  ASSERT_EQ(cucache_torch_create_or_incref_pool(0, 0, 41), 0) << cucache_torch_last_error();
  ASSERT_EQ(cucache_torch_set_pool_no_split(0, 0, 41), 0) << cucache_torch_last_error();
  const auto filter = [](void*, cucache_torch_stream s) -> int { return s == stream(0x77) ? 1 : 0; };
  ASSERT_EQ(cucache_torch_begin_allocate_to_pool(0, 0, 41, filter, nullptr, nullptr), 0);
  void* a = cucache_torch_alloc(4 * MiB, 0, stream(0x77));
  void* b = cucache_torch_alloc(4 * MiB, 0, stream(0x77));
  ASSERT_TRUE(a && b);
  struct count {
    int segments = 0;
    int blocks = 0;
  } c;
  ASSERT_EQ(cucache_torch_segments(
                0,
                [](void* ctx, const cucache_torch_segment_info* s) {
                  if (s->pool_first == 0 && s->pool_second == 41) {
                    ++static_cast<count*>(ctx)->segments;
                    static_cast<count*>(ctx)->blocks += static_cast<int>(s->block_count);
                  }
                  return 0;
                },
                &c),
            0);
  EXPECT_EQ(c.segments, 2);  // a 4 MiB segment each, no 20 MiB one split
  EXPECT_EQ(c.blocks, 2);
  EXPECT_EQ(cucache_torch_delete(a), 0);
  EXPECT_EQ(cucache_torch_delete(b), 0);
  EXPECT_EQ(cucache_torch_end_allocate_to_pool(0, 0, 41), 0);
  EXPECT_EQ(cucache_torch_release_pool(0, 0, 41), 0);
  EXPECT_EQ(cucache_torch_release_pool(0, 0, 41), 0);
}

TEST(TorchExtensionCalls, IpcHandleSizeAndRefusals) {
  EXPECT_GT(cucache_torch_ipc_handle_size(), 64u);
  std::vector<char> h(cucache_torch_ipc_handle_size());
  int stack = 0;
  EXPECT_EQ(cucache_torch_ipc_export(&stack, h.data(), h.size()), -1);
  EXPECT_EQ(cucache_torch_ipc_export(&stack, h.data(), 3), -1);
  EXPECT_NE(std::string(cucache_torch_last_error()).find("cucacheIpcHandle"), std::string::npos);
  void* out = nullptr;
  std::memset(h.data(), 0, h.size());
  EXPECT_EQ(cucache_torch_ipc_open(h.data(), h.size(), 1, &out), -1);
  EXPECT_NE(std::string(cucache_torch_last_error()).find("not a cucache IPC handle"),
            std::string::npos);
}

TEST(TorchExtensionCalls, IpcLongHandleOfADefaultModeBlock) {
  // Default mode: a Segment handle of no pieces, the header alone (120 bytes).
  const int dev = 13;
  void* a = cucache_torch_alloc(4 * MiB, dev, stream(0));
  void* b = cucache_torch_alloc(4 * MiB, dev, stream(0));
  ASSERT_TRUE(a && b);
  ASSERT_EQ(static_cast<char*>(b), static_cast<char*>(a) + 4 * MiB);
  void* h = nullptr;
  std::size_t n = 0;
  ASSERT_EQ(cucache_torch_ipc_export_long(b, &h, &n), 0) << cucache_torch_last_error();
  ASSERT_EQ(n, 120u);
  std::uint64_t offset = 0;
  std::memcpy(&offset, static_cast<char*>(h) + 24, sizeof offset);  // as torch_allocator reads it
  EXPECT_EQ(offset, 4 * MiB);
  std::vector<char> bytes(static_cast<char*>(h), static_cast<char*>(h) + n);
  cucache_torch_ipc_free(h);
  void* out = reinterpret_cast<void*>(1);
  EXPECT_EQ(cucache_torch_ipc_open(bytes.data(), n - 1, 1, &out), -1);
  EXPECT_EQ(out, nullptr);
  EXPECT_NE(std::string(cucache_torch_last_error()).find("truncated"), std::string::npos)
      << cucache_torch_last_error();
  bytes.resize(n + 16);  // a piece too many for a Segment handle of 0 pieces
  EXPECT_EQ(cucache_torch_ipc_open(bytes.data(), n + 16, 1, &out), -1);
  EXPECT_NE(std::string(cucache_torch_last_error()).find("trailing bytes"), std::string::npos)
      << cucache_torch_last_error();
  // The sim opens its own process's segment handle (a real device would refuse: same pid).
  ASSERT_EQ(cucache_torch_ipc_open(bytes.data(), n, 1, &out), 0) << cucache_torch_last_error();
  EXPECT_NE(out, nullptr);
  EXPECT_EQ(cucache_torch_ipc_close(out), 0) << cucache_torch_last_error();
  EXPECT_EQ(cucache_torch_ipc_close(out), -1);
  cucache_torch_free(a, 4 * MiB, dev, stream(0));
  cucache_torch_free(b, 4 * MiB, dev, stream(0));
  EXPECT_EQ(cucache_torch_ipc_export_long(nullptr, &h, &n), -1);
  EXPECT_EQ(cucache_torch_ipc_export_long(b, nullptr, &n), -1);
}

std::size_t open_fds() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

// Expandable mode needs its own process (this binary's registry is in default mode): the body
// runs in a fresh copy of the test binary (death-test "threadsafe" style re-executes it) and
// exits 0, or 1 with what went wrong on stderr.
std::string expandable_long_export_and_open() {
  ::setenv("CUCACHE_CONF", "expandable_segments:True,ipc_handles:True", 1);
  const auto fail = [](const std::string& what) {
    return what + ": " + cucache_torch_last_error();
  };
  // 300 pages, each its own physical handle: backed one by one (2 MiB blocks), cached, then one
  // 600 MiB block carved from them.
  std::vector<void*> small;
  for (int i = 0; i < 300; ++i) small.push_back(cucache_torch_alloc(2 * MiB, 0, stream(0)));
  for (void* p : small) cucache_torch_free(p, 2 * MiB, 0, stream(0));
  void* b = cucache_torch_alloc(600 * MiB, 0, stream(0));
  if (b != small.front()) return fail("the 600 MiB block is not carved from the cached pages");
  std::vector<char> fixed(cucache_torch_ipc_handle_size());
  if (cucache_torch_ipc_export(b, fixed.data(), fixed.size()) != -1) {
    return "the fixed export took 300 pieces";
  }
  if (std::string(cucache_torch_last_error()).find("spans 300 physical handles") ==
          std::string::npos ||
      std::string(cucache_torch_last_error()).find("long handle") == std::string::npos) {
    return fail("the fixed export's refusal");
  }
  const std::size_t fds0 = open_fds();
  void* h = nullptr;
  std::size_t n = 0;
  if (cucache_torch_ipc_export_long(b, &h, &n) != 0) return fail("export_long");
  if (n != 120 + 300 * 16) return "export_long made " + std::to_string(n) + " bytes";
  std::int32_t pieces = 0;
  std::memcpy(&pieces, static_cast<char*>(h) + 112, sizeof pieces);
  if (pieces != 300) return "pieceCount " + std::to_string(pieces);
  // The exporter keeps the 300 descriptors open for importers' pidfd_getfd.
  if (open_fds() != fds0 + 300) return "after export: " + std::to_string(open_fds()) + " fds";
  void* out = reinterpret_cast<void*>(1);
  if (cucache_torch_ipc_open(h, n - 16, 1, &out) != -1 || out != nullptr) {
    return "a truncated long handle was opened";
  }
  if (open_fds() != fds0 + 300) return "a refused open leaked descriptors";
  // As torch's getIpcDevPtr does: the exporter's descriptor numbers, duplicated by pidfd_getfd
  // (here from this very process), imported, then closed.
  if (cucache_torch_ipc_open(h, n, 1, &out) != 0) return fail("open");
  if (out == nullptr || out == b) return "open returned the exporter's address or NULL";
  if (open_fds() != fds0 + 300) return "open leaked its duplicated descriptors";
  if (cucache_torch_ipc_close(out) != 0) return fail("close");
  if (cucache_torch_ipc_close(out) != -1) return "closed twice";
  cucache_torch_ipc_free(h);
  cucache_torch_free(b, 600 * MiB, 0, stream(0));
  return "";
}

TEST(TorchExtensionCallsDeathTest, IpcLongHandleOfThreeHundredExpandablePages) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        const std::string err = expandable_long_export_and_open();
        if (!err.empty()) std::fprintf(stderr, "%s\n", err.c_str());
        std::_Exit(err.empty() ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(TorchPlugin, SizeRulesChangeAtRunTimeAsPyTorchsSettingsDo) {
  // torch.cuda.memory._set_allocator_settings through the hooks library: each call resets
  // max_split_size, roundup_power2_divisions and garbage_collection_threshold, then applies its
  // keys; the rules hold for the allocations after it, on every device (created or not).
  const int dev = 11;
  const std::size_t n = 84 * MiB;  // PyTorch's test: 21 Mi floats
  std::vector<void*> held;
  auto grows_by = [&](int d) {
    const int64_t before = stats(d).active_bytes[0].allocated;
    void* p = cucache_torch_alloc(n, d, stream(0));
    EXPECT_NE(p, nullptr);
    held.push_back(p);
    return stats(d).active_bytes[0].allocated - before;
  };
  ASSERT_EQ(cucache_torch_set_size_rules(""), 0) << cucache_torch_last_error();
  EXPECT_EQ(grows_by(dev), static_cast<int64_t>(n));
  ASSERT_EQ(cucache_torch_set_size_rules("roundup_power2_divisions:4"), 0)
      << cucache_torch_last_error();
  EXPECT_EQ(grows_by(dev), static_cast<int64_t>(96 * MiB));  // 64 MiB + 2 steps of 16 MiB
  ASSERT_EQ(cucache_torch_set_size_rules("garbage_collection_threshold:0.5"), 0);
  ASSERT_EQ(cucache_torch_set_size_rules("garbage_collection_threshold:0.5,max_split_size_mb:40"),
            0)
      << cucache_torch_last_error();
  EXPECT_EQ(grows_by(dev), static_cast<int64_t>(n));        // the divisions were reset
  EXPECT_EQ(stats(dev).oversize_allocations, 3u);           // recounted under the 40 MiB cap
  ASSERT_EQ(cucache_torch_set_size_rules(
                "garbage_collection_threshold:0.5,"
                "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]"),
            0)
      << cucache_torch_last_error();
  EXPECT_EQ(stats(dev).oversize_allocations, 0u);
  EXPECT_EQ(grows_by(dev), static_cast<int64_t>(88 * MiB));  // 8 divisions: 80 + 8 MiB
  // A device first used after the call starts with the rules in force.
  EXPECT_EQ(grows_by(12), static_cast<int64_t>(88 * MiB));

  // Refused, naming the reason; nothing changes.
  EXPECT_EQ(cucache_torch_set_size_rules("max_split_size_mb:40,expandable_segments:True"), -1);
  EXPECT_NE(std::string(cucache_torch_last_error()).find("'expandable_segments' is not a size rule"),
            std::string::npos)
      << cucache_torch_last_error();
  EXPECT_EQ(cucache_torch_set_size_rules("expandable_segments:False"), -1);  // even its default
  EXPECT_NE(std::string(cucache_torch_last_error()).find("'expandable_segments' is not a size rule"),
            std::string::npos)
      << cucache_torch_last_error();
  EXPECT_EQ(cucache_torch_set_size_rules("roundup_power2_divisions:3"), -1);
  EXPECT_NE(std::string(cucache_torch_last_error()).find("roundup_power2_divisions"),
            std::string::npos)
      << cucache_torch_last_error();
  EXPECT_EQ(cucache_torch_set_size_rules(nullptr), -1);
  EXPECT_EQ(grows_by(dev), static_cast<int64_t>(88 * MiB));

  ASSERT_EQ(cucache_torch_set_size_rules(""), 0) << cucache_torch_last_error();
  EXPECT_EQ(grows_by(dev), static_cast<int64_t>(n));
  for (void* p : held) {
    const int d = p == held[5] ? 12 : dev;
    cucache_torch_free(p, n, d, stream(0));
  }
  EXPECT_EQ(stats(dev).allocated_bytes[0].current, 0);
  EXPECT_EQ(stats(12).allocated_bytes[0].current, 0);
}

}  // namespace
