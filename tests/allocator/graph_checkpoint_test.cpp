// Graph pools as PyTorch's private pools (src/allocator/graph_checkpoint.cpp): owners without a
// route, live allocations, one pool's cache, and checkpoints that cudagraph trees restore -- on
// the simulated device, in both modes, with exact expectations and a seeded randomized run that
// checks the invariants after every step. Also the memory fraction changed at run time.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

class GraphCheckpoint : public ::testing::TestWithParam<const char*> {
 protected:
  sim_allocator a{parse_config(GetParam())};
  stream_handle s = a.sim->create_stream();
  const graph_pool_id pool{0, 42};
  /// A MemPool (one owner: createOrIncrefPool) with s routed to it, as torch.cuda.use_mem_pool
  /// does: beginAllocateToPool adds an owner; at the end of the block endAllocateToPool and
  /// releasePool (unroute) drop the route and that owner; the MemPool's end releases its own.
  void route() {
    a.alloc.create_or_incref_graph_pool(pool);
    a.alloc.begin_allocate_to_pool(pool, [this](stream_handle st) { return st == s; });
  }
  void unroute() {
    a.alloc.end_allocate_to_pool(pool);
    a.alloc.release_graph_pool(pool);
  }
  void drop() {
    unroute();
    a.alloc.release_graph_pool(pool);
  }
  std::vector<void*> live() const { return a.alloc.graph_pool_live_allocations(pool); }
};

std::vector<void*> sorted(std::vector<void*> v) {
  std::sort(v.begin(), v.end());
  return v;
}

TEST_P(GraphCheckpoint, OwnersWithoutARouteCountAndReviveASettledPool) {
  EXPECT_THROW(a.alloc.create_or_incref_graph_pool({0, 0}), invalid_argument);
  a.alloc.create_or_incref_graph_pool(pool);
  EXPECT_EQ(a.alloc.graph_pool_state(pool).uses, 1u);
  a.alloc.create_or_incref_graph_pool(pool);
  EXPECT_EQ(a.alloc.graph_pool_state(pool).uses, 2u);
  EXPECT_FALSE(a.alloc.graph_pool_state(pool).routed);
  a.alloc.release_graph_pool(pool);
  a.alloc.release_graph_pool(pool);
  EXPECT_TRUE(a.alloc.graph_pool_state(pool).released);
  // Released with no capture underway: settled at once, so it may be revived.
  a.alloc.create_or_incref_graph_pool(pool);
  EXPECT_EQ(a.alloc.graph_pool_state(pool).uses, 1u);
  EXPECT_FALSE(a.alloc.graph_pool_state(pool).released);
  a.alloc.release_graph_pool(pool);
  a.alloc.check_invariants();
}

TEST_P(GraphCheckpoint, LiveAllocationsAndOnePoolsCache) {
  route();
  void* x = a.alloc.allocate(3 * MiB, s);
  void* y = a.alloc.allocate(4096, s);
  void* outside = a.alloc.allocate(4096, nullptr);  // not routed
  EXPECT_EQ(live(), sorted({x, y}));
  a.alloc.deallocate(y);
  EXPECT_EQ(live(), std::vector<void*>{x});
  EXPECT_TRUE(a.alloc.graph_pool_live_allocations({9, 9}).empty());
  unroute();  // (a route blocks device synchronization: it may be a capture's)
  const auto frees = a.frees();
  a.alloc.empty_graph_pool_cache(pool);  // y's small segment goes; x's segment is in use
  EXPECT_EQ(a.frees(), frees + 1);
  EXPECT_EQ(a.alloc.graph_pool_state(pool).reserved_bytes, 20 * MiB);
  EXPECT_THROW(a.alloc.empty_graph_pool_cache({9, 9}), invalid_argument);
  a.alloc.deallocate(x);
  a.alloc.deallocate(outside);
  a.alloc.release_graph_pool(pool);
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  a.alloc.check_invariants();
}

