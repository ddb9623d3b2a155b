// A server that runs for weeks (issue 22): 100,000 cycles of stream create -> allocate and free
// on it (in its order) -> destroy, on the simulated device, in both modes. No failure; host memory
// (resident set) grows by at most 10 MB after the first 1,000 cycles (not checked under a
// sanitizer); reserved memory stays within
// the working set of one request (checked after every cycle); the simulated device sees no call on
// a destroyed stream. The time per cycle over the first and the last 10% is printed, not asserted.
//
// Every 1,000th cycle frees without naming the stream (no quiet event can be recorded) and then
// empties the cache: the device-wide path retires those pools instead.
//
// CUCACHE_STRESS_SCALE (a factor) scales the number of cycles.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <unistd.h>

#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

// Under a sanitizer the runtime keeps freed heap memory in quarantine: the resident set then says
// nothing about the allocator, and is printed only.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool k_sanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
constexpr bool k_sanitized = true;
#else
constexpr bool k_sanitized = false;
#endif
#else
constexpr bool k_sanitized = false;
#endif

/// The process's resident set in bytes (/proc/self/statm), 0 where unknown.
std::size_t resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::size_t pages_total = 0, pages_resident = 0;
  if (!(statm >> pages_total >> pages_resident)) return 0;
  return pages_resident * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
}

class StreamSoak : public ::testing::TestWithParam<const char*> {};

TEST_P(StreamSoak, CreateAllocateFreeDestroy) {
  const auto cycles = static_cast<std::size_t>(100'000 * stress_scale());
  ASSERT_GE(cycles, 2'000u) << "CUCACHE_STRESS_SCALE too small for this test";
  sim_options o;
  o.events_complete_immediately = true;  // each request's work is done by the next one
  sim_allocator a(parse_config(GetParam()), o);
  // One request's working set: a small block and a large one (their segments: 2 + 20 MiB; in
  // expandable mode the pages they touch). Reserved memory never holds more than that.
  constexpr std::size_t k_sizes[][2] = {
      {4 * KiB, 3 * MiB}, {512 * KiB, 8 * MiB}, {1 * MiB, 6 * MiB}, {64 * KiB, 9 * MiB}};
  constexpr std::int64_t k_working_set = 22 * static_cast<std::int64_t>(MiB);
  std::size_t rss_after_warmup = 0;
  const std::size_t tenth = cycles / 10;
  std::chrono::steady_clock::duration first_tenth{}, last_tenth{};
  auto tenth_start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < cycles; ++i) {
    const stream_handle s = a.sim->create_stream();
    const auto& sz = k_sizes[i % 4];
    void* small = a.alloc.allocate(sz[0], s);
    void* large = a.alloc.allocate(sz[1], s);
    ASSERT_NE(small, nullptr);
    ASSERT_NE(large, nullptr);
    if (i % 1000 == 999) {
      a.alloc.deallocate(small);
      a.alloc.deallocate(large);
      a.sim->destroy_stream(s);
      a.alloc.empty_cache();
      ASSERT_EQ(a.reserved(), 0) << "cycle " << i;
    } else {
      a.alloc.deallocate(small, s);
      a.alloc.deallocate(large, s);
      a.sim->destroy_stream(s);
    }
    ASSERT_LE(a.reserved(), k_working_set) << "cycle " << i;
    if (i + 1 == 1000) rss_after_warmup = resident_bytes();
    if (i + 1 == tenth) first_tenth = std::chrono::steady_clock::now() - tenth_start;
    if (i + 1 == cycles - tenth) tenth_start = std::chrono::steady_clock::now();
  }
  last_tenth = std::chrono::steady_clock::now() - tenth_start;
  const std::size_t rss_end = resident_bytes();
  a.alloc.check_invariants();
  EXPECT_EQ(a.sim->destroyed_stream_calls(), 0u);
  if (!k_sanitized && rss_after_warmup != 0 && rss_end != 0) {
    EXPECT_LE(rss_end, rss_after_warmup + 10'000'000)
        << "resident set after 1,000 cycles " << rss_after_warmup << " bytes, at the end "
        << rss_end;
  }
  const auto per_cycle_ns = [&](std::chrono::steady_clock::duration d) {
    return static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(d).count()) /
           static_cast<double>(tenth);
  };
  std::printf(
      "stream soak '%s': %zu cycles; ns per cycle, first 10%%: %.0f, last 10%%: %.0f; resident "
      "set after 1,000 cycles %zu bytes, at the end %zu (+%lld)\n",
      GetParam(), cycles, per_cycle_ns(first_tenth), per_cycle_ns(last_tenth), rss_after_warmup,
      rss_end, static_cast<long long>(rss_end) - static_cast<long long>(rss_after_warmup));
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Modes, StreamSoak, ::testing::Values("", "expandable_segments:True"));

}  // namespace
}  // namespace cucache::test
