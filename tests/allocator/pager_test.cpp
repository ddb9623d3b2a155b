// The pager on its own: a device budget, a pool table and a pager over the simulated device, with
// blocks placed by hand in one pool's range (the allocator's part), so that every expectation is
// about the pager alone -- which pages it maps with which handles, what goes idle, what it
// releases, moves and reclaims, and what it charges to the budget.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <vector>

#include "allocator/pager.hpp"
#include "allocator/placement.hpp"
#include "core/size_policy.hpp"
#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

using detail::block;
using detail::block_state;
using detail::pool_kind;

/// One pool (the legacy stream's) with a large range of `capacity` x 2 (the pager's size for a
/// large range), on a simulated device of `capacity` bytes under `limit` (0: none).
struct pager_rig {
  explicit pager_rig(std::size_t capacity = 64 * MiB, std::size_t limit = 0)
      : sim(make_sim(capacity)),
        budget(capacity, limit, 0),
        pools(*sim),
        pg(*sim, budget, 2 * MiB, pools),
        pool(pools.pool_for(nullptr)),
        range(pg.reserve_range(pool_kind::large,
                               pg.next_range_bytes(pool_kind::large, 2 * MiB, 0))) {
    seg.base = range->base;
    seg.size = range->size;
    seg.kind = pool_kind::large;
    seg.owner = &pool;
    seg.vm = range.get();
  }
  ~pager_rig() { pg.destroy_range(*range); }

  static std::shared_ptr<sim_backend> make_sim(std::size_t capacity) {
    return std::make_shared<sim_backend>(sized(capacity));
  }

  /// A block carved at [offset, offset + bytes) of the range, its pages touched (as carve does).
  block* carve(std::size_t offset, std::size_t bytes) {
    auto b = std::make_unique<block>();
    b->addr = range->base + offset;
    b->size = bytes;
    b->seg = &seg;
    b->state = block_state::allocated;
    b->uses = nullptr;
    pool.stats.on_allocate(pool_kind::large, static_cast<std::int64_t>(bytes),
                           static_cast<std::int64_t>(bytes));
    pg.touch_carved(pool, b.get());
    blocks.push_back(std::move(b));
    return blocks.back().get();
  }
  /// carve, then back its pages; the result of back().
  bool carve_and_back(std::size_t offset, std::size_t bytes, block** out = nullptr) {
    block* b = carve(offset, bytes);
    if (out != nullptr) *out = b;
    return pg.back(pool, b);
  }
  /// The block freed: its pages untouched (as release_to_free does).
  void free(block* b) {
    pool.stats.on_free(pool_kind::large, static_cast<std::int64_t>(b->size),
                       static_cast<std::int64_t>(b->size));
    pg.touch_freed(pool, b);
    b->state = block_state::free;
  }

  [[nodiscard]] std::size_t reserved() const { return budget.reserved_bytes(); }
  [[nodiscard]] std::uint64_t calls(sim_call c) const { return sim->calls(c); }
  /// The VM calls and device synchronizations made so far.
  [[nodiscard]] std::uint64_t vm_calls() const {
    std::uint64_t n = 0;
    for (sim_call c : {sim_call::phys_create, sim_call::phys_release, sim_call::map,
                       sim_call::unmap, sim_call::set_access, sim_call::device_synchronize}) {
      n += sim->calls(c);
    }
    return n;
  }

  std::shared_ptr<sim_backend> sim;
  detail::device_budget budget;
  detail::pool_table pools;
  detail::pager pg;
  detail::stream_pool& pool;
  std::unique_ptr<detail::vm_range> range;
  detail::segment seg;
  std::vector<std::unique_ptr<block>> blocks;
};

TEST(Pager, BacksOnlyTheBlocksPagesOneHandlePerPage) {
  pager_rig r;
  block* b = nullptr;
  ASSERT_TRUE(r.carve_and_back(0, 3 * MiB, &b));  // pages 0-1; it ends inside page 1
  EXPECT_EQ(r.calls(sim_call::phys_create), 2u);  // one handle per page
  EXPECT_EQ(r.calls(sim_call::map), 2u);
  EXPECT_EQ(r.calls(sim_call::set_access), 1u);  // both, in one call
  EXPECT_TRUE(r.sim->accessible(reinterpret_cast<void*>(b->addr), 3 * MiB));
  EXPECT_EQ(r.reserved(), 4 * MiB);
  EXPECT_EQ(r.budget.peak_bytes(), 4 * MiB);
  EXPECT_EQ(r.budget.device_allocs.load(), 2u);
  EXPECT_EQ(r.range->mapped_pages, 2u);
  EXPECT_EQ(r.pool.stats.reserved_bytes[0].current, static_cast<std::int64_t>(4 * MiB));
  EXPECT_EQ(r.pool.stats.segment_count[0].current, 1);  // the range holds memory
  EXPECT_EQ(r.pool.pages.idle_bytes(), 0u);

  // A block on page boundaries: still a handle per page, one set-access for the run.
  ASSERT_TRUE(r.carve_and_back(4 * MiB, 8 * MiB));  // pages 2-5
  EXPECT_EQ(r.calls(sim_call::phys_create), 6u);
  EXPECT_EQ(r.calls(sim_call::set_access), 2u);
  EXPECT_EQ(r.reserved(), 12 * MiB);
}

TEST(Pager, AFreedBlocksPagesGoIdleAndAreUsedInPlaceWithoutAnyCall) {
  pager_rig r;
  block* b = nullptr;
  ASSERT_TRUE(r.carve_and_back(0, 8 * MiB, &b));
  r.free(b);
  EXPECT_EQ(r.pool.pages.idle_bytes(), 8 * MiB);
  EXPECT_EQ(r.pg.reclaimable_bytes(r.pool.pages.idle_bytes()), 8 * MiB);
  EXPECT_EQ(r.pg.reclaimable_bytes(0), 0u);
  const std::uint64_t vm_calls = r.calls(sim_call::map) + r.calls(sim_call::phys_create);
  ASSERT_TRUE(r.carve_and_back(0, 8 * MiB));  // the same pages
  EXPECT_EQ(r.calls(sim_call::map) + r.calls(sim_call::phys_create), vm_calls);
  EXPECT_EQ(r.pool.pages.idle_bytes(), 0u);
  EXPECT_EQ(r.pool.pages.idle_head(), nullptr);
  EXPECT_EQ(r.reserved(), 8 * MiB);
}

TEST(Pager, ABlockUsingPartOfIdleMemoryPinsOnlyItsOwnPages) {
  pager_rig r;
  block* b = nullptr;
  ASSERT_TRUE(r.carve_and_back(0, 8 * MiB, &b));  // four one-page handles
  r.free(b);
  ASSERT_TRUE(r.carve_and_back(0, 2 * MiB));  // page 0 only: used in place, nothing split
  EXPECT_EQ(r.pg.counters.splits.load(), 0u);
  EXPECT_EQ(r.calls(sim_call::unmap), 0u);
  EXPECT_EQ(r.calls(sim_call::phys_release), 0u);
  EXPECT_EQ(r.calls(sim_call::device_synchronize), 0u);
  EXPECT_EQ(r.reserved(), 8 * MiB);             // memory is plentiful: idle pages stay mapped
  EXPECT_EQ(r.pool.pages.idle_bytes(), 6 * MiB);  // pages 1-3, each reclaimable on its own
  EXPECT_EQ(r.pg.reclaimable_bytes(r.pool.pages.idle_bytes()), 6 * MiB);
}