TEST_P(GraphCheckpoint, RestoreFreesWhatIsLiveAndAllocatesTheCheckpointAtItsAddresses) {
  route();
  void* x = a.alloc.allocate(1 * MiB + 512, s);  // large pool, shares a 20 MiB segment
  void* y = a.alloc.allocate(3 * MiB, s);
  void* z = a.alloc.allocate(4096, s);           // small pool
  const device_stats before = a.stats();
  const auto cp = a.alloc.checkpoint_graph_pool(pool);
  ASSERT_EQ(cp.live.size(), 3u);
  EXPECT_EQ(cp.segments.size(), 2u);
  for (const auto& b : cp.live) EXPECT_EQ(b.stream, s);
  // The tree goes down another path: y dies, new tensors are made.
  a.alloc.deallocate(y);
  void* u = a.alloc.allocate(5 * MiB, s);
  void* v = a.alloc.allocate(8192, s);
  EXPECT_EQ(live().size(), 4u);
  const auto mallocs = a.mallocs();

  const auto back = a.alloc.restore_graph_pool(cp);
  EXPECT_EQ(sorted(back.freed), sorted({x, z, u, v}));
  ASSERT_EQ(back.allocated.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(back.allocated[i].address, cp.live[i].address);
    EXPECT_EQ(back.allocated[i].size, cp.live[i].size);
    EXPECT_EQ(back.allocated[i].requested, cp.live[i].requested);
  }
  EXPECT_EQ(live(), sorted({x, y, z}));
  EXPECT_EQ(a.mallocs(), mallocs);  // no device call: the segments were there
  const device_stats after = a.stats();
  EXPECT_EQ(after.allocated_bytes[0].current, before.allocated_bytes[0].current);
  EXPECT_EQ(after.requested_bytes[0].current, before.requested_bytes[0].current);
  EXPECT_EQ(after.allocation_count[0].current, 3);
  EXPECT_EQ(a.alloc.allocation_size(y), 3 * MiB);
  a.alloc.check_invariants();
  // The restored blocks are ordinary allocations: freed, and the pool serves them again.
  for (void* p : {x, y, z}) a.alloc.deallocate(p);
  EXPECT_TRUE(live().empty());
  void* again = a.alloc.allocate(3 * MiB, s);
  EXPECT_EQ(live(), std::vector<void*>{again});
  a.alloc.deallocate(again);
  drop();
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  a.alloc.check_invariants();
}

