// The pool table on its own: a pool table over the simulated device, pools made quiet (or not)
// by hand, and the retirement steps the allocator takes through the table -- the quiet events'
// rate, recording a quiet event, queueing a candidate, handing a proven pool to a new stream,
// and what keeps a pool from being handed on (memory without proof, a change after the record,
// an allocation that unlocked the pool midway, another sleep domain).
#include <gtest/gtest.h>

#include <memory>

#include "allocator/pool_table.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

using detail::pool_lock;
using detail::pool_table;
using detail::stream_pool;

struct table_rig {
  table_rig() : sim(std::make_shared<sim_backend>()), pools(*sim) { pools.set_event_backend(sim.get()); }
  std::shared_ptr<sim_backend> sim;
  pool_table pools;

  /// The pool of a new stream of the sim.
  stream_pool& new_stream_pool(std::uint32_t domain = 0) {
    const stream_handle s = sim->create_stream();
    return pools.pool_for(s, pools.stream_key(s), domain);
  }
  /// p holds `bytes` of device memory (as its segments would count them).
  static void hold(stream_pool& p, std::int64_t bytes) {
    pool_lock lk(p.mu);
    p.stats.reserved_bytes.inc(detail::pool_kind::large, bytes);
  }
  /// Records p's quiet event on its stream with p quiet, as impl::note_quiet does.
  void record_quiet(stream_pool& p) {
    pool_lock lk(p.mu);
    const event_handle e = p.retirement.begin_record([&] { return sim->event_create(); });
    sim->event_record(e, p.stream);
    pools.quiet_recorded(p);
  }
  void queue(stream_pool& p) {
    pool_lock lk(p.mu);
    pools.queue_quiet(p);
  }
  static bool queued(stream_pool& p) {
    pool_lock lk(p.mu);
    return p.retirement.queued();
  }
  ~table_rig() {
    for (const auto& p : pools.list()) {
      if (const event_handle e = p->retirement.quiet_event(); e != nullptr) sim->event_destroy(e);
    }
  }
};

TEST(PoolTable, QuietEventsForTheFirstEightQuietFreesThenOneIn256) {
  table_rig r;
  stream_pool& p = r.new_stream_pool();
  pool_lock lk(p.mu);
  int due = 0;
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(p.retirement.count_quiet_free()) << i;
  for (int i = 8; i < 1000; ++i) due += p.retirement.count_quiet_free() ? 1 : 0;
  EXPECT_EQ(due, 3);  // the 256th, 512th and 768th
}

TEST(PoolTable, AQuietPoolWithoutMemoryGoesToTheNextNewStream) {
  table_rig r;
  stream_pool& p = r.new_stream_pool();
  const std::uint64_t old_key = p.key;
  r.queue(p);
  EXPECT_TRUE(table_rig::queued(p));
  const stream_handle s2 = r.sim->create_stream();
  stream_pool& q = r.pools.pool_for(s2, r.pools.stream_key(s2));
  EXPECT_EQ(&q, &p);
  EXPECT_EQ(r.pools.adoptions(), 1u);
  EXPECT_EQ(p.key, r.pools.stream_key(s2));
  EXPECT_EQ(p.stream, s2);
  EXPECT_FALSE(table_rig::queued(p));
  EXPECT_EQ(r.pools.size(), 1u);
  // The old stream's key names no pool now: its next request gets a new one.
  stream_pool& fresh = r.pools.pool_for_key(nullptr, old_key);
  EXPECT_NE(&fresh, &p);
  EXPECT_EQ(r.pools.size(), 2u);
}

