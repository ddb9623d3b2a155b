// A million checked operations (issue 11; ctest label `stress`): the randomized program of
// tests/allocator/randomized_test.cpp, widened to every config key, request sizes over the whole
// size_t range, failures injected on every kind of device call and streams destroyed while their
// blocks are live or pending. After every operation: check_invariants, the shadow model (live
// blocks never overlap, each 512-aligned and at least its request), the device's bytes equal to
// the reserved bytes, and the allocation count, allocated bytes and requested bytes equal to the
// model's. A failed allocation changes no allocation statistic; a request larger than the device
// fails before anything is released or created; bad pointers are refused with nothing changed.
//
// 14 configurations x 2 seeds x 36,000 operations = 1,008,000 operations. CUCACHE_STRESS_SCALE
// (a factor: 0.25 in the ASan job) scales the count; CUCACHE_RANDOM_SEED replays one
// seed (printed on failure with the operation number).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/size_policy.hpp"
#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

constexpr std::size_t k_ops_per_run = 36'000;
constexpr std::size_t k_size_max = std::numeric_limits<std::size_t>::max();
constexpr std::size_t k_capacity = 3 * GiB;

// Every config key (trace is the registry's, tested there), alone and combined, in both modes.
const std::vector<std::string>& configs() {
  static const std::vector<std::string> all = {
      "",
      "roundup_power2_divisions:4",
      "roundup_power2_divisions:[1:4,64:2,>:1]",
      "roundup_power2_divisions:[1:0,>:2147483648]",
      "max_split_size_mb:20",
      "max_split_size_mb:64,max_non_split_rounding_mb:128",
      "garbage_collection_threshold:0.6",
      "memory_fraction:0.5",
      "memory_limit:1GiB",
      "expandable_segments:True",
      "expandable_segments:True,roundup_power2_divisions:8,max_split_size_mb:100",
      "expandable_segments:True,memory_limit:768MiB,garbage_collection_threshold:0.5",
      "expandable_segments:True,per_process_memory_fraction:0.4",
      "roundup_power2_divisions:[256:8,>:1],garbage_collection_threshold:0.9,"
      "max_split_size_mb:200,memory_limit:2GiB",
  };
  return all;
}

// Sizes at the edge of every size rule, of the device and of size_t, each also +-1; and the
// edges of this configuration's own limits.
std::vector<std::size_t> edge_sizes(const config& cfg) {
  std::vector<std::size_t> base = {512,
                                   MiB,
                                   2 * MiB,
                                   10 * MiB,
                                   20 * MiB,
                                   64 * MiB,
                                   k_capacity,
                                   std::size_t{80} << 30,
                                   std::size_t{160} << 30,
                                   std::size_t{1} << 44,
                                   std::size_t{1} << 62,
                                   std::size_t{1} << 63,
                                   0xc000000000000001ULL,
                                   0xe000000000000001ULL,
                                   0xf000000000000000ULL,
                                   0xfffffffffd7fffffULL,
                                   detail::k_max_request_bytes - 20 * MiB,
                                   detail::k_max_request_bytes,
                                   k_size_max - 511,
                                   k_size_max};
  if (cfg.memory_limit_bytes != 0) base.push_back(cfg.memory_limit_bytes);
  if (cfg.memory_fraction != 0.0) {
    base.push_back(static_cast<std::size_t>(cfg.memory_fraction * static_cast<double>(k_capacity)));
  }
  if (cfg.max_split_size != k_size_max) base.push_back(cfg.max_split_size);
  std::vector<std::size_t> out = {1};
  for (const std::size_t b : base) {
    for (const std::size_t v : {b - 1, b, b + 1}) {
      if (v != 0) out.push_back(v);  // b + 1 wraps to 0 only for SIZE_MAX
    }
  }
  return out;
}

struct live_block {
  std::uintptr_t addr;
  std::size_t requested;
  std::size_t block;  // allocation_size: the rounded size the stats count
};

/// What a run exercised (printed at its end).
struct tally {
  std::uint64_t ops = 0, allocs = 0, ooms = 0, huge_refused = 0, injected = 0, surfaced = 0,
                bad_pointer_rounds = 0, streams_destroyed = 0;
};

class million_ops : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(million_ops, InvariantsHoldAfterEveryOperation) {
  const auto& [text, seed_index] = GetParam();
  std::uint64_t seed =
      0x5EED0000ULL + std::hash<std::string>{}(text)*31 + static_cast<std::uint64_t>(seed_index);
  if (const char* s = std::getenv("CUCACHE_RANDOM_SEED")) seed = std::strtoull(s, nullptr, 10);
  SCOPED_TRACE("config '" + text + "', seed " + std::to_string(seed) +
               " (rerun with CUCACHE_RANDOM_SEED=" + std::to_string(seed) + ")");
  const auto ops = static_cast<std::size_t>(static_cast<double>(k_ops_per_run) * stress_scale());

