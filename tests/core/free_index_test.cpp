// free_index: bins are monotonic in size, and best_fit returns exactly the smallest block that
// fits (lowest address among equals), checked against a brute-force model on random contents.
#include "core/free_index.hpp"

#include <gtest/gtest.h>

#include <deque>
#include <random>
#include <set>

namespace cucache::detail {
namespace {

TEST(FreeIndex, BinsAreMonotonicAndExactBelowSixteenUnits) {
  std::uint32_t last = 0;
  for (std::size_t units = 1; units < 100'000; ++units) {
    const std::uint32_t b = free_index::bin_of(units * 512);
    EXPECT_GE(b, last) << units;
    if (units < 32) {
      EXPECT_EQ(b, units < 16 ? units : 16 + (units - 16)) << units;
    }
    last = b;
  }
  EXPECT_LT(free_index::bin_of(std::size_t{1} << 62), free_index::k_bins);
}

TEST(FreeIndex, BestFitMatchesBruteForceModel) {
  std::mt19937_64 rng(42);
  std::deque<block> storage;
  free_index idx;
  std::set<std::pair<std::size_t, std::uintptr_t>> model;  // (size, addr)
  std::vector<block*> in;
  std::uintptr_t next_addr = 0x1000000;
  for (int op = 0; op < 20'000; ++op) {
    const int kind = static_cast<int>(rng() % 3);
    if (kind == 0 || in.empty()) {
      block& b = storage.emplace_back();
      b.size = 512 * (1 + (rng() % 4 == 0 ? rng() % 100'000 : rng() % 64));
      b.addr = next_addr;
      next_addr += b.size;
      idx.insert(&b);
      model.emplace(b.size, b.addr);
      in.push_back(&b);
    } else if (kind == 1) {
      const std::size_t i = rng() % in.size();
      idx.erase(in[i]);
      model.erase({in[i]->size, in[i]->addr});
      in[i] = in.back();
      in.pop_back();
    } else {
      const std::size_t want = 512 * (1 + rng() % 120'000);
      block* got = idx.best_fit(want);
      auto it = model.lower_bound({want, 0});
      if (it == model.end()) {
        ASSERT_EQ(got, nullptr);
      } else {
        ASSERT_NE(got, nullptr);
        ASSERT_EQ(got->size, it->first);
        ASSERT_EQ(got->addr, it->second);
      }
    }
    ASSERT_EQ(idx.count(), model.size());
    if (!model.empty()) {
      ASSERT_EQ(idx.largest()->size, model.rbegin()->first);
    }
  }
}

TEST(FreeIndex, ContainsAndBytes) {
  block a, b;
  a.size = 1024;
  a.addr = 0x10000;
  b.size = 1024;
  b.addr = 0x8000;
  free_index idx;
  idx.insert(&a);
  idx.insert(&b);
  EXPECT_TRUE(idx.contains(&a));
  EXPECT_EQ(idx.bytes(), 2048u);
  EXPECT_EQ(idx.best_fit(1024), &b);  // lower address first
  idx.erase(&b);
  EXPECT_FALSE(idx.contains(&b));
  EXPECT_EQ(idx.best_fit(1024), &a);
  EXPECT_EQ(idx.best_fit(1536), nullptr);
}

}  // namespace
}  // namespace cucache::detail