TEST(PoolTable, APoolWithMemoryWaitsForItsQuietEvent) {
  table_rig r;
  stream_pool& p = r.new_stream_pool();
  table_rig::hold(p, 2 * MiB);
  r.record_quiet(p);
  EXPECT_TRUE(table_rig::queued(p));
  // Its stream's work is not done: a new stream gets a new pool, p stays a candidate.
  stream_pool& a = r.new_stream_pool();
  EXPECT_NE(&a, &p);
  EXPECT_EQ(r.pools.adoptions(), 0u);
  EXPECT_TRUE(table_rig::queued(p));
  r.sim->complete_stream(p.stream);
  stream_pool& b = r.new_stream_pool();
  EXPECT_EQ(&b, &p);
  EXPECT_EQ(r.pools.adoptions(), 1u);
  pool_lock lk(p.mu);
  EXPECT_FALSE(p.retirement.event_proves(p.tick));  // no proof for its new stream
  EXPECT_NE(p.retirement.quiet_event(), nullptr);   // the event is kept for the pool's life
}

TEST(PoolTable, APoolWithMemoryAndNoQuietEventIsNotHandedOn) {
  table_rig r;
  stream_pool& p = r.new_stream_pool();
  table_rig::hold(p, 2 * MiB);
  r.queue(p);
  stream_pool& a = r.new_stream_pool();
  EXPECT_NE(&a, &p);
  EXPECT_EQ(r.pools.adoptions(), 0u);
  EXPECT_FALSE(table_rig::queued(p));  // judged stale: out of the queue until queued again
}

TEST(PoolTable, AChangeAfterTheRecordVoidsTheProof) {
  table_rig r;
  stream_pool& p = r.new_stream_pool();
  table_rig::hold(p, 2 * MiB);
  r.record_quiet(p);
  r.sim->complete_stream(p.stream);
  {
    pool_lock lk(p.mu);
    EXPECT_TRUE(p.retirement.event_proves(p.tick));
    ++p.tick;  // a free since the record
    EXPECT_FALSE(p.retirement.event_proves(p.tick));
  }
  stream_pool& a = r.new_stream_pool();
  EXPECT_NE(&a, &p);
  EXPECT_EQ(r.pools.adoptions(), 0u);
  EXPECT_FALSE(table_rig::queued(p));
  // Recorded again (quiet, nothing since) and completed: handed on.
  r.record_quiet(p);
  r.sim->complete_stream(p.stream);
  EXPECT_EQ(&r.new_stream_pool(), &p);
}

TEST(PoolTable, AnAllocationUnlockedMidwayKeepsThePoolFromRetiring) {
  table_rig r;
  stream_pool& p = r.new_stream_pool();
  {
    pool_lock lk(p.mu);
    EXPECT_TRUE(p.quiet());
    p.retirement.unlocked_allocation_began();
    p.retirement.unlocked_allocation_began();
    EXPECT_FALSE(p.quiet());
    r.pools.queue_quiet(p);
  }
  stream_pool& a = r.new_stream_pool();
  EXPECT_NE(&a, &p);
  EXPECT_FALSE(table_rig::queued(p));
  {
    pool_lock lk(p.mu);
    p.retirement.unlocked_allocation_ended();
    EXPECT_FALSE(p.quiet());
    p.retirement.unlocked_allocation_ended();
    EXPECT_TRUE(p.quiet());
  }
  r.queue(p);
  EXPECT_EQ(&r.new_stream_pool(), &p);
}

TEST(PoolTable, ARetiredPoolServesOnlyItsSleepDomain) {
  table_rig r;
  stream_pool& p = r.new_stream_pool(/*domain=*/3);
  EXPECT_EQ(p.domain, 3u);
  r.queue(p);
  stream_pool& a = r.new_stream_pool(/*domain=*/0);
  EXPECT_NE(&a, &p);
  EXPECT_TRUE(table_rig::queued(p));  // still a candidate, for its own domain
  EXPECT_EQ(&r.new_stream_pool(/*domain=*/3), &p);
  EXPECT_EQ(r.pools.adoptions(), 1u);
}

TEST(PoolTable, AGraphPoolsPartIsNeverQuiet) {
  table_rig r;
  stream_pool* part = nullptr;
  {
    detail::unique_lock list(r.pools.list_mutex());
    part = &r.pools.new_pool(nullptr, 7, reinterpret_cast<detail::graph_pool*>(0x10), 0);
  }
  pool_lock lk(part->mu);
  EXPECT_FALSE(part->quiet());
}

}  // namespace
}  // namespace cucache::test
