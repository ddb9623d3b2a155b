// Tests of the trace recorder: exact row format, thread ids, flushing, errors, a round trip through
// the reader, and concurrent recording from many threads.
#include <unistd.h>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "cucache/errors.hpp"
#include "cucache/trace.hpp"

namespace cucache {
namespace {

using act = trace_event::action;

std::filesystem::path temp_path(const std::string& stem) {
  return std::filesystem::temp_directory_path() /
         (stem + "." + std::to_string(::getpid()) + ".csv");
}

struct file_remover {
  std::filesystem::path path;
  ~file_remover() { std::filesystem::remove(path); }
};

std::vector<std::string> read_lines(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

void* fake(std::uintptr_t address) {
  return reinterpret_cast<void*>(address);
}

TEST(TraceRecorder, WritesRowsInRmmFormat) {
  const file_remover file{temp_path("cucache_rec_format")};
  void* const ptr = fake(0x7f77cfe00000);
  void* const stream = fake(0x5603a1b0);
  {
    trace_recorder rec(file.path);
    EXPECT_EQ(rec.path(), file.path);
    rec.record_allocate(ptr, 37632, nullptr);
    rec.record_free(ptr, 37632, stream);
    rec.record_failure(1ULL << 40, stream);
    rec.record_allocate(nullptr, 0, nullptr);
  }
  const auto lines = read_lines(file.path);
  ASSERT_EQ(lines.size(), 5U);
  EXPECT_EQ(lines[0], "Thread,Time,Action,Pointer,Size,Stream");
  const std::regex row(R"(1,(\d\d):(\d\d):(\d\d)\.\d{6},(.*))");
  std::vector<std::string> rest;
  for (std::size_t i = 1; i < lines.size(); ++i) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(lines[i], m, row)) << lines[i];
    EXPECT_LT(std::stoi(m[1]), 24);
    EXPECT_LT(std::stoi(m[2]), 60);
    EXPECT_LT(std::stoi(m[3]), 61);
    rest.push_back(m[4]);
  }
  // The pointer column must read exactly as glibc's %p prints it.
  char printed[32];
  std::snprintf(printed, sizeof printed, "%p", ptr);
  EXPECT_EQ(rest[0], std::string("allocate,") + printed + ",37632,0");
  EXPECT_EQ(rest[1], std::string("free,") + printed + ",37632,5603a1b0");
  std::snprintf(printed, sizeof printed, "%p", static_cast<void*>(nullptr));
  EXPECT_EQ(rest[2], std::string("allocate failure,") + printed + ",1099511627776,5603a1b0");
  EXPECT_EQ(rest[3], "allocate,(nil),0,0");
}

TEST(TraceRecorder, FlushMakesRowsVisibleBeforeDestruction) {
  const file_remover file{temp_path("cucache_rec_flush")};
  trace_recorder rec(file.path);
  rec.record_allocate(fake(0x1000), 8, nullptr);
  rec.flush();
  EXPECT_EQ(read_lines(file.path).size(), 2U);
  rec.record_free(fake(0x1000), 8, nullptr);
  rec.flush();
  EXPECT_EQ(read_lines(file.path).size(), 3U);
}

TEST(TraceRecorder, WritesOutALargeBufferWithoutAFlush) {
  const file_remover file{temp_path("cucache_rec_large")};
  trace_recorder rec(file.path);
  for (std::uintptr_t i = 0; i < 50000; ++i) rec.record_allocate(fake(0x1000 + 16 * i), 8, nullptr);
  EXPECT_GT(std::filesystem::file_size(file.path), 0U);
}

TEST(TraceRecorder, ThrowsNamingAPathItCannotOpen) {
  const std::filesystem::path bad = "/nonexistent/cucache/trace.csv";
  try {
    trace_recorder rec(bad);
    FAIL() << "no exception";
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(bad.string()), std::string::npos) << e.what();
  }
}

