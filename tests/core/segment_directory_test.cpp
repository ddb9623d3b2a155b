// segment_directory: owners of addresses against a model of the live segments -- exact answers
// inside segments, nullptr or a neighbouring owner outside them, the shared-granule path, bad
// input refused with nothing changed; and lookups racing with adds and removes elsewhere.
#include "core/segment_directory.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <map>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

namespace cucache::detail {
namespace {

constexpr std::uintptr_t MiB = std::uintptr_t{1} << 20;
constexpr std::uintptr_t k_base = 0x400000000000ULL;  // the sim's device 0

stream_pool* pool(std::uintptr_t i) {
  return reinterpret_cast<stream_pool*>(i * 64);
}

TEST(SegmentDirectory, AlignedSegmentsAnswerWithoutTheIndex) {
  segment_directory d;
  d.add(k_base, 2 * MiB, pool(1));
  d.add(k_base + 2 * MiB, 20 * MiB, pool(2));
  EXPECT_EQ(d.owner_of(k_base), pool(1));
  EXPECT_EQ(d.owner_of(k_base + 2 * MiB - 512), pool(1));
  EXPECT_EQ(d.owner_of(k_base + 2 * MiB), pool(2));
  EXPECT_EQ(d.owner_of(k_base + 22 * MiB - 1), pool(2));
  EXPECT_EQ(d.owner_of(k_base + 22 * MiB), nullptr);
  d.remove(k_base + 22 * MiB);  // no segment starts there: nothing happens
  EXPECT_EQ(d.segments(), 2u);
  EXPECT_EQ(d.owner_of(k_base - 1), nullptr);
  EXPECT_EQ(d.owner_of(0x1000), nullptr);
  EXPECT_FALSE(d.shared_granule(k_base + 2 * MiB));
  EXPECT_EQ(d.segments(), 2u);
  EXPECT_EQ(d.nodes(), 1u);  // the granules of the first GiB
  d.remove(k_base);
  EXPECT_EQ(d.owner_of(k_base), nullptr);
  EXPECT_EQ(d.owner_of(k_base + 2 * MiB), pool(2));
  EXPECT_EQ(d.segments(), 1u);
}

TEST(SegmentDirectory, GranuleOfTwoOwnersIsAnsweredFromTheIndex) {
  segment_directory d;
  // 1 MiB-aligned segments: the granule [k_base + 2 MiB, + 4 MiB) holds the end of pool 1's and
  // the start of pool 2's.
  d.add(k_base + 1 * MiB, 2 * MiB, pool(1));
  d.add(k_base + 3 * MiB, 2 * MiB, pool(2));
  EXPECT_TRUE(d.shared_granule(k_base + 2 * MiB));
  EXPECT_EQ(d.owner_of(k_base + 3 * MiB - 512), pool(1));
  EXPECT_EQ(d.owner_of(k_base + 3 * MiB), pool(2));
  // A granule holding only pool 1's start, with a gap before it: pool 1 for the gap too (the
  // caller's block map then finds nothing there).
  EXPECT_FALSE(d.shared_granule(k_base));
  EXPECT_EQ(d.owner_of(k_base + 1 * MiB), pool(1));
  EXPECT_EQ(d.owner_of(k_base), pool(1));
  // Two segments of one owner in one granule: not shared.
  d.add(k_base + 6 * MiB, 1 * MiB, pool(3));
  d.add(k_base + 7 * MiB, 1 * MiB, pool(3));
  EXPECT_FALSE(d.shared_granule(k_base + 6 * MiB));
  EXPECT_EQ(d.owner_of(k_base + 7 * MiB), pool(3));
  // The shared granule is one owner's again once the other's segment goes.
  d.remove(k_base + 3 * MiB);
  EXPECT_FALSE(d.shared_granule(k_base + 2 * MiB));
  EXPECT_EQ(d.owner_of(k_base + 2 * MiB), pool(1));
  EXPECT_EQ(d.owner_of(k_base + 4 * MiB), nullptr);
}

TEST(SegmentDirectory, AddressesBeyondTheTableUseTheIndex) {
  segment_directory d;
  const std::uintptr_t high = std::uintptr_t{1} << 60;
  d.add(high, 4 * MiB, pool(5));
  EXPECT_TRUE(d.shared_granule(high));
  EXPECT_EQ(d.owner_of(high + MiB), pool(5));
  EXPECT_EQ(d.owner_of(high + 4 * MiB), nullptr);
  EXPECT_EQ(d.nodes(), 0u);
  // One that starts below 2^52 (the table's end) and ends above it.
  const std::uintptr_t edge = (std::uintptr_t{1} << 52) - 2 * MiB;
  d.add(edge, 4 * MiB, pool(6));
  EXPECT_EQ(d.owner_of(edge), pool(6));
  EXPECT_EQ(d.owner_of(edge + 3 * MiB), pool(6));
  d.remove(edge);
  EXPECT_EQ(d.owner_of(edge), nullptr);
  EXPECT_EQ(d.owner_of(edge + 3 * MiB), nullptr);
}

TEST(SegmentDirectory, AHugeRangeTakesCoarseEntriesAndNodesAtItsEdgesOnly) {
  // An expandable range of 600 GiB that starts 1 MiB past a granule: one owner entry per 1 GiB
  // or 512 GiB it covers, and child nodes only where it covers a span in part.
  segment_directory d;
  constexpr std::uintptr_t GiB = std::uintptr_t{1} << 30;
  const std::uintptr_t base = k_base + 3 * GiB + MiB;
  const std::uintptr_t bytes = 600 * GiB;
  d.add(base, bytes, pool(7));
  EXPECT_EQ(d.nodes(), 2u);  // the GiB it starts in and the GiB it ends in
  for (std::uintptr_t off : {std::uintptr_t{0}, MiB, GiB, 100 * GiB, 509 * GiB + 5 * MiB, 512 * GiB,
                             599 * GiB, bytes - 512}) {
    EXPECT_EQ(d.owner_of(base + off), pool(7)) << "offset " << off;
  }
  EXPECT_EQ(d.owner_of(base - 512), pool(7));  // the first granule's gap: the neighbour's owner
  EXPECT_EQ(d.owner_of(base - 2 * MiB), nullptr);
  EXPECT_EQ(d.owner_of(base + bytes + 2 * MiB), nullptr);
  // A small segment in the first granule's gap, of another pool: that granule is shared.
  d.add(base - MiB, MiB, pool(8));
  EXPECT_TRUE(d.shared_granule(base));
  EXPECT_EQ(d.owner_of(base - 512), pool(8));
  EXPECT_EQ(d.owner_of(base), pool(7));
  d.remove(base);
  for (std::uintptr_t off : {MiB, GiB, 100 * GiB, 512 * GiB, 599 * GiB}) {
    EXPECT_EQ(d.owner_of(base + off), nullptr) << "offset " << off;
  }
  EXPECT_EQ(d.owner_of(base - 512), pool(8));
  // Added again: the nodes made the first time are reused.
  const std::size_t nodes = d.nodes();
  d.add(base, bytes, pool(9));
  EXPECT_EQ(d.nodes(), nodes);
  EXPECT_EQ(d.owner_of(base + 300 * GiB), pool(9));
}

TEST(SegmentDirectory, ASegmentTakenOutComesBackWhole) {
  // take_out before the device call of a release, put_back when the device refuses it.
  segment_directory d;
  d.add(k_base + MiB, 2 * MiB, pool(1));  // shares a granule with pool 2's
  d.add(k_base + 3 * MiB, 2 * MiB, pool(2));
  auto t = d.take_out(k_base + MiB);
  EXPECT_EQ(d.segments(), 1u);
  EXPECT_EQ(d.owner_of(k_base + MiB), nullptr);
  EXPECT_FALSE(d.shared_granule(k_base + 2 * MiB));
  EXPECT_EQ(d.owner_of(k_base + 3 * MiB), pool(2));
  d.put_back(std::move(t));
  EXPECT_EQ(d.segments(), 2u);
  EXPECT_EQ(d.owner_of(k_base + MiB), pool(1));
  EXPECT_EQ(d.owner_of(k_base + 3 * MiB - 512), pool(1));
  EXPECT_TRUE(d.shared_granule(k_base + 2 * MiB));
  d.put_back(segment_directory::taken_segment{});  // an empty one: nothing
  EXPECT_EQ(d.segments(), 2u);
}

TEST(SegmentDirectory, BadSegmentsAreRefusedWithNothingChanged) {
  segment_directory d;
  d.add(k_base, 4 * MiB, pool(1));
  EXPECT_THROW(d.add(k_base + 2 * MiB, 4 * MiB, pool(2)), std::invalid_argument);  // overlaps
  EXPECT_THROW(d.add(k_base - 2 * MiB, 4 * MiB, pool(2)), std::invalid_argument);  // overlaps
  EXPECT_THROW(d.add(k_base + 8 * MiB, 0, pool(2)), std::invalid_argument);        // empty
  EXPECT_THROW(d.add(~std::uintptr_t{0} - MiB, 2 * MiB, pool(2)), std::invalid_argument);
  EXPECT_THROW(d.add(k_base + 8 * MiB, MiB, nullptr), std::invalid_argument);
  EXPECT_THROW(d.add(k_base + 8 * MiB, MiB, reinterpret_cast<stream_pool*>(0x1001)),
               std::invalid_argument);  // not 4-byte aligned: its low bits are the tags
  try {
    d.add(k_base + 2 * MiB, 4 * MiB, pool(2));
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(),
                 "segment_directory::add: segment 0x400000200000 of 4194304 bytes overlaps the "
                 "live segment 0x400000000000 of 4194304 bytes: the backend handed out memory it "
                 "had handed out before and not taken back");
  }
  EXPECT_EQ(d.segments(), 1u);
  EXPECT_EQ(d.owner_of(k_base + 3 * MiB), pool(1));
  EXPECT_EQ(d.owner_of(k_base + 4 * MiB), nullptr);
}

// The model: live segments by base. Inside a segment the answer is exact; outside, nullptr or
// the owner of a segment in the same granule. Two scales: segments of 256 KiB-10 MiB in 512 MiB
// (many granules shared), and of 256 KiB-4 GiB in 64 GiB (1 GiB entries and child nodes mixed).
void run_against_model(std::uint64_t seed, std::uintptr_t space, std::uintptr_t max_units) {
  segment_directory d;
  std::map<std::uintptr_t, std::pair<std::uintptr_t, stream_pool*>> model;  // base -> end, owner
  std::mt19937_64 rng(seed);
  constexpr std::uintptr_t unit = 256 * 1024;
  for (int op = 0; op < 20'000; ++op) {
    if (rng() % 3 != 0 || model.empty()) {
      const std::uintptr_t base = k_base + (rng() % (space / unit)) * unit;
      // Sizes log-uniform in units, so that both scales see small and large segments.
      const std::uintptr_t bytes =
          std::max<std::uintptr_t>(
              1, std::uintptr_t{1} << (rng() % 64 % (std::bit_width(max_units)))) *
          unit * (1 + rng() % 2);
      auto next = model.lower_bound(base);
      const bool overlaps = (next != model.end() && next->first < base + bytes) ||
                            (next != model.begin() && std::prev(next)->second.first > base);
      stream_pool* owner = pool(1 + rng() % 4);
      if (overlaps) {
        ASSERT_THROW(d.add(base, bytes, owner), std::invalid_argument);
      } else {
        d.add(base, bytes, owner);
        model.emplace(base, std::make_pair(base + bytes, owner));
      }
    } else {
      auto it = model.begin();
      std::advance(it, static_cast<long>(rng() % model.size()));
      d.remove(it->first);
      model.erase(it);
    }
    ASSERT_EQ(d.segments(), model.size());
    for (int probe = 0; probe < 8; ++probe) {
      // Half the probes at a segment's edges (its first and last 512 B), half anywhere.
      std::uintptr_t a = k_base - MiB + (rng() % ((space + 12 * MiB) / 512)) * 512;
      if (probe % 2 == 0 && !model.empty()) {
        auto it = model.begin();
        std::advance(it, static_cast<long>(rng() % model.size()));
        a = probe % 4 == 0 ? it->first : it->second.first - 512;
      }
      auto it = model.upper_bound(a);
      stream_pool* want = nullptr;
      if (it != model.begin() && a < std::prev(it)->second.first) {
        want = std::prev(it)->second.second;
      }
      stream_pool* got = d.owner_of(a);
      if (want != nullptr) {
        ASSERT_EQ(got, want) << "address " << a;
      } else if (got != nullptr) {
        // A neighbour in a's granule.
        const std::uintptr_t lo = a & ~(2 * MiB - 1);
        bool near = false;
        for (const auto& [b, v] : model) {
          near = near || (v.second == got && b < lo + 2 * MiB && v.first > lo);
        }
        ASSERT_TRUE(near) << "address " << a;
      }
    }
  }
}

TEST(SegmentDirectory, MatchesModelWithSmallSegmentsSharingGranules) {
  run_against_model(11, 512 * MiB, 40);
}

TEST(SegmentDirectory, MatchesModelWithSegmentsUpToGigabytes) {
  run_against_model(12, 64 * 1024 * MiB, 16 * 1024);
}

// Lookups of addresses inside segments that stay live, while other threads add and remove
// segments in the same granules (the shared path) and elsewhere: always the right owner.
TEST(SegmentDirectory, LookupsRaceWithChangesElsewhere) {
  segment_directory d;
  // Stable segments: 1 MiB at the start of every 2 MiB granule of 64; changers use the granules'
  // second halves, so every granule turns shared and back.
  for (std::uintptr_t g = 0; g < 64; ++g) d.add(k_base + g * 2 * MiB, MiB, pool(1 + g % 3));
  std::atomic<bool> stop{false};
  std::vector<std::thread> changers;
  for (int t = 0; t < 2; ++t) {
    changers.emplace_back([&, t] {
      for (int round = 0; round < 300; ++round) {
        for (std::uintptr_t g = static_cast<std::uintptr_t>(t); g < 64; g += 2) {
          d.add(k_base + g * 2 * MiB + MiB, MiB, pool(10 + t));
        }
        for (std::uintptr_t g = static_cast<std::uintptr_t>(t); g < 64; g += 2) {
          d.remove(k_base + g * 2 * MiB + MiB);
        }
      }
    });
  }
  std::vector<std::thread> readers;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 2; ++t) {
    readers.emplace_back([&] {
      std::uint64_t i = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        const std::uintptr_t g = i++ % 64;
        if (d.owner_of(k_base + g * 2 * MiB + (i % 2048) * 512) != pool(1 + g % 3)) ++wrong;
      }
    });
  }
  for (auto& th : changers) th.join();
  stop = true;
  for (auto& th : readers) th.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(d.segments(), 64u);
}

}  // namespace
}  // namespace cucache::detail