  const config cfg = parse_config(text);
  sim_options o;
  o.capacity_bytes = k_capacity;
  sim_allocator a(cfg, o);
  const std::vector<std::size_t> edges = edge_sizes(cfg);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::vector<live_block> live;
  shadow_blocks by_addr;  // shadow model: live ranges (requested sizes)
  std::int64_t allocated_bytes = 0;               // shadow: sum of live block sizes
  std::int64_t requested_bytes = 0;               // shadow: sum of live requests
  // Two fake streams and two the sim created (destroyed and replaced now and then, with blocks
  // still live and frees pending on them).
  std::array<stream_handle, 4> streams = {nullptr, stream(0x10), a.sim->create_stream(),
                                          a.sim->create_stream()};
  tally t;

  auto random_size = [&]() -> std::size_t {
    const double r = unit(rng);
    if (r < 0.75) {  // what fills the device: 1 B .. 256 MiB, log-uniform
      return std::max<std::size_t>(
          1, static_cast<std::size_t>(std::exp(unit(rng) * std::log(256.0 * MiB))));
    }
    if (r < 0.85) {  // the whole of size_t, log-uniform
      const unsigned bits = static_cast<unsigned>(rng() % 64);
      const std::size_t base = std::size_t{1} << bits;
      return base | (rng() & (base - 1));
    }
    if (r < 0.95) return edges[rng() % edges.size()];
    // A multiple of 512 B, 1 MiB or 2 MiB, give or take one.
    const std::size_t units[] = {512, MiB, 2 * MiB};
    const std::size_t u = units[rng() % 3];
    return std::max<std::size_t>(1, u * (1 + rng() % 64) + (rng() % 3) - 1);
  };
  auto pick_stream = [&] { return streams[rng() % streams.size()]; };
  auto remove_live = [&](std::size_t i) {
    by_addr.remove(live[i].addr);
    allocated_bytes -= static_cast<std::int64_t>(live[i].block);
    requested_bytes -= static_cast<std::int64_t>(live[i].requested);
    live[i] = live.back();
    live.pop_back();
  };

