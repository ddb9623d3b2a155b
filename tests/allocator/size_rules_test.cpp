// device_allocator::set_size_rules: the size rules (roundup_power2_divisions, max_split_size,
// max_non_split_rounding, garbage_collection_threshold) changed at run time, as PyTorch's
// _set_allocator_settings changes them. Exact expectations on the simulated device, a seeded
// randomized program that changes the rules among allocations and frees (invariants after every
// operation, both modes), and threads that allocate while another changes the rules.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/size_policy.hpp"
#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

constexpr std::size_t k_84mib = 84 * MiB;

std::uint64_t seed_from_env(std::uint64_t fallback) {
  if (const char* s = std::getenv("CUCACHE_RANDOM_SEED")) return std::strtoull(s, nullptr, 10);
  return fallback;
}

/// The configuration in force with the size rules of `text` (PyTorch's semantics: the rules not
/// named go back to their defaults).
config rules_of(const device_allocator& a, const std::string& text) {
  const config parsed = parse_config(text);
  config c = a.get_config();
  c.max_split_size = parsed.max_split_size;
  c.max_non_split_rounding = parsed.max_non_split_rounding;
  c.roundup_power2_divisions = parsed.roundup_power2_divisions;
  c.garbage_collection_threshold = parsed.garbage_collection_threshold;
  return c;
}

TEST(SizeRules, DivisionsAndMaxSplitSizeApplyFromTheNextAllocation) {
  sim_allocator a;
  // 84 MiB + 1 byte: 512 B rounding, then 4 divisions (64 MiB + 2 steps of 16 MiB = 96 MiB).
  void* p1 = a.alloc.allocate(k_84mib + 1);
  EXPECT_EQ(a.alloc.allocation_size(p1), k_84mib + 512);
  EXPECT_EQ(a.stats().oversize_allocations, 0u);
  a.alloc.check_invariants();

  a.alloc.set_size_rules(rules_of(a.alloc, "roundup_power2_divisions:4"));
  a.alloc.check_invariants();
  EXPECT_EQ(a.alloc.get_config().roundup_power2_divisions,
            parse_config("roundup_power2_divisions:4").roundup_power2_divisions);
  void* p2 = a.alloc.allocate(k_84mib + 1);
  EXPECT_EQ(a.alloc.allocation_size(p2), 96 * MiB);
  EXPECT_EQ(a.alloc.allocation_size(p1), k_84mib + 512);  // cached blocks stay
  EXPECT_EQ(a.stats().allocated_bytes[0].current,
            static_cast<std::int64_t>(k_84mib + 512 + 96 * MiB));
  a.alloc.check_invariants();

  // The array syntax: 8 divisions for 64..128 MiB: 80 MiB + 8 MiB = 88 MiB.
  a.alloc.set_size_rules(
      rules_of(a.alloc, "roundup_power2_divisions:[64:8,128:2,256:2,512:2,1024:1,>:1]"));
  void* p3 = a.alloc.allocate(k_84mib + 1);
  EXPECT_EQ(a.alloc.allocation_size(p3), 88 * MiB);
  a.alloc.check_invariants();

  // max_split_size 40 MiB (divisions back to none): the live blocks and their segments (86, 96
  // and 88 MiB) become oversize, and the statistics say so at once.
  a.alloc.set_size_rules(rules_of(a.alloc, "max_split_size_mb:40"));
  EXPECT_EQ(a.alloc.get_config().max_split_size, 40 * MiB);
  EXPECT_TRUE(a.alloc.get_config().roundup_power2_divisions.empty());
  EXPECT_EQ(a.stats().oversize_allocations, 3u);
  EXPECT_EQ(a.stats().oversize_segments, 3u);
  a.alloc.check_invariants();
  void* p4 = a.alloc.allocate(k_84mib + 1);
  // Rounded as without divisions, but at or above the cap nothing is split: the whole 86 MiB.
  EXPECT_EQ(a.alloc.allocation_size(p4), 86 * MiB);
  EXPECT_EQ(a.stats().oversize_allocations, 4u);
  EXPECT_EQ(a.stats().oversize_segments, 4u);
  a.alloc.check_invariants();

  // A free under the cap's rules: an oversize block leaves the count.
  a.alloc.deallocate(p2);
  EXPECT_EQ(a.stats().oversize_allocations, 3u);
  a.alloc.check_invariants();
  // A 30 MiB request may not take the cached 96 MiB oversize block (it is below the cap); the
  // miss gives the whole free oversize segment back first, then makes a segment of 30 MiB.
  void* p5 = a.alloc.allocate(30 * MiB);
  EXPECT_EQ(a.mallocs(), 5u);
  EXPECT_EQ(a.frees(), 1u);
  EXPECT_EQ(a.stats().oversize_segments, 3u);
  a.alloc.check_invariants();

  // Back to the defaults: nothing is oversize, and a cached 86 MiB block may be split again.
  a.alloc.set_size_rules(rules_of(a.alloc, ""));
  EXPECT_EQ(a.stats().oversize_allocations, 0u);
  EXPECT_EQ(a.stats().oversize_segments, 0u);
  a.alloc.check_invariants();
  a.alloc.deallocate(p4);
  void* p6 = a.alloc.allocate(30 * MiB);  // carved from p4's free segment
  EXPECT_EQ(p6, p4);
  EXPECT_EQ(a.mallocs(), 5u);
  a.alloc.check_invariants();
  for (void* p : {p1, p3, p5, p6}) a.alloc.deallocate(p);
  a.alloc.check_invariants();
  expect_no_leak(a);
}

