// vm_range: the page table's queries about chunks, with exact expectations on a hand-built range
// of 2 MiB pages -- which pages a span covers whole, which chunks a carve would cut (cut_chunks,
// the one-load test touch_carved runs at every carve), and which idle pages of a chunk no unmap can
// give back while a block touches the rest of it (straddled_idle_pages, max_allocatable's rule).
#include "core/vm_range.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace cucache::detail {
namespace {

constexpr std::size_t k_page = std::size_t{2} << 20;
constexpr std::uintptr_t k_base = std::uintptr_t{1} << 40;

// A range of 64 pages. Its idle runs live here (the pager's pool_pages would own them).
struct range_rig {
  vm_range r{k_base, 64 * k_page, k_page, pool_kind::large};
  std::vector<std::unique_ptr<idle_run>> runs;

  // Pages [first, first + n) mapped as one chunk (n > 1) or as one-page handles (n == 1).
  void map_chunk(std::size_t first, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      r.add_page(first + i, 100 + first, static_cast<std::uint16_t>(n > 1 ? n : 0),
                 static_cast<std::uint16_t>(n > 1 ? i : 0));
    }
    if (n > 1) ++r.chunks;
  }
  // Pages [first, end) idle: one run.
  void idle(std::size_t first, std::size_t end) {
    auto u = std::make_unique<idle_run>();
    u->range = &r;
    u->first = first;
    u->end = end;
    r.idle_runs.insert(u.get());
    runs.push_back(std::move(u));
  }
  [[nodiscard]] std::uintptr_t at(std::size_t page, std::size_t offset = 0) const {
    return k_base + page * k_page + offset;
  }
};

TEST(VmRange, WholePagesOfASpan) {
  range_rig g;
  EXPECT_EQ(g.r.whole_pages(g.at(2), 3 * k_page).first, 2u);
  EXPECT_EQ(g.r.whole_pages(g.at(2), 3 * k_page).end, 5u);
  // Half a page in at both ends: only the pages strictly inside.
  const page_span inner = g.r.whole_pages(g.at(2, k_page / 2), 3 * k_page);
  EXPECT_EQ(inner.first, 3u);
  EXPECT_EQ(inner.end, 5u);
  // Less than a page: none.
  EXPECT_EQ(g.r.whole_pages(g.at(7, 512), 4096).pages(), 0u);
}

TEST(VmRange, CutChunksCountsEachChunkASpanTouchesInPart) {
  range_rig g;
  g.map_chunk(0, 8);   // a chunk of pages 0-7
  g.map_chunk(8, 1);   // one-page handles 8, 9
  g.map_chunk(9, 1);
  g.map_chunk(10, 4);  // a chunk of pages 10-13
  // Without chunks at its ends a span cuts none.
  EXPECT_EQ(g.r.cut_chunks(g.at(8), 2 * k_page, 8, 9), 0u);
  // A span covering a chunk whole cuts nothing.
  EXPECT_EQ(g.r.cut_chunks(g.at(0), 8 * k_page, 0, 7), 0u);
  EXPECT_EQ(g.r.cut_chunks(g.at(0), 10 * k_page, 0, 9), 0u);
  // Part of one chunk: one.
  EXPECT_EQ(g.r.cut_chunks(g.at(2), 3 * k_page, 2, 4), 1u);
  // Its first page covered only in part (a neighbour may share it): the chunk is cut.
  EXPECT_EQ(g.r.cut_chunks(g.at(0, 512), 8 * k_page - 512, 0, 7), 1u);
  // From inside one chunk into another: two.
  EXPECT_EQ(g.r.cut_chunks(g.at(6), 6 * k_page, 6, 11), 2u);
  // Both ends in the same chunk: counted once.
  EXPECT_EQ(g.r.cut_chunks(g.at(1), 2 * k_page, 1, 2), 1u);
  // A span on one page of a chunk.
  EXPECT_EQ(g.r.cut_chunks(g.at(11), 4096, 11, 11), 1u);
  // Starting on a one-page handle, ending inside the second chunk.
  EXPECT_EQ(g.r.cut_chunks(g.at(9), 3 * k_page, 9, 11), 1u);
}

TEST(VmRange, StraddledIdlePagesAreThoseOfAChunkThatIsNotIdleAsAWhole) {
  range_rig g;
  g.map_chunk(0, 8);  // pages 0-7: a block touches 0-2, pages 3-7 idle
  g.idle(3, 8);
  g.map_chunk(8, 4);  // pages 8-11: idle as a whole
  g.idle(8, 12);
  g.map_chunk(12, 1);  // a one-page handle, idle
  g.idle(12, 13);
  const page_span straddled = g.r.mapping_of(5);
  EXPECT_EQ(straddled.first, 0u);
  EXPECT_EQ(straddled.end, 8u);
  EXPECT_FALSE(g.r.all_idle(straddled));
  EXPECT_EQ(g.r.straddled_idle_pages(straddled, 0, 64), 5u);
  EXPECT_EQ(g.r.straddled_idle_pages(straddled, 6, 64), 2u);  // only [6, 64) asked
  EXPECT_EQ(g.r.straddled_idle_pages(straddled, 0, 3), 0u);   // the touched pages
  // A chunk idle as a whole can be unmapped whole: nothing straddled.
  const page_span whole_idle = g.r.mapping_of(9);
  EXPECT_TRUE(g.r.all_idle(whole_idle));
  EXPECT_EQ(g.r.straddled_idle_pages(whole_idle, 0, 64), 0u);
  // A one-page handle is never straddled.
  EXPECT_EQ(g.r.straddled_idle_pages(g.r.mapping_of(12), 0, 64), 0u);
}

// The page table's chunks of 512 entries: an emptied chunk stays in place as the one spare (a
// block carved and freed alone in its chunk allocates nothing); another chunk that needs storage
// takes it; a second emptied chunk frees the earlier spare.
TEST(SparsePageTable, AnEmptiedChunkIsTheOneSpare) {
  sparse_page_table<std::uint32_t> t(4 * 512);
  EXPECT_EQ(t.chunks(), 0u);
  t.set(10, 1);
  EXPECT_EQ(t.chunks(), 1u);
  t.set(10, 0);  // emptied: kept as the spare
  EXPECT_EQ(t.chunks(), 1u);
  EXPECT_EQ(t.get(10), 0u);
  t.set(11, 2);  // the same chunk again
  EXPECT_EQ(t.chunks(), 1u);
  t.set(11, 0);
  t.set(600, 3);  // another chunk takes the spare
  EXPECT_EQ(t.chunks(), 1u);
  EXPECT_EQ(t.get(600), 3u);
  EXPECT_EQ(t.get(11), 0u);
  t.set(1100, 4);  // a third chunk: new storage
  EXPECT_EQ(t.chunks(), 2u);
  t.set(600, 0);   // emptied: the spare
  t.set(1100, 0);  // emptied too: the earlier spare is freed
  EXPECT_EQ(t.chunks(), 1u);
  std::size_t seen = 0;
  t.for_each([&](std::size_t, std::uint32_t) { ++seen; });
  EXPECT_EQ(seen, 0u);
  t.set(5, 7);  // the spare moves to chunk 0
  EXPECT_EQ(t.chunks(), 1u);
  t.for_each([&](std::size_t pg, std::uint32_t v) {
    ++seen;
    EXPECT_EQ(pg, 5u);
    EXPECT_EQ(v, 7u);
  });
  EXPECT_EQ(seen, 1u);
}

}  // namespace
}  // namespace cucache::detail
