// The sleeper on its own, on pager_test's rig: a device budget, a pool table, a pager and the
// graph pools over the simulated device, with blocks placed by hand in one pool of sleep domain 7
// (the allocator's part), so that every expectation is about the sleeper's walk -- which pages
// sleep gives back, what it keeps in host memory, where wake maps them again, and what a failure
// part way leaves.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <vector>

#include "allocator/device_budget.hpp"
#include "allocator/graph_pools.hpp"
#include "allocator/pager.hpp"
#include "allocator/pool_table.hpp"
#include "allocator/tag_sleeper.hpp"
#include "allocator/whole_vm_segments.hpp"
#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

using detail::block;
using detail::block_state;
using detail::pool_kind;

constexpr std::uint32_t k_domain = 7;
constexpr std::size_t k_page = 2 * MiB;

sim_options rig_options(std::size_t capacity, bool host_memory = false) {
  sim_options o = sized(capacity);
  o.host_memory = host_memory;
  return o;
}

/// One pool of sleep domain k_domain on the legacy stream, with one large range, on a simulated
/// device of `capacity` bytes; a sleeper, and the parts its walk works with.
struct sleeper_rig {
  explicit sleeper_rig(sim_options o = rig_options(64 * MiB))
      : sim(std::make_shared<sim_backend>(o)),
        budget(o.capacity_bytes, 0, 0),
        pools(*sim),
        pg(*sim, budget, k_page, pools),
        graphs(*sim, pools),
        pool(pools.pool_for(nullptr, pools.stream_key(nullptr), k_domain)),
        range(pg.reserve_range(pool_kind::large,
                               pg.next_range_bytes(pool_kind::large, k_page, 0))) {
    seg.base = range->base;
    seg.size = range->size;
    seg.kind = pool_kind::large;
    seg.owner = &pool;
    seg.vm = range.get();
    detail::pool_table::all_locked all(pools);
    detail::pool_table::assert_locked(pool);
    pg.make_room_for_range(pool);
    pg.add_range(pool, &seg);
  }
  ~sleeper_rig() {
    detail::pool_table::all_locked all(pools);
    detail::pool_table::assert_locked(pool);
    sleeper.free_spares(*sim);
    pg.forget_range(pool, &seg);
    pg.destroy_range(*range);
  }

  /// A block carved at [offset, offset + bytes) of the range, its pages touched and backed (as
  /// the allocator's carve and back do), linked into the range's block list in address order.
  block* carve(std::size_t offset, std::size_t bytes) {
    auto b = std::make_unique<block>();
    b->addr = range->base + offset;
    b->size = bytes;
    b->seg = &seg;
    b->state = block_state::allocated;
    b->uses = nullptr;
    block* raw = b.get();
    blocks[offset] = std::move(b);
    relink();
    detail::pool_table::all_locked all(pools);
    detail::pool_table::assert_locked(pool);
    pool.stats.on_allocate(pool_kind::large, static_cast<std::int64_t>(bytes),
                           static_cast<std::int64_t>(bytes));
    pg.touch_carved(pool, raw);
    EXPECT_TRUE(pg.back(pool, raw));
    return raw;
  }
  /// The block freed: its pages untouched (their mappings go idle).
  void free(block* b) {
    detail::pool_table::all_locked all(pools);
    detail::pool_table::assert_locked(pool);
    pool.stats.on_free(pool_kind::large, static_cast<std::int64_t>(b->size),
                       static_cast<std::int64_t>(b->size));
    pg.touch_freed(pool, b);
    b->state = block_state::free;
  }
  void relink() {
    block* prev = nullptr;
    seg.first = nullptr;
    for (auto& [off, b] : blocks) {
      b->prev = prev;
      b->next = nullptr;
      if (prev != nullptr) {
        prev->next = b.get();
      } else {
        seg.first = b.get();
      }
      prev = b.get();
    }
  }

