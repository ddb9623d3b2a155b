// block_map: insert/take/find against a model, including deletions that must shift probe chains;
// an empty map's lookups; growth.
#include "core/block_map.hpp"

#include <gtest/gtest.h>

#include <random>
#include <unordered_map>
#include <vector>

namespace cucache::detail {
namespace {

TEST(BlockMap, EmptyMapFindsNothing) {
  block_map m;
  EXPECT_EQ(m.size(), 0u);
  EXPECT_EQ(m.find(0x400000000000ULL), nullptr);
  EXPECT_EQ(m.take(0x400000000000ULL), nullptr);
  EXPECT_EQ(m.size(), 0u);
}

TEST(BlockMap, MatchesModelUnderRandomInsertAndTake) {
  block_map m;
  std::unordered_map<std::uintptr_t, block*> model;
  std::mt19937_64 rng(7);
  std::vector<std::uintptr_t> keys;
  for (int op = 0; op < 200'000; ++op) {
    if (rng() % 2 == 0 || keys.empty()) {
      const std::uintptr_t k = 0x7f0000000000ULL + 512 * (rng() % 50'000);
      if (model.count(k) != 0) {
        ASSERT_EQ(m.find(k), model[k]);
        continue;
      }
      ASSERT_EQ(m.find(k), nullptr);
      block* v = reinterpret_cast<block*>(k ^ 0x55);
      m.insert(k, v);
      model.emplace(k, v);
      keys.push_back(k);
    } else {
      const std::size_t i = rng() % keys.size();
      const std::uintptr_t k = keys[i];
      ASSERT_EQ(m.find(k), model[k]);
      ASSERT_EQ(m.take(k), model[k]);
      ASSERT_EQ(m.take(k), nullptr);
      model.erase(k);
      keys[i] = keys.back();
      keys.pop_back();
    }
    ASSERT_EQ(m.size(), model.size());
  }
  for (auto [k, v] : model) ASSERT_EQ(m.find(k), v);
}

TEST(BlockMap, DenseNeighboursSurviveGrowthAndShiftedDeletes) {
  // Consecutive 512 B blocks (one segment cut into its smallest blocks): many share a home slot's
  // run, so every take shifts a chain back; the table doubles several times on the way up.
  block_map m;
  constexpr std::uintptr_t base = 0x400000000000ULL;
  constexpr std::size_t n = 10'000;
  for (std::size_t i = 0; i < n; ++i) m.insert(base + 512 * i, reinterpret_cast<block*>(i + 1));
  ASSERT_EQ(m.size(), n);
  for (std::size_t i = 0; i < n; i += 2) {
    ASSERT_EQ(m.take(base + 512 * i), reinterpret_cast<block*>(i + 1));
  }
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(m.find(base + 512 * i), i % 2 == 0 ? nullptr : reinterpret_cast<block*>(i + 1));
  }
  ASSERT_EQ(m.size(), n / 2);
}

}  // namespace
}  // namespace cucache::detail
