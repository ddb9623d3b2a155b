// Expandable segments: what only the simulated device can check -- the device calls it counts,
// exact page mappings (one handle per page), reuse of unmapped handles, compaction under a limit,
// injected failures of every VM call, contents that survive pages being moved, and a device without
// virtual memory. The rules of expandable mode that hold on any device are in the typed suite,
// allocator_suite.cpp, which runs them on the simulated device and on a real GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

#include "allocator/churn_script.hpp"
#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

// One handle per page: the mechanics this file counts exactly. Coarse handles (the default in
// expandable mode) have their own tests below and in pager_test.cpp.
config expandable() {
  return parse_config("expandable_segments:True,coarse_handles:0");
}

TEST(Expandable, MapsOnlyTheMissingPagesOneHandlePerPage) {
  sim_allocator a(expandable());
  void* p = a.alloc.allocate(3 * MiB);  // pages 0-1 of the large range
  auto s = a.stats();
  EXPECT_EQ(a.sim->calls(sim_call::va_reserve), 1u);
  // Every page gets a handle of its own: an idle page then pins nothing but itself.
  EXPECT_EQ(s.device_alloc_count, 2u);
  EXPECT_EQ(s.vm_map_count, 2u);
  // Both handles get access in one call: they are adjacent, and a set-access may span mappings.
  EXPECT_EQ(a.sim->calls(sim_call::set_access), 1u);
  EXPECT_TRUE(a.sim->accessible(p, 3 * MiB));
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(4 * MiB));
  void* q = a.alloc.allocate(3 * MiB);  // [3, 6) MiB: page 1 is mapped, page 2 is not
  EXPECT_EQ(addr(q), addr(p) + 3 * MiB);
  s = a.stats();
  EXPECT_EQ(s.device_alloc_count, 3u);
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(6 * MiB));
  a.alloc.deallocate(p);
  void* r = a.alloc.allocate(MiB + MiB / 2);  // the hole at page 0: no device call at all
  EXPECT_EQ(r, p);
  EXPECT_EQ(a.stats().device_alloc_count, 3u);
  EXPECT_EQ(a.stats().vm_map_count, 3u);
  // A 10-page run at [6, 26) MiB: ten handles, ten maps, one set-access.
  void* big = a.alloc.allocate(20 * MiB);
  EXPECT_EQ(addr(big), addr(q) + 3 * MiB);
  EXPECT_EQ(a.stats().device_alloc_count, 13u);
  EXPECT_EQ(a.stats().vm_map_count, 13u);
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(26 * MiB));
  EXPECT_EQ(a.sim->calls(sim_call::set_access), 3u);  // one per block that mapped anything
  EXPECT_EQ(a.sim->inaccessible_mappings(), 0u);
  a.alloc.check_invariants();
  expect_no_leak(a);
}

// coarse_handles:8 (docs/config.md): while half the device is to spare beyond a growth, a block's
// whole pages get handles of up to 8 pages, and a later block that uses part of an idle one uses
// it as it is; on a device without that room, one handle per page as without the key.
TEST(Expandable, CoarseHandlesWhilePlentifulAndOneHandlePerPageWithoutRoom) {
  sim_allocator a(parse_config("expandable_segments:True,coarse_handles:8"));
  void* p = a.alloc.allocate(20 * MiB);  // pages 0-9, all whole: handles of 8 and 2 pages
  EXPECT_EQ(a.stats().device_alloc_count, 2u);
  EXPECT_EQ(a.stats().vm_map_count, 2u);
  EXPECT_EQ(a.sim->calls(sim_call::set_access), 1u);
  EXPECT_TRUE(a.sim->accessible(p, 20 * MiB));
  a.alloc.deallocate(p);
  const std::uint64_t maps = a.sim->calls(sim_call::map);
  void* q = a.alloc.allocate(6 * MiB);  // pages 0-2: part of the idle 8-page handle, kept
  EXPECT_EQ(q, p);
  EXPECT_EQ(a.sim->calls(sim_call::map), maps);
  EXPECT_EQ(a.sim->calls(sim_call::unmap), 0u);
  EXPECT_EQ(a.sim->calls(sim_call::device_synchronize), 0u);
  EXPECT_EQ(a.stats().device_alloc_count, 2u);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(20 * MiB));
  a.alloc.check_invariants();
  expect_no_leak(a);
  a.alloc.deallocate(q);
  a.alloc.empty_cache();
  EXPECT_EQ(a.reserved(), 0);
  EXPECT_EQ(a.sim->live_handles(), 0u);
  a.alloc.check_invariants();

  sim_options small;
  small.capacity_bytes = 32 * MiB;  // 20 MiB + half of 32 do not fit
  sim_allocator b(parse_config("expandable_segments:True,coarse_handles:8"), small);
  (void)b.alloc.allocate(20 * MiB);
  EXPECT_EQ(b.stats().device_alloc_count, 10u);
  b.alloc.check_invariants();
  expect_no_leak(b);
}

