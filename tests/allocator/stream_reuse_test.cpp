// Streams die and their handles come back (issue 11, item 3). After cudaStreamDestroy the runtime
// hands the same cudaStream_t value to the next cudaStreamCreate, while work queued on the dead
// stream may still run. Pools are keyed by the stream id (cudaStreamGetId), which is never reused,
// so the new stream never gets a block whose last use is the dead stream's work. The simulated
// device reuses handle values the same way; a "running kernel" is an event recorded on the stream
// that has not completed.
#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <utility>

#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

class StreamReuse : public ::testing::TestWithParam<const char*> {
 protected:
  static sim_allocator make() {
    sim_options o;
    o.host_memory = true;  // to compare the physical bytes behind two addresses
    return sim_allocator(parse_config(GetParam()), o);
  }
};

TEST_P(StreamReuse, DestroyThenCreateTheSameHandleWithARunningKernel) {
  for (std::size_t bytes : {4 * KiB, 8 * MiB, 64 * MiB}) {
    SCOPED_TRACE(bytes);
    sim_allocator a = make();
    const stream_handle s = a.sim->create_stream();
    void* p = a.alloc.allocate(bytes, s);
    // (The physical memory behind the block's first bytes: a block may span several mappings.)
    std::byte* p_bytes = a.sim->host_view(p, 512);
    ASSERT_NE(p_bytes, nullptr);
    // The kernel that uses p, still running when the program frees p and destroys the stream:
    // both are legal (the free is ordered after the kernel on s, and cudaStreamDestroy returns at
    // once, the work finishing in the background).
    const event_handle kernel = a.sim->event_create();
    a.sim->event_record(kernel, s);
    a.alloc.deallocate(p);
    a.sim->destroy_stream(s);
    const stream_handle t = a.sim->create_stream();
    ASSERT_EQ(t, s);  // the runtime's behaviour: the dead stream's handle value comes back
    ASSERT_NE(a.sim->stream_id(t), 1u);
    // This thread's pool cache last saw handle s; a cache keyed by the handle would answer with
    // the dead stream's pool here, and hand out p while the kernel writes it.
    void* q = a.alloc.allocate(bytes, t);
    EXPECT_NE(q, p);
    // The kernel's memory may go to the new stream only once the kernel is done: in expandable
    // mode the pager may move the dead pool's idle pages, after a device synchronization.
    const bool kernel_done = a.sim->event_query(kernel);
    EXPECT_EQ(kernel_done, std::string(GetParam()).empty() ? false : kernel_done);
    if (!kernel_done) {
      EXPECT_NE(a.sim->host_view(q, 512), p_bytes) << "the new stream got the kernel's memory";
    }
    // Another thread on the same handle: the shared pool table is keyed by id too.
    void* r = nullptr;
    std::thread([&] { r = a.alloc.allocate(bytes, t); }).join();
    EXPECT_NE(r, p);
    if (!a.sim->event_query(kernel)) {
      EXPECT_NE(a.sim->host_view(r, 512), p_bytes);
    }
    a.alloc.check_invariants();
    a.alloc.deallocate(q);
    a.alloc.deallocate(r);
    // The dead stream's pool keeps p until a path that synchronizes the device gives it back.
    a.sim->complete_all();
    a.alloc.empty_cache();
    EXPECT_EQ(a.sim->used_bytes(), 0u);
    EXPECT_EQ(a.sim->destroyed_stream_calls(), 0u);
    a.sim->destroy_stream(t);
    a.sim->event_destroy(kernel);
    a.alloc.check_invariants();
  }
}

TEST_P(StreamReuse, TheNewStreamsFreesAreItsOwnAndTheDeadPoolIsNeverNamedAgain) {
  sim_allocator a = make();
  const stream_handle s = a.sim->create_stream();
  const stream_handle other = a.sim->create_stream();
  void* p = a.alloc.allocate(1 * MiB, s);
  void* live = a.alloc.allocate(2 * MiB, s);  // outlives its stream, freed later
  a.alloc.deallocate(p);
  a.sim->destroy_stream(s);
  const stream_handle t = a.sim->create_stream();
  ASSERT_EQ(t, s);
  // A free of the dead stream's block in the order of the new stream with the same handle value:
  // treated as the block's own stream, it goes back to the dead stream's pool, which only a
  // device synchronization reaches (no allocation on any live stream can get it).
  a.alloc.deallocate(live, t);
  EXPECT_EQ(a.sim->calls(sim_call::event_record), 0u);
  void* q = a.alloc.allocate(2 * MiB, t);
  EXPECT_NE(q, live);
  void* u = a.alloc.allocate(2 * MiB, other);
  EXPECT_NE(u, live);
  // The new stream's own blocks are reused on it at once, as for any stream.
  a.alloc.deallocate(q);
  EXPECT_EQ(a.alloc.allocate(2 * MiB, t), q);
  a.alloc.deallocate(q);
  a.alloc.deallocate(u);
  a.alloc.check_invariants();
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  EXPECT_EQ(a.sim->destroyed_stream_calls(), 0u);
}

