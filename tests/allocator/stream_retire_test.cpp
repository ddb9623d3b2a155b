// What a stream costs, and when its state goes (issue 22, items 1-4; docs/design.md, "What a
// stream costs"). A program that creates a stream per request, allocates on it, frees in its
// order and destroys it must not keep a pool -- its host memory, its cached device memory, in
// expandable mode its virtual ranges -- per stream ever seen. The pool of a stream that is gone
// is handed, with its cache, to the next new stream once a quiet event recorded on the old
// stream (at an ordered free on it) has completed, or once a device-wide path gave its memory
// back. Never a call on a destroyed stream: the simulated device rejects those
// (destroyed_stream_calls).
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

class StreamRetire : public ::testing::TestWithParam<const char*> {
 protected:
  static bool expandable() { return std::string(GetParam()).find("True") != std::string::npos; }
  static sim_allocator make(bool events_complete, bool host_memory = false) {
    sim_options o;
    o.events_complete_immediately = events_complete;
    o.host_memory = host_memory;
    return sim_allocator(parse_config(GetParam()), o);
  }
  /// Device memory obtained so far: cudaMalloc calls, or in expandable mode virtual ranges.
  static std::uint64_t reservations(const sim_allocator& a) {
    return a.sim->calls(expandable() ? sim_call::va_reserve : sim_call::segment_malloc);
  }
};

// Item 1-3: 2,000 requests, each on a new stream destroyed after its ordered free. Before: a pool
// per stream, 2 MiB more reserved per request (default mode), a range of the device's size per
// stream until the address space ran out (expandable mode: va_reserve failed at ~820 streams).
TEST_P(StreamRetire, AStreamPerRequestReusesTheGoneStreamsPool) {
  sim_allocator a = make(/*events_complete=*/true);
  for (int i = 0; i < 2000; ++i) {
    const stream_handle s = a.sim->create_stream();
    void* p = a.alloc.allocate(1 * MiB, s);
    ASSERT_NE(p, nullptr) << "request " << i;
    a.alloc.deallocate(p, s);
    a.sim->destroy_stream(s);
  }
  EXPECT_EQ(reservations(a), 1u);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(2 * MiB));
  EXPECT_EQ(a.sim->destroyed_stream_calls(), 0u);
  a.alloc.check_invariants();
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  a.alloc.check_invariants();
}

// The quiet event is recorded after the kernel on the stream: until it completes, the next stream
// (with the same handle value) gets other memory; once it has, the next new stream gets the pool
// and its block.
TEST_P(StreamRetire, AGoneStreamsPoolWaitsForItsWork) {
  sim_allocator a = make(/*events_complete=*/false, /*host_memory=*/true);
  const stream_handle s = a.sim->create_stream();
  const std::uint64_t s_id = a.sim->stream_id(s);
  void* p = a.alloc.allocate(1 * MiB, s);
  std::byte* p_bytes = a.sim->host_view(p, 512);
  const event_handle kernel = a.sim->event_create();
  a.sim->event_record(kernel, s);  // still running when the stream is destroyed
  a.alloc.deallocate(p, s);
  a.sim->destroy_stream(s);
  const stream_handle t = a.sim->create_stream();
  ASSERT_EQ(t, s);
  void* q = a.alloc.allocate(1 * MiB, t);
  EXPECT_NE(a.sim->host_view(q, 512), p_bytes) << "the new stream got the running kernel's memory";
  EXPECT_EQ(reservations(a), 2u);
  a.sim->complete_stream_id(s_id);  // the kernel and the quiet event after it complete
  const stream_handle u = a.sim->create_stream();
  void* r = a.alloc.allocate(1 * MiB, u);
  EXPECT_EQ(r, p) << "the pool of the gone stream, its work done, serves the next new stream";
  EXPECT_EQ(reservations(a), 2u);
  EXPECT_EQ(a.sim->destroyed_stream_calls(), 0u);
  a.alloc.check_invariants();
  a.alloc.deallocate(q, t);
  a.alloc.deallocate(r, u);
  a.sim->destroy_stream(t);
  a.sim->destroy_stream(u);
  a.sim->event_destroy(kernel);
  a.sim->complete_all();
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  a.alloc.check_invariants();
}

