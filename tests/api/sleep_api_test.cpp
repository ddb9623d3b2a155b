// Sleep and wake through the C API (cucacheMakeTagSleepable, cucacheSleep, cucacheWake,
// cucacheGetSleepingBytes) on the simulated device: tags choose the placement, addresses stay,
// reserved bytes fall and come back, statistics, memory_summary and the snapshot show sleeping
// bytes, and every misuse returns its documented error with a message naming the problem and
// nothing changed. Contents are checked at the allocator level (tests/allocator/sleep_test.cpp).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "api/registry.hpp"
#include "cucache/cucache.h"
#include "cucache/cucache.hpp"
#include "cucache/observe.hpp"
#include "cucache/sim_backend.hpp"
#include "support/sim_registry.hpp"

namespace {

using cucache::test::MiB;

std::string fmt_ptr(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

class SleepApi : public ::testing::Test {
 protected:
  void SetUp() override { restore("expandable_segments:True"); }
  void TearDown() override {
    while (cucachePopTag() == cudaSuccess) {
    }
    ::unsetenv("CUCACHE_SIM_HOST_MEMORY");
    restore("");
  }
  static void restore(const char* conf) { cucache::test::use_sim_registry(conf); }
  static cucacheStats stats() {
    cucacheStats s{};
    EXPECT_EQ(cucacheGetStats(0, &s), cudaSuccess) << cucacheGetLastErrorMessage();
    return s;
  }
  static std::string message() { return cucacheGetLastErrorMessage(); }
  static void* alloc_under(const char* tag, std::size_t bytes) {
    EXPECT_EQ(cucachePushTag(tag), cudaSuccess);
    void* p = nullptr;
    EXPECT_EQ(cucacheMalloc(&p, bytes), cudaSuccess) << message();
    EXPECT_EQ(cucachePopTag(), cudaSuccess);
    return p;
  }
};

TEST_F(SleepApi, SleepAndWakeATagThroughTheCApi) {
  ASSERT_EQ(cucacheMakeTagSleepable("train"), cudaSuccess) << message();
  void* untagged = nullptr;
  ASSERT_EQ(cucacheMalloc(&untagged, 3 * MiB), cudaSuccess);
  void* w = alloc_under("train", 40 * MiB);
  void* small = alloc_under("train", 4096);
  const cucacheStats before = stats();
  EXPECT_EQ(before.reservedBytes, 4 * MiB + 40 * MiB + 2 * MiB);

  ASSERT_EQ(cucacheSleep(0, "train", 1), cudaSuccess) << message();
  cucacheStats s = stats();
  EXPECT_EQ(s.reservedBytes, 4 * MiB);  // the untagged block's pages
  EXPECT_EQ(s.sleepingBytes, 42 * MiB);
  EXPECT_EQ(s.sleepingHostBytes, 40 * MiB + 4096);
  std::size_t dev = 0, host = 0;
  ASSERT_EQ(cucacheGetSleepingBytes(0, "train", &dev, &host), cudaSuccess);
  EXPECT_EQ(dev, 42 * MiB);
  EXPECT_EQ(host, 40 * MiB + 4096);
  const std::string summary = cucache::memory_summary(0);
  EXPECT_NE(summary.find("Sleeping tags"), std::string::npos) << summary;
  EXPECT_NE(summary.find("Sleeping: 42.00 MiB released"), std::string::npos) << summary;
  const std::string snap = cucache::snapshot();
  EXPECT_NE(snap.find("\"asleep\":true"), std::string::npos);
  EXPECT_NE(snap.find("\"sleep_tag\":\"train\""), std::string::npos);

  ASSERT_EQ(cucacheWake(0, "train"), cudaSuccess) << message();
  s = stats();
  EXPECT_EQ(s.reservedBytes, before.reservedBytes);
  EXPECT_EQ(s.sleepingBytes, 0u);
  EXPECT_EQ(s.sleepingHostBytes, 0u);
  ASSERT_EQ(cucacheGetSleepingBytes(0, "train", &dev, &host), cudaSuccess);
  EXPECT_EQ(dev, 0u);
  // Same pointers, freed as usual.
  EXPECT_EQ(cucacheFree(w), cudaSuccess) << message();
  EXPECT_EQ(cucacheFree(small), cudaSuccess) << message();
  EXPECT_EQ(cucacheFree(untagged), cudaSuccess);
  cucache::get(0).check_invariants();
}

TEST_F(SleepApi, SeveralTagsSleepAndWakeInOneCall) {
  ASSERT_EQ(cucacheMakeTagSleepable("weights"), cudaSuccess) << message();
  ASSERT_EQ(cucacheMakeTagSleepable("kv_cache"), cudaSuccess) << message();
  ASSERT_EQ(cucacheMakeTagSleepable("plain_sleepable"), cudaSuccess) << message();
  void* w = alloc_under("weights", 40 * MiB);
  void* kv = alloc_under("kv_cache", 20 * MiB);
  void* untagged = nullptr;
  ASSERT_EQ(cucacheMalloc(&untagged, 3 * MiB), cudaSuccess);
  const cucacheStats before = stats();
  const char* const tags[] = {"weights", "kv_cache"};
  const int keep[] = {1, 0};
  // Refusals, each with nothing changed for either tag.
  const char* const twice[] = {"weights", "weights"};
  EXPECT_EQ(cucacheSleepTags(0, twice, keep, 2), cudaErrorInvalidValue);
  EXPECT_NE(message().find("tag 'weights' on device 0 is named twice"), std::string::npos)
      << message();
  const char* const unknown[] = {"weights", "no_such_tag"};
  EXPECT_EQ(cucacheSleepTags(0, unknown, keep, 2), cudaErrorInvalidValue);
  EXPECT_NE(message().find("unknown tag 'no_such_tag'"), std::string::npos) << message();
  const char* const with_null[] = {"weights", nullptr};
  EXPECT_EQ(cucacheSleepTags(0, with_null, keep, 2), cudaErrorInvalidValue);
  EXPECT_NE(message().find("tags[1] is NULL"), std::string::npos) << message();
  EXPECT_EQ(cucacheSleepTags(0, nullptr, keep, 2), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheSleepTags(0, tags, nullptr, 2), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheSleepTags(0, tags, keep, 0), cudaErrorInvalidValue);
  EXPECT_TRUE(cucache::sleeping(0).empty());
  EXPECT_EQ(stats().reservedBytes, before.reservedBytes);

  ASSERT_EQ(cucacheSleepTags(0, tags, keep, 2), cudaSuccess) << message();
  cucacheStats s = stats();
  EXPECT_EQ(s.reservedBytes, 4 * MiB);  // the untagged block's pages
  EXPECT_EQ(s.sleepingBytes, 60 * MiB);
  EXPECT_EQ(s.sleepingHostBytes, 40 * MiB);  // weights kept, kv_cache dropped
  // Wake: a tag not asleep refuses the whole call.
  const char* const not_asleep[] = {"weights", "plain_sleepable"};
  EXPECT_EQ(cucacheWakeTags(0, not_asleep, 2), cudaErrorInvalidValue);
  EXPECT_NE(message().find("tag 'plain_sleepable' on device 0 is not asleep"), std::string::npos)
      << message();
  EXPECT_EQ(stats().sleepingBytes, 60 * MiB);
  ASSERT_EQ(cucacheWakeTags(0, tags, 2), cudaSuccess) << message();
  s = stats();
  EXPECT_EQ(s.reservedBytes, before.reservedBytes);
  EXPECT_EQ(s.sleepingBytes, 0u);
  EXPECT_EQ(cucacheFree(w), cudaSuccess) << message();
  EXPECT_EQ(cucacheFree(kv), cudaSuccess) << message();
  EXPECT_EQ(cucacheFree(untagged), cudaSuccess);
  cucache::get(0).check_invariants();
}

TEST_F(SleepApi, EveryMisuseIsItsErrorWithNothingChanged) {
  EXPECT_EQ(cucacheSleep(0, nullptr, 1), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheSleep(0, "nobody", 1), cudaErrorInvalidValue);
  EXPECT_NE(message().find("unknown tag 'nobody'"), std::string::npos) << message();
  EXPECT_EQ(cucacheWake(0, "nobody"), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheMakeTagSleepable(""), cudaErrorInvalidValue);

  // A tag that is not sleepable.
  void* plain = alloc_under("plain", MiB);
  EXPECT_EQ(cucacheSleep(0, "plain", 1), cudaErrorInvalidValue);
  EXPECT_NE(message().find("tag 'plain' is not sleepable"), std::string::npos) << message();

  // Blocks allocated under a tag before it was made sleepable share pages: refused.
  void* early = alloc_under("late", MiB);
  ASSERT_EQ(cucacheMakeTagSleepable("late"), cudaSuccess);
  EXPECT_EQ(cucacheSleep(0, "late", 1), cudaErrorInvalidValue);
  EXPECT_NE(message().find("allocated before make_sleepable"), std::string::npos) << message();
  EXPECT_EQ(cucacheFree(early), cudaSuccess);
  EXPECT_EQ(cucacheSleep(0, "late", 1), cudaSuccess) << message();  // nothing live: fine
  EXPECT_EQ(cucacheWake(0, "late"), cudaSuccess) << message();

  ASSERT_EQ(cucacheMakeTagSleepable("infer"), cudaSuccess);
  void* kv = alloc_under("infer", 8 * MiB);
  EXPECT_EQ(cucacheWake(0, "infer"), cudaErrorInvalidValue);
  EXPECT_NE(message().find("is not asleep"), std::string::npos) << message();
  ASSERT_EQ(cucacheSleep(0, "infer", 0), cudaSuccess) << message();
  const cucacheStats asleep = stats();
  EXPECT_EQ(cucacheSleep(0, "infer", 1), cudaErrorInvalidValue);
  EXPECT_NE(message().find("asleep already"), std::string::npos) << message();
  EXPECT_EQ(cucacheFree(kv), cudaErrorInvalidValue);
  EXPECT_NE(message().find("tag 'infer', which is asleep"), std::string::npos) << message();
  ASSERT_EQ(cucachePushTag("infer"), cudaSuccess);
  void* p = nullptr;
  EXPECT_EQ(cucacheMalloc(&p, MiB), cudaErrorInvalidValue);
  EXPECT_NE(message().find("tag 'infer' is asleep"), std::string::npos) << message();
  // A nested tag that is not sleepable places normally; popping back to "infer" refuses again.
  ASSERT_EQ(cucachePushTag("plain"), cudaSuccess);
  EXPECT_EQ(cucacheMalloc(&p, MiB), cudaSuccess) << message();
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
  ASSERT_EQ(cucachePopTag(), cudaSuccess);
  EXPECT_EQ(cucacheMalloc(&p, MiB), cudaErrorInvalidValue);
  ASSERT_EQ(cucachePopTag(), cudaSuccess);
  const cucacheStats after = stats();
  EXPECT_EQ(after.allocatedBytes, asleep.allocatedBytes);
  EXPECT_EQ(after.sleepingBytes, asleep.sleepingBytes);
  cucache::get(0).check_invariants();
  ASSERT_EQ(cucacheWake(0, "infer"), cudaSuccess) << message();
  EXPECT_EQ(cucacheWake(0, "infer"), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheFree(kv), cudaSuccess);
  EXPECT_EQ(cucacheFree(plain), cudaSuccess);
}

TEST_F(SleepApi, WakeWithoutRoomSaysHowMuchIsMissing) {
  restore("expandable_segments:True,memory_limit:64MiB");
  ASSERT_EQ(cucacheMakeTagSleepable("gen"), cudaSuccess);
  void* kv = alloc_under("gen", 30 * MiB);
  ASSERT_EQ(cucacheSleep(0, "gen", 1), cudaSuccess) << message();
  void* other = nullptr;
  ASSERT_EQ(cucacheMalloc(&other, 50 * MiB), cudaSuccess) << message();
  EXPECT_EQ(cucacheWake(0, "gen"), cudaErrorMemoryAllocation);
  EXPECT_NE(message().find("needs 30.00 MiB"), std::string::npos) << message();
  EXPECT_NE(message().find("16.00 MiB missing"), std::string::npos) << message();
  std::size_t dev = 0, host = 0;
  ASSERT_EQ(cucacheGetSleepingBytes(0, "gen", &dev, &host), cudaSuccess);
  EXPECT_EQ(dev, 30 * MiB);
  ASSERT_EQ(cucacheFree(other), cudaSuccess);
  ASSERT_EQ(cucacheWake(0, "gen"), cudaSuccess) << message();
  EXPECT_EQ(cucacheFree(kv), cudaSuccess);
}

// cucacheSleepPrepare pins the next kept sleep's buffer ahead (issue 33): the size it reports is
// what the first kept sleep then uses, and every misuse is its error with nothing pinned.
TEST_F(SleepApi, PrepareThroughTheCApiPinsWhatTheFirstKeptSleepUses) {
  ASSERT_EQ(cucacheMakeTagSleepable("train"), cudaSuccess) << message();
  void* w = alloc_under("train", 40 * MiB);
  void* small = alloc_under("train", 4096);
  EXPECT_EQ(cucache::sleep_buffer_bytes(0, "train"), 0u);
  std::size_t pinned = 0;
  ASSERT_EQ(cucacheSleepPrepare(0, "train", 0, &pinned), cudaSuccess) << message();
  EXPECT_EQ(pinned, 40 * MiB + 4096);
  EXPECT_EQ(cucache::sleep_buffer_bytes(0, "train"), 40 * MiB + 4096);
  ASSERT_EQ(cucacheSleepPrepare(0, "train", 64 * MiB, nullptr), cudaSuccess) << message();
  EXPECT_EQ(cucache::sleep_buffer_bytes(0, "train"), 64 * MiB);
  EXPECT_EQ(cucache::prepare_sleep(0, "train"), 64 * MiB);  // large enough: nothing new

  ASSERT_EQ(cucacheSleep(0, "train", 1), cudaSuccess) << message();
  EXPECT_EQ(stats().sleepingHostBytes, 40 * MiB + 4096);
  EXPECT_EQ(cucacheSleepPrepare(0, "train", 0, &pinned), cudaErrorInvalidValue);
  EXPECT_NE(message().find("cucacheSleepPrepare: cucache: prepare_sleep: tag 'train' on device 0 "
                           "is asleep"),
            std::string::npos)
      << message();
  ASSERT_EQ(cucacheWake(0, "train"), cudaSuccess) << message();
  EXPECT_EQ(cucache::sleep_buffer_bytes(0, "train"), 64 * MiB);
  // A sleep without contents frees it.
  ASSERT_EQ(cucacheSleep(0, "train", 0), cudaSuccess) << message();
  EXPECT_EQ(cucache::sleep_buffer_bytes(0, "train"), 0u);
  ASSERT_EQ(cucacheWake(0, "train"), cudaSuccess) << message();

  EXPECT_EQ(cucacheSleepPrepare(0, nullptr, 0, &pinned), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheSleepPrepare(0, "nobody", 0, &pinned), cudaErrorInvalidValue);
  EXPECT_NE(message().find("prepare_sleep: unknown tag 'nobody'"), std::string::npos) << message();
  ASSERT_EQ(cucachePushTag("plain"), cudaSuccess);
  ASSERT_EQ(cucachePopTag(), cudaSuccess);
  EXPECT_EQ(cucacheSleepPrepare(0, "plain", 0, &pinned), cudaErrorInvalidValue);
  EXPECT_NE(message().find("tag 'plain' is not sleepable"), std::string::npos) << message();
  EXPECT_EQ(cucache::sleep_buffer_bytes(0, "train"), 0u);
  EXPECT_EQ(cucacheFree(w), cudaSuccess) << message();
  EXPECT_EQ(cucacheFree(small), cudaSuccess) << message();
  cucache::get(0).check_invariants();
}

TEST_F(SleepApi, DefaultModeIsRefused) {
  restore("");
  ASSERT_EQ(cucacheMakeTagSleepable("train"), cudaSuccess);
  void* p = alloc_under("train", MiB);
  EXPECT_EQ(cucacheSleep(0, "train", 1), cudaErrorNotSupported);
  EXPECT_NE(message().find("needs expandable segments"), std::string::npos) << message();
  EXPECT_EQ(cucacheSleepPrepare(0, "train", 0, nullptr), cudaErrorNotSupported);
  EXPECT_NE(message().find("needs expandable segments"), std::string::npos) << message();
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
}

// --- issue 30 ----------------------------------------------------------------------------------

TEST_F(SleepApi, SleepIsNotRefusedWhileAnotherThreadAllocatesAndFreesUnderTheTag) {
  // The check that every live block of the tag lies in its pages compares the tag's bytes with
  // the bytes of its pools: another thread allocating or freeing under the tag meanwhile must not
  // make it refuse (it did, blaming blocks "allocated before make_sleepable").
  ASSERT_EQ(cucacheMakeTagSleepable("race"), cudaSuccess) << message();
  std::atomic<bool> stop{false};
  std::thread worker([&] {
    ASSERT_EQ(cucachePushTag("race"), cudaSuccess);
    std::vector<void*> live;
    while (!stop.load()) {
      void* p = nullptr;
      if (cucacheMalloc(&p, (live.size() + 1) * 4096) == cudaSuccess) live.push_back(p);
      // Refused while the tag sleeps: kept, freed later.
      if (live.size() > 3 && cucacheFree(live.front()) == cudaSuccess) live.erase(live.begin());
    }
    ASSERT_EQ(cucachePopTag(), cudaSuccess);
    for (void* p : live) EXPECT_EQ(cucacheFree(p), cudaSuccess) << cucacheGetLastErrorMessage();
  });
  int refused = 0;
  std::string why;
  for (int i = 0; i < 3000; ++i) {
    if (cucacheSleep(0, "race", i % 2) != cudaSuccess) {
      ++refused;
      why = message();
      continue;
    }
    ASSERT_EQ(cucacheWake(0, "race"), cudaSuccess) << message();
  }
  stop.store(true);
  worker.join();
  EXPECT_EQ(refused, 0) << "e.g. " << why;
  cucache::get(0).check_invariants();
}

TEST_F(SleepApi, ATagWithAnExportedBlockRefusesToSleepNamingTheBlock) {
  // Sleep would release the physical memory the importers map: after wake the exporter and the
  // importers would see different bytes. Refused, nothing changed, until the block is freed.
  ::setenv("CUCACHE_SIM_HOST_MEMORY", "1", 1);
  restore("expandable_segments:True,ipc_handles:True");
  ASSERT_EQ(cucacheMakeTagSleepable("shared"), cudaSuccess);
  void* b = alloc_under("shared", 4 * MiB);
  void* quiet = alloc_under("shared", 2 * MiB);
  cucacheIpcHandle h{};
  ASSERT_EQ(cucacheIpcGetHandle(&h, b), cudaSuccess) << message();
  void* q = nullptr;
  ASSERT_EQ(cucacheIpcOpenHandle(&q, &h), cudaSuccess) << message();
  EXPECT_EQ(cucacheIpcReleaseFds(&h), cudaSuccess);
  const cucacheStats before = stats();
  EXPECT_EQ(cucacheSleep(0, "shared", 1), cudaErrorInvalidValue);
  const std::string m = message();
  EXPECT_NE(m.find("exported"), std::string::npos) << m;
  EXPECT_NE(m.find(fmt_ptr(b)), std::string::npos) << m;
  EXPECT_NE(m.find("tag 'shared'"), std::string::npos) << m;
  EXPECT_NE(m.find("nothing changed"), std::string::npos) << m;
  EXPECT_TRUE(cucache::sleeping(0).empty());
  EXPECT_EQ(stats().reservedBytes, before.reservedBytes);
  // Still one memory: what the exporter writes, the importer reads.
  auto& sim = dynamic_cast<cucache::sim_backend&>(cucache::get(0).backend());
  std::memset(sim.host_view(b, 16), 0x11, 16);
  EXPECT_EQ(sim.host_view(q, 16)[7], std::byte{0x11});
  // Freed (its importer closed it first), the block no longer holds the tag awake; a block
  // carved again at its address is not exported.
  ASSERT_EQ(cucacheIpcCloseHandle(q), cudaSuccess) << message();
  ASSERT_EQ(cucacheFree(b), cudaSuccess) << message();
  void* again = alloc_under("shared", 4 * MiB);
  EXPECT_EQ(again, b);
  ASSERT_EQ(cucacheSleep(0, "shared", 1), cudaSuccess) << message();
  ASSERT_EQ(cucacheWake(0, "shared"), cudaSuccess) << message();
  EXPECT_EQ(cucacheFree(again), cudaSuccess);
  EXPECT_EQ(cucacheFree(quiet), cudaSuccess);
  cucache::get(0).check_invariants();
}

TEST_F(SleepApi, AGraphCapturedUnderASleepableTagSleepsWithItsTag) {
  // As a serving engine captures its CUDA graphs (PyTorch routes the capture to a pool of its
  // own): under the tag, the graph's memory counts as the tag's and sleeps with it. Before, the
  // tag's bytes counted the graph's and sleep refused ("inside a CUDA graph capture").
  ASSERT_EQ(cucacheMakeTagSleepable("cuda_graph"), cudaSuccess) << message();
  auto& dev = cucache::get(0);
  auto& sim = dynamic_cast<cucache::sim_backend&>(dev.backend());
  const cucache::stream_handle s = sim.create_stream();
  const cucache::graph_pool_id pool{9, 0};
  void* weights = alloc_under("cuda_graph", 5 * MiB);
  ASSERT_EQ(cucachePushTag("cuda_graph"), cudaSuccess);
  dev.begin_allocate_to_pool(pool, [s](cucache::stream_handle t) { return t == s; });
  const std::uint64_t id = sim.begin_capture(s);
  void* out = nullptr;
  ASSERT_EQ(cucacheMallocAsync(&out, 30 * MiB, static_cast<cudaStream_t>(s)), cudaSuccess)
      << message();
  EXPECT_EQ(sim.end_capture(s), id);
  dev.end_allocate_to_pool(pool);
  ASSERT_EQ(cucachePopTag(), cudaSuccess);
  const cucacheStats before = stats();
  EXPECT_EQ(before.reservedBytes, 6 * MiB + 30 * MiB);

  ASSERT_EQ(cucacheSleep(0, "cuda_graph", 0), cudaSuccess) << message();
  std::size_t bytes = 0, host = 0;
  ASSERT_EQ(cucacheGetSleepingBytes(0, "cuda_graph", &bytes, &host), cudaSuccess);
  EXPECT_EQ(bytes, 30 * MiB + 6 * MiB);  // the graph pool's segment and the tag's 3 pages
  EXPECT_EQ(host, 0u);
  EXPECT_EQ(stats().reservedBytes, 0u);
  EXPECT_EQ(sim.used_bytes(), 0u);
  dev.check_invariants();
  // Freeing the graph's output while asleep: refused, nothing changed.
  EXPECT_EQ(cucacheFree(out), cudaErrorInvalidValue);
  EXPECT_NE(message().find("asleep"), std::string::npos) << message();
  ASSERT_EQ(cucacheWake(0, "cuda_graph"), cudaSuccess) << message();
  EXPECT_EQ(stats().reservedBytes, before.reservedBytes);
  EXPECT_TRUE(sim.accessible(out, 30 * MiB));
  dev.check_invariants();
  EXPECT_EQ(cucacheFree(out), cudaSuccess) << message();
  EXPECT_EQ(cucacheFree(weights), cudaSuccess) << message();
  dev.release_graph_pool(pool);
  dev.empty_cache();
  EXPECT_EQ(stats().reservedBytes, 0u);
  dev.check_invariants();
}

TEST_F(SleepApi, SmallMisusesNameTheirProblem) {
  restore("expandable_segments:True,ipc_handles:True");
  ASSERT_EQ(cucacheMakeTagSleepable("nap"), cudaSuccess);
  void* p = alloc_under("nap", 2 * MiB);
  ASSERT_EQ(cucacheSleep(0, "nap", 1), cudaSuccess) << message();
  // An IPC handle of a sleeping block: the block is live, its tag asleep.
  cucacheIpcHandle h{};
  EXPECT_EQ(cucacheIpcGetHandle(&h, p), cudaErrorInvalidValue);
  EXPECT_NE(message().find("tag 'nap', which is asleep"), std::string::npos) << message();
  EXPECT_EQ(message().find("already freed"), std::string::npos) << message();
  // record_stream on a sleeping block is refused like a free.
  EXPECT_EQ(cucacheRecordStream(p, reinterpret_cast<cudaStream_t>(0x5150)), cudaErrorInvalidValue);
  EXPECT_NE(message().find("tag 'nap', which is asleep"), std::string::npos) << message();
  // A device that does not exist.
  std::size_t dev = 1, host = 1;
  EXPECT_EQ(cucacheGetSleepingBytes(7, "nap", &dev, &host), cudaErrorInvalidDevice);
  EXPECT_NE(message().find("device"), std::string::npos) << message();
  EXPECT_EQ(cucacheGetSleepingBytes(-1, "nap", &dev, &host), cudaErrorInvalidDevice);
  ASSERT_EQ(cucacheGetSleepingBytes(0, "nap", &dev, &host), cudaSuccess) << message();
  EXPECT_EQ(dev, 2 * MiB);
  ASSERT_EQ(cucacheWake(0, "nap"), cudaSuccess) << message();
  EXPECT_EQ(cucacheRecordStream(p, reinterpret_cast<cudaStream_t>(0x5150)), cudaSuccess)
      << message();
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
  // An empty tag: make_sleepable's own error, not push_tag's.
  EXPECT_EQ(cucacheMakeTagSleepable(""), cudaErrorInvalidValue);
  EXPECT_NE(message().find("make_sleepable"), std::string::npos) << message();
  EXPECT_EQ(message().find("push_tag"), std::string::npos) << message();
}

}  // namespace