/// PyTorch's SEGMENT_MAP / SEGMENT_UNMAP (NCCL's user-buffer registration listens to them): a
/// map event for each run of pages given access at once, after the access; an unmap event for
/// each accessible mapping, before it goes; none for segments (expandable mode has none).
TEST(Expandable, ObserverIsToldOfEveryAccessibleMappingAndItsUnmap) {
  struct event {
    char kind;  // 'm' map, 'u' unmap, 'a' segment alloc, 'f' segment free
    std::uintptr_t base;
    std::size_t bytes;
    bool accessible_then;
  };
  struct recorder final : allocation_observer {
    std::shared_ptr<sim_backend> sim;
    std::vector<event> events;
    void on_allocate(const void*, std::size_t, stream_handle) noexcept override {}
    void on_free(const void*, std::size_t, stream_handle) noexcept override {}
    void on_failure(std::size_t, stream_handle) noexcept override {}
    void on_segment_alloc(std::uintptr_t b, std::size_t n, stream_handle) noexcept override {
      events.push_back({'a', b, n, false});
    }
    void on_segment_free(std::uintptr_t b, std::size_t n, stream_handle) noexcept override {
      events.push_back({'f', b, n, false});
    }
    void on_segment_map(std::uintptr_t b, std::size_t n, stream_handle) noexcept override {
      events.push_back({'m', b, n, sim->accessible(reinterpret_cast<void*>(b), n)});
    }
    void on_segment_unmap(std::uintptr_t b, std::size_t n, stream_handle) noexcept override {
      events.push_back({'u', b, n, sim->accessible(reinterpret_cast<void*>(b), n)});
    }
  };
  sim_allocator a(expandable());
  auto rec = std::make_shared<recorder>();
  rec->sim = a.sim;
  a.alloc.attach_observer(rec);
  void* p = a.alloc.allocate(3 * MiB);  // pages 0-1: one run, one event
  ASSERT_EQ(rec->events.size(), 1u);
  EXPECT_EQ(rec->events[0].kind, 'm');
  EXPECT_EQ(rec->events[0].base, addr(p));
  EXPECT_EQ(rec->events[0].bytes, 4 * MiB);
  EXPECT_TRUE(rec->events[0].accessible_then);
  void* q = a.alloc.allocate(3 * MiB);  // [3, 6) MiB: only page 2 is new
  ASSERT_EQ(rec->events.size(), 2u);
  EXPECT_EQ(rec->events[1].kind, 'm');
  EXPECT_EQ(rec->events[1].base, addr(p) + 4 * MiB);
  EXPECT_EQ(rec->events[1].bytes, 2 * MiB);
  void* r = a.alloc.allocate(3 * MiB);  // [6, 9) MiB: pages 3-4, one run
  ASSERT_EQ(rec->events.size(), 3u);
  EXPECT_EQ(rec->events[2].base, addr(r));
  EXPECT_EQ(rec->events[2].bytes, 4 * MiB);
  std::size_t mapped = 0;
  for (const event& e : rec->events) mapped += e.bytes;
  EXPECT_EQ(mapped, static_cast<std::size_t>(a.reserved()));
  a.alloc.deallocate(p);
  a.alloc.deallocate(q);
  a.alloc.deallocate(r);
  a.alloc.empty_cache();
  EXPECT_EQ(a.reserved(), 0);
  std::size_t unmapped = 0;
  for (std::size_t i = 3; i < rec->events.size(); ++i) {
    EXPECT_EQ(rec->events[i].kind, 'u') << i;
    EXPECT_TRUE(rec->events[i].accessible_then) << i;  // told before the unmap
    unmapped += rec->events[i].bytes;
  }
  EXPECT_EQ(unmapped, mapped);
  for (const event& e : rec->events) {
    EXPECT_NE(e.kind, 'a');
    EXPECT_NE(e.kind, 'f');
  }
  a.alloc.check_invariants();
  expect_no_leak(a);
}

/// A block over [0, 10) MiB of the large range whose page 2 is an idle mapping with access and
/// whose pages 0-1 and 3-4 are unmapped, nothing reusable cached: backing it maps four handles,
/// a run of two on each side of page 2.
void make_hole_around_a_mapped_page(sim_allocator& a) {
  void* x = a.alloc.allocate(4 * MiB);  // pages 0-1
  void* y = a.alloc.allocate(2 * MiB);  // page 2
  void* z = a.alloc.allocate(4 * MiB);  // pages 3-4
  ASSERT_EQ(addr(y), addr(x) + 4 * MiB);
  ASSERT_EQ(addr(z), addr(y) + 2 * MiB);
  a.alloc.deallocate(x);
  a.alloc.deallocate(z);
  a.alloc.empty_cache();  // pages 0-1 and 3-4 unmapped and released; page 2 stays (y is live)
  a.alloc.deallocate(y);
  ASSERT_EQ(a.sim->live_mappings(), 1u);
  ASSERT_EQ(a.sim->live_handles(), 1u);
}

