// whole_vm_segments on its own, on the simulated device: a budget, a pool table and segments made
// by hand in one pool of a sleep domain, so that every expectation is about the part's device
// steps -- what create reserves, maps and charges; what release and map give back and take again,
// with the pool's statistics; and what each failure part way leaves (whole_vm_segments.hpp).
#include "allocator/whole_vm_segments.hpp"

#include <gtest/gtest.h>

#include <deque>
#include <memory>
#include <vector>

#include "allocator/device_budget.hpp"
#include "allocator/pool_table.hpp"
#include "allocator/stream_pool.hpp"
#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

using detail::pool_kind;
using detail::segment;

constexpr std::size_t k_page = 2 * MiB;
constexpr std::uint32_t k_domain = 3;

struct whole_vm_rig {
  explicit whole_vm_rig(std::size_t capacity = 64 * MiB, std::size_t limit = 0)
      : sim(std::make_shared<sim_backend>(sized(capacity))),
        budget(capacity, limit, 0),
        pools(*sim),
        pool(pools.pool_for(nullptr, pools.stream_key(nullptr), k_domain)) {}

  /// A segment of `bytes` made by create and entered in the pool's statistics, as new_segment
  /// does.
  segment* make(std::size_t bytes) {
    std::uint64_t phys = 0;
    void* va = vm.create(bytes, phys);
    EXPECT_NE(va, nullptr);
    segment& s = segs.emplace_back();
    s.base = reinterpret_cast<std::uintptr_t>(va);
    s.size = bytes;
    s.kind = pool_kind::large;
    s.owner = &pool;
    s.whole_vm = true;
    s.phys = phys;
    detail::pool_table::all_locked all(pools);
    detail::pool_table::assert_locked(pool);
    pool.stats.reserved_bytes.inc(pool_kind::large, static_cast<std::int64_t>(bytes));
    pool.stats.segment_count.inc(pool_kind::large, 1);
    return &s;
  }
  std::int64_t pool_reserved() {
    detail::pool_table::all_locked all(pools);
    detail::pool_table::assert_locked(pool);
    return pool.stats.reserved_bytes[0].current;
  }
  std::int64_t pool_segments() {
    detail::pool_table::all_locked all(pools);
    detail::pool_table::assert_locked(pool);
    return pool.stats.segment_count[0].current;
  }
  std::size_t release(const std::vector<segment*>& v, bool& synchronize) {
    detail::pool_table::all_locked all(pools);
    return vm.release(v, synchronize);
  }
  bool map(const std::vector<segment*>& v) {
    detail::pool_table::all_locked all(pools);
    return vm.map(v);
  }

  std::shared_ptr<sim_backend> sim;
  detail::device_budget budget;
  detail::pool_table pools;
  detail::stream_pool& pool;
  detail::whole_vm_segments vm{*sim, budget};
  std::deque<segment> segs;
};

TEST(WholeVmSegments, CreateReservesMapsAndChargesOneRangeAndDestroyGivesItAllBack) {
  whole_vm_rig r;
  segment* s = r.make(3 * k_page);
  EXPECT_EQ(r.budget.reserved_bytes(), 3 * k_page);
  EXPECT_EQ(r.sim->live_reservations(), 1U);
  EXPECT_EQ(r.sim->live_handles(), 1U);
  EXPECT_EQ(r.sim->live_mappings(), 1U);
  EXPECT_EQ(r.sim->inaccessible_mappings(), 0U);
  EXPECT_EQ(r.sim->used_bytes(), 3 * k_page);

  r.vm.destroy(*s);
  EXPECT_TRUE(s->unmapped);
  EXPECT_EQ(r.sim->live_reservations(), 0U);
  EXPECT_EQ(r.sim->live_handles(), 0U);
  EXPECT_EQ(r.sim->live_mappings(), 0U);
  EXPECT_EQ(r.sim->used_bytes(), 0U);
  EXPECT_EQ(r.budget.reserved_bytes(), 3 * k_page) << "destroy is not charged: the caller refunds";
}

TEST(WholeVmSegments, UndoCreateRefundsAndLeavesNothing) {
  whole_vm_rig r;
  std::uint64_t phys = 0;
  void* va = r.vm.create(k_page, phys);
  ASSERT_NE(va, nullptr);
  r.vm.undo_create(va, k_page, phys);
  EXPECT_EQ(r.budget.reserved_bytes(), 0U);
  EXPECT_EQ(r.sim->live_reservations(), 0U);
  EXPECT_EQ(r.sim->live_handles(), 0U);
  EXPECT_EQ(r.sim->live_mappings(), 0U);
}

