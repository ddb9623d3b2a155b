// Threads on shared and separate streams against one allocator, while another thread takes every
// pool lock (stats, snapshots, the invariant check) over and over: the pool locks must exclude, and
// no thread may hang on a missed wake-up.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "core/segment_directory.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

/// One worker: `ops` steps on stream s of allocations of 1 B-3 MiB (at most `max_live` live) and
/// frees in random order (`free_one(rng, p)`), then every block left freed. `every_1000()` runs
/// at every 1,000th step.
template <class Free, class Probe>
void churn(device_allocator& alloc, stream_handle s, std::uint64_t seed, int ops,
           std::size_t max_live, Free&& free_one, Probe&& every_1000) {
  std::mt19937_64 rng(seed);
  std::vector<void*> live;
  for (int i = 0; i < ops; ++i) {
    if (i % 1000 == 999) every_1000();
    if (live.size() < max_live && (live.empty() || rng() % 2 == 0)) {
      live.push_back(alloc.allocate(1 + rng() % (3 * MiB), s));
    } else {
      const std::size_t j = rng() % live.size();
      free_one(rng, live[j]);
      live[j] = live.back();
      live.pop_back();
    }
  }
  for (void* p : live) alloc.deallocate(p);
}

TEST(Concurrency, SharedAndSeparateStreamsWithDeviceWideReaders) {
  sim_allocator a;
  constexpr int k_threads = 4;
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
      const stream_handle s = stream(1 + static_cast<std::uintptr_t>(t % 2));  // two per stream
      churn(
          a.alloc, s, static_cast<std::uint64_t>(t), 20000, 64,
          [&](std::mt19937_64&, void* p) { a.alloc.deallocate(p); }, [] {});
    });
  }
  for (auto& w : workers) w.join();
  done = true;
  reader.join();
  a.alloc.check_invariants();
  EXPECT_EQ(a.allocated(), 0);
}

/// The 2 MiB granules that segments of two or more streams meet.
std::size_t granules_of_two_streams(const std::vector<segment_view>& segments) {
  std::map<std::uintptr_t, std::set<stream_handle>> streams;
  for (const segment_view& v : segments) {
    constexpr unsigned k_log2 = detail::segment_directory::k_granule_log2;
    for (std::uintptr_t g = v.address >> k_log2; g <= (v.address + v.size - 1) >> k_log2; ++g) {
      streams[g].insert(v.stream);
    }
  }
  return static_cast<std::size_t>(std::count_if(streams.begin(), streams.end(),
                                                [](const auto& e) { return e.second.size() > 1; }));
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
  std::atomic<bool> done{false};
  std::atomic<std::size_t> shared_seen{0};  // granules of two streams, summed over the looks
  std::thread releaser([&] {
    for (int i = 0; !done.load(); ++i) {
      a.alloc.empty_cache();
      if (i % 8 == 0) a.alloc.check_invariants();
    }
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < k_threads; ++t) {
    workers.emplace_back([&, t] {
      const stream_handle s = stream(1 + static_cast<std::uintptr_t>(t));  // a stream each
      churn(
          a.alloc, s, 100 + static_cast<std::uint64_t>(t), 20000, 32,
          [&](std::mt19937_64& rng, void* p) {
            // Some frees look the block up first (record_stream on its own stream changes
            // nothing).
            if (rng() % 4 == 0) a.alloc.record_stream(p, s);
            a.alloc.deallocate(p, s);
          },
          [&] { shared_seen += granules_of_two_streams(a.alloc.segments()); });
    });
  }
  for (auto& w : workers) w.join();
  done = true;
  releaser.join();
  EXPECT_GT(shared_seen.load(), 0u)
      << "no granule held segments of two streams: the test shared none";
  a.alloc.check_invariants();
  EXPECT_EQ(a.allocated(), 0);
  a.sim->segment_free(offset);
}

// A segment's memory goes back to the device under its pool's lock only (release_oversize on a
// miss): another pool may get the same addresses at once. The observer holds the releasing
// thread right after the device call until another thread has allocated on another stream --
// which takes those addresses (the sim hands out the lowest free range) -- so the second
// segment is added while the first's release is not finished. It must not be refused as an
// overlap: the directory let go of the first before the device call.
class wait_at_segment_free : public allocation_observer {
 public:
  void on_allocate(const void*, std::size_t, stream_handle) noexcept override {}
  void on_free(const void*, std::size_t, stream_handle) noexcept override {}
  void on_failure(std::size_t, stream_handle) noexcept override {}
  void on_segment_free(std::uintptr_t base, std::size_t, stream_handle) noexcept override {
    if (armed.exchange(false)) {
      freed_base = base;
      std::unique_lock lk(mu);
      released = true;
      cv.notify_all();
      // The other thread's allocation, done (or failed); bounded, so that a regression fails
      // rather than hangs.
      cv.wait_for(lk, std::chrono::seconds(10), [&] { return other_done; });
    }
  }
  std::atomic<bool> armed{false};
  std::atomic<std::uintptr_t> freed_base{0};
  std::mutex mu;
  std::condition_variable cv;
  bool released = false;
  bool other_done = false;
};

TEST(Concurrency, AddressesReleasedByOnePoolAreTakenByAnotherWhileTheReleaseFinishes) {
  auto sim = std::make_shared<sim_backend>();
  auto obs = std::make_shared<wait_at_segment_free>();
  device_allocator alloc(sim, parse_config("max_split_size_mb:20"), obs);
  const stream_handle s1 = stream(1);
  const stream_handle s2 = stream(2);
  alloc.deallocate(alloc.allocate(40 * MiB, s1), s1);  // an oversize segment, cached, lowest
  obs->armed = true;
  void* other = nullptr;
  std::string other_error;
  std::thread second([&] {
    {
      // Bounded like the observer's wait: a release that never comes fails the address check
      // below rather than hanging the test.
      std::unique_lock lk(obs->mu);
      obs->cv.wait_for(lk, std::chrono::seconds(10), [&] { return obs->released; });
    }
    try {
      other = alloc.allocate(40 * MiB, s2);
    } catch (const std::exception& e) {
      other_error = e.what();
    }
    std::lock_guard lk(obs->mu);
    obs->other_done = true;
    obs->cv.notify_all();
  });
  void* big = alloc.allocate(60 * MiB, s1);  // a miss: the oversize segment is released first
  second.join();
  EXPECT_EQ(other_error, "");
  ASSERT_NE(obs->freed_base.load(), 0u);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(other), obs->freed_base.load())
      << "the other pool did not get the released addresses: the test did not make the race";
  alloc.check_invariants();
  alloc.deallocate(other, s2);
  alloc.deallocate(big, s1);
  alloc.check_invariants();
}

}  // namespace
}  // namespace cucache::test
