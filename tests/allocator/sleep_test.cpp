// Sleep and wake of a sleep domain (device_allocator::sleep / wake; docs/design.md, "Sleep and
// wake") on the simulated device, whose memory is host-backed here so that contents can be
// checked: addresses stay, reserved bytes fall by exactly the domain's pages and come back,
// contents survive with keep_contents, placement keeps every page of a domain to itself, every
// misuse is a clear error that changes nothing, and a seeded random program of sleeps, wakes,
// allocations, frees and limits keeps every invariant.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

constexpr std::size_t k_page = 2 * MiB;

config expandable(const std::string& extra = "") {
  return parse_config("expandable_segments:True" + (extra.empty() ? "" : "," + extra));
}

/// Allocations made on this thread go to `domain` while the object lives.
class in_domain {
 public:
  explicit in_domain(std::uint32_t d) : before_(device_allocator::thread_sleep_domain()) {
    device_allocator::set_thread_sleep_domain(d);
  }
  ~in_domain() { device_allocator::set_thread_sleep_domain(before_); }
  in_domain(const in_domain&) = delete;
  in_domain& operator=(const in_domain&) = delete;

 private:
  std::uint32_t before_;
};

/// Fills a block with a pattern of `seed` through the sim's host view, page by page (a view
/// covers one mapping at most).
void fill(sim_backend& sim, void* p, std::size_t bytes, std::uint8_t seed) {
  for (std::size_t off = 0; off < bytes;) {
    const std::uintptr_t a = addr(p) + off;
    const std::size_t n = std::min(bytes - off, k_page - a % k_page);
    std::byte* h = sim.host_view(reinterpret_cast<void*>(a), n);
    ASSERT_NE(h, nullptr);
    for (std::size_t i = 0; i < n; ++i) h[i] = std::byte(static_cast<std::uint8_t>(seed + (off + i) * 7));
    off += n;
  }
}

::testing::AssertionResult holds(sim_backend& sim, void* p, std::size_t bytes, std::uint8_t seed) {
  for (std::size_t off = 0; off < bytes;) {
    const std::uintptr_t a = addr(p) + off;
    const std::size_t n = std::min(bytes - off, k_page - a % k_page);
    std::byte* h = sim.host_view(reinterpret_cast<void*>(a), n);
    if (h == nullptr) return ::testing::AssertionFailure() << "byte " << off << " is not mapped";
    for (std::size_t i = 0; i < n; ++i) {
      if (h[i] != std::byte(static_cast<std::uint8_t>(seed + (off + i) * 7))) {
        return ::testing::AssertionFailure() << "byte " << off + i << " of " << p << " changed";
      }
    }
    off += n;
  }
  return ::testing::AssertionSuccess();
}

/// Blocks of 512 B, 100,000 B, 5 MiB and 40 MiB in `domain`, filled with the seeds 10, 11, 12, 13.
template <class Allocator>
std::vector<std::pair<void*, std::size_t>> domain_blocks(Allocator& a, std::uint32_t domain) {
  std::vector<std::pair<void*, std::size_t>> blocks;
  {
    in_domain d(domain);
    for (std::size_t bytes : {std::size_t{512}, std::size_t{100'000}, 5 * MiB, 40 * MiB}) {
      blocks.emplace_back(a.alloc.allocate(bytes), bytes);
    }
  }
  std::uint8_t seed = 10;
  for (auto [p, n] : blocks) fill(*a.sim, p, n, seed++);
  return blocks;
}

std::set<std::uintptr_t> pages_of(void* p, std::size_t bytes) {
  std::set<std::uintptr_t> out;
  for (std::uintptr_t pg = addr(p) / k_page; pg <= (addr(p) + bytes - 1) / k_page; ++pg) {
    out.insert(pg);
  }
  return out;
}

TEST(Sleep, ReleasesTheDomainsPagesKeepsAddressesAndContents) {
  sim_allocator a(expandable(), host_backed(4 * GiB));
  void* other = a.alloc.allocate(3 * MiB);  // untagged: stays mapped throughout
  fill(*a.sim, other, 3 * MiB, 1);
  const std::vector<std::pair<void*, std::size_t>> mine = domain_blocks(a, 7);
  const std::int64_t reserved_before = a.reserved();
  const std::size_t used_before = a.sim->used_bytes();
  a.alloc.check_invariants();

  a.alloc.sleep(7, /*keep_contents=*/true, "train");
  a.alloc.check_invariants();
  expect_no_leak(a);
  EXPECT_TRUE(a.alloc.is_asleep(7));
  // The small pool's range: one 2 MiB page holds both small blocks; the large one: 5 MiB + 40 MiB
  // from its front, 23 pages (45 MiB rounded up to pages).
  const std::size_t domain_pages = 1 + 23;
  const auto s = a.stats();
  EXPECT_EQ(s.sleeping_bytes, domain_pages * k_page);
  EXPECT_EQ(s.sleeping_host_bytes, 512 + 100'352 + 5 * MiB + 40 * MiB);  // block sizes, rounded
  EXPECT_EQ(reserved_before - a.reserved(), static_cast<std::int64_t>(domain_pages * k_page));
  EXPECT_EQ(used_before - a.sim->used_bytes(), domain_pages * k_page);
  for (auto [p, n] : mine) EXPECT_FALSE(a.sim->accessible(p, n));
  EXPECT_TRUE(holds(*a.sim, other, 3 * MiB, 1));
  ASSERT_EQ(a.alloc.sleeping().size(), 1u);
  EXPECT_EQ(a.alloc.sleeping()[0].domain, 7u);
  EXPECT_EQ(a.alloc.sleeping()[0].bytes, domain_pages * k_page);

  a.alloc.wake(7, "train");
  a.alloc.check_invariants();
  expect_no_leak(a);
  EXPECT_FALSE(a.alloc.is_asleep(7));
  EXPECT_EQ(a.reserved(), reserved_before);
  EXPECT_EQ(a.stats().sleeping_bytes, 0u);
  EXPECT_EQ(a.stats().sleeping_host_bytes, 0u);
  std::uint8_t seed = 10;
  for (auto [p, n] : mine) {
    EXPECT_TRUE(a.sim->accessible(p, n));
    EXPECT_TRUE(holds(*a.sim, p, n, seed++));
  }
  // The pinned buffer is kept for the next sleep: a second round pins nothing new.
  EXPECT_EQ(a.sim->calls(sim_call::host_free_pinned), 0u);
  a.alloc.sleep(7, /*keep_contents=*/true, "train");
  a.alloc.wake(7, "train");
  EXPECT_EQ(a.sim->calls(sim_call::host_alloc_pinned), 1u);
  seed = 10;
  for (auto [p, n] : mine) EXPECT_TRUE(holds(*a.sim, p, n, seed++));
  // Same addresses, usable as before: freed, reallocated.
  for (auto [p, n] : mine) a.alloc.deallocate(p);
  a.alloc.deallocate(other);
  a.alloc.check_invariants();
  a.alloc.empty_cache();
  EXPECT_EQ(a.reserved(), 0);
  // A sleep that keeps nothing gives the buffer back.
  a.alloc.sleep(7, /*keep_contents=*/false);
  EXPECT_EQ(a.sim->calls(sim_call::host_free_pinned), 1u);
  a.alloc.wake(7);
  EXPECT_EQ(a.sim->calls(sim_call::host_alloc_pinned), 1u);
}

TEST(Sleep, AChunkedBlockSleepsAndWakesWithItsContentsHandleByHandle) {
  // 300 MiB at the front of the large range: 150 whole pages, backed by chunks of 32, 32, 32, 32
  // and 22 pages (pager::k_max_chunk_pages, k_min_chunked_pages). Sleep releases each chunk whole
  // (one unmap and one release each); wake backs the block with chunks again.
  sim_allocator a(expandable(), host_backed(4 * GiB));
  void* p = nullptr;
  {
    in_domain d(7);
    p = a.alloc.allocate(300 * MiB);
  }
  EXPECT_EQ(a.stats().device_alloc_count, 5u);
  fill(*a.sim, p, 300 * MiB, 42);
  a.alloc.check_invariants();
  const auto unmaps = a.sim->calls(sim_call::unmap);
  a.alloc.sleep(7, /*keep_contents=*/true, "chunks");
  a.alloc.check_invariants();
  expect_no_leak(a);
  EXPECT_EQ(a.sim->calls(sim_call::unmap) - unmaps, 5u);
  EXPECT_EQ(a.stats().device_free_count, 5u);
  EXPECT_EQ(a.stats().sleeping_bytes, 300 * MiB);
  EXPECT_EQ(a.reserved(), 0);
  a.alloc.wake(7, "chunks");
  a.alloc.check_invariants();
  expect_no_leak(a);
  EXPECT_EQ(a.stats().device_alloc_count, 10u);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(300 * MiB));
  EXPECT_TRUE(a.sim->accessible(p, 300 * MiB));
  EXPECT_TRUE(holds(*a.sim, p, 300 * MiB, 42));
  a.alloc.deallocate(p);
  a.alloc.check_invariants();
}

TEST(Sleep, WithoutContentsCopiesNothingAndReleasesCachedPagesToo) {
  sim_allocator a(expandable(), host_backed(4 * GiB));
  void* keep = nullptr;
  {
    in_domain d(3);
    keep = a.alloc.allocate(6 * MiB);  // pages 0-2
    void* cached = a.alloc.allocate(10 * MiB);  // pages 3-7, then freed: idle, cached
    a.alloc.deallocate(cached);
  }
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(16 * MiB));
  a.alloc.sleep(3, /*keep_contents=*/false);
  EXPECT_EQ(a.reserved(), 0);  // the live block's pages and the cached ones
  EXPECT_EQ(a.stats().sleeping_bytes, 6 * MiB);  // what wake maps again: the live block's
  EXPECT_EQ(a.stats().sleeping_host_bytes, 0u);
  EXPECT_EQ(a.sim->calls(sim_call::host_alloc_pinned), 0u);
  a.alloc.check_invariants();
  a.alloc.wake(3);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(6 * MiB));
  EXPECT_TRUE(a.sim->accessible(keep, 6 * MiB));
  a.alloc.check_invariants();
  a.alloc.deallocate(keep);
  expect_no_leak(a);
}

