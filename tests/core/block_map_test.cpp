// block_map: insert/take/find against a model, including deletions that must shift probe chains,
// and concurrent use by several threads on disjoint keys.
#include "core/block_map.hpp"

#include <gtest/gtest.h>

#include <random>
#include <thread>
#include <unordered_map>

namespace cucache::detail {
namespace {

TEST(BlockMap, MatchesModelUnderRandomInsertAndTake) {
  block_map m;
  std::unordered_map<std::uintptr_t, block*> model;
  std::vector<block> storage(1);
  std::mt19937_64 rng(7);
  std::vector<std::uintptr_t> keys;
  for (int op = 0; op < 200'000; ++op) {
    if (rng() % 2 == 0 || keys.empty()) {
      const std::uintptr_t k = 0x7f0000000000ULL + 512 * (rng() % 50'000);
      if (model.count(k) != 0) continue;
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

TEST(BlockMap, ConcurrentThreads) {
  block_map m;
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&m, t] {
      for (int round = 0; round < 20; ++round) {
        for (std::uintptr_t i = 1; i <= 2000; ++i) {
          m.insert((static_cast<std::uintptr_t>(t) << 40) + i * 512, reinterpret_cast<block*>(i));
        }
        for (std::uintptr_t i = 1; i <= 2000; ++i) {
          if (m.take((static_cast<std::uintptr_t>(t) << 40) + i * 512) !=
              reinterpret_cast<block*>(i)) {
            std::abort();
          }
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(m.size(), 0u);
}

}  // namespace
}  // namespace cucache::detail
