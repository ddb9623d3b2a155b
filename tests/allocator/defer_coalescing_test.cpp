// defer_coalescing:True (pool_mutex.hpp's held block, impl::takes_back): a stream pool keeps its
// last freed block unmerged, and the next allocation takes it back only where best fit over the
// merged pool would carve exactly it. Exact cases first, each against the same program with the
// setting off; then a seeded twin program: two allocators, one with the setting, must hand out
// the same addresses and report the same statistics throughout.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/free_index.hpp"
#include "cucache/errors.hpp"
#include "support/sim_device.hpp"
#include "support/stat_values.hpp"

namespace cucache::test {
namespace {

config deferring(config cfg = {}) {
  cfg.defer_coalescing = true;
  return cfg;
}

/// Every statistic but the setting's own counter and the host times (two allocators' differ).
std::vector<double> stat_values(const device_stats& s) {
  return test::stat_values(s, {"take_back_count", "vm_host_ns", "sync_host_ns"});
}

std::uintptr_t addr(void* p) {
  return reinterpret_cast<std::uintptr_t>(p);
}

TEST(DeferCoalescing, APairOnOneStreamTakesItsBlockBack) {
  sim_allocator a(deferring());
  const stream_handle s = a.sim->create_stream();
  void* x = a.alloc.allocate(64 * KiB, s);
  a.alloc.deallocate(x, s);
  void* y = a.alloc.allocate(64 * KiB, s);
  EXPECT_EQ(y, x);
  a.alloc.deallocate(y, s);
  void* z = a.alloc.allocate(64 * KiB, s);
  EXPECT_EQ(z, x);
  const device_stats st = a.stats();
  EXPECT_EQ(st.take_back_count, 2u);
  EXPECT_EQ(st.allocation_count[0].allocated, 3);
  EXPECT_EQ(st.allocation_count[0].current, 1);
  EXPECT_EQ(st.inactive_split_count[0].current, 1);  // the segment's rest
  a.alloc.deallocate(z, s);
  a.alloc.check_invariants();
  EXPECT_EQ(a.stats().inactive_split_count[0].current, 0);  // merged: one whole free segment
  EXPECT_EQ(a.stats().free_block_count, 1u);
  a.alloc.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes[0].current, 0);
  expect_no_leak(a);
}

config expandable(config cfg = {}) {
  cfg.expandable_segments = true;
  return cfg;
}

TEST(DeferCoalescing, OffByDefault) {
  sim_allocator a(config{});
  const stream_handle s = a.sim->create_stream();
  for (int i = 0; i < 4; ++i) a.alloc.deallocate(a.alloc.allocate(64 * KiB, s), s);
  EXPECT_EQ(a.stats().take_back_count, 0u);
  a.alloc.check_invariants();
}

/// Two allocators on the simulated device, the second deferring, with one stream each (the same
/// handle): both(f) runs a step on each, then requires the same statistics and the deferring one's
/// invariants.
struct twins {
  explicit twins(const config& base, const sim_options& o = {})
      : plain(base, o), deferred(deferring(base), o), s(plain.sim->create_stream()) {
    EXPECT_EQ(deferred.sim->create_stream(), s);
  }
  void both(const std::function<void(sim_allocator&)>& f) {
    f(plain);
    f(deferred);
    EXPECT_EQ(stat_values(plain.stats()), stat_values(deferred.stats()));
    deferred.alloc.check_invariants();
  }
  sim_allocator plain;
  sim_allocator deferred;
  stream_handle s;
};

// Expandable mode: the held block keeps its pages touched (pager::hold_pages), and a take-back
// skips both page steps; a read of the statistics settles it, its page then idle as after a plain
// free. Every figure agrees with the setting off after each step.
TEST(DeferCoalescing, ExpandableModeTakesTheBlockBackWithItsPages) {
  twins t(expandable());
  const stream_handle s = t.s;
  const auto both = [&t](const std::function<void(sim_allocator&)>& f) { t.both(f); };
  sim_allocator& deferred = t.deferred;
  void* x = nullptr;
  void* y = nullptr;
  both([&](sim_allocator& a) { x = a.alloc.allocate(64 * KiB, s); });
  for (int i = 0; i < 3; ++i) {
    both([&](sim_allocator& a) {
      a.alloc.deallocate(x, s);
      y = a.alloc.allocate(64 * KiB, s);  // no read between: the held block is taken back
      EXPECT_EQ(y, x);
    });
  }
  EXPECT_EQ(deferred.stats().take_back_count, 3u);
  // Freed and read: settled, the page idle (free_bytes, mapped_bytes as with the setting off).
  both([&](sim_allocator& a) { a.alloc.deallocate(x, s); });
  both([&](sim_allocator& a) { EXPECT_EQ(a.alloc.allocate(64 * KiB, s), x); });
  EXPECT_EQ(deferred.stats().take_back_count, 3u);
  both([&](sim_allocator& a) { a.alloc.deallocate(x, s); });
  both([&](sim_allocator& a) { a.alloc.empty_cache(); });
  EXPECT_EQ(deferred.stats().mapped_bytes, 0u);
  expect_no_leak(deferred);
}

// A held block that cuts a chunk (coarse handles) is taken back only while a carve would keep
// that chunk straddled; once coarse handles are no longer plentiful, the carve would release the
// cut chunk (all idle after the free) and map the block's pages anew: the held block settles and
// the allocation takes that path, with the same device calls as without the setting.
TEST(DeferCoalescing, ExpandableModeRefusesATakeBackThatWouldReleaseACutChunk) {
  sim_options o;
  o.capacity_bytes = 512 * MiB;
  twins t(expandable(), o);
  const stream_handle s = t.s;
  const auto both = [&t](const std::function<void(sim_allocator&)>& f) { t.both(f); };
  sim_allocator& plain = t.plain;
  sim_allocator& deferred = t.deferred;
  void* d = nullptr;
  void* c = nullptr;
  void* g = nullptr;
  both([&](sim_allocator& a) {
    void* x = a.alloc.allocate(24 * MiB, s);  // chunks of up to 8 pages (16 MiB)
    g = a.alloc.allocate(2 * MiB, s);         // after it, live: larger requests go beyond
    a.alloc.deallocate(x, s);
  });
  both([&](sim_allocator& a) { d = a.alloc.allocate(5 * MiB, s); });  // cuts the first chunk
  // Taken back while coarse handles are plentiful (the chunk stays straddled).
  const auto pair = [&](sim_allocator& a) {
    a.alloc.deallocate(d, s);
    EXPECT_EQ(a.alloc.allocate(5 * MiB, s), d);
  };
  both(pair);
  EXPECT_EQ(deferred.stats().take_back_count, 1u);
  both([&](sim_allocator& a) { c = a.alloc.allocate(300 * MiB, s); });  // no longer plentiful
  const std::uint64_t splits = plain.stats().vm_split_count;
  both(pair);  // the cut chunk released, d's pages mapped anew
  EXPECT_EQ(plain.stats().vm_split_count, splits + 1);
  EXPECT_EQ(deferred.stats().take_back_count, 1u);
  both([&](sim_allocator& a) {
    for (void* p : {d, c, g}) a.alloc.deallocate(p, s);
  });
}

// reserve counts the pools' idle pages as reclaimable: a held block (the free just before) counts
// as its free would have made it count. Here the reservation fits only with that block's pages
// counted (device free 324 MiB, idle 700): it uses them in place.
TEST(DeferCoalescing, ReserveCountsTheIdlePagesOfAHeldBlock) {
  sim_options o;
  o.capacity_bytes = 1 * GiB;
  for (const bool defer : {false, true}) {
    SCOPED_TRACE(defer ? "defer" : "off");
    sim_allocator a(defer ? deferring(expandable()) : expandable(), o);
    const stream_handle s = a.sim->create_stream();
    void* x = a.alloc.allocate(700 * MiB, s);
    a.alloc.deallocate(x, s);  // held (defer): 700 MiB of pages touched until it settles
    EXPECT_NO_THROW(a.alloc.reserve(600 * MiB, s));
    a.alloc.check_invariants();
    EXPECT_EQ(a.stats().mapped_bytes, 700 * MiB);
    EXPECT_EQ(a.alloc.allocate(600 * MiB, s), x);
  }
}

// Whatever looks at the pool between the free and the next allocation merges the held block (in
// expandable mode, and settles its pages) first: a statistics read, an invariant check, a lookup,
// headroom, a reservation, empty_cache. The allocation then takes the usual path, no take-back.
TEST(DeferCoalescing, EveryOtherLockMergesTheHeldBlockFirst) {
  for (const config& cfg : {deferring(), deferring(expandable())}) {
    SCOPED_TRACE(to_string(cfg));
    sim_allocator a(cfg);
    const stream_handle s = a.sim->create_stream();
    void* keep = a.alloc.allocate(512, s);
    void* x = a.alloc.allocate(64 * KiB, s);
    const std::vector<std::function<void()>> lookers = {
        [&] { (void)a.stats(); },
        [&] { a.alloc.check_invariants(); },
        [&] { (void)a.alloc.locate(keep); },
        [&] { (void)a.alloc.max_allocatable(s); },
        [&] { a.alloc.reset_peak_stats(); },
        [&] { a.alloc.reserve(4 * MiB, s); },
        [&] { a.alloc.empty_cache(); },
    };
    for (const auto& look : lookers) {
      a.alloc.deallocate(x, s);
      look();
      x = a.alloc.allocate(64 * KiB, s);
      EXPECT_EQ(a.stats().take_back_count, 0u);
      a.alloc.check_invariants();
    }
    a.alloc.deallocate(x, s);
    a.alloc.deallocate(keep, s);
    a.alloc.check_invariants();
  }
}

// An exact-size free block elsewhere in the pool comes before the held block merged with the
// segment's rest in best-fit order: the allocation gets that block, as without the setting.
TEST(DeferCoalescing, ASmallerBestFitElsewhereWins) {
  for (const bool defer : {false, true}) {
    sim_allocator a(defer ? deferring() : config{});
    const stream_handle s = a.sim->create_stream();
    void* x = a.alloc.allocate(64 * KiB, s);      // segment offset 0
    void* guard = a.alloc.allocate(64 * KiB, s);  // 64 KiB
    void* y = a.alloc.allocate(64 * KiB, s);      // 128 KiB; the rest of the 2 MiB is free
    a.alloc.deallocate(x, s);                     // x: free, 64 KiB, between nothing and guard
    a.alloc.deallocate(y, s);                     // y: held (defer), its next the free rest
    void* z = a.alloc.allocate(64 * KiB, s);
    EXPECT_EQ(z, x) << "defer " << defer;
    EXPECT_EQ(a.stats().take_back_count, 0u);
    void* w = a.alloc.allocate(64 * KiB, s);
    EXPECT_EQ(w, y) << "defer " << defer;
    a.alloc.check_invariants();
    for (void* p : {z, w, guard}) a.alloc.deallocate(p, s);
  }
}

// The take-back's best-fit test is remembered while the pool's index is unchanged
// (stream_pool::fit_memo). A block indexed since -- settled by a read of the statistics, the
// index's one change -- fits before the held block merged with the segment's rest, and wins as
// without the setting.
TEST(DeferCoalescing, ABlockIndexedSinceTheLastTakeBackWins) {
  for (const bool defer : {false, true}) {
    SCOPED_TRACE(defer ? "defer" : "off");
    sim_allocator a(defer ? deferring() : config{});
    const stream_handle s = a.sim->create_stream();
    void* y = a.alloc.allocate(128 * KiB, s);  // [y][x][z][h][the segment's rest]
    void* x = a.alloc.allocate(128 * KiB, s);
    void* z = a.alloc.allocate(128 * KiB, s);
    void* h = a.alloc.allocate(64 * KiB, s);
    a.alloc.deallocate(h, s);
    EXPECT_EQ(a.alloc.allocate(64 * KiB, s), h);  // taken back (defer): the test remembered
    a.alloc.deallocate(x, s);                     // x: between y and z, both live; held (defer)
    (void)a.stats();                              // x indexed (settled by the read)
    a.alloc.deallocate(h, s);                     // held (defer)
    EXPECT_EQ(a.alloc.allocate(64 * KiB, s), x);  // x (128 KiB) fits before h + the rest
    EXPECT_EQ(a.stats().take_back_count, defer ? 1u : 0u);
    a.alloc.check_invariants();
    for (void* p : {x, y, z}) a.alloc.deallocate(p, s);
    a.alloc.empty_cache();
    expect_no_leak(a);
  }
}

// The same, for a free block that grew since in place: q (64.5 KiB, too small for 65 KiB)
// absorbs its freed neighbour b (1 KiB) -- a resize that keeps q's bin and place -- and then
// fits before the held block merged.
TEST(DeferCoalescing, ABlockGrownSinceTheLastTakeBackWins) {
  constexpr std::size_t k_request = 65 * KiB;
  ASSERT_EQ(detail::free_index::bin_of(129 * 512), detail::free_index::bin_of(131 * 512));
  for (const bool defer : {false, true}) {
    SCOPED_TRACE(defer ? "defer" : "off");
    sim_allocator a(defer ? deferring() : config{});
    const stream_handle s = a.sim->create_stream();
    void* y = a.alloc.allocate(128 * KiB, s);  // [y][q][b][z][h][the segment's rest]
    void* q = a.alloc.allocate(129 * 512, s);
    void* b = a.alloc.allocate(1 * KiB, s);
    void* z = a.alloc.allocate(128 * KiB, s);
    void* h = a.alloc.allocate(k_request, s);
    a.alloc.deallocate(q, s);                      // held (defer)
    a.alloc.deallocate(h, s);                      // q indexed (too small); h held
    EXPECT_EQ(a.alloc.allocate(k_request, s), h);  // taken back (defer): the test remembered
    a.alloc.deallocate(b, s);                      // merged into q: 65.5 KiB, in place
    a.alloc.deallocate(h, s);                      // held (defer)
    EXPECT_EQ(a.alloc.allocate(k_request, s), q);  // q fits before h + the rest
    EXPECT_EQ(a.stats().take_back_count, defer ? 1u : 0u);
    a.alloc.check_invariants();
    for (void* p : {q, y, z}) a.alloc.deallocate(p, s);
    a.alloc.empty_cache();
    expect_no_leak(a);
  }
}

// Other sizes, a free previous block, another size class: the held block is merged and best fit
// runs as usual.
TEST(DeferCoalescing, OnlyTheExactSizeAndKindIsTakenBack) {
  for (const bool defer : {false, true}) {
    SCOPED_TRACE(defer ? "defer" : "off");
    sim_allocator a(defer ? deferring() : config{});
    const stream_handle s = a.sim->create_stream();
    void* x = a.alloc.allocate(64 * KiB, s);
    a.alloc.deallocate(x, s);
    EXPECT_EQ(a.alloc.allocate(32 * KiB, s), x);  // smaller: carved at the merged block's front
    void* y = a.alloc.allocate(32 * KiB, s);
    EXPECT_EQ(addr(y), addr(x) + 32 * KiB);
    a.alloc.deallocate(x, s);  // held (its previous block: none)
    a.alloc.deallocate(y, s);  // its previous block x is free: x merged first, then y into it
    void* z = a.alloc.allocate(64 * KiB, s);
    EXPECT_EQ(z, x);
    a.alloc.deallocate(z, s);
    void* big = a.alloc.allocate(4 * MiB, s);  // the large pool: the small held block merged
    EXPECT_NE(a.alloc.allocate(64 * KiB, s), nullptr);
    a.alloc.deallocate(big, s);
    EXPECT_EQ(a.stats().take_back_count, 0u);
    a.alloc.check_invariants();
  }
}

// A held block is free: freeing it again is the same error as with the setting off, and changes
// nothing.
TEST(DeferCoalescing, ADoubleFreeOfAHeldBlockIsRefusedAsWithoutIt) {
  for (const config& cfg : {deferring(), deferring(expandable())}) {
    SCOPED_TRACE(to_string(cfg));
    sim_allocator a(cfg);
    const stream_handle s = a.sim->create_stream();
    void* x = a.alloc.allocate(64 * KiB, s);
    a.alloc.deallocate(x, s);
    EXPECT_FALSE(a.alloc.try_deallocate(x, s, true));
    EXPECT_THROW(a.alloc.deallocate(x, s), invalid_argument);
    EXPECT_EQ(a.alloc.allocate(64 * KiB, s), x);
    a.alloc.check_invariants();
  }
}

// max_split_size: a held oversize block is taken back only by a request the rules let take it,
// and never split; a small remainder that the large pool does not split keeps the whole block.
TEST(DeferCoalescing, SplitRulesDecideAsForTheMergedBlock) {
  config base;
  base.max_split_size = 64 * MiB;
  for (const bool defer : {false, true}) {
    SCOPED_TRACE(defer ? "defer" : "off");
    sim_allocator a(defer ? deferring(base) : base);
    const stream_handle s = a.sim->create_stream();
    std::vector<void*> got;
    for (const std::size_t bytes : {100 * MiB, 100 * MiB, 90 * MiB, 3 * MiB, 3 * MiB}) {
      void* p = a.alloc.allocate(bytes, s);
      got.push_back(p);
      a.alloc.deallocate(p, s);
    }
    void* q = a.alloc.allocate(19 * MiB, s);  // a 20 MiB segment's front, 1 MiB left unsplit
    a.alloc.deallocate(q, s);
    got.push_back(a.alloc.allocate(20 * MiB - 512, s));
    EXPECT_EQ(got[1], got[0]);  // the oversize block, taken whole by the same size
    EXPECT_EQ(got[2], got[0]);  // 90 MiB: within max_non_split_rounding, whole
    EXPECT_EQ(got[4], got[3]);
    EXPECT_EQ(got[5], q);  // the whole 20 MiB block, its 1 MiB rest never split off
    a.alloc.check_invariants();
    if (defer) {
      EXPECT_GE(a.stats().take_back_count, 2u);
    }
  }
}

// A free that takes the general path (here: an observer attached after the block was held) merges
// the held block before its own: the held block is the freed block's free neighbour.
TEST(DeferCoalescing, AFreeOnTheGeneralPathMergesTheHeldBlockFirst) {
  struct counting final : allocation_observer {
    void on_allocate(const void*, std::size_t, stream_handle) noexcept override {}
    void on_free(const void*, std::size_t, stream_handle) noexcept override { ++frees; }
    void on_failure(std::size_t, stream_handle) noexcept override {}
    std::atomic<int> frees{0};
  };
  sim_allocator a(deferring());
  const stream_handle s = a.sim->create_stream();
  void* x = a.alloc.allocate(64 * KiB, s);
  void* y = a.alloc.allocate(64 * KiB, s);
  void* guard = a.alloc.allocate(64 * KiB, s);  // y's next block stays allocated
  a.alloc.deallocate(x, s);                     // held
  auto obs = std::make_shared<counting>();
  a.alloc.attach_observer(obs);
  a.alloc.deallocate(y, s);  // the general path (an observer): x merged, then y into it
  EXPECT_EQ(obs->frees.load(), 1);
  a.alloc.check_invariants();
  const device_stats st = a.stats();
  EXPECT_EQ(st.free_block_count, 2u);  // x and y as one block; the segment's rest
  EXPECT_EQ(st.inactive_split_count[0].current, 2);
  EXPECT_EQ(a.alloc.allocate(128 * KiB, s), x);
  a.alloc.check_invariants();
  a.alloc.deallocate(guard, s);
}

// Blocks split under one max_split_size and freed under a lower one (set_size_rules): a held
// block whose merged block is now oversize is taken back only where the rules would hand out
// that merged block split at the held block's end -- here never: once whole (under
// max_non_split_rounding), once not at all (a new segment).
TEST(DeferCoalescing, SplitRulesChangedAtRunTimeDecideAsForTheMergedBlock) {
  for (const bool defer : {false, true}) {
    SCOPED_TRACE(defer ? "defer" : "off");
    sim_allocator a(defer ? deferring() : config{});
    const stream_handle s = a.sim->create_stream();
    // Two segments, each split under no cap: [100 MiB | 10 MiB free], [40 MiB | 30 MiB free].
    void* w = a.alloc.allocate(110 * MiB, s);
    void* v = a.alloc.allocate(70 * MiB, s);
    a.alloc.deallocate(w, s);
    a.alloc.deallocate(v, s);
    void* h1 = a.alloc.allocate(100 * MiB, s);
    EXPECT_EQ(h1, w);
    void* h2 = a.alloc.allocate(40 * MiB, s);
    EXPECT_EQ(h2, v);
    config capped = a.alloc.get_config();
    capped.max_split_size = 64 * MiB;
    a.alloc.set_size_rules(capped);
    // 100 MiB + 10 free: oversize, within max_non_split_rounding of 100 MiB: taken whole.
    a.alloc.deallocate(h1, s);
    void* again1 = a.alloc.allocate(100 * MiB, s);
    EXPECT_EQ(again1, w);
    EXPECT_EQ(a.stats().allocated_bytes[0].current, static_cast<std::int64_t>(150 * MiB));
    // 40 MiB + 30 free: oversize, and a 40 MiB request may not take an oversize block: the
    // cached oversize segment goes back to the device and a new one is made (the device may
    // hand out the same address).
    a.alloc.deallocate(h2, s);
    const std::uint64_t mallocs = a.mallocs();
    const std::uint64_t frees = a.frees();
    void* again2 = a.alloc.allocate(40 * MiB, s);
    EXPECT_EQ(a.mallocs(), mallocs + 1);
    EXPECT_EQ(a.frees(), frees + 1);
    EXPECT_EQ(a.stats().take_back_count, 0u);
    a.alloc.check_invariants();
    a.alloc.deallocate(again1, s);
    a.alloc.deallocate(again2, s);
  }
}

// The twin program: the same seeded operations on two allocators, one deferring; every
// allocation must get the same address, and the statistics and invariants must agree whenever
// they are read (every 37 operations: a read merges the held block, so reading after every
// operation would leave nothing to take back).
void run_twins(const config& base, std::uint64_t seed, int ops, std::size_t capacity = 2 * GiB) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  sim_options o;
  o.capacity_bytes = capacity;
  sim_allocator plain(base, o);
  sim_allocator deferred(deferring(base), o);
  std::mt19937_64 rng(seed);
  std::vector<stream_handle> streams;
  for (int i = 0; i < 3; ++i) {
    const stream_handle s = plain.sim->create_stream();
    ASSERT_EQ(deferred.sim->create_stream(), s);
    streams.push_back(s);
  }
  struct live {
    void* p;
    stream_handle s;
    std::size_t bytes;
  };
  std::vector<live> lives;
  const std::size_t sizes[] = {512, 4 * KiB, 64 * KiB, 64 * KiB, 1 * MiB, 3 * MiB, 24 * MiB};
  std::size_t last_freed = 64 * KiB;
  for (int op = 0; op < ops; ++op) {
    SCOPED_TRACE("op " + std::to_string(op));
    const unsigned r = static_cast<unsigned>(rng() % 100);
    if (r < 45 || lives.empty()) {
      // Half the allocations repeat the last freed size: the pattern take-backs serve.
      const std::size_t bytes =
          rng() % 2 == 0 ? last_freed : sizes[rng() % std::size(sizes)] + rng() % 3 * 512;
      const stream_handle s = streams[rng() % streams.size()];
      void* p = nullptr;
      void* q = nullptr;
      try {
        p = plain.alloc.allocate(bytes, s);
      } catch (const out_of_memory&) {
      }
      try {
        q = deferred.alloc.allocate(bytes, s);
      } catch (const out_of_memory&) {
      }
      ASSERT_EQ(p, q) << bytes << " bytes";
      if (p != nullptr) lives.push_back({p, s, bytes});
    } else if (r < 92) {
      // Mostly the newest block (a pair), else any.
      const std::size_t i = rng() % 3 == 0 ? rng() % lives.size() : lives.size() - 1;
      plain.alloc.deallocate(lives[i].p, lives[i].s);
      deferred.alloc.deallocate(lives[i].p, lives[i].s);
      last_freed = lives[i].bytes;
      lives[i] = lives.back();
      lives.pop_back();
    } else if (r < 95) {
      plain.alloc.empty_cache();
      deferred.alloc.empty_cache();
    } else if (r < 97) {
      // A free on another stream than the block's (cross-stream: an event, then pending).
      const std::size_t i = rng() % lives.size();
      const stream_handle other = streams[(rng() % 2 + 1) % streams.size()];
      plain.alloc.record_stream(lives[i].p, other);
      deferred.alloc.record_stream(lives[i].p, other);
    } else {
      plain.sim->complete_all();
      deferred.sim->complete_all();
    }
    if (op % 37 == 0) {
      ASSERT_EQ(stat_values(plain.stats()), stat_values(deferred.stats()));
      deferred.alloc.check_invariants();
    }
  }
  for (const live& l : lives) {
    plain.alloc.deallocate(l.p, l.s);
    deferred.alloc.deallocate(l.p, l.s);
  }
  EXPECT_EQ(stat_values(plain.stats()), stat_values(deferred.stats()));
  deferred.alloc.check_invariants();
  EXPECT_GT(deferred.stats().take_back_count, static_cast<std::uint64_t>(ops / 50))
      << "the program must exercise take-backs";
  EXPECT_EQ(plain.stats().take_back_count, 0u);
}