// reserve and max_allocatable answer for the pool an allocation on this thread would use: under a
// sleepable tag, that tag's pool. Reserved pages are then the tag's (its sleep gives them back),
// and while it sleeps nothing can be allocated under it: max_allocatable says 0, reserve refuses.
TEST(Sleep, ReserveAndMaxAllocatableUnderASleepableTagUseItsPool) {
  sim_allocator a(expandable(), host_backed(4 * GiB));
  {
    in_domain d(4);
    a.alloc.reserve(8 * MiB);
  }
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(8 * MiB));
  a.alloc.sleep(4, /*keep_contents=*/false);
  EXPECT_EQ(a.reserved(), 0);  // the reserved pages were the tag's
  a.alloc.check_invariants();
  {
    in_domain d(4);
    EXPECT_EQ(a.alloc.max_allocatable(), 0u);
    const std::uint64_t before = a.sim->calls(sim_call::phys_create);
    EXPECT_THROW(a.alloc.reserve(2 * MiB), invalid_argument);
    EXPECT_EQ(a.sim->calls(sim_call::phys_create), before);
  }
  EXPECT_GT(a.alloc.max_allocatable(), 0u);  // untagged requests are served
  a.alloc.wake(4);
  {
    in_domain d(4);
    EXPECT_GT(a.alloc.max_allocatable(), 0u);
  }
  a.alloc.check_invariants();
  a.alloc.empty_cache();
  expect_no_leak(a);
}

// A server that makes a stream per request under a sleepable tag: the gone streams' pools of that
// domain are handed to the next stream of the same domain (never to another domain's, nor to
// untagged requests), so address space and reservations stay bounded (issue 22 x issue 24).
TEST(Sleep, AStreamPerRequestUnderASleepableTagReusesThatDomainsPools) {
  sim_options o = host_backed(4 * GiB);
  o.events_complete_immediately = true;
  sim_allocator a(expandable(), o);
  for (int i = 0; i < 1500; ++i) {
    const stream_handle s = a.sim->create_stream();
    {
      in_domain d(5);
      void* p = a.alloc.allocate(1 * MiB, s);
      ASSERT_NE(p, nullptr) << "request " << i;
      a.alloc.deallocate(p, s);
    }
    void* q = a.alloc.allocate(1 * MiB, s);  // untagged, on the same stream: its own pool
    a.alloc.deallocate(q, s);
    a.sim->destroy_stream(s);
  }
  // Two pools' ranges (the domain's and the untagged one), each reserved once and reused.
  EXPECT_EQ(a.sim->calls(sim_call::va_reserve), 2u);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(2 * k_page));
  EXPECT_EQ(a.sim->destroyed_stream_calls(), 0u);
  a.alloc.check_invariants();
  // The domain still sleeps and wakes: its pool kept only its own pages.
  a.alloc.sleep(5, /*keep_contents=*/false);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(k_page));
  a.alloc.wake(5);
  a.alloc.check_invariants();
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
}

// Free memory while a tag sleeps: its blocks stay allocated (active) but no reserved page backs
// them, so they are not subtracted from what is reserved.
TEST(Sleep, FreeBytesCountOnlyTheAwakeBlocks) {
  sim_allocator a(expandable(), host_backed(4 * GiB));
  void* tagged = nullptr;
  {
    in_domain d(4);
    tagged = a.alloc.allocate(8 * MiB);
  }
  void* cached = a.alloc.allocate(4 * MiB);  // untagged, freed: 2 idle pages
  a.alloc.deallocate(cached);
  EXPECT_EQ(a.stats().free_bytes, 4 * MiB);
  a.alloc.sleep(4, /*keep_contents=*/false);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(4 * MiB));
  EXPECT_EQ(a.stats().free_bytes, 4 * MiB);  // was 0: 4 MiB reserved minus 8 MiB active
  a.alloc.wake(4);
  EXPECT_EQ(a.stats().free_bytes, 4 * MiB);
  a.alloc.deallocate(tagged);
  a.alloc.check_invariants();
}

// Overhead fragmentation is the share of reserved memory that no block uses (issue 30): a
// sleeping tag's blocks stay allocated while nothing reserved backs them, so they count on
// neither side -- it was 1 - 8 / 4 = -1 here. Every relation of the field table holds
// throughout.
TEST(Sleep, OverheadFragmentationCountsOnlyWhatIsReserved) {
  sim_allocator a(expandable(), host_backed(4 * GiB));
  void* tagged = nullptr;
  {
    in_domain d(4);
    tagged = a.alloc.allocate(8 * MiB);
  }
  void* cached = a.alloc.allocate(4 * MiB);  // untagged, freed: 2 idle pages
  a.alloc.deallocate(cached);
  device_stats s = a.stats();
  EXPECT_DOUBLE_EQ(s.overhead_fragmentation(), 4.0 / 12.0);
  EXPECT_EQ(violated_stats_relation(s, true), "");
  a.alloc.sleep(4, /*keep_contents=*/false);
  s = a.stats();
  EXPECT_EQ(s.reserved_bytes[0].current, static_cast<std::int64_t>(4 * MiB));
  EXPECT_EQ(s.allocated_bytes[0].current, static_cast<std::int64_t>(8 * MiB));
  EXPECT_DOUBLE_EQ(s.overhead_fragmentation(), 1.0);  // all that is reserved is cache
  EXPECT_EQ(violated_stats_relation(s, true), "");
  a.alloc.wake(4);
  s = a.stats();
  EXPECT_DOUBLE_EQ(s.overhead_fragmentation(), 4.0 / 12.0);
  EXPECT_EQ(violated_stats_relation(s, true), "");
  a.alloc.deallocate(tagged);
  a.alloc.check_invariants();
}

TEST(Sleep, ADomainsBlocksShareNoPageWithOthers) {
  sim_allocator a(expandable(), host_backed(4 * GiB));
  std::set<std::uintptr_t> untagged, tagged, other_tag;
  auto alloc_into = [&](std::set<std::uintptr_t>& pages, std::size_t bytes) {
    void* p = a.alloc.allocate(bytes);
    for (auto pg : pages_of(p, bytes)) pages.insert(pg);
  };
  std::mt19937_64 rng(42);
  for (int i = 0; i < 300; ++i) {
    const std::size_t bytes = std::size_t{512} << (rng() % 16);  // 512 B .. 16 MiB
    switch (rng() % 3) {
      case 0:
        alloc_into(untagged, bytes);
        break;
      case 1: {
        in_domain d(1);
        alloc_into(tagged, bytes);
        break;
      }
      default: {
        in_domain d(2);
        alloc_into(other_tag, bytes);
        break;
      }
    }
  }
  for (auto pg : tagged) {
    EXPECT_FALSE(untagged.contains(pg));
    EXPECT_FALSE(other_tag.contains(pg));
  }
  for (auto pg : other_tag) EXPECT_FALSE(untagged.contains(pg));
  for (const segment_view& v : a.alloc.segments()) {
    EXPECT_TRUE(v.sleep_domain == 0 || v.sleep_domain == 1 || v.sleep_domain == 2);
  }
  a.alloc.check_invariants();
}

