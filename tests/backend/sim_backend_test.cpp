// sim_backend: the simulated device behaves like the driver where the allocator depends on it --
// capacity, alignment, deterministic addresses, whole-mapping rules, events, failure injection
// and host memory behind device addresses.
#include "cucache/sim_backend.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include <string>
#include <utility>
#include <vector>

#include "cucache/errors.hpp"

namespace cucache {
namespace {

constexpr std::size_t MiB = std::size_t{1} << 20;

TEST(SimBackend, DeterministicAlignedAddressesAndCapacity) {
  sim_options o;
  o.capacity_bytes = 10 * MiB;
  sim_backend s(o);
  void* a = s.segment_malloc(3 * MiB);  // charged as 4 MiB (whole 2 MiB pages)
  void* b = s.segment_malloc(2 * MiB);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a), sim_backend::k_first_address);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(b), sim_backend::k_first_address + 4 * MiB);
  EXPECT_EQ(s.used_bytes(), 6 * MiB);
  EXPECT_EQ(s.segment_malloc(6 * MiB), nullptr);  // only 4 MiB left
  EXPECT_EQ(s.mem_get_info().free_bytes, 4 * MiB);
  s.segment_free(a);
  EXPECT_EQ(s.segment_malloc(4 * MiB), a);  // first fit reuses the lowest range
  EXPECT_THROW(s.segment_free(reinterpret_cast<void*>(0x1234)), cuda_error);
  EXPECT_EQ(s.calls(sim_call::segment_malloc), 4u);
}

TEST(SimBackend, DeviceAddressesShareNoneWithTheHostProcess) {
  // A pinned host buffer and device memory never share an address, as under the real driver
  // (which reserves its ranges in the process): copy_async tells host from device by address. The
  // first TiB of device 0's window -- more than any test uses -- holds none of the process's
  // accessible mappings: heap, pinned buffers, libraries, stack (with the sim's old base of
  // 0x7f0000000000, the stack and the mmap area lay there, and an ASLR draw could put a pinned
  // buffer under a device address). Checked with buffers pinned and device memory taken.
  sim_backend s;
  void* host = s.host_alloc_pinned(64 * MiB);  // malloc's mmap area
  void* dev = s.segment_malloc(64 * MiB);
  ASSERT_NE(host, nullptr);
  ASSERT_NE(dev, nullptr);
  const std::uintptr_t lo = sim_backend::k_first_address;
  const std::uintptr_t hi = lo + (std::uintptr_t{1} << 40);
  std::ifstream maps("/proc/self/maps");
  ASSERT_TRUE(maps.good()) << "cannot read /proc/self/maps";
  std::string line;
  std::size_t mappings = 0;
  while (std::getline(maps, line)) {
    std::istringstream in(line);
    std::uintptr_t start = 0, end = 0;
    char dash = 0;
    std::string perms;
    in >> std::hex >> start >> dash >> end >> perms;
    ASSERT_EQ(dash, '-') << line;
    ++mappings;
    // Reservations without access (a sanitizer's gaps between its shadows) hold nothing.
    if (perms.starts_with("---")) continue;
    EXPECT_TRUE(end <= lo || start >= hi) << "a host mapping in the sim's device window: " << line;
  }
  EXPECT_GT(mappings, 3u);  // the binary, the heap, the stack at least
  const auto h = reinterpret_cast<std::uintptr_t>(host);
  EXPECT_TRUE(h + 64 * MiB <= lo || h >= hi);
  s.host_free_pinned(host);
  s.segment_free(dev);
}

TEST(SimBackend, EachDeviceHandsOutAddressesOfItsOwn) {
  // Real GPUs share one virtual address space, so a pointer names its device: the registry's
  // owner search relies on it. Device d's window starts d * 64 TiB above device 0's.
  sim_options o;
  o.device = 1;
  sim_backend one(o);
  o.device = 63;
  sim_backend last(o);
  sim_backend zero;
  void* z = zero.segment_malloc(2 * MiB);
  void* a = one.segment_malloc(2 * MiB);
  void* v = one.va_reserve(4 * MiB);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(z), sim_backend::k_first_address);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a),
            sim_backend::k_first_address + sim_backend::k_window_bytes);
  EXPECT_GT(reinterpret_cast<std::uintptr_t>(v), reinterpret_cast<std::uintptr_t>(a));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(last.segment_malloc(2 * MiB)),
            sim_backend::k_first_address + 63 * sim_backend::k_window_bytes);
  o.device = 64;
  EXPECT_THROW(sim_backend{o}, invalid_argument);
  o.device = -1;
  EXPECT_THROW(sim_backend{o}, invalid_argument);
}

