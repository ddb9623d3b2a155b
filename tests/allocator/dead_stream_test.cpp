// Streams that die: a program may destroy a stream long before cucache next touches the pool it
// allocated on -- at empty_cache, in the out-of-memory ladder, at process exit. The simulated
// device rejects every operation on a destroyed stream as the driver does (400), so any path that
// synchronizes or records on a pool's stream after its owner destroyed it fails here.
#include <gtest/gtest.h>

#include <string>

#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

class DeadStream : public ::testing::TestWithParam<const char*> {
 protected:
  [[nodiscard]] static config cfg(const std::string& extra = "") {
    std::string text = GetParam();
    if (!extra.empty()) text += (text.empty() ? "" : ",") + extra;
    return parse_config(text);
  }
};

TEST_P(DeadStream, EmptyCacheAfterTheStreamIsDestroyed) {
  for (std::size_t bytes : {4 * KiB, 8 * MiB, 64 * MiB}) {
    SCOPED_TRACE(bytes);
    sim_allocator a(cfg());
    const stream_handle s = a.sim->create_stream();
    void* p = a.alloc.allocate(bytes, s);
    a.alloc.deallocate(p);
    a.sim->destroy_stream(s);
    EXPECT_NO_THROW(a.alloc.empty_cache());
    EXPECT_EQ(a.sim->destroyed_stream_calls(), 0u);
    EXPECT_EQ(a.reserved(), 0);
    EXPECT_EQ(a.sim->used_bytes(), 0u);
    a.alloc.check_invariants();
  }
}

TEST_P(DeadStream, AllocFreeLoopThenDestroyThenEmptyCache) {
  sim_allocator a(cfg());
  const stream_handle s = a.sim->create_stream();
  for (int i = 0; i < 50; ++i) {
    void* p = a.alloc.allocate((std::size_t{1} + static_cast<std::size_t>(i % 7)) * 3 * MiB, s);
    void* q = a.alloc.allocate(KiB * static_cast<std::size_t>(1 + i), s);
    a.alloc.deallocate(p);
    a.alloc.deallocate(q);
  }
  a.sim->destroy_stream(s);
  EXPECT_NO_THROW(a.alloc.empty_cache());
  EXPECT_EQ(a.sim->destroyed_stream_calls(), 0u);
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  a.alloc.check_invariants();
}

TEST_P(DeadStream, RecordStreamOnAStreamDestroyedAfterTheFree) {
  sim_allocator a(cfg());
  const stream_handle owner = a.sim->create_stream();
  const stream_handle user = a.sim->create_stream();
  void* p = a.alloc.allocate(8 * MiB, owner);
  a.alloc.record_stream(p, user);
  a.alloc.deallocate(p);  // records an event on `user`, alive now
  EXPECT_EQ(a.stats().events_pending, 1u);
  a.sim->destroy_stream(user);
  a.sim->destroy_stream(owner);
  EXPECT_NO_THROW(a.alloc.empty_cache());
  EXPECT_EQ(a.sim->destroyed_stream_calls(), 0u);
  EXPECT_EQ(a.stats().events_pending, 0u);
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  a.alloc.check_invariants();
}

TEST_P(DeadStream, RecordStreamOnAStreamDestroyedBeforeTheFree) {
  // The caller broke the record_stream contract (the stream must outlive the free): the event
  // cannot be recorded, and the fallback waits device-wide instead of naming the dead stream
  // again. Only the capture query before the record, and the record itself, reach the dead
  // stream.
  sim_allocator a(cfg());
  const stream_handle owner = a.sim->create_stream();
  const stream_handle user = a.sim->create_stream();
  void* p = a.alloc.allocate(8 * MiB, owner);
  a.alloc.record_stream(p, user);
  a.sim->destroy_stream(user);
  const auto syncs = a.sim->calls(sim_call::device_synchronize);
  EXPECT_NO_THROW(a.alloc.deallocate(p));
  EXPECT_EQ(a.sim->destroyed_stream_calls(), 2u);  // capture_status, event_record
  EXPECT_EQ(a.sim->calls(sim_call::device_synchronize), syncs + 1);
  EXPECT_EQ(a.stats().events_pending, 0u);
  EXPECT_EQ(a.stats().active_bytes[0].current, 0);
  a.alloc.check_invariants();
  void* q = a.alloc.allocate(8 * MiB, owner);
  EXPECT_EQ(q, p);  // reusable at once: the device drained
  a.alloc.deallocate(q);
  a.sim->destroy_stream(owner);
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  a.alloc.check_invariants();
}