TEST(Pager, ACacheHitOfAHugeBlockTakesOneIdleRunAndGivesOneBack) {
  pager_rig r(1024 * MiB);
  block* b = nullptr;
  ASSERT_TRUE(r.carve_and_back(0, 512 * MiB, &b));  // pages 0-255
  EXPECT_EQ(r.range->mapped_runs.size(), 1u);       // one run of mapped pages
  EXPECT_TRUE(r.range->idle_runs.empty());
  r.free(b);
  // Its 256 pages went idle as one span: the bookkeeping of a free is one entry, not 256 -- the
  // pool's parked span (no idle run yet: a cache hit takes it back without touching the runs).
  EXPECT_TRUE(r.range->idle_runs.empty());
  EXPECT_EQ(r.pool.pages.idle_head(), nullptr);
  ASSERT_EQ(r.pool.pages.parked(), r.range.get());
  EXPECT_EQ(r.range->parked_first, 0u);
  EXPECT_EQ(r.range->parked_end, 256u);
  EXPECT_EQ(r.pool.pages.idle_bytes(), 512 * MiB);
  const std::uint64_t vm_calls = r.calls(sim_call::map) + r.calls(sim_call::phys_create) +
                                 r.calls(sim_call::set_access);
  ASSERT_TRUE(r.carve_and_back(0, 512 * MiB));  // the cache hit
  EXPECT_EQ(r.calls(sim_call::map) + r.calls(sim_call::phys_create) +
                r.calls(sim_call::set_access),
            vm_calls);
  EXPECT_TRUE(r.range->idle_runs.empty());
  EXPECT_EQ(r.pool.pages.idle_head(), nullptr);
  EXPECT_EQ(r.pool.pages.parked(), nullptr);
  EXPECT_EQ(r.pool.pages.idle_bytes(), 0u);
  // The page table holds one chunk of 512 pages, not the range's 1,024 pages; the edge counts
  // one chunk (pages 0 and 255) and the spare left when the free emptied it.
  EXPECT_EQ(r.range->pages.chunks(), 1u);
  EXPECT_EQ(r.range->edge_use.chunks(), 1u);
}

TEST(Pager, TheHostMemoryOfThePageTableFollowsWhatIsMappedNotTheRange) {
  pager_rig r(1024 * MiB);  // a range of 2 GiB: 1,024 pages, two chunks of 512
  EXPECT_EQ(r.range->pages.chunks(), 0u);
  EXPECT_EQ(r.range->edge_use.chunks(), 0u);
  block* b = nullptr;
  ASSERT_TRUE(r.carve_and_back(1536 * MiB, 2 * MiB, &b));  // page 768: the second chunk only
  EXPECT_EQ(r.range->pages.chunks(), 1u);
  EXPECT_EQ(r.range->edge_use.chunks(), 1u);
  r.free(b);
  r.pg.unmap_idle(r.pool, /*release_handles=*/true);
  // Everything unmapped: each table keeps at most its one spare chunk.
  EXPECT_EQ(r.range->mapped_pages, 0u);
  EXPECT_TRUE(r.range->mapped_runs.empty());
  EXPECT_EQ(r.range->pages.chunks(), 1u);
  EXPECT_EQ(r.range->edge_use.chunks(), 1u);
  EXPECT_EQ(r.reserved(), 0u);
}

TEST(Pager, ACarveSplittingAnIdleRunKeepsTheOrderInWhichPagesWentIdle) {
  pager_rig r(64 * MiB, /*limit=*/8 * MiB);
  block* a = nullptr;
  ASSERT_TRUE(r.carve_and_back(0, 8 * MiB, &a));  // pages 0-3, the whole limit
  r.free(a);                                      // one idle run, pages 0-3
  ASSERT_TRUE(r.carve_and_back(2 * MiB, 4 * MiB));  // pages 1-2 used in place: the run splits
  ASSERT_EQ(r.range->idle_runs.size(), 2u);
  EXPECT_EQ(r.pool.pages.idle_tail()->first, 0u);  // page 0 went idle first
  EXPECT_EQ(r.pool.pages.idle_head()->first, 3u);
  EXPECT_EQ(r.pool.pages.idle_bytes(), 4 * MiB);
  // A page elsewhere under the limit: the least recently idle page (0) moves there.
  ASSERT_TRUE(r.carve_and_back(32 * MiB, 2 * MiB));
  EXPECT_FALSE(r.range->mapped(0));
  EXPECT_TRUE(r.range->mapped(3));
  EXPECT_TRUE(r.range->mapped(16));
  EXPECT_EQ(r.calls(sim_call::unmap), 1u);
  EXPECT_EQ(r.calls(sim_call::phys_create), 4u);
  // Then page 3.
  ASSERT_TRUE(r.carve_and_back(40 * MiB, 2 * MiB));
  EXPECT_FALSE(r.range->mapped(3));
  EXPECT_TRUE(r.range->idle_runs.empty());
  EXPECT_EQ(r.pool.pages.idle_bytes(), 0u);
  EXPECT_EQ(r.reserved(), 8 * MiB);
  EXPECT_EQ(r.range->mapped_runs.size(), 3u);  // pages 1-2, 16, 20
}