  detail::tag_sleeper::parts parts() {
    return detail::tag_sleeper::parts{pools,
                                      &pg,
                                      budget,
                                      *sim,
                                      graphs,
                                      k_page,
                                      [this](detail::stream_pool& q) {
                                        EXPECT_EQ(&q, &pool);
                                        ++syncs;
                                      },
                                      [this] { ++settles; },
                                      graph_vm};  // no graph memory on this rig
  }
  void sleep(bool keep, const std::function<void(std::size_t)>& check = {}) {
    const device_allocator::sleep_request r{k_domain, keep, "weights", check};
    detail::pool_table::all_locked all(pools);
    sleeper.sleep(parts(), std::span(&r, 1));
  }
  void wake() {
    const device_allocator::wake_request r{k_domain, ""};
    detail::pool_table::all_locked all(pools);
    sleeper.wake(parts(), std::span(&r, 1));
  }
  /// The sleeper's check, against the pages this rig's live blocks touch.
  void check() {
    std::map<std::uint32_t, std::size_t> touched;
    std::size_t last = 0;
    bool any = false;
    for (const auto& [off, b] : blocks) {
      if (b->state == block_state::free) continue;
      const std::size_t first = off / k_page;
      const std::size_t end = (off + b->size - 1) / k_page;
      const std::size_t start = any && first <= last ? last + 1 : first;
      if (start <= end) touched[k_domain] += end - start + 1;
      last = std::max(last, end);
      any = true;
    }
    detail::pool_table::all_locked all(pools);
    sleeper.check_invariants(touched, {}, k_page);
  }
  [[nodiscard]] const detail::tag_sleeper::record& record() {
    detail::pool_table::all_locked all(pools);
    return sleeper.records().at(k_domain);
  }
  [[nodiscard]] std::size_t spare() {
    detail::pool_table::all_locked all(pools);
    return sleeper.spare_bytes(k_domain);
  }
  [[nodiscard]] bool accessible(const block* b) const {
    return sim->accessible(reinterpret_cast<void*>(b->addr), b->size);
  }

  std::shared_ptr<sim_backend> sim;
  detail::device_budget budget;
  detail::pool_table pools;
  detail::pager pg;
  detail::graph_pools graphs;
  detail::whole_vm_segments graph_vm{*sim, budget};
  detail::stream_pool& pool;
  std::unique_ptr<detail::vm_range> range;
  detail::segment seg;
  std::map<std::size_t, std::unique_ptr<block>> blocks;  // by offset
  detail::tag_sleeper sleeper;
  int syncs = 0;
  int settles = 0;
};

/// Three live blocks on pages 0-1 (3 MiB from 0), 1-2 (2 MiB from 3 MiB: page 1 shared) and 4
/// (2 MiB from 8 MiB), and an idle page 6 (a freed block's).
struct three_blocks {
  explicit three_blocks(sleeper_rig& r)
      : a(r.carve(0, 3 * MiB)), b(r.carve(3 * MiB, 2 * MiB)), c(r.carve(8 * MiB, 2 * MiB)) {
    r.free(r.carve(12 * MiB, 2 * MiB));
  }
  block* a;
  block* b;
  block* c;
};

TEST(TagSleeper, SleepGivesBackEveryPageAndWakeMapsTheTouchedOnesAtTheSameAddresses) {
  sleeper_rig r;
  const three_blocks t(r);
  EXPECT_EQ(r.budget.reserved_bytes(), 5 * k_page);  // pages 0, 1, 2, 4 and the idle 6
  EXPECT_EQ(r.pool.pages.idle_bytes(), k_page);
  const std::uint64_t syncs_before = r.sim->calls(sim_call::device_synchronize);

  r.sleep(/*keep=*/false);
  EXPECT_TRUE(r.sleeper.asleep(k_domain));
  EXPECT_TRUE(r.sleeper.any());
  EXPECT_EQ(r.syncs, 1);  // the domain's one pool: its pending frees completed first
  EXPECT_EQ(r.budget.reserved_bytes(), 0u);
  EXPECT_EQ(r.sim->live_mappings(), 0u);
  EXPECT_EQ(r.sim->live_handles(), 0u);
  EXPECT_EQ(r.sim->calls(sim_call::phys_release), 5u);
  EXPECT_EQ(r.sim->calls(sim_call::device_synchronize), syncs_before + 1);  // evict's one
  EXPECT_EQ(r.range->mapped_pages, 0u);
  const auto& rec = r.record();
  EXPECT_EQ(rec.sleeping_bytes, 4 * k_page);  // the pages live blocks touch, page 1 once
  EXPECT_EQ(rec.released_bytes, 5 * k_page);  // the idle page too
  EXPECT_EQ(rec.label, "weights");
  EXPECT_EQ(rec.host, nullptr);
  EXPECT_EQ(rec.host_bytes, 0u);
  EXPECT_TRUE(rec.runs.empty());
  EXPECT_EQ(r.sim->pinned_bytes(), 0u);
  EXPECT_FALSE(r.accessible(t.a));
  r.check();

  r.wake();
  EXPECT_FALSE(r.sleeper.asleep(k_domain));
  EXPECT_FALSE(r.sleeper.any());
  EXPECT_TRUE(r.sleeper.records().empty());
  EXPECT_EQ(r.budget.reserved_bytes(), 4 * k_page);  // the touched pages; the idle one stays gone
  EXPECT_EQ(r.range->mapped_pages, 4u);
  EXPECT_TRUE(r.accessible(t.a));  // at the same addresses
  EXPECT_TRUE(r.accessible(t.b));
  EXPECT_TRUE(r.accessible(t.c));
  EXPECT_FALSE(r.sim->accessible(reinterpret_cast<void*>(r.range->base + 12 * MiB), k_page));
  EXPECT_EQ(r.settles, 0);  // room enough: nothing settled
  r.check();
}