// An ordered free of a gone stream's last block on a new stream that got its handle value: the
// handles are equal, the streams are not, so no quiet event is recorded there (it would prove
// only the new stream's work done) and the gone stream's pool is not handed on while its kernel
// runs.
TEST_P(StreamRetire, NoQuietEventOnANewStreamWithTheGoneOnesHandle) {
  sim_allocator a = make(/*events_complete=*/false, /*host_memory=*/true);
  const stream_handle s = a.sim->create_stream();
  void* p = a.alloc.allocate(1 * MiB, s);
  std::byte* p_bytes = a.sim->host_view(p, 512);
  const event_handle kernel = a.sim->event_create();
  a.sim->event_record(kernel, s);
  a.sim->destroy_stream(s);
  const stream_handle t = a.sim->create_stream();
  ASSERT_EQ(t, s);
  a.alloc.deallocate(p, t);
  EXPECT_EQ(a.sim->calls(sim_call::event_record), 1u);  // the test's kernel only
  a.sim->complete_stream(t);
  const stream_handle u = a.sim->create_stream();
  void* q = a.alloc.allocate(1 * MiB, u);
  EXPECT_NE(a.sim->host_view(q, 512), p_bytes) << "the new stream got the running kernel's memory";
  EXPECT_EQ(a.sim->destroyed_stream_calls(), 0u);
  a.alloc.deallocate(q, u);
  a.sim->destroy_stream(t);
  a.sim->destroy_stream(u);
  a.sim->event_destroy(kernel);
  a.alloc.check_invariants();
}

// A live stream whose quiet pool went to another stream gets a pool of its own again, also through
// this thread's pool cache, which still names the old pool.
TEST_P(StreamRetire, ALiveStreamWhosePoolWentToAnotherGetsANewOne) {
  sim_allocator a = make(/*events_complete=*/true);
  const stream_handle s = a.sim->create_stream();
  void* p = a.alloc.allocate(1 * MiB, s);
  a.alloc.deallocate(p, s);  // s's pool is quiet, its event complete
  const stream_handle t = a.sim->create_stream();
  void* x = a.alloc.allocate(1 * MiB, t);
  EXPECT_EQ(x, p);  // t got s's pool
  void* y = a.alloc.allocate(1 * MiB, s);  // this thread's cache names the pool t has now
  EXPECT_NE(y, x);
  void* z = nullptr;
  std::thread([&] { z = a.alloc.allocate(1 * MiB, s); }).join();
  EXPECT_NE(z, x);
  EXPECT_NE(z, y);
  a.alloc.check_invariants();
  for (void* v : {x}) a.alloc.deallocate(v, t);
  for (void* v : {y, z}) a.alloc.deallocate(v, s);
  a.sim->destroy_stream(s);
  a.sim->destroy_stream(t);
  EXPECT_EQ(a.sim->destroyed_stream_calls(), 0u);
  a.alloc.check_invariants();
}

// Unordered frees name no stream, so no quiet event is recorded: the pools of gone streams keep
// their cache until a device-wide path (here empty_cache) gives it back; then they hold nothing,
// their virtual ranges are returned, and new streams get them.
TEST_P(StreamRetire, EmptyCacheRetiresThePoolsOfGoneStreams) {
  sim_allocator a = make(/*events_complete=*/true);
  for (int i = 0; i < 100; ++i) {
    const stream_handle s = a.sim->create_stream();
    a.alloc.deallocate(a.alloc.allocate(1 * MiB, s));
    a.sim->destroy_stream(s);
  }
  EXPECT_EQ(reservations(a), 100u);
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(200 * MiB));
  a.alloc.empty_cache();
  EXPECT_EQ(a.reserved(), 0);
  if (expandable()) {
    EXPECT_EQ(a.sim->calls(sim_call::va_free), 100u);  // address space returned
  }
  for (int i = 0; i < 100; ++i) {
    const stream_handle s = a.sim->create_stream();
    void* p = a.alloc.allocate(1 * MiB, s);
    a.alloc.deallocate(p, s);
    a.sim->destroy_stream(s);
  }
  EXPECT_EQ(reservations(a), 101u);  // one more, reused by the 99 after it
  EXPECT_EQ(a.reserved(), static_cast<std::int64_t>(2 * MiB));
  EXPECT_EQ(a.sim->destroyed_stream_calls(), 0u);
  a.alloc.check_invariants();
}

// The quiet event's rate: a loop of ordered pairs on one stream records one on the first 8 quiet
// frees, then one in 256 (n = 0..9999: 8 + 39).
TEST_P(StreamRetire, AHotLoopRecordsFewQuietEvents) {
  sim_allocator a = make(/*events_complete=*/true);
  const stream_handle s = a.sim->create_stream();
  for (int i = 0; i < 10000; ++i) a.alloc.deallocate(a.alloc.allocate(4 * KiB, s), s);
  EXPECT_EQ(a.sim->calls(sim_call::event_record), 47u);
  a.sim->destroy_stream(s);
}