TEST_P(StreamReuse, ManyGenerationsOfOneHandle) {
  // A program that creates and destroys a stream per step: each generation gets a pool of its
  // own; their cached memory comes back at empty_cache (or garbage collection, or the ladder).
  sim_allocator a = make();
  stream_handle first = nullptr;
  void* previous = nullptr;
  for (int i = 0; i < 20; ++i) {
    const stream_handle s = a.sim->create_stream();
    if (i == 0) first = s;
    ASSERT_EQ(s, first);
    void* p = a.alloc.allocate(64 * KiB, s);
    const event_handle kernel = a.sim->event_create();
    a.sim->event_record(kernel, s);  // never completes before the next generation allocates
    EXPECT_NE(p, previous);
    a.alloc.deallocate(p);
    a.sim->destroy_stream(s);
    a.sim->event_destroy(kernel);
    previous = p;
  }
  a.alloc.check_invariants();
  a.sim->complete_all();
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Modes, StreamReuse, ::testing::Values("", "expandable_segments:True"),
                         [](const auto& param) {
                           return std::string(param.index == 0 ? "Default" : "Expandable");
                         });

TEST(StreamReuseCost, OneIdAndOneCaptureQueryPerAllocationNoneForTheLegacyStreamOrAFree) {
  // The hot path's price for both rules: an allocation on a stream asks the device for the
  // stream's id and capture state (two thread-local lookups in the driver); the legacy default
  // stream can be neither destroyed nor captured and costs nothing; a free finds its pool through
  // its block and asks nothing.
  sim_allocator a;
  void* p = a.alloc.allocate(4 * KiB, stream(0x5000));
  EXPECT_EQ(a.sim->calls(sim_call::stream_id), 1u);
  EXPECT_EQ(a.sim->calls(sim_call::capture_status), 1u);
  a.alloc.deallocate(p);
  a.alloc.deallocate(a.alloc.allocate(4 * KiB, stream(0x5000)));
  EXPECT_EQ(a.sim->calls(sim_call::stream_id), 2u);
  EXPECT_EQ(a.sim->calls(sim_call::capture_status), 2u);
  a.alloc.deallocate(a.alloc.allocate(4 * KiB, nullptr));
  EXPECT_EQ(a.sim->calls(sim_call::stream_id), 2u);
  EXPECT_EQ(a.sim->calls(sim_call::capture_status), 2u);
}

TEST(StreamReuseCost, QueriesPerAllocationByHandleKind) {
  // Issue 21: what an allocation asks the device, by the kind of handle. The legacy stream by
  // either handle (nullptr, cudaStreamLegacy) nothing -- it is never captured nor destroyed;
  // cudaStreamPerThread its capture every time and its id once per thread; a created stream both,
  // every time (its handle may be a destroyed stream's, reused). Before issue 21,
  // cudaStreamLegacy and cudaStreamPerThread cost both queries every time.
  for (const char* conf : {"", "expandable_segments:True"}) {
    SCOPED_TRACE(conf);
    sim_allocator a(parse_config(conf));
    const stream_handle created = a.sim->create_stream();
    using counts = std::pair<std::uint64_t, std::uint64_t>;  // (capture queries, id queries)
    const auto queries_of_pairs = [&](stream_handle s, int n) {
      const counts before{a.sim->calls(sim_call::capture_status),
                          a.sim->calls(sim_call::stream_id)};
      // (Unordered frees: an ordered one may ask too -- a quiet event's proof, the per-thread
      // handle's owner -- and a free is not what this counts.)
      for (int i = 0; i < n; ++i) a.alloc.deallocate(a.alloc.allocate(4 * KiB, s));
      return counts{a.sim->calls(sim_call::capture_status) - before.first,
                    a.sim->calls(sim_call::stream_id) - before.second};
    };
    EXPECT_EQ(queries_of_pairs(nullptr, 10), (counts{0, 0}));
    EXPECT_EQ(queries_of_pairs(legacy_stream(), 10), (counts{0, 0}));
    EXPECT_EQ(queries_of_pairs(per_thread_stream(), 10), (counts{10, 1}));
    EXPECT_EQ(queries_of_pairs(per_thread_stream(), 10), (counts{10, 0}));
    EXPECT_EQ(queries_of_pairs(created, 10), (counts{10, 10}));
    a.alloc.check_invariants();
  }
}

TEST(StreamReuseCost, TheLegacyStreamsTwoHandlesShareOnePool) {
  // nullptr and cudaStreamLegacy name one stream: a block freed on one is the other's cache hit,
  // and a free naming the other handle is a free on the block's own stream (no event).
  sim_allocator a;
  void* p = a.alloc.allocate(4 * KiB, nullptr);
  a.alloc.deallocate(p, legacy_stream());
  EXPECT_EQ(a.sim->calls(sim_call::event_record), 0u);
  EXPECT_EQ(a.alloc.allocate(4 * KiB, legacy_stream()), p);
  a.alloc.deallocate(p, nullptr);
  EXPECT_EQ(a.alloc.allocate(4 * KiB, nullptr), p);
  a.alloc.deallocate(p);
  EXPECT_EQ(a.sim->calls(sim_call::event_record), 0u);
  EXPECT_EQ(a.mallocs(), 1u);
  a.alloc.check_invariants();
}

TEST(StreamReuseCost, AFailingIdQueryChangesNothing) {
  sim_allocator a;
  a.sim->fail_nth(sim_call::stream_id, 1);
  EXPECT_THROW((void)a.alloc.allocate(4 * KiB, stream(0x5000)), cuda_error);
  EXPECT_EQ(a.mallocs(), 0u);
  a.alloc.check_invariants();
  void* p = a.alloc.allocate(4 * KiB, stream(0x5000));
  a.alloc.deallocate(p);
  a.alloc.check_invariants();
}

}  // namespace
}  // namespace cucache::test