/// The pager's runs against a per-page recount: every idle run holds mapped pages no live block
/// touches and every such page is in one; the runs of mapped pages are the page table's; the
/// idle list holds each run once with epochs never rising toward the tail; reserved is the mapped
/// pages plus the unmapped handles, and the simulated device agrees.
void expect_runs_match_pages(const pager_rig& r, const std::vector<block*>& live) {
  const detail::vm_range& v = *r.range;
  std::vector<int> use(v.page_count, 0);
  std::vector<std::uint32_t> edge(v.page_count, 0);
  for (const block* b : live) {
    const std::size_t f = v.page_of(b->addr);
    const std::size_t l = v.page_of(b->addr + b->size - 1);
    ++edge[f];
    if (l != f) ++edge[l];
    for (std::size_t pg = f; pg <= l; ++pg) ++use[pg];
  }
  std::size_t idle_pages = 0;
  std::size_t mapped = 0;
  std::map<std::size_t, std::size_t> runs;
  for (std::size_t pg = 0; pg < v.page_count; ++pg) {
    ASSERT_EQ(v.edge(pg), edge[pg]) << "page " << pg;
    if (!v.mapped(pg)) {
      ASSERT_EQ(use[pg], 0) << "page " << pg << " used but unmapped";
      ASSERT_FALSE(v.idle(pg));
      continue;
    }
    ++mapped;
    if (runs.empty() || std::prev(runs.end())->second != pg) {
      runs.emplace(pg, pg + 1);
    } else {
      std::prev(runs.end())->second = pg + 1;
    }
    ASSERT_EQ(v.idle(pg), use[pg] == 0) << "page " << pg;
    idle_pages += use[pg] == 0;
  }
  ASSERT_EQ(runs, v.mapped_runs);
  ASSERT_EQ(mapped, v.mapped_pages);
  std::size_t listed = 0;
  std::size_t listed_runs = 0;
  const detail::idle_run* newer = nullptr;
  for (const detail::idle_run* u = r.pool.pages.idle_head(); u != nullptr; u = u->older) {
    ASSERT_EQ(u->newer, newer);
    if (newer != nullptr) {
      ASSERT_LE(u->epoch, newer->epoch);
    }
    ASSERT_EQ(v.idle_runs.at(u->first), u);
    listed += u->pages();
    ++listed_runs;
    newer = u;
  }
  ASSERT_EQ(newer, r.pool.pages.idle_tail());
  // The parked span: the most recently idle pages, outside the runs.
  if (r.pool.pages.parked() != nullptr) {
    ASSERT_EQ(r.pool.pages.parked(), &v);
    ASSERT_LT(v.parked_first, v.parked_end);
    if (r.pool.pages.idle_head() != nullptr) {
      ASSERT_LE(r.pool.pages.idle_head()->epoch, v.parked_epoch);
    }
    listed += v.parked_end - v.parked_first;
  } else {
    ASSERT_EQ(v.parked_first, v.parked_end);
  }
  ASSERT_EQ(listed, idle_pages);
  ASSERT_EQ(listed_runs, v.idle_runs.size());
  ASSERT_EQ(r.pool.pages.idle_bytes(), idle_pages * 2 * MiB);
  ASSERT_EQ(r.reserved(), mapped * 2 * MiB + r.pg.free_handle_bytes);
  ASSERT_EQ(r.sim->used_bytes(), r.reserved());
  // Chunks: each idle as a whole, or within the pages one live block covers whole (unless a
  // carve straddled one it could not unmap).
  std::size_t chunks = 0;
  for (std::size_t pg = 0; pg < v.page_count; ++pg) {
    const detail::vm_page e = v.pages.get(pg);
    if (e.chunk_pages == 0 || e.chunk_index != 0) continue;
    ++chunks;
    const detail::page_span m = v.mapping_of(pg);
    const bool all_idle = v.all_idle(m);
    const bool one_block = std::any_of(live.begin(), live.end(), [&](const block* b) {
      const detail::page_span w = v.whole_pages(b->addr, b->size);
      return m.first >= w.first && m.end <= w.end;
    });
    if (r.pg.straddled_chunks() == 0) {
      ASSERT_TRUE(all_idle || one_block) << "chunk at page " << pg;
    }
    ASSERT_LE(m.pages(), r.pg.largest_chunk_pages()) << "chunk at page " << pg;
    for (std::size_t q = m.first; q < m.end; ++q) {
      ASSERT_EQ(v.pages.get(q).handle, e.handle) << "page " << q;
      ASSERT_EQ(v.pages.get(q).chunk_index, q - m.first) << "page " << q;
    }
  }
  ASSERT_EQ(chunks, v.chunks);
}