TEST(SizeRules, GarbageCollectionThresholdAppliesFromNowOn) {
  // Three cached free segments (200, 210, 220 MiB) on a 1 GiB device, then a 300 MiB request.
  auto run = [](bool set_threshold) {
    sim_options o;
    o.capacity_bytes = 1 * GiB;
    sim_allocator a({}, o);
    for (std::size_t mib : {200, 210, 220}) a.alloc.deallocate(a.alloc.allocate(mib * MiB));
    if (set_threshold) {
      a.alloc.set_size_rules(rules_of(a.alloc, "garbage_collection_threshold:0.5"));
      EXPECT_DOUBLE_EQ(a.alloc.get_config().garbage_collection_threshold, 0.5);
    }
    void* p = a.alloc.allocate(300 * MiB);
    a.alloc.check_invariants();
    const auto out = std::make_pair(a.reserved(), a.frees());
    a.alloc.deallocate(p);
    return out;
  };
  // Without it: 930 MiB reserved. With it (512 MiB): collection releases the oldest free segments
  // until 212 MiB remain reserved -- all three -- before the 300 MiB segment is made.
  EXPECT_EQ(run(false), std::make_pair(static_cast<std::int64_t>(930 * MiB), std::uint64_t{0}));
  EXPECT_EQ(run(true), std::make_pair(static_cast<std::int64_t>(300 * MiB), std::uint64_t{3}));
}

TEST(SizeRules, AKeyThatCannotChangeIsRefusedByName) {
  sim_allocator a(parse_config("max_split_size_mb:100"));
  void* p = a.alloc.allocate(150 * MiB);
  config c = a.alloc.get_config();
  c.expandable_segments = true;
  c.max_split_size = 20 * MiB;
  try {
    a.alloc.set_size_rules(c);
    FAIL() << "no error";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'expandable_segments' cannot change at run time"),
              std::string::npos)
        << e.what();
  }
  // Nothing changed.
  EXPECT_EQ(a.alloc.get_config(), parse_config("max_split_size_mb:100"));
  EXPECT_EQ(a.stats().oversize_allocations, 1u);
  c = a.alloc.get_config();
  c.trace_path = "/tmp/x.csv";
  EXPECT_THROW(a.alloc.set_size_rules(c), invalid_argument);
  // A value parse_config refuses (divisions that are not powers of two).
  c = a.alloc.get_config();
  c.roundup_power2_divisions.assign(k_roundup_power2_intervals, 3);
  EXPECT_THROW(a.alloc.set_size_rules(c), invalid_argument);
  EXPECT_EQ(a.alloc.get_config(), parse_config("max_split_size_mb:100"));
  a.alloc.check_invariants();
  a.alloc.deallocate(p);
}

/// A random set of size rules: divisions (one value or per interval), a cap, a GC threshold.
std::string random_rules(std::mt19937_64& rng) {
  std::string out;
  auto add = [&](const std::string& kv) { out += (out.empty() ? "" : ",") + kv; };
  const std::uint32_t divs[] = {0, 1, 2, 4, 8, 16};
  switch (rng() % 3) {
    case 0:
      break;
    case 1:
      add("roundup_power2_divisions:" + std::to_string(divs[1 + rng() % 5]));
      break;
    default:
      add("roundup_power2_divisions:[1:" + std::to_string(divs[rng() % 6]) +
          ",64:" + std::to_string(divs[rng() % 6]) + ",>:" + std::to_string(divs[rng() % 6]) +
          "]");
  }
  if (rng() % 2 == 0) add("max_split_size_mb:" + std::to_string(20 + rng() % 200));
  if (rng() % 3 == 0) add("max_non_split_rounding_mb:" + std::to_string(20 + rng() % 64));
  if (rng() % 3 == 0) add("garbage_collection_threshold:0." + std::to_string(3 + rng() % 6));
  return out;
}

class size_rules_random : public ::testing::TestWithParam<bool> {};

