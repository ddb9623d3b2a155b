// Graph memory of a sleepable tag (graph_sleep.cpp; docs/design.md, "Sleep and wake") on the
// simulated device, host-backed so that contents can be checked: a CUDA graph captured while the
// thread's sleep domain is d puts its pool's memory in whole-VM segments that sleep and wake with
// d -- dropped: the device gets back exactly the graph pool's bytes plus the domain's pages, and
// wake maps them at the same addresses; kept: every byte of the graph's segments (free blocks,
// which a replay reuses, included) comes back. Misuse while asleep is refused and changes
// nothing; a device failure part way rolls back; the invariants hold after every step.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

constexpr std::size_t k_page = 2 * MiB;

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

void fill(sim_backend& sim, std::uintptr_t a0, std::size_t bytes, std::uint8_t seed) {
  for (std::size_t off = 0; off < bytes;) {
    const std::uintptr_t a = a0 + off;
    const std::size_t n = std::min(bytes - off, k_page - a % k_page);
    std::byte* h = sim.host_view(reinterpret_cast<void*>(a), n);
    ASSERT_NE(h, nullptr);
    for (std::size_t i = 0; i < n; ++i) {
      h[i] = std::byte(static_cast<std::uint8_t>(seed + (off + i) * 7));
    }
    off += n;
  }
}

