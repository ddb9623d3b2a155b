// largest_free_block (impl::largest_cached_request; in expandable mode the pager's dry run,
// pager::largest_cached_request) against what the allocator does, in both modes:
//  - sound: after random operations, a request of largest_free_block bytes (on the stream whose
//    pool holds it) is served with no device allocation call and no out-of-memory retry;
//  - tight: no request served that way is larger than largest_free_block was just before it, so
//    it is never 0 while free bytes are > 0 and a request could be served (the resnet50 case of
//    issue 9: free bytes in partly used pages, largest 0, and the next 5 MiB request served from
//    them). Excluded by the definition (docs/design.md, "Free memory"): requests that the pager
//    served by moving idle pages from elsewhere (stitched_pages rose), which it does only when
//    the device's memory is short at that moment.
// "No device allocation" is read from the simulated device's call counters.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/format_bytes.hpp"
#include "core/size_policy.hpp"
#include "cucache/errors.hpp"
#include "cucache/trace.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

/// Device allocation calls (made or refused) and out-of-memory retries so far.
struct device_calls {
  std::uint64_t mallocs, creates, retries;
  friend bool operator==(const device_calls&, const device_calls&) = default;
};
device_calls calls_of(const sim_allocator& a) {
  return {a.sim->calls(sim_call::segment_malloc), a.sim->calls(sim_call::phys_create),
          a.stats().alloc_retry_count};
}

struct served {
  void* ptr = nullptr;
  bool from_cache = false;  // no device allocation call, no retry
  bool moved = false;       // the pager moved idle pages to serve it
};
served allocate(sim_allocator& a, std::size_t bytes, stream_handle s) {
  const device_calls before = calls_of(a);
  const std::uint64_t stitched = a.stats().stitched_pages;
  served r;
  try {
    r.ptr = a.alloc.allocate(bytes, s);
  } catch (const out_of_memory&) {
    return r;
  }
  r.from_cache = calls_of(a) == before;
  r.moved = a.stats().stitched_pages != stitched;
  return r;
}

const stream_handle k_streams[] = {nullptr, stream(0x10), stream(0x20)};

/// A random program, a function of its seed only: allocations (1 B to 64 MiB, log-uniform),
/// frees (some ordered on another stream, some after record_stream), event completion, peak
/// resets and empty_cache, on the first `streams` streams. `before_allocate` sees the allocator
/// before every allocation, `after_allocate` the result.
template <class Before, class After>
void run_program(sim_allocator& a, std::uint64_t seed, std::size_t ops, std::size_t streams,
                 Before&& before_allocate, After&& after_allocate) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  struct live {
    void* ptr;
    stream_handle stream;
  };
  std::vector<live> blocks;
  auto pick = [&] { return k_streams[rng() % streams]; };
  for (std::size_t op = 0; op < ops; ++op) {
    const double r = unit(rng);
    if (r < 0.55 || blocks.empty()) {
      const auto bytes = static_cast<std::size_t>(std::exp(unit(rng) * std::log(64.0 * MiB)));
      const stream_handle s = pick();
      before_allocate(bytes, s);
      const served got = allocate(a, bytes, s);
      after_allocate(bytes, s, got);
      if (got.ptr != nullptr) blocks.push_back({got.ptr, s});
    } else if (r < 0.90) {
      const std::size_t i = rng() % blocks.size();
      const double how = unit(rng);
      if (how < 0.1) {
        a.alloc.record_stream(blocks[i].ptr, pick());
        a.alloc.deallocate(blocks[i].ptr);
      } else if (how < 0.2) {
        a.alloc.deallocate(blocks[i].ptr, pick());
      } else {
        a.alloc.deallocate(blocks[i].ptr);
      }
      blocks[i] = blocks.back();
      blocks.pop_back();
    } else if (r < 0.96) {
      a.sim->complete_all();
    } else if (r < 0.99) {
      a.alloc.reset_peak_stats();
    } else {
      a.alloc.empty_cache();
    }
  }
}

sim_options small_device() {
  sim_options o;
  o.capacity_bytes = 2 * GiB;  // the ladder and out-of-memory happen too
  return o;
}

class free_space : public ::testing::TestWithParam<std::string> {};