TEST(TraceRecorder, ReportsWriteErrorsOnFlush) {
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  trace_recorder rec("/dev/full");
  rec.record_allocate(fake(0x1000), 8, nullptr);
  EXPECT_THROW(rec.flush(), error);
  rec.flush();  // reported once, then clear
}

TEST(TraceRecorder, ThreadIdsArePerRecorderAndStartAtOne) {
  const file_remover a{temp_path("cucache_rec_ids_a")};
  const file_remover b{temp_path("cucache_rec_ids_b")};
  {
    trace_recorder ra(a.path);
    std::thread([&] { ra.record_allocate(fake(0x1000), 8, nullptr); }).join();
    ra.record_allocate(fake(0x2000), 8, nullptr);
    trace_recorder rb(b.path);
    rb.record_allocate(fake(0x3000), 8, nullptr);
    ra.record_free(fake(0x2000), 8, nullptr);
  }
  const auto ea = read_trace(a.path);
  ASSERT_EQ(ea.size(), 3U);
  EXPECT_EQ(ea[0].thread, 1U);
  EXPECT_EQ(ea[1].thread, 2U);
  EXPECT_EQ(ea[2].thread, 2U);
  const auto eb = read_trace(b.path);
  ASSERT_EQ(eb.size(), 1U);
  EXPECT_EQ(eb[0].thread, 1U);
}