TEST(Expandable, SetAccessCoversEachRunOfNewMappingsOnceAndLeavesMappedPagesAlone) {
  sim_allocator a(expandable());
  make_hole_around_a_mapped_page(a);
  const std::uint64_t maps = a.sim->calls(sim_call::map);
  const std::uint64_t access = a.sim->calls(sim_call::set_access);
  void* p = a.alloc.allocate(10 * MiB);  // page 2 is used in place
  EXPECT_EQ(a.sim->calls(sim_call::map), maps + 4);
  // Two runs of new mappings, split by page 2, which already has access (work may be using a
  // mapping that has access: it is not set again).
  EXPECT_EQ(a.sim->calls(sim_call::set_access), access + 2);
  EXPECT_TRUE(a.sim->accessible(p, 10 * MiB));
  EXPECT_EQ(a.sim->inaccessible_mappings(), 0u);
  a.alloc.check_invariants();
  a.alloc.deallocate(p);
  expect_no_leak(a);
}

// A failure in the middle of a batch -- the second map, or the second set-access of two -- leaves
// no half-mapped block: what the batch mapped and could not give access to is unmapped again and
// its handle kept for reuse; what got access stays mapped, idle. Nothing leaks, and the next
// allocation succeeds.
TEST(Expandable, AFailureInTheMiddleOfABatchLeavesNoHalfMappedBlock) {
  for (sim_call kind : {sim_call::map, sim_call::set_access}) {
    SCOPED_TRACE(to_string(kind));
    sim_allocator a(expandable());
    make_hole_around_a_mapped_page(a);
    a.sim->fail_nth(kind, 2);
    EXPECT_THROW((void)a.alloc.allocate(10 * MiB), cuda_error);
    EXPECT_EQ(a.stats().allocation_count[0].current, 0);
    EXPECT_EQ(a.sim->inaccessible_mappings(), 0u);
    // map #2 failed: page 0's handle was unmapped again, page 1's never mapped; both kept.
    // set_access #2 failed: pages 0-1 have access and stay mapped (idle); pages 3-4 were
    // unmapped again, their handles kept.
    const bool map_failed = kind == sim_call::map;
    EXPECT_EQ(a.sim->live_mappings(), map_failed ? 1u : 3u);
    EXPECT_EQ(a.sim->live_handles(), map_failed ? 3u : 5u);
    EXPECT_EQ(a.stats().unmapped_handle_bytes, 4 * MiB);
    a.alloc.check_invariants();
    expect_no_leak(a);
    const std::uint64_t creates = a.sim->calls(sim_call::phys_create);
    void* p = a.alloc.allocate(10 * MiB);  // the kept handles first: only the rest is created
    EXPECT_EQ(a.sim->calls(sim_call::phys_create), creates + (map_failed ? 2 : 0));
    EXPECT_TRUE(a.sim->accessible(p, 10 * MiB));
    a.alloc.check_invariants();
    a.alloc.deallocate(p);
    a.alloc.empty_cache();
    EXPECT_EQ(a.sim->live_handles(), 0u);
    EXPECT_EQ(a.sim->live_mappings(), 0u);
  }
}

// The set-access fails and so does the unmap that would undo the map: the mapping stays recorded,
// idle and without access, so that its handle is not lost; the next block over it grants access.
TEST(Expandable, AMappingWhoseUndoFailedGetsAccessWhenABlockUsesIt) {
  sim_allocator a(expandable());
  make_hole_around_a_mapped_page(a);
  a.sim->fail_nth(sim_call::set_access, 1);
  a.sim->fail_nth(sim_call::unmap, 1);
  EXPECT_THROW((void)a.alloc.allocate(10 * MiB), cuda_error);
  EXPECT_EQ(a.sim->inaccessible_mappings(), 1u);  // pages 0-1: its undo failed
  EXPECT_EQ(a.sim->live_mappings(), 2u);
  a.alloc.check_invariants();
  expect_no_leak(a);
  void* p = a.alloc.allocate(10 * MiB);
  EXPECT_TRUE(a.sim->accessible(p, 10 * MiB));
  EXPECT_EQ(a.sim->inaccessible_mappings(), 0u);
  a.alloc.check_invariants();
  a.alloc.deallocate(p);
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->live_handles(), 0u);
}