TEST_P(DeadStream, OutOfMemoryLadderUnderALimitSkipsNoPoolAndTouchesNoDeadStream) {
  // 24 MiB limit: the dead stream's idle 16 MiB must be taken back (the ladder, or the limit's
  // release of idle memory) for another stream's 16 MiB to fit.
  sim_allocator a(cfg("memory_limit:24MiB"));
  const stream_handle dead = a.sim->create_stream();
  const stream_handle live = a.sim->create_stream();
  void* p = a.alloc.allocate(16 * MiB, dead);
  a.alloc.deallocate(p);
  a.sim->destroy_stream(dead);
  void* q = nullptr;
  EXPECT_NO_THROW(q = a.alloc.allocate(16 * MiB, live));
  EXPECT_NE(q, nullptr);
  EXPECT_EQ(a.sim->destroyed_stream_calls(), 0u);
  a.alloc.check_invariants();
  expect_no_leak(a);
  EXPECT_LE(a.reserved(), static_cast<std::int64_t>(24 * MiB));
  a.alloc.deallocate(q);
  EXPECT_NO_THROW(a.alloc.empty_cache());
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  a.alloc.check_invariants();
}

TEST_P(DeadStream, OutOfMemoryLadderOnTheDeviceTouchesNoDeadStream) {
  sim_options o;
  o.capacity_bytes = 24 * MiB;
  sim_allocator a(cfg(), o);
  const stream_handle dead = a.sim->create_stream();
  const stream_handle live = a.sim->create_stream();
  void* p = a.alloc.allocate(8 * MiB, dead);
  a.alloc.deallocate(p);
  a.sim->destroy_stream(dead);
  void* q = nullptr;
  EXPECT_NO_THROW(q = a.alloc.allocate(20 * MiB, live));
  EXPECT_NE(q, nullptr);
  EXPECT_EQ(a.sim->destroyed_stream_calls(), 0u);
  a.alloc.check_invariants();
  expect_no_leak(a);
  a.alloc.deallocate(q);
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Modes, DeadStream, ::testing::Values("", "expandable_segments:True"),
                         [](const auto& param) {
                           return std::string(param.index == 0 ? "Default" : "Expandable");
                         });

TEST(DeadStreamExpandable, IdlePagesAreUnmappedAfterADeviceWideSynchronization) {
  // The rule (docs/design.md): pages of a freed block are unmapped only after a device-wide
  // synchronization, which names no stream; the pool's own stream is never synchronized.
  sim_allocator a(parse_config("expandable_segments:True"));
  const stream_handle s = a.sim->create_stream();
  void* p = a.alloc.allocate(8 * MiB, s);
  a.alloc.deallocate(p);
  const auto syncs = a.sim->calls(sim_call::device_synchronize);
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->calls(sim_call::device_synchronize), syncs + 1);
  EXPECT_EQ(a.sim->calls(sim_call::stream_synchronize), 0u);
  a.alloc.check_invariants();
}

TEST(DeadStreamExpandable, AFailedDeviceSynchronizationUnmapsNothing) {
  sim_allocator a(parse_config("expandable_segments:True"));
  void* p = a.alloc.allocate(8 * MiB, stream(1));
  a.alloc.deallocate(p);
  const auto before = a.stats();
  a.sim->fail_nth(sim_call::device_synchronize, 1);
  EXPECT_THROW(a.alloc.empty_cache(), cuda_error);
  EXPECT_EQ(a.stats().vm_unmap_count, before.vm_unmap_count);
  EXPECT_EQ(a.stats().mapped_bytes, before.mapped_bytes);
  a.alloc.check_invariants();
  expect_no_leak(a);
  a.alloc.empty_cache();
  EXPECT_EQ(a.sim->used_bytes(), 0u);
}

}  // namespace
}  // namespace cucache::test