TEST(Sleep, MisusesAreClearErrorsThatChangeNothing) {
  sim_allocator a(expandable(), host_backed(4 * GiB));
  void* p = nullptr;
  {
    in_domain d(5);
    p = a.alloc.allocate(4 * MiB);
  }
  fill(*a.sim, p, 4 * MiB, 99);
  EXPECT_THROW(a.alloc.sleep(0, true), invalid_argument);
  EXPECT_THROW(a.alloc.sleep(1u << 14, true), invalid_argument);
  EXPECT_THROW(
      {
        try {
          a.alloc.wake(5, "infer");
        } catch (const invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("tag 'infer'"), std::string::npos) << e.what();
          EXPECT_NE(std::string(e.what()).find("is not asleep"), std::string::npos) << e.what();
          throw;
        }
      },
      invalid_argument);
  a.alloc.sleep(5, true, "infer");
  const auto asleep_stats = a.stats();
  // Double sleep.
  EXPECT_THROW(
      {
        try {
          a.alloc.sleep(5, true, "infer");
        } catch (const invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("asleep already"), std::string::npos) << e.what();
          throw;
        }
      },
      invalid_argument);
  // Free of a sleeping block: refused, the block stays live.
  EXPECT_THROW(
      {
        try {
          a.alloc.deallocate(p);
        } catch (const invalid_argument& e) {
          EXPECT_NE(std::string(e.what()).find("tag 'infer', which is asleep"), std::string::npos)
              << e.what();
          throw;
        }
      },
      invalid_argument);
  EXPECT_THROW(static_cast<void>(a.alloc.try_deallocate(p, nullptr, false)), invalid_argument);
  EXPECT_EQ(a.alloc.allocation_size(p), 4 * MiB);
  // Allocation under the sleeping domain: refused, nothing allocated.
  {
    in_domain d(5);
    EXPECT_THROW(
        {
          try {
            static_cast<void>(a.alloc.allocate(MiB));
          } catch (const invalid_argument& e) {
            EXPECT_NE(std::string(e.what()).find("asleep; wake it before allocating"),
                      std::string::npos)
                << e.what();
            throw;
          }
        },
        invalid_argument);
    // On another stream too: the domain's pool of that stream is asleep with it.
    EXPECT_THROW(static_cast<void>(a.alloc.allocate(MiB, stream(0x40))), invalid_argument);
  }
  const auto after = a.stats();
  EXPECT_EQ(after.allocated_bytes[0].current, asleep_stats.allocated_bytes[0].current);
  EXPECT_EQ(after.reserved_bytes[0].current, asleep_stats.reserved_bytes[0].current);
  EXPECT_EQ(after.sleeping_bytes, asleep_stats.sleeping_bytes);
  a.alloc.check_invariants();
  // Other domains and untagged allocations go on.
  void* q = a.alloc.allocate(MiB);
  a.alloc.deallocate(q);
  a.alloc.wake(5, "infer");
  EXPECT_TRUE(holds(*a.sim, p, 4 * MiB, 99));
  // Double wake.
  EXPECT_THROW(a.alloc.wake(5), invalid_argument);
  a.alloc.deallocate(p);
  a.alloc.check_invariants();
}

TEST(Sleep, DefaultModeIsRefused) {
  sim_allocator a(config{}, host_backed(4 * GiB));
  try {
    a.alloc.sleep(1, true, "train");
    FAIL() << "sleep in the default mode";
  } catch (const cuda_error& e) {
    EXPECT_EQ(e.code(), 801);
    EXPECT_NE(std::string(e.what()).find("needs expandable segments"), std::string::npos)
        << e.what();
  }
}

TEST(Sleep, WakeWithoutRoomLeavesTheDomainAsleepAndSaysWhatIsMissing) {
  sim_allocator a(expandable("memory_limit:64MiB"), host_backed(4 * GiB));
  void* mine = nullptr;
  {
    in_domain d(9);
    mine = a.alloc.allocate(20 * MiB);
  }
  fill(*a.sim, mine, 20 * MiB, 3);
  a.alloc.sleep(9, true);
  void* big = a.alloc.allocate(50 * MiB);  // the room the domain had, and more
  const auto before = a.stats();
  try {
    a.alloc.wake(9);
    FAIL() << "wake without room";
  } catch (const out_of_memory& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("needs 20.00 MiB"), std::string::npos) << m;
    EXPECT_NE(m.find("room for 14.00 MiB: 6.00 MiB missing"), std::string::npos) << m;
    EXPECT_NE(m.find("stays asleep"), std::string::npos) << m;
  }
  EXPECT_TRUE(a.alloc.is_asleep(9));
  EXPECT_EQ(a.stats().reserved_bytes[0].current, before.reserved_bytes[0].current);
  EXPECT_EQ(a.stats().sleeping_bytes, 20 * MiB);
  a.alloc.check_invariants();
  expect_no_leak(a);
  a.alloc.deallocate(big);  // cached, idle: wake gives it back
  a.alloc.wake(9);
  EXPECT_TRUE(holds(*a.sim, mine, 20 * MiB, 3));
  a.alloc.check_invariants();
  a.alloc.deallocate(mine);
}

TEST(Sleep, AFailedMapDuringWakeUndoesEverythingItMapped) {
  // Blocks of 6 MiB (3 pages each). With one handle per page the 5th map fails part way through a
  // block; with coarse handles (one chunk per block) the 3rd map, the third block's.
  for (const auto& [extra, failing_map] :
       {std::pair<std::string, int>{"coarse_handles:0", 5}, {"coarse_handles:8", 3}}) {
    SCOPED_TRACE(extra);
    sim_allocator a(expandable(extra), host_backed(4 * GiB));
    std::vector<void*> mine;
    {
      in_domain d(4);
      for (int i = 0; i < 4; ++i) mine.push_back(a.alloc.allocate(6 * MiB));
    }
    for (std::size_t i = 0; i < mine.size(); ++i) {
      fill(*a.sim, mine[i], 6 * MiB, static_cast<std::uint8_t>(i));
    }
    a.alloc.sleep(4, true);
    const std::size_t used_asleep = a.sim->used_bytes();
    a.sim->fail_nth(sim_call::map, failing_map);
    EXPECT_THROW(a.alloc.wake(4), cuda_error);
    EXPECT_TRUE(a.alloc.is_asleep(4));
    EXPECT_EQ(a.sim->used_bytes(), used_asleep);
    EXPECT_EQ(a.sim->live_mappings(), 0u);
    a.alloc.check_invariants();
    a.alloc.wake(4);
    for (std::size_t i = 0; i < mine.size(); ++i) {
      EXPECT_TRUE(holds(*a.sim, mine[i], 6 * MiB, static_cast<std::uint8_t>(i)));
    }
    a.alloc.check_invariants();
  }
}

TEST(Sleep, HostMemoryThatCannotBePinnedChangesNothing) {
  sim_allocator a(expandable(), host_backed(4 * GiB));
  {
    in_domain d(2);
    static_cast<void>(a.alloc.allocate(4 * MiB));
  }
  const std::int64_t reserved = a.reserved();
  a.sim->fail_nth(sim_call::host_alloc_pinned, 1);
  EXPECT_THROW(a.alloc.sleep(2, true), out_of_memory);
  EXPECT_FALSE(a.alloc.is_asleep(2));
  EXPECT_EQ(a.reserved(), reserved);
  a.alloc.check_invariants();
}

TEST(Sleep, PendingFreesAndQueuedWorkAreWaitedFor) {
  sim_allocator a(expandable(), host_backed(4 * GiB));
  void* p = nullptr;
  {
    in_domain d(6);
    p = a.alloc.allocate(4 * MiB);
    static_cast<void>(a.alloc.allocate(2 * MiB));
  }
  a.alloc.record_stream(p, stream(0x50));
  a.alloc.deallocate(p);  // pending on an event of stream 0x50
  EXPECT_EQ(a.sim->pending_events(), 1u);
  a.alloc.sleep(6, true);
  EXPECT_EQ(a.sim->pending_events(), 0u);  // waited for, not refused
  EXPECT_EQ(a.stats().sleeping_bytes, 2 * MiB);
  a.alloc.check_invariants();
  a.alloc.wake(6);
  a.alloc.check_invariants();
}

// --- failures part way (issue 30) ------------------------------------------------------------

/// A domain with blocks in two pools (two streams, small and large ranges) and cached pages, its
/// blocks filled with a pattern each.
struct failing_domain {
  std::vector<std::pair<void*, std::size_t>> blocks;
  explicit failing_domain(sim_allocator& a, std::uint32_t domain) {
    in_domain d(domain);
    for (std::size_t bytes : {std::size_t{4096}, 6 * MiB, 9 * MiB}) {
      blocks.emplace_back(a.alloc.allocate(bytes), bytes);
      blocks.emplace_back(a.alloc.allocate(bytes, stream(0x70)), bytes);
    }
    void* cached = a.alloc.allocate(8 * MiB);
    a.alloc.deallocate(cached);  // idle pages of the domain's pool
    std::uint8_t seed = 40;
    for (auto [p, n] : blocks) fill(*a.sim, p, n, seed++);
  }
  ::testing::AssertionResult mapped_and_kept(sim_allocator& a, bool contents) const {
    std::uint8_t seed = 40;
    for (auto [p, n] : blocks) {
      if (!a.sim->accessible(p, n)) return ::testing::AssertionFailure() << p << " is not mapped";
      if (contents) {
        auto r = holds(*a.sim, p, n, seed);
        if (!r) return r;
      }
      ++seed;
    }
    return ::testing::AssertionSuccess();
  }
};

