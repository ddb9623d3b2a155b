// The graph pools on their own: a pool table and graph_pools over the simulated device, no
// allocator -- routes and captures choose parts, the blockers that forbid synchronizing the
// device, blocks held for graphs and what settling a released pool hands back, and the errors.
#include <gtest/gtest.h>

#include <memory>

#include "allocator/graph_pools.hpp"
#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

using detail::block;
using detail::block_state;
using detail::graph_pool;
using detail::pool_table;

constexpr graph_pool_id k_pool{1, 2};

struct graph_rig {
  graph_rig() : sim(std::make_shared<sim_backend>()), pools(*sim), graphs(*sim, pools) {}
  std::shared_ptr<sim_backend> sim;
  pool_table pools;
  detail::graph_pools graphs;

  /// A pending block of pool p (as the free path leaves one before retaining it).
  static std::unique_ptr<block> pending_block(detail::stream_pool& p, detail::segment& seg) {
    seg.owner = &p;
    auto b = std::make_unique<block>();
    b->seg = &seg;
    b->state = block_state::pending;
    b->uses = new detail::stream_uses;
    return b;
  }
};

TEST(GraphPools, ARouteSendsItsStreamsToOnePartPerStream) {
  graph_rig r;
  const stream_handle s1 = r.sim->create_stream();
  const stream_handle s2 = r.sim->create_stream();
  EXPECT_FALSE(r.graphs.sync_blocked());
  EXPECT_EQ(r.graphs.part_for(s1, {}), nullptr);  // no route: the stream's own pool
  r.graphs.begin_route(k_pool, [&](stream_handle s) { return s == s1 || s == s2; });
  EXPECT_TRUE(r.graphs.sync_blocked());
  EXPECT_TRUE(r.graphs.any_route());
  EXPECT_FALSE(r.graphs.any_capture());
  detail::stream_pool* p1 = r.graphs.part_for(s1, {});
  detail::stream_pool* p2 = r.graphs.part_for(s2, {});
  ASSERT_NE(p1, nullptr);
  ASSERT_NE(p2, nullptr);
  EXPECT_NE(p1, p2);
  EXPECT_EQ(r.graphs.part_for(s1, {}), p1);    // the same part again
  EXPECT_EQ(p1->key, r.pools.stream_key(s1));  // routed outside a capture: keyed by id
  ASSERT_NE(p1->graph, nullptr);
  EXPECT_EQ(p1->graph->id, k_pool);
  EXPECT_EQ(r.pools.size(), 2u);                       // parts live in the pool table
  EXPECT_EQ(r.graphs.part_for(nullptr, {}), nullptr);  // the filter says no

  const graph_pool_info info = r.graphs.state(k_pool);
  EXPECT_TRUE(info.exists);
  EXPECT_EQ(info.uses, 1u);
  EXPECT_TRUE(info.routed);
  EXPECT_FALSE(info.released);
  r.graphs.end_route(k_pool);
  EXPECT_FALSE(r.graphs.sync_blocked());
  EXPECT_FALSE(r.graphs.state(k_pool).routed);
  r.graphs.release(k_pool);
  EXPECT_TRUE(r.graphs.state(k_pool).released);
  EXPECT_EQ(r.graphs.state(k_pool).uses, 0u);
  EXPECT_FALSE(r.graphs.state(graph_pool_id{7, 7}).exists);
  r.graphs.check_invariants();
}

TEST(GraphPools, ACapturingStreamGetsItsCapturesPoolKeyedByHandle) {
  graph_rig r;
  const stream_handle s = r.sim->create_stream();
  const capture_info cap{capture_state::active, 5};
  detail::stream_pool* part = r.graphs.part_for(s, cap);
  ASSERT_NE(part, nullptr);
  EXPECT_EQ(part->key, pool_table::capture_key(s));
  ASSERT_NE(part->graph, nullptr);
  EXPECT_EQ(part->graph->id, graph_pool_id::of_capture(5));
  EXPECT_EQ(r.graphs.state(graph_pool_id::of_capture(5)).uses, 1u);  // the capture's graph
  EXPECT_TRUE(r.graphs.any_capture());
  EXPECT_TRUE(r.graphs.sync_blocked());
  EXPECT_EQ(r.graphs.capture_of(pool_table::capture_key(s)), part->graph);
  // The stream seen not capturing: the capture has ended, nothing blocks any more.
  EXPECT_EQ(r.graphs.part_for(s, {}), nullptr);
  EXPECT_FALSE(r.graphs.sync_blocked());
  EXPECT_EQ(r.graphs.capture_of(pool_table::capture_key(s)), nullptr);
  r.graphs.check_invariants();
}

TEST(GraphPools, AnInvalidatedCaptureAllocatesNothing) {
  graph_rig r;
  const stream_handle s = r.sim->create_stream();
  try {
    (void)r.graphs.part_for(s, {capture_state::invalidated, 3});
    FAIL() << "no error";
  } catch (const cuda_error& e) {
    EXPECT_EQ(e.code(), 901);
  }
  EXPECT_EQ(r.pools.size(), 0u);
}

