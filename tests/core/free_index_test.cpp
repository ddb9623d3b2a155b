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
    if (op % 256 == 0) {
      ASSERT_TRUE(idx.well_formed()) << op;
    }
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

// Bins that hold many blocks (thousands of one size, each between live ones, freed in any
// order) become treaps: every operation on them is checked against the model -- best fit,
// largest, contains, totals, and the whole best-fit order of for_each -- while blocks of a few
// sizes come and go in random order, through insert, erase, replace and resize. The bins turn into
// treaps and, emptied, into lists again.
TEST(FreeIndex, LongBinsBecomeTreapsWithTheSameOrder) {
  for (const bool one_size : {true, false}) {
    SCOPED_TRACE(one_size);
    std::mt19937_64 rng(one_size ? 11 : 12);
    std::deque<block> storage;
    free_index idx;
    size_model model;
    std::vector<block*> in;
    std::vector<std::uintptr_t> free_addrs;  // addresses to hand out, in random order
    for (std::uintptr_t i = 0; i < 60'000; ++i) free_addrs.push_back(0x100000000 + i * 0x20000);
    std::shuffle(free_addrs.begin(), free_addrs.end(), rng);
    // One exact-size bin (512 B), or a range bin (66,048-67,584 B all fall in one bin) and its
    // neighbours.
    const auto random_size = [&]() -> std::size_t {
      if (one_size) return 512;
      return 512 * (129 + rng() % 4);
    };
    const auto fresh = [&](std::size_t size) {
      block& b = storage.emplace_back();
      b.size = size;
      b.addr = free_addrs.back();
      free_addrs.pop_back();
      return &b;
    };
    const std::uint32_t bin = free_index::bin_of(one_size ? 512 : 512 * 129);
    bool was_tree = false;
    bool tree_emptied = false;
    const auto check = [&](int op) {
      if (op % 64 == 0) {  // (walks of everything)
        ASSERT_EQ(idx.totals().count, model.size()) << op;
        ASSERT_TRUE(idx.well_formed()) << op;
      }
      if (model.empty()) return;
      ASSERT_EQ(idx.largest()->size, model.rbegin()->first) << op;
      ASSERT_EQ(idx.largest()->addr, model.rbegin()->second) << op;
      ASSERT_NO_FATAL_FAILURE(expect_best_fit(idx, model, random_size() - 512 * (rng() % 2)));
      ASSERT_NO_FATAL_FAILURE(expect_best_fit(idx, model, 512 * (1 + rng() % 200)));
      const block* probe = in[rng() % in.size()];
      ASSERT_TRUE(idx.contains(probe)) << op;
    };
    for (int phase = 0; phase < 2; ++phase) {
      // Fill to 3,000 blocks, then drain to none, with random erases, replaces and resizes.
      for (int op = 0; op < 12'000; ++op) {
        const bool fill = phase == 0 ? op < 9'000 : op < 3'000;
        const auto kind = rng() % 8;
        if ((fill && kind < 5) || in.empty()) {
          if (!fill && in.empty()) break;
          block* b = fresh(random_size());
          idx.insert(b);
          model.emplace(b->size, b->addr);
          in.push_back(b);
        } else if (kind < 6 || !fill) {
          const std::size_t i = rng() % in.size();
          idx.erase(in[i]);
          model.erase({in[i]->size, in[i]->addr});
          ASSERT_FALSE(idx.contains(in[i]));
          in[i] = in.back();
          in.pop_back();
        } else if (kind < 7) {
          const std::size_t i = rng() % in.size();
          block* b = fresh(random_size());
          model.erase({in[i]->size, in[i]->addr});
          idx.replace(in[i], b);
          model.emplace(b->size, b->addr);
          ASSERT_FALSE(idx.contains(in[i]));
          in[i] = b;
        } else {
          const std::size_t i = rng() % in.size();
          model.erase({in[i]->size, in[i]->addr});
          idx.resize(in[i], random_size());
          model.emplace(in[i]->size, in[i]->addr);
        }
        was_tree = was_tree || idx.is_tree_bin(bin);
        if (was_tree && in.empty()) tree_emptied = !idx.is_tree_bin(bin);
        ASSERT_NO_FATAL_FAILURE(check(op));
        if (op % 1'000 == 0) {
          std::vector<std::pair<std::size_t, std::uintptr_t>> order;
          idx.for_each([&](const block* b) { order.emplace_back(b->size, b->addr); });
          ASSERT_TRUE(std::equal(order.begin(), order.end(), model.begin(), model.end())) << op;
        }
      }
    }
    EXPECT_TRUE(was_tree) << "no bin grew into a treap";
    EXPECT_TRUE(tree_emptied) << "the emptied treap bin is not a list again";
    EXPECT_EQ(idx.totals().count, 0u);
    EXPECT_EQ(idx.best_fit(512), nullptr);
  }
}

// A long list that only best fit walks -- every block inserted at the head (lower addresses come
// later), all smaller than the request -- becomes a treap at the first long best-fit walk.
TEST(FreeIndex, ALongBestFitWalkMakesTheBinATreap) {
  std::deque<block> storage;
  free_index idx;
  block& big = storage.emplace_back();  // the next bin up
  big.size = 512 * 140;
  big.addr = 0x100000;
  idx.insert(&big);
  const std::size_t n = 4 * free_index::k_list_walk_max;
  for (std::size_t i = 0; i < n; ++i) {
    block& b = storage.emplace_back();
    b.size = 512 * 129;
    b.addr = 0x100000000 + (n - i) * 0x20000;  // decreasing: each one becomes the head
    idx.insert(&b);
  }
  const std::uint32_t bin = free_index::bin_of(512 * 129);
  ASSERT_EQ(free_index::bin_of(512 * 130), bin);
  ASSERT_NE(free_index::bin_of(512 * 140), bin);
  EXPECT_FALSE(idx.is_tree_bin(bin));        // no insert walked
  EXPECT_EQ(idx.best_fit(512 * 130), &big);  // walks every block of the bin
  EXPECT_TRUE(idx.is_tree_bin(bin));
  EXPECT_EQ(idx.best_fit(512 * 130), &big);
  EXPECT_EQ(idx.best_fit(512 * 129)->addr, 0x100000000 + 0x20000);  // lowest address first
  EXPECT_EQ(idx.totals().count, n + 1);
  EXPECT_TRUE(idx.well_formed());
}

// for_each's callback may call best_fit (headroom and the pager's dry run do), and a long walk
// there turns the bin being walked into a treap: the walk goes on in it, every block once, in order.
TEST(FreeIndex, ForEachGoesOnWhenItsCallbackMakesTheBinATreap) {
  std::deque<block> storage;
  free_index idx;
  size_model model;
  const std::size_t n = 3 * free_index::k_list_walk_max;
  for (std::size_t i = 0; i < n; ++i) {
    block& b = storage.emplace_back();
    b.size = 512 * 129;
    b.addr = 0x100000000 + (n - i) * 0x20000;  // decreasing: head inserts, no long walk
    idx.insert(&b);
    model.emplace(b.size, b.addr);
  }
  const std::uint32_t bin = free_index::bin_of(512 * 129);
  ASSERT_FALSE(idx.is_tree_bin(bin));
  std::vector<std::pair<std::size_t, std::uintptr_t>> order;
  idx.for_each([&](const block* b) {
    if (order.size() == 5) {
      EXPECT_EQ(idx.best_fit(512 * 130), nullptr);  // walks the whole bin
    }
    order.emplace_back(b->size, b->addr);
  });
  EXPECT_TRUE(idx.is_tree_bin(bin));
  EXPECT_TRUE(std::equal(order.begin(), order.end(), model.begin(), model.end()));
  EXPECT_TRUE(idx.well_formed());
}

// changes() counts every change of contents -- insert, erase, replace and resize, on list and
// treap bins, in place or not -- and nothing else: lookups, walks and best_fit's turning a long
// list into a treap leave it as it was (impl::takes_back's memo trusts an equal reading).
TEST(FreeIndex, ChangesCountEveryChangeOfContentsAndNothingElse) {
  std::deque<block> storage;
  free_index idx;
  const auto fresh = [&](std::size_t size, std::uintptr_t addr) {
    block& b = storage.emplace_back();
    b.size = size;
    b.addr = addr;
    return &b;
  };
  std::uint64_t last = idx.changes();
  EXPECT_EQ(last, 0u);
  const auto expect_counted = [&](const char* what) {
    EXPECT_GT(idx.changes(), last) << what;
    last = idx.changes();
  };
  const auto expect_same = [&](const char* what) { EXPECT_EQ(idx.changes(), last) << what; };
  block* a = fresh(512 * 40, 0x100000);
  idx.insert(a);
  expect_counted("insert");
  block* b = fresh(512 * 20, 0x200000);
  idx.insert(b);
  expect_counted("insert");
  idx.resize(a, 512 * 41);  // in place: same bin, same order
  expect_counted("resize in place");
  idx.resize(b, 512 * 60);  // to another bin
  expect_counted("resize to another bin");
  block* c = fresh(512 * 41, 0x300000);
  idx.replace(a, c);  // in place
  expect_counted("replace in place");
  block* d = fresh(512 * 9000, 0x400000);
  idx.replace(c, d);  // to another bin
  expect_counted("replace to another bin");
  idx.erase(d);
  expect_counted("erase");
  (void)idx.best_fit(512);
  (void)idx.next_after(b);
  (void)idx.largest();
  (void)idx.totals();
  (void)idx.contains(b);
  (void)idx.well_formed();
  expect_same("lookups and walks");
  // A long list bin: best_fit makes it a treap (a change of shape, not contents).
  const std::size_t n = 2 * free_index::k_list_walk_max;
  std::vector<block*> many;
  for (std::size_t i = 0; i < n; ++i) {
    many.push_back(fresh(512 * 129, 0x100000000 + (n - i) * 0x20000));  // head inserts
    idx.insert(many.back());
  }
  last = idx.changes();
  const std::uint32_t bin = free_index::bin_of(512 * 129);
  ASSERT_FALSE(idx.is_tree_bin(bin));
  (void)idx.best_fit(512 * 130);
  ASSERT_TRUE(idx.is_tree_bin(bin));
  expect_same("best_fit making a treap");
  idx.insert(fresh(512 * 129, 0x1000));
  expect_counted("insert into a treap");
  idx.resize(many[0], 512 * 130);
  expect_counted("resize in a treap");
  idx.replace(many[1], fresh(512 * 129, 0x2000));
  expect_counted("replace in a treap");
  idx.erase(many[2]);
  expect_counted("erase from a treap");
  EXPECT_TRUE(idx.well_formed());
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
