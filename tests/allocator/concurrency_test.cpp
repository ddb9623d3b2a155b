// Threads on shared and separate streams against one allocator, while another thread takes every
// pool lock (stats, snapshots, the invariant check) over and over: the pool locks must exclude, and
// no thread may hang on a missed wake-up.
#include <gtest/gtest.h>

#include <atomic>
#include <random>
#include <thread>
#include <vector>

#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

TEST(Concurrency, SharedAndSeparateStreamsWithDeviceWideReaders) {
  sim_allocator a;
  constexpr int k_threads = 4;
  constexpr int k_ops = 20000;
  std::atomic<bool> done{false};
  std::thread reader([&] {
    for (int i = 0; !done.load(); ++i) {
      // Each takes every pool lock. The invariant check too: a free changes its pool's blocks,
      // block map and statistics only under the pool's lock (decision 0030), so the check sees
      // every pool between two operations.
      (void)a.alloc.stats();
      if (i % 64 == 0) (void)a.alloc.snapshot_json();
      if (i % 16 == 0) a.alloc.check_invariants();
    }
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < k_threads; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937_64 rng(static_cast<std::uint64_t>(t));
      const stream_handle s = stream(1 + static_cast<std::uintptr_t>(t % 2));  // two per stream
      std::vector<void*> live;
      for (int i = 0; i < k_ops; ++i) {
        if (live.size() < 64 && (live.empty() || rng() % 2 == 0)) {
          live.push_back(a.alloc.allocate(1 + rng() % (3 * MiB), s));
        } else {
          const std::size_t j = rng() % live.size();
          a.alloc.deallocate(live[j]);
          live[j] = live.back();
          live.pop_back();
        }
      }
      for (void* p : live) a.alloc.deallocate(p);
    });
  }
  for (auto& w : workers) w.join();
  done = true;
  reader.join();
  a.alloc.check_invariants();
  EXPECT_EQ(a.allocated(), 0);
}

// Segments 512 KiB aligned (a backend whose memory is not 2 MiB aligned): pools of different
// streams share 2 MiB granules, so frees find their pool through the segment directory's ordered
// index while other threads create and release segments beside them (empty_cache).
TEST(Concurrency, PoolsSharingGranulesFreeWhileSegmentsComeAndGo) {
  sim_options o;
  o.malloc_page_bytes = 512 * 1024;
  sim_allocator a(config{}, o);
  // 512 KiB taken first: every segment after it starts 512 KiB past a granule, so neighbouring
  // segments of two pools share one.
  void* offset = a.sim->segment_malloc(512 * 1024);
  ASSERT_NE(offset, nullptr);
  constexpr int k_threads = 4;
  constexpr int k_ops = 20000;
  std::atomic<bool> done{false};
  std::thread releaser([&] {
    for (int i = 0; !done.load(); ++i) {
      a.alloc.empty_cache();
      if (i % 8 == 0) a.alloc.check_invariants();
    }
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < k_threads; ++t) {
    workers.emplace_back([&, t] {
      std::mt19937_64 rng(100 + static_cast<std::uint64_t>(t));
      const stream_handle s = stream(1 + static_cast<std::uintptr_t>(t));  // a stream each
      std::vector<void*> live;
      for (int i = 0; i < k_ops; ++i) {
        if (live.size() < 32 && (live.empty() || rng() % 2 == 0)) {
          live.push_back(a.alloc.allocate(1 + rng() % (3 * MiB), s));
        } else {
          const std::size_t j = rng() % live.size();
          // Some frees look the block up first (record_stream on its own stream changes nothing).
          if (rng() % 4 == 0) a.alloc.record_stream(live[j], s);
          a.alloc.deallocate(live[j], s);
          live[j] = live.back();
          live.pop_back();
        }
      }
      for (void* p : live) a.alloc.deallocate(p);
    });
  }
  for (auto& w : workers) w.join();
  done = true;
  releaser.join();
  a.alloc.check_invariants();
  EXPECT_EQ(a.allocated(), 0);
  a.sim->segment_free(offset);
}

}  // namespace
}  // namespace cucache::test
