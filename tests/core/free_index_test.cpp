// free_index: bins are monotonic in size, and best_fit returns exactly the smallest block that
// fits (lowest address among equals), checked against a brute-force model on random contents.
#include "core/free_index.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <random>
#include <set>
#include <vector>

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

using size_model = std::set<std::pair<std::size_t, std::uintptr_t>>;  // (size, addr)

/// best_fit(want) is the model's smallest (size, addr) with size >= want, or nullptr.
void expect_best_fit(const free_index& idx, const size_model& model, std::size_t want) {
  const block* got = idx.best_fit(want);
  auto it = model.lower_bound({want, 0});
  if (it == model.end()) {
    ASSERT_EQ(got, nullptr);
  } else {
    ASSERT_NE(got, nullptr);
    ASSERT_EQ(got->size, it->first);
    ASSERT_EQ(got->addr, it->second);
  }
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
      ASSERT_NO_FATAL_FAILURE(expect_best_fit(idx, model, 512 * (1 + rng() % 120'000)));
    }
    ASSERT_EQ(idx.totals().count, model.size());
    if (!model.empty()) {
      ASSERT_EQ(idx.largest()->size, model.rbegin()->first);
    }
  }
}

TEST(FreeIndex, ReplaceMatchesBruteForceModel) {
  // replace (a split's rest or a merge's result taking another block's place) against the model,
  // sparse and dense: its three paths -- in place, alone in its bin to an empty bin (a segment's
  // tail split and merged by every cache-hit pair), and unlink + relink.
  for (const std::size_t blocks : {std::size_t{3}, std::size_t{300}}) {
    SCOPED_TRACE(blocks);
    std::mt19937_64 rng(7 + blocks);
    std::deque<block> storage;
    free_index idx;
    std::set<std::pair<std::size_t, std::uintptr_t>> model;
    std::vector<block*> in;
    std::uintptr_t next_addr = 0x1000000;
    const auto fresh = [&](std::size_t size) {
      block& b = storage.emplace_back();
      b.size = size;
      b.addr = next_addr;
      next_addr += size;
      return &b;
    };
    const auto random_size = [&] {
      return 512 * (1 + (rng() % 2 == 0 ? rng() % 8192 : rng() % 40));
    };
    for (std::size_t i = 0; i < blocks; ++i) {
      block* b = fresh(random_size());
      idx.insert(b);
      model.emplace(b->size, b->addr);
      in.push_back(b);
    }
    for (int op = 0; op < 20'000; ++op) {
      const std::size_t i = rng() % in.size();
      block* out = in[i];
      // Another block near out's size (same bin, neighbouring bin) or anywhere.
      std::size_t size = random_size();
      if (rng() % 2 == 0) {
        const std::size_t delta = 512 * (rng() % 3);
        size = rng() % 2 == 0 ? out->size + delta : std::max<std::size_t>(512, out->size - delta);
      }
      block* b = fresh(size);
      const std::size_t bytes = idx.totals().bytes;
      idx.replace(out, b);
      model.erase({out->size, out->addr});
      model.emplace(b->size, b->addr);
      in[i] = b;
      ASSERT_FALSE(idx.contains(out));
      ASSERT_TRUE(idx.contains(b));
      ASSERT_EQ(idx.totals().count, model.size());
      ASSERT_EQ(idx.totals().bytes, bytes - out->size + b->size);
      ASSERT_NO_FATAL_FAILURE(expect_best_fit(idx, model, random_size()));
      ASSERT_EQ(idx.largest()->size, model.rbegin()->first);
    }
    std::size_t walked = 0;
    idx.for_each([&](const block*) { ++walked; });
    EXPECT_EQ(walked, model.size());
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
  EXPECT_EQ(idx.totals().bytes, 2048u);
  EXPECT_EQ(idx.best_fit(1024), &b);  // lower address first
  idx.erase(&b);
  EXPECT_FALSE(idx.contains(&b));
  EXPECT_EQ(idx.best_fit(1024), &a);
  EXPECT_EQ(idx.best_fit(1536), nullptr);
}

}  // namespace
}  // namespace cucache::detail