TEST_P(free_space, LargestFreeBlockIsTheLargestRequestServedFromTheCache) {
  const config cfg = parse_config(GetParam());
  const detail::size_policy policy(cfg);
  for (std::size_t streams : {std::size_t{1}, std::size_t{3}}) {
    const std::uint64_t seed = 0xF5EE + streams + std::hash<std::string>{}(GetParam());
    SCOPED_TRACE("seed " + std::to_string(seed) + ", " + std::to_string(streams) + " streams");
    sim_allocator a(cfg, small_device());
    device_stats before;
    std::size_t checked = 0, served_from_cache = 0, sound = 0;
    const std::size_t ops = 3000;
    run_program(
        a, seed, ops, streams, [&](std::size_t, stream_handle) { before = a.stats(); },
        [&](std::size_t bytes, stream_handle s, const served& got) {
          // Tight: a request served from the cache alone was no larger than the figure. Frees
          // still pending on events join the cache at the next allocation: not counted.
          ++checked;
          if (got.from_cache && !got.moved && before.events_pending == 0) {
            ++served_from_cache;
            ASSERT_LE(policy.round_size(bytes), before.largest_free_block)
                << "a request of " << bytes << " bytes on stream " << s
                << " was served from cached memory, yet the largest free block was "
                << before.largest_free_block << " (free bytes " << before.free_bytes << ")";
          }
          ASSERT_LE(before.largest_free_block, before.free_bytes);
          if (streams != 1) return;
          // Sound: the figure itself is served from the cache (one stream: this one).
          const device_stats s_now = a.stats();
          if (s_now.largest_free_block == 0 || s_now.events_pending != 0) return;
          const served probe = allocate(a, s_now.largest_free_block, s);
          ASSERT_NE(probe.ptr, nullptr);
          ASSERT_TRUE(probe.from_cache && !probe.moved)
              << "largest_free_block " << s_now.largest_free_block << " needed device memory";
          a.alloc.deallocate(probe.ptr);
          ++sound;
        });
    a.alloc.check_invariants();
    EXPECT_GT(checked, ops / 3);
    EXPECT_GT(served_from_cache, 50u) << "the program should reuse cached memory";
    if (streams == 1) {
      EXPECT_GT(sound, 50u);
      continue;
    }
    // Several streams: the figure is served on the stream whose pool holds it. Checked at a few
    // points by rebuilding the state (the program is a function of its seed) once per stream.
    auto none = [](auto&&...) {};
    for (std::size_t at : {ops / 4, ops / 2, ops - 1}) {
      sim_allocator state(cfg, small_device());
      run_program(state, seed, at, streams, none, none);
      const device_stats s = state.stats();
      if (s.largest_free_block == 0 || s.events_pending != 0) continue;
      bool served_somewhere = false;
      for (std::size_t i = 0; i < streams && !served_somewhere; ++i) {
        sim_allocator probe_state(cfg, small_device());
        run_program(probe_state, seed, at, streams, none, none);
        const served probe = allocate(probe_state, s.largest_free_block, k_streams[i]);
        served_somewhere = probe.ptr != nullptr && probe.from_cache && !probe.moved;
      }
      EXPECT_TRUE(served_somewhere) << "after " << at << " operations: largest_free_block "
                                    << s.largest_free_block << " is served on no stream";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, free_space,
                         ::testing::Values("", "max_split_size_mb:64",
                                           "roundup_power2_divisions:[1:4,64:2,>:1]",
                                           "memory_limit:1GiB,garbage_collection_threshold:0.5",
                                           "expandable_segments:True",
                                           "expandable_segments:True,memory_limit:1GiB",
                                           "expandable_segments:True,"
                                           "garbage_collection_threshold:0.3",
                                           "expandable_segments:True,roundup_power2_divisions:4",
                                           "expandable_segments:True,coarse_handles:8"),
                         [](const ::testing::TestParamInfo<std::string>& p) {
                           return "config" + std::to_string(p.index);
                         });

// Issue 9's report: replaying traces/resnet50_train.csv.gz with expandable segments, free bytes
// sat in partly used pages with largest_free_block 0, and the next requests were served from
// them. Every allocation of the trace that is served from cached memory alone must be at most
// the figure taken just before it; in both modes.
TEST(FreeSpace, Resnet50TraceNeverServesMoreThanTheLargestFreeBlock) {
  const std::vector<trace_event> events =
      read_trace(std::string(CUCACHE_SOURCE_DIR) + "/traces/resnet50_train.csv.gz");
  for (const char* conf : {"", "expandable_segments:True"}) {
    SCOPED_TRACE(conf);
    const config cfg = parse_config(conf);
    const detail::size_policy policy(cfg);
    sim_options o;
    o.events_complete_immediately = true;
    sim_allocator a(cfg, o);
    std::unordered_map<std::uintptr_t, void*> live;
    std::size_t from_cache = 0, with_zero_before = 0, into_partly_used_pages = 0;
    for (const trace_event& ev : events) {
      const auto s = reinterpret_cast<stream_handle>(ev.stream);
      if (ev.act == trace_event::action::allocate && ev.size != 0 && ev.pointer != 0) {
        const device_stats before = a.stats();
        const served got = allocate(a, ev.size, s);
        ASSERT_NE(got.ptr, nullptr);
        live[ev.pointer] = got.ptr;
        if (!got.from_cache || got.moved || before.events_pending != 0) continue;
        ++from_cache;
        // Before the fix the figure was 0 here while free bytes were not.
        with_zero_before += before.largest_free_block == 0;
        into_partly_used_pages += before.largest_free_block < before.free_bytes;
        ASSERT_LE(policy.round_size(ev.size), before.largest_free_block)
            << ev.size << " bytes at trace line " << ev.line << " were served from the cache; "
            << "free " << before.free_bytes << ", largest " << before.largest_free_block;
      } else if (ev.act == trace_event::action::free) {
        auto it = live.find(ev.pointer);
        if (it == live.end()) continue;
        a.alloc.deallocate(it->second);
        live.erase(it);
      }
    }
    EXPECT_GT(from_cache, 1000u);
    EXPECT_EQ(with_zero_before, 0u);
    EXPECT_GT(into_partly_used_pages, 0u);
    a.alloc.check_invariants();
  }
}

// The smallest form of the report: free space left in pages that live blocks still use. Default
// mode would call the free block the largest; expandable mode called it 0 (only idle pages and
// unmapped handles counted).
TEST(FreeSpace, FreeBytesInPartlyUsedPagesServeRequests) {
  sim_allocator a(parse_config("expandable_segments:True"));
  void* x = a.alloc.allocate(3 * MiB);  // [0, 3) MiB: pages 0-1
  void* y = a.alloc.allocate(5 * MiB);  // [3, 8) MiB: pages 1-3
  void* z = a.alloc.allocate(3 * MiB);  // [8, 11) MiB: pages 4-5
  a.alloc.deallocate(y);                // pages 2-3 idle; 5 MiB free over mapped pages
  device_stats s = a.stats();
  EXPECT_EQ(s.free_bytes, 12 * MiB - 6 * MiB);  // 12 MiB mapped, 6 MiB live
  EXPECT_EQ(s.largest_free_block, 5 * MiB);     // y's hole, on mapped pages
  EXPECT_EQ(s.free_block_count, 2u);            // y's hole and the 1 MiB after z (page 5)
  const served again = allocate(a, 5 * MiB, nullptr);
  EXPECT_TRUE(again.from_cache);
  EXPECT_EQ(again.ptr, y);
  // 1 MiB stays free in page 5 (beside z), but no request can have it: up to 1 MiB a request
  // goes to the small pool, and a larger one needs page 6, with no idle page left to move there.
  s = a.stats();
  EXPECT_EQ(s.free_bytes, MiB);
  EXPECT_EQ(s.largest_free_block, 0u);
  EXPECT_DOUBLE_EQ(s.external_fragmentation(), 1.0);
  const served more = allocate(a, MiB + 512, nullptr);
  EXPECT_FALSE(more.from_cache);
  a.alloc.deallocate(more.ptr);
  a.alloc.deallocate(again.ptr);
  a.alloc.deallocate(x);
  a.alloc.deallocate(z);
  a.alloc.check_invariants();
}

// stats(), memory_summary() and the out-of-memory report show the same figure: one computation.
TEST(FreeSpace, SummaryAndOutOfMemoryReportShowTheSameLargestFreeBlock) {
  for (const char* conf : {"", "expandable_segments:True"}) {
    SCOPED_TRACE(conf);
    sim_options o;
    o.capacity_bytes = 64 * MiB;
    sim_allocator a(parse_config(conf), o);
    std::vector<void*> held;
    for (int i = 0; i < 6; ++i) held.push_back(a.alloc.allocate(9 * MiB + 7 * KiB));
    a.alloc.deallocate(held[1]);
    a.alloc.deallocate(held[3]);
    std::string report;
    try {
      static_cast<void>(a.alloc.allocate(40 * MiB));
      FAIL() << "no out-of-memory";
    } catch (const out_of_memory& e) {
      report = e.what();
    }
    const device_stats s = a.stats();
    EXPECT_GT(s.largest_free_block, 0u);
    const std::string largest = detail::format_bytes(static_cast<double>(s.largest_free_block));
    EXPECT_NE(report.find("(largest " + largest + ")"), std::string::npos) << report;
    const std::string summary = a.alloc.memory_summary();
    EXPECT_NE(summary.find("largest servable request " + largest), std::string::npos) << summary;
    const served probe = allocate(a, s.largest_free_block, nullptr);
    EXPECT_TRUE(probe.from_cache);
    a.alloc.deallocate(probe.ptr);
    for (void* p : held) {
      if (p != held[1] && p != held[3]) a.alloc.deallocate(p);
    }
  }
}

}  // namespace
}  // namespace cucache::test