  for (std::size_t op = 0; op < ops; ++op) {
    SCOPED_TRACE("operation " + std::to_string(op));
    const double r = unit(rng);
    std::size_t touched = live.size();  // the live block a failed free may have released
    try {
      if (r < 0.46 || live.empty()) {
        const std::size_t size = random_size();
        const stream_handle s = pick_stream();
        const auto before = a.stats();
        void* p = nullptr;
        try {
          p = a.alloc.allocate(size, s);
        } catch (const out_of_memory&) {
          ++t.ooms;
          const auto after = a.stats();
          ASSERT_EQ(after.oom_count, before.oom_count + 1);
          if (size > k_capacity) {
            // Refused before the ladder: nothing released, nothing created. (Pending frees whose
            // events completed may have been retired on the way: active bytes can only drop.)
            ++t.huge_refused;
            ASSERT_EQ(after.reserved_bytes[0].current, before.reserved_bytes[0].current);
            ASSERT_EQ(after.device_free_count, before.device_free_count);
            ASSERT_EQ(after.device_alloc_count, before.device_alloc_count);
            ASSERT_GE(after.free_bytes, before.free_bytes);
          }
        } catch (const cuda_error&) {
          ++t.surfaced;  // an injected failure of a device call the allocation made
        }
        if (p == nullptr) {
          const auto after = a.stats();
          ASSERT_EQ(after.allocation_count[0].current, before.allocation_count[0].current);
          ASSERT_EQ(after.allocated_bytes[0].current, before.allocated_bytes[0].current);
          ASSERT_EQ(after.requested_bytes[0].current, before.requested_bytes[0].current);
          ASSERT_LE(after.active_bytes[0].current, before.active_bytes[0].current);
        } else {
          ++t.allocs;
          ASSERT_LE(size, k_capacity) << "a request larger than the device was served";
          const auto ad = addr(p);
          ASSERT_EQ(ad % 512, 0u);
          const std::size_t got = a.alloc.allocation_size(p);
          ASSERT_GE(got, size);
          ASSERT_TRUE(by_addr.add(ad, size));
          live.push_back({ad, size, got});
          allocated_bytes += static_cast<std::int64_t>(got);
          requested_bytes += static_cast<std::int64_t>(size);
        }
      } else if (r < 0.80) {
        touched = rng() % live.size();
        void* p = reinterpret_cast<void*>(live[touched].addr);
        if (unit(rng) < 0.2) {
          a.alloc.deallocate(p, pick_stream());
        } else {
          a.alloc.deallocate(p);
        }
        remove_live(touched);
        touched = live.size();
      } else if (r < 0.86) {
        a.alloc.record_stream(reinterpret_cast<void*>(live[rng() % live.size()].addr),
                              pick_stream());
      } else if (r < 0.91) {
        if (unit(rng) < 0.6) {
          a.sim->complete_stream(pick_stream());
        } else {
          a.sim->complete_all();
        }
      } else if (r < 0.915) {
        a.alloc.empty_cache();
      } else if (r < 0.918) {
        // The program destroys a stream whose blocks may be live or pending, and makes another.
        const std::size_t i = 2 + rng() % 2;
        a.sim->destroy_stream(streams[i]);
        streams[i] = a.sim->create_stream();
        ++t.streams_destroyed;
      } else if (r < 0.925) {
        (void)a.alloc.memory_summary();
        if (unit(rng) < 0.2) a.alloc.reset_peak_stats();
      } else if (r < 0.96) {
        // One failure of any kind of device call, soon.
        const auto kind = static_cast<sim_call>(rng() % k_sim_call_kinds);
        a.sim->fail_nth(kind, 1 + rng() % 4);
        ++t.injected;
      } else {
        // Bad pointers are refused with nothing changed.
        ++t.bad_pointer_rounds;
        const auto before = a.stats();
        int host = 0;
        EXPECT_THROW(a.alloc.deallocate(&host), invalid_argument);
        EXPECT_THROW(a.alloc.record_stream(&host, pick_stream()), invalid_argument);
        EXPECT_THROW(a.alloc.deallocate(reinterpret_cast<void*>(rng() | 1)), invalid_argument);
        const auto& b = live[rng() % live.size()];
        if (b.requested > 1) {
          void* interior = reinterpret_cast<char*>(b.addr) + 1 + rng() % (b.requested - 1);
          EXPECT_THROW(a.alloc.deallocate(interior), invalid_argument);
          EXPECT_THROW(a.alloc.deallocate(interior, pick_stream()), invalid_argument);
          EXPECT_FALSE(a.alloc.try_deallocate(interior, nullptr, false));
        }
        const auto after = a.stats();
        ASSERT_EQ(after.allocation_count[0].current, before.allocation_count[0].current);
        ASSERT_EQ(after.active_bytes[0].current, before.active_bytes[0].current);
        ASSERT_EQ(after.reserved_bytes[0].current, before.reserved_bytes[0].current);
      }
    } catch (const cuda_error&) {
      // An injected failure surfaced (a device call inside free, record_stream, empty_cache...):
      // the allocator must still be consistent, and is the judge of whether a block was freed.
      ++t.surfaced;
      if (touched < live.size() &&
          a.alloc.allocation_size(reinterpret_cast<void*>(live[touched].addr)) == 0) {
        remove_live(touched);
      }
    }
    ASSERT_NO_THROW(a.alloc.check_invariants());
    const auto s = a.stats();
    ASSERT_EQ(a.sim->used_bytes(), static_cast<std::size_t>(s.reserved_bytes[0].current));
    ASSERT_EQ(static_cast<std::size_t>(s.allocation_count[0].current), live.size());
    ASSERT_EQ(s.allocated_bytes[0].current, allocated_bytes);
    ASSERT_EQ(s.requested_bytes[0].current, requested_bytes);
    if (s.memory_limit != 0) {
      ASSERT_LE(static_cast<std::size_t>(s.reserved_bytes[0].current), s.memory_limit);
    }
  }
  t.ops = ops;
  // Drain: everything freed and the cache emptied leaves nothing on the device.
  for (std::size_t k = 0; k < k_sim_call_kinds; ++k) {
    a.sim->fail_nth(static_cast<sim_call>(k), 0);
    a.sim->fail_always(static_cast<sim_call>(k), false);
  }
  for (auto& b : live) a.alloc.deallocate(reinterpret_cast<void*>(b.addr));
  a.alloc.empty_cache();
  a.alloc.check_invariants();
  EXPECT_EQ(a.reserved(), 0);
  EXPECT_EQ(a.sim->live_segments(), 0u);
  EXPECT_EQ(a.sim->live_handles(), 0u);
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  EXPECT_GT(t.allocs, ops / 5);
  EXPECT_GT(t.ooms, 0u);
  EXPECT_GT(t.huge_refused, 0u);
  EXPECT_GT(t.injected, 0u);
  std::printf(
      "million_ops: %llu operations: %llu allocations, %llu out of memory (%llu beyond "
      "the device), %llu failures injected (%llu surfaced), %llu bad-pointer rounds, "
      "%llu streams destroyed\n",
      static_cast<unsigned long long>(t.ops), static_cast<unsigned long long>(t.allocs),
      static_cast<unsigned long long>(t.ooms), static_cast<unsigned long long>(t.huge_refused),
      static_cast<unsigned long long>(t.injected), static_cast<unsigned long long>(t.surfaced),
      static_cast<unsigned long long>(t.bad_pointer_rounds),
      static_cast<unsigned long long>(t.streams_destroyed));
}

INSTANTIATE_TEST_SUITE_P(EveryKey, million_ops,
                         ::testing::Combine(::testing::ValuesIn(configs()),
                                            ::testing::Values(0, 1)),
                         [](const ::testing::TestParamInfo<million_ops::ParamType>& p) {
                           return "config" + std::to_string(p.index / 2) + "_seed" +
                                  std::to_string(std::get<1>(p.param));
                         });

}  // namespace
}  // namespace cucache::test
