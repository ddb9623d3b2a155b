// size_policy: every size rule and named constant, at and around its boundaries.
#include "core/size_policy.hpp"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace cucache::detail
