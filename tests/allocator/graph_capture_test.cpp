// CUDA graph capture (issue 11, item 4) on the simulated device, which enforces the driver's
// capture rules: a call that is illegal while a stream captures throws 900 and invalidates the
// capture (end_capture then throws 901). Every test checks that cucache made no such call
// (capture_violations() == 0, end_capture succeeds), that captured allocations come from the
// capture's private pool and are never handed to anyone else until the pool is released, and the
// invariants after each step.
#include <gtest/gtest.h>

#include <iterator>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

class GraphCapture : public ::testing::TestWithParam<const char*> {
 protected:
  static sim_allocator make(const std::string& extra = "", sim_options o = {}) {
    std::string text = GetParam();
    if (!extra.empty()) text += (text.empty() ? "" : ",") + extra;
    return sim_allocator(parse_config(text), o);
  }
};

int code_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const cuda_error& e) {
    return e.code();
  }
  return 0;
}

TEST_P(GraphCapture, CapturedAllocationsComeFromAPrivatePoolUntilItIsReleased) {
  sim_allocator a = make();
  const stream_handle s = a.sim->create_stream();
  const stream_handle other = a.sim->create_stream();
  // A cached block on s: a cache hit inside the capture would hand it to the graph, and the free
  // after the capture to the next user.
  void* cached = a.alloc.allocate(1 * MiB, s);
  a.alloc.deallocate(cached);
  const auto mallocs = a.mallocs();

  const std::uint64_t id = a.sim->begin_capture(s);
  const graph_pool_id pool = graph_pool_id::of_capture(id);
  void* g1 = a.alloc.allocate(1 * MiB, s);
  EXPECT_NE(g1, cached);
  EXPECT_EQ(a.mallocs(), mallocs + 1);  // a segment of its own, made in relaxed capture mode
  graph_pool_info info = a.alloc.graph_pool_state(pool);
  EXPECT_TRUE(info.exists);
  EXPECT_EQ(info.uses, 1u);
  EXPECT_FALSE(info.released);
  EXPECT_EQ(info.reserved_bytes, 2 * MiB);  // a small-pool segment
  EXPECT_EQ(info.allocated_bytes, 1 * MiB);
  // Freed inside the capture, a block is reused by the same capture on the same stream: in the
  // graph, the next use on s comes after the last one.
  a.alloc.deallocate(g1);
  void* g2 = a.alloc.allocate(1 * MiB, s);
  EXPECT_EQ(g2, g1);
  a.alloc.deallocate(g2, s);
  a.alloc.check_invariants();
  EXPECT_EQ(a.sim->end_capture(s), id);  // never invalidated: cucache made no illegal call
  EXPECT_EQ(a.sim->capture_violations(), 0u);

  // The graph may replay at any time now: its memory goes to nobody else, on any stream.
  void* after = a.alloc.allocate(1 * MiB, s);
  EXPECT_EQ(after, cached);  // s's own pool
  void* elsewhere = a.alloc.allocate(1 * MiB, other);
  EXPECT_NE(elsewhere, g1);
  a.alloc.deallocate(after);
  a.alloc.deallocate(elsewhere);
  info = a.alloc.graph_pool_state(pool);
  EXPECT_EQ(info.allocated_bytes, 0u);
  EXPECT_EQ(info.reserved_bytes, 2 * MiB);
  a.alloc.check_invariants();

  // Released: one device synchronization (the last replay may still run), then the segment goes.
  const auto syncs = a.sim->calls(sim_call::device_synchronize);
  const auto frees = a.frees();
  a.alloc.release_graph_pool(pool);
  EXPECT_EQ(a.sim->calls(sim_call::device_synchronize), syncs + 1);
  EXPECT_EQ(a.frees(), frees + 1);
  info = a.alloc.graph_pool_state(pool);
  EXPECT_TRUE(info.released);
  EXPECT_EQ(info.reserved_bytes, 0u);
  EXPECT_THROW(a.alloc.release_graph_pool(pool), invalid_argument);  // no owner left
  a.alloc.check_invariants();
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  EXPECT_EQ(a.sim->capture_violations(), 0u);
}

