// Headroom and reserve on the simulated device, with exact expectations: max_allocatable is the
// largest request that succeeds (that many bytes are served; 512 B more -- the allocation granule
// -- are refused with out_of_memory) in both modes, under a memory limit, on several streams and
// over fragmented caches; reserve and reserve_mb fill the cache so that a workload whose peak fits
// makes no device allocation; nvtx is off by default and works when on.
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

constexpr std::size_t k_granule = 512;

/// n = max_allocatable(s): n + 512 fails, n succeeds (and is freed again), n + 512 fails again.
void expect_exact(device_allocator& a, stream_handle s, const char* where) {
  SCOPED_TRACE(where);
  const std::size_t n = a.max_allocatable(s);
  ASSERT_GT(n, 0u);
  EXPECT_THROW((void)a.allocate(n + k_granule, s), out_of_memory) << "n = " << n;
  EXPECT_EQ(a.max_allocatable(s), n);
  void* p = nullptr;
  EXPECT_NO_THROW(p = a.allocate(n, s)) << "n = " << n;
  ASSERT_NE(p, nullptr);
  a.deallocate(p);
  EXPECT_THROW((void)a.allocate(n + k_granule, s), out_of_memory) << "n = " << n;
  a.check_invariants();
}

sim_options capacity(std::size_t bytes) {
  sim_options o;
  o.capacity_bytes = bytes;
  return o;
}

TEST(MaxAllocatable, EmptyDeviceDefaultMode) {
  sim_allocator a({}, capacity(GiB));
  EXPECT_EQ(a.alloc.max_allocatable(), GiB);
  expect_exact(a.alloc, nullptr, "empty");
}

TEST(MaxAllocatable, EmptyDeviceExpandable) {
  sim_allocator a(parse_config("expandable_segments:True"), capacity(GiB));
  EXPECT_EQ(a.alloc.max_allocatable(), GiB);
  expect_exact(a.alloc, nullptr, "empty");
}

TEST(MaxAllocatable, UnderAMemoryLimit) {
  sim_allocator a(parse_config("memory_limit:300MiB"), capacity(GiB));
  EXPECT_EQ(a.alloc.max_allocatable(), 300 * MiB);
  void* p = a.alloc.allocate(50 * MiB);
  EXPECT_EQ(a.alloc.max_allocatable(), 250 * MiB);
  expect_exact(a.alloc, nullptr, "limit, one live block");
  a.alloc.deallocate(p);
  expect_exact(a.alloc, nullptr, "limit, cached");
}

TEST(MaxAllocatable, ACachedBlockInsideAPinnedSegmentIsTheLargest) {
  sim_allocator a({}, capacity(256 * MiB));
  void* big = a.alloc.allocate(100 * MiB);
  a.alloc.deallocate(big);
  void* pin = a.alloc.allocate(5 * MiB);  // splits the 100 MiB segment: 95 MiB stay cached
  EXPECT_EQ(addr(pin), addr(big));
  std::vector<void*> others;
  for (int i = 0; i < 7; ++i) others.push_back(a.alloc.allocate(20 * MiB, stream(3)));  // 140 MiB
  // The device has 16 MiB left; the 95 MiB free block is the largest request.
  EXPECT_EQ(a.alloc.max_allocatable(), 95 * MiB);
  expect_exact(a.alloc, nullptr, "cached block");
  // Another stream's pool cannot use that block: there the device's 16 MiB are the room (a 14 MiB
  // request gets its own 14 MiB segment; under 10 MiB a 20 MiB one, which does not fit).
  // (stream(1) would be cudaStreamLegacy: the legacy stream, as nullptr.)
  EXPECT_EQ(a.alloc.max_allocatable(stream(4)), 16 * MiB);
  expect_exact(a.alloc, stream(4), "other stream");
  for (void* p : others) a.alloc.deallocate(p);
  a.alloc.deallocate(pin);
}

TEST(MaxAllocatable, RoomUnderTwentyMiBServesSmallOrOwnSegmentRequests) {
  sim_allocator a({}, capacity(24 * MiB));
  void* p = a.alloc.allocate(20 * MiB);                    // device: 4 MiB left
  EXPECT_EQ(a.alloc.max_allocatable(stream(2)), 1 * MiB);  // the small pool's 2 MiB segment
  expect_exact(a.alloc, stream(2), "small only");
  a.alloc.deallocate(p);
}

struct sweep_case {
  const char* conf;
  std::size_t capacity;
};

class MaxAllocatableSweep : public ::testing::TestWithParam<sweep_case> {};