TEST(Expandable, AnIdlePagePinsNothingButItself) {
  // Ten idle pages, of which a new block uses two in place; under a limit the other eight are
  // moved, page by page, to where the next block needs them: reserved memory is exactly the
  // pages live blocks touch (the floor), and nothing is split or released.
  sim_allocator a(parse_config("expandable_segments:True,memory_limit:24MiB"));
  void* x = a.alloc.allocate(20 * MiB);  // pages 0-9: ten one-page handles
  void* y = a.alloc.allocate(2 * MiB);   // page 10
  a.alloc.deallocate(x);
  void* z = a.alloc.allocate(4 * MiB);  // pages 0-1, used in place: no VM call
  EXPECT_EQ(z, x);
  auto s = a.stats();
  EXPECT_EQ(s.device_alloc_count, 11u);
  EXPECT_EQ(s.vm_map_count, 11u);
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(22 * MiB));
  // 18 MiB do not fit the 16 MiB hole: pages 11-19. Creating them would pass the limit, so the
  // eight idle pages 2-9 move there and the ninth is created (22 + 2 = 24 MiB).
  void* w = a.alloc.allocate(18 * MiB);
  EXPECT_EQ(addr(w), addr(y) + 2 * MiB);
  s = a.stats();
  EXPECT_EQ(s.stitched_pages, 8u);
  EXPECT_EQ(s.device_alloc_count, 12u);
  EXPECT_EQ(s.device_free_count, 0u);
  EXPECT_EQ(s.vm_split_count, 0u);
  EXPECT_EQ(s.alloc_retry_count, 0u);
  EXPECT_EQ(s.vm_sync_count, 1u);  // one synchronization covers every page idle before it
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(24 * MiB));
  EXPECT_EQ(s.reserved_bytes[0].peak, static_cast<std::int64_t>(24 * MiB));
  a.alloc.check_invariants();
  expect_no_leak(a);
}

TEST(Expandable, SplitsFreelyAndIgnoresTheSplitCap) {
  sim_allocator a(parse_config("expandable_segments:True,max_split_size_mb:64"));
  void* p = a.alloc.allocate(19 * MiB);  // a cudaMalloc'd segment would waste 1 MiB here
  EXPECT_EQ(a.alloc.allocation_size(p), 19 * MiB);
  a.alloc.deallocate(p);
  void* q = a.alloc.allocate(100 * MiB);
  a.alloc.deallocate(q);
  void* r = a.alloc.allocate(30 * MiB);  // takes the front of the 100 MiB hole
  EXPECT_EQ(r, p);
  EXPECT_EQ(a.stats().reserved_bytes[0].peak, static_cast<std::int64_t>(100 * MiB));
  a.alloc.check_invariants();
}

TEST(Expandable, IdlePagesStayMappedWhileMemoryIsPlentiful) {
  sim_allocator a(expandable());
  void* x = a.alloc.allocate(8 * MiB);   // pages 0-3
  void* y = a.alloc.allocate(8 * MiB);   // pages 4-7
  a.alloc.deallocate(x);                 // pages 0-3 idle
  void* z = a.alloc.allocate(16 * MiB);  // pages 8-15: created, x's pages stay where they are
  EXPECT_EQ(addr(z), addr(y) + 8 * MiB);
  auto s = a.stats();
  EXPECT_EQ(s.stitched_pages, 0u);
  EXPECT_EQ(s.vm_unmap_count, 0u);
  EXPECT_EQ(s.device_alloc_count, 16u);
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(32 * MiB));
  EXPECT_EQ(a.sim->calls(sim_call::device_synchronize), 0u);
  // The program comes back for x's pages: mapped, no call at all.
  const std::uint64_t maps = a.sim->calls(sim_call::map);
  void* x2 = a.alloc.allocate(8 * MiB);
  EXPECT_EQ(x2, x);
  EXPECT_EQ(a.sim->calls(sim_call::map), maps);
  EXPECT_EQ(a.stats().device_alloc_count, 16u);
  a.alloc.check_invariants();
  expect_no_leak(a);
}

// The loop of a training step, twice: once its pages are mapped, the second iteration makes no VM
// call, no device synchronization and does not ask the device for its free memory.
TEST(Expandable, ASteadyLoopMakesNoVmCallInItsSecondIteration) {
  sim_allocator a(expandable());
  void* weights = a.alloc.allocate(40 * MiB + 300 * KiB);
  auto step = [&] {
    std::vector<void*> acts;
    for (std::size_t i = 1; i <= 6; ++i) acts.push_back(a.alloc.allocate(i * 3 * MiB + 100 * KiB));
    void* grads = a.alloc.allocate(40 * MiB + 300 * KiB);
    for (auto it = acts.rbegin(); it != acts.rend(); ++it) a.alloc.deallocate(*it);
    void* scratch = a.alloc.allocate(25 * MiB);  // lands where activations were
    a.alloc.deallocate(scratch);
    a.alloc.deallocate(grads);
    a.alloc.check_invariants();
  };
  step();
  const auto calls = [&] {
    std::uint64_t n = 0;
    for (sim_call c :
         {sim_call::phys_create, sim_call::phys_release, sim_call::map, sim_call::unmap,
          sim_call::set_access, sim_call::device_synchronize, sim_call::mem_get_info}) {
      n += a.sim->calls(c);
    }
    return n;
  };
  const std::uint64_t after_first = calls();
  const auto reserved = a.stats().reserved_bytes[0].current;
  for (int i = 0; i < 3; ++i) step();
  EXPECT_EQ(calls(), after_first);
  EXPECT_EQ(a.stats().reserved_bytes[0].current, reserved);
  a.alloc.deallocate(weights);
  expect_no_leak(a);
}