::testing::AssertionResult holds(sim_backend& sim, std::uintptr_t a0, std::size_t bytes,
                                 std::uint8_t seed) {
  for (std::size_t off = 0; off < bytes;) {
    const std::uintptr_t a = a0 + off;
    const std::size_t n = std::min(bytes - off, k_page - a % k_page);
    std::byte* h = sim.host_view(reinterpret_cast<void*>(a), n);
    if (h == nullptr) return ::testing::AssertionFailure() << "byte " << off << " is not mapped";
    for (std::size_t i = 0; i < n; ++i) {
      if (h[i] != std::byte(static_cast<std::uint8_t>(seed + (off + i) * 7))) {
        return ::testing::AssertionFailure() << "byte " << off + i << " changed";
      }
    }
    off += n;
  }
  return ::testing::AssertionSuccess();
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

/// Device bytes held equal the allocator's reserved bytes (graph segments are no pager ranges,
/// so expect_no_leak's mapped-bytes equality does not apply).
void expect_device_matches(const sim_allocator& a) {
  EXPECT_EQ(a.sim->used_bytes(), static_cast<std::size_t>(a.reserved()));
}

/// Domain 5 holds a 5 MiB block (3 pages) of its own; a capture on `s` under domain 5 allocates
/// 1 MiB (freed inside the capture: its memory is the graph's, a replay reuses it) and 30 MiB
/// (the graph's output). Every byte of the graph's two segments and of the 5 MiB block is
/// filled: seed 20 for the small segment, 21 the large one, 22 the block.
struct graph_under_tag {
  stream_handle s{};
  graph_pool_id pool{};
  void* tagged = nullptr;
  void* out = nullptr;
  std::uintptr_t small_seg = 0;  // the 1 MiB block's segment (2 MiB)
  explicit graph_under_tag(sim_allocator& a, std::uint32_t domain = 5) {
    s = a.sim->create_stream();
    in_domain d(domain);
    tagged = a.alloc.allocate(5 * MiB);
    // As PyTorch captures: the capture's allocations routed to a pool of its own
    // (beginAllocateToPool), created here, under the domain.
    pool = graph_pool_id{1, 0};
    a.alloc.begin_allocate_to_pool(pool, [st = s](stream_handle t) { return t == st; });
    const std::uint64_t id = a.sim->begin_capture(s);
    void* scratch = a.alloc.allocate(1 * MiB, s);
    small_seg = addr(scratch) / k_page * k_page;
    a.alloc.deallocate(scratch, s);
    out = a.alloc.allocate(30 * MiB, s);
    EXPECT_EQ(a.sim->end_capture(s), id);
    a.alloc.end_allocate_to_pool(pool);
    EXPECT_EQ(a.sim->capture_violations(), 0u);
    fill(*a.sim, small_seg, 2 * MiB, 20);
    fill(*a.sim, addr(out), 30 * MiB, 21);
    fill(*a.sim, addr(tagged), 5 * MiB, 22);
  }
  ::testing::AssertionResult kept(sim_allocator& a) const {
    auto r = holds(*a.sim, small_seg, 2 * MiB, 20);
    if (!r) return r;
    r = holds(*a.sim, addr(out), 30 * MiB, 21);
    if (!r) return r;
    return holds(*a.sim, addr(tagged), 5 * MiB, 22);
  }
  [[nodiscard]] bool mapped(const sim_allocator& a) const {
    return a.sim->accessible(reinterpret_cast<void*>(small_seg), 2 * MiB) &&
           a.sim->accessible(out, 30 * MiB) && a.sim->accessible(tagged, 5 * MiB);
  }
};

TEST(GraphSleep, DroppedGivesBackTheGraphPoolAndTheTagAndWakeMapsTheSameAddresses) {
  sim_allocator a(parse_config("expandable_segments:True"), host_backed(1 * GiB));
  void* other = a.alloc.allocate(3 * MiB);  // untagged: stays
  const graph_under_tag g(a);
  // The graph pool: a 2 MiB small segment and a 30 MiB large one, whole-VM: no cudaMalloc.
  EXPECT_EQ(a.mallocs(), 0u);
  EXPECT_EQ(a.alloc.graph_pool_state(g.pool).reserved_bytes, 32 * MiB);
  EXPECT_EQ(a.alloc.graph_pool_state(g.pool).allocated_bytes, 30 * MiB);
  a.alloc.check_invariants();
  expect_device_matches(a);
  const std::size_t used = a.sim->used_bytes();
  const std::int64_t reserved = a.reserved();

  a.alloc.sleep(5, /*keep_contents=*/false, "graph");
  a.alloc.check_invariants();
  expect_device_matches(a);
  // Exactly the graph pool's 32 MiB and the tag's 3 pages.
  EXPECT_EQ(used - a.sim->used_bytes(), 32 * MiB + 3 * k_page);
  EXPECT_EQ(a.reserved(), reserved - static_cast<std::int64_t>(32 * MiB + 3 * k_page));
  const auto asleep = a.alloc.sleeping();
  ASSERT_EQ(asleep.size(), 1u);
  EXPECT_EQ(asleep[0].bytes, 32 * MiB + 3 * k_page);
  EXPECT_EQ(asleep[0].host_bytes, 0u);
  EXPECT_FALSE(a.sim->accessible(g.out, 30 * MiB));
  EXPECT_FALSE(a.sim->accessible(reinterpret_cast<void*>(g.small_seg), 2 * MiB));
  EXPECT_TRUE(a.sim->accessible(other, 3 * MiB));

  a.alloc.wake(5, "graph");
  a.alloc.check_invariants();
  expect_device_matches(a);
  EXPECT_EQ(a.sim->used_bytes(), used);
  EXPECT_EQ(a.reserved(), reserved);
  EXPECT_TRUE(g.mapped(a));  // the same addresses, mapped again
  EXPECT_EQ(a.alloc.graph_pool_state(g.pool).reserved_bytes, 32 * MiB);
  // The graph's memory is still its own: a replay may write the output, then it is freed.
  a.alloc.deallocate(g.out);
  a.alloc.deallocate(g.tagged);
  a.alloc.deallocate(other);
  a.alloc.release_graph_pool(g.pool);
  a.alloc.empty_cache();
  a.alloc.check_invariants();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  EXPECT_EQ(a.reserved(), 0);
}

TEST(GraphSleep, KeptContentsOfEveryGraphSegmentComeBackWholeFreeBlocksIncluded) {
  sim_allocator a(parse_config("expandable_segments:True"), host_backed(1 * GiB));
  const graph_under_tag g(a);
  for (int cycle = 0; cycle < 3; ++cycle) {
    SCOPED_TRACE(cycle);
    a.alloc.sleep(5, /*keep_contents=*/true, "graph");
    a.alloc.check_invariants();
    expect_device_matches(a);
    const auto asleep = a.alloc.sleeping();
    ASSERT_EQ(asleep.size(), 1u);
    // Whole graph segments (32 MiB) and the tag's allocated 5 MiB.
    EXPECT_EQ(asleep[0].host_bytes, 32 * MiB + 5 * MiB);
    // Another user takes the device memory and scribbles on it.
    void* scribble = a.alloc.allocate(40 * MiB);
    fill(*a.sim, addr(scribble), 40 * MiB, 99);
    a.alloc.deallocate(scribble);
    a.alloc.empty_cache();
    a.alloc.wake(5, "graph");
    a.alloc.check_invariants();
    expect_device_matches(a);
    EXPECT_TRUE(g.kept(a));
  }
}

TEST(GraphSleep, WhileAsleepEveryMisuseIsRefusedAndChangesNothing) {
  sim_allocator a(parse_config("expandable_segments:True"), host_backed(1 * GiB));
  const graph_under_tag g(a);
  a.alloc.sleep(5, /*keep_contents=*/true, "graph");
  const std::size_t used = a.sim->used_bytes();
  // Freeing the graph's output: its block has no memory behind it.
  std::string m = message_of([&] { a.alloc.deallocate(g.out); });
  EXPECT_NE(m.find("asleep"), std::string::npos) << m;
  EXPECT_NE(m.find("graph"), std::string::npos) << m;
  // Allocating into the sleeping graph pool (a route to it): refused.
  a.alloc.begin_allocate_to_pool(g.pool, [s = g.s](stream_handle t) { return t == s; });
  m = message_of([&] { (void)a.alloc.allocate(1 * MiB, g.s); });
  EXPECT_NE(m.find("asleep"), std::string::npos) << m;
  a.alloc.end_allocate_to_pool(g.pool);
  a.alloc.release_graph_pool(g.pool);  // the second route's owner
  a.alloc.check_invariants();
  // empty_cache and a released, settled pool give nothing of the sleeping segments back (they
  // hold no memory); release_graph_pool itself is bookkeeping and is allowed.
  a.alloc.release_graph_pool(g.pool);
  a.alloc.empty_cache();
  a.alloc.check_invariants();
  EXPECT_EQ(a.sim->used_bytes(), used);
  EXPECT_TRUE(a.alloc.graph_pool_state(g.pool).released);
  a.alloc.wake(5, "graph");
  a.alloc.check_invariants();
  EXPECT_TRUE(g.kept(a));
  // Awake and released: the graph's free segment goes back, the output's once freed.
  a.alloc.deallocate(g.out);
  a.alloc.deallocate(g.tagged);
  a.alloc.empty_cache();
  a.alloc.check_invariants();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
}

TEST(GraphSleep, ACaptureUnderwayRefusesSleepAndWake) {
  sim_allocator a(parse_config("expandable_segments:True"), host_backed(1 * GiB));
  const graph_under_tag g(a);
  const stream_handle t = a.sim->create_stream();
  a.sim->begin_capture(t);
  (void)a.alloc.allocate(1 * MiB, t);  // cucache sees the capture
  EXPECT_NE(message_of([&] { a.alloc.sleep(5, true, "graph"); }).find("capture"),
            std::string::npos);
  EXPECT_FALSE(a.alloc.is_asleep(5));
  a.alloc.check_invariants();
  EXPECT_TRUE(g.kept(a));
}

TEST(GraphSleep, AFailedUnmapOrReleaseRollsBackGraphSegmentsToo) {
  // Every unmap and every handle release of the sleep failed in turn: the sleep throws, the tag
  // is awake with every graph segment and page mapped (contents kept when kept), the invariants
  // hold and the device holds what is reserved; sleep and wake then work.
  for (const sim_call kind : {sim_call::unmap, sim_call::phys_release}) {
    for (const bool keep : {true, false}) {
      bool reached_the_end = false;
      for (std::uint64_t k = 1; k < 50 && !reached_the_end; ++k) {
        SCOPED_TRACE(::testing::Message() << (kind == sim_call::unmap ? "unmap " : "release ")
                                          << k << (keep ? ", keep" : ", drop"));
        sim_allocator a(parse_config("expandable_segments:True"), host_backed(256 * MiB));
        const graph_under_tag g(a);
        a.sim->fail_nth(kind, k);
        try {
          a.alloc.sleep(5, keep, "graph");
          reached_the_end = true;
        } catch (const cuda_error& e) {
          const std::string m = e.what();
          EXPECT_NE(m.find("stays awake"), std::string::npos) << m;
        }
        a.sim->fail_nth(kind, 0);
        a.alloc.check_invariants();
        expect_device_matches(a);
        if (reached_the_end) {
          // The tag's pages and the two graph segments: at least 3 calls of each kind.
          EXPECT_GT(k, 3u);
          EXPECT_TRUE(a.alloc.is_asleep(5));
          a.alloc.wake(5, "graph");
          a.alloc.check_invariants();
          EXPECT_TRUE(g.mapped(a));
          if (keep) {
            EXPECT_TRUE(g.kept(a));
          }
          break;
        }
        EXPECT_FALSE(a.alloc.is_asleep(5));
        EXPECT_TRUE(g.mapped(a));
        if (keep) {
          EXPECT_TRUE(g.kept(a));
        }
        a.alloc.sleep(5, keep, "graph");
        a.alloc.check_invariants();
        a.alloc.wake(5, "graph");
        a.alloc.check_invariants();
        expect_device_matches(a);
        if (keep) {
          EXPECT_TRUE(g.kept(a));
        }
      }
      EXPECT_TRUE(reached_the_end);
    }
  }
}

TEST(GraphSleep, WakeWithoutRoomForTheGraphSegmentsLeavesTheTagAsleep) {
  // 64 MiB device: the graph (32 MiB) and the tag (6 MiB) sleep; another user takes 40 MiB; wake
  // needs 38 MiB and finds 24: refused, nothing mapped, still asleep; freed, wake works.
  sim_allocator a(parse_config("expandable_segments:True"), host_backed(64 * MiB));
  const graph_under_tag g(a);
  a.alloc.sleep(5, true, "graph");
  void* big = a.alloc.allocate(40 * MiB);
  const std::size_t used = a.sim->used_bytes();
  EXPECT_THROW(a.alloc.wake(5, "graph"), out_of_memory);
  EXPECT_TRUE(a.alloc.is_asleep(5));
  EXPECT_EQ(a.sim->used_bytes(), used);
  a.alloc.check_invariants();
  expect_device_matches(a);
  a.alloc.deallocate(big);
  a.alloc.wake(5, "graph");  // the freed block's idle pages are given back first
  a.alloc.check_invariants();
  EXPECT_TRUE(g.kept(a));
}

TEST(GraphSleep, AFailedMapDuringWakeUndoesEverythingItMapped) {
  // Every map the wake makes (the tag's pages, then the two graph segments), failed in turn: the
  // wake throws, the tag stays asleep with nothing of it mapped, the device holds what it held;
  // the next wake brings every byte back.
  bool reached_the_end = false;
  for (std::uint64_t k = 1; k < 20 && !reached_the_end; ++k) {
    SCOPED_TRACE(k);
    sim_allocator a(parse_config("expandable_segments:True"), host_backed(1 * GiB));
    const graph_under_tag g(a);
    a.alloc.sleep(5, true, "graph");
    const std::size_t used = a.sim->used_bytes();
    a.sim->fail_nth(sim_call::map, k);
    try {
      a.alloc.wake(5, "graph");
      reached_the_end = true;
    } catch (const cuda_error&) {
    }
    a.sim->fail_nth(sim_call::map, 0);
    a.alloc.check_invariants();
    expect_device_matches(a);
    if (reached_the_end) {
      EXPECT_GT(k, 3u);  // at least one page map and the two graph segments' maps failed
      EXPECT_TRUE(g.kept(a));
      break;
    }
    EXPECT_TRUE(a.alloc.is_asleep(5));
    EXPECT_EQ(a.sim->used_bytes(), used);
    a.alloc.wake(5, "graph");
    a.alloc.check_invariants();
    EXPECT_TRUE(g.kept(a));
  }
  EXPECT_TRUE(reached_the_end);
}

TEST(GraphSleep, DefaultModeGraphPoolsUnderATagAreOrdinarySegments) {
  // Without expandable segments nothing sleeps: a graph captured under a domain takes
  // cudaMalloc'd segments as before.
  sim_allocator a(config{}, host_backed(1 * GiB));
  const stream_handle s = a.sim->create_stream();
  in_domain d(5);
  const std::uint64_t id = a.sim->begin_capture(s);
  void* p = a.alloc.allocate(1 * MiB, s);
  EXPECT_EQ(a.sim->end_capture(s), id);
  EXPECT_EQ(a.mallocs(), 1u);
  a.alloc.check_invariants();
  a.alloc.deallocate(p);
}

class graph_sleep_random : public ::testing::TestWithParam<unsigned> {};

TEST_P(graph_sleep_random, InvariantsHoldAfterEveryOperation) {
  // A seeded program of tagged allocations, graph captures under the tag (routed, blocks freed
  // inside the capture), frees, graph pool releases, empty_cache, kept and dropped sleeps and
  // wakes: after every operation the invariants hold and the device holds exactly what is
  // reserved; after every kept sleep every live block's bytes are back; while asleep a free is
  // refused and changes nothing.
  std::mt19937 rng(GetParam());  // (32-bit results: the casts below are exact)
  sim_allocator a(parse_config("expandable_segments:True"), host_backed(2 * GiB));
  const stream_handle s = a.sim->create_stream();
  struct live {
    void* p;
    std::size_t n;
    std::uint8_t seed;
  };
  std::vector<live> blocks;
  std::vector<graph_pool_id> pools;
  std::uint64_t next_pool = 100;
  bool asleep = false;
  bool kept = false;
  std::size_t graph_sleeps = 0;
  std::uint8_t next_seed = 1;
  const auto size = [&] {
    const std::size_t sizes[] = {4096, 100'000, 1 * MiB, 3 * MiB, 7 * MiB + 5};
    return sizes[rng() % 5];
  };
  const auto add = [&](void* p, std::size_t n) {
    blocks.push_back({p, n, next_seed});
    fill(*a.sim, addr(p), n, next_seed++);
  };
  for (int op = 0; op < 150; ++op) {
    SCOPED_TRACE(op);
    const auto what = static_cast<unsigned>(rng() % 9);
    if (asleep) {
      if (what < 3 && !blocks.empty()) {
        const live b = blocks[rng() % blocks.size()];
        EXPECT_THROW(a.alloc.deallocate(b.p), invalid_argument);
      } else if (what < 4 && !pools.empty()) {
        const std::size_t i = rng() % pools.size();
        a.alloc.release_graph_pool(pools[i]);
        pools.erase(pools.begin() + static_cast<std::ptrdiff_t>(i));
      } else if (what < 5) {
        a.alloc.empty_cache();
      } else {
        a.alloc.wake(5, "g");
        asleep = false;
        for (live& b : blocks) {
          if (kept) {
            EXPECT_TRUE(holds(*a.sim, addr(b.p), b.n, b.seed));
          } else {
            b.seed = next_seed++;
            fill(*a.sim, addr(b.p), b.n, b.seed);
          }
        }
      }
    } else if (what < 2) {
      in_domain d(5);
      const std::size_t n = size();
      add(a.alloc.allocate(n), n);
    } else if (what < 4) {
      in_domain d(5);
      const graph_pool_id pool{next_pool++, 0};
      a.alloc.begin_allocate_to_pool(pool, [s](stream_handle t) { return t == s; });
      const std::uint64_t id = a.sim->begin_capture(s);
      std::vector<std::pair<void*, std::size_t>> made;
      for (auto k = static_cast<unsigned>(1 + rng() % 3); k-- > 0;) {
        const std::size_t n = size();
        made.emplace_back(a.alloc.allocate(n, s), n);
      }
      if (made.size() > 1) {
        a.alloc.deallocate(made.front().first, s);  // freed inside the capture
        made.erase(made.begin());
      }
      EXPECT_EQ(a.sim->end_capture(s), id);
      a.alloc.end_allocate_to_pool(pool);
      pools.push_back(pool);
      for (auto [p, n] : made) add(p, n);
    } else if (what < 6 && !blocks.empty()) {
      const std::size_t i = rng() % blocks.size();
      a.alloc.deallocate(blocks[i].p);
      blocks.erase(blocks.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (what < 7 && !pools.empty()) {
      const std::size_t i = rng() % pools.size();
      a.alloc.release_graph_pool(pools[i]);
      pools.erase(pools.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (what < 8) {
      a.alloc.empty_cache();
    } else {
      kept = rng() % 2 == 0;
      for (const graph_pool_id& pool : pools) {
        if (a.alloc.graph_pool_state(pool).reserved_bytes != 0) {
          ++graph_sleeps;  // a sleep with graph memory in it
          break;
        }
      }
      a.alloc.sleep(5, kept, "g");
      asleep = true;
    }
    a.alloc.check_invariants();
    expect_device_matches(a);
  }
  if (asleep) a.alloc.wake(5, "g");
  for (const live& b : blocks) a.alloc.deallocate(b.p);
  for (const graph_pool_id& pool : pools) a.alloc.release_graph_pool(pool);
  a.alloc.empty_cache();
  a.alloc.check_invariants();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  EXPECT_GE(graph_sleeps, 3u);
}

INSTANTIATE_TEST_SUITE_P(Seeds, graph_sleep_random, ::testing::Values(1u, 2u, 3u));

}  // namespace
}  // namespace cucache::test