TEST(SimBackend, VirtualMemoryRules) {
  sim_backend s;
  EXPECT_EQ(s.vm_granularity(), 2 * MiB);
  void* va = s.va_reserve(8 * MiB);
  auto h = s.phys_create(4 * MiB);
  ASSERT_TRUE(h.has_value());
  EXPECT_THROW((void)s.phys_create(3 * MiB), cuda_error);  // not a multiple of the granularity
  s.map(va, 4 * MiB, *h);
  EXPECT_THROW(s.map(static_cast<char*>(va) + 2 * MiB, 4 * MiB, *h), cuda_error);  // overlap
  EXPECT_THROW(s.set_access(va, 6 * MiB), cuda_error);  // not fully mapped
  s.set_access(va, 4 * MiB);
  EXPECT_THROW(s.unmap(va, 2 * MiB), cuda_error);    // must unmap whole mappings
  EXPECT_THROW(s.phys_release(*h), cuda_error);      // still mapped
  EXPECT_THROW(s.va_free(va, 8 * MiB), cuda_error);  // still has mappings
  s.unmap(va, 4 * MiB);
  s.phys_release(*h);
  s.va_free(va, 8 * MiB);
  EXPECT_EQ(s.live_handles() + s.live_mappings() + s.live_reservations(), 0u);
  EXPECT_EQ(s.used_bytes(), 0u);
}

// cuMemSetAccess takes a fully mapped range of whole mappings, several adjacent ones included;
// cuMemUnmap exactly one mapping. A refused call changes nothing.
TEST(SimBackend, SetAccessSpansWholeAdjacentMappingsOnly) {
  sim_backend s;
  auto* va = static_cast<char*>(s.va_reserve(16 * MiB));
  const auto a = s.phys_create(2 * MiB);
  const auto b = s.phys_create(4 * MiB);
  const auto c = s.phys_create(2 * MiB);
  ASSERT_TRUE(a && b && c);
  s.map(va, 2 * MiB, *a);
  s.map(va + 2 * MiB, 4 * MiB, *b);
  s.map(va + 8 * MiB, 2 * MiB, *c);  // a hole at [6, 8) MiB
  EXPECT_EQ(s.inaccessible_mappings(), 3u);
  EXPECT_FALSE(s.accessible(va, 2 * MiB));
  EXPECT_THROW(s.set_access(va, 4 * MiB), cuda_error);            // ends inside b
  EXPECT_THROW(s.set_access(va + 2 * MiB, 2 * MiB), cuda_error);  // inside b
  EXPECT_THROW(s.set_access(va + 4 * MiB, 2 * MiB), cuda_error);  // begins inside b
  EXPECT_THROW(s.set_access(va, 10 * MiB), cuda_error);           // the hole
  EXPECT_THROW(s.set_access(va + 6 * MiB, 4 * MiB), cuda_error);  // begins in the hole
  EXPECT_THROW(s.set_access(va, 0), cuda_error);
  EXPECT_EQ(s.inaccessible_mappings(), 3u);  // nothing changed
  s.set_access(va, 6 * MiB);                 // a and b at once
  EXPECT_EQ(s.inaccessible_mappings(), 1u);
  EXPECT_TRUE(s.accessible(va, 6 * MiB));
  EXPECT_TRUE(s.accessible(va + 3 * MiB, 1 * MiB));
  EXPECT_FALSE(s.accessible(va, 10 * MiB));
  s.set_access(va, 6 * MiB);  // again: allowed
  s.set_access(va + 8 * MiB, 2 * MiB);
  EXPECT_EQ(s.inaccessible_mappings(), 0u);
  EXPECT_THROW(s.unmap(va, 6 * MiB), cuda_error);  // two mappings: one call each
  s.unmap(va, 2 * MiB);
  s.unmap(va + 2 * MiB, 4 * MiB);
  s.unmap(va + 8 * MiB, 2 * MiB);
  s.map(va, 2 * MiB, *a);  // a mapping starts without access again
  EXPECT_EQ(s.inaccessible_mappings(), 1u);
  s.unmap(va, 2 * MiB);
  for (const auto h : {*a, *b, *c}) s.phys_release(h);
  s.va_free(va, 16 * MiB);
}