// The same kind of loop under a memory limit that it reaches in its middle: creating would pass
// the limit, so the pages a step lacks are moved from idle ones, page by page, and reserved memory
// never passes the limit -- no out-of-memory, no ladder, no split.
TEST(Expandable, ALimitReachedMidLoopMovesIdleSinglePages) {
  for (const bool limited : {false, true}) {
    SCOPED_TRACE(limited ? "limit 24 MiB" : "no limit");
    sim_allocator a(limited ? parse_config("memory_limit:24MiB", expandable()) : expandable());
    auto step = [&] {
      void* p = a.alloc.allocate(8 * MiB);   // pages 0-3
      void* q = a.alloc.allocate(8 * MiB);   // pages 4-7
      a.alloc.deallocate(p);                 // 8 MiB hole
      void* r = a.alloc.allocate(12 * MiB);  // does not fit it: pages 8-13
      a.alloc.deallocate(q);
      a.alloc.deallocate(r);
      a.alloc.check_invariants();
      expect_no_leak(a);
    };
    step();
    const auto first = a.stats();
    step();
    const auto second = a.stats();
    EXPECT_EQ(second.alloc_retry_count, 0u);
    EXPECT_EQ(second.vm_split_count, 0u);
    EXPECT_EQ(second.oom_count, 0u);
    if (!limited) {  // 14 pages, all kept mapped: the second step makes no VM call
      EXPECT_EQ(second.reserved_bytes[0].peak, static_cast<std::int64_t>(28 * MiB));
      EXPECT_EQ(second.vm_map_count, first.vm_map_count);
      EXPECT_EQ(second.vm_unmap_count, 0u);
    } else {  // 12 pages at most: r's first two pages are a's, moved; each step moves again
      EXPECT_EQ(second.reserved_bytes[0].peak, static_cast<std::int64_t>(24 * MiB));
      EXPECT_EQ(first.stitched_pages, 2u);
      EXPECT_EQ(first.device_alloc_count, 12u);
      EXPECT_EQ(second.device_alloc_count, 12u);  // nothing created: every page moved
      EXPECT_GT(second.stitched_pages, first.stitched_pages);
      EXPECT_EQ(second.device_free_count, 0u);
    }
  }
}

TEST(Expandable, IdlePagesOfAnotherStreamServeAGrowingPoolWithoutTheLadder) {
  sim_options o;
  o.capacity_bytes = 24 * MiB;
  sim_allocator a(expandable(), o);
  void* p = a.alloc.allocate(8 * MiB, stream(1));
  a.alloc.deallocate(p);  // an idle 8 MiB mapping in stream 1's range
  // Stream 2 needs 20 MiB (10 pages); 8 + 20 > 24, so memory is not plentiful. Idle pages of
  // stream 1 are moved, one at a time, only until the rest may be created: after two, 8 + 16 <=
  // 24, and the other 8 pages are created. No out-of-memory ladder, nothing released.
  void* q = a.alloc.allocate(20 * MiB, stream(2));
  EXPECT_NE(q, nullptr);
  const auto s = a.stats();
  EXPECT_EQ(s.alloc_retry_count, 0u);
  EXPECT_EQ(s.device_alloc_count, 12u);
  EXPECT_EQ(s.device_free_count, 0u);
  EXPECT_EQ(s.vm_map_count, 14u);
  EXPECT_EQ(s.stitched_pages, 2u);
  EXPECT_EQ(s.shared_pages, 2u);
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(24 * MiB));
  a.alloc.check_invariants();
  expect_no_leak(a);
}

TEST(Expandable, FailedVmCallsLeaveNoHalfMappedBlockAndNoLeakedHandle) {
  // phys_release is covered by FailedReleaseInEmptyCacheKeepsTheHandleTracked: this allocation
  // releases nothing.
  for (sim_call kind :
       {sim_call::map, sim_call::set_access, sim_call::unmap, sim_call::device_synchronize}) {
    SCOPED_TRACE(to_string(kind));
    // Under the limit the next block's pages are moved, not created: every kind of call happens.
    sim_allocator a(parse_config("expandable_segments:True,memory_limit:24MiB"));
    void* x = a.alloc.allocate(8 * MiB);
    void* y = a.alloc.allocate(8 * MiB);
    a.alloc.deallocate(x);
    a.sim->fail_nth(kind, 1);
    const auto before = a.stats();
    const std::uint64_t calls_before = a.sim->calls(kind);
    bool threw = false;
    try {
      void* z =
          a.alloc.allocate(16 * MiB);  // needs a device sync, an unmap (stitch), a map, set_access
      a.alloc.deallocate(z);
    } catch (const cuda_error&) {
      threw = true;
      EXPECT_EQ(a.stats().allocation_count[0].current, before.allocation_count[0].current);
    }
    ASSERT_GT(a.sim->calls(kind), calls_before) << "the allocation never made that call";
    EXPECT_TRUE(threw) << "the injected failure did not surface";
    a.alloc.check_invariants();
    expect_no_leak(a);
    void* w = a.alloc.allocate(16 * MiB);  // works afterwards
    a.alloc.deallocate(w);
    a.alloc.deallocate(y);
    a.alloc.empty_cache();
    a.alloc.check_invariants();
    EXPECT_EQ(a.sim->live_handles(), 0u);
  }
}

