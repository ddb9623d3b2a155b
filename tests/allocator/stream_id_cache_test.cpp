// Announced stream destructions (src/allocator/stream_id_cache.hpp; docs/design.md, "Announced
// stream destructions") on the simulated device, which counts every stream query and hands a
// destroyed stream's handle value to the next stream it creates, as the runtime does. Exact id
// query counts per allocation, the reused handle after an announced destruction, the contract's
// breach shown, the mode's switches, threads, and a seeded twin test: the same program on two
// allocators, with and without the mode, gets the same address at every step.
#include <gtest/gtest.h>

#include <atomic>
#include <latch>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cucache/stats.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

class StreamIdCache : public ::testing::TestWithParam<const char*> {
 protected:
  static sim_allocator make() {
    sim_options o;
    o.host_memory = true;  // to compare the physical bytes behind two addresses
    return sim_allocator(parse_config(GetParam()), o);
  }
  // The front-end modes: captures announced, and stream destructions announced (or not).
  static void announce(sim_allocator& a, bool streams_announced = true) {
    a.alloc.set_captures_announced(true);
    a.alloc.set_stream_destructions_announced(streams_announced);
  }
  static std::uint64_t ids(const sim_allocator& a) { return a.sim->calls(sim_call::stream_id); }
};

constexpr int k_pairs = 1000;

TEST_P(StreamIdCache, ACacheHitAsksTheDriverNothing) {
  sim_allocator a = make();
  announce(a);
  EXPECT_TRUE(a.alloc.stream_destructions_announced());
  const stream_handle s = a.sim->create_stream();
  const std::uint64_t before = ids(a);
  a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));  // the first allocation asks and caches
  EXPECT_EQ(ids(a) - before, 1u);
  for (int i = 0; i < k_pairs; ++i) a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));
  EXPECT_EQ(ids(a) - before, 1u);
  EXPECT_EQ(a.sim->calls(sim_call::capture_status), 0u);
  // Off: every allocation asks again (the captures-announced mode alone).
  a.alloc.set_stream_destructions_announced(false);
  EXPECT_FALSE(a.alloc.stream_destructions_announced());
  for (int i = 0; i < k_pairs; ++i) a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));
  EXPECT_EQ(ids(a) - before, 1u + k_pairs);
  a.alloc.check_invariants();
}

TEST_P(StreamIdCache, OneEntryPerThreadTwoStreamsInTurnAskEveryTime) {
  sim_allocator a = make();
  announce(a);
  const stream_handle s = a.sim->create_stream();
  const stream_handle t = a.sim->create_stream();
  const std::uint64_t before = ids(a);
  for (int i = 0; i < 100; ++i) {
    a.alloc.deallocate(a.alloc.allocate(4 * KiB, s));
    a.alloc.deallocate(a.alloc.allocate(4 * KiB, t));
  }
  EXPECT_EQ(ids(a) - before, 200u);
}

TEST_P(StreamIdCache, TheModeIsOnlyConsultedWhereTheCaptureQueryIsSkipped) {
  // Captures announced off: identify asks both, whatever the stream mode says.
  sim_allocator a = make();
  announce(a);
  a.alloc.set_captures_announced(false);
  const stream_handle s = a.sim->create_stream();
  const std::uint64_t before = ids(a);
  for (int i = 0; i < 10; ++i) a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));
  EXPECT_EQ(ids(a) - before, 10u);
  EXPECT_EQ(a.sim->calls(sim_call::capture_status), 10u);
  // On again, with an announced capture active: the capture status is asked, and the id.
  a.alloc.set_captures_announced(true);
  a.alloc.announce_capture_begin();
  for (int i = 0; i < 10; ++i) a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));
  EXPECT_EQ(ids(a) - before, 20u);
  EXPECT_EQ(a.sim->calls(sim_call::capture_status), 20u);
  a.alloc.announce_capture_end();
  a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));
  a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));
  EXPECT_EQ(ids(a) - before, 21u);  // one to fill the entry, none for the hit
  EXPECT_EQ(a.sim->calls(sim_call::capture_status), 20u);
}