TEST(SimBackend, EventsCompleteWhenTheTestSaysSo) {
  sim_backend s;
  event_handle e = s.event_create();
  auto* s1 = reinterpret_cast<stream_handle>(1);
  auto* s2 = reinterpret_cast<stream_handle>(2);
  s.event_record(e, s1);
  EXPECT_FALSE(s.event_query(e));
  s.complete_stream(s2);
  EXPECT_FALSE(s.event_query(e));
  s.complete_stream(s1);
  EXPECT_TRUE(s.event_query(e));
  s.event_record(e, s2);
  EXPECT_EQ(s.pending_events(), 1u);
  s.event_synchronize(e);
  EXPECT_TRUE(s.event_query(e));
  s.event_destroy(e);
  EXPECT_THROW((void)s.event_query(e), cuda_error);
}

TEST(SimBackend, SegmentFreeSynchronizesTheDeviceVisitingOnlyThePendingEvents) {
  // Like cudaFree, segment_free completes every event recorded before it (not a captured one).
  // Issue 30 item 9: it did so by visiting every event that exists, so freeing n segments with n
  // events alive cost n * n (an empty_cache over 20,000 stalled pools took 174 s). Its work must
  // be proportional to the events it completes.
  sim_backend s;
  const stream_handle st = s.create_stream();
  constexpr int k_n = 2'000;
  std::vector<event_handle> events;
  std::vector<void*> segments;
  for (int i = 0; i < k_n; ++i) {
    events.push_back(s.event_create());
    s.event_record(events.back(), st);
    segments.push_back(s.segment_malloc(2 * MiB));
    ASSERT_NE(segments.back(), nullptr);
  }
  const stream_handle cap = s.create_stream();
  const event_handle captured = s.event_create();
  (void)s.begin_capture(cap);
  s.event_record(captured, cap);
  (void)s.end_capture(cap);
  EXPECT_EQ(s.pending_events(), static_cast<std::size_t>(k_n) + 1);
  const std::uint64_t before = s.event_visits();
  s.segment_free(segments[0]);
  EXPECT_EQ(s.pending_events(), 1u) << "only the captured record stays incomplete";
  for (int i = 0; i < k_n; i += 97) EXPECT_TRUE(s.event_query(events[static_cast<std::size_t>(i)]));
  // Events recorded after a free wait for the next one; the rest of the frees complete nothing.
  s.event_record(events[0], st);
  s.event_record(events[1], st);
  EXPECT_FALSE(s.event_query(events[0]));
  for (int i = 1; i < k_n; ++i) s.segment_free(segments[static_cast<std::size_t>(i)]);
  EXPECT_TRUE(s.event_query(events[0]));
  EXPECT_TRUE(s.event_query(events[1]));
  EXPECT_EQ(s.pending_events(), 1u);
  EXPECT_EQ(s.live_segments(), 0u);
  EXPECT_LE(s.event_visits() - before, static_cast<std::uint64_t>(k_n) + 2)
      << "segment_free visited every event, not only the pending ones";
  // complete_all and device_synchronize visit nothing when nothing is pending.
  const std::uint64_t idle = s.event_visits();
  s.complete_all();
  s.device_synchronize();
  EXPECT_EQ(s.event_visits(), idle);
  // None of them completes the captured record (it is a node of the graph).
  EXPECT_EQ(s.pending_events(), 1u);
  for (event_handle e : events) s.event_destroy(e);
  s.event_destroy(captured);
  EXPECT_EQ(s.pending_events(), 0u);
}