TEST(Expandable, FailedReleaseInEmptyCacheKeepsTheHandleTracked) {
  sim_allocator a(expandable());
  void* p = a.alloc.allocate(8 * MiB);
  a.alloc.deallocate(p);
  a.sim->fail_nth(sim_call::phys_release, 1);
  EXPECT_THROW(a.alloc.empty_cache(), cuda_error);
  a.alloc.check_invariants();
  expect_no_leak(a);
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->live_handles(), 0u);
  EXPECT_EQ(a.stats().reserved_bytes[0].current, 0);
}

TEST(Expandable, ContentsSurviveStitching) {
  sim_options o;
  o.host_memory = true;
  o.capacity_bytes = 20 * MiB;  // z cannot be created whole: x's pages move
  sim_allocator a(expandable(), o);
  auto fill = [&](void* p, std::size_t n, std::byte v) {
    for (std::size_t off = 0; off < n; off += 2 * MiB) {
      const std::size_t len = std::min(n - off, 2 * MiB - (addr(p) + off) % (2 * MiB));
      std::byte* h = a.sim->host_view(static_cast<char*>(p) + off, len);
      ASSERT_NE(h, nullptr);
      std::fill(h, h + len, v);
      if (len < 2 * MiB - (addr(p) + off) % (2 * MiB)) break;
      off -= (2 * MiB - len);  // keep offsets page aligned after the first partial page
    }
  };
  auto check = [&](void* p, std::size_t n, std::byte v) {
    for (std::size_t off = 0; off < n; ++off) {
      const std::byte* h = a.sim->host_view(static_cast<char*>(p) + off, 1);
      ASSERT_NE(h, nullptr);
      ASSERT_EQ(*h, v) << "offset " << off;
    }
  };
  void* x = a.alloc.allocate(8 * MiB);
  void* y = a.alloc.allocate(6 * MiB);
  fill(x, 8 * MiB, std::byte{1});
  fill(y, 6 * MiB, std::byte{2});
  a.alloc.deallocate(x);
  void* z = a.alloc.allocate(12 * MiB);  // moves x's pages behind y
  EXPECT_GT(a.stats().stitched_pages, 0u);
  fill(z, 12 * MiB, std::byte{3});
  check(y, 6 * MiB, std::byte{2});
  check(z, 12 * MiB, std::byte{3});
  a.alloc.check_invariants();
}

// The churn of tests/gpu/expandable_gpu_test.cu (ChurnKeepsEveryBlocksContents), same seed, sizes
// and memory limit, on a device much larger than the limit: the limit, not the device, makes
// memory short, idle pages move where the wandering holes need them, and nothing runs out. The
// placement is the device's, so the GPU run makes the same moves. Without a limit this churn
// touches 1,288 MiB of pages; under 1,100 MiB it runs out (its live blocks' pages pass it); at
// 1,200 MiB it moves 596 pages.
TEST(Expandable, ChurnUnderALimitMovesPagesAndNeverRunsOut) {
  sim_options o;
  o.capacity_bytes = 8 * GiB;
  config cfg = expandable();
  cfg.memory_limit_bytes = 1200 * MiB;
  sim_allocator a(cfg, o);
  std::vector<void*> blocks;
  churn_script script;
  for (int op = 0; op < churn_script::k_steps; ++op) {
    const churn_script::step st = script.next(blocks.size());
    if (st.allocate) {
      void* p = a.alloc.allocate(st.bytes);
      ASSERT_NE(p, nullptr) << "op " << op;
      blocks.push_back(p);
    } else {
      a.alloc.deallocate(blocks[st.victim]);
      blocks[st.victim] = blocks.back();
      blocks.pop_back();
    }
    if (op % 100 == 0) a.alloc.check_invariants();
  }
  for (void* b : blocks) a.alloc.deallocate(b);
  const device_stats s = a.stats();
  EXPECT_GT(s.stitched_pages, 0u);
  EXPECT_EQ(s.oom_count, 0u);
  EXPECT_LE(s.reserved_bytes[0].peak, static_cast<std::int64_t>(1200 * MiB));
  a.alloc.check_invariants();
}

