// Snapshots in PyTorch's memory-viewer schema, leak hunting and tags (cucache/observe.hpp), through
// the global API on the simulated device: every key and type of a snapshot and the invariants the
// viewer relies on, exact device traces, exact leak candidates, per-tag bytes across nesting,
// threads and frees outside the tag's scope, and the errors of each call.
#include "cucache/observe.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "api/registry.hpp"
#include "cucache/cucache.h"
#include "cucache/cucache.hpp"
#include "support/sim_registry.hpp"

namespace cucache {

// Exported (the executable is linked with -rdynamic), never inlined and never a tail call: a
// frame of its own that dladdr can name.
[[gnu::noinline]] void* allocate_here_for_the_backtrace(std::size_t n) {
  void* p = cucache::malloc(n);
  asm volatile("" ::: "memory");
  return p;
}

namespace {

using nlohmann::json;
using test::fake_stream;
using test::MiB;

class Observe : public ::testing::Test {
 protected:
  void SetUp() override { restore(); }
  void TearDown() override {
    while (!current_tag().empty()) pop_tag();
    restore();
  }
  static void restore() { test::use_sim_registry(); }
  static void conf(const char* text) { test::use_sim_registry(text); }
  static std::filesystem::path temp_dir() {
    auto d = std::filesystem::temp_directory_path() /
             ("cucache-observe-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    return d;
  }
};

// Every key PyTorch's _snapshot() writes, with its type, and the invariants memory_viz needs.
void check_schema(const json& snap, const device_allocator& a) {
  ASSERT_TRUE(snap.is_object());
  ASSERT_TRUE(snap.contains("segments") && snap["segments"].is_array());
  ASSERT_TRUE(snap.contains("device_traces") && snap["device_traces"].is_array());
  std::size_t reserved = 0, allocated = 0, active = 0, requested = 0;
  for (const json& seg : snap["segments"]) {
    for (const char* key : {"device", "address", "total_size", "allocated_size", "active_size",
                            "requested_size", "stream"}) {
      ASSERT_TRUE(seg.contains(key)) << key;
      ASSERT_TRUE(seg[key].is_number_integer()) << key;
    }
    ASSERT_TRUE(seg["segment_type"] == "small" || seg["segment_type"] == "large");
    ASSERT_TRUE(seg["segment_pool_id"].is_array());
    ASSERT_EQ(seg["segment_pool_id"].size(), 2u);
    ASSERT_TRUE(seg["is_expandable"].is_boolean());
    ASSERT_TRUE(seg["frames"].is_array());
    ASSERT_TRUE(seg["blocks"].is_array());
    ASSERT_FALSE(seg["blocks"].empty());
    std::uint64_t at = seg["address"];
    std::size_t seg_alloc = 0, seg_active = 0, seg_req = 0, tiled = 0;
    for (const json& b : seg["blocks"]) {
      for (const char* key : {"address", "size", "requested_size"}) {
        ASSERT_TRUE(b.contains(key) && b[key].is_number_integer()) << key;
      }
      ASSERT_TRUE(b["frames"].is_array());
      const std::string state = b["state"];
      ASSERT_TRUE(state == "active_allocated" || state == "active_pending_free" ||
                  state == "inactive")
          << state;
      // Blocks tile the segment: each starts where the previous one ends.
      ASSERT_EQ(b["address"].get<std::uint64_t>(), at);
      const std::size_t size = b["size"];
      ASSERT_GT(size, 0u);
      at += size;
      tiled += size;
      const std::size_t req = b["requested_size"];
      if (state == "active_allocated") {
        ASSERT_LE(req, size);
        ASSERT_GT(req, 0u);
        seg_alloc += size;
        seg_req += req;
      } else {
        ASSERT_EQ(req, 0u);
      }
      if (state != "inactive") seg_active += size;
    }
    ASSERT_EQ(tiled, seg["total_size"].get<std::size_t>());
    ASSERT_EQ(seg_alloc, seg["allocated_size"].get<std::size_t>());
    ASSERT_EQ(seg_active, seg["active_size"].get<std::size_t>());
    ASSERT_EQ(seg_req, seg["requested_size"].get<std::size_t>());
    reserved += tiled;
    allocated += seg_alloc;
    active += seg_active;
    requested += seg_req;
  }
  // Sizes sum to the allocator's own totals.
  const device_stats s = a.stats();
  EXPECT_EQ(reserved, static_cast<std::size_t>(s.reserved_bytes[0].current));
  EXPECT_EQ(allocated, static_cast<std::size_t>(s.allocated_bytes[0].current));
  EXPECT_EQ(active, static_cast<std::size_t>(s.active_bytes[0].current));
  EXPECT_EQ(requested, static_cast<std::size_t>(s.requested_bytes[0].current));
  for (const json& trace : snap["device_traces"]) {
    ASSERT_TRUE(trace.is_array());
    for (const json& e : trace) {
      const std::string action = e["action"];
      ASSERT_TRUE(action == "alloc" || action == "free_requested" || action == "free_completed" ||
                  action == "segment_alloc" || action == "segment_free" || action == "oom" ||
                  action == "snapshot")
          << action;
      ASSERT_TRUE(e[action == "oom" ? "device_free" : "addr"].is_number_integer());
      ASSERT_TRUE(e["size"].is_number_integer());
      ASSERT_TRUE(e["stream"].is_number_integer());
      ASSERT_TRUE(e["time_us"].is_number_integer());
      ASSERT_TRUE(e["frames"].is_array());
    }
  }
}

std::vector<std::string> actions(const json& trace) {
  std::vector<std::string> out;
  for (const json& e : trace) out.push_back(e["action"]);
  return out;
}

TEST_F(Observe, SnapshotHasEveryKeyOfPyTorchsSchemaAndItsInvariants) {
  conf("history:1000");
  void* small = cucache::malloc(1000);
  void* big = cucache::malloc(3 * MiB + 5);
  void* other = cucache::malloc(2 * MiB, fake_stream(1));
  void* pending = cucache::malloc(4096);
  void* freed = cucache::malloc(8192);
  cucache::free(freed);
  cucache::record_stream(pending, fake_stream(2));
  cucache::free(pending);  // waits for the event on stream 2: active_pending_free
  const json snap = json::parse(snapshot());
  check_schema(snap, get(0));
  ASSERT_EQ(snap["device_traces"].size(), 1u);
  std::size_t n_alloc = 0, n_pending = 0;
  bool saw_small = false, saw_large = false, saw_stream = false;
  for (const json& seg : snap["segments"]) {
    saw_small |= seg["segment_type"] == "small";
    saw_large |= seg["segment_type"] == "large";
    saw_stream |= seg["stream"].get<std::uintptr_t>() ==
                  reinterpret_cast<std::uintptr_t>(fake_stream(1));
    EXPECT_EQ(seg["device"], 0);
    EXPECT_EQ(seg["is_expandable"], false);
    EXPECT_EQ(seg["segment_pool_id"], json::array({0, 0}));
    for (const json& b : seg["blocks"]) {
      if (b["state"] == "active_allocated") {
        ++n_alloc;
        if (b["address"].get<std::uintptr_t>() == reinterpret_cast<std::uintptr_t>(big)) {
          EXPECT_EQ(b["requested_size"], 3 * MiB + 5);
          EXPECT_EQ(b["size"], 3 * MiB + 512);
        }
      }
      if (b["state"] == "active_pending_free") ++n_pending;
    }
  }
  EXPECT_TRUE(saw_small && saw_large && saw_stream);
  EXPECT_EQ(n_alloc, 3u);
  EXPECT_EQ(n_pending, 1u);
  cucache::free(small);
  cucache::free(big);
  cucache::free(other);
}

TEST_F(Observe, DeviceTraceRecordsSegmentsAllocationsFreesAndSnapshotsInOrder) {
  conf("history:1000");
  void* p = cucache::malloc(1000);
  cucache::free(p);
  static_cast<void>(snapshot());
  cucache::empty_cache();
  const json snap = json::parse(snapshot());
  const json& trace = snap["device_traces"][0];
  EXPECT_EQ(actions(trace), (std::vector<std::string>{"segment_alloc", "alloc", "free_requested",
                                                      "free_completed", "snapshot",
                                                      "segment_free"}));
  EXPECT_EQ(trace[0]["size"], 2 * MiB);
  EXPECT_EQ(trace[1]["addr"].get<std::uintptr_t>(), reinterpret_cast<std::uintptr_t>(p));
  EXPECT_EQ(trace[1]["size"], 1000u);
  EXPECT_EQ(trace[0]["addr"], trace[5]["addr"]);
  EXPECT_TRUE(snap["segments"].empty());
  for (std::size_t i = 1; i < trace.size(); ++i) {
    EXPECT_LE(trace[i - 1]["time_us"].get<std::uint64_t>(), trace[i]["time_us"].get<std::uint64_t>());
  }
}

TEST_F(Observe, DeviceTraceIsARingOfTheLastNEvents) {
  conf("history:4");
  void* keep = cucache::malloc(100);  // segment_alloc, alloc: pushed out below
  for (std::size_t i = 1; i <= 3; ++i) cucache::free(cucache::malloc(i * 1024));
  const json trace = json::parse(snapshot())["device_traces"][0];
  ASSERT_EQ(trace.size(), 4u);
  // The last two pairs' free events and the third's alloc... exactly the last four events.
  EXPECT_EQ(actions(trace), (std::vector<std::string>{"free_completed", "alloc", "free_requested",
                                                      "free_completed"}));
  EXPECT_EQ(trace[1]["size"], 3 * 1024u);
  cucache::free(keep);
}

TEST_F(Observe, WithoutHistoryTheTraceIsEmptyAndOomIsRecordedWithIt) {
  void* p = cucache::malloc(1000);
  json snap = json::parse(snapshot());
  EXPECT_EQ(snap["device_traces"], json::array({json::array()}));
  cucache::free(p);
  conf("history:10,memory_limit:4MiB");
  EXPECT_THROW(static_cast<void>(cucache::malloc(8 * MiB)), out_of_memory);
  snap = json::parse(snapshot());
  const json& trace = snap["device_traces"][0];
  ASSERT_EQ(actions(trace), (std::vector<std::string>{"oom"}));
  EXPECT_EQ(trace[0]["size"], 8 * MiB);
  EXPECT_TRUE(trace[0].contains("device_free"));
  EXPECT_FALSE(trace[0].contains("addr"));
}

TEST_F(Observe, WriteSnapshotReplacesTheFileAndLeavesNothingOnFailure) {
  const auto dir = temp_dir();
  const auto path = dir / "snap.json";
  void* p = cucache::malloc(1000);
  write_snapshot(path);
  std::ifstream in(path);
  const json snap = json::parse(in);
  EXPECT_EQ(snap["segments"].size(), 1u);
  cucache::free(p);
  // A folder that does not exist: the error names the file.
  const auto bad = dir / "missing" / "snap.json";
  try {
    write_snapshot(bad);
    FAIL() << "no error";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(bad.string()), std::string::npos) << e.what();
  }
  // A target that cannot be replaced (a non-empty folder): no temporary file is left beside it.
  std::filesystem::create_directories(dir / "taken" / "x");
  EXPECT_THROW(write_snapshot(dir / "taken"), invalid_argument);
  std::size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    static_cast<void>(e);
    ++files;
  }
  EXPECT_EQ(files, 2u);  // snap.json and taken/
  // The C API: NULL, then the same unwritable path.
  EXPECT_EQ(cucacheSnapshot(nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheSnapshot(bad.c_str()), cudaErrorInvalidValue);
  EXPECT_NE(std::string(cucacheGetLastErrorMessage()).find(bad.string()), std::string::npos);
  EXPECT_EQ(cucacheSnapshot(path.c_str()), cudaSuccess);
  std::filesystem::remove_all(dir);
}

// --- leak hunting ---------------------------------------------------------------------------

TEST_F(Observe, ALoopThatLeaksOneBlockPerStepIsReported) {
  conf("leak_steps:3");
  std::vector<void*> leaked;
  for (std::size_t i = 0; i < 10; ++i) {
    void* temp = cucache::malloc(4 * MiB);
    {
      scoped_tag t("leaky");
      leaked.push_back(cucache::malloc((i + 1) * MiB, fake_stream(3)));
    }
    cucache::free(temp);
    mark_step();
  }
  const std::vector<leak_candidate> c = leak_report();
  // Allocated in steps 0..6: alive for 10..4 markers, more than 3.
  ASSERT_EQ(c.size(), 7u);
  for (std::size_t j = 0; j < c.size(); ++j) {
    const std::size_t i = 6 - j;  // largest first
    EXPECT_EQ(c[j].address, reinterpret_cast<std::uintptr_t>(leaked[i]));
    EXPECT_EQ(c[j].size, (i + 1) * MiB);
    EXPECT_EQ(c[j].step, i);
    EXPECT_EQ(c[j].steps_alive, 10 - i);
    EXPECT_EQ(c[j].stream, fake_stream(3));
    EXPECT_EQ(c[j].tag, "leaky");
    EXPECT_EQ(c[j].device, 0);
    EXPECT_TRUE(c[j].frames.empty());
  }
  // Another window: more than 8 steps leaves steps 0 and 1.
  EXPECT_EQ(leak_report(8).size(), 2u);
  const json j = json::parse(leak_report_json(8));
  EXPECT_EQ(j["step"], 10);
  EXPECT_EQ(j["steps"], 8);
  ASSERT_EQ(j["candidates"].size(), 2u);
  EXPECT_EQ(j["candidates"][0]["size"], 2 * MiB);
  EXPECT_EQ(j["candidates"][0]["steps_alive"], 9);
  EXPECT_EQ(j["candidates"][0]["tag"], "leaky");
  // The C API: the same text.
  const std::size_t n = cucacheLeakReport(8, nullptr, 0);
  ASSERT_GT(n, 0u);
  std::string buf(n + 1, '\0');
  EXPECT_EQ(cucacheLeakReport(8, buf.data(), buf.size()), n);
  EXPECT_EQ(json::parse(buf.c_str()), j);
  for (void* p : leaked) cucache::free(p);
  // Freed: nothing survives, however long the window.
  EXPECT_EQ(cucacheStepMarker(), cudaSuccess);
  EXPECT_TRUE(leak_report(1).empty());
}

TEST_F(Observe, ASteadyLoopIsNotReportedEvenWithLongLivedWeights) {
  conf("leak_steps:2");
  void* weights = cucache::malloc(64 * MiB);
  for (int i = 0; i < 10; ++i) {
    void* a = cucache::malloc(8 * MiB);
    void* b = cucache::malloc(1000);
    cucache::free(b);
    cucache::free(a);
    mark_step();
  }
  // weights survived 10 steps, but the live total did not grow: no leak.
  EXPECT_TRUE(leak_report().empty());
  EXPECT_TRUE(leak_report(1).empty());
  cucache::free(weights);
}

TEST_F(Observe, LeakHuntingErrorsAreClear) {
  // Off: the marker names the key.
  try {
    mark_step();
    FAIL() << "no error";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("leak_steps"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cucacheStepMarker(), cudaErrorInvalidValue);
  EXPECT_NE(std::string(cucacheGetLastErrorMessage()).find("leak_steps"), std::string::npos);
  EXPECT_THROW(static_cast<void>(leak_report(3)), invalid_argument);
  EXPECT_EQ(cucacheLeakReport(3, nullptr, 0), 0u);
  // On, but no step marked: a report has nothing to measure against.
  conf("leak_steps:2");
  try {
    static_cast<void>(leak_report());
    FAIL() << "no error";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("no step was marked"), std::string::npos) << e.what();
  }
  // Fewer markers than the window: nothing can be a candidate yet.
  void* p = cucache::malloc(1000);
  mark_step();
  EXPECT_TRUE(leak_report().empty());
  cucache::free(p);
  // Bad config values name the key.
  conf("leak_steps:0");
  try {
    static_cast<void>(cucache::malloc(1));
    FAIL() << "no error";
  } catch (const environment_error& e) {
    EXPECT_NE(std::string(e.what()).find("leak_steps"), std::string::npos) << e.what();
  }
  conf("history:lots");
  EXPECT_THROW(static_cast<void>(cucache::malloc(1)), environment_error);
}

#if CUCACHE_TEST_HAVE_BACKTRACES

TEST_F(Observe, RecordBacktracesGivesTheAllocationSite) {
  conf("leak_steps:1,record_backtraces:True,history:16");
  void* p = allocate_here_for_the_backtrace(5000);
  mark_step();
  void* q = cucache::malloc(6000);
  mark_step();
  const std::vector<leak_candidate> c = leak_report();
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].size, 5000u);
  ASSERT_FALSE(c[0].frames.empty());
  bool found = false;
  for (const frame& f : c[0].frames) {
    found |= f.name.find("allocate_here_for_the_backtrace") != std::string::npos;
    EXPECT_FALSE(f.filename.empty());
  }
  EXPECT_TRUE(found);
  // The snapshot's block and its trace entry carry the same frames.
  const json snap = json::parse(snapshot());
  bool block_frames = false;
  for (const json& seg : snap["segments"]) {
    for (const json& b : seg["blocks"]) {
      if (b["address"].get<std::uintptr_t>() == reinterpret_cast<std::uintptr_t>(p)) {
        block_frames = !b["frames"].empty() && b["frames"][0].contains("filename") &&
                       b["frames"][0].contains("line") && b["frames"][0].contains("name");
      }
    }
  }
  EXPECT_TRUE(block_frames);
  cucache::free(p);
  cucache::free(q);
}
#else
TEST_F(Observe, RecordBacktracesIsRefusedWithoutLibunwind) {
  conf("record_backtraces:True");
  try {
    static_cast<void>(cucache::malloc(1));
    FAIL() << "no error";
  } catch (const environment_error& e) {
    EXPECT_NE(std::string(e.what()).find("record_backtraces"), std::string::npos) << e.what();
  }
}
#endif

