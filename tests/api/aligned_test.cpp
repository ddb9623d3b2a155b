// Tests of allocations aligned beyond cucache's 512 B (cucache/aligned.hpp) on a simulated device:
// every power of two is honoured, the whole over-allocated block goes back on free (statistics
// return to zero, invariants hold), a bad alignment is rejected naming it, and a bad free changes
// nothing.
#include "cucache/aligned.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cucache/device_allocator.hpp"
#include "cucache/errors.hpp"
#include "cucache/sim_backend.hpp"
#include "support/sim_device.hpp"

namespace cucache {
namespace {

std::uintptr_t addr(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p);
}
using test::fake_stream;

struct Aligned : ::testing::Test {
  Aligned() : alloc(std::make_shared<sim_backend>()) {}
  std::int64_t allocated() const { return alloc.stats().allocated_bytes[0].current; }
  std::int64_t count() const { return alloc.stats().allocation_count[0].current; }
  device_allocator alloc;
};

TEST_F(Aligned, EveryPowerOfTwoIsHonouredAndTheWholeBlockReturns) {
  for (const std::size_t alignment :
       {std::size_t{1}, std::size_t{16}, std::size_t{256}, std::size_t{512}, std::size_t{1024},
        std::size_t{4096}, std::size_t{65536}, std::size_t{1} << 21}) {
    SCOPED_TRACE("alignment " + std::to_string(alignment));
    // A 512-B block first, so that the next small block starts off every larger alignment.
    void* spacer = alloc.allocate(100);
    std::vector<std::pair<void*, std::size_t>> live;
    for (const std::size_t bytes :
         {std::size_t{1}, std::size_t{700}, std::size_t{5000}, std::size_t{3} << 20}) {
      void* p = allocate_aligned(alloc, bytes, alignment);
      ASSERT_NE(p, nullptr);
      EXPECT_EQ(addr(p) % alignment, 0u);
      live.emplace_back(p, bytes);
    }
    // The aligned ranges do not overlap each other or the spacer.
    live.emplace_back(spacer, 100);
    std::sort(live.begin(), live.end());
    for (std::size_t i = 1; i < live.size(); ++i) {
      EXPECT_LE(addr(live[i - 1].first) + live[i - 1].second, addr(live[i].first));
    }
    alloc.check_invariants();
    for (auto& [p, bytes] : live) {
      if (p != spacer) deallocate_aligned(alloc, p);
    }
    alloc.deallocate(spacer);
    EXPECT_EQ(allocated(), 0);
    EXPECT_EQ(count(), 0);
    alloc.check_invariants();
  }
}

TEST_F(Aligned, OverAlignedBlocksAreLargerByAtMostAlignmentMinus512) {
  void* spacer = alloc.allocate(100);
  const std::int64_t before = allocated();
  void* p = allocate_aligned(alloc, 4096, 4096);
  EXPECT_EQ(addr(p) % 4096, 0u);
  // The block after the spacer starts 512 B into its segment: the aligned pointer is inside it.
  EXPECT_EQ(alloc.allocation_size(p), 0u);
  EXPECT_LE(allocated() - before, 4096 + 4096 - 512);
  deallocate_aligned(alloc, p);
  alloc.deallocate(spacer);
  EXPECT_EQ(allocated(), 0);
}

TEST_F(Aligned, StreamOrderedFreeGoesThroughTheStream) {
  void* spacer = alloc.allocate(100, fake_stream(1));
  void* p = allocate_aligned(alloc, 1000, 2048, fake_stream(1));
  EXPECT_EQ(addr(p) % 2048, 0u);
  // Freed in the order of another stream than its own: the block waits for that stream's event,
  // and the whole of it is no longer allocated.
  deallocate_aligned(alloc, p, fake_stream(2), /*ordered=*/true);
  alloc.deallocate(spacer);
  EXPECT_EQ(allocated(), 0);
  alloc.check_invariants();
}

TEST_F(Aligned, AlignmentsThatAreNotPowersOfTwoAreRejectedByName) {
  for (const std::size_t alignment : {std::size_t{0}, std::size_t{3}, std::size_t{768}}) {
    try {
      (void)allocate_aligned(alloc, 64, alignment);
      ADD_FAILURE() << "alignment " << alignment << " accepted";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("alignment " + std::to_string(alignment)),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(count(), 0);
}

TEST_F(Aligned, ZeroBytesIsNullAndFreeingNullIsANoOp) {
  EXPECT_EQ(allocate_aligned(alloc, 0, 4096), nullptr);
  deallocate_aligned(alloc, nullptr);
  EXPECT_EQ(count(), 0);
}

TEST_F(Aligned, ABadFreeThrowsAndChangesNothing) {
  void* spacer = alloc.allocate(100);
  void* p = allocate_aligned(alloc, 1000, 4096);
  ASSERT_NE(p, spacer);
  const std::int64_t before = allocated();
  // An interior pointer, and a pointer of another allocator.
  EXPECT_THROW(deallocate_aligned(alloc, static_cast<char*>(p) + 512), invalid_argument);
  device_allocator other(std::make_shared<sim_backend>());
  EXPECT_THROW(deallocate_aligned(other, p), invalid_argument);
  EXPECT_EQ(allocated(), before);
  // The record survived: the real free still returns the whole block.
  deallocate_aligned(alloc, p);
  EXPECT_THROW(deallocate_aligned(alloc, p), invalid_argument);  // a double free
  alloc.deallocate(spacer);
  EXPECT_EQ(allocated(), 0);
}

TEST_F(Aligned, ConcurrentOverAlignedAllocationsReturnEverything) {
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([this, t] {
      std::vector<void*> mine;
      for (int i = 0; i < 500; ++i) {
        const std::size_t alignment = std::size_t{1} << (9 + (i + t) % 5);
        void* p = allocate_aligned(alloc, 64 + static_cast<std::size_t>(i), alignment,
                                   fake_stream(static_cast<std::uintptr_t>(t + 1)));
        EXPECT_EQ(addr(p) % alignment, 0u);
        mine.push_back(p);
        if (i % 3 == 0) {
          deallocate_aligned(alloc, mine.front());
          mine.erase(mine.begin());
        }
      }
      for (void* p : mine) deallocate_aligned(alloc, p);
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(allocated(), 0);
  alloc.check_invariants();
}

}  // namespace
}  // namespace cucache