TEST(TagSleeper, KeptContentsGoToOnePinnedBufferAndComeBackAfterWake) {
  sleeper_rig r(rig_options(64 * MiB, /*host_memory=*/true));
  const three_blocks t(r);
  // A byte per 4 KiB of every block, each its own (host_view covers one mapping at a time).
  const auto byte_at = [&](std::uintptr_t a) -> std::byte* {
    return r.sim->host_view(reinterpret_cast<void*>(a), 1);
  };
  for (const block* b : {t.a, t.b, t.c}) {
    for (std::size_t i = 0; i < b->size; i += 4096) {
      std::byte* h = byte_at(b->addr + i);
      ASSERT_NE(h, nullptr);
      *h = std::byte(((b->addr + i) >> 12) & 0xff);
    }
  }
  r.sleep(/*keep=*/true);
  const auto& rec = r.record();
  // a and b are adjacent: one run of 5 MiB at offset 0; c a run of 2 MiB after it.
  ASSERT_EQ(rec.runs.size(), 2u);
  EXPECT_EQ(rec.runs[0].addr, t.a->addr);
  EXPECT_EQ(rec.runs[0].bytes, 5 * MiB);
  EXPECT_EQ(rec.runs[0].host_offset, 0u);
  EXPECT_EQ(rec.runs[1].addr, t.c->addr);
  EXPECT_EQ(rec.runs[1].bytes, 2 * MiB);
  EXPECT_EQ(rec.runs[1].host_offset, 5 * MiB);
  EXPECT_EQ(rec.host_bytes, 7 * MiB);
  EXPECT_EQ(rec.host_capacity, 7 * MiB);
  EXPECT_TRUE(rec.keep_contents);
  EXPECT_EQ(r.sim->pinned_bytes(), 7 * MiB);
  EXPECT_EQ(r.sim->calls(sim_call::copy_async), 2u);  // one per run (both under 256 MiB)
  EXPECT_EQ(r.budget.reserved_bytes(), 0u);
  r.check();

  r.wake();
  EXPECT_EQ(r.sim->calls(sim_call::copy_async), 4u);
  for (const block* b : {t.a, t.b, t.c}) {
    for (std::size_t i = 0; i < b->size; i += 4096) {
      const std::byte* h = byte_at(b->addr + i);
      ASSERT_NE(h, nullptr);
      ASSERT_EQ(*h, std::byte(((b->addr + i) >> 12) & 0xff)) << "at " << b->addr + i;
    }
  }
  // The pinned buffer stays, the domain's spare for its next kept sleep.
  EXPECT_EQ(r.spare(), 7 * MiB);
  EXPECT_EQ(r.sim->pinned_bytes(), 7 * MiB);
  EXPECT_EQ(r.sim->live_pinned(), 1u);
  r.sleep(/*keep=*/true);  // reuses it: no new pin
  EXPECT_EQ(r.sim->calls(sim_call::host_alloc_pinned), 1u);
  EXPECT_EQ(r.spare(), 0u);  // in use by the record
  r.wake();
  // A sleep that keeps nothing frees the spare.
  r.sleep(/*keep=*/false);
  EXPECT_EQ(r.spare(), 0u);
  EXPECT_EQ(r.sim->pinned_bytes(), 0u);
  r.check();
  r.wake();
  r.check();
}

