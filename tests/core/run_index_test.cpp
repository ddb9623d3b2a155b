// run_index: exact lookups on hand-placed runs (within a 64-page word, across words and across
// summary words, at both ends of the range), and a seeded randomized run of inserts, erases and
// key moves checked against a std::map model after every operation.
#include "core/run_index.hpp"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <random>
#include <vector>

namespace cucache::detail {
namespace {

struct run {
  std::size_t first = 0;
  std::size_t end = 0;
};

// Runs owned by the test, indexed in a run_index of `pages` pages.
struct rig {
  explicit rig(std::size_t pages) : index(pages) {}
  run_index<run> index;
  std::vector<std::unique_ptr<run>> runs;
  run* add(std::size_t first, std::size_t end) {
    runs.push_back(std::make_unique<run>(run{first, end}));
    index.insert(runs.back().get());
    return runs.back().get();
  }
};

TEST(RunIndex, EmptyFindsNothing) {
  rig g(100);
  EXPECT_TRUE(g.index.empty());
  EXPECT_EQ(g.index.front(), nullptr);
  EXPECT_EQ(g.index.holding(0), nullptr);
  EXPECT_EQ(g.index.holding(99), nullptr);
  EXPECT_EQ(g.index.first_meeting(0), nullptr);
  EXPECT_EQ(g.index.at(5), nullptr);
}

TEST(RunIndex, LookupsWithinAndAcrossWords) {
  // 3 summary words' worth of pages (64 x 64 each) and a tail.
  rig g(3 * 4096 + 10);
  run* a = g.add(0, 3);          // the first page of the range
  run* b = g.add(62, 66);        // across the first word boundary
  run* c = g.add(5000, 5001);    // the second summary word
  run* d = g.add(12295, 12298);  // the last pages of the range
  ASSERT_EQ(g.index.size(), 4u);
  EXPECT_EQ(g.index.front(), a);
  EXPECT_EQ(g.index.at(62), b);
  EXPECT_EQ(g.index.at(63), nullptr);
  // holding: the run at the last start <= pg, if it ends after pg.
  EXPECT_EQ(g.index.holding(0), a);
  EXPECT_EQ(g.index.holding(2), a);
  EXPECT_EQ(g.index.holding(3), nullptr);
  EXPECT_EQ(g.index.holding(61), nullptr);
  EXPECT_EQ(g.index.holding(63), b);
  EXPECT_EQ(g.index.holding(64), b);  // the next word, a run that started in the one before
  EXPECT_EQ(g.index.holding(65), b);
  EXPECT_EQ(g.index.holding(66), nullptr);
  EXPECT_EQ(g.index.holding(4999), nullptr);  // the nearest start is 4,900 pages back
  EXPECT_EQ(g.index.holding(5000), c);
  EXPECT_EQ(g.index.holding(12297), d);
  // first_meeting: the run holding pg, else the next one.
  EXPECT_EQ(g.index.first_meeting(1), a);
  EXPECT_EQ(g.index.first_meeting(3), b);
  EXPECT_EQ(g.index.first_meeting(66), c);
  EXPECT_EQ(g.index.first_meeting(5001), d);
  EXPECT_EQ(g.index.first_meeting(12290), d);
  // next, in page order, to the end.
  EXPECT_EQ(g.index.next(a), b);
  EXPECT_EQ(g.index.next(b), c);
  EXPECT_EQ(g.index.next(c), d);
  EXPECT_EQ(g.index.next(d), nullptr);
  std::vector<const run*> seen;
  g.index.for_each([&](const run* u) { seen.push_back(u); });
  EXPECT_EQ(seen, (std::vector<const run*>{a, b, c, d}));
}

TEST(RunIndex, LookupsAcrossTopLevelWords) {
  // 262,144 pages per top-level word: runs in the first and third, none in the second.
  constexpr std::size_t k_top = 262144;
  rig g(3 * k_top + 5);
  run* a = g.add(100, 200);
  run* b = g.add(2 * k_top + 7, 2 * k_top + 9);
  run* c = g.add(3 * k_top + 4, 3 * k_top + 5);  // the last page
  EXPECT_EQ(g.index.holding(199), a);
  EXPECT_EQ(g.index.holding(200), nullptr);
  EXPECT_EQ(g.index.holding(k_top + 1), nullptr);  // the nearest start is a's, a word back
  EXPECT_EQ(g.index.first_meeting(200), b);        // across an empty top-level word
  EXPECT_EQ(g.index.first_meeting(k_top), b);
  EXPECT_EQ(g.index.holding(2 * k_top + 8), b);
  EXPECT_EQ(g.index.first_meeting(2 * k_top + 9), c);
  EXPECT_EQ(g.index.holding(3 * k_top + 4), c);
  EXPECT_EQ(g.index.next(c), nullptr);
  EXPECT_EQ(g.index.next(a), b);
  g.index.erase(b);  // the third top-level word's only run below c
  EXPECT_EQ(g.index.first_meeting(200), c);
  EXPECT_EQ(g.index.holding(3 * k_top + 3), nullptr);
  g.index.erase(a);
  EXPECT_EQ(g.index.front(), c);
  EXPECT_EQ(g.index.holding(3 * k_top), nullptr);
}

TEST(RunIndex, EraseAndMoveFirstKeepTheSummaryRight) {
  rig g(3 * 4096);
  run* a = g.add(10, 20);
  run* b = g.add(8000, 8010);
  g.index.erase(a);  // the first summary word empties
  EXPECT_EQ(g.index.holding(15), nullptr);
  EXPECT_EQ(g.index.front(), b);
  EXPECT_EQ(g.index.first_meeting(0), b);
  // b loses its lower pages: keyed by its new first page.
  g.index.move_first(b, 8004);
  EXPECT_EQ(b->first, 8004u);
  EXPECT_EQ(g.index.at(8000), nullptr);
  EXPECT_EQ(g.index.at(8004), b);
  EXPECT_EQ(g.index.holding(8002), nullptr);
  EXPECT_EQ(g.index.holding(8009), b);
  // A move to its own first page changes nothing.
  g.index.move_first(b, 8004);
  EXPECT_EQ(g.index.at(8004), b);
  EXPECT_EQ(g.index.size(), 1u);
  // ... and gains pages below, in another summary word.
  g.index.move_first(b, 4000);
  EXPECT_EQ(g.index.holding(4000), b);
  EXPECT_EQ(g.index.holding(8009), b);
  EXPECT_EQ(g.index.front(), b);
  while (run* u = g.index.front()) g.index.erase(u);  // as pager::destroy_range empties one
  EXPECT_TRUE(g.index.empty());
  EXPECT_EQ(g.index.holding(8009), nullptr);
  EXPECT_EQ(g.index.front(), nullptr);
}

// The model: disjoint runs keyed by first page. Each step inserts a run into a gap, erases a run,
// trims a run's lower pages or extends it downward into free pages; then every page's holding,
// first_meeting and at, the walk and the size are compared with the model.
TEST(RunIndex, RandomizedAgainstAMap) {
  for (const std::size_t pages : {std::size_t{1}, std::size_t{63}, std::size_t{64},
                                  std::size_t{4097}, std::size_t{9000}, std::size_t{600000}}) {
    SCOPED_TRACE(pages);
    rig g(pages);
    std::map<std::size_t, run*> model;
    std::mt19937_64 rng(pages);
    auto rand_below = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
    // The run of the model holding pg, or nullptr.
    auto holder = [&](std::size_t pg) -> run* {
      auto it = model.upper_bound(pg);
      if (it == model.begin()) return nullptr;
      --it;
      return it->second->end > pg ? it->second : nullptr;
    };
    const int steps = pages > 4096 ? 600 : 1500;
    // Every page is probed in the smaller ranges; in the largest, 3,000 random pages per step
    // plus every run's edges and the pages beside them.
    const bool every_page = pages <= 9000;
    for (int step = 0; step < steps; ++step) {
      const int op = static_cast<int>(rng() % 4);
      if (op == 0 || model.empty()) {  // insert a run into the gap around a random page
        const std::size_t pg = rand_below(pages);
        if (holder(pg) != nullptr) continue;
        auto next = model.upper_bound(pg);
        const std::size_t gap_end = next == model.end() ? pages : next->first;
        const std::size_t end = pg + 1 + rand_below(gap_end - pg);
        model[pg] = g.add(pg, end);
      } else if (op == 1) {  // erase a random run
        auto it = std::next(model.begin(), static_cast<long>(rand_below(model.size())));
        g.index.erase(it->second);
        model.erase(it);
      } else if (op == 2) {  // a run loses lower pages
        auto it = std::next(model.begin(), static_cast<long>(rand_below(model.size())));
        run* u = it->second;
        if (u->end - u->first < 2) continue;
        const std::size_t first = u->first + 1 + rand_below(u->end - u->first - 1);
        model.erase(it);
        g.index.move_first(u, first);
        model[first] = u;
      } else {  // a run gains pages below, into the gap before it
        auto it = std::next(model.begin(), static_cast<long>(rand_below(model.size())));
        run* u = it->second;
        const std::size_t gap_first = it == model.begin() ? 0 : std::prev(it)->second->end;
        if (gap_first == u->first) continue;
        const std::size_t first = gap_first + rand_below(u->first - gap_first);
        model.erase(it);
        g.index.move_first(u, first);
        model[first] = u;
      }
      ASSERT_EQ(g.index.size(), model.size());
      std::vector<std::size_t> probes;
      if (every_page) {
        for (std::size_t pg = 0; pg < pages; ++pg) probes.push_back(pg);
      } else {
        for (int k = 0; k < 3000; ++k) probes.push_back(rand_below(pages));
        for (const auto& [first, u] : model) {
          for (std::size_t pg : {first, u->end - 1, u->end}) {
            if (pg < pages) probes.push_back(pg);
          }
          if (first > 0) probes.push_back(first - 1);
        }
      }
      for (std::size_t pg : probes) {
        run* h = holder(pg);
        ASSERT_EQ(g.index.holding(pg), h) << "page " << pg << " step " << step;
        auto after = model.upper_bound(pg);
        run* meet = h != nullptr ? h : (after == model.end() ? nullptr : after->second);
        ASSERT_EQ(g.index.first_meeting(pg), meet) << "page " << pg << " step " << step;
        auto exact = model.find(pg);
        ASSERT_EQ(g.index.at(pg), exact == model.end() ? nullptr : exact->second);
      }
      std::vector<run*> walk;
      g.index.for_each([&](run* u) { walk.push_back(u); });
      std::vector<run*> want;
      for (const auto& [first, u] : model) want.push_back(u);
      ASSERT_EQ(walk, want) << "step " << step;
    }
  }
}

}  // namespace
}  // namespace cucache::detail