TEST_P(StreamIdCache, AnAnnouncedDestructionAnywhereMakesTheNextAllocationAsk) {
  sim_allocator a = make();
  announce(a);
  sim_allocator other = make();  // the count is process-wide: any allocator's front end
  announce(other);
  const stream_handle s = a.sim->create_stream();
  a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));
  const std::uint64_t before = ids(a);
  const stream_handle gone = other.sim->create_stream();
  device_allocator::announce_stream_destruction();
  other.sim->destroy_stream(gone);
  a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));
  a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));
  EXPECT_EQ(ids(a) - before, 1u);
}

TEST_P(StreamIdCache, DestroyThenCreateTheSameHandleWithARunningKernel) {
  for (std::size_t bytes : {4 * KiB, 8 * MiB, 64 * MiB}) {
    SCOPED_TRACE(bytes);
    sim_allocator a = make();
    announce(a);
    const stream_handle s = a.sim->create_stream();
    void* p = a.alloc.allocate(bytes, s);
    std::byte* p_bytes = a.sim->host_view(p, 512);
    ASSERT_NE(p_bytes, nullptr);
    // A kernel using p, still running when p is freed on s and s is destroyed (both legal).
    const event_handle kernel = a.sim->event_create();
    a.sim->event_record(kernel, s);
    a.alloc.deallocate(p);
    device_allocator::announce_stream_destruction();  // the front end, before the driver
    a.sim->destroy_stream(s);
    const stream_handle t = a.sim->create_stream();
    ASSERT_EQ(t, s);  // the dead stream's handle value comes back
    // This thread's entry named handle s; the announcement made it miss, so t's id is asked.
    const std::uint64_t before = ids(a);
    void* q = a.alloc.allocate(bytes, t);
    EXPECT_EQ(ids(a) - before, 1u);
    EXPECT_NE(q, p);
    if (!a.sim->event_query(kernel)) {
      EXPECT_NE(a.sim->host_view(q, 512), p_bytes) << "the new stream got the kernel's memory";
    }
    a.alloc.deallocate(q);
    a.sim->complete_all();
    a.alloc.empty_cache();
    EXPECT_EQ(a.sim->used_bytes(), 0u);
    a.sim->destroy_stream(t);
    a.sim->event_destroy(kernel);
    a.alloc.check_invariants();
  }
}

TEST_P(StreamIdCache, ADestructionNobodyAnnouncedIsTheContractsBreach) {
  // What the contract prevents, shown: without the announcement the thread's entry answers the
  // new stream with the dead stream's id, and the dead stream's block comes back to it while the
  // dead stream's kernel may still use it: the same address, from the dead stream's pool. (The
  // same program with the mode off gets a new pool: StreamReuse in stream_reuse_test.cpp.)
  sim_allocator a = make();
  announce(a);
  const stream_handle s = a.sim->create_stream();
  void* p = a.alloc.allocate(64 * KiB, s);
  a.alloc.deallocate(p);
  a.sim->destroy_stream(s);  // not announced
  const stream_handle t = a.sim->create_stream();
  ASSERT_EQ(t, s);
  const std::uint64_t before = ids(a);
  void* q = a.alloc.allocate(64 * KiB, t);
  EXPECT_EQ(ids(a) - before, 0u);
  EXPECT_EQ(q, p);
  a.alloc.deallocate(q);
  a.sim->destroy_stream(t);
}

TEST_P(StreamIdCache, TurningTheModeOnTrustsNothingCachedBefore) {
  sim_allocator a = make();
  announce(a);
  const stream_handle s = a.sim->create_stream();
  void* p = a.alloc.allocate(64 * KiB, s);  // the entry: s -> its id
  a.alloc.deallocate(p);
  // Off: destructions need no announcement; one happens unannounced.
  a.alloc.set_stream_destructions_announced(false);
  a.sim->destroy_stream(s);
  const stream_handle t = a.sim->create_stream();
  ASSERT_EQ(t, s);
  a.alloc.set_stream_destructions_announced(true);
  const std::uint64_t before = ids(a);
  void* q = a.alloc.allocate(64 * KiB, t);
  EXPECT_EQ(ids(a) - before, 1u);
  if (std::string(GetParam()).empty()) {
    EXPECT_NE(q, p);  // t's own pool
  }
  a.alloc.deallocate(q);
  a.sim->destroy_stream(t);
}