// --- tags -----------------------------------------------------------------------------------

TEST_F(Observe, NestedTagsAttributeToTheInnermostAndKeepPeaks) {
  void* a1 = nullptr;
  void* b1 = nullptr;
  void* a2 = nullptr;
  void* none = cucache::malloc(500);
  {
    scoped_tag a("params");
    EXPECT_EQ(current_tag(), "params");
    a1 = cucache::malloc(1000);
    {
      scoped_tag b("activations");
      EXPECT_EQ(current_tag(), "activations");
      b1 = cucache::malloc(2000);
    }
    EXPECT_EQ(current_tag(), "params");
    a2 = cucache::malloc(3000);
  }
  EXPECT_EQ(current_tag(), "");
  tag_stat p = tag_stats(0, "params");
  EXPECT_EQ(p.current_bytes, 4000u);
  EXPECT_EQ(p.peak_bytes, 4000u);
  EXPECT_EQ(p.allocations, 2u);
  tag_stat act = tag_stats(0, "activations");
  EXPECT_EQ(act.current_bytes, 2000u);
  cucache::free(a2);
  cucache::free(b1);
  p = tag_stats(0, "params");
  EXPECT_EQ(p.current_bytes, 1000u);
  EXPECT_EQ(p.peak_bytes, 4000u);
  EXPECT_EQ(p.total_allocations, 2u);
  act = tag_stats(0, "activations");
  EXPECT_EQ(act.current_bytes, 0u);
  EXPECT_EQ(act.peak_bytes, 2000u);
  const std::vector<tag_stat> all = tag_stats(0);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].tag, "activations");
  EXPECT_EQ(all[1].tag, "params");
  EXPECT_EQ(tag_stats(0, "never").peak_bytes, 0u);
  // The summary and the snapshot show them.
  const std::string summary = memory_summary(0);
  EXPECT_NE(summary.find("Tags (requested bytes)"), std::string::npos) << summary;
  EXPECT_NE(summary.find("params"), std::string::npos);
  const json snap = json::parse(snapshot());
  std::size_t tagged = 0;
  for (const json& seg : snap["segments"]) {
    for (const json& b : seg["blocks"]) {
      if (b.contains("tag")) {
        ++tagged;
        EXPECT_EQ(b["tag"], "params");
        EXPECT_EQ(b["address"].get<std::uintptr_t>(), reinterpret_cast<std::uintptr_t>(a1));
      }
    }
  }
  EXPECT_EQ(tagged, 1u);
  cucache::free(a1);
  cucache::free(none);
  EXPECT_EQ(tag_stats(0, "params").current_bytes, 0u);
}

