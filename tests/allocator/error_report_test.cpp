// error_report on its own: the out-of-memory message from its facts, clause by clause, with exact
// text; and the bad-pointer diagnosis over a pool table whose segments and blocks are made by
// hand (error_report.hpp).
#include "allocator/error_report.hpp"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "allocator/pool_table.hpp"
#include "allocator/stream_pool.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

using detail::block;
using detail::block_state;
using detail::pool_kind;
using detail::segment;

/// 1 GiB asked of an 8 GiB device with 512 MiB free, cucache holding 3 GiB of which 1 GiB is
/// allocated, in 7 free blocks (largest 256 MiB): nothing else applies.
detail::oom_facts plain_facts() {
  detail::oom_facts f;
  f.device = 1;
  f.device_name = "sim";
  f.bytes = GiB;
  f.rounded = GiB;
  f.stream = stream(0x40);
  f.device_total = 8 * GiB;
  f.device_free = 512 * MiB;
  f.reserved = 3 * GiB;
  f.allocated = GiB;
  f.free_blocks = 7;
  f.largest_free_block = 256 * MiB;
  f.external_fragmentation = 0.25;
  f.overhead_fragmentation = 0.125;
  return f;
}

const std::string k_plain =
    "cucache: out of memory on device 1 (sim): tried to allocate 1.00 GiB (1073741824 bytes, "
    "rounded to 1073741824) on stream 0x40. Device capacity 8.00 GiB, of which 512.00 MiB is "
    "free. cucache holds 3.00 GiB reserved: 1.00 GiB allocated, 2.00 GiB reserved but "
    "unallocated in 7 free blocks (largest 256.00 MiB). Fragmentation: external 25.0%, "
    "overhead 12.5%.";

TEST(ErrorReport, OutOfMemorySaysTheRequestTheDeviceAndWhatCucacheHolds) {
  EXPECT_EQ(detail::oom_message(plain_facts()), k_plain);
}

TEST(ErrorReport, OutOfMemoryNamesARequestBeyondAnyDeviceAndAnUnknownFreeCount) {
  detail::oom_facts f = plain_facts();
  f.rounded = 0;
  f.device_free.reset();
  const std::string m = detail::oom_message(f);
  EXPECT_NE(m.find("(1073741824 bytes, beyond any device)"), std::string::npos) << m;
  EXPECT_NE(m.find("of which unknown is free"), std::string::npos) << m;
}

TEST(ErrorReport, OutOfMemoryAddsEachClauseOnlyWhereItApplies) {
  detail::oom_facts f = plain_facts();
  f.limit = 4 * GiB;
  EXPECT_EQ(detail::oom_message(f), k_plain + " The memory limit is 4.00 GiB.");

  f = plain_facts();
  f.address_space = true;
  f.address_bytes = 64 * GiB;
  EXPECT_EQ(detail::oom_message(f),
            k_plain +
                " The process's virtual address space has no room for a new range of expandable "
                "segments (cuMemAddressReserve refused it; cucache's ranges on this device span "
                "64.00 GiB): fewer streams holding cached memory at once, or empty_cache, give "
                "address space back.");

  f = plain_facts();
  f.capture_underway = true;
  EXPECT_EQ(detail::oom_message(f),
            k_plain +
                " A CUDA graph capture is underway: cached memory cannot be given back to the "
                "device meanwhile (cudaFree and unmapping synchronize the device, which is "
                "illegal during a capture).");
}

// The expandable hint: more than half fragmented, and the free bytes would have held the request.
TEST(ErrorReport, OutOfMemorySuggestsExpandableSegmentsOnlyWhenFragmentationCostTheRequest) {
  const std::string hint =
      " Much reserved memory is free but fragmented: expandable_segments:True avoids this.";
  detail::oom_facts f = plain_facts();
  f.external_fragmentation = 0.75;  // 2 GiB free > 1 GiB asked
  std::string m = detail::oom_message(f);
  EXPECT_EQ(m.substr(m.size() - hint.size()), hint);

  f.bytes = 2 * GiB;  // the free bytes would not have held it
  m = detail::oom_message(f);
  EXPECT_EQ(m.find(hint), std::string::npos) << m;

  f = plain_facts();
  f.external_fragmentation = 0.5;  // not more than half
  EXPECT_EQ(detail::oom_message(f).find(hint), std::string::npos);
}