TEST(TraceRecorder, RoundTripsThroughTheReader) {
  const file_remover file{temp_path("cucache_rec_roundtrip")};
  const std::uint32_t train = trace_tag_id("train");
  const std::vector<trace_event> written = {
      {1, 0, act::allocate, 0x7f77cfe00000, 37632, 0, 0, {}, false},
      {1, 0, act::allocate, 0x7f77cfe09400, 256, 0x5603a1b0, 0, {}, false},
      {1, 0, act::allocate_failure, 0, 1ULL << 45, 0x5603a1b0, 0, {}, false},
      {1, 0, act::free, 0x7f77cfe00000, 37632, 0, 0, {}, false},
      {1, 0, act::allocate, 0x7f77cfe00000, 1, 0xffffffffffffULL, 0, {}, false},
      {1, 0, act::allocate, 0x1, 0, 0, 0, {}, false},
      {1, 0, act::free, 0x7f77cfe09400, 256, 0x5603a1b0, 0, {}, false},
      // cucache's extension: tags (one CSV-quoted) and sleep / wake rows.
      {1, 0, act::allocate, 0x7f77d0000000, 4096, 0, 0, train, false},
      {1, 0, act::allocate, 0x7f77d0200000, 10, 0, 0, trace_tag_id("a,\"b\""), false},
      {1, 0, act::sleep, 0, 2097152, 0, 0, train, true},
      {1, 0, act::wake, 0, 2097152, 0, 0, train, false},
      {1, 0, act::sleep, 0, 2097152, 0, 0, train, false},
      {1, 0, act::wake, 0, 2097152, 0, 0, train, false},
  };
  {
    trace_recorder rec(file.path);
    for (const auto& ev : written) {
      void* const p = fake(ev.pointer);
      void* const s = fake(ev.stream);
      switch (ev.act) {
        case act::allocate:
          rec.record_allocate(p, ev.size, s, trace_tag_name(ev.tag));
          break;
        case act::sleep:
          rec.record_sleep(trace_tag_name(ev.tag), ev.keep_contents, ev.size);
          break;
        case act::wake:
          rec.record_wake(trace_tag_name(ev.tag), ev.size);
          break;
        case act::free:
          rec.record_free(p, ev.size, s);
          break;
        case act::allocate_failure:
          rec.record_failure(ev.size, s);
          break;
      }
    }
  }
  const auto read = read_trace(file.path);
  ASSERT_EQ(read.size(), written.size());
  for (std::size_t i = 0; i < read.size(); ++i) {
    trace_event expected = written[i];
    expected.time_us = read[i].time_us;
    expected.line = i + 2;
    EXPECT_EQ(read[i], expected) << "row " << i;
    EXPECT_LT(read[i].time_us, 86'400'000'000ULL);
  }
}

TEST(TraceRecorder, NamesTheTagColumnOnlyWhenRowsCarryTags) {
  const file_remover file{temp_path("cucache_rec_tags")};
  {
    trace_recorder rec(file.path);
    rec.record_allocate(fake(0x1000), 8, nullptr);
    rec.record_allocate(fake(0x2000), 8, nullptr, "infer");
    rec.record_sleep("infer", false, 2097152);
    rec.record_wake("infer", 2097152);
  }
  const auto lines = read_lines(file.path);
  ASSERT_EQ(lines.size(), 5U);
  EXPECT_EQ(lines[0], "Thread,Time,Action,Pointer,Size,Stream,Tag");
  EXPECT_TRUE(lines[1].ends_with(",allocate,0x1000,8,0")) << lines[1];
  EXPECT_TRUE(lines[2].ends_with(",allocate,0x2000,8,0,infer")) << lines[2];
  EXPECT_TRUE(lines[3].ends_with(",sleep,(nil),2097152,0,infer")) << lines[3];
  EXPECT_TRUE(lines[4].ends_with(",wake,(nil),2097152,0,infer")) << lines[4];
  // Without tags the file is RMM's six columns.
  {
    trace_recorder rec(file.path);
    rec.record_allocate(fake(0x1000), 8, nullptr);
  }
  EXPECT_EQ(read_lines(file.path).front(), "Thread,Time,Action,Pointer,Size,Stream");
}

TEST(TraceRecorder, ManyThreadsRecordConcurrently) {
  const file_remover file{temp_path("cucache_rec_threads")};
  constexpr int k_threads = 8;
  constexpr std::uintptr_t k_pairs = 5000;
  {
    trace_recorder rec(file.path);
    std::vector<std::thread> threads;
    for (int t = 0; t < k_threads; ++t) {
      threads.emplace_back([&rec, t] {
        // Disjoint address ranges per thread keep the trace valid in any interleaving.
        const std::uintptr_t base = (std::uintptr_t{1} << 40) * static_cast<std::uintptr_t>(t + 1);
        void* const stream = fake(static_cast<std::uintptr_t>(t));
        for (std::uintptr_t i = 0; i < k_pairs; ++i) {
          rec.record_allocate(fake(base + 256 * i), i, stream);
          rec.record_free(fake(base + 256 * i), i, stream);
        }
      });
    }
    for (auto& th : threads) th.join();
  }
  const auto events = read_trace(file.path);  // also validates every free against its allocate
  ASSERT_EQ(events.size(), static_cast<std::size_t>(k_threads) * k_pairs * 2);
  const trace_summary s = summarize(events);
  EXPECT_EQ(s.threads, static_cast<std::size_t>(k_threads));
  EXPECT_EQ(s.streams, static_cast<std::size_t>(k_threads));
  EXPECT_EQ(s.live_at_end, 0U);

  // Each recorder thread id maps to one stream (one worker), and its rows are in program order.
  std::vector<std::uintptr_t> stream_of(k_threads + 1, ~std::uintptr_t{0});
  std::vector<std::size_t> seen(k_threads + 1, 0);
  for (const auto& ev : events) {
    ASSERT_GE(ev.thread, 1U);
    ASSERT_LE(ev.thread, static_cast<std::uint32_t>(k_threads));
    if (stream_of[ev.thread] == ~std::uintptr_t{0}) stream_of[ev.thread] = ev.stream;
    ASSERT_EQ(stream_of[ev.thread], ev.stream);
    const std::size_t n = seen[ev.thread]++;
    ASSERT_EQ(ev.act, n % 2 == 0 ? act::allocate : act::free);
    ASSERT_EQ(ev.size, n / 2);
  }
}

}  // namespace
}  // namespace cucache