TEST(GraphPools, HeldBlocksComeBackAfterTheReleaseAndOneSynchronization) {
  graph_rig r;
  const stream_handle s = r.sim->create_stream();
  r.graphs.begin_route(k_pool, [&](stream_handle x) { return x == s; });
  detail::stream_pool* part = r.graphs.part_for(s, {});
  detail::stream_pool& own = r.pools.pool_for(nullptr);
  detail::segment seg;
  auto b = graph_rig::pending_block(own, seg);
  graph_pool* g = part->graph;
  r.graphs.retain(*g, own, b.get());
  EXPECT_EQ(own.retained, 1u);
  EXPECT_EQ(b->uses->pending_events, 1u);
  EXPECT_EQ(r.graphs.state(k_pool).retained_blocks, 1u);
  r.graphs.check_invariants();

  r.graphs.end_route(k_pool);
  // Not released yet: settling hands nothing back and does not synchronize.
  auto none = r.graphs.settle(*r.sim);
  EXPECT_TRUE(none.blocks.empty());
  EXPECT_TRUE(none.parts.empty());
  EXPECT_EQ(r.sim->calls(sim_call::device_synchronize), 0u);

  r.graphs.release(k_pool);
  auto back = r.graphs.settle(*r.sim);
  EXPECT_EQ(r.sim->calls(sim_call::device_synchronize), 1u);
  ASSERT_EQ(back.blocks.size(), 1u);
  EXPECT_EQ(back.blocks[0].b, b.get());
  EXPECT_EQ(back.blocks[0].pool, &own);
  ASSERT_EQ(back.parts.size(), 1u);
  EXPECT_EQ(back.parts[0], part);
  EXPECT_EQ(r.graphs.state(k_pool).retained_blocks, 0u);
  // The caller returns the blocks (here by hand, as settle_graph_pools does).
  --own.retained;
  --b->uses->pending_events;
  r.graphs.check_invariants();
  // Settled: no second wait, and not the parts again -- what the pool frees after its first
  // settlement may be used by a later graph and stays cached until empty_cache or the ladder.
  auto again = r.graphs.settle(*r.sim);
  EXPECT_TRUE(again.blocks.empty());
  EXPECT_TRUE(again.parts.empty());
  EXPECT_EQ(r.sim->calls(sim_call::device_synchronize), 1u);
  delete b->uses;
}

TEST(GraphPools, ABlockHeldUntilASynchronizationComesBackAtTheNextSettle) {
  graph_rig r;
  detail::stream_pool& own = r.pools.pool_for(nullptr);
  detail::segment seg;
  auto b = graph_rig::pending_block(own, seg);
  r.graphs.retain_until_sync(own, b.get());
  EXPECT_EQ(own.retained, 1u);
  auto back = r.graphs.settle(*r.sim);
  EXPECT_EQ(r.sim->calls(sim_call::device_synchronize), 1u);
  ASSERT_EQ(back.blocks.size(), 1u);
  EXPECT_TRUE(back.parts.empty());
  delete b->uses;
}

TEST(GraphPools, TheInvariantCheckSeesAWrongRetentionCount) {
  graph_rig r;
  detail::stream_pool& own = r.pools.pool_for(nullptr);
  r.graphs.check_invariants();
  ++own.retained;
  EXPECT_THROW(r.graphs.check_invariants(), std::logic_error);
  --own.retained;
}

TEST(GraphPools, BadCallsNameTheProblem) {
  graph_rig r;
  const auto message = [](auto&& f) {
    try {
      f();
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const stream_filter all = [](stream_handle) { return true; };
  EXPECT_NE(message([&] { r.graphs.begin_route(graph_pool_id{}, all); }).find("names no pool"),
            std::string::npos);
  EXPECT_NE(message([&] { r.graphs.begin_route(k_pool, {}); }).find("the filter is empty"),
            std::string::npos);
  EXPECT_NE(message([&] { r.graphs.end_route(k_pool); }).find("nothing allocates"),
            std::string::npos);
  EXPECT_NE(message([&] { r.graphs.release(k_pool); }).find("does not exist"), std::string::npos);
  r.graphs.begin_route(k_pool, all);
  EXPECT_NE(message([&] { r.graphs.begin_route(k_pool, all); }).find("routed already"),
            std::string::npos);
  EXPECT_NE(message([&] { r.graphs.release(k_pool); }).find("still routed"), std::string::npos);
  const std::string blocks = message([&] { r.graphs.throw_capture_blocks("empty_cache"); });
  EXPECT_NE(blocks.find("the route to graph pool (0x1, 0x2)"), std::string::npos) << blocks;
  EXPECT_NE(blocks.find("code 900"), std::string::npos) << blocks;
  r.graphs.end_route(k_pool);
  r.graphs.release(k_pool);
  EXPECT_NE(message([&] { r.graphs.release(k_pool); }).find("released already"), std::string::npos);
}

}  // namespace
}  // namespace cucache::test