TEST_P(MaxAllocatableSweep, ExactOverRandomFragmentedStatesOnThreeStreams) {
  const sweep_case c = GetParam();
  sim_allocator a(parse_config(c.conf), capacity(c.capacity));
  std::mt19937_64 rng(42);
  const stream_handle streams[] = {nullptr, stream(1), stream(2)};
  struct live {
    void* p;
    stream_handle s;
  };
  std::vector<live> alive;
  std::size_t checks = 0;
  for (int step = 0; step < 400; ++step) {
    const stream_handle s = streams[rng() % 3];
    const bool free_one = !alive.empty() && rng() % 3 == 0;
    if (free_one) {
      const std::size_t i = rng() % alive.size();
      a.alloc.deallocate(alive[i].p);
      alive.erase(alive.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      // Sizes from 1 KiB to 48 MiB, log-uniform.
      const double e = std::uniform_real_distribution<double>(10.0, 25.6)(rng);
      const auto bytes = static_cast<std::size_t>(std::exp2(e));
      try {
        alive.push_back({a.alloc.allocate(bytes, s), s});
      } catch (const out_of_memory&) {
        // Full: free half.
        for (std::size_t i = 0; i < alive.size(); i += 2) a.alloc.deallocate(alive[i].p);
        std::vector<live> rest;
        for (std::size_t i = 1; i < alive.size(); i += 2) rest.push_back(alive[i]);
        alive.swap(rest);
      }
    }
    if (step % 25 == 24) {
      expect_exact(a.alloc, s, c.conf);
      ++checks;
    }
  }
  EXPECT_EQ(checks, 16u);
  for (const live& l : alive) a.alloc.deallocate(l.p);
}

INSTANTIATE_TEST_SUITE_P(
    Configs, MaxAllocatableSweep,
    ::testing::Values(sweep_case{"", 512 * MiB}, sweep_case{"max_split_size_mb:40", 512 * MiB},
                      sweep_case{"roundup_power2_divisions:4", 512 * MiB},
                      sweep_case{"garbage_collection_threshold:0.6", 512 * MiB},
                      sweep_case{"memory_limit:300MiB", 512 * MiB},
                      sweep_case{"expandable_segments:True", 512 * MiB},
                      sweep_case{"expandable_segments:True,coarse_handles:0", 512 * MiB},
                      sweep_case{"expandable_segments:True,coarse_handles:32", 512 * MiB},
                      sweep_case{"expandable_segments:True,coarse_handles:8,memory_limit:300MiB",
                                 512 * MiB},
                      sweep_case{"expandable_segments:True,memory_limit:300MiB", 512 * MiB},
                      sweep_case{"expandable_segments:True,roundup_power2_divisions:4",
                                 512 * MiB}));

// --- reserve ----------------------------------------------------------------------------------

/// Large requests whose live peak is 240 MiB.
void workload(device_allocator& a) {
  for (int step = 0; step < 3; ++step) {
    void* x = a.allocate(100 * MiB);
    void* y = a.allocate(60 * MiB);
    void* z = a.allocate(80 * MiB);
    a.deallocate(y);
    void* w = a.allocate(40 * MiB);
    a.deallocate(x);
    a.deallocate(z);
    a.deallocate(w);
  }
}

TEST(Reserve, DefaultModeMakesTheFirstStepsCallTheDeviceNever) {
  sim_allocator a({}, capacity(GiB));
  a.alloc.reserve(256 * MiB);
  EXPECT_EQ(a.mallocs(), 1u);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(256 * MiB));
  EXPECT_EQ(a.allocated(), 0);
  workload(a.alloc);
  EXPECT_EQ(a.mallocs(), 1u);
  EXPECT_EQ(a.frees(), 0u);
  a.alloc.check_invariants();
  // Without it, the same workload calls the device.
  sim_allocator b({}, capacity(GiB));
  workload(b.alloc);
  EXPECT_GT(b.mallocs(), 1u);
  // Reserved memory is cached memory: empty_cache gives it back.
  a.alloc.empty_cache();
  EXPECT_EQ(a.reserved(), 0);
  EXPECT_EQ(a.frees(), 1u);
}

TEST(Reserve, ConfigReserveMbAtCreation) {
  sim_allocator a(parse_config("reserve_mb:256"), capacity(GiB));
  EXPECT_EQ(a.mallocs(), 1u);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(256 * MiB));
  workload(a.alloc);
  EXPECT_EQ(a.mallocs(), 1u);
}