/// One pool with one 1 MiB segment at k_base cut by hand into: [0, 256 KiB) allocated,
/// [256 KiB, 512 KiB) free, [512 KiB, 1 MiB) allocated.
struct pointer_rig {
  pointer_rig()
      : sim(std::make_shared<sim_backend>()),
        pools(*sim),
        pool(pools.pool_for(nullptr, pools.stream_key(nullptr))) {
    seg.base = k_base;
    seg.size = MiB;
    seg.kind = pool_kind::large;
    seg.owner = &pool;
    const std::size_t sizes[] = {256 * KiB, 256 * KiB, 512 * KiB};
    const block_state states[] = {block_state::allocated, block_state::free,
                                  block_state::allocated};
    std::uintptr_t a = k_base;
    for (int i = 0; i < 3; ++i) {
      b[i].addr = a;
      b[i].size = sizes[i];
      b[i].state = states[i];
      b[i].seg = &seg;
      b[i].prev = i > 0 ? &b[i - 1] : nullptr;
      b[i].next = i < 2 ? &b[i + 1] : nullptr;
      a += sizes[i];
    }
    seg.first = &b[0];
    detail::pool_table::all_locked all(pools);
    detail::pool_table::assert_locked(pool);
    pool.segments = &seg;
  }
  ~pointer_rig() {
    detail::pool_table::all_locked all(pools);
    detail::pool_table::assert_locked(pool);
    pool.segments = nullptr;
  }
  std::string why(std::uintptr_t a, const char* what = "free") {
    return detail::explain_pointer(pools, 2, reinterpret_cast<const void*>(a), what);
  }

  std::shared_ptr<sim_backend> sim;
  detail::pool_table pools;
  detail::stream_pool& pool;
  segment seg;
  block b[3];
};

TEST(ErrorReport, ABadPointerIsToldApartByWhereItPoints) {
  pointer_rig r;
  const auto text = [](std::uintptr_t a, const char* what, const std::string& why) {
    return fmt::format("cucache: {}({}) on device 2: {}", what, reinterpret_cast<void*>(a), why);
  };
  EXPECT_EQ(r.why(k_base + 256 * KiB), text(k_base + 256 * KiB, "free", "it was already freed"));
  EXPECT_EQ(r.why(k_base + 512 * KiB + 4096, "record_stream"),
            text(k_base + 512 * KiB + 4096, "record_stream",
                 fmt::format("it points 4096 bytes into the live allocation at {:#x}: pass the "
                             "allocation's start",
                             k_base + 512 * KiB)));
  EXPECT_EQ(r.why(k_base + 300 * KiB),
            text(k_base + 300 * KiB, "free",
                 fmt::format("it points into free memory (inside the block at {:#x}, already "
                             "freed)",
                             k_base + 256 * KiB)));
  EXPECT_EQ(r.why(k_base + MiB),
            text(k_base + MiB, "free", "it was not allocated by cucache on this device"));
  EXPECT_EQ(r.why(0x1000), text(0x1000, "free", "it was not allocated by cucache on this device"));

  // The walk both answers are made from (device_allocator::locate's).
  const auto at =
      detail::locate_pointer(r.pools, reinterpret_cast<const void*>(k_base + 600 * KiB));
  EXPECT_TRUE(at.in_segment);
  EXPECT_EQ(at.segment, k_base);
  EXPECT_EQ(at.segment_size, MiB);
  EXPECT_EQ(at.block, k_base + 512 * KiB);
  EXPECT_EQ(at.block_size, 512 * KiB);
  EXPECT_TRUE(at.live);
  EXPECT_FALSE(
      detail::locate_pointer(r.pools, reinterpret_cast<const void*>(k_base + 300 * KiB)).live);
  EXPECT_FALSE(detail::locate_pointer(r.pools, reinterpret_cast<const void*>(0x1000)).in_segment);
}

}  // namespace
}  // namespace cucache::test