TEST(DeferCoalescing, TwinProgramsAgreeOnEveryAddressAndStatistic) {
  std::uint64_t seed = 20261206;
  if (const char* e = std::getenv("CUCACHE_RANDOM_SEED")) seed = std::strtoull(e, nullptr, 10);
  run_twins({}, seed, 20'000);
}

TEST(DeferCoalescing, TwinProgramsAgreeUnderSplitRules) {
  config c;
  c.max_split_size = 20 * MiB;
  c.roundup_power2_divisions.assign(k_roundup_power2_intervals, 4);
  run_twins(c, 7, 10'000);
}

// Expandable mode: the same addresses and statistics -- device calls, mappings, syncs before
// unmaps -- with plentiful memory (coarse handles at work, and without them), and with a device
// so small that the out-of-memory ladder unmaps idle pages in their idle order.
TEST(DeferCoalescing, TwinProgramsAgreeInExpandableMode) {
  run_twins(expandable(), 11, 10'000);
  config fine = expandable();
  fine.coarse_handle_pages = 0;
  run_twins(fine, 12, 10'000);
}

TEST(DeferCoalescing, TwinProgramsAgreeInExpandableModeUnderPressure) {
  run_twins(expandable(), 13, 10'000, 96 * MiB);
}

// Threads on their own streams (1-4 MiB blocks) while one of them reads the statistics, which
// merges every pool's held block under that pool's lock: the invariants hold and nothing is lost
// (ThreadSanitizer runs this too).
void threads_beside_reads(const config& cfg, std::size_t capacity = 80 * GiB) {
  sim_options o;
  o.capacity_bytes = capacity;
  sim_allocator a(cfg, o);
  std::atomic<int> refused{0};
  std::vector<stream_handle> streams;
  for (int i = 0; i < 4; ++i) streams.push_back(a.sim->create_stream());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t));
      std::vector<void*> mine;
      for (int i = 0; i < 5'000; ++i) {
        const stream_handle s = streams[static_cast<std::size_t>(t)];
        if (mine.empty() || rng() % 2 == 0) {
          try {
            mine.push_back(a.alloc.allocate(MiB << (rng() % 3), s));
          } catch (const out_of_memory&) {
            ++refused;  // a small device: the others hold the rest
          }
        } else {
          a.alloc.deallocate(mine.back(), s);
          mine.pop_back();
        }
        if (t == 0 && i % 101 == 0) (void)a.stats();  // merges every pool's held block
      }
      for (void* p : mine) a.alloc.deallocate(p, streams[static_cast<std::size_t>(t)]);
    });
  }
  for (auto& th : threads) th.join();
  a.alloc.check_invariants();
  const device_stats s = a.stats();
  EXPECT_EQ(s.allocation_count[0].current, 0);
  EXPECT_GT(s.take_back_count, 0u);
  if (capacity == 80 * GiB) {
    EXPECT_EQ(refused.load(), 0);
  } else {
    EXPECT_GT(s.shared_pages, 0u) << "the pressure must move pages between the streams' pools";
  }
  a.alloc.empty_cache();
  expect_no_leak(a);
  EXPECT_EQ(a.stats().reserved_bytes[0].current, 0);
}

TEST(DeferCoalescing, ThreadsKeepTheHeldBlocksUnderTheirPoolLocks) {
  threads_beside_reads(deferring());
}

// The same in expandable mode, where a statistics read also settles the held blocks' pages.
TEST(DeferCoalescing, ThreadsKeepTheHeldBlocksAndTheirPagesUnderTheirPoolLocks) {
  threads_beside_reads(deferring(expandable()));
}

// Expandable mode on a device too small for the four threads: a growth takes the idle pages of
// other streams' pools under their try_lock, which settles their held blocks first.
TEST(DeferCoalescing, ThreadsUnderPressureSettleEachOthersHeldBlocks) {
  threads_beside_reads(deferring(expandable()), 48 * MiB);
}

}  // namespace
}  // namespace cucache::test