TEST(Expandable, SmallRequestsPackIntoTheSmallRange) {
  sim_allocator a(expandable());
  std::vector<void*> v;
  for (int i = 0; i < 4096; ++i) v.push_back(a.alloc.allocate(512));
  EXPECT_EQ(addr(v.back()), addr(v.front()) + 4095 * 512);
  EXPECT_EQ(a.stats().reserved_bytes[0].current, static_cast<std::int64_t>(2 * MiB));
  EXPECT_EQ(a.stats().reserved_bytes[1].current, static_cast<std::int64_t>(2 * MiB));
  for (void* p : v) a.alloc.deallocate(p);
  a.alloc.check_invariants();
}

TEST(Expandable, MemoryLimitReleasesIdleMemoryBeforeRefusing) {
  sim_allocator a(parse_config("expandable_segments:True,memory_limit:32MiB"));
  void* p = a.alloc.allocate(20 * MiB, stream(1));
  a.alloc.deallocate(p);
  void* q = a.alloc.allocate(30 * MiB, stream(2));  // ladder moves stream 1's idle pages
  EXPECT_NE(q, nullptr);
  EXPECT_LE(a.stats().reserved_bytes[0].peak, static_cast<std::int64_t>(32 * MiB));
  EXPECT_THROW((void)a.alloc.allocate(4 * MiB, stream(2)), out_of_memory);
  a.alloc.check_invariants();
  expect_no_leak(a);
}

TEST(Expandable, UnderALimitIdlePagesOfAnotherStreamMoveOneByOne) {
  // Stream 1 frees 254 MiB: 127 idle one-page handles (below pager::k_min_chunked_pages: no
  // chunks). Stream 2 then needs 8 MiB under a 256 MiB limit: memory is short, so idle pages of
  // stream 1 are moved until the rest may be created (three, then 254 + 2 <= 256), and the fourth
  // page is created. Nothing is released, nothing goes through the out-of-memory ladder.
  sim_allocator a(parse_config("expandable_segments:True,memory_limit:256MiB"));
  void* big = a.alloc.allocate(254 * MiB, stream(1));
  a.alloc.deallocate(big);
  void* q = a.alloc.allocate(8 * MiB, stream(2));
  ASSERT_NE(q, nullptr);
  const auto s = a.stats();
  EXPECT_EQ(s.alloc_retry_count, 0u);
  EXPECT_EQ(s.vm_reclaim_count, 0u);
  EXPECT_EQ(s.device_alloc_count, 128u);
  EXPECT_EQ(s.device_free_count, 0u);
  EXPECT_EQ(s.shared_pages, 3u);
  EXPECT_EQ(s.vm_sync_count, 1u);  // the pages went idle before that one sync
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(256 * MiB));
  EXPECT_EQ(s.reserved_bytes[0].peak, static_cast<std::int64_t>(256 * MiB));
  a.alloc.check_invariants();
  expect_no_leak(a);
}

TEST(Expandable, UnderALimitAMoveThatMeetsAnIdleChunkReleasesItWhole) {
  // Stream 1 frees 256 MiB: pager::k_min_chunked_pages whole pages, so four chunks of 32 pages.
  // Stream 2 then needs 8 MiB under a 258 MiB limit: memory is short, and the least recently idle
  // page is a chunk's, which cannot move (a handle maps whole): the chunk is unmapped and
  // released (64 MiB of room), and the four pages are created.
  sim_allocator a(parse_config("expandable_segments:True,memory_limit:258MiB"));
  void* big = a.alloc.allocate(256 * MiB, stream(1));
  EXPECT_EQ(a.stats().device_alloc_count, 4u);
  a.alloc.deallocate(big);
  void* q = a.alloc.allocate(8 * MiB, stream(2));
  ASSERT_NE(q, nullptr);
  const auto s = a.stats();
  EXPECT_EQ(s.alloc_retry_count, 0u);
  EXPECT_EQ(s.vm_reclaim_count, 0u);
  EXPECT_EQ(s.device_alloc_count, 8u);
  EXPECT_EQ(s.device_free_count, 1u);
  EXPECT_EQ(s.shared_pages, 0u);
  EXPECT_EQ(s.vm_sync_count, 1u);
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(200 * MiB));
  EXPECT_EQ(s.reserved_bytes[0].peak, static_cast<std::int64_t>(256 * MiB));
  a.alloc.check_invariants();
  expect_no_leak(a);
}