// Item 4: 1,000 pending frees, each behind its own stalled stream: an allocation polls at most
// k_poll_queues of their queues, in turn (before: every queue, 1,000 event queries).
TEST_P(StreamRetire, APollQueriesABoundedNumberOfQueues) {
  sim_allocator a = make(/*events_complete=*/false);
  const stream_handle own = a.sim->create_stream();
  std::vector<stream_handle> others;
  for (int i = 0; i < 1000; ++i) {
    others.push_back(a.sim->create_stream());
    void* p = a.alloc.allocate(4 * KiB, own);
    a.alloc.deallocate(p, others.back());  // ordered on another stream: pending on its event
  }
  const std::uint64_t before = a.sim->calls(sim_call::event_query);
  a.alloc.deallocate(a.alloc.allocate(4 * KiB, own), own);
  EXPECT_EQ(a.sim->calls(sim_call::event_query) - before, 32u);
  a.alloc.check_invariants();
  a.sim->complete_all();
  // Every queue is looked at within 1000 / 32 polls: all the blocks come back.
  for (int i = 0; i < 40; ++i) a.alloc.deallocate(a.alloc.allocate(4 * KiB, own), own);
  EXPECT_EQ(a.stats().events_pending, 0u);
  a.alloc.check_invariants();
  for (stream_handle s : others) a.sim->destroy_stream(s);
  a.sim->destroy_stream(own);
}

INSTANTIATE_TEST_SUITE_P(Modes, StreamRetire,
                         ::testing::Values("", "expandable_segments:True"));

// Expandable mode, streams live at once. Each pool used to reserve a range of the device's size
// (small pool) and one of twice that (large pool) for as long as it lived, so ~820 live streams
// holding cached memory exhausted the simulated device's 64 TiB of address space (~935 on the
// H200's 128 TiB), and every allocation failed from then on. Past an address budget of 32 devices,
// a pool's ranges start at 64 MiB and double (pager::next_range_bytes).

/// The address space of the expandable ranges of `stream`'s pool of one kind, oldest first
/// (segments() lists by address; the sim hands out rising addresses).
std::vector<std::size_t> range_sizes(const sim_allocator& a, stream_handle stream, bool small) {
  std::vector<std::size_t> out;
  for (const segment_view& v : a.alloc.segments()) {
    if (v.expandable && v.stream == stream && v.small == small) out.push_back(v.size);
  }
  return out;
}

std::size_t address_space(const sim_allocator& a) {
  std::size_t n = 0;
  for (const segment_view& v : a.alloc.segments()) n += v.expandable ? v.size : 0;
  return n;
}

TEST(LiveStreams, ThreeThousandStreamsEachHoldingCacheInBothPools) {
  sim_options o;  // 80 GiB: full ranges of 80 and 160 GiB until 2,560 GiB are reserved
  o.events_complete_immediately = true;
  sim_allocator a(parse_config("expandable_segments:True"), o);
  // Each stream holds a small block (its pool in use: never handed to another stream) and has
  // a large one cached (freed: its pages stay mapped in the pool).
  std::vector<stream_handle> streams(3000);
  std::vector<void*> small(streams.size());
  for (std::size_t i = 0; i < streams.size(); ++i) {
    streams[i] = a.sim->create_stream();
    small[i] = a.alloc.allocate(512 * KiB, streams[i]);
    void* large = a.alloc.allocate(8 * MiB, streams[i]);
    ASSERT_NE(small[i], nullptr) << "stream " << i;
    ASSERT_NE(large, nullptr) << "stream " << i;
    a.alloc.deallocate(large, streams[i]);
  }
  EXPECT_EQ(a.sim->calls(sim_call::va_reserve), 6000u);
  // Ten pools of 80 + 160 GiB, the eleventh's small range (2,480 GiB in all), then 64 MiB each.
  EXPECT_EQ(address_space(a), 2480 * GiB + 64 * MiB + 2989 * 128 * MiB);
  EXPECT_EQ(range_sizes(a, streams[0], false), std::vector<std::size_t>{160 * GiB});
  EXPECT_EQ(range_sizes(a, streams[2999], true), std::vector<std::size_t>{64 * MiB});
  // Every stream again: its own cache serves it, no new range, no new page.
  const std::uint64_t creates = a.sim->calls(sim_call::phys_create);
  for (stream_handle s : streams) a.alloc.deallocate(a.alloc.allocate(8 * MiB, s), s);
  EXPECT_EQ(a.sim->calls(sim_call::va_reserve), 6000u);
  EXPECT_EQ(a.sim->calls(sim_call::phys_create), creates);
  a.alloc.check_invariants();
  // Freed, gone streams and empty_cache: every range goes back.
  for (std::size_t i = 0; i < streams.size(); ++i) {
    a.alloc.deallocate(small[i], streams[i]);
    a.sim->destroy_stream(streams[i]);
  }
  a.alloc.empty_cache();
  EXPECT_EQ(address_space(a), 0u);
  EXPECT_EQ(a.sim->calls(sim_call::va_free), 6000u);
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  EXPECT_EQ(a.sim->destroyed_stream_calls(), 0u);
  a.alloc.check_invariants();
}