TEST_F(Observe, TagsAreThreadLocalAndFreesCountForTheAllocationsTag) {
  void* from_thread = nullptr;
  std::thread t([&] {
    scoped_tag tag("kv_cache");
    from_thread = cucache::malloc(7000);
  });
  t.join();
  EXPECT_EQ(current_tag(), "");  // the other thread's tag is not this one's
  void* untagged = cucache::malloc(9000);
  EXPECT_EQ(tag_stats(0, "kv_cache").current_bytes, 7000u);
  {
    // Freed here, under another tag, after the allocating scope ended on another thread.
    scoped_tag other("optimizer");
    cucache::free(from_thread);
  }
  EXPECT_EQ(tag_stats(0, "kv_cache").current_bytes, 0u);
  EXPECT_EQ(tag_stats(0, "kv_cache").peak_bytes, 7000u);
  EXPECT_EQ(tag_stats(0, "optimizer").total_allocations, 0u);
  EXPECT_EQ(tag_stats(0).size(), 1u);
  // Two threads, two tags, at once.
  std::vector<void*> a, b;
  std::thread ta([&] {
    scoped_tag tag("a");
    for (int i = 0; i < 100; ++i) a.push_back(cucache::malloc(1024));
  });
  std::thread tb([&] {
    scoped_tag tag("b");
    for (int i = 0; i < 50; ++i) b.push_back(cucache::malloc(2048));
  });
  ta.join();
  tb.join();
  EXPECT_EQ(tag_stats(0, "a").current_bytes, 100u * 1024);
  EXPECT_EQ(tag_stats(0, "b").current_bytes, 50u * 2048);
  for (void* p : a) cucache::free(p);
  for (void* p : b) cucache::free(p);
  EXPECT_EQ(tag_stats(0, "a").current_bytes, 0u);
  EXPECT_EQ(tag_stats(0, "b").peak_bytes, 50u * 2048);
  cucache::free(untagged);
}