TEST(SimBackend, DestroyedStreamsAreRejectedAsTheDriverDoes) {
  sim_backend s;
  const stream_handle a = s.create_stream();
  const stream_handle b = s.create_stream();
  EXPECT_NE(a, nullptr);
  EXPECT_NE(a, b);
  event_handle e = s.event_create();
  s.event_record(e, a);
  s.stream_synchronize(a);
  EXPECT_TRUE(s.event_query(e));
  s.event_record(e, a);  // work recorded before the destroy still completes
  s.destroy_stream(a);
  EXPECT_TRUE(s.stream_destroyed(a));
  EXPECT_FALSE(s.stream_destroyed(b));
  EXPECT_FALSE(s.event_query(e));
  const auto expect_400 = [](auto&& call) {
    try {
      call();
      ADD_FAILURE() << "no error on a destroyed stream";
    } catch (const cuda_error& err) {
      EXPECT_EQ(err.code(), k_sim_invalid_resource_handle);
      const std::string what = err.what();
      EXPECT_TRUE(what.find("destroyed") != std::string::npos ||
                  what.find("not created") != std::string::npos)
          << what;
    }
  };
  expect_400([&] { s.stream_synchronize(a); });
  expect_400([&] { s.event_record(e, a); });
  expect_400([&] { s.destroy_stream(a); });                                   // twice
  expect_400([&] { s.destroy_stream(reinterpret_cast<stream_handle>(1)); });  // never created
  EXPECT_EQ(s.destroyed_stream_calls(), 2u);  // stream_synchronize, event_record
  s.device_synchronize();                     // names no stream: completes the dead stream's work
  EXPECT_TRUE(s.event_query(e));
  // Handles the sim never created -- the default stream, tests' fake values -- are alive.
  for (stream_handle fake :
       {static_cast<stream_handle>(nullptr), reinterpret_cast<stream_handle>(1),
        reinterpret_cast<stream_handle>(0x5000)}) {
    s.event_record(e, fake);
    s.stream_synchronize(fake);
  }
  // As the runtime does, the next stream gets the destroyed handle value back -- with a new id --
  // and is alive; the dead stream's id stays dead.
  const std::uint64_t dead_id = 1;  // a's
  const stream_handle c = s.create_stream();
  EXPECT_EQ(c, a);
  EXPECT_FALSE(s.stream_destroyed(c));
  EXPECT_EQ(s.stream_id(c), 3u);  // a was 1, b 2
  EXPECT_NE(s.stream_id(c), dead_id);
  EXPECT_NO_THROW(s.stream_synchronize(c));
  s.event_destroy(e);
}

TEST(SimBackend, FailureInjection) {
  sim_backend s;
  s.fail_nth(sim_call::segment_malloc, 2);
  void* a = s.segment_malloc(2 * MiB);
  EXPECT_NE(a, nullptr);
  EXPECT_EQ(s.segment_malloc(2 * MiB), nullptr);  // the second call fails (out of memory)
  EXPECT_NE(s.segment_malloc(2 * MiB), nullptr);
  s.fail_always(sim_call::event_create);
  EXPECT_THROW((void)s.event_create(), cuda_error);
  EXPECT_THROW((void)s.event_create(), cuda_error);
  s.fail_always(sim_call::event_create, false);
  EXPECT_NO_THROW((void)s.event_create());
  s.fail_nth(sim_call::phys_create, 1);
  EXPECT_FALSE(s.phys_create(2 * MiB).has_value());
}

TEST(SimBackend, HostMemoryFollowsMappings) {
  sim_options o;
  o.host_memory = true;
  sim_backend s(o);
  void* seg = s.segment_malloc(2 * MiB);
  std::byte* h = s.host_view(seg, 2 * MiB);
  ASSERT_NE(h, nullptr);
  h[100] = std::byte{7};
  EXPECT_EQ(s.host_view(static_cast<char*>(seg) + 100, 1)[0], std::byte{7});
  // A physical page moved to another address keeps its contents.
  void* va = s.va_reserve(8 * MiB);
  auto ph = s.phys_create(2 * MiB);
  s.map(va, 2 * MiB, *ph);
  s.host_view(va, 2 * MiB)[5] = std::byte{9};
  s.unmap(va, 2 * MiB);
  EXPECT_EQ(s.host_view(va, 1), nullptr);
  s.map(static_cast<char*>(va) + 4 * MiB, 2 * MiB, *ph);
  EXPECT_EQ(s.host_view(static_cast<char*>(va) + 4 * MiB, 6)[5], std::byte{9});
}