TEST(WholeVmSegments, DestroyOfAnAsleepSegmentFreesOnlyItsRange) {
  whole_vm_rig r;
  segment* s = r.make(k_page);
  bool sync = false;
  EXPECT_EQ(r.release({s}, sync), k_page);
  const std::uint64_t releases = r.sim->calls(sim_call::phys_release);
  r.vm.destroy(*s);
  EXPECT_EQ(r.sim->calls(sim_call::phys_release), releases) << "its handle went at release";
  EXPECT_EQ(r.sim->live_reservations(), 0U);
}

// Every step of create refused in turn: nothing is left behind and nothing is charged. The
// device's and the address space's refusals are an empty answer; a failed map or access throws.
TEST(WholeVmSegments, CreateRefusedAtAnyStepLeavesNothing) {
  for (const sim_call step :
       {sim_call::va_reserve, sim_call::phys_create, sim_call::map, sim_call::set_access}) {
    SCOPED_TRACE(static_cast<int>(step));
    whole_vm_rig r;
    r.sim->fail_nth(step, 1);
    std::uint64_t phys = 0;
    if (step == sim_call::va_reserve || step == sim_call::phys_create) {
      EXPECT_EQ(r.vm.create(k_page, phys), nullptr);
    } else {
      EXPECT_THROW((void)r.vm.create(k_page, phys), cuda_error);
    }
    EXPECT_EQ(r.budget.reserved_bytes(), 0U);
    EXPECT_EQ(r.sim->live_reservations(), 0U);
    EXPECT_EQ(r.sim->live_handles(), 0U);
    EXPECT_EQ(r.sim->live_mappings(), 0U);
    // And the next create succeeds.
    EXPECT_NE(r.vm.create(k_page, phys), nullptr);
    EXPECT_EQ(r.budget.reserved_bytes(), k_page);
  }
}

TEST(WholeVmSegments, CreatePastTheLimitAsksNothingOfTheDevice) {
  whole_vm_rig r(64 * MiB, 4 * MiB);
  std::uint64_t phys = 0;
  EXPECT_EQ(r.vm.create(3 * k_page, phys), nullptr);
  EXPECT_EQ(r.sim->calls(sim_call::va_reserve), 0U);
  EXPECT_EQ(r.budget.reserved_bytes(), 0U);
  EXPECT_NE(r.vm.create(2 * k_page, phys), nullptr);
}

TEST(WholeVmSegments, ReleaseThenMapKeepsTheAddressesAndTheAccounts) {
  whole_vm_rig r;
  segment* a = r.make(k_page);
  segment* b = r.make(2 * k_page);
  const std::uintptr_t a_base = a->base;
  const std::uintptr_t b_base = b->base;

  bool sync = true;
  EXPECT_EQ(r.release({a, b}, sync), 3 * k_page);
  EXPECT_FALSE(sync) << "the synchronization was done, once";
  EXPECT_EQ(r.sim->calls(sim_call::device_synchronize), 1U);
  EXPECT_TRUE(a->unmapped);
  EXPECT_TRUE(b->unmapped);
  EXPECT_EQ(r.budget.reserved_bytes(), 0U);
  EXPECT_EQ(r.sim->live_handles(), 0U);
  EXPECT_EQ(r.sim->live_mappings(), 0U);
  EXPECT_EQ(r.sim->live_reservations(), 2U) << "the addresses stay reserved";
  EXPECT_EQ(r.pool_reserved(), 0);
  EXPECT_EQ(r.pool_segments(), 0);

  // Released again: nothing mapped, so no synchronization and nothing released.
  sync = true;
  EXPECT_EQ(r.release({a, b}, sync), 0U);
  EXPECT_TRUE(sync);
  EXPECT_EQ(r.sim->calls(sim_call::device_synchronize), 1U);

  EXPECT_TRUE(r.map({a, b}));
  EXPECT_FALSE(a->unmapped);
  EXPECT_FALSE(b->unmapped);
  EXPECT_EQ(a->base, a_base);
  EXPECT_EQ(b->base, b_base);
  EXPECT_EQ(r.budget.reserved_bytes(), 3 * k_page);
  EXPECT_EQ(r.sim->live_handles(), 2U);
  EXPECT_EQ(r.sim->live_mappings(), 2U);
  EXPECT_EQ(r.sim->inaccessible_mappings(), 0U);
  EXPECT_EQ(r.pool_reserved(), static_cast<std::int64_t>(3 * k_page));
  EXPECT_EQ(r.pool_segments(), 2);

  // Mapped again: a no-op.
  EXPECT_TRUE(r.map({a, b}));
  EXPECT_EQ(r.sim->live_handles(), 2U);
}