TEST_F(Observe, TagErrorsAndTheCApi) {
  EXPECT_THROW(pop_tag(), invalid_argument);
  EXPECT_THROW(push_tag(""), invalid_argument);
  EXPECT_EQ(cucachePopTag(), cudaErrorInvalidValue);
  EXPECT_NE(std::string(cucacheGetLastErrorMessage()).find("no current tag"), std::string::npos);
  EXPECT_EQ(cucachePushTag(nullptr), cudaErrorInvalidValue);
  ASSERT_EQ(cucachePushTag("c_tag"), cudaSuccess);
  void* p = nullptr;
  ASSERT_EQ(cucacheMalloc(&p, 4000), cudaSuccess);
  ASSERT_EQ(cucachePopTag(), cudaSuccess);
  std::size_t cur = 1, peak = 1;
  ASSERT_EQ(cucacheGetTagStats(0, "c_tag", &cur, &peak), cudaSuccess);
  EXPECT_EQ(cur, 4000u);
  EXPECT_EQ(peak, 4000u);
  ASSERT_EQ(cucacheFree(p), cudaSuccess);
  ASSERT_EQ(cucacheGetTagStats(0, "c_tag", &cur, &peak), cudaSuccess);
  EXPECT_EQ(cur, 0u);
  EXPECT_EQ(peak, 4000u);
  ASSERT_EQ(cucacheGetTagStats(0, "unknown", &cur, &peak), cudaSuccess);
  EXPECT_EQ(cur, 0u);
  EXPECT_EQ(peak, 0u);
  EXPECT_EQ(cucacheGetTagStats(0, "c_tag", nullptr, &peak), cudaErrorInvalidValue);
}

}  // namespace
// Every row of memory_summary has the same width: PyTorch's table, cucache's lines under it (the
// long expandable ones wrapped), and the tags' and sleeping tags' tables after it.
TEST_F(Observe, MemorySummaryRowsAllHaveTheSameWidth) {
  conf("expandable_segments:True");
  ASSERT_EQ(cucacheMakeTagSleepable("train"), cudaSuccess) << cucacheGetLastErrorMessage();
  void* a = nullptr;
  void* b = nullptr;
  {
    scoped_tag t("train");
    a = cucache::malloc(40 * MiB);
  }
  {
    scoped_tag t("a tag whose name is longer than the tag column is wide");
    b = cucache::malloc(1000);
  }
  ASSERT_EQ(cucacheSleep(0, "train", 1), cudaSuccess) << cucacheGetLastErrorMessage();
  const std::string summary = memory_summary(0);
  for (const char* part : {"Expandable:", "Tags (requested bytes)", "Sleeping tags", "Sleeping:"}) {
    EXPECT_NE(summary.find(part), std::string::npos) << part << " missing in\n" << summary;
  }
  std::size_t width = 0;
  std::size_t start = 0;
  int row = 0;
  while (start < summary.size()) {
    std::size_t end = summary.find('\n', start);
    if (end == std::string::npos) end = summary.size();
    const std::size_t w = end - start;
    if (row == 0) width = w;
    EXPECT_EQ(w, width) << "row " << row << " is " << w << " characters, the first " << width
                        << ": '" << summary.substr(start, w) << "'\n" << summary;
    ++row;
    start = end + 1;
  }
  EXPECT_GT(row, 30);
  ASSERT_EQ(cucacheWake(0, "train"), cudaSuccess) << cucacheGetLastErrorMessage();
  cucache::free(a);
  cucache::free(b);
}

}  // namespace cucache
