// The captures-announced mode (issue 34; docs/design.md, "Announced captures") on the simulated
// device, which counts every stream query and enforces the driver's capture rules (the id of a
// capturing stream is refused, and the refusal invalidates the capture). Exact counts of capture
// queries per cache-hit pair in each mode, the announced capture served from its private pool,
// the failure rule for a capture nobody announced, and bad announcements refused.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

class AnnouncedCapture : public ::testing::TestWithParam<const char*> {
 protected:
  static sim_allocator make() { return sim_allocator(parse_config(GetParam())); }
};

struct queries {
  std::uint64_t capture = 0;
  std::uint64_t id = 0;
};

queries count(const sim_allocator& a) {
  return {a.sim->calls(sim_call::capture_status), a.sim->calls(sim_call::stream_id)};
}

// N cache-hit pairs on a created stream.
queries pairs(sim_allocator& a, stream_handle s, int n) {
  const queries before = count(a);
  for (int i = 0; i < n; ++i) a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));
  const queries after = count(a);
  return {after.capture - before.capture, after.id - before.id};
}

constexpr int k_pairs = 1000;

TEST_P(AnnouncedCapture, ModeOffAsksTheCaptureStatusOfEveryAllocation) {
  sim_allocator a = make();
  const stream_handle s = a.sim->create_stream();
  a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));  // warm: the pool and its block exist
  EXPECT_FALSE(a.alloc.captures_announced());
  const queries q = pairs(a, s, k_pairs);
  EXPECT_EQ(q.capture, static_cast<std::uint64_t>(k_pairs));
  EXPECT_EQ(q.id, static_cast<std::uint64_t>(k_pairs));
}

TEST_P(AnnouncedCapture, ModeOnAsksNoCaptureStatusWhileNothingIsAnnounced) {
  sim_allocator a = make();
  a.alloc.set_captures_announced(true);
  EXPECT_TRUE(a.alloc.captures_announced());
  const stream_handle s = a.sim->create_stream();
  a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));
  const queries q = pairs(a, s, k_pairs);
  EXPECT_EQ(q.capture, 0u);
  EXPECT_EQ(q.id, static_cast<std::uint64_t>(k_pairs));  // the id stays: dead-stream safety
  // Off again: the query is back.
  a.alloc.set_captures_announced(false);
  EXPECT_EQ(pairs(a, s, k_pairs).capture, static_cast<std::uint64_t>(k_pairs));
  EXPECT_EQ(a.sim->capture_violations(), 0u);
  a.alloc.check_invariants();
}

TEST_P(AnnouncedCapture, PerThreadStreamKeepsItsCaptureQuery) {
  // Its id is kept per thread, so no query would notice a capture nobody announced on it.
  sim_allocator a = make();
  a.alloc.set_captures_announced(true);
  const stream_handle s = per_thread_stream();
  a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));
  const queries q = pairs(a, s, k_pairs);
  EXPECT_EQ(q.capture, static_cast<std::uint64_t>(k_pairs));
  EXPECT_EQ(q.id, 0u);
}

TEST_P(AnnouncedCapture, AnAnnouncedCaptureIsQueriedAndServedFromItsPrivatePool) {
  sim_allocator a = make();
  a.alloc.set_captures_announced(true);
  const stream_handle s = a.sim->create_stream();
  void* cached = a.alloc.allocate(1 * MiB, s);
  a.alloc.deallocate(cached);

  a.alloc.announce_capture_begin();
  EXPECT_EQ(a.alloc.announced_captures(), 1u);
  const std::uint64_t id = a.sim->begin_capture(s);
  const queries before = count(a);
  void* g = a.alloc.allocate(1 * MiB, s);
  EXPECT_EQ(count(a).capture, before.capture + 1);
  EXPECT_EQ(count(a).id, before.id);  // never the id of a capturing stream
  EXPECT_NE(g, cached);
  EXPECT_EQ(a.alloc.graph_pool_state(graph_pool_id::of_capture(id)).allocated_bytes, 1 * MiB);
  a.alloc.deallocate(g);
  a.sim->end_capture(s);
  a.alloc.announce_capture_end();
  EXPECT_EQ(a.alloc.announced_captures(), 0u);

  // The capture cucache saw keeps the query on until an allocation on s sees it ended.
  const queries after_capture = pairs(a, s, 1);
  EXPECT_EQ(after_capture.capture, 1u);
  EXPECT_EQ(pairs(a, s, k_pairs).capture, 0u);
  a.alloc.release_graph_pool(graph_pool_id::of_capture(id));
  EXPECT_EQ(a.sim->capture_violations(), 0u);
  a.alloc.check_invariants();
  expect_no_leak(a);
}