TEST_P(StreamIdCache, EachThreadAndEachAllocatorKeepsItsOwnEntry) {
  sim_allocator a = make();
  announce(a);
  sim_allocator b = make();
  announce(b);
  const stream_handle s = a.sim->create_stream();
  a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));
  const std::uint64_t before = ids(a);
  std::thread([&] {
    for (int i = 0; i < 10; ++i) a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));
  }).join();
  EXPECT_EQ(ids(a) - before, 1u);  // the other thread asked once
  // Another allocator on this thread: its own entry (b's device has its own stream).
  const stream_handle bs = b.sim->create_stream();
  const std::uint64_t b_before = ids(b);
  for (int i = 0; i < 10; ++i) b.alloc.deallocate(b.alloc.allocate(64 * KiB, bs));
  EXPECT_EQ(ids(b) - b_before, 1u);
  // Back on a: this thread's one entry now names b, so a asks once again.
  for (int i = 0; i < 10; ++i) a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));
  EXPECT_EQ(ids(a) - before, 2u);
}

// Threads that create, use and destroy streams at once, each destruction announced: a handle
// comes back to another thread, every destruction anywhere makes each thread's entry miss once,
// and no allocation gets memory that a block freed on a dead stream still lends to the kernel
// left running there. (ThreadSanitizer runs it too: the entries are per thread, the count one
// atomic.) In expandable mode the check is on the bytes behind the addresses (host memory).
TEST_P(StreamIdCache, ThreadsDestroyAndCreateStreamsWhileOthersAllocate) {
  const bool expandable = !std::string(GetParam()).empty();
  sim_options o;
  o.host_memory = expandable;
  sim_allocator a(parse_config(GetParam()), o);
  announce(a);
  struct dead_block {
    const std::byte* at;
    std::size_t bytes;
    event_handle kernel;
  };
  std::mutex mu;
  std::vector<dead_block> dead;  // guarded by mu
  std::vector<event_handle> kernels;  // guarded by mu
  std::atomic<int> overlaps{0};
  const auto where = [&](void* p) {
    return expandable ? static_cast<const std::byte*>(a.sim->host_view(p, 512))
                      : static_cast<const std::byte*>(p);
  };
  constexpr int k_threads = 4;
  // Each round leaves its blocks cached in the dead stream's pool: fewer rounds where host
  // memory backs every page.
  const int k_rounds = expandable ? 40 : 400;
  std::latch start(k_threads);
  const std::size_t sizes[] = {512, 4 * KiB, 64 * KiB};
  std::vector<std::thread> threads;
  for (int t = 0; t < k_threads; ++t) {
    threads.emplace_back([&, t] {
      std::minstd_rand rng(static_cast<std::uint32_t>(t + 1));
      start.arrive_and_wait();
      for (int round = 0; round < k_rounds; ++round) {
        const stream_handle s = a.sim->create_stream();
        std::vector<std::pair<void*, std::size_t>> mine;
        for (int k = 0; k < 3; ++k) {
          const std::size_t bytes = sizes[rng() % std::size(sizes)];
          void* p = a.alloc.allocate(bytes, s);
          const std::byte* at = where(p);
          const std::lock_guard lock(mu);
          for (const dead_block& d : dead) {
            if (at < d.at + d.bytes && d.at < at + bytes && !a.sim->event_query(d.kernel)) {
              overlaps.fetch_add(1);
            }
          }
          mine.emplace_back(p, bytes);
        }
        const event_handle kernel = a.sim->event_create();  // left running on s
        a.sim->event_record(kernel, s);
        std::vector<dead_block> freed;
        for (auto [p, bytes] : mine) {
          freed.push_back({where(p), bytes, kernel});
          a.alloc.deallocate(p);
        }
        {
          const std::lock_guard lock(mu);
          dead.insert(dead.end(), freed.begin(), freed.end());
          kernels.push_back(kernel);
        }
        device_allocator::announce_stream_destruction();  // the front end, before the driver
        a.sim->destroy_stream(s);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(overlaps.load(), 0) << "an allocation got memory a dead stream's kernel still uses";
  a.sim->complete_all();
  for (event_handle k : kernels) a.sim->event_destroy(k);
  a.alloc.check_invariants();
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
}

// The twin test: one seeded program -- allocations and frees on 4 stream slots, streams destroyed
// (announced by the program, the front end) and created again with the handles coming back,
// work left running on dead streams, completions -- on two allocators, one with the mode off and
// one with it on. The mode changes where the stream id comes from, never which: every
// allocation gets the same address, and the statistics are equal at every check.
TEST_P(StreamIdCache, TwinProgramsGetTheSameAddresses) {
  for (std::uint32_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE(seed);
    // (No host memory behind the sim here: addresses are compared, not bytes.)
    sim_allocator off(parse_config(GetParam()));
    announce(off, false);
    sim_allocator on(parse_config(GetParam()));
    announce(on, true);
    std::minstd_rand rng(seed);
    struct slot {
      stream_handle off = nullptr, on = nullptr;
      std::vector<std::pair<void*, void*>> live;
    };
    std::vector<slot> slots(4);
    for (slot& sl : slots) {
      sl.off = off.sim->create_stream();
      sl.on = on.sim->create_stream();
    }
    std::vector<std::pair<event_handle, event_handle>> kernels;
    const std::size_t sizes[] = {512, 4 * KiB, 64 * KiB, 1 * MiB, 3 * MiB, 24 * MiB};
    for (int step = 0; step < 3000; ++step) {
      slot& sl = slots[rng() % slots.size()];
      const auto op = rng() % 100;
      if (op < 50) {
        const std::size_t bytes = sizes[rng() % std::size(sizes)];
        void* x = off.alloc.allocate(bytes, sl.off);
        void* y = on.alloc.allocate(bytes, sl.on);
        ASSERT_EQ(x, y) << "step " << step;
        sl.live.emplace_back(x, y);
      } else if (op < 90) {
        if (sl.live.empty()) continue;
        const std::size_t i = rng() % sl.live.size();
        off.alloc.deallocate(sl.live[i].first);
        on.alloc.deallocate(sl.live[i].second);
        sl.live.erase(sl.live.begin() + static_cast<std::ptrdiff_t>(i));
      } else if (op < 96) {
        // A kernel on the stream, then the stream destroyed with its blocks freed first.
        if (rng() % 2 == 0) {
          kernels.emplace_back(off.sim->event_create(), on.sim->event_create());
          off.sim->event_record(kernels.back().first, sl.off);
          on.sim->event_record(kernels.back().second, sl.on);
        }
        for (auto& [x, y] : sl.live) {
          off.alloc.deallocate(x);
          on.alloc.deallocate(y);
        }
        sl.live.clear();
        device_allocator::announce_stream_destruction();
        off.sim->destroy_stream(sl.off);
        on.sim->destroy_stream(sl.on);
        sl.off = off.sim->create_stream();
        sl.on = on.sim->create_stream();
        ASSERT_EQ(off.sim->stream_id(sl.off), on.sim->stream_id(sl.on));
      } else {
        off.sim->complete_all();
        on.sim->complete_all();
      }
      if (step % 100 == 0) {
        const device_stats x = off.alloc.stats();
        const device_stats y = on.alloc.stats();
        ASSERT_EQ(x.allocated_bytes[0].current, y.allocated_bytes[0].current);
        ASSERT_EQ(x.reserved_bytes[0].current, y.reserved_bytes[0].current);
        ASSERT_EQ(x.device_alloc_count, y.device_alloc_count);
        on.alloc.check_invariants();
      }
    }
    for (slot& sl : slots) {
      for (auto& [x, y] : sl.live) {
        off.alloc.deallocate(x);
        on.alloc.deallocate(y);
      }
    }
    for (auto& [x, y] : kernels) {
      off.sim->event_destroy(x);
      on.sim->event_destroy(y);
    }
    off.sim->complete_all();
    on.sim->complete_all();
    EXPECT_EQ(off.alloc.stats().reserved_bytes[0].current,
              on.alloc.stats().reserved_bytes[0].current);
    on.alloc.check_invariants();
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, StreamIdCache, ::testing::Values("", "expandable_segments:True"),
                         [](const auto& p) {
                           return std::string(p.param).empty() ? "default" : "expandable";
                         });

}  // namespace
}  // namespace cucache::test