// --- stream ids and graph capture ------------------------------------------------------------

int code_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const cuda_error& e) {
    return e.code();
  }
  return 0;
}

TEST(SimStreams, IdsAreNeverReusedThoughHandlesAre) {
  sim_backend s;
  const stream_handle a = s.create_stream();
  EXPECT_EQ(s.stream_id(a), 1u);
  s.destroy_stream(a);
  EXPECT_EQ(code_of([&] { (void)s.stream_id(a); }), k_sim_invalid_resource_handle);
  const stream_handle b = s.create_stream();
  EXPECT_EQ(b, a);
  EXPECT_EQ(s.stream_id(b), 2u);
  EXPECT_EQ(s.stream_id(nullptr), k_sim_legacy_stream_id);
  EXPECT_EQ(s.stream_id(reinterpret_cast<stream_handle>(0x5000)),
            (std::uint64_t{1} << 62) | 0x5000);
  // Work of the dead stream and of the new one are told apart.
  const event_handle old_work = s.event_create();
  const event_handle new_work = s.event_create();
  s.destroy_stream(b);
  const stream_handle c = s.create_stream();  // id 3, handle a again
  s.event_record(new_work, c);
  s.complete_stream(c);
  EXPECT_TRUE(s.event_query(new_work));
  s.event_destroy(old_work);
  s.event_destroy(new_work);
  sim_options o;
  o.reuse_stream_handles = false;
  sim_backend t(o);
  const stream_handle x = t.create_stream();
  t.destroy_stream(x);
  EXPECT_NE(t.create_stream(), x);
}

TEST(SimStreams, IdentifyAsksTheIdOnlyOutsideACapture) {
  // identify is what every allocation asks: the capture first, the id only when there is none --
  // asking the id of a capturing stream would invalidate its capture. The sim's override and the
  // interface's default (what hand-written wrappers inherit) must agree.
  sim_backend s;
  const stream_handle a = s.create_stream();
  const auto check_outside = [&](const stream_identity& who) {
    EXPECT_EQ(who.capture.state, capture_state::none);
    EXPECT_EQ(who.id, s.stream_id(a));
  };
  check_outside(s.identify(a));
  check_outside(s.device_backend::identify(a));
  const auto fake = reinterpret_cast<stream_handle>(0x5000);
  EXPECT_EQ(s.identify(fake).id, s.stream_id(fake));
  EXPECT_EQ(s.identify(fake).capture.state, capture_state::none);

  const std::uint64_t capture = s.begin_capture(a);
  for (bool base : {false, true}) {
    SCOPED_TRACE(base ? "device_backend::identify" : "sim_backend::identify");
    const std::uint64_t ids = s.calls(sim_call::stream_id);
    const stream_identity who = base ? s.device_backend::identify(a) : s.identify(a);
    EXPECT_EQ(who.capture.state, capture_state::active);
    EXPECT_EQ(who.capture.id, capture);
    EXPECT_EQ(who.id, 0u);
    EXPECT_EQ(s.calls(sim_call::stream_id), ids);  // not asked
  }
  EXPECT_EQ(s.capture_violations(), 0u);
  EXPECT_EQ(s.end_capture(a), capture);  // not invalidated

  // A destroyed stream's handle, reused: a new id.
  const std::uint64_t old_id = s.identify(a).id;
  s.destroy_stream(a);
  const stream_handle b = s.create_stream();
  ASSERT_EQ(b, a);
  EXPECT_NE(s.identify(b).id, old_id);
  EXPECT_EQ(s.identify(b).id, s.stream_id(b));
}