TEST(Sleep, AFailedUnmapOrReleaseRollsTheSleepBackAtEveryStep) {
  // Every unmap (and every handle release) sleep makes, failed in turn: the sleep throws and the
  // domain is awake, every page of its live blocks mapped again (with their contents when kept),
  // the invariants hold and nothing leaks; sleep and wake then work.
  for (const sim_call kind : {sim_call::unmap, sim_call::phys_release}) {
    for (const bool keep : {true, false}) {
      bool reached_the_end = false;
      for (std::uint64_t k = 1; k < 200 && !reached_the_end; ++k) {
        SCOPED_TRACE(::testing::Message() << (kind == sim_call::unmap ? "unmap " : "release ") << k
                                          << (keep ? ", keep contents" : ", drop contents"));
        sim_allocator a(expandable(), host_backed(256 * MiB));
        const failing_domain dom(a, 3);
        const std::int64_t allocated = a.allocated();
        a.sim->fail_nth(kind, k);
        try {
          a.alloc.sleep(3, keep);
          reached_the_end = true;  // k is past the last call: the sleep did it all
        } catch (const cuda_error& e) {
          const std::string m = e.what();
          EXPECT_NE(m.find("stays awake"), std::string::npos) << m;
        }
        if (reached_the_end) {
          ASSERT_GT(k, 4u) << "the sleep made no call of that kind";
          a.sim->fail_nth(kind, 0);
          EXPECT_TRUE(a.alloc.is_asleep(3));
          a.alloc.check_invariants();
          a.alloc.wake(3);
          EXPECT_TRUE(dom.mapped_and_kept(a, keep));
          break;
        }
        EXPECT_FALSE(a.alloc.is_asleep(3));
        a.alloc.check_invariants();
        expect_no_leak(a);
        EXPECT_EQ(a.allocated(), allocated);
        EXPECT_TRUE(dom.mapped_and_kept(a, keep));
        a.alloc.sleep(3, keep);
        a.alloc.check_invariants();
        a.alloc.wake(3);
        a.alloc.check_invariants();
        EXPECT_TRUE(dom.mapped_and_kept(a, keep));
      }
      EXPECT_TRUE(reached_the_end);
    }
  }
}

// --- several domains in one call (device_allocator::sleep(std::span), wake(std::span)) ---------

using sleep_request = device_allocator::sleep_request;
using wake_request = device_allocator::wake_request;

/// Domains 3 (kept), 4 (dropped) and 6 (kept) each with the blocks of failing_domain, and an
/// untagged block; the sims of two allocators built this way behave the same.
struct three_domains {
  failing_domain d3;
  failing_domain d4;
  failing_domain d6;
  void* other;
  explicit three_domains(sim_allocator& a)
      : d3(a, 3), d4(a, 4), d6(a, 6), other(a.alloc.allocate(3 * MiB)) {
    fill(*a.sim, other, 3 * MiB, 1);
  }
};

const std::vector<sleep_request> k_three = {
    {3, true, "weights", {}}, {4, false, "kv_cache", {}}, {6, true, "graphs", {}}};

TEST(SleepTags, SeveralDomainsSleepAsOneAndWakeAsOneUnderOneSynchronization) {
  // The same program twice: one allocator sleeps the three domains one by one, the other in one
  // call. Every figure is the same, and the call synchronizes the device twice (before and after
  // the copies), the three single calls at least six times.
  sim_allocator one(expandable(), host_backed(4 * GiB));
  sim_allocator all(expandable(), host_backed(4 * GiB));
  const three_domains d1(one);
  const three_domains d(all);
  for (const sleep_request& r : k_three) one.alloc.sleep(r.domain, r.keep_contents, r.label);
  const auto syncs = all.sim->calls(sim_call::device_synchronize);
  all.alloc.sleep(k_three);
  EXPECT_EQ(all.sim->calls(sim_call::device_synchronize), syncs + 2);
  all.alloc.check_invariants();
  expect_no_leak(all);
  for (std::uint32_t dom : {3u, 4u, 6u}) EXPECT_TRUE(all.alloc.is_asleep(dom)) << dom;
  EXPECT_EQ(all.reserved(), one.reserved());
  EXPECT_EQ(all.sim->used_bytes(), one.sim->used_bytes());
  EXPECT_EQ(all.sim->pinned_bytes(), one.sim->pinned_bytes());
  const auto s1 = one.alloc.sleeping();
  const auto s = all.alloc.sleeping();
  ASSERT_EQ(s.size(), 3u);
  ASSERT_EQ(s1.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(s[i].domain, s1[i].domain);
    EXPECT_EQ(s[i].bytes, s1[i].bytes);
    EXPECT_EQ(s[i].host_bytes, s1[i].host_bytes);
  }
  EXPECT_EQ(s[1].host_bytes, 0u);  // kv_cache dropped
  EXPECT_GT(s[0].host_bytes, 0u);
  EXPECT_EQ(all.stats().sleeping_bytes, one.stats().sleeping_bytes);
  EXPECT_FALSE(all.sim->accessible(d.d3.blocks[2].first, 1));
  EXPECT_TRUE(holds(*all.sim, d.other, 3 * MiB, 1));

  const std::vector<wake_request> wake_all = {{6, "graphs"}, {3, "weights"}, {4, "kv_cache"}};
  const auto wake_syncs = all.sim->calls(sim_call::device_synchronize);
  all.alloc.wake(wake_all);
  EXPECT_EQ(all.sim->calls(sim_call::device_synchronize), wake_syncs + 1);  // the copies'
  all.alloc.check_invariants();
  expect_no_leak(all);
  EXPECT_TRUE(all.alloc.sleeping().empty());
  EXPECT_TRUE(d.d3.mapped_and_kept(all, true));
  EXPECT_TRUE(d.d4.mapped_and_kept(all, false));
  EXPECT_TRUE(d.d6.mapped_and_kept(all, true));
  for (std::uint32_t dom : {3u, 4u, 6u}) one.alloc.wake(dom);
  EXPECT_EQ(all.reserved(), one.reserved());
  EXPECT_EQ(all.sim->used_bytes(), one.sim->used_bytes());
  // The kept domains keep their buffers for the next sleep, as after single wakes.
  EXPECT_EQ(all.alloc.sleep_buffer_bytes(3), one.alloc.sleep_buffer_bytes(3));
  EXPECT_EQ(all.alloc.sleep_buffer_bytes(6), one.alloc.sleep_buffer_bytes(6));
  EXPECT_EQ(all.alloc.sleep_buffer_bytes(4), 0u);

  // Nothing kept: one synchronization (the first release's), for the whole call.
  const std::vector<sleep_request> drop = {{3, false, "weights", {}}, {4, false, "kv_cache", {}}};
  const auto drop_syncs = all.sim->calls(sim_call::device_synchronize);
  all.alloc.sleep(drop);
  EXPECT_EQ(all.sim->calls(sim_call::device_synchronize), drop_syncs + 1);
  EXPECT_EQ(all.alloc.sleep_buffer_bytes(3), 0u);  // a drop frees the domain's buffer
  all.alloc.check_invariants();
  const std::vector<wake_request> wake_two = {{3, {}}, {4, {}}};
  all.alloc.wake(wake_two);
  EXPECT_TRUE(d.d3.mapped_and_kept(all, false));
  all.alloc.check_invariants();
  expect_no_leak(all);
}

/// What a refused call must leave as it was.
struct snapshot {
  std::int64_t reserved;
  std::size_t used;
  std::size_t pinned;
  std::vector<std::size_t> spares;
  std::vector<bool> asleep;
  snapshot(sim_allocator& a, const std::vector<std::uint32_t>& domains)
      : reserved(a.reserved()), used(a.sim->used_bytes()), pinned(a.sim->pinned_bytes()) {
    for (std::uint32_t d : domains) {
      spares.push_back(a.alloc.sleep_buffer_bytes(d));
      asleep.push_back(a.alloc.is_asleep(d));
    }
  }
  bool operator==(const snapshot&) const = default;
};

