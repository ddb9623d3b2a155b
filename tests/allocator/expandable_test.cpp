// Expandable segments: what only the simulated device can check -- the device calls it counts,
// reuse of unmapped handles at an exact capacity, injected failures of every VM call, contents that
// survive pages being moved, and a device without virtual memory. The rules of expandable mode
// (page mappings, stitching, placement, empty_cache, limits, stats) are in the typed suite,
// allocator_suite.cpp, which runs them on the simulated device and on a real GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "allocator/test_support.hpp"
#include "cucache/errors.hpp"

namespace cucache::test {
namespace {

config expandable() {
  return parse_config("expandable_segments:True");
}

/// Physical handles the sim holds must equal what the allocator accounts for.
void expect_no_leak(sim_allocator& a) {
  const auto s = a.stats();
  EXPECT_EQ(a.sim->used_bytes(), static_cast<std::size_t>(s.reserved_bytes[0].current));
  EXPECT_EQ(s.mapped_bytes + s.unmapped_handle_bytes,
            static_cast<std::size_t>(s.reserved_bytes[0].current));
}

TEST(Expandable, OneReservationPerRangeAndStitchingSynchronizesTheStreamBeforeUnmapping) {
  sim_allocator a(expandable());
  void* x = a.alloc.allocate(8 * MiB);  // pages 0-3
  void* y = a.alloc.allocate(8 * MiB);  // pages 4-7
  EXPECT_EQ(a.sim->calls(sim_call::va_reserve), 1u);
  a.alloc.deallocate(x);
  void* z = a.alloc.allocate(16 * MiB);  // moves x's idle pages behind y
  EXPECT_EQ(a.stats().stitched_pages, 4u);
  // Unmapping is not stream-ordered: the pool's stream is synchronized once, before the unmaps.
  EXPECT_EQ(a.sim->calls(sim_call::stream_synchronize), 1u);
  EXPECT_EQ(a.sim->calls(sim_call::unmap), 3u);
  EXPECT_EQ(a.sim->calls(sim_call::va_reserve), 1u);
  (void)y;
  (void)z;
  a.alloc.check_invariants();
  expect_no_leak(a);
}

TEST(Expandable, UnmappedHandlesAreReusedBeforeCreatingNewOnes) {
  sim_options o;
  o.capacity_bytes = 24 * MiB;
  sim_allocator a(expandable(), o);
  void* p = a.alloc.allocate(8 * MiB, stream(1));
  a.alloc.deallocate(p);  // an idle 8 MiB mapping in stream 1's range
  // Stream 2 needs 20 MiB: creating it fails (8 + 20 > 24), so the ladder unmaps stream 1's idle
  // pages into the handle list, and the retry maps that handle plus a new 12 MiB one.
  void* q = a.alloc.allocate(20 * MiB, stream(2));
  EXPECT_NE(q, nullptr);
  const auto s = a.stats();
  // p: handles of 1, 2, 1 pages. First try for q: 1 page created, then 8 pages would pass the
  // capacity. The ladder unmaps every idle mapping (p's three, and q's first page after the
  // undo) into the reusable list; the retry maps those four (2 + 4 + 2 + 2 MiB) and creates
  // 4 pages and 1 page.
  EXPECT_EQ(s.alloc_retry_count, 1u);
  EXPECT_EQ(s.vm_create_count, 6u);
  EXPECT_EQ(s.vm_release_count, 0u);
  EXPECT_EQ(s.vm_map_count, 10u);
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(20 * MiB));
  a.alloc.check_invariants();
  expect_no_leak(a);
}

TEST(Expandable, FailedVmCallsLeaveNoHalfMappedBlockAndNoLeakedHandle) {
  // phys_release is covered by FailedReleaseInEmptyCacheKeepsTheHandleTracked: this allocation
  // releases nothing.
  for (sim_call kind :
       {sim_call::map, sim_call::set_access, sim_call::unmap, sim_call::stream_synchronize}) {
    SCOPED_TRACE(to_string(kind));
    sim_allocator a(expandable());
    void* x = a.alloc.allocate(8 * MiB);
    void* y = a.alloc.allocate(8 * MiB);
    a.alloc.deallocate(x);
    a.sim->fail_nth(kind, 1);
    const auto before = a.stats();
    const std::uint64_t calls_before = a.sim->calls(kind);
    bool threw = false;
    try {
      void* z =
          a.alloc.allocate(16 * MiB);  // needs a stream sync, an unmap (stitch), a map, set_access
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
  o.capacity_bytes = 256 * MiB;
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