TEST(Reserve, ExpandableMapsIdlePagesThatTheFirstRequestsUseInPlace) {
  sim_allocator a(parse_config("expandable_segments:True,reserve_mb:256"), capacity(GiB));
  const std::uint64_t creates = a.sim->calls(sim_call::phys_create);
  const std::uint64_t maps = a.sim->calls(sim_call::map);
  EXPECT_EQ(creates, 128u);  // one 2 MiB page per handle
  EXPECT_EQ(maps, 128u);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(256 * MiB));
  workload(a.alloc);
  EXPECT_EQ(a.sim->calls(sim_call::phys_create), creates);
  EXPECT_EQ(a.sim->calls(sim_call::map), maps);
  EXPECT_EQ(a.sim->calls(sim_call::segment_malloc), 0u);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(256 * MiB));
  a.alloc.check_invariants();
  a.alloc.empty_cache();
  EXPECT_EQ(a.reserved(), 0);
}

TEST(Reserve, RefusedWhenTheDeviceOrTheLimitHasNoRoom) {
  sim_allocator a({}, capacity(GiB));
  EXPECT_THROW(a.alloc.reserve(2 * GiB), out_of_memory);
  EXPECT_EQ(a.reserved(), 0);
  sim_allocator b(parse_config("memory_limit:100MiB"), capacity(GiB));
  EXPECT_THROW(b.alloc.reserve(200 * MiB), out_of_memory);
  EXPECT_THROW({ sim_allocator t(parse_config("reserve_mb:2048"), capacity(GiB)); }, out_of_memory);
  EXPECT_THROW(
      { sim_allocator t(parse_config("expandable_segments:True,reserve_mb:2048"), capacity(GiB)); },
      out_of_memory);
}

TEST(Reserve, SizesWhoseRoundingOverflowsAreNamedNotCalledZero) {
  // SIZE_MAX and its neighbours round past the top of size_t: the message says what is wrong
  // instead of "no room for a segment of 0 bytes".
  const std::size_t max = std::numeric_limits<std::size_t>::max();
  for (const char* conf : {"", "expandable_segments:True"}) {
    sim_allocator a(parse_config(conf), capacity(GiB));
    for (const std::size_t bytes : {max, max - MiB, max / 2 * 2 - 1}) {
      try {
        a.alloc.reserve(bytes);
        ADD_FAILURE() << conf << ": reserve(" << bytes << ") succeeded";
      } catch (const out_of_memory& e) {
        const std::string what = e.what();
        EXPECT_NE(what.find("reserve(" + std::to_string(bytes) + " bytes)"), std::string::npos)
            << what;
        EXPECT_NE(what.find("larger than"), std::string::npos) << conf << ": " << what;
        EXPECT_EQ(what.find(" 0 bytes"), std::string::npos) << conf << ": " << what;
      }
    }
    EXPECT_EQ(a.reserved(), 0);
  }
}

TEST(Reserve, ConfigRejectsBadValuesNamingTheKey) {
  for (const char* bad : {"reserve_mb:-1", "reserve_mb:abc", "reserve_mb:99999999999",
                          "reserve_mb:1.5", "reserve_mb:"}) {
    try {
      (void)parse_config(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("reserve_mb"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(parse_config("reserve_mb:0").reserve_bytes, 0u);
  EXPECT_EQ(parse_config("reserve_mb:16777216").reserve_bytes, std::size_t{1} << 44);
  const config c = parse_config("reserve_mb:4096");
  EXPECT_EQ(c.reserve_bytes, 4 * GiB);
  EXPECT_EQ(to_string(c), "reserve_mb:4096");
  EXPECT_EQ(parse_config(to_string(c)), c);
}

// --- nvtx ---------------------------------------------------------------------------------------

TEST(Nvtx, OffByDefaultAndWorkingWhenOn) {
  EXPECT_FALSE(config{}.nvtx);
  EXPECT_FALSE(parse_config("").nvtx);
  EXPECT_TRUE(parse_config("nvtx:True").nvtx);
  EXPECT_EQ(to_string(parse_config("nvtx:True")), "nvtx:True");
  EXPECT_THROW((void)parse_config("nvtx:maybe"), invalid_argument);
  for (const char* conf : {"nvtx:True", "nvtx:True,expandable_segments:True"}) {
    SCOPED_TRACE(conf);
    // Device calls, the out-of-memory ladder and (expandable) page moves and reclaims, ranged.
    sim_allocator a(parse_config(conf), capacity(128 * MiB));
    EXPECT_TRUE(a.alloc.get_config().nvtx);
    void* p = a.alloc.allocate(60 * MiB);
    void* q = a.alloc.allocate(30 * MiB, stream(1));
    a.alloc.deallocate(q);
    EXPECT_THROW((void)a.alloc.allocate(100 * MiB), out_of_memory);
    void* r = a.alloc.allocate(60 * MiB, stream(2));
    a.alloc.deallocate(p);
    a.alloc.deallocate(r);
    a.alloc.empty_cache();
    EXPECT_EQ(a.reserved(), 0);
    a.alloc.check_invariants();
  }
}

}  // namespace
}  // namespace cucache::test