TEST(Expandable, FailedVmCallsDuringCompactionLeaveNoHalfMappedBlockAndNoLeakedHandle) {
  for (sim_call kind : {sim_call::device_synchronize, sim_call::unmap, sim_call::phys_release,
                        sim_call::phys_create, sim_call::map, sim_call::set_access}) {
    for (std::uint64_t nth = 1; nth <= 3; ++nth) {
      SCOPED_TRACE(std::string(to_string(kind)) + " #" + std::to_string(nth));
      sim_allocator a(parse_config("expandable_segments:True,memory_limit:258MiB"));
      void* big = a.alloc.allocate(256 * MiB, stream(1));
      a.alloc.deallocate(big);
      a.sim->fail_nth(kind, nth);
      void* q = nullptr;
      try {
        q = a.alloc.allocate(8 * MiB, stream(2));
      } catch (const cuda_error&) {
      } catch (const out_of_memory&) {
      }
      a.sim->fail_nth(kind, 0);  // an injection the allocation did not reach stays off
      a.alloc.check_invariants();
      expect_no_leak(a);
      if (q == nullptr) q = a.alloc.allocate(8 * MiB, stream(2));  // works afterwards
      ASSERT_NE(q, nullptr);
      a.alloc.check_invariants();
      a.alloc.deallocate(q);
      a.alloc.empty_cache();
      a.alloc.check_invariants();
      EXPECT_EQ(a.sim->live_handles(), 0u);
      EXPECT_EQ(a.sim->live_mappings(), 0u);
    }
  }
}

TEST(Expandable, AGrowingBufferKeepsItsPagesMappedAndMovesThemOnlyUnderALimit) {
  // A KV cache grown by concatenation: the new buffer is allocated while the old one is live,
  // then the old one is freed. Best fit leapfrogs: each new buffer lands in the hole the one
  // before the last left. While memory is plentiful the pages stay mapped where they went idle
  // and each page is created once; under a limit the pages a buffer lacks are moved from the
  // hole (a few VM calls per step) and reserved memory stays at two buffers.
  for (const bool limited : {false, true}) {
    SCOPED_TRACE(limited ? "limit 56 MiB" : "no limit");
    sim_allocator a(limited ? parse_config("memory_limit:56MiB", expandable()) : expandable());
    void* pin = a.alloc.allocate(MiB + 512);  // something live below, as in a real program
    void* cache = a.alloc.allocate(20 * MiB);
    for (int step = 1; step <= 64; ++step) {
      void* grown = a.alloc.allocate(20 * MiB + static_cast<std::size_t>(step) * 64 * KiB);
      a.alloc.deallocate(cache);
      cache = grown;
      a.alloc.check_invariants();
    }
    const auto s = a.stats();
    EXPECT_EQ(s.oom_count, 0u);
    EXPECT_EQ(s.alloc_retry_count, 0u);
    if (!limited) {
      // Exact on the simulated device: the pages of the three-buffer extent (74 MiB), each
      // created and mapped once; nothing moved, unmapped or synchronized.
      EXPECT_EQ(s.reserved_bytes[0].peak, static_cast<std::int64_t>(74 * MiB));
      EXPECT_EQ(s.device_alloc_count, 37u);
      EXPECT_EQ(s.vm_map_count, 37u);
      EXPECT_EQ(s.vm_unmap_count, 0u);
      EXPECT_EQ(s.vm_sync_count, 0u);
    } else {
      // Two buffers of at most 24 MiB are live at once, plus the pin and boundary pages.
      EXPECT_LE(s.reserved_bytes[0].peak, static_cast<std::int64_t>(56 * MiB));
      EXPECT_GT(s.stitched_pages, 0u);
    }
    a.alloc.deallocate(cache);
    a.alloc.deallocate(pin);
    expect_no_leak(a);
  }
}

TEST(Expandable, SnapshotAndSummaryShowMappedAndUnmappedParts) {
  sim_allocator a(expandable());
  void* x = a.alloc.allocate(3 * MiB);  // pages 0-1: two one-page handles
  void* y = a.alloc.allocate(2 * MiB);  // [3, 5) MiB: page 2 added
  a.alloc.deallocate(y);                // page 2 idle (page 1 is shared with x)
  const auto snap = nlohmann::json::parse(a.alloc.snapshot_json());
  ASSERT_EQ(snap["segments"].size(), 1u);
  const auto& range = snap["segments"][0];
  EXPECT_TRUE(range["expandable"].get<bool>());
  EXPECT_EQ(range["mapped_bytes"], 6 * MiB);
  EXPECT_EQ(range["unmapped_bytes"], range["size"].get<std::size_t>() - 6 * MiB);
  ASSERT_EQ(range["mappings"].size(), 3u);
  EXPECT_EQ(range["mappings"][0]["address"], addr(x));
  EXPECT_EQ(range["mappings"][2]["idle"], true);
  EXPECT_EQ(snap["stats"]["device_alloc_count"], 3u);
  const std::string summary = a.alloc.memory_summary();
  EXPECT_NE(summary.find("Expandable: 6.00 MiB mapped"), std::string::npos) << summary;
  EXPECT_NE(summary.find("device allocs: 3 "), std::string::npos) << summary;  // cuMemCreate
  EXPECT_NE(summary.find("Pager host time: "), std::string::npos) << summary;
  a.alloc.deallocate(x);
}

TEST(Expandable, DeviceWithoutVirtualMemoryIsAClearError) {
  sim_options o;
  o.granularity_bytes = 0;
  try {
    sim_allocator a(expandable(), o);
    FAIL();
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("virtual memory"), std::string::npos);
  }
}

}  // namespace
}  // namespace cucache::test