TEST(SimStreams, IdentifyAsksNothingOfTheLegacyStreamAndOnlyTheCaptureOfThePerThreadOne) {
  // cuda_backend's rule, which the sim models call for call: the legacy stream (nullptr,
  // cudaStreamLegacy) is never captured nor destroyed, so identify asks nothing; the per-thread
  // stream's id is kept per thread, its capture asked every time; any other stream costs both.
  sim_backend s;
  const auto queries = [&] {
    return std::pair{s.calls(sim_call::capture_status), s.calls(sim_call::stream_id)};
  };
  const auto asked = [&](stream_handle h, int n) {
    const auto before = queries();
    stream_identity who{};
    for (int i = 0; i < n; ++i) who = s.identify(h);
    const auto after = queries();
    EXPECT_EQ(who.capture.state, capture_state::none);
    EXPECT_EQ(who.id, s.stream_id(h));
    return std::pair{after.first - before.first, after.second - before.second};
  };
  using counts = std::pair<std::uint64_t, std::uint64_t>;  // (capture queries, id queries)
  EXPECT_EQ(asked(nullptr, 100), (counts{0, 0}));
  EXPECT_EQ(asked(legacy_stream(), 100), (counts{0, 0}));
  EXPECT_EQ(s.identify(legacy_stream()).id, k_sim_legacy_stream_id);
  EXPECT_EQ(s.stream_id(legacy_stream()), s.stream_id(nullptr));  // one stream, two handles
  EXPECT_EQ(asked(per_thread_stream(), 1), (counts{1, 1}));       // the id once per thread
  EXPECT_EQ(asked(per_thread_stream(), 100), (counts{100, 0}));
  std::thread([&] {  // another thread asks the id once too
    EXPECT_EQ(asked(per_thread_stream(), 100), (counts{100, 1}));
  })
      .join();
  const stream_handle a = s.create_stream();
  EXPECT_EQ(asked(a, 100), (counts{100, 100}));
  const auto fake = reinterpret_cast<stream_handle>(0x5000);
  EXPECT_EQ(asked(fake, 100), (counts{100, 100}));

  // The per-thread stream's capture is still seen, and its id is not asked while it captures.
  const std::uint64_t capture = s.begin_capture(per_thread_stream());
  const auto before = queries();
  const stream_identity who = s.identify(per_thread_stream());
  EXPECT_EQ(who.capture.state, capture_state::active);
  EXPECT_EQ(who.capture.id, capture);
  EXPECT_EQ(queries().second, before.second);
  EXPECT_EQ(s.end_capture(per_thread_stream()), capture);
  EXPECT_EQ(s.capture_violations(), 0u);
}

TEST(SimStreams, TheLegacyStreamCannotBeCapturedByEitherHandle) {
  // "Capture may not be initiated if stream is cudaStreamLegacy" (CUDA Runtime API reference,
  // cudaStreamBeginCapture): nullptr and cudaStreamLegacy name that stream.
  sim_backend s;
  for (const stream_handle legacy : {stream_handle{nullptr}, legacy_stream()}) {
    EXPECT_EQ(code_of([&] { (void)s.begin_capture(legacy); }), 1);  // cudaErrorInvalidValue
    EXPECT_EQ(code_of([&] { (void)s.begin_capture(legacy, capture_mode::relaxed); }), 1);
    EXPECT_EQ(s.capture_status(legacy).state, capture_state::none);
  }
  EXPECT_EQ(s.active_captures(), 0u);
}

TEST(SimCapture, GlobalModeRefusesUnsafeCallsFromEveryThreadAndInvalidates) {
  sim_backend s;
  const stream_handle cap = s.create_stream();
  const std::uint64_t id = s.begin_capture(cap);
  EXPECT_EQ(id, 1u);
  EXPECT_EQ(s.capture_status(cap).state, capture_state::active);
  EXPECT_EQ(s.capture_status(cap).id, id);
  EXPECT_EQ(s.capture_status(nullptr).state, capture_state::none);
  int other_thread = 0;
  std::thread([&] { other_thread = code_of([&] { (void)s.segment_malloc(2 * MiB); }); }).join();
  EXPECT_EQ(other_thread, k_sim_capture_unsupported);
  EXPECT_EQ(s.capture_status(cap).state, capture_state::invalidated);
  EXPECT_EQ(s.capture_violations(), 1u);
  EXPECT_EQ(code_of([&] { (void)s.end_capture(cap); }), k_sim_capture_invalidated);
  EXPECT_EQ(s.capture_status(cap).state, capture_state::none);
  EXPECT_NE(s.segment_malloc(2 * MiB), nullptr);  // no capture: legal again
}