TEST(TagSleeper, RefusalsChangeNothing) {
  sleeper_rig r(rig_options(64 * MiB));
  const three_blocks t(r);
  const std::size_t reserved = r.budget.reserved_bytes();
  // The check sees the requested bytes of the domain's pools, and its throw stops the sleep.
  std::size_t seen = 0;
  EXPECT_THROW(r.sleep(false,
                       [&](std::size_t placed) {
                         seen = placed;
                         throw std::runtime_error("no");
                       }),
               std::runtime_error);
  EXPECT_EQ(seen, 7 * MiB);
  EXPECT_FALSE(r.sleeper.asleep(k_domain));
  EXPECT_EQ(r.budget.reserved_bytes(), reserved);
  EXPECT_EQ(r.sim->calls(sim_call::unmap), 0u);
  // No pinned memory for the kept contents: out_of_memory, nothing changed.
  r.sim->fail_always(sim_call::host_alloc_pinned);
  try {
    r.sleep(true);
    ADD_FAILURE() << "sleep kept contents without a host buffer";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("cannot pin 7.00 MiB"), std::string::npos) << e.what();
  }
  r.sim->fail_always(sim_call::host_alloc_pinned, false);
  EXPECT_FALSE(r.sleeper.asleep(k_domain));
  EXPECT_TRUE(r.sleeper.records().empty());
  EXPECT_EQ(r.budget.reserved_bytes(), reserved);
  EXPECT_TRUE(r.accessible(t.a));
  // Asleep already / not asleep.
  r.sleep(false);
  EXPECT_THROW(r.sleep(false), invalid_argument);
  r.wake();
  EXPECT_THROW(r.wake(), invalid_argument);
  r.check();
}

TEST(TagSleeper, WakeWithoutRoomLeavesTheDomainAsleepWithNothingMapped) {
  sleeper_rig r(rig_options(64 * MiB));
  const three_blocks t(r);
  r.sleep(false);
  r.sim->set_capacity(3 * k_page);  // another process took the rest: 4 pages do not fit
  try {
    r.wake();
    ADD_FAILURE() << "wake mapped more than the device holds";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("4 page(s)"), std::string::npos) << e.what();
  }
  EXPECT_EQ(r.settles, 1);  // short of room: released graph pools settled first
  EXPECT_TRUE(r.sleeper.asleep(k_domain));
  EXPECT_EQ(r.budget.reserved_bytes(), 0u);
  EXPECT_EQ(r.range->mapped_pages, 0u);
  r.check();
  r.sim->set_capacity(64 * MiB);
  r.wake();
  EXPECT_TRUE(r.accessible(t.c));
  r.check();
}

TEST(TagSleeper, AFailurePartWayIsRolledBackToAwakeWithTheContentsBack) {
  sleeper_rig r(rig_options(64 * MiB, /*host_memory=*/true));
  const three_blocks t(r);
  std::byte* h = r.sim->host_view(reinterpret_cast<void*>(t.c->addr), t.c->size);
  ASSERT_NE(h, nullptr);
  std::memset(h, 0x5a, t.c->size);
  // The third unmap fails: evict has released some pages and not others.
  r.sim->fail_nth(sim_call::unmap, 3);
  try {
    r.sleep(/*keep=*/true);
    ADD_FAILURE() << "the injected failure did not reach sleep";
  } catch (const cuda_error& e) {
    EXPECT_NE(std::string(e.what()).find("rolled back: it stays awake"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(r.sleeper.asleep(k_domain));
  EXPECT_TRUE(r.sleeper.records().empty());
  EXPECT_TRUE(r.accessible(t.a));
  EXPECT_TRUE(r.accessible(t.b));
  EXPECT_TRUE(r.accessible(t.c));
  h = r.sim->host_view(reinterpret_cast<void*>(t.c->addr), t.c->size);
  ASSERT_NE(h, nullptr);
  EXPECT_TRUE(std::all_of(h, h + t.c->size, [](std::byte x) { return x == std::byte{0x5a}; }));
  // The pinned buffer is kept as the next sleep's spare.
  EXPECT_EQ(r.spare(), 7 * MiB);
  r.check();
  // And the domain sleeps and wakes as before.
  r.sleep(false);
  EXPECT_EQ(r.budget.reserved_bytes(), 0u);
  r.wake();
  EXPECT_EQ(r.budget.reserved_bytes(), 4 * k_page);
  r.check();
}

TEST(TagSleeper, CheckInvariantsCatchesARecordThatDisagreesWithTheBlocks) {
  sleeper_rig r;
  const three_blocks t(r);
  r.sleep(false);
  r.check();
  // A block the record does not know of (as if carved while asleep): the check names it.
  r.blocks[20 * MiB] = std::make_unique<block>();
  block* extra = r.blocks[20 * MiB].get();
  extra->addr = r.range->base + 20 * MiB;
  extra->size = k_page;
  extra->seg = &r.seg;
  extra->state = block_state::allocated;
  r.relink();
  try {
    r.check();
    ADD_FAILURE() << "the check missed a page the record does not count";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("record says 8388608 sleeping bytes, its blocks touch 5"),
              std::string::npos)
        << e.what();
  }
  r.blocks.erase(20 * MiB);
  r.relink();
  r.check();
  r.wake();
  (void)t;
}

}  // namespace
}  // namespace cucache::test