TEST(WholeVmSegments, AFailedHandleReleaseMapsTheSegmentBack) {
  whole_vm_rig r;
  segment* a = r.make(k_page);
  segment* b = r.make(k_page);
  r.sim->fail_nth(sim_call::phys_release, 2);  // b's
  bool sync = false;
  EXPECT_THROW(r.release({a, b}, sync), cuda_error);
  EXPECT_TRUE(a->unmapped) << "done before the failure: stays released";
  EXPECT_FALSE(b->unmapped) << "mapped back: as it was";
  EXPECT_EQ(r.budget.reserved_bytes(), k_page);
  EXPECT_EQ(r.sim->live_handles(), 1U);
  EXPECT_EQ(r.sim->live_mappings(), 1U);
  EXPECT_EQ(r.sim->inaccessible_mappings(), 0U);
  EXPECT_EQ(r.pool_reserved(), static_cast<std::int64_t>(k_page));
  EXPECT_EQ(r.pool_segments(), 1);
}

TEST(WholeVmSegments, WhenMappingBackFailsTooTheSegmentStaysUnmappedWithItsHandleCharged) {
  whole_vm_rig r;
  segment* a = r.make(k_page);
  r.sim->fail_nth(sim_call::phys_release, 1);
  r.sim->fail_nth(sim_call::map, 1);
  bool sync = false;
  EXPECT_THROW(r.release({a}, sync), cuda_error);
  EXPECT_TRUE(a->unmapped);
  EXPECT_EQ(r.sim->live_handles(), 1U) << "the handle is still held";
  EXPECT_EQ(r.sim->live_mappings(), 0U);
  EXPECT_EQ(r.budget.reserved_bytes(), k_page) << "and still charged";
  EXPECT_EQ(r.pool_reserved(), 0) << "the pool holds no memory of it";
  EXPECT_EQ(r.pool_segments(), 0);
}

TEST(WholeVmSegments, MapStopsAtTheLimitKeepingWhatItMapped) {
  whole_vm_rig r(64 * MiB, 0);
  segment* a = r.make(k_page);
  segment* b = r.make(k_page);
  bool sync = false;
  ASSERT_EQ(r.release({a, b}, sync), 2 * k_page);
  r.budget.set_limit(k_page);
  EXPECT_FALSE(r.map({a, b}));
  EXPECT_FALSE(a->unmapped);
  EXPECT_TRUE(b->unmapped);
  EXPECT_EQ(r.budget.reserved_bytes(), k_page);
  EXPECT_EQ(r.sim->live_handles(), 1U);
  EXPECT_EQ(r.pool_reserved(), static_cast<std::int64_t>(k_page));
  EXPECT_EQ(r.pool_segments(), 1);
}

TEST(WholeVmSegments, AFailedMapOrAccessChangesNothingOfTheFailingSegment) {
  for (const sim_call step : {sim_call::map, sim_call::set_access}) {
    SCOPED_TRACE(static_cast<int>(step));
    whole_vm_rig r;
    segment* a = r.make(k_page);
    bool sync = false;
    ASSERT_EQ(r.release({a}, sync), k_page);
    r.sim->fail_nth(step, 1);
    EXPECT_THROW((void)r.map({a}), cuda_error);
    EXPECT_TRUE(a->unmapped);
    EXPECT_EQ(r.budget.reserved_bytes(), 0U);
    EXPECT_EQ(r.sim->live_handles(), 0U);
    EXPECT_EQ(r.sim->live_mappings(), 0U);
    EXPECT_EQ(r.pool_reserved(), 0);
    EXPECT_TRUE(r.map({a}));  // and the next try maps it
    EXPECT_EQ(r.pool_reserved(), static_cast<std::int64_t>(k_page));
  }
}

}  // namespace
}  // namespace cucache::test