TEST(SimCapture, RelaxedModePermitsUnsafeCallsButNotConflictingOnes) {
  sim_backend s;
  const stream_handle cap = s.create_stream();
  const stream_handle other = s.create_stream();
  const event_handle outside = s.event_create();
  s.event_record(outside, other);
  const event_handle inside = s.event_create();
  (void)s.begin_capture(cap);
  s.event_record(inside, cap);  // legal: a node of the graph
  EXPECT_EQ(s.exchange_capture_mode(capture_mode::relaxed), capture_mode::global);
  void* p = s.segment_malloc(2 * MiB);
  EXPECT_NE(p, nullptr);
  EXPECT_FALSE(s.event_query(outside));
  EXPECT_NO_THROW(s.stream_synchronize(other));
  EXPECT_EQ(s.capture_violations(), 0u);
  // Conflicting in every mode: querying a captured event, synchronizing the capturing stream or
  // the device, cudaFree.
  EXPECT_EQ(code_of([&] { (void)s.event_query(inside); }), k_sim_capture_unsupported);
  EXPECT_EQ(code_of([&] { s.segment_free(p); }), k_sim_capture_unsupported);
  EXPECT_EQ(code_of([&] { s.device_synchronize(); }), k_sim_capture_unsupported);
  EXPECT_EQ(code_of([&] { s.stream_synchronize(cap); }), k_sim_capture_unsupported);
  EXPECT_EQ(s.capture_violations(), 4u);
  EXPECT_EQ(s.exchange_capture_mode(capture_mode::global), capture_mode::relaxed);
  EXPECT_EQ(code_of([&] { (void)s.end_capture(cap); }), k_sim_capture_invalidated);
  s.segment_free(p);
  // The captured record never completes: it is in the graph, not on the stream.
  s.complete_all();
  EXPECT_EQ(code_of([&] { (void)s.event_query(inside); }), k_sim_capture_unsupported);
  s.event_record(inside, other);  // recorded again outside a capture: an ordinary event
  s.complete_all();
  EXPECT_TRUE(s.event_query(inside));
  s.event_destroy(inside);
  s.event_destroy(outside);
}

TEST(SimCapture, ThreadLocalAndRelaxedCapturesBindOnlyTheirOwnThread) {
  sim_backend s;
  const stream_handle cap = s.create_stream();
  const std::uint64_t id = s.begin_capture(cap, capture_mode::thread_local_mode);
  void* elsewhere = nullptr;
  std::thread([&] { elsewhere = s.segment_malloc(2 * MiB); }).join();  // not bound
  EXPECT_NE(elsewhere, nullptr);
  EXPECT_EQ(s.capture_violations(), 0u);
  // A capture that is not relaxed ends on the thread that began it.
  int code = 0;
  std::thread([&] { code = code_of([&] { (void)s.end_capture(cap); }); }).join();
  EXPECT_EQ(code, k_sim_capture_wrong_thread);
  EXPECT_EQ(s.active_captures(), 1u);
  EXPECT_EQ(s.end_capture(cap), id);
  // A relaxed capture forbids nothing, and ends on any thread.
  const stream_handle relaxed = s.create_stream();
  const std::uint64_t rid = s.begin_capture(relaxed, capture_mode::relaxed);
  EXPECT_NE(s.segment_malloc(2 * MiB), nullptr);
  std::uint64_t ended = 0;
  std::thread([&] { ended = s.end_capture(relaxed); }).join();
  EXPECT_EQ(ended, rid);
  EXPECT_EQ(s.capture_violations(), 0u);
  EXPECT_EQ(code_of([&] { (void)s.begin_capture(nullptr); }), 1);
  (void)s.begin_capture(cap);
  EXPECT_EQ(code_of([&] { s.destroy_stream(cap); }), k_sim_capture_unsupported);
  EXPECT_EQ(code_of([&] { (void)s.begin_capture(cap); }), k_sim_capture_unsupported);
  (void)s.end_capture(cap);
}

}  // namespace
}  // namespace cucache