TEST_P(GraphCheckpoint, ARefusedRestoreChangesNothing) {
  route();
  void* x = a.alloc.allocate(4096, s);
  void* big = a.alloc.allocate(3 * MiB, s);
  auto cp = a.alloc.checkpoint_graph_pool(pool);
  a.alloc.deallocate(x);
  unroute();
  a.alloc.empty_graph_pool_cache(pool);  // x's small segment is gone
  const std::vector<void*> now = live();
  try {
    static_cast<void>(a.alloc.restore_graph_pool(cp));
    ADD_FAILURE() << "restored a checkpoint whose segment is gone";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no longer has the segment"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(live(), now);
  // Overlapping blocks in a (corrupted) checkpoint, an unknown pool: refused too.
  cp = a.alloc.checkpoint_graph_pool(pool);
  cp.live.push_back(cp.live.front());
  EXPECT_THROW(static_cast<void>(a.alloc.restore_graph_pool(cp)), invalid_argument);
  cp.pool = {7, 7};
  EXPECT_THROW(static_cast<void>(a.alloc.restore_graph_pool(cp)), invalid_argument);
  EXPECT_THROW(static_cast<void>(a.alloc.checkpoint_graph_pool({7, 7})), invalid_argument);
  EXPECT_EQ(live(), now);
  a.alloc.check_invariants();
  a.alloc.deallocate(big);
  a.alloc.release_graph_pool(pool);
}

TEST_P(GraphCheckpoint, RandomizedRestoresKeepEveryInvariant) {
  // Random allocations and frees in the pool, checkpoints at random moments, restores of random
  // earlier checkpoints: after each restore the live set is exactly the checkpoint's, no served
  // block overlaps a live one, and the invariants hold after every step.
  route();
  std::mt19937_64 rng(20261203);
  std::map<void*, std::size_t> alive;  // address -> requested
  std::vector<device_allocator::graph_pool_checkpoint> cps;
  const std::size_t sizes[] = {512, 4096, 100000, 1 * MiB, 1 * MiB + 1, 3 * MiB, 9 * MiB};
  for (int step = 0; step < 600; ++step) {
    const auto r = rng() % 10;
    if (r < 5 || alive.empty()) {
      const std::size_t n = sizes[rng() % std::size(sizes)];
      void* p = a.alloc.allocate(n, s);
      const std::size_t rounded = a.alloc.allocation_size(p);
      for (const auto& [q, qn] : alive) {
        const auto qa = reinterpret_cast<std::uintptr_t>(q);
        const auto pa = reinterpret_cast<std::uintptr_t>(p);
        ASSERT_TRUE(pa + rounded <= qa || qa + a.alloc.allocation_size(q) <= pa)
            << "overlap at step " << step;
      }
      alive[p] = n;
    } else if (r < 8) {
      auto it = alive.begin();
      std::advance(it, static_cast<long>(rng() % alive.size()));
      a.alloc.deallocate(it->first);
      alive.erase(it);
    } else if (r < 9 || cps.empty()) {
      cps.push_back(a.alloc.checkpoint_graph_pool(pool));
    } else {
      const auto& cp = cps[rng() % cps.size()];
      const auto back = a.alloc.restore_graph_pool(cp);
      EXPECT_EQ(back.freed.size(), alive.size());
      alive.clear();
      for (const auto& b : cp.live) alive[reinterpret_cast<void*>(b.address)] = b.requested;
      std::vector<void*> want;
      for (const auto& [p, n] : alive) want.push_back(p);
      ASSERT_EQ(live(), want) << "step " << step;
    }
    a.alloc.check_invariants();
  }
  for (const auto& [p, n] : alive) a.alloc.deallocate(p);
  drop();
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
}

TEST_P(GraphCheckpoint, ANoSplitPoolHoldsOneBlockPerSegment) {
  // MemPool(no_split=True): requests take a free block whole, or a segment of their own size.
  EXPECT_THROW(a.alloc.set_graph_pool_no_split(pool), invalid_argument);  // no such pool yet
  route();
  a.alloc.set_graph_pool_no_split(pool);
  void* x = a.alloc.allocate(4 * MiB, s);
  void* y = a.alloc.allocate(4 * MiB, s);
  void* z = a.alloc.allocate(4096, s);  // small: a 2 MiB segment, taken whole
  EXPECT_EQ(a.alloc.allocation_size(x), 4 * MiB);
  EXPECT_EQ(a.alloc.allocation_size(z), 2 * MiB);
  std::size_t segments = 0;
  for (const segment_view& sv : a.alloc.segments()) {
    if (sv.pool != pool) continue;
    ++segments;
    EXPECT_EQ(sv.blocks.size(), 1u);
  }
  EXPECT_EQ(segments, 3u);
  a.alloc.deallocate(y);
  void* w = a.alloc.allocate(1 * MiB + 512, s);  // y's free segment, whole
  EXPECT_EQ(w, y);
  EXPECT_EQ(a.alloc.allocation_size(w), 4 * MiB);
  a.alloc.check_invariants();
  for (void* p : {x, z, w}) a.alloc.deallocate(p);
  drop();
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
}

TEST_P(GraphCheckpoint, TheMemoryFractionChangesAtRunTime) {
  EXPECT_EQ(a.alloc.memory_fraction(), 1.0);
  const std::size_t total = a.sim->mem_get_info().total_bytes;
  void* x = a.alloc.allocate(total / 4, nullptr);
  a.alloc.set_memory_fraction(0.5);
  EXPECT_EQ(a.alloc.memory_fraction(), 0.5);
  EXPECT_EQ(a.stats().memory_limit, total / 2);
  EXPECT_THROW(static_cast<void>(a.alloc.allocate(total / 2, nullptr)), out_of_memory);
  void* y = a.alloc.allocate(total / 8, nullptr);
  // Lowered under what is reserved: nothing is given back here, and nothing more is taken.
  a.alloc.set_memory_fraction(0.125);
  EXPECT_GT(static_cast<std::size_t>(a.reserved()), total / 8);
  EXPECT_THROW(static_cast<void>(a.alloc.allocate(total / 8, nullptr)), out_of_memory);
  a.alloc.check_invariants();
  a.alloc.deallocate(x);
  a.alloc.deallocate(y);
  a.alloc.empty_cache();
  void* z = a.alloc.allocate(total / 16, nullptr);
  a.alloc.deallocate(z);
  EXPECT_THROW(a.alloc.set_memory_fraction(-0.1), invalid_argument);
  EXPECT_THROW(a.alloc.set_memory_fraction(1.5), invalid_argument);
  EXPECT_EQ(a.alloc.memory_fraction(), 0.125);
  // 0: nothing more can be reserved.
  a.alloc.empty_cache();
  a.alloc.set_memory_fraction(0.0);
  EXPECT_EQ(a.alloc.memory_fraction(), 0.0);
  EXPECT_THROW(static_cast<void>(a.alloc.allocate(4096, nullptr)), out_of_memory);
  a.alloc.set_memory_fraction(1.0);
  a.alloc.deallocate(a.alloc.allocate(4096, nullptr));
  a.alloc.check_invariants();
}

INSTANTIATE_TEST_SUITE_P(Modes, GraphCheckpoint, ::testing::Values("", "expandable_segments:True"),
                         [](const auto& param_info) {
                           return std::string(param_info.param).empty() ? "Default" : "Expandable";
                         });

}  // namespace
}  // namespace cucache::test