/// A 1 GiB device whose address budget (32 GiB) eleven streams spend, each holding a small and a
/// large block: the next pool's ranges start small.
struct crowded_device {
  crowded_device() : a(parse_config("expandable_segments:True"), options()) {
    for (int i = 0; i < 11; ++i) {
      const stream_handle s = a.sim->create_stream();
      held.emplace_back(s, a.alloc.allocate(4 * KiB, s));
      held.emplace_back(s, a.alloc.allocate(4 * MiB, s));
    }
  }
  ~crowded_device() {
    for (auto [s, ptr] : held) a.alloc.deallocate(ptr, s);
  }
  static sim_options options() {
    sim_options o;
    o.capacity_bytes = 1 * GiB;
    o.events_complete_immediately = true;
    return o;
  }
  sim_allocator a;
  std::vector<std::pair<stream_handle, void*>> held;
};

TEST(LiveStreams, APoolPastTheBudgetGrowsRangesByDoublingAndGivesEmptyOnesBack) {
  crowded_device d;
  sim_allocator& a = d.a;
  const stream_handle s = a.sim->create_stream();
  void* x = a.alloc.allocate(40 * MiB, s);  // first range: 64 MiB
  void* y = a.alloc.allocate(40 * MiB, s);  // 24 MiB left there: a range of twice 64 MiB
  void* z = a.alloc.allocate(200 * MiB, s);  // holes of 24 and 88 MiB: twice 192 MiB
  EXPECT_EQ(range_sizes(a, s, false), (std::vector<std::size_t>{64 * MiB, 128 * MiB, 384 * MiB}));
  void* w = a.alloc.allocate(20 * MiB, s);  // the best fit: the 24 MiB hole of the first range
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(w), reinterpret_cast<std::uintptr_t>(x) + 40 * MiB);
  a.alloc.check_invariants();
  a.alloc.deallocate(x, s);
  a.alloc.deallocate(y, s);
  a.alloc.deallocate(w, s);
  // The two older ranges are empty: empty_cache unmaps their pages and gives them back; the
  // newest, holding z, stays.
  a.alloc.empty_cache();
  EXPECT_EQ(range_sizes(a, s, false), std::vector<std::size_t>{384 * MiB});
  a.alloc.check_invariants();
  // Empty too, the newest stays while the pool is in use ...
  void* v = a.alloc.allocate(4 * KiB, s);
  a.alloc.deallocate(z, s);
  a.alloc.empty_cache();
  EXPECT_EQ(range_sizes(a, s, false), std::vector<std::size_t>{384 * MiB});
  // ... and goes with the pool's last block.
  a.alloc.deallocate(v, s);
  a.alloc.empty_cache();
  EXPECT_TRUE(range_sizes(a, s, false).empty());
  EXPECT_TRUE(range_sizes(a, s, true).empty());
  a.alloc.check_invariants();
  a.sim->destroy_stream(s);
}

TEST(LiveStreams, NoAddressSpaceRunsTheLadderThenNamesTheCause) {
  crowded_device d;
  sim_allocator& a = d.a;
  const stream_handle s = a.sim->create_stream();
  // Refused once: the ladder gives empty ranges back and the second try gets one.
  a.sim->fail_nth(sim_call::va_reserve, 1);
  void* x = a.alloc.allocate(40 * MiB, s);
  EXPECT_NE(x, nullptr);
  EXPECT_EQ(a.stats().alloc_retry_count, 1u);
  // Refused for good: an out-of-memory error that says so, nothing reserved or leaked.
  a.sim->fail_always(sim_call::va_reserve);
  const std::int64_t reserved = a.reserved();
  try {
    (void)a.alloc.allocate(100 * MiB, s);  // the 24 MiB hole cannot hold it
    ADD_FAILURE() << "no error";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("virtual address space has no room"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(a.reserved(), reserved);
  EXPECT_EQ(a.stats().oom_count, 1u);
  void* y = a.alloc.allocate(20 * MiB, s);  // a hole holds it: no range needed
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(y), reinterpret_cast<std::uintptr_t>(x) + 40 * MiB);
  a.sim->fail_always(sim_call::va_reserve, false);
  a.alloc.deallocate(x, s);
  a.alloc.deallocate(y, s);
  a.alloc.check_invariants();
  a.sim->destroy_stream(s);
}

}  // namespace
}  // namespace cucache::test