TEST_P(GraphCapture, TheSimRefusesWhatCucacheNeverDoes) {
  // The model bites: the same calls made directly by the capturing thread in global mode are
  // refused and invalidate the capture.
  sim_allocator a = make();
  const stream_handle s = a.sim->create_stream();
  (void)a.sim->begin_capture(s);
  void* p = a.alloc.allocate(4 * MiB, s);  // a miss: segment_malloc, relaxed
  EXPECT_NE(p, nullptr);
  EXPECT_EQ(a.sim->capture_violations(), 0u);
  EXPECT_EQ(code_of([&] { (void)a.sim->segment_malloc(2 * MiB); }), k_sim_capture_unsupported);
  EXPECT_EQ(a.sim->capture_violations(), 1u);
  // An allocation on the invalidated capture fails clearly, changing nothing.
  EXPECT_EQ(code_of([&] { (void)a.alloc.allocate(4 * MiB, s); }), 901);
  EXPECT_EQ(code_of([&] { (void)a.sim->end_capture(s); }), k_sim_capture_invalidated);
  a.alloc.deallocate(p);
  a.alloc.check_invariants();
}

TEST_P(GraphCapture, TheSimRefusesTheIdOfACapturingStreamInEveryMode) {
  // As on the H200: cudaStreamGetId of a capturing stream is refused even in relaxed mode, and
  // the refusal invalidates the capture; the id of another stream is fine. cucache keys a
  // capturing stream by its handle, so allocations, frees and record_stream on it never ask.
  sim_allocator a = make();
  const stream_handle s = a.sim->create_stream();
  const stream_handle t = a.sim->create_stream();
  void* before = a.alloc.allocate(1 * MiB, s);  // s's own pool, keyed by its id
  (void)a.sim->begin_capture(s);
  void* p = a.alloc.allocate(4 * MiB, s);
  a.alloc.record_stream(before, s);
  a.alloc.deallocate(before, s);
  a.alloc.deallocate(p, s);
  void* q = a.alloc.allocate(512, t);
  a.alloc.record_stream(q, s);
  a.alloc.deallocate(q, t);
  EXPECT_EQ(a.sim->capture_violations(), 0u);
  EXPECT_NE(a.sim->stream_id(t), 0u);
  EXPECT_EQ(a.sim->capture_violations(), 0u);
  const capture_mode previous = a.sim->exchange_capture_mode(capture_mode::relaxed);
  EXPECT_EQ(code_of([&] { (void)a.sim->stream_id(s); }), k_sim_capture_unsupported);
  (void)a.sim->exchange_capture_mode(previous);
  EXPECT_EQ(a.sim->capture_violations(), 1u);
  EXPECT_EQ(code_of([&] { (void)a.sim->end_capture(s); }), k_sim_capture_invalidated);
  a.alloc.check_invariants();
}

TEST_P(GraphCapture, OtherThreadsAllocateFreeAndPollDuringAGlobalCapture) {
  // Another thread's misses (cudaMalloc / cuMemCreate + map), hits and pending-free polls
  // (cudaEventQuery) are "potentially unsafe" calls that global mode forbids to every thread:
  // cucache makes them in relaxed mode, so the capture survives.
  sim_allocator a = make();
  const stream_handle s = a.sim->create_stream();
  const stream_handle t = a.sim->create_stream();
  const stream_handle u = a.sim->create_stream();
  const std::uint64_t id = a.sim->begin_capture(s);
  void* g = a.alloc.allocate(8 * MiB, s);
  std::thread worker([&] {
    std::vector<void*> live;
    for (int i = 0; i < 50; ++i) {
      void* p = a.alloc.allocate((1 + static_cast<std::size_t>(i % 9)) * 700 * KiB, t);
      if (i % 3 == 0) a.alloc.record_stream(p, u);  // an event on u at the free
      live.push_back(p);
      if (live.size() > 5) {
        a.alloc.deallocate(live.front());
        live.erase(live.begin());
      }
      if (i % 10 == 0) a.sim->complete_stream(u);
    }
    for (void* p : live) a.alloc.deallocate(p);
  });
  worker.join();
  a.alloc.deallocate(g);
  EXPECT_EQ(a.sim->capture_violations(), 0u);
  EXPECT_EQ(a.sim->end_capture(s), id);
  EXPECT_GT(a.sim->calls(sim_call::event_query), 0u);
  a.alloc.check_invariants();
  a.alloc.end_allocate_to_pool(graph_pool_id::of_capture(id));
  a.alloc.release_graph_pool(graph_pool_id::of_capture(id));
  a.sim->complete_all();
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
}