TEST_P(AnnouncedCapture, ARouteTurnsTheQueryBackOn) {
  // PyTorch announces its captures by routes (beginAllocateToPool before the capture begins,
  // endAllocateToPool after it ended): while one is active every allocation asks.
  sim_allocator a = make();
  a.alloc.set_captures_announced(true);
  const stream_handle s = a.sim->create_stream();
  a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));
  const graph_pool_id pool{7, 1};
  a.alloc.begin_allocate_to_pool(pool, [](stream_handle) { return false; });
  EXPECT_EQ(pairs(a, s, k_pairs).capture, static_cast<std::uint64_t>(k_pairs));
  a.alloc.end_allocate_to_pool(pool);
  EXPECT_EQ(pairs(a, s, k_pairs).capture, 0u);
  a.alloc.release_graph_pool(pool);
}

TEST_P(AnnouncedCapture, ACaptureNobodyAnnouncedFailsLoudlyAndTakesNothing) {
  // The failure rule: the stream's id is refused (the sim, as the driver, then invalidates the
  // capture); cucache names the capture, allocates nothing, and the capture cannot end well.
  sim_allocator a = make();
  a.alloc.set_captures_announced(true);
  const stream_handle s = a.sim->create_stream();
  void* cached = a.alloc.allocate(1 * MiB, s);
  a.alloc.deallocate(cached);
  const std::int64_t allocated = a.allocated();
  const std::uint64_t id = a.sim->begin_capture(s);
  int code = 0;
  std::string what;
  try {
    (void)a.alloc.allocate(1 * MiB, s);
  } catch (const cuda_error& e) {
    code = e.code();
    what = e.what();
  }
  EXPECT_EQ(code, 901);
  EXPECT_NE(what.find("not announced"), std::string::npos) << what;
  EXPECT_NE(what.find("capture " + std::to_string(id)), std::string::npos) << what;
  EXPECT_EQ(a.alloc.unannounced_captures(), 1u);
  EXPECT_EQ(a.allocated(), allocated);  // nothing handed out
  EXPECT_FALSE(a.alloc.graph_pool_state(graph_pool_id::of_capture(id)).exists);
  EXPECT_THROW(a.sim->end_capture(s), cuda_error);  // invalidated: its graph never runs
  a.alloc.check_invariants();
  // The stream works again once the capture is over, with its cached block.
  void* again = a.alloc.allocate(1 * MiB, s);
  EXPECT_EQ(again, cached);
  a.alloc.deallocate(again);
  expect_no_leak(a);
}

TEST_P(AnnouncedCapture, AnEndWithoutABeginIsRefusedAndChangesNothing) {
  sim_allocator a = make();
  a.alloc.set_captures_announced(true);
  EXPECT_THROW(a.alloc.announce_capture_end(), invalid_argument);
  EXPECT_EQ(a.alloc.announced_captures(), 0u);
  a.alloc.announce_capture_begin();
  a.alloc.announce_capture_begin();
  a.alloc.announce_capture_end();
  EXPECT_EQ(a.alloc.announced_captures(), 1u);
  a.alloc.announce_capture_end();
  EXPECT_THROW(a.alloc.announce_capture_end(), invalid_argument);
  EXPECT_EQ(a.alloc.announced_captures(), 0u);
  const stream_handle s = a.sim->create_stream();
  a.alloc.deallocate(a.alloc.allocate(64 * KiB, s));
  EXPECT_EQ(pairs(a, s, 10).capture, 0u);
}

INSTANTIATE_TEST_SUITE_P(Modes, AnnouncedCapture,
                         ::testing::Values("", "expandable_segments:True"),
                         [](const auto& p) {
                           return std::string(p.param).empty() ? "Default" : "Expandable";
                         });

}  // namespace
}  // namespace cucache::test