TEST_P(size_rules_random, RulesChangeAmongAllocationsAndFrees) {
  const bool expandable = GetParam();
  const std::uint64_t seed = seed_from_env(20261203);
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with CUCACHE_RANDOM_SEED)");
  sim_options o;
  o.capacity_bytes = 2 * GiB;
  config base;
  base.expandable_segments = expandable;
  sim_allocator a(base, o);
  std::mt19937_64 rng(seed);
  std::vector<std::pair<void*, std::size_t>> live;
  const stream_handle streams[] = {nullptr, stream(0x10), stream(0x20)};
  std::size_t changes = 0, ooms = 0;
  for (std::size_t op = 0; op < 3000; ++op) {
    SCOPED_TRACE("operation " + std::to_string(op));
    const unsigned r = static_cast<unsigned>(rng() % 100);
    if (r < 5) {
      const std::string text = random_rules(rng);
      SCOPED_TRACE("rules '" + text + "'");
      a.alloc.set_size_rules(rules_of(a.alloc, text));
      ++changes;
      const config now = a.alloc.get_config();
      EXPECT_EQ(now.max_split_size, parse_config(text).max_split_size);
      EXPECT_EQ(now.expandable_segments, expandable);
    } else if (r < 55 || live.empty()) {
      // Mostly small and medium requests, some large enough to be oversize under a cap.
      const std::size_t n = r % 4 == 0 ? 1 + rng() % (300 * MiB)
                            : r % 2 == 0 ? 1 + rng() % (8 * MiB)
                                         : 1 + rng() % (64 * KiB);
      const std::optional<std::size_t> rounded =
          detail::size_policy(a.alloc.get_config()).round_size(n);
      try {
        void* p = a.alloc.allocate(n, streams[rng() % 3]);
        const std::size_t got = a.alloc.allocation_size(p);
        ASSERT_TRUE(rounded.has_value());
        // Expandable mode splits any remainder: exactly the rounding; segments may keep a
        // remainder too small to split.
        if (expandable) {
          EXPECT_EQ(got, *rounded);
        } else {
          EXPECT_GE(got, *rounded);
        }
        live.emplace_back(p, n);
      } catch (const out_of_memory&) {
        ++ooms;
      }
    } else if (r < 97) {
      const std::size_t i = rng() % live.size();
      a.alloc.deallocate(live[i].first);
      live[i] = live.back();
      live.pop_back();
    } else {
      a.alloc.empty_cache();
    }
    a.alloc.check_invariants();
    expect_no_leak(a);
    if (::testing::Test::HasFailure()) return;
  }
  EXPECT_GT(changes, 100u);
  for (auto& [p, n] : live) a.alloc.deallocate(p);
  a.alloc.check_invariants();
  EXPECT_EQ(a.stats().allocated_bytes[0].current, 0);
  EXPECT_EQ(a.stats().oversize_allocations, 0u);
  RecordProperty("ooms", static_cast<int>(ooms));
}

INSTANTIATE_TEST_SUITE_P(Modes, size_rules_random, ::testing::Values(false, true),
                         [](const auto& param_info) { return param_info.param ? "expandable" : "segments"; });

TEST(SizeRulesThreads, AllocationsWhileAnotherThreadChangesTheRules) {
  for (const bool expandable : {false, true}) {
    SCOPED_TRACE(expandable ? "expandable" : "segments");
    config base;
    base.expandable_segments = expandable;
    sim_allocator a(base);
    std::atomic<bool> done{false};
    std::atomic<std::size_t> bad{0};
    std::vector<std::thread> workers;
    for (int t = 0; t < 3; ++t) {
      workers.emplace_back([&, t] {
        std::mt19937_64 rng(1000 + static_cast<std::uint64_t>(t));
        std::vector<void*> mine;
        for (int i = 0; i < 20000; ++i) {
          const std::size_t n = rng() % 4 == 0 ? 1 + rng() % (100 * MiB) : 1 + rng() % (2 * MiB);
          void* p = a.alloc.allocate(n, stream(0x100 * (static_cast<std::uintptr_t>(t) + 1)));
          if (a.alloc.allocation_size(p) < n) bad.fetch_add(1);
          mine.push_back(p);
          if (mine.size() > 8) {
            const std::size_t j = rng() % mine.size();
            a.alloc.deallocate(mine[j]);
            mine[j] = mine.back();
            mine.pop_back();
          }
        }
        for (void* p : mine) a.alloc.deallocate(p);
      });
    }
    std::thread changer([&] {
      std::mt19937_64 rng(7);
      std::size_t n = 0;
      while (!done.load() || n < 50) {
        a.alloc.set_size_rules(rules_of(a.alloc, random_rules(rng)));
        ++n;
        if (n % 8 == 0) (void)a.stats();
      }
    });
    for (auto& w : workers) w.join();
    done.store(true);
    changer.join();
    EXPECT_EQ(bad.load(), 0u);
    a.alloc.check_invariants();
    EXPECT_EQ(a.stats().allocated_bytes[0].current, 0);
    EXPECT_EQ(a.stats().oversize_allocations, 0u);
    expect_no_leak(a);
  }
}

}  // namespace
}  // namespace cucache::test