TEST_P(GraphCapture, NothingSynchronizesTheDeviceWhileACaptureIsKnown) {
  // Under a limit, a miss on another stream would release cached memory (garbage collection, the
  // ladder's cudaFree or unmapping, all of which synchronize the device): during the capture
  // cucache takes only new memory, and says why when there is none.
  sim_allocator a = make("memory_limit:64MiB,garbage_collection_threshold:0.5");
  const stream_handle s = a.sim->create_stream();
  const stream_handle t = a.sim->create_stream();
  void* big = a.alloc.allocate(40 * MiB, t);
  a.alloc.deallocate(big);  // 40 MiB cached on t
  const std::uint64_t id = a.sim->begin_capture(s);
  void* g = a.alloc.allocate(4 * MiB, s);
  const auto syncs = a.sim->calls(sim_call::device_synchronize);
  const auto frees = a.frees();
  const auto unmaps = a.sim->calls(sim_call::unmap);
  // 60 MiB reserved (t's 40, the graph's 20): 50 MiB more fit only if t's cache is given back.
  try {
    (void)a.alloc.allocate(50 * MiB, t);
    ADD_FAILURE() << "50 MiB fitted under a 64 MiB limit with 60 MiB reserved";
  } catch (const out_of_memory& e) {
    EXPECT_NE(std::string(e.what()).find("graph capture"), std::string::npos) << e.what();
  }
  EXPECT_EQ(a.sim->calls(sim_call::device_synchronize), syncs);
  EXPECT_EQ(a.frees(), frees);
  EXPECT_EQ(a.sim->calls(sim_call::unmap), unmaps);
  // empty_cache refuses, changing nothing, and says why.
  const auto reserved = a.reserved();
  try {
    a.alloc.empty_cache();
    ADD_FAILURE() << "empty_cache during a capture";
  } catch (const cuda_error& e) {
    EXPECT_EQ(e.code(), 900);
    EXPECT_NE(std::string(e.what()).find("capture " + std::to_string(id)), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(a.reserved(), reserved);
  a.alloc.deallocate(g);
  EXPECT_EQ(a.sim->end_capture(s), id);
  EXPECT_EQ(a.sim->capture_violations(), 0u);
  a.alloc.check_invariants();
  // Once cucache sees the capture has ended -- an allocation on s finds it not capturing -- the
  // device may be synchronized again.
  a.alloc.deallocate(a.alloc.allocate(512, s));
  EXPECT_NO_THROW(a.alloc.empty_cache());
  a.alloc.release_graph_pool(graph_pool_id::of_capture(id));
  void* p = a.alloc.allocate(50 * MiB, t);  // the ladder may give t's cache back now
  a.alloc.deallocate(p);
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  a.alloc.check_invariants();
}

TEST_P(GraphCapture, ABlockOfTheCapturingStreamFreedDuringTheCaptureIsRetainedForTheGraph) {
  // x was allocated before the capture; the captured work uses it; the program frees it inside
  // the capture. After the capture s would reuse x at once -- while the graph replays on it.
  sim_allocator a = make();
  const stream_handle s = a.sim->create_stream();
  void* x = a.alloc.allocate(2 * MiB, s);
  const std::uint64_t id = a.sim->begin_capture(s);
  const graph_pool_id pool = graph_pool_id::of_capture(id);
  void* g = a.alloc.allocate(512, s);  // cucache now knows s captures
  a.alloc.deallocate(x);
  EXPECT_EQ(a.alloc.graph_pool_state(pool).retained_blocks, 1u);
  EXPECT_EQ(a.stats().active_bytes[0].current, static_cast<std::int64_t>(2 * MiB + 512));
  a.alloc.check_invariants();
  a.alloc.deallocate(g);
  EXPECT_EQ(a.sim->end_capture(s), id);
  void* y = a.alloc.allocate(2 * MiB, s);
  EXPECT_NE(y, x);  // held for the graph
  a.alloc.deallocate(y);
  a.alloc.release_graph_pool(pool);  // the graph is gone: after a synchronization x is s's again
  EXPECT_EQ(a.alloc.graph_pool_state(pool).retained_blocks, 0u);
  void* z = a.alloc.allocate(2 * MiB, s);
  EXPECT_TRUE(z == x || z == y);
  a.alloc.deallocate(z);
  a.alloc.check_invariants();
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  EXPECT_EQ(a.sim->capture_violations(), 0u);
}

TEST_P(GraphCapture, AFreeThatUsedACapturingStreamRecordsNoEventThereAndRetainsTheBlock) {
  // An event recorded on a capturing stream would be a node of the graph: no query could ever see
  // it complete (the third failure). cucache asks first, and holds the block for the
  // capture's graph instead -- even when nothing of the capture was allocated by cucache yet.
  sim_allocator a = make();
  const stream_handle s = a.sim->create_stream();
  const stream_handle t = a.sim->create_stream();
  void* p = a.alloc.allocate(3 * MiB, t);
  void* q = a.alloc.allocate(3 * MiB, t);
  a.alloc.record_stream(p, s);
  const std::uint64_t id = a.sim->begin_capture(s);
  const auto records = a.sim->calls(sim_call::event_record);
  a.alloc.deallocate(p);     // used on s (record_stream)
  a.alloc.deallocate(q, s);  // freed in the order of s
  EXPECT_EQ(a.sim->calls(sim_call::event_record), records);
  const graph_pool_info info = a.alloc.graph_pool_state(graph_pool_id::of_capture(id));
  EXPECT_TRUE(info.exists);
  EXPECT_EQ(info.retained_blocks, 2u);
  EXPECT_EQ(info.reserved_bytes, 0u);
  a.alloc.check_invariants();
  // Allocations on t keep going, without the retained blocks.
  void* r = a.alloc.allocate(3 * MiB, t);
  EXPECT_NE(r, p);
  EXPECT_NE(r, q);
  a.alloc.deallocate(r);
  EXPECT_EQ(a.sim->end_capture(s), id);
  EXPECT_EQ(a.sim->capture_violations(), 0u);
  a.alloc.release_graph_pool(graph_pool_id::of_capture(id));
  EXPECT_EQ(a.stats().active_bytes[0].current, 0);
  a.alloc.check_invariants();
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
}

TEST_P(GraphCapture, RoutedPoolsAreSharedByCapturesAndReleasedWithTheirLastOwner) {
  // PyTorch's protocol: beginAllocateToPool before cudaStreamBeginCapture, endAllocateToPool
  // after cudaStreamEndCapture, releasePool when the graph goes. Two graphs share one pool.
  sim_allocator a = make();
  const stream_handle s = a.sim->create_stream();
  const stream_handle other = a.sim->create_stream();
  const graph_pool_id pool{7, 0};
  std::uint64_t current = 0;  // the capture the filter accepts
  const auto filter = [&](stream_handle st) {
    const capture_info c = a.sim->capture_status(st);
    return c.state == capture_state::active && c.id == current;
  };
  a.alloc.begin_allocate_to_pool(pool, filter);
  EXPECT_THROW(a.alloc.begin_allocate_to_pool(pool, filter), invalid_argument);  // routed
  current = a.sim->begin_capture(s);
  void* x = a.alloc.allocate(5 * MiB, s);
  a.alloc.deallocate(x);
  EXPECT_EQ(a.sim->end_capture(s), current);
  a.alloc.end_allocate_to_pool(pool);
  EXPECT_EQ(a.alloc.graph_pool_state(pool).uses, 1u);
  EXPECT_FALSE(a.alloc.graph_pool_state(pool).routed);
  // Not routed and not capturing: s allocates from its own pool.
  void* own = a.alloc.allocate(5 * MiB, s);
  EXPECT_NE(own, x);
  a.alloc.deallocate(own);
  // The second graph, captured into the same pool, reuses the first one's memory.
  a.alloc.begin_allocate_to_pool(pool, filter);
  current = a.sim->begin_capture(s);
  void* y = a.alloc.allocate(5 * MiB, s);
  EXPECT_EQ(y, x);
  EXPECT_EQ(a.sim->end_capture(s), current);
  a.alloc.end_allocate_to_pool(pool);
  EXPECT_EQ(a.alloc.graph_pool_state(pool).uses, 2u);
  EXPECT_THROW(a.alloc.end_allocate_to_pool(pool), invalid_argument);  // nothing routed
  a.alloc.release_graph_pool(pool);                                    // the first graph
  EXPECT_FALSE(a.alloc.graph_pool_state(pool).released);
  // y is still live (a graph output the program holds): the pool keeps its segment.
  a.alloc.release_graph_pool(pool);
  EXPECT_TRUE(a.alloc.graph_pool_state(pool).released);
  EXPECT_EQ(a.alloc.graph_pool_state(pool).reserved_bytes, 20 * MiB);
  void* elsewhere = a.alloc.allocate(5 * MiB, other);
  EXPECT_NE(elsewhere, x);  // a released pool's memory goes back to the device, to nobody else
  a.alloc.deallocate(elsewhere);
  a.alloc.deallocate(y);
  a.alloc.check_invariants();
  a.alloc.empty_cache();
  EXPECT_EQ(a.alloc.graph_pool_state(pool).reserved_bytes, 0u);
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  EXPECT_EQ(a.sim->capture_violations(), 0u);
  EXPECT_THROW(a.alloc.begin_allocate_to_pool({0, 0}, filter), invalid_argument);
  EXPECT_THROW(a.alloc.begin_allocate_to_pool({8, 0}, nullptr), invalid_argument);
  EXPECT_THROW(a.alloc.release_graph_pool({9, 9}), invalid_argument);
}

TEST_P(GraphCapture, AReleasedPoolsBlockFreedInALaterCaptureIsKeptForThatGraph) {
  // PyTorch's test_graph_capture_reset_recapture: a graph's output outlives the graph (reset),
  // a second capture on the same stream writes to it and then frees it (b = b + 2). The second
  // graph's replays write that memory: it must stay reserved, and nobody else's, until the second
  // graph goes -- not be returned to the device when the first pool settles again.
  sim_allocator a = make();
  const stream_handle s = a.sim->create_stream();
  const stream_handle other = a.sim->create_stream();
  std::uint64_t current = 0;
  const auto filter = [&](stream_handle st) {
    const capture_info c = a.sim->capture_status(st);
    return c.state == capture_state::active && c.id == current;
  };
  const graph_pool_id p1{1, 0};
  const graph_pool_id p2{2, 0};
  a.alloc.begin_allocate_to_pool(p1, filter);
  current = a.sim->begin_capture(s);
  void* b = a.alloc.allocate(4096, s);
  for (int i = 0; i < 10; ++i) {
    void* next = a.alloc.allocate(4096, s);
    a.alloc.deallocate(b, s);
    b = next;
  }
  EXPECT_EQ(a.sim->end_capture(s), current);
  a.alloc.end_allocate_to_pool(p1);
  a.alloc.release_graph_pool(p1);  // g.reset(): b, the graph's output, is still live
  const auto frees_before = a.frees();

  a.alloc.begin_allocate_to_pool(p2, filter);
  current = a.sim->begin_capture(s);
  void* c = a.alloc.allocate(4096, s);
  a.alloc.deallocate(b, s);  // the old output freed inside the second capture, which wrote it
  EXPECT_EQ(a.sim->end_capture(s), current);
  a.alloc.end_allocate_to_pool(p2);
  // Graph 2 may replay now: the memory at b is still the allocator's and goes to nobody.
  EXPECT_EQ(a.frees(), frees_before);
  std::vector<void*> others;
  for (int i = 0; i < 8; ++i) {
    for (stream_handle st : {s, other}) {
      void* q = a.alloc.allocate(4096, st);
      EXPECT_NE(q, b);
      others.push_back(q);
    }
  }
  for (void* q : others) a.alloc.deallocate(q);
  a.alloc.check_invariants();
  a.alloc.deallocate(c, s);
  a.alloc.release_graph_pool(p2);  // graph 2 goes: now nothing can touch b's memory
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  EXPECT_EQ(a.sim->capture_violations(), 0u);
  a.alloc.check_invariants();
}

TEST_P(GraphCapture, ARouteOutsideACaptureIsAMemPool) {
  // torch.cuda.use_mem_pool: a route whose filter takes a stream that is not capturing.
  sim_allocator a = make();
  const stream_handle s = a.sim->create_stream();
  const graph_pool_id pool{0, 3};
  a.alloc.begin_allocate_to_pool(pool, [&](stream_handle st) { return st == s; });
  void* p = a.alloc.allocate(1 * MiB, s);
  void* n = a.alloc.allocate(1 * MiB, nullptr);  // not routed
  EXPECT_EQ(a.alloc.graph_pool_state(pool).allocated_bytes, 1 * MiB);
  a.alloc.deallocate(p);
  a.alloc.deallocate(n);
  a.alloc.end_allocate_to_pool(pool);
  a.alloc.release_graph_pool(pool);
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  a.alloc.check_invariants();
}

TEST_P(GraphCapture, ForkJoinInsideACaptureKeepsEachStreamsBlocksToItself) {
  // A capture that forks onto a second stream (it waits on an event of the first, and so joins
  // the capture): both streams allocate from the capture's pool, each from its own part, and a
  // block used on the other one is retained, not evented.
  sim_allocator a = make();
  const stream_handle s = a.sim->create_stream();
  const stream_handle side = a.sim->create_stream();
  const std::uint64_t id = a.sim->begin_capture(s);
  // (The sim has no fork/join model: a second begin_capture stands for the joined stream; its
  // capture id differs, so it has a pool of its own -- the retention rule is what is tested.)
  const std::uint64_t id2 = a.sim->begin_capture(side);
  void* p = a.alloc.allocate(6 * MiB, s);
  void* q = a.alloc.allocate(6 * MiB, side);
  EXPECT_NE(p, q);
  a.alloc.record_stream(p, side);
  a.alloc.deallocate(p);
  EXPECT_EQ(a.alloc.graph_pool_state(graph_pool_id::of_capture(id2)).retained_blocks, 1u);
  void* p2 = a.alloc.allocate(6 * MiB, s);
  EXPECT_NE(p2, p);  // held for side's graph
  a.alloc.deallocate(p2);
  a.alloc.deallocate(q);
  EXPECT_EQ(a.sim->end_capture(side), id2);
  EXPECT_EQ(a.sim->end_capture(s), id);
  EXPECT_EQ(a.sim->capture_violations(), 0u);
  a.alloc.check_invariants();
  a.alloc.release_graph_pool(graph_pool_id::of_capture(id));
  a.alloc.release_graph_pool(graph_pool_id::of_capture(id2));
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  a.alloc.check_invariants();
}

TEST_P(GraphCapture, ARecordThatFailsDuringACaptureHoldsTheBlockUntilTheNextSynchronization) {
  sim_allocator a = make();
  const stream_handle s = a.sim->create_stream();
  const stream_handle t = a.sim->create_stream();
  void* p = a.alloc.allocate(2 * MiB, t);
  a.alloc.record_stream(p, stream(0x7000));
  const std::uint64_t id = a.sim->begin_capture(s);
  void* g = a.alloc.allocate(512, s);  // known capture: no device synchronization allowed
  a.sim->fail_nth(sim_call::event_record, 1);
  const auto syncs = a.sim->calls(sim_call::device_synchronize);
  a.alloc.deallocate(p);
  EXPECT_EQ(a.sim->calls(sim_call::device_synchronize), syncs);
  EXPECT_NE(a.alloc.allocate(2 * MiB, t), p);
  a.alloc.deallocate(g);
  EXPECT_EQ(a.sim->end_capture(s), id);
  a.alloc.release_graph_pool(graph_pool_id::of_capture(id));  // synchronizes: p is t's again
  EXPECT_EQ(a.stats().active_bytes[0].current, static_cast<std::int64_t>(2 * MiB));
  a.alloc.check_invariants();
  EXPECT_EQ(a.sim->capture_violations(), 0u);
}

TEST_P(GraphCapture, RandomizedCapturesNeverShareAGraphsMemory) {
  // Random allocations, frees (plain and ordered on random streams), record_stream, event
  // completion, and captures begun, ended and released on four streams. A shadow model keeps the
  // address ranges each live graph may touch at replay -- its allocations, and the blocks freed or
  // used on its stream during the capture -- and checks that no allocation outside that capture
  // overlaps them, that live allocations never overlap, that cucache makes no call the capture
  // forbids, and the invariants after every operation. (Each capture allocates right after it
  // begins and cucache is told when it ends, so cucache always knows which streams capture.)
  sim_allocator a = make();
  std::mt19937_64 rng(20261201);
  constexpr int k_streams = 4;
  std::vector<stream_handle> streams;
  for (int i = 0; i < k_streams; ++i) streams.push_back(a.sim->create_stream());
  std::vector<std::uint64_t> capturing(k_streams, 0);  // capture id per stream, 0 = none
  struct range {
    std::uintptr_t begin, end;
  };
  std::map<std::uint64_t, std::vector<range>> protect;  // per capture id, until its release
  std::vector<std::uint64_t> ended;                     // captured graphs not released yet
  struct live_block {
    std::size_t bytes;
    int home;               // stream index, -1 for the legacy stream
    std::uint64_t capture;  // the capture it was allocated in, 0 = none
    std::vector<int> uses;  // record_stream
  };
  std::map<std::uintptr_t, live_block> live;
  auto stream_of = [&](int i) { return i < 0 ? nullptr : streams[static_cast<std::size_t>(i)]; };
  auto overlaps = [](const range& x, const range& y) { return x.begin < y.end && y.begin < x.end; };
  auto check_alloc = [&](void* p, std::size_t bytes, std::uint64_t in_capture) {
    const range r{addr(p), addr(p) + bytes};
    auto next = live.lower_bound(r.begin);
    if (next != live.end()) {
      ASSERT_FALSE(overlaps(r, {next->first, next->first + next->second.bytes}));
    }
    if (next != live.begin()) {
      auto prev = std::prev(next);
      ASSERT_FALSE(overlaps(r, {prev->first, prev->first + prev->second.bytes}));
    }
    for (const auto& [id, ranges] : protect) {
      if (id == in_capture) continue;
      for (const range& g : ranges) {
        ASSERT_FALSE(overlaps(r, g))
            << "an allocation outside capture " << id << " got memory its graph uses";
      }
    }
  };
  auto allocate = [&](int home, std::size_t bytes) {
    const std::uint64_t c = home < 0 ? 0 : capturing[static_cast<std::size_t>(home)];
    void* p = a.alloc.allocate(bytes, stream_of(home));
    check_alloc(p, bytes, c);
    if (HasFatalFailure()) return;
    live[addr(p)] = live_block{bytes, home, c, {}};
    if (c != 0) protect[c].push_back({addr(p), addr(p) + bytes});
  };
  auto size = [&] { return rng() % 4 == 0 ? (1 + rng() % 32) * MiB : 512 * (1 + rng() % 2048); };
  const auto ops = static_cast<int>(scaled_ops(6000, 1000));
  for (int op = 0; op < ops && !HasFatalFailure(); ++op) {
    const auto dice = rng() % 100;
    const int si = static_cast<int>(rng() % k_streams);
    const auto su = static_cast<std::size_t>(si);
    if (dice < 4) {
      if (capturing[su] == 0) {
        capturing[su] = a.sim->begin_capture(streams[su]);
        allocate(si, size());
      } else {
        const std::uint64_t id = capturing[su];
        ASSERT_EQ(a.sim->end_capture(streams[su]), id);
        capturing[su] = 0;
        a.alloc.end_allocate_to_pool(graph_pool_id::of_capture(id));
        ended.push_back(id);
      }
    } else if (dice < 7) {
      if (!ended.empty()) {
        const std::size_t k = rng() % ended.size();
        const std::uint64_t id = ended[k];
        ended.erase(ended.begin() + static_cast<std::ptrdiff_t>(k));
        a.alloc.release_graph_pool(graph_pool_id::of_capture(id));
        protect.erase(id);
      }
    } else if (dice < 50) {
      allocate(static_cast<int>(rng() % (k_streams + 1)) - 1, size());
    } else if (dice < 55) {
      if (!live.empty()) {
        auto it = std::next(live.begin(), static_cast<std::ptrdiff_t>(rng() % live.size()));
        if (si != it->second.home) {
          a.alloc.record_stream(reinterpret_cast<void*>(it->first), streams[su]);
          it->second.uses.push_back(si);
        }
      }
    } else if (dice < 95) {
      if (!live.empty()) {
        auto it = std::next(live.begin(), static_cast<std::ptrdiff_t>(rng() % live.size()));
        const live_block b = it->second;
        const range r{it->first, it->first + b.bytes};
        std::vector<int> uses = b.uses;
        if (rng() % 2 == 0) {
          a.alloc.deallocate(reinterpret_cast<void*>(it->first));
        } else {
          a.alloc.deallocate(reinterpret_cast<void*>(it->first), streams[su]);
          if (si != b.home) uses.push_back(si);
        }
        // Retained for every capture that may touch it: its own stream's (for a block of a
        // stream's own pool) and those of the streams that used it.
        if (b.capture == 0 && b.home >= 0 && capturing[static_cast<std::size_t>(b.home)] != 0) {
          protect[capturing[static_cast<std::size_t>(b.home)]].push_back(r);
        }
        for (int u : uses) {
          if (u >= 0 && capturing[static_cast<std::size_t>(u)] != 0) {
            protect[capturing[static_cast<std::size_t>(u)]].push_back(r);
          }
        }
        live.erase(it);
      }
    } else {
      a.sim->complete_all();
    }
    a.alloc.check_invariants();
    ASSERT_EQ(a.sim->capture_violations(), 0u) << "after operation " << op;
  }
  for (int i = 0; i < k_streams; ++i) {
    const auto u = static_cast<std::size_t>(i);
    if (capturing[u] == 0) continue;
    ASSERT_EQ(a.sim->end_capture(streams[u]), capturing[u]);
    a.alloc.end_allocate_to_pool(graph_pool_id::of_capture(capturing[u]));
    ended.push_back(capturing[u]);
  }
  for (std::uint64_t id : ended) a.alloc.release_graph_pool(graph_pool_id::of_capture(id));
  for (const auto& [p, b] : live) a.alloc.deallocate(reinterpret_cast<void*>(p));
  a.sim->complete_all();
  a.alloc.empty_cache();
  a.alloc.check_invariants();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  EXPECT_EQ(a.sim->capture_violations(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Modes, GraphCapture, ::testing::Values("", "expandable_segments:True"),
                         [](const auto& param) {
                           return std::string(param.index == 0 ? "Default" : "Expandable");
                         });

}  // namespace
}  // namespace cucache::test