TEST(SleepTags, EveryRefusalChangesNothingForAnyDomain) {
  sim_allocator a(expandable(), host_backed(4 * GiB));
  const failing_domain d3(a, 3);
  const failing_domain d4(a, 4);
  const failing_domain d5(a, 5);
  a.alloc.sleep(5, true, "asleep");
  EXPECT_GT(a.alloc.prepare_sleep(4), 0u);  // a spare buffer that must stay as it is
  const std::vector<std::uint32_t> doms = {3, 4, 5};
  const snapshot before(a, doms);
  const auto refused = [&](const std::vector<sleep_request>& req, const std::string& words) {
    SCOPED_TRACE(words);
    try {
      a.alloc.sleep(req);
      ADD_FAILURE() << "not refused";
    } catch (const error& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("nothing changed"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(snapshot(a, doms) == before);
    a.alloc.check_invariants();
    expect_no_leak(a);
    EXPECT_TRUE(d3.mapped_and_kept(a, true));
    EXPECT_TRUE(d4.mapped_and_kept(a, true));
  };
  refused({{3, true, "w", {}}, {3, false, "w", {}}}, "tag 'w' on device 0 is named twice");
  refused({{3, true, "w", {}}, {4, true, "kv", {}}, {5, true, "asleep", {}}},
          "tag 'asleep' on device 0 is asleep already");
  refused({{3, true, "w", {}}, {0, true, "zero", {}}}, "sleep domain 0 is not in [1, 16383]");
  refused({{3, true, "w", {}},
           {4, false, "kv",
            [](std::size_t) { throw invalid_argument("cucache: front end says no; nothing changed"); }}},
          "front end says no");
  // An exported block in the second domain.
  a.alloc.note_ipc_export(d4.blocks[2].first);
  refused({{3, true, "w", {}}, {4, false, "kv", {}}}, "exported to other processes");
  EXPECT_THROW(a.alloc.sleep(std::vector<sleep_request>{}), invalid_argument);
  EXPECT_TRUE(snapshot(a, doms) == before);
  // Blocks held for a graph in the second domain's pools: the graph checkpoint tests' setup is
  // heavy; the single-domain refusal (sleep_test's graph case) runs the same loop.
  a.alloc.wake(5);
  a.alloc.check_invariants();
  EXPECT_TRUE(d5.mapped_and_kept(a, true));
}

TEST(SleepTags, AHostThatCannotPinTheSecondCopyChangesNothingForTheFirst) {
  sim_allocator a(expandable(), host_backed(4 * GiB));
  const failing_domain d3(a, 3);
  const failing_domain d4(a, 4);
  const std::vector<std::uint32_t> doms = {3, 4};
  const snapshot before(a, doms);
  a.sim->fail_nth(sim_call::host_alloc_pinned, 2);  // the second domain's buffer
  try {
    a.alloc.sleep(std::vector<sleep_request>{{3, true, "w", {}}, {4, true, "kv", {}}});
    ADD_FAILURE() << "not refused";
  } catch (const out_of_memory& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("tag 'kv' on device 0: cannot pin"), std::string::npos) << m;
    EXPECT_NE(m.find("nothing changed (and no tag of the call sleeps)"), std::string::npos) << m;
  }
  EXPECT_TRUE(snapshot(a, doms) == before);
  EXPECT_EQ(a.sim->calls(sim_call::host_free_pinned), 1u);  // the first domain's new buffer
  EXPECT_EQ(a.sim->live_pinned(), 0u);
  a.alloc.check_invariants();
  expect_no_leak(a);
  EXPECT_TRUE(d3.mapped_and_kept(a, true));
  EXPECT_TRUE(d4.mapped_and_kept(a, true));
  a.sim->fail_nth(sim_call::host_alloc_pinned, 0);
  a.alloc.sleep(std::vector<sleep_request>{{3, true, "w", {}}, {4, true, "kv", {}}});
  a.alloc.wake(std::vector<wake_request>{{3, {}}, {4, {}}});
  EXPECT_TRUE(d3.mapped_and_kept(a, true));
  EXPECT_TRUE(d4.mapped_and_kept(a, true));
}

TEST(SleepTags, AFailedReleaseRollsThatDomainBackLeavesTheEarlierAsleepAndTheLaterUntouched) {
  // How many unmaps each domain's sleep makes, from single sleeps of the same program.
  std::vector<std::uint64_t> unmaps;
  {
    sim_allocator a(expandable(), host_backed(512 * MiB));
    const three_domains d(a);
    for (const sleep_request& r : k_three) {
      const auto before = a.sim->calls(sim_call::unmap);
      a.alloc.sleep(r.domain, r.keep_contents, r.label);
      unmaps.push_back(a.sim->calls(sim_call::unmap) - before);
    }
  }
  ASSERT_GT(unmaps[0], 2u);
  const std::uint64_t total = unmaps[0] + unmaps[1] + unmaps[2];
  for (std::uint64_t k = 1; k <= total; ++k) {
    // The domain whose release fails: 0, 1 or 2.
    const std::size_t failing = k <= unmaps[0] ? 0 : k <= unmaps[0] + unmaps[1] ? 1 : 2;
    SCOPED_TRACE(::testing::Message() << "unmap " << k << ", failing domain index " << failing);
    sim_allocator a(expandable(), host_backed(512 * MiB));
    const three_domains d(a);
    const std::vector<const failing_domain*> doms = {&d.d3, &d.d4, &d.d6};
    a.sim->fail_nth(sim_call::unmap, k);
    try {
      a.alloc.sleep(k_three);
      ADD_FAILURE() << "the failed unmap was not reported";
    } catch (const cuda_error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(fmt::format("tag '{}' on device 0: releasing its pages failed part way",
                                   k_three[failing].label)),
                std::string::npos)
          << m;
      EXPECT_NE(m.find("stays awake"), std::string::npos) << m;
      if (failing == 0) {
        EXPECT_EQ(m.find("slept before the failure"), std::string::npos) << m;
      }
      if (failing == 1) {
        EXPECT_NE(m.find("tag 'weights' slept before the failure and stays asleep"),
                  std::string::npos)
            << m;
      }
      if (failing == 2) {
        EXPECT_NE(m.find("tag 'weights', tag 'kv_cache' slept before the failure and stay asleep"),
                  std::string::npos)
            << m;
        EXPECT_EQ(m.find("not touched"), std::string::npos) << m;
      }
      if (failing == 0) {
        EXPECT_NE(m.find("tag 'kv_cache', tag 'graphs' were not touched and stay awake"),
                  std::string::npos)
            << m;
      }
      if (failing == 1) {
        EXPECT_NE(m.find("tag 'graphs' was not touched and stays awake"), std::string::npos) << m;
      }
    }
    a.sim->fail_nth(sim_call::unmap, 0);
    a.alloc.check_invariants();
    expect_no_leak(a);
    for (std::size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(a.alloc.is_asleep(k_three[i].domain), i < failing) << i;
      if (i >= failing) {
        // Rolled back (the failing one: its kept bytes copied back; dropped bytes may be lost)
        // or untouched (every byte in place).
        EXPECT_TRUE(doms[i]->mapped_and_kept(a, i > failing || k_three[i].keep_contents)) << i;
      }
    }
    // The untouched kept domain's copy became its spare buffer.
    if (failing < 2) {
      EXPECT_GT(a.alloc.sleep_buffer_bytes(6), 0u);
    }
    // The rest of the call, then a wake of everything: every kept byte back.
    std::vector<sleep_request> rest(k_three.begin() + static_cast<std::ptrdiff_t>(failing),
                                    k_three.end());
    a.alloc.sleep(rest);
    a.alloc.check_invariants();
    a.alloc.wake(std::vector<wake_request>{{3, {}}, {4, {}}, {6, {}}});
    a.alloc.check_invariants();
    expect_no_leak(a);
    EXPECT_TRUE(d.d3.mapped_and_kept(a, true));
    EXPECT_TRUE(d.d6.mapped_and_kept(a, true));
    EXPECT_TRUE(holds(*a.sim, d.other, 3 * MiB, 1));
  }
}

