// size_policy: every size rule and named constant, at and around its boundaries.
#include "core/size_policy.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace cucache::detail {
namespace {

TEST(SizePolicy, Constants) {
  EXPECT_EQ(k_min_block_bytes, 512u);
  EXPECT_EQ(k_small_request_max_bytes, k_mib);
  EXPECT_EQ(k_small_segment_bytes, 2 * k_mib);
  EXPECT_EQ(k_large_shared_below_bytes, 10 * k_mib);
  EXPECT_EQ(k_large_segment_bytes, 20 * k_mib);
  EXPECT_EQ(k_large_segment_round_bytes, 2 * k_mib);
}

TEST(SizePolicy, RoundingPoolsAndSegments) {
  size_policy p;
  EXPECT_EQ(p.round_size(1), 512u);
  EXPECT_EQ(p.round_size(512), 512u);
  EXPECT_EQ(p.round_size(513), 1024u);
  EXPECT_EQ(size_policy::pool_for(k_mib), pool_kind::small);
  EXPECT_EQ(size_policy::pool_for(k_mib + 512), pool_kind::large);
  EXPECT_EQ(p.segment_size(512), 2 * k_mib);
  EXPECT_EQ(p.segment_size(k_mib + 512), 20 * k_mib);
  EXPECT_EQ(p.segment_size(10 * k_mib - 512), 20 * k_mib);
  EXPECT_EQ(p.segment_size(10 * k_mib), 10 * k_mib);
  EXPECT_EQ(p.segment_size(10 * k_mib + 512), 12 * k_mib);
}

TEST(SizePolicy, SplitRules) {
  size_policy p;
  EXPECT_TRUE(p.should_split(pool_kind::small, 2 * k_mib, 2 * k_mib - 512));
  EXPECT_FALSE(p.should_split(pool_kind::small, 2 * k_mib, 2 * k_mib));
  EXPECT_FALSE(p.should_split(pool_kind::large, 20 * k_mib, 19 * k_mib));
  EXPECT_TRUE(p.should_split(pool_kind::large, 20 * k_mib, 19 * k_mib - 512));
}

TEST(SizePolicy, MaxSplitSize) {
  config c;
  c.max_split_size = 64 * k_mib;
  size_policy p(c);
  EXPECT_TRUE(p.is_oversize(64 * k_mib));
  EXPECT_FALSE(p.is_oversize(64 * k_mib - 512));
  EXPECT_TRUE(p.may_take(40 * k_mib, 30 * k_mib));
  EXPECT_FALSE(p.may_take(100 * k_mib, 30 * k_mib));  // under the cap never takes oversize
  EXPECT_TRUE(p.may_take(100 * k_mib, 81 * k_mib));   // wastes 19 MiB < 20 MiB
  EXPECT_FALSE(p.may_take(100 * k_mib, 80 * k_mib));  // wastes exactly 20 MiB
  EXPECT_FALSE(p.should_split(pool_kind::large, 100 * k_mib, 81 * k_mib));
}

TEST(SizePolicy, PowerOfTwoDivisionsPerInterval) {
  config c;
  c.roundup_power2_divisions.assign(k_roundup_power2_intervals, 0);
  c.roundup_power2_divisions[0] = 4;  // below 2 MiB
  c.roundup_power2_divisions[8] = 2;  // [256 MiB, 512 MiB)
  size_policy p(c);
  EXPECT_EQ(p.round_size(1'200'000), 1'310'720u);
  EXPECT_EQ(p.round_size(3 * k_mib), 3 * k_mib);      // interval 1: plain rounding
  EXPECT_EQ(p.round_size(300 * k_mib), 384 * k_mib);  // halves of [256, 512)
  EXPECT_EQ(p.round_size(256 * k_mib), 256 * k_mib);  // powers of two stay
  EXPECT_EQ(p.round_size(1500), 1536u);               // <= 512 * divisions: plain
}

TEST(SizePolicy, RoundingIsCheckedAtTheTopOfTheRange) {
  // Every rounding configuration: a size rounds to a multiple of 512 that is >= it and within
  // k_max_request_bytes (so segment sizes cannot overflow either), or is refused (nullopt).
  constexpr std::size_t max = std::numeric_limits<std::size_t>::max();
  std::vector<std::size_t> sizes = {max,
                                    max - 511,
                                    max - 512,
                                    std::size_t{1} << 63,
                                    (std::size_t{1} << 63) + 1,
                                    (std::size_t{1} << 63) - 1,
                                    (std::size_t{1} << 62) + 1,
                                    0xf000000000000000ULL,
                                    0xe000000000000001ULL,
                                    0xc000000000000001ULL,
                                    0xfffffffffd7fffffULL,
                                    k_max_request_bytes,
                                    k_max_request_bytes - 511,
                                    k_max_request_bytes + 1,
                                    k_max_request_bytes - 20 * k_mib};
  for (std::size_t k = 1; k < (std::size_t{1} << 40); k <<= 3) sizes.push_back(max - k);
  for (const char* text :
       {"", "roundup_power2_divisions:2", "roundup_power2_divisions:4",
        "roundup_power2_divisions:2147483648", "roundup_power2_divisions:[1:4,64:2,>:1]",
        "roundup_power2_divisions:[1:0,>:2147483648]", "expandable_segments:True",
        "max_split_size_mb:20,roundup_power2_divisions:8"}) {
    SCOPED_TRACE(text);
    const size_policy p(parse_config(text));
    for (std::size_t bytes : sizes) {
      const std::optional<std::size_t> rounded = p.round_size(bytes);
      if (!rounded) continue;
      EXPECT_GE(*rounded, bytes) << std::hex << bytes;
      EXPECT_EQ(*rounded % k_min_block_bytes, 0u) << std::hex << bytes;
      EXPECT_LE(*rounded, k_max_request_bytes) << std::hex << bytes;
      EXPECT_GE(p.segment_size(*rounded), *rounded) << std::hex << bytes;
    }
    EXPECT_EQ(p.round_size(max), std::nullopt);
    EXPECT_EQ(p.round_size(k_max_request_bytes + 1), std::nullopt);
    EXPECT_EQ(p.round_size(1), std::optional<std::size_t>(512));
  }
  // The sizes: with 4 divisions the next step of three of them lies past SIZE_MAX (it
  // wrapped to 0); the fourth rounds to a representable size that no device holds.
  const size_policy div4(parse_config("roundup_power2_divisions:4"));
  for (std::size_t bytes : {std::size_t{0xf000000000000000ULL}, std::size_t{0xe000000000000001ULL},
                            std::size_t{0xfffffffffd7fffffULL}}) {
    EXPECT_EQ(div4.round_size(bytes), std::nullopt) << std::hex << bytes;
  }
  EXPECT_EQ(div4.round_size(0xc000000000000001ULL), 0xe000000000000000ULL);
  EXPECT_EQ(div4.round_size(0xb000000000000000ULL), 0xc000000000000000ULL);
  EXPECT_EQ(div4.round_size(std::size_t{1} << 63), std::size_t{1} << 63);
  EXPECT_EQ(size_policy().round_size(k_max_request_bytes - 511), 0xfffffffffd7ffe00ULL);
  EXPECT_EQ(size_policy().round_size(k_max_request_bytes), std::nullopt);  // rounds past it
}

// largest_rounded_within (O(1), used per free block and page by the statistics' largest request)
// against its definition, the binary search over round_size: every size up to 16 KiB, the
// neighbourhood of every power of two and of every step of every interval, and seeded random
// sizes of every bit length, over fixed configurations (the interval tables of config.md
// included), random per-interval division lists, and divisions that are not powers of two
// (which take the search itself).
TEST(SizePolicy, LargestRoundedWithinIsTheSearchsAnswer) {
  constexpr std::size_t max = std::numeric_limits<std::size_t>::max();
  std::vector<config> configs;
  for (const char* text :
       {"", "roundup_power2_divisions:2", "roundup_power2_divisions:4",
        "roundup_power2_divisions:16", "roundup_power2_divisions:2147483648",
        "roundup_power2_divisions:[1:4,64:2,>:1]", "roundup_power2_divisions:[256:4,512:2,>:1]",
        "roundup_power2_divisions:[1:0,>:2147483648]", "expandable_segments:True",
        "max_split_size_mb:20,roundup_power2_divisions:8"}) {
    configs.push_back(parse_config(text));
  }
  std::mt19937_64 rng(30);
  for (int i = 0; i < 12; ++i) {
    config c;
    c.roundup_power2_divisions.resize(1 + rng() % k_roundup_power2_intervals);
    for (auto& d : c.roundup_power2_divisions) {
      d = rng() % 4 == 0 ? 0 : std::uint32_t{1} << (rng() % 32);
    }
    configs.push_back(c);
  }
  for (const std::uint32_t odd : {3u, 5u, 6u, 1000u}) {  // not powers of two: the search
    config c;
    c.roundup_power2_divisions.assign(k_roundup_power2_intervals, odd);
    configs.push_back(c);
  }
  std::vector<std::size_t> sizes;
  for (std::size_t b = 0; b <= 16 * 1024; ++b) sizes.push_back(b);
  for (int k = 9; k < 64; ++k) {
    const std::size_t f = std::size_t{1} << k;
    for (std::size_t d = 1; d <= (std::size_t{1} << 12) && d <= f; d <<= 1) {
      for (std::size_t m = 1; m < 2 * d && m < 12; ++m) {  // steps of f / d within [f, 2f)
        const std::size_t at = f + m * (f / d);
        for (std::size_t delta : {0, 1, 511, 512, 513}) {
          sizes.push_back(at - delta);
          if (at <= max - delta) sizes.push_back(at + delta);
        }
      }
    }
  }
  for (std::size_t k = 0; k < 4096; ++k) sizes.push_back(max - k * 97);
  for (int i = 0; i < 5000; ++i) sizes.push_back(rng() >> (rng() % 64));
  std::size_t checked = 0;
  for (std::size_t ci = 0; ci < configs.size(); ++ci) {
    const size_policy p(configs[ci]);
    for (const std::size_t bytes : sizes) {
      const std::size_t expect = p.largest_rounded_within_by_search(bytes);
      ASSERT_EQ(p.largest_rounded_within(bytes), expect)
          << "config " << ci << ", bytes " << std::hex << bytes;
      ++checked;
    }
  }
  EXPECT_GT(checked, 1'000'000u);
  // Worked cases: halves of [256 MiB, 512 MiB) under 2 divisions, quarters of [1 GiB, 2 GiB).
  const size_policy halves(parse_config("roundup_power2_divisions:[256:4,512:2,>:1]"));
  EXPECT_EQ(halves.largest_rounded_within(300 * k_mib), 256 * k_mib);
  EXPECT_EQ(halves.largest_rounded_within(700 * k_mib - 1), 512 * k_mib);
  const size_policy quarters(parse_config("roundup_power2_divisions:4"));
  EXPECT_EQ(quarters.largest_rounded_within(1791 * k_mib), 1536 * k_mib);
  EXPECT_EQ(quarters.largest_rounded_within(1500), 1024u);  // below 512 * 4: 512 B steps
  EXPECT_EQ(quarters.largest_rounded_within(511), 0u);
  EXPECT_EQ(size_policy().largest_rounded_within(max), k_max_request_bytes - 511);
}

// largest_growable_within against its definition: the largest rounded size of the pool whose
// segment_size fits, over every multiple of 512 up to 96 MiB, for rooms up to 64 MiB (every 256
// KiB and at each segment-size boundary), under the size rules that change segment_size's shape.
TEST(SizePolicy, LargestGrowableWithinIsTheLargestSizeWhoseSegmentFits) {
  for (const char* text :
       {"", "max_split_size_mb:20", "max_split_size_mb:24", "max_split_size_mb:40",
        "roundup_power2_divisions:4", "roundup_power2_divisions:[1:4,64:2,>:1],max_split_size_mb:30",
        "expandable_segments:True"}) {
    const size_policy p(parse_config(text));
    constexpr std::size_t k_limit = 96 * k_mib;
    std::vector<std::size_t> rooms;
    for (std::size_t room = 0; room <= 64 * k_mib; room += 256 * 1024) rooms.push_back(room);
    for (const std::size_t edge : {2 * k_mib, 10 * k_mib, 12 * k_mib, 20 * k_mib, 24 * k_mib}) {
      rooms.push_back(edge - 1);
      rooms.push_back(edge + 1);
    }
    for (const pool_kind kind : {pool_kind::small, pool_kind::large}) {
      // best[room] by brute force: every rounded size r (a fixed point of round_size) of the pool.
      // (Segment sizes are few: the largest rounded size of each, then the best that fits.)
      std::map<std::size_t, std::size_t> largest_of_segment;
      for (std::size_t r = k_min_block_bytes; r <= k_limit; r += k_min_block_bytes) {
        if (p.round_size(r) != r || size_policy::pool_for(r) != kind) continue;
        std::size_t& largest = largest_of_segment[p.segment_size(r)];
        largest = std::max(largest, r);
      }
      std::vector<std::size_t> expect(rooms.size(), 0);
      for (std::size_t i = 0; i < rooms.size(); ++i) {
        for (const auto& [seg, r] : largest_of_segment) {
          if (seg <= rooms[i]) expect[i] = std::max(expect[i], r);
        }
      }
      for (std::size_t i = 0; i < rooms.size(); ++i) {
        EXPECT_EQ(p.largest_growable_within(rooms[i], kind), expect[i])
            << "'" << text << "' room " << rooms[i] << " kind " << static_cast<int>(kind);
      }
    }
  }
  // Past the brute force's range: a huge room gives the largest request there is.
  EXPECT_EQ(size_policy().largest_growable_within(std::numeric_limits<std::size_t>::max(),
                                                  pool_kind::large),
            k_max_request_bytes - 511);
  EXPECT_EQ(size_policy().largest_growable_within(std::size_t{1} << 40, pool_kind::large),
            std::size_t{1} << 40);
}

}  // namespace
}  // namespace cucache::detail