// Seeded random carves (any size and offset, blocks sharing edge pages), frees, unmaps and
// releases under a limit, with VM calls failing at random, with and without chunks: after every
// operation the runs and chunks agree with a per-page recount, and no failure leaves a page
// half-mapped or a handle untracked.
TEST(Pager, RunsMatchAPerPageRecountAfterEveryOperation) {
  for (std::uint32_t seed = 1; seed <= 12; ++seed) {
    SCOPED_TRACE(seed);
    // 64 pages of range; seeds 9-12 (coarse handles) 128, so that half the capacity is often to
    // spare.
    const std::size_t capacity = seed > 8 ? 128 * MiB : 64 * MiB;
    pager_rig r(capacity, /*limit=*/seed % 2 == 0 ? capacity / 8 * 5 : 0);
    // Seeds 5-8: chunks of up to 4 pages for blocks of at least 2 whole pages, so that carves
    // cut idle chunks often. Seeds 9-12: coarse handles of up to 4 pages (chunks for every block
    // while half the capacity is to spare, straddled when cut), otherwise the default chunking.
    if (seed > 4 && seed <= 8) r.pg.set_chunking(4, 2);
    if (seed > 8) r.pg.set_coarse_handles(4);
    std::mt19937_64 rng(seed);
    std::vector<block*> live;
    const std::size_t span = r.range->size;
    auto overlaps = [&](std::size_t off, std::size_t bytes) {
      return std::any_of(live.begin(), live.end(), [&](const block* b) {
        const std::size_t bo = b->addr - r.range->base;
        return off < bo + b->size && bo < off + bytes;
      });
    };
    for (int op = 0; op < 3000; ++op) {
      const int what = static_cast<int>(rng() % 100);
      if (what < 5) {  // a VM call of some kind fails soon
        constexpr sim_call kinds[] = {sim_call::phys_create, sim_call::map, sim_call::set_access,
                                      sim_call::unmap, sim_call::phys_release};
        r.sim->fail_nth(kinds[rng() % 5], 1 + rng() % 4);
      } else if (what < 55 || live.empty()) {  // carve and back
        const std::size_t bytes = 512 * (1 + rng() % (rng() % 4 == 0 ? 24576 : 4096));
        const std::size_t off = 512 * (rng() % ((span - bytes) / 512));
        if (overlaps(off, bytes)) continue;
        block* b = r.carve(off, bytes);
        bool ok = false;
        try {
          ok = r.pg.back(r.pool, b);
        } catch (const std::exception&) {
          ok = false;
        }
        if (ok) {
          live.push_back(b);
        } else {
          r.free(b);  // the allocator's undo
        }
      } else if (what < 95) {  // free
        const std::size_t i = rng() % live.size();
        r.free(live[i]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      } else {  // the ladder or empty_cache
        try {
          r.pg.unmap_idle(r.pool, /*release_handles=*/rng() % 2 == 0);
          if (rng() % 2 == 0) r.pg.release_unmapped(0);
        } catch (const std::exception&) {
        }
      }
      expect_runs_match_pages(r, live);
      if (HasFatalFailure()) return;
    }
    for (block* b : live) r.free(b);
    live.clear();
    r.sim->fail_always(sim_call::unmap, false);
    expect_runs_match_pages(r, live);
    if (seed > 8 && seed % 2 == 1) {  // without a limit, coarse chunks were cut and kept
      EXPECT_GT(r.pg.straddled_chunks(), 0u);
    }
  }
}

TEST(Pager, NothingIsUnmappedWhileTheSynchronizationGateIsShut) {
  pager_rig r(64 * MiB, /*limit=*/12 * MiB);
  block* b = nullptr;
  ASSERT_TRUE(r.carve_and_back(0, 8 * MiB, &b));
  r.free(b);
  r.pg.set_synchronization_gate([] { return false; });  // a capture is underway
  // Under the limit idle pages would move here; with the gate shut they are not unmapped, and the
  // 4 MiB still fit under the limit as new pages.
  ASSERT_TRUE(r.carve_and_back(16 * MiB, 4 * MiB));
  EXPECT_EQ(r.calls(sim_call::unmap), 0u);
  EXPECT_EQ(r.calls(sim_call::device_synchronize), 0u);
  EXPECT_EQ(r.reserved(), 12 * MiB);
  // Nothing more fits without unmapping: refused, nothing unmapped, nothing leaked.
  EXPECT_FALSE(r.carve_and_back(32 * MiB, 2 * MiB));
  EXPECT_EQ(r.calls(sim_call::unmap), 0u);
  EXPECT_EQ(r.sim->used_bytes(), r.reserved());
}

TEST(Pager, UnderTheLimitIdlePagesMoveWhereTheyAreNeededPageByPage) {
  pager_rig r(64 * MiB, /*limit=*/8 * MiB);
  block* a = nullptr;
  ASSERT_TRUE(r.carve_and_back(0, 8 * MiB, &a));  // the whole limit, four pages
  r.free(a);
  // 4 MiB elsewhere: two idle pages move there (unmapped and mapped again), nothing is created.
  ASSERT_TRUE(r.carve_and_back(16 * MiB, 4 * MiB));
  EXPECT_EQ(r.calls(sim_call::phys_create), 4u);
  EXPECT_EQ(r.calls(sim_call::phys_release), 0u);
  EXPECT_EQ(r.calls(sim_call::unmap), 2u);
  EXPECT_EQ(r.pg.counters.stitched_pages.load(), 2u);
  EXPECT_EQ(r.reserved(), 8 * MiB);
  EXPECT_EQ(r.budget.peak_bytes(), 8 * MiB);
  EXPECT_EQ(r.pool.pages.idle_bytes(), 4 * MiB);
  // More than the limit allows even with everything idle moved: refused, nothing leaks.
  block* c = nullptr;
  EXPECT_FALSE(r.carve_and_back(32 * MiB, 6 * MiB, &c));
  EXPECT_LE(r.reserved(), 8 * MiB);
  EXPECT_EQ(r.sim->used_bytes(), r.reserved());
}

TEST(Pager, UnmappedHandlesAreKeptReusedAndReleased) {
  pager_rig r;
  block* a = nullptr;
  block* b = nullptr;
  ASSERT_TRUE(r.carve_and_back(0, 4 * MiB, &a));        // two pages
  ASSERT_TRUE(r.carve_and_back(4 * MiB, 2 * MiB, &b));  // one page
  r.free(a);
  r.free(b);
  r.pg.unmap_idle(r.pool, /*release_handles=*/false);
  EXPECT_EQ(r.calls(sim_call::unmap), 3u);
  EXPECT_EQ(r.pg.free_handle_bytes, 6 * MiB);
  EXPECT_EQ(r.pg.free_handles.size(), 3u);
  EXPECT_EQ(r.pg.reclaimable_bytes(0), 6 * MiB);
  EXPECT_EQ(r.reserved(), 6 * MiB);  // unmapped handles are still reserved
  // A 1-page block elsewhere takes an unmapped handle: no new memory.
  ASSERT_TRUE(r.carve_and_back(20 * MiB, 2 * MiB));
  EXPECT_EQ(r.calls(sim_call::phys_create), 3u);
  EXPECT_EQ(r.pg.free_handle_bytes, 4 * MiB);
  // release_unmapped gives back handles down to the target.
  r.pg.release_unmapped(2 * MiB);
  EXPECT_EQ(r.pg.free_handle_bytes, 0u);
  EXPECT_EQ(r.reserved(), 2 * MiB);
  EXPECT_EQ(r.budget.device_frees.load(), 2u);
}

// The device-wide half of the pager's check: the address space it counts against what the
// ranges span, and its unmapped handle list against its counter; it returns the list's bytes.
TEST(Pager, TheDeviceWideCheckHoldsTheAddressSpaceAndTheHandleListToTheirCounts) {
  pager_rig r;
  const std::size_t span = r.pg.reserved_address_bytes();
  ASSERT_EQ(span, r.range->size);
  EXPECT_EQ(r.pg.check_device_wide(span), 0u);
  EXPECT_THROW((void)r.pg.check_device_wide(span + 2 * MiB), std::logic_error);
  block* a = nullptr;
  ASSERT_TRUE(r.carve_and_back(0, 4 * MiB, &a));
  r.free(a);
  r.pg.unmap_idle(r.pool, /*release_handles=*/false);
  EXPECT_EQ(r.pg.check_device_wide(span), 4 * MiB);
  r.pg.free_handle_bytes += 2 * MiB;  // the counter drifts from the list
  EXPECT_THROW((void)r.pg.check_device_wide(span), std::logic_error);
  r.pg.free_handle_bytes -= 2 * MiB;
  EXPECT_EQ(r.pg.check_device_wide(span), 4 * MiB);
  r.pg.release_unmapped(0);
}

TEST(Pager, MapIdlePagesMapsOnePageHandlesNoBlockTouches) {
  pager_rig r;
  ASSERT_TRUE(r.pg.map_idle_pages(r.pool, *r.range, r.range->base, 6 * MiB));
  EXPECT_EQ(r.calls(sim_call::phys_create), 3u);
  EXPECT_EQ(r.calls(sim_call::set_access), 1u);
  EXPECT_EQ(r.pool.pages.idle_bytes(), 6 * MiB);
  EXPECT_EQ(r.reserved(), 6 * MiB);
  // A block over those pages uses them in place.
  ASSERT_TRUE(r.carve_and_back(0, 6 * MiB));
  EXPECT_EQ(r.calls(sim_call::phys_create), 3u);
  EXPECT_EQ(r.pool.pages.idle_bytes(), 0u);
}

TEST(Pager, TheDryRunServesWhatIsMappedAndPlacesAsTheAllocatorDoes) {
  pager_rig r;
  const detail::size_policy policy{config{}};
  // The whole range one free block, placed in the pool's index as the allocator would hold it.
  block hole;
  hole.addr = r.range->base;
  hole.size = r.range->size;
  hole.seg = &r.seg;
  hole.state = block_state::free;
  r.seg.first = &hole;
  r.pg.make_room_for_range(r.pool);
  r.pg.add_range(r.pool, &r.seg);
  r.pool.index_of(pool_kind::large).insert(&hole);
  EXPECT_EQ(detail::place_in_range(r.pool.index_of(pool_kind::large), 8 * MiB), &hole);
  EXPECT_EQ(r.pg.largest_cached_request(r.pool, pool_kind::large, policy), 0u);  // nothing mapped
  ASSERT_TRUE(r.pg.map_idle_pages(r.pool, *r.range, r.range->base, 8 * MiB));
  // Pages 0-3 are mapped: a request of up to 8 MiB at the front of the hole needs nothing new.
  EXPECT_EQ(r.pg.largest_cached_request(r.pool, pool_kind::large, policy), 8 * MiB);
  EXPECT_EQ(r.calls(sim_call::phys_create), 4u);  // the dry run made no call
  r.pool.index_of(pool_kind::large).erase(&hole);
  r.pg.forget_range(r.pool, &r.seg);
}


// The size of a pool's next range (docs/design.md, "What a stream costs"): the device's size
// (twice for the large kind) for a pool's first range while the device's ranges span less than
// 32 devices, else 64 MiB for a first range and twice what the pool holds for a later one, never
// above the full size, always at least the request.
TEST(PagerRanges, NextRangeBytesFollowsTheAddressBudget) {
  pager_rig r;  // 64 MiB device; the rig's own range: 128 MiB
  using detail::pager;
  EXPECT_EQ(r.pg.reserved_address_bytes(), 128 * MiB);
  EXPECT_EQ(r.pg.next_range_bytes(pool_kind::large, 2 * MiB, 0), 128 * MiB);
  EXPECT_EQ(r.pg.next_range_bytes(pool_kind::small, 512 * KiB, 0), 64 * MiB);
  EXPECT_EQ(r.pg.next_range_bytes(pool_kind::large, 3 * MiB + 1, 64 * MiB), 128 * MiB);
  // Spend the budget (32 x 64 MiB = 2 GiB): 15 more ranges of 128 MiB make 2 GiB.
  std::vector<std::unique_ptr<detail::vm_range>> more;
  while (r.pg.reserved_address_bytes() + 128 * MiB <= pager::k_address_budget_devices * 64 * MiB) {
    more.push_back(r.pg.reserve_range(pool_kind::large, 128 * MiB));
    ASSERT_NE(more.back(), nullptr);
  }
  EXPECT_EQ(more.size(), 15u);
  EXPECT_EQ(r.pg.reserved_address_bytes(), 2 * GiB);
  // Past it: 64 MiB first, then double what the pool holds, up to the full size; never less
  // than the request.
  EXPECT_EQ(r.pg.next_range_bytes(pool_kind::large, 2 * MiB, 0), 64 * MiB);
  EXPECT_EQ(r.pg.next_range_bytes(pool_kind::small, 4 * KiB, 0), 64 * MiB);
  EXPECT_EQ(r.pg.next_range_bytes(pool_kind::large, 40 * MiB, 64 * MiB), 128 * MiB);
  EXPECT_EQ(r.pg.next_range_bytes(pool_kind::large, 40 * MiB, 100 * MiB), 128 * MiB);
  EXPECT_EQ(r.pg.next_range_bytes(pool_kind::large, 100 * MiB + 1, 0), 102 * MiB);
  EXPECT_EQ(r.pg.next_range_bytes(pool_kind::small, 4 * KiB, 48 * MiB), 64 * MiB);
  for (auto& range : more) r.pg.destroy_range(*range);
  EXPECT_EQ(r.pg.reserved_address_bytes(), 128 * MiB);
  EXPECT_EQ(r.pg.next_range_bytes(pool_kind::large, 2 * MiB, 0), 128 * MiB);
}

// The process's address space exhausted: reserve_range says so with nullptr, counts nothing.
TEST(PagerRanges, ReserveRangeWithoutAddressSpaceIsNull) {
  pager_rig r;
  r.sim->fail_nth(sim_call::va_reserve, 1);
  EXPECT_EQ(r.pg.reserve_range(pool_kind::large, 128 * MiB), nullptr);
  EXPECT_EQ(r.pg.reserved_address_bytes(), 128 * MiB);
}

// --- chunks: handles of several pages for the pages a big block covers whole ---------------------

TEST(Pager, ABigBlocksWholePagesGetChunksItsEdgePagesAHandleEach) {
  pager_rig r;
  r.pg.set_chunking(4, 4);  // chunks of up to 4 pages, for blocks of at least 4 whole pages
  block* b = nullptr;
  // [1, 21) MiB: pages 0-10; page 0 and page 10 only in part (a neighbour may share them), pages
  // 1-9 whole: chunks over 1-4 and 5-8, and page 9 (a run of one) a handle of its own.
  ASSERT_TRUE(r.carve_and_back(1 * MiB, 20 * MiB, &b));
  EXPECT_EQ(r.calls(sim_call::phys_create), 5u);
  EXPECT_EQ(r.calls(sim_call::map), 5u);
  EXPECT_EQ(r.calls(sim_call::set_access), 1u);  // the whole run of new mappings at once
  EXPECT_TRUE(r.sim->accessible(reinterpret_cast<void*>(b->addr), 20 * MiB));
  EXPECT_EQ(r.range->chunks, 2u);
  EXPECT_EQ(r.pg.counters.chunks.load(), 2u);
  EXPECT_EQ(r.range->mapping_of(3).first, 1u);
  EXPECT_EQ(r.range->mapping_of(3).end, 5u);
  EXPECT_EQ(r.range->mapping_of(9).pages(), 1u);
  EXPECT_EQ(r.range->mapping_of(0).pages(), 1u);
  EXPECT_EQ(r.reserved(), 22 * MiB);
  EXPECT_EQ(r.budget.device_allocs.load(), 5u);
  EXPECT_EQ(r.pool.stats.reserved_bytes[0].current, static_cast<std::int64_t>(22 * MiB));
  expect_runs_match_pages(r, {b});
  // A block with fewer whole pages than the minimum gets a handle per page.
  ASSERT_TRUE(r.carve_and_back(32 * MiB, 6 * MiB));
  EXPECT_EQ(r.calls(sim_call::phys_create), 8u);
  EXPECT_EQ(r.range->chunks, 2u);
}

TEST(Pager, AChunkedBlockFreedAndCarvedAgainWholeMakesNoCall) {
  pager_rig r;
  r.pg.set_chunking(4, 4);
  block* b = nullptr;
  ASSERT_TRUE(r.carve_and_back(1 * MiB, 20 * MiB, &b));
  const auto calls = r.vm_calls();
  r.free(b);
  EXPECT_EQ(r.pool.pages.idle_bytes(), 22 * MiB);
  // The same block again, then one of another size that still covers both chunks whole.
  ASSERT_TRUE(r.carve_and_back(1 * MiB, 20 * MiB, &b));
  r.free(b);
  ASSERT_TRUE(r.carve_and_back(2 * MiB, 16 * MiB, &b));  // pages 1-8, all whole
  EXPECT_EQ(r.vm_calls(), calls);
  EXPECT_EQ(r.pg.counters.splits.load(), 0u);
  expect_runs_match_pages(r, {b});
}

TEST(Pager, ACarveTouchingPartOfAnIdleChunkReleasesItAndBacksItsPagesOneByOne) {
  pager_rig r;
  r.pg.set_chunking(4, 4);
  block* b = nullptr;
  ASSERT_TRUE(r.carve_and_back(1 * MiB, 20 * MiB, &b));
  r.free(b);
  // [0, 6) MiB: pages 0-2 whole, but the chunk over pages 1-4 reaches beyond: it is unmapped
  // (after a device synchronization: it went idle since the last one) and released whole; pages
  // 1 and 2 get a handle each (3 whole pages: below the minimum), page 0 is used in place.
  ASSERT_TRUE(r.carve_and_back(0, 6 * MiB, &b));
  EXPECT_EQ(r.calls(sim_call::device_synchronize), 1u);
  EXPECT_EQ(r.calls(sim_call::unmap), 1u);
  EXPECT_EQ(r.calls(sim_call::phys_release), 1u);
  EXPECT_EQ(r.calls(sim_call::phys_create), 7u);
  EXPECT_EQ(r.pg.counters.splits.load(), 1u);
  EXPECT_EQ(r.budget.device_frees.load(), 1u);
  EXPECT_EQ(r.range->chunks, 1u);  // the chunk over pages 5-8 stays, idle
  EXPECT_FALSE(r.range->mapped(3));
  EXPECT_FALSE(r.range->mapped(4));
  EXPECT_EQ(r.reserved(), 18 * MiB);
  EXPECT_EQ(r.pool.pages.idle_bytes(), 12 * MiB);  // pages 5-10
  EXPECT_EQ(r.pg.straddled_chunks(), 0u);
  expect_runs_match_pages(r, {b});
}

TEST(Pager, MovesAndEmptyCacheReleaseAnIdleChunkWhole) {
  pager_rig r(64 * MiB, /*limit=*/24 * MiB);
  r.pg.set_chunking(4, 4);
  block* a = nullptr;
  ASSERT_TRUE(r.carve_and_back(0, 16 * MiB, &a));  // pages 0-7: chunks over 0-3 and 4-7
  EXPECT_EQ(r.calls(sim_call::phys_create), 2u);
  r.free(a);
  // 12 MiB elsewhere under the 24 MiB limit: memory is short, so idle memory moves -- but the
  // least recently idle page is a chunk's, which maps only whole: the chunk is released (8 MiB of
  // room), and the six pages are then created one by one (memory is not plentiful: no chunk).
  ASSERT_TRUE(r.carve_and_back(32 * MiB, 12 * MiB));
  EXPECT_EQ(r.calls(sim_call::unmap), 1u);
  EXPECT_EQ(r.calls(sim_call::phys_release), 1u);
  EXPECT_EQ(r.calls(sim_call::phys_create), 8u);
  EXPECT_EQ(r.pg.counters.stitched_pages.load(), 0u);
  EXPECT_EQ(r.reserved(), 20 * MiB);
  EXPECT_EQ(r.budget.peak_bytes(), 20 * MiB);
  EXPECT_EQ(r.range->chunks, 1u);
  // empty_cache's unmap: the other chunk is unmapped in one call and released, even when one-page
  // handles would be kept.
  r.pg.unmap_idle(r.pool, /*release_handles=*/false);
  EXPECT_EQ(r.calls(sim_call::unmap), 2u);
  EXPECT_EQ(r.calls(sim_call::phys_release), 2u);
  EXPECT_EQ(r.pg.free_handle_bytes, 0u);
  EXPECT_EQ(r.range->chunks, 0u);
  EXPECT_EQ(r.reserved(), 12 * MiB);
}

TEST(Pager, AFailedCallWhileBackingChunksLeavesNothingHalfMappedAndNoHandleLeaked) {
  for (const sim_call kind : {sim_call::map, sim_call::set_access}) {
    // Three maps (one per mapping), one set-access over the run.
    for (std::uint64_t nth = 1; nth <= (kind == sim_call::map ? 3u : 1u); ++nth) {
      SCOPED_TRACE(std::string(to_string(kind)) + " #" + std::to_string(nth));
      pager_rig r;
      r.pg.set_chunking(4, 4);
      r.sim->fail_nth(kind, nth);
      block* b = r.carve(0, 20 * MiB);  // pages 0-9: chunks 0-3, 4-7 and 8-9
      EXPECT_THROW((void)r.pg.back(r.pool, b), cuda_error);
      r.free(b);  // the allocator's undo
      EXPECT_EQ(r.range->mapped_pages, 0u);
      EXPECT_EQ(r.range->chunks, 0u);
      EXPECT_EQ(r.reserved(), 0u);  // the chunks were released, not kept as unmapped handles
      EXPECT_EQ(r.sim->used_bytes(), 0u);
      EXPECT_EQ(r.sim->live_handles(), 0u);
      expect_runs_match_pages(r, {});
    }
  }
  // A chunk's create refused (out of memory): its first page gets a handle of its own, and the
  // next run a chunk again (pages 0-3, 4, 5-7).
  pager_rig r;
  r.pg.set_chunking(4, 4);
  r.sim->fail_nth(sim_call::phys_create, 2);
  block* b = nullptr;
  ASSERT_TRUE(r.carve_and_back(0, 16 * MiB, &b));
  EXPECT_EQ(r.range->chunks, 2u);
  EXPECT_EQ(r.range->mapping_of(4).pages(), 1u);
  EXPECT_EQ(r.range->mapping_of(5).pages(), 3u);
  EXPECT_EQ(r.range->mapped_pages, 8u);
  EXPECT_EQ(r.sim->used_bytes(), r.reserved());
  expect_runs_match_pages(r, {b});
}

TEST(Pager, EvictReleasesChunksWholeAndBackMapsThemAgain) {
  pager_rig r;
  r.pg.set_chunking(4, 4);
  block* b = nullptr;
  ASSERT_TRUE(r.carve_and_back(1 * MiB, 20 * MiB, &b));
  r.pg.make_room_for_range(r.pool);
  r.pg.add_range(r.pool, &r.seg);  // evict walks the pool's
  EXPECT_EQ(r.pg.evict(r.pool, /*synchronize=*/true), 22 * MiB);
  EXPECT_EQ(r.calls(sim_call::unmap), 5u);  // one per mapping: three pages and two chunks
  EXPECT_EQ(r.calls(sim_call::phys_release), 5u);
  EXPECT_EQ(r.range->chunks, 0u);
  EXPECT_EQ(r.reserved(), 0u);
  // Wake: back() maps the block's pages again, with chunks as before.
  ASSERT_TRUE(r.pg.back(r.pool, b));
  EXPECT_EQ(r.calls(sim_call::phys_create), 10u);
  EXPECT_EQ(r.range->chunks, 2u);
  EXPECT_EQ(r.reserved(), 22 * MiB);
  expect_runs_match_pages(r, {b});
  r.pg.forget_range(r.pool, &r.seg);
}

TEST(Pager, WithTheGateShutACarveStraddlesAnIdleChunkWhichIsReleasedOnceIdleAgain) {
  pager_rig r;
  r.pg.set_chunking(4, 4);
  block* b = nullptr;
  ASSERT_TRUE(r.carve_and_back(0, 16 * MiB, &b));  // chunks over 0-3 and 4-7
  r.free(b);
  r.pg.set_synchronization_gate([] { return false; });  // a capture is underway
  ASSERT_TRUE(r.carve_and_back(0, 4 * MiB, &b));  // part of the first chunk: nothing unmapped
  EXPECT_EQ(r.calls(sim_call::unmap), 0u);
  EXPECT_EQ(r.pg.straddled_chunks(), 1u);
  EXPECT_EQ(r.reserved(), 16 * MiB);
  expect_runs_match_pages(r, {b});
  // While a block touches part of it, the chunk is not unmapped; the other one is.
  r.pg.set_synchronization_gate([] { return true; });
  r.pg.unmap_idle(r.pool, /*release_handles=*/true);
  EXPECT_EQ(r.calls(sim_call::unmap), 1u);
  EXPECT_EQ(r.reserved(), 8 * MiB);
  expect_runs_match_pages(r, {b});
  // Idle as a whole again: released whole.
  r.free(b);
  r.pg.unmap_idle(r.pool, /*release_handles=*/true);
  EXPECT_EQ(r.calls(sim_call::unmap), 2u);
  EXPECT_EQ(r.reserved(), 0u);
  EXPECT_EQ(r.sim->live_handles(), 0u);
}

// Coarse handles (set_coarse_handles): while the device has room for a block's missing pages
// plus half its capacity, every block's whole pages get chunks, and a carve that cuts an idle
// chunk uses it as it is (straddled) instead of releasing it; the straddled chunk is released
// once idle as a whole.
TEST(Pager, CoarseHandlesChunkEveryBlockWhilePlentifulAndKeepACutChunk) {
  pager_rig r;  // 64 MiB: coarse while 14 + 32 MiB fit
  r.pg.set_coarse_handles(4);
  block* b = nullptr;
  // [1, 13) MiB: pages 0-6, pages 1-5 whole: a chunk over 1-4, page 5 (a run of one) and the
  // edge pages 0 and 6 a handle each.
  ASSERT_TRUE(r.carve_and_back(1 * MiB, 12 * MiB, &b));
  EXPECT_EQ(r.calls(sim_call::phys_create), 4u);
  EXPECT_EQ(r.calls(sim_call::map), 4u);
  EXPECT_EQ(r.calls(sim_call::set_access), 1u);
  EXPECT_EQ(r.range->chunks, 1u);
  EXPECT_EQ(r.range->mapping_of(2).first, 1u);
  EXPECT_EQ(r.range->mapping_of(2).end, 5u);
  EXPECT_EQ(r.reserved(), 14 * MiB);
  expect_runs_match_pages(r, {b});
  r.free(b);
  // [2, 6) MiB: pages 1-2, part of the idle chunk: it stays mapped, straddled; no call at all.
  const auto calls = r.vm_calls();
  ASSERT_TRUE(r.carve_and_back(2 * MiB, 4 * MiB, &b));
  EXPECT_EQ(r.vm_calls(), calls);
  EXPECT_EQ(r.pg.straddled_chunks(), 1u);
  EXPECT_EQ(r.pg.counters.splits.load(), 0u);
  EXPECT_EQ(r.reserved(), 14 * MiB);
  EXPECT_EQ(r.pool.pages.idle_bytes(), 10 * MiB);  // pages 0 and 3-6
  expect_runs_match_pages(r, {b});
  // empty_cache gives back what is idle as a whole mapping (pages 0, 5, 6); the chunk's idle
  // pages 3-4 stay while b touches its pages 1-2.
  r.pg.unmap_idle(r.pool, /*release_handles=*/true);
  EXPECT_EQ(r.calls(sim_call::unmap), 3u);
  EXPECT_EQ(r.reserved(), 8 * MiB);
  EXPECT_EQ(r.pool.pages.idle_bytes(), 4 * MiB);
  expect_runs_match_pages(r, {b});
  r.free(b);
  r.pg.unmap_idle(r.pool, /*release_handles=*/true);
  EXPECT_EQ(r.calls(sim_call::unmap), 4u);
  EXPECT_EQ(r.reserved(), 0u);
  EXPECT_EQ(r.sim->live_handles(), 0u);
}

// Once a growth leaves less than half the capacity to spare, coarse handles behave as without:
// one handle per page for a block below the chunk minimum, and an idle chunk a carve cuts is
// released and its pages created again one by one.
TEST(Pager, CoarseHandlesBehaveAsWithoutOnceHalfTheCapacityIsNotToSpare) {
  pager_rig r;
  r.pg.set_coarse_handles(4);
  block* a = nullptr;
  ASSERT_TRUE(r.carve_and_back(1 * MiB, 12 * MiB, &a));  // coarse, as above: 4 creates
  ASSERT_EQ(r.calls(sim_call::phys_create), 4u);
  // [32, 56) MiB: pages 16-27, 12 missing: 24 + 32 MiB do not fit in the 50 MiB left.
  block* c = nullptr;
  ASSERT_TRUE(r.carve_and_back(32 * MiB, 24 * MiB, &c));
  EXPECT_EQ(r.calls(sim_call::phys_create), 16u);
  EXPECT_EQ(r.range->chunks, 1u);
  r.free(a);
  // The chunk over pages 1-4 is cut: unmapped after a device synchronization and released;
  // pages 1 and 2 get a handle each (30 MiB reserved: 4 + 32 MiB do not fit in the 34 left).
  block* b = nullptr;
  ASSERT_TRUE(r.carve_and_back(2 * MiB, 4 * MiB, &b));
  EXPECT_EQ(r.calls(sim_call::device_synchronize), 1u);
  EXPECT_EQ(r.calls(sim_call::unmap), 1u);
  EXPECT_EQ(r.calls(sim_call::phys_release), 1u);
  EXPECT_EQ(r.calls(sim_call::phys_create), 18u);
  EXPECT_EQ(r.reserved(), 34 * MiB);
  EXPECT_EQ(r.pg.counters.splits.load(), 1u);
  EXPECT_EQ(r.pg.straddled_chunks(), 0u);
  EXPECT_EQ(r.range->chunks, 0u);
  expect_runs_match_pages(r, {b, c});
}

TEST(Pager, TheDryRunCountsTheChunksARequestWouldCutAsMissing) {
  pager_rig r;
  r.pg.set_chunking(4, 4);
  const detail::size_policy policy{config{}};
  block* b = nullptr;
  ASSERT_TRUE(r.carve_and_back(0, 16 * MiB, &b));  // chunks over 0-3 and 4-7
  r.free(b);
  block hole;
  hole.addr = r.range->base;
  hole.size = r.range->size;
  hole.seg = &r.seg;
  hole.state = block_state::free;
  r.seg.first = &hole;
  r.pg.make_room_for_range(r.pool);
  r.pg.add_range(r.pool, &r.seg);
  r.pool.index_of(pool_kind::large).insert(&hole);
  // 16 MiB covers both chunks whole: served from them. Anything between 8 and 16 MiB would cut
  // the second chunk, releasing it: with no unmapped handles, not served from cached memory.
  EXPECT_EQ(r.pg.largest_cached_request(r.pool, pool_kind::large, policy), 16 * MiB);
  r.pool.index_of(pool_kind::large).erase(&hole);
  r.pg.forget_range(r.pool, &r.seg);
}

// A pool's ranges change only through the pager: add_range lists a range and counts its bytes
// by kind, forget_range unlists it, drop_range unlists it and gives its address space back.
// check_invariants holds the list to the pool's segments that own a vm_range.
TEST(Pager, RangesAreAddedAndDroppedThroughThePagerAndCheckedAgainstTheSegments) {
  pager_rig r;
  EXPECT_NO_THROW(r.pg.check_invariants(r.pool));  // no range, no segment
  r.pg.make_room_for_range(r.pool);
  r.pg.add_range(r.pool, &r.seg);
  ASSERT_EQ(r.pool.pages.ranges(), (std::vector<detail::segment*>{&r.seg}));
  EXPECT_EQ(r.pool.pages.range_bytes(pool_kind::large), r.seg.size);
  EXPECT_EQ(r.pool.pages.range_bytes(pool_kind::small), 0u);
  // Listed, but not in the pool's segment list.
  EXPECT_THROW(r.pg.check_invariants(r.pool), std::logic_error);
  r.pool.segments = &r.seg;
  EXPECT_NO_THROW(r.pg.check_invariants(r.pool));
  r.pg.forget_range(r.pool, &r.seg);
  EXPECT_TRUE(r.pool.pages.ranges().empty());
  EXPECT_EQ(r.pool.pages.range_bytes(pool_kind::large), 0u);
  // A segment with a range that the list does not name.
  EXPECT_THROW(r.pg.check_invariants(r.pool), std::logic_error);
  r.pool.segments = nullptr;
  EXPECT_NO_THROW(r.pg.check_invariants(r.pool));
  // A second range, dropped: unlisted and its address space given back.
  const std::size_t before = r.pg.reserved_address_bytes();
  auto vm = r.pg.reserve_range(pool_kind::small, r.pg.next_range_bytes(pool_kind::small, 2 * MiB, 0));
  ASSERT_NE(vm, nullptr);
  detail::segment small;
  small.base = vm->base;
  small.size = vm->size;
  small.kind = pool_kind::small;
  small.owner = &r.pool;
  small.vm = vm.get();
  EXPECT_EQ(r.pg.reserved_address_bytes(), before + vm->size);
  r.pg.make_room_for_range(r.pool);
  r.pg.add_range(r.pool, &small);
  EXPECT_EQ(r.pool.pages.range_bytes(pool_kind::small), small.size);
  EXPECT_EQ(r.pool.pages.range_bytes(pool_kind::large), 0u);
  r.pg.drop_range(r.pool, &small);
  EXPECT_TRUE(r.pool.pages.ranges().empty());
  EXPECT_EQ(r.pool.pages.range_bytes(pool_kind::small), 0u);
  EXPECT_EQ(r.pg.reserved_address_bytes(), before);
}

// check_invariants holds the idle list and idle_bytes to the ranges' tables: a freed block's
// pages (parked, then listed) agree; a parked span the pool's count does not cover is seen.
TEST(Pager, CheckInvariantsHoldsTheIdleListToThePageTables) {
  pager_rig r;
  r.pg.make_room_for_range(r.pool);
  r.pg.add_range(r.pool, &r.seg);
  r.pool.segments = &r.seg;
  block* a = nullptr;
  block* b = nullptr;
  ASSERT_TRUE(r.carve_and_back(0, 4 * MiB, &a));
  ASSERT_TRUE(r.carve_and_back(8 * MiB, 4 * MiB, &b));
  EXPECT_NO_THROW(r.pg.check_invariants(r.pool));
  r.free(a);  // pages 0-1 parked
  ASSERT_EQ(r.pool.pages.parked(), r.range.get());
  EXPECT_EQ(r.pool.pages.idle_bytes(), 4 * MiB);
  EXPECT_NO_THROW(r.pg.check_invariants(r.pool));
  r.free(b);  // pages 4-5 parked, pages 0-1 listed
  ASSERT_NE(r.pool.pages.idle_head(), nullptr);
  EXPECT_EQ(r.pool.pages.idle_head(), r.pool.pages.idle_tail());
  EXPECT_EQ(r.pool.pages.idle_bytes(), 8 * MiB);
  EXPECT_NO_THROW(r.pg.check_invariants(r.pool));
  // The parked span grown in the range's table behind the pool's back: the count disagrees.
  const std::size_t end = r.range->parked_end;
  r.range->parked_end = end + 1;
  EXPECT_THROW(r.pg.check_invariants(r.pool), std::logic_error);
  r.range->parked_end = end;
  EXPECT_NO_THROW(r.pg.check_invariants(r.pool));
  r.pool.segments = nullptr;
  r.pg.forget_range(r.pool, &r.seg);
}

// fresh_pages (the rule touch_carved and headroom share) against its definition, by brute force:
// the pages of a span inside a free hole that no carved block's span touches. Seeded random
// layouts of blocks at quarter-page offsets, so that holes share edge pages with their
// neighbours; every span checked is inside a hole, at its front and elsewhere.
TEST(Pager, FreshPagesAreThePagesOfTheSpanNoBlockTouches) {
  constexpr std::size_t q = 512 * 1024;  // a quarter page
  std::mt19937_64 rng(31);
  for (int layout = 0; layout < 40; ++layout) {
    pager_rig r;
    const std::size_t quarters = r.range->size / q;
    std::vector<std::pair<std::size_t, std::size_t>> spans;  // [first, end) in quarters
    for (std::size_t at = rng() % 3; at < quarters;) {
      const std::size_t len = 1 + rng() % 10;
      if (at + len > quarters) break;
      if (rng() % 2 == 0) {
        r.carve(at * q, len * q);
        spans.emplace_back(at, at + len);
      }
      at += len + rng() % 3;
    }
    const auto touched_by_a_block = [&](std::size_t pg) {
      return std::any_of(spans.begin(), spans.end(), [&](const auto& s) {
        return r.range->page_of(r.range->base + s.first * q) <= pg &&
               r.range->page_of(r.range->base + s.second * q - 1) >= pg;
      });
    };
    // The holes: the quarters between carved spans.
    std::size_t prev = 0;
    spans.emplace_back(quarters, quarters);
    for (const auto& [first, end] : spans) {
      for (int k = 0; first > prev && k < 6; ++k) {
        const std::size_t from = prev * q + (k == 0 ? 0 : rng() % ((first - prev) * q));
        const std::size_t bytes = 1 + rng() % (first * q - from);
        const std::uintptr_t addr = r.range->base + from;
        std::size_t expect = 0;
        for (std::size_t pg = r.range->page_of(addr); pg <= r.range->page_of(addr + bytes - 1);
             ++pg) {
          expect += touched_by_a_block(pg) ? 0 : 1;
        }
        ASSERT_EQ(detail::pager::fresh_pages(*r.range, addr, bytes), expect)
            << "layout " << layout << " offset " << from << " bytes " << bytes;
      }
      prev = end;
    }
    for (const auto& b : r.blocks) r.free(b.get());
  }
  // Exact cases: a span inside one page, beside blocks on both sides, on neither, across pages.
  EXPECT_EQ(detail::pager::fresh_pages(3, 3, true, true), 0u);
  EXPECT_EQ(detail::pager::fresh_pages(3, 3, false, false), 1u);
  EXPECT_EQ(detail::pager::fresh_pages(3, 4, true, true), 0u);
  EXPECT_EQ(detail::pager::fresh_pages(3, 4, true, false), 1u);
  EXPECT_EQ(detail::pager::fresh_pages(3, 7, true, true), 3u);
  EXPECT_EQ(detail::pager::fresh_pages(3, 7, false, false), 5u);
}

}  // namespace
}  // namespace cucache::test