TEST(SleepTags, WakeOfSeveralIsAllOrNone) {
  sim_allocator a(expandable("memory_limit:96MiB"), host_backed(4 * GiB));
  void* p = nullptr;
  void* q = nullptr;
  {
    in_domain d(3);
    p = a.alloc.allocate(20 * MiB);
  }
  {
    in_domain d(4);
    q = a.alloc.allocate(20 * MiB);
  }
  fill(*a.sim, p, 20 * MiB, 5);
  fill(*a.sim, q, 20 * MiB, 6);
  a.alloc.sleep(std::vector<sleep_request>{{3, true, "w", {}}, {4, true, "kv", {}}});
  const std::vector<std::uint32_t> doms = {3, 4};
  const auto refused = [&](const std::vector<wake_request>& req, const std::string& words) {
    SCOPED_TRACE(words);
    const snapshot before(a, doms);
    try {
      a.alloc.wake(req);
      ADD_FAILURE() << "not refused";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
    // Asleep as before, nothing of them mapped; only other pools' cached pages may have been
    // given back (a wake short of room gives them back first, as a single wake does).
    const snapshot after(a, doms);
    EXPECT_EQ(after.asleep, before.asleep);
    EXPECT_EQ(after.spares, before.spares);
    EXPECT_EQ(after.pinned, before.pinned);
    EXPECT_LE(after.reserved, before.reserved);
    EXPECT_LE(after.used, before.used);
    EXPECT_FALSE(a.sim->accessible(p, 1));
    EXPECT_FALSE(a.sim->accessible(q, 1));
    EXPECT_EQ(a.stats().sleeping_bytes, 40 * MiB);
    a.alloc.check_invariants();
    expect_no_leak(a);
  };
  refused({{3, "w"}, {3, "w"}}, "tag 'w' on device 0 is named twice");
  {
    in_domain d(5);
    void* r = a.alloc.allocate(MiB);
    refused({{3, "w"}, {5, "awake"}}, "tag 'awake' on device 0 is not asleep; nothing changed");
    a.alloc.deallocate(r);
  }
  // Room for one of them but not both: both stay asleep.
  void* big = a.alloc.allocate(60 * MiB);
  refused({{3, "w"}, {4, "kv"}},
          "tag 'w', tag 'kv' on device 0 need 40.00 MiB of device memory to map their 20 page(s)");
  a.alloc.deallocate(big);
  a.alloc.wake(std::vector<wake_request>{{4, {}}, {3, {}}});
  EXPECT_TRUE(holds(*a.sim, p, 20 * MiB, 5));
  EXPECT_TRUE(holds(*a.sim, q, 20 * MiB, 6));
  a.alloc.check_invariants();
  expect_no_leak(a);
}

TEST(SleepTags, AFailedCopyBackWakesNoneOfThem) {
  sim_allocator a(expandable(), host_backed(4 * GiB));
  const failing_domain d3(a, 3);
  const failing_domain d4(a, 4);
  a.alloc.sleep(std::vector<sleep_request>{{3, true, "w", {}}, {4, true, "kv", {}}});
  const std::size_t used_asleep = a.sim->used_bytes();
  a.sim->fail_nth(sim_call::copy_async, 3);  // a copy of the second domain's
  EXPECT_THROW(a.alloc.wake(std::vector<wake_request>{{3, {}}, {4, {}}}), cuda_error);
  EXPECT_TRUE(a.alloc.is_asleep(3));
  EXPECT_TRUE(a.alloc.is_asleep(4));
  EXPECT_EQ(a.sim->used_bytes(), used_asleep);
  a.alloc.check_invariants();
  expect_no_leak(a);
  a.sim->fail_nth(sim_call::copy_async, 0);
  a.alloc.wake(std::vector<wake_request>{{3, {}}, {4, {}}});
  EXPECT_TRUE(d3.mapped_and_kept(a, true));
  EXPECT_TRUE(d4.mapped_and_kept(a, true));
  a.alloc.check_invariants();
}

TEST(Sleep, AFailedCopyBackDuringWakeLeavesItAsleepAndWakeableAgain) {
  sim_allocator a(expandable(), host_backed(4 * GiB));
  const failing_domain dom(a, 5);
  a.alloc.sleep(5, true);
  const std::size_t used_asleep = a.sim->used_bytes();
  a.sim->fail_nth(sim_call::copy_async, 2);
  EXPECT_THROW(a.alloc.wake(5), cuda_error);
  EXPECT_TRUE(a.alloc.is_asleep(5));
  EXPECT_EQ(a.sim->used_bytes(), used_asleep);
  a.alloc.check_invariants();
  a.alloc.wake(5);
  a.alloc.check_invariants();
  EXPECT_TRUE(dom.mapped_and_kept(a, true));
}

TEST(Sleep, AFailedCopyOutDuringSleepChangesNothingAndFreesTheBuffer) {
  sim_allocator a(expandable(), host_backed(4 * GiB));
  const failing_domain dom(a, 5);
  const std::int64_t reserved = a.reserved();
  a.sim->fail_nth(sim_call::copy_async, 3);
  EXPECT_THROW(a.alloc.sleep(5, true), cuda_error);
  EXPECT_FALSE(a.alloc.is_asleep(5));
  EXPECT_EQ(a.reserved(), reserved);
  EXPECT_EQ(a.sim->calls(sim_call::host_free_pinned), a.sim->calls(sim_call::host_alloc_pinned));
  a.alloc.check_invariants();
  EXPECT_TRUE(dom.mapped_and_kept(a, true));
}

// prepare_sleep pins the buffer of the next kept sleep ahead (issue 33: cudaHostAlloc of 9 GiB took
// 3.3 s of the first kept sleep on the H200): that sleep pins nothing, a larger request replaces a
// smaller buffer, a sleep without contents frees it, and while asleep it is refused.
TEST(Sleep, PrepareSleepPinsAheadSoTheFirstKeptSleepPinsNothing) {
  sim_allocator a(expandable(), host_backed(4 * GiB));
  const std::vector<std::pair<void*, std::size_t>> mine = domain_blocks(a, 7);
  const std::size_t run_bytes = 512 + 100'352 + 5 * MiB + 40 * MiB;  // block sizes, rounded
  EXPECT_EQ(a.alloc.sleep_buffer_bytes(7), 0u);
  EXPECT_EQ(a.alloc.prepare_sleep(7, 0, "train"), run_bytes);
  EXPECT_EQ(a.sim->calls(sim_call::host_alloc_pinned), 1u);
  EXPECT_EQ(a.sim->pinned_bytes(), run_bytes);
  EXPECT_EQ(a.alloc.sleep_buffer_bytes(7), run_bytes);
  // Large enough already: nothing pinned again; a smaller request gets the same buffer.
  EXPECT_EQ(a.alloc.prepare_sleep(7), run_bytes);
  EXPECT_EQ(a.alloc.prepare_sleep(7, 1 * MiB), run_bytes);
  EXPECT_EQ(a.sim->calls(sim_call::host_alloc_pinned), 1u);
  // A larger one (room for the tag to grow) replaces it.
  EXPECT_EQ(a.alloc.prepare_sleep(7, 64 * MiB), 64 * MiB);
  EXPECT_EQ(a.sim->calls(sim_call::host_alloc_pinned), 2u);
  EXPECT_EQ(a.sim->calls(sim_call::host_free_pinned), 1u);
  EXPECT_EQ(a.sim->pinned_bytes(), 64 * MiB);
  EXPECT_EQ(a.sim->live_pinned(), 1u);
  a.alloc.check_invariants();

  // The first kept sleep copies into it: nothing pinned, nothing freed.
  a.alloc.sleep(7, /*keep_contents=*/true, "train");
  EXPECT_EQ(a.sim->calls(sim_call::host_alloc_pinned), 2u);
  EXPECT_EQ(a.sim->calls(sim_call::host_free_pinned), 1u);
  EXPECT_EQ(a.stats().sleeping_host_bytes, run_bytes);
  EXPECT_EQ(a.alloc.sleep_buffer_bytes(7), 0u);  // it holds the contents now
  try {
    static_cast<void>(a.alloc.prepare_sleep(7, 0, "train"));
    ADD_FAILURE() << "prepare_sleep of a sleeping domain was not refused";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tag 'train' on device 0 is asleep"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(a.sim->pinned_bytes(), 64 * MiB);
  a.alloc.check_invariants();
  a.alloc.wake(7, "train");
  std::uint8_t seed = 10;
  for (auto [p, n] : mine) EXPECT_TRUE(holds(*a.sim, p, n, seed++));
  EXPECT_EQ(a.alloc.sleep_buffer_bytes(7), 64 * MiB);  // kept after wake, whole
  EXPECT_EQ(a.sim->pinned_bytes(), 64 * MiB);

  // A sleep without contents frees it; the next prepare pins again.
  a.alloc.sleep(7, /*keep_contents=*/false, "train");
  EXPECT_EQ(a.sim->pinned_bytes(), 0u);
  EXPECT_EQ(a.sim->live_pinned(), 0u);
  EXPECT_EQ(a.alloc.sleep_buffer_bytes(7), 0u);
  a.alloc.wake(7, "train");
  EXPECT_EQ(a.alloc.prepare_sleep(7), run_bytes);
  EXPECT_EQ(a.sim->calls(sim_call::host_alloc_pinned), 3u);

  // A domain with nothing allocated pins nothing for bytes 0, and what it is asked for otherwise.
  EXPECT_EQ(a.alloc.prepare_sleep(8), 0u);
  EXPECT_EQ(a.sim->calls(sim_call::host_alloc_pinned), 3u);
  EXPECT_EQ(a.alloc.prepare_sleep(8, 3 * MiB), 3 * MiB);
  EXPECT_EQ(a.sim->pinned_bytes(), run_bytes + 3 * MiB);
  // Out of range and the default mode are refused.
  EXPECT_THROW(static_cast<void>(a.alloc.prepare_sleep(0)), invalid_argument);
  EXPECT_THROW(static_cast<void>(a.alloc.prepare_sleep(16384)),
               invalid_argument);
  sim_allocator plain(config{}, host_backed(4 * GiB));
  try {
    static_cast<void>(plain.alloc.prepare_sleep(7));
    ADD_FAILURE() << "prepare_sleep in the default mode was not refused";
  } catch (const cuda_error& e) {
    EXPECT_EQ(e.code(), 801);
  }
  EXPECT_EQ(plain.sim->calls(sim_call::host_alloc_pinned), 0u);
  a.alloc.check_invariants();
  expect_no_leak(a);
}

// The host refusing to pin (the sim's pinned_capacity_bytes, as cudaHostAlloc's
// cudaErrorMemoryAllocation) refuses prepare_sleep and a kept sleep with nothing changed: the tag
// stays awake, every byte in place, the buffer it had still held.
TEST(Sleep, PinningTheHostRefusesLeavesTheTagAwakeAndEveryByteInPlace) {
  sim_options o = host_backed(4 * GiB);
  o.pinned_capacity_bytes = 16 * MiB;
  sim_allocator a(expandable(), o);
  void* p = nullptr;
  void* q = nullptr;
  {
    in_domain d(4);
    p = a.alloc.allocate(10 * MiB);
  }
  fill(*a.sim, p, 10 * MiB, 3);
  EXPECT_EQ(a.alloc.prepare_sleep(4), 10 * MiB);
  const std::int64_t reserved = a.reserved();
  try {
    static_cast<void>(a.alloc.prepare_sleep(4, 20 * MiB, "weights"));
    ADD_FAILURE() << "pinning 20 MiB beyond the host's 16 MiB was not refused";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("tag 'weights' on device 0: cannot pin 20"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(a.alloc.sleep_buffer_bytes(4), 10 * MiB);  // the buffer it had
  EXPECT_EQ(a.reserved(), reserved);
  EXPECT_EQ(a.sim->pinned_bytes(), 10 * MiB);
  // The tag grows to 14 MiB: a kept sleep needs a 14 MiB buffer. The host cannot pin it beside
  // the 10 MiB one, so that one is freed first and 14 MiB pinned in its place.
  {
    in_domain d(4);
    q = a.alloc.allocate(4 * MiB);
  }
  fill(*a.sim, q, 4 * MiB, 9);
  a.alloc.sleep(4, /*keep_contents=*/true, "weights");
  EXPECT_EQ(a.sim->pinned_bytes(), 14 * MiB);
  EXPECT_EQ(a.sim->live_pinned(), 1u);
  a.alloc.wake(4, "weights");
  EXPECT_TRUE(holds(*a.sim, p, 10 * MiB, 3));
  EXPECT_TRUE(holds(*a.sim, q, 4 * MiB, 9));
  // Grown past what the host can pin at all: refused, awake, every byte in place, and the
  // message says the smaller buffer went.
  void* r = nullptr;
  {
    in_domain d(4);
    r = a.alloc.allocate(4 * MiB);
  }
  fill(*a.sim, r, 4 * MiB, 17);
  const std::int64_t reserved_grown = a.reserved();
  try {
    a.alloc.sleep(4, /*keep_contents=*/true, "weights");
    ADD_FAILURE() << "a kept sleep of 18 MiB beyond the host's 16 MiB was not refused";
  } catch (const out_of_memory& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("it stays awake with every byte in place (its smaller pinned buffer of 14"),
              std::string::npos)
        << what;
  }
  EXPECT_FALSE(a.alloc.is_asleep(4));
  EXPECT_EQ(a.reserved(), reserved_grown);
  EXPECT_TRUE(holds(*a.sim, p, 10 * MiB, 3));
  EXPECT_TRUE(holds(*a.sim, q, 4 * MiB, 9));
  EXPECT_TRUE(holds(*a.sim, r, 4 * MiB, 17));
  EXPECT_EQ(a.sim->pinned_bytes(), 0u);
  a.alloc.check_invariants();
  // An injected refusal with a large enough buffer held is never reached: the buffer is used.
  a.alloc.deallocate(r);
  EXPECT_EQ(a.alloc.prepare_sleep(4), 14 * MiB);
  a.sim->fail_nth(sim_call::host_alloc_pinned, 1);
  a.alloc.sleep(4, /*keep_contents=*/true, "weights");
  a.alloc.wake(4, "weights");
  EXPECT_TRUE(holds(*a.sim, p, 10 * MiB, 3));
  EXPECT_TRUE(holds(*a.sim, q, 4 * MiB, 9));
  // Without any buffer, an injected refusal changes nothing at all.
  a.alloc.sleep(4, /*keep_contents=*/false);  // frees the buffer
  a.alloc.wake(4);
  fill(*a.sim, p, 10 * MiB, 3);
  fill(*a.sim, q, 4 * MiB, 9);
  a.sim->fail_nth(sim_call::host_alloc_pinned, 1);
  try {
    a.alloc.sleep(4, /*keep_contents=*/true, "weights");
    ADD_FAILURE() << "an injected pinning failure was not reported";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("every byte in place; nothing changed"),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(a.alloc.is_asleep(4));
  EXPECT_TRUE(holds(*a.sim, p, 10 * MiB, 3));
  EXPECT_TRUE(holds(*a.sim, q, 4 * MiB, 9));
  EXPECT_EQ(a.sim->pinned_bytes(), 0u);
  a.alloc.check_invariants();
  expect_no_leak(a);
}

// Issue 33: 1,000 cycles of three tags -- one always kept (prepared once), one always dropped,
// one alternating (prepared before each kept sleep, its buffer freed by each dropped one) --
// leave the pinned host bytes, the pinned blocks, the device's handles and mappings and the
// reserved bytes exactly where they started, and every kept byte exact.
TEST(Sleep, AThousandCyclesOfSeveralTagsGrowNothingAndKeepEveryByte) {
  sim_allocator a(expandable(), host_backed(4 * GiB));
  void* other = a.alloc.allocate(3 * MiB);  // untagged: mapped throughout
  fill(*a.sim, other, 3 * MiB, 1);
  std::map<std::uint32_t, std::vector<std::pair<void*, std::size_t>>> blocks;
  for (std::uint32_t d : {1U, 2U, 3U}) {
    in_domain in(d);
    for (std::size_t bytes : {std::size_t{512}, std::size_t{100'000}, 1 * MiB}) {
      blocks[d].emplace_back(a.alloc.allocate(bytes), bytes);
    }
  }
  {
    in_domain in(1);
    blocks[1].emplace_back(a.alloc.allocate(4 * MiB), 4 * MiB);  // a large-pool block too
  }
  const auto fill_domain = [&](std::uint32_t d) {
    std::uint8_t seed = static_cast<std::uint8_t>(d * 16);
    for (auto [p, n] : blocks[d]) fill(*a.sim, p, n, seed++);
  };
  const auto kept = [&](std::uint32_t d) {
    std::uint8_t seed = static_cast<std::uint8_t>(d * 16);
    for (auto [p, n] : blocks[d]) {
      auto r = holds(*a.sim, p, n, seed++);
      if (!r) return r;
    }
    return ::testing::AssertionSuccess();
  };
  for (std::uint32_t d : {1U, 2U, 3U}) fill_domain(d);
  const std::size_t small_run = 512 + 100'352 + 1 * MiB;
  const std::size_t run1 = small_run + 4 * MiB;
  const std::size_t run3 = small_run;
  ASSERT_EQ(a.alloc.prepare_sleep(1), run1);
  const std::int64_t reserved = a.reserved();
  const std::size_t handles = a.sim->live_handles();
  const std::size_t mappings = a.sim->live_mappings();
  const std::size_t used = a.sim->used_bytes();
  std::size_t reserved_asleep = 0;
  for (int cycle = 0; cycle < 1000; ++cycle) {
    const bool keep3 = cycle % 2 == 0;
    if (keep3) {
      ASSERT_EQ(a.alloc.prepare_sleep(3), run3) << "cycle " << cycle;
    }
    a.alloc.sleep(1, /*keep_contents=*/true);
    a.alloc.sleep(2, /*keep_contents=*/false);
    a.alloc.sleep(3, keep3);
    ASSERT_EQ(a.stats().sleeping_host_bytes, run1 + (keep3 ? run3 : 0)) << "cycle " << cycle;
    if (cycle == 0) reserved_asleep = static_cast<std::size_t>(a.reserved());
    ASSERT_EQ(static_cast<std::size_t>(a.reserved()), reserved_asleep) << "cycle " << cycle;
    ASSERT_EQ(a.sim->pinned_bytes(), run1 + (keep3 ? run3 : 0)) << "cycle " << cycle;
    a.alloc.wake(3);
    a.alloc.wake(2);
    a.alloc.wake(1);
    ASSERT_TRUE(kept(1)) << "cycle " << cycle;
    if (keep3) {
      ASSERT_TRUE(kept(3)) << "cycle " << cycle;
    } else {
      fill_domain(3);
    }
    fill_domain(2);
    ASSERT_EQ(a.sim->pinned_bytes(), run1 + (keep3 ? run3 : 0)) << "cycle " << cycle;
    ASSERT_EQ(a.sim->live_pinned(), keep3 ? 2u : 1u) << "cycle " << cycle;
    ASSERT_EQ(a.sim->live_handles(), handles) << "cycle " << cycle;
    ASSERT_EQ(a.sim->live_mappings(), mappings) << "cycle " << cycle;
    ASSERT_EQ(a.sim->used_bytes(), used) << "cycle " << cycle;
    ASSERT_EQ(a.reserved(), reserved) << "cycle " << cycle;
  }
  // Domain 1 pinned once (before the loop); domain 3 once per kept cycle, freed once per dropped
  // one; domain 2 never.
  EXPECT_EQ(a.sim->calls(sim_call::host_alloc_pinned), 1u + 500u);
  EXPECT_EQ(a.sim->calls(sim_call::host_free_pinned), 500u);
  EXPECT_TRUE(holds(*a.sim, other, 3 * MiB, 1));
  a.alloc.check_invariants();
  expect_no_leak(a);
}

TEST(Sleep, WakeWaitsForPendingFreesAsAnAllocationDoes) {
  // Issue 30, item 6: the room a stream-ordered free holds comes back once its stream's work
  // completes; wake waits for it, as the out-of-memory ladder does, before saying memory is
  // missing.
  sim_allocator a(expandable("memory_limit:64MiB"), host_backed(4 * GiB));
  void* mine = nullptr;
  {
    in_domain d(9);
    mine = a.alloc.allocate(30 * MiB);
  }
  fill(*a.sim, mine, 30 * MiB, 8);
  a.alloc.sleep(9, true);
  void* other = a.alloc.allocate(50 * MiB);
  a.alloc.record_stream(other, stream(0x51));
  a.alloc.deallocate(other);  // pending on an event of stream 0x51
  ASSERT_EQ(a.sim->pending_events(), 1u);
  a.alloc.wake(9);
  EXPECT_EQ(a.sim->pending_events(), 0u);
  EXPECT_FALSE(a.alloc.is_asleep(9));
  EXPECT_TRUE(holds(*a.sim, mine, 30 * MiB, 8));
  a.alloc.check_invariants();
  expect_no_leak(a);
  a.alloc.deallocate(mine);
}

// --- randomized ------------------------------------------------------------------------------

std::uint64_t seed_from_env(std::uint64_t fallback) {
  if (const char* s = std::getenv("CUCACHE_RANDOM_SEED")) return std::strtoull(s, nullptr, 10);
  return fallback;
}

struct live_block {
  void* p;
  std::size_t bytes;
  std::uint32_t domain;
  std::uint8_t seed;
};

class random_sleep : public ::testing::TestWithParam<std::string> {};

TEST_P(random_sleep, InvariantsHoldAfterEveryOperation) {
  const std::uint64_t seed = seed_from_env(0x5EE9ULL + std::hash<std::string>{}(GetParam()));
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with CUCACHE_RANDOM_SEED=" +
               std::to_string(seed) + ")");
  sim_allocator a(expandable(GetParam()), host_backed(1 * GiB));
  std::mt19937_64 rng(seed);
  std::vector<live_block> live;
  std::map<std::uint32_t, bool> asleep{{1, false}, {2, false}, {3, false}};
  std::map<std::uint32_t, bool> kept{{1, false}, {2, false}, {3, false}};
  const stream_handle streams[] = {nullptr, stream(0x10)};
  std::size_t sleeps = 0, wakes = 0, refused = 0, no_room = 0;
  std::uint8_t next_seed = 0;
  const std::size_t ops = scaled_ops(2000, 500);
  for (std::size_t op = 0; op < ops; ++op) {
    SCOPED_TRACE("operation " + std::to_string(op));
    const unsigned r = static_cast<unsigned>(rng() % 100);
    const std::uint32_t d = static_cast<std::uint32_t>(rng() % 4);  // 0: untagged
    if (r < 45) {  // allocate
      const std::size_t bytes = std::size_t{1} << (8 + rng() % 18);  // 256 B .. 32 MiB
      in_domain in(d);
      try {
        void* p = a.alloc.allocate(bytes, streams[rng() % 2]);
        ASSERT_FALSE(d != 0 && asleep[d]) << "allocated under a sleeping domain";
        const std::uint8_t s = next_seed++;
        fill(*a.sim, p, bytes, s);
        live.push_back({p, bytes, d, s});
      } catch (const invalid_argument&) {
        ASSERT_TRUE(d != 0 && asleep[d]);
        ++refused;
      } catch (const out_of_memory&) {
      }
    } else if (r < 80 && !live.empty()) {  // free
      const std::size_t i = rng() % live.size();
      const live_block b = live[i];
      if (b.domain != 0 && asleep[b.domain]) {
        ASSERT_THROW(a.alloc.deallocate(b.p), invalid_argument);
        ++refused;
      } else {
        ASSERT_TRUE(holds(*a.sim, b.p, b.bytes, b.seed));
        a.alloc.deallocate(b.p);
        live[i] = live.back();
        live.pop_back();
      }
    } else if (r < 88) {  // sleep
      const std::uint32_t s = 1 + static_cast<std::uint32_t>(rng() % 3);
      const bool keep = rng() % 4 != 0;
      if (asleep[s]) {
        ASSERT_THROW(a.alloc.sleep(s, keep), invalid_argument);
      } else {
        const std::int64_t before = a.reserved();
        a.alloc.sleep(s, keep);
        ASSERT_LE(a.reserved(), before);
        asleep[s] = true;
        kept[s] = keep;
        ++sleeps;
      }
    } else if (r < 97) {  // wake
      const std::uint32_t s = 1 + static_cast<std::uint32_t>(rng() % 3);
      if (!asleep[s]) {
        ASSERT_THROW(a.alloc.wake(s), invalid_argument);
      } else {
        try {
          a.alloc.wake(s);
          asleep[s] = false;
          ++wakes;
          for (live_block& b : live) {
            if (b.domain != s) continue;
            if (kept[s]) {
              ASSERT_TRUE(holds(*a.sim, b.p, b.bytes, b.seed));
            } else {
              fill(*a.sim, b.p, b.bytes, b.seed);  // contents were not kept: write them again
            }
          }
        } catch (const out_of_memory&) {
          ASSERT_TRUE(a.alloc.is_asleep(s));
          ++no_room;
        }
      }
    } else if (r < 99) {
      a.alloc.empty_cache();
    } else {
      // Another process takes or gives back memory.
      a.sim->set_capacity(rng() % 2 == 0 ? 512 * MiB : 1 * GiB);
    }
    a.alloc.check_invariants();
    const auto st = a.stats();
    ASSERT_EQ(a.sim->used_bytes(), static_cast<std::size_t>(st.reserved_bytes[0].current));
    for (const live_block& b : live) {
      const bool sleeping = b.domain != 0 && asleep[b.domain];
      ASSERT_EQ(a.sim->accessible(b.p, b.bytes), !sleeping);
    }
  }
  // The end: everything awake is freed first (under a limit the sleeping domains may not fit
  // beside it), then each sleeping domain wakes with its contents and is freed.
  a.sim->set_capacity(1 * GiB);
  std::erase_if(live, [&](const live_block& b) {
    if (b.domain != 0 && asleep[b.domain]) return false;
    a.alloc.deallocate(b.p);
    return true;
  });
  a.alloc.empty_cache();
  for (auto& [s, is] : asleep) {
    if (!is) continue;
    a.alloc.wake(s);
    a.alloc.check_invariants();
    std::erase_if(live, [&](const live_block& b) {
      if (b.domain != s) return false;
      if (kept[s]) {
        EXPECT_TRUE(holds(*a.sim, b.p, b.bytes, b.seed));
      }
      a.alloc.deallocate(b.p);
      return true;
    });
    a.alloc.empty_cache();
  }
  EXPECT_TRUE(live.empty());
  a.alloc.empty_cache();
  a.alloc.check_invariants();
  EXPECT_EQ(a.reserved(), 0);
  EXPECT_GT(sleeps, 15u);
  EXPECT_GT(wakes, 8u);
  EXPECT_GT(refused, 0u);
  RecordProperty("no_room_wakes", static_cast<int>(no_room));
}

INSTANTIATE_TEST_SUITE_P(Configs, random_sleep,
                         ::testing::Values("", "memory_limit:256MiB",
                                           "memory_limit:384MiB,garbage_collection_threshold:0.5"),
                         [](const ::testing::TestParamInfo<std::string>& p) {
                           return "config" + std::to_string(p.index);
                         });

}  // namespace
}  // namespace cucache::test
