// Tests of PyTorch memory snapshots read as traces (include/cucache/snapshot_reader.hpp): the
// synthetic snapshots of tests/data/torch_snapshots (python3's pickle, protocols 2, 4, 5 and
// gzip; make_snapshots.py says what each holds) read into exactly the rows their histories mean,
// with every rule of docs/replay.md applied and counted; bad snapshots get their messages; and a
// pickle equal in content to cucache's own snapshot JSON (a random program on the simulated
// device, recorded at the same time as a CSV trace) reads back as the same rows as that trace.
#include "cucache/snapshot_reader.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "api/registry.hpp"
#include "cucache/cucache.hpp"
#include "cucache/errors.hpp"
#include "cucache/observe.hpp"
#include "cucache/trace.hpp"
#include "support/temp_file.hpp"

namespace cucache {
namespace {

using act = trace_event::action;
using nlohmann::json;

const std::filesystem::path k_data = std::filesystem::path(CUCACHE_SOURCE_DIR) / "tests" / "data" /
                                     "torch_snapshots";
constexpr std::uintptr_t k_base = 0x7F0000000000;
constexpr std::uintptr_t k_side = 0x55AA00;
constexpr std::uint64_t k_t0 = 1'700'000'000'000'000;

std::string read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

using cucache::test::temp_file;

std::string rejection(const std::filesystem::path& p, const torch_snapshot_options& o = {}) {
  try {
    (void)read_torch_snapshot(p, o);
  } catch (const invalid_argument& e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted " << p;
  return {};
}

// A protocol-2 pickle of a JSON value, the opcodes Python's pickler writes for the same dict:
// the test's own writer, so that cucache's JSON can be read as the pickle PyTorch would write.
void pickle_into(std::string& out, const json& v) {
  const auto u32 = [&](std::uint32_t n) {
    for (int i = 0; i < 4; ++i) out += static_cast<char>((n >> (8 * i)) & 0xff);
  };
  const auto str = [&](const std::string& s) {
    out += 'X';
    u32(static_cast<std::uint32_t>(s.size()));
    out += s;
  };
  const auto integer = [&](std::int64_t i, bool is_unsigned, std::uint64_t u) {
    // LONG1 of 9 bytes: two's complement, little-endian (enough for every 64-bit value).
    out += '\x8a';
    out += '\x09';
    const std::uint64_t bits = is_unsigned ? u : static_cast<std::uint64_t>(i);
    for (int k = 0; k < 8; ++k) out += static_cast<char>((bits >> (8 * k)) & 0xff);
    out += (!is_unsigned && i < 0) ? '\xff' : '\x00';
  };
  switch (v.type()) {
    case json::value_t::null:
      out += 'N';
      break;
    case json::value_t::boolean:
      out += v.get<bool>() ? '\x88' : '\x89';
      break;
    case json::value_t::number_unsigned:
      integer(0, true, v.get<std::uint64_t>());
      break;
    case json::value_t::number_integer:
      integer(v.get<std::int64_t>(), false, 0);
      break;
    case json::value_t::number_float: {
      out += 'G';
      const auto bits = std::bit_cast<std::uint64_t>(v.get<double>());
      for (int k = 7; k >= 0; --k) out += static_cast<char>((bits >> (8 * k)) & 0xff);
      break;
    }
    case json::value_t::string:
      str(v.get<std::string>());
      break;
    case json::value_t::array:
      out += ']';
      for (const json& item : v) {
        pickle_into(out, item);
        out += 'a';
      }
      break;
    case json::value_t::object:
      out += '}';
      for (auto it = v.begin(); it != v.end(); ++it) {
        str(it.key());
        pickle_into(out, it.value());
        out += 's';
      }
      break;
    default:
      ADD_FAILURE() << "unexpected JSON type";
  }
}
std::string to_pickle(const json& v) {
  std::string out = "\x80\x02";
  pickle_into(out, v);
  out += '.';
  return out;
}

struct row {
  act a;
  std::uintptr_t pointer;
  std::size_t size;
  std::uintptr_t stream;
  std::size_t line;
};
std::vector<row> rows_of(const std::vector<trace_event>& events) {
  std::vector<row> out;
  for (const trace_event& e : events) out.push_back({e.act, e.pointer, e.size, e.stream, e.line});
  return out;
}
bool operator==(const row& x, const row& y) {
  return x.a == y.a && x.pointer == y.pointer && x.size == y.size && x.stream == y.stream &&
         x.line == y.line;
}
std::ostream& operator<<(std::ostream& os, const row& r) {
  return os << fmt::format("{{{} {:#x} {} {:#x} line {}}}", to_string(r.a), r.pointer, r.size,
                           r.stream, r.line);
}

TEST(SnapshotReader, BasicHistoryInEveryProtocolAndGzip) {
  const std::uintptr_t a = k_base, b = k_base + 1024, d = k_base + 0x200000;
  const std::vector<row> expected = {
      {act::allocate, a, 1000, 0, 2},
      {act::allocate, b, 3000, 0, 3},
      {act::free, a, 1000, 0, 4},
      {act::allocate, a, 500, 0, 6},
      {act::allocate, d, 4 << 20, k_side, 8},
      {act::free, b, 3000, 0, 9},
      {act::free, d, 4 << 20, k_side, 11},
      {act::allocate, b, 100, 0, 12},
      {act::allocate_failure, 0, std::size_t{1} << 40, 0, 14},
  };
  for (const char* file :
       {"basic_p2.pickle", "basic_p4.pickle", "basic_p5.pickle", "basic_p4.pickle.gz"}) {
    SCOPED_TRACE(file);
    const auto path = k_data / file;
    EXPECT_TRUE(is_torch_snapshot(path));
    const torch_snapshot_trace t = read_torch_snapshot(path);
    EXPECT_EQ(rows_of(t.events), expected);
    EXPECT_EQ(t.events.front().time_us, k_t0 + 1);
    EXPECT_EQ(t.events.front().thread, 0U);
    EXPECT_EQ(t.device, 0);
    EXPECT_EQ(t.devices, 1U);
    EXPECT_EQ(t.entries, 15U);
    EXPECT_EQ(t.allocs, 5U);
    EXPECT_EQ(t.frees, 3U);
    EXPECT_EQ(t.ooms, 1U);
    EXPECT_EQ(t.completions, 3U);
    EXPECT_EQ(t.late_completions, 1U);  // D's, after E's alloc
    EXPECT_EQ(t.completions_before_history, 0U);
    EXPECT_EQ(t.completions_without_request, 0U);
    EXPECT_EQ(t.segment_entries, 2U);
    EXPECT_EQ(t.snapshot_entries, 1U);
    EXPECT_EQ(t.before_history_freed + t.before_history_alive + t.disagreeing_blocks, 0U);
    // Call stacks: allocations carry theirs, shared frames once; frees and the oom none.
    ASSERT_EQ(t.event_stacks.size(), t.events.size());
    ASSERT_EQ(t.stacks.size(), 3U);  // none, [forward, step], [step]
    const auto& s0 = t.stacks[t.event_stacks[0]];
    ASSERT_EQ(s0.size(), 2U);
    EXPECT_EQ(s0[0].filename, "model.py");
    EXPECT_EQ(s0[0].line, 42);
    EXPECT_EQ(s0[0].name, "forward");
    EXPECT_EQ(s0[1].name, "step");
    EXPECT_EQ(t.event_stacks[1], t.event_stacks[0]);
    EXPECT_EQ(t.event_stacks[2], 0U);
    EXPECT_EQ(t.stacks[t.event_stacks[3]].size(), 1U);
    EXPECT_EQ(t.event_stacks[8], 0U);
    // The segments at the dump.
    ASSERT_EQ(t.segments.size(), 2U);
    EXPECT_EQ(t.segments[0].address, k_base);
    EXPECT_EQ(t.segments[0].total_size, 2U << 20);
    EXPECT_EQ(t.segments[0].segment_type, "small");
    ASSERT_EQ(t.segments[0].blocks.size(), 3U);
    EXPECT_EQ(t.segments[0].blocks[1].address, k_base + 1024);
    EXPECT_EQ(t.segments[0].blocks[1].requested_size, 100U);
    EXPECT_EQ(t.segments[0].blocks[1].state, "active_allocated");
    EXPECT_EQ(t.segments[1].stream, k_side);
    EXPECT_EQ(t.segments[1].segment_type, "large");
    // The figures the replay starts from.
    const trace_summary sum = summarize(t.events);
    EXPECT_EQ(sum.peak_requested_bytes, 1000U + 3000 - 1000 + 500 + (4U << 20));
    EXPECT_EQ(sum.allocations, 5U);
    EXPECT_EQ(sum.frees, 3U);
    EXPECT_EQ(sum.failures, 1U);
    EXPECT_EQ(sum.live_at_end, 2U);
    EXPECT_EQ(sum.streams, 2U);
    EXPECT_EQ(t.note(),
              "PyTorch memory snapshot, device 0 (of 1 in device_traces): 15 entries: 5 alloc, 3 "
              "free_requested, 1 oom (replayed as allocate failures); 3 free_completed not "
              "replayed (the free is the request), 1 of them after later allocations "
              "(record_stream: PyTorch reused those blocks later than the replay does); 2 "
              "segment and 1 snapshot entries skipped (the allocator's own)");
    // read_trace reads a snapshot as the rows of its one device.
    EXPECT_EQ(rows_of(read_trace(path)), expected);
  }
}

TEST(SnapshotReader, AllocationsBeforeTheHistoryAreLiveAtItsStart) {
  const torch_snapshot_trace t = read_torch_snapshot(k_data / "wrapped.pickle");
  const std::uintptr_t p = k_base + 0x100000, r = k_base + 0x400000;
  const std::vector<row> expected = {
      {act::allocate, p, 2048, 0, 0},  // from its free_requested (entry 1)
      {act::allocate, r, 8192, 0, 0},  // active at the dump, never in the history
      {act::free, p, 2048, 0, 1},
      {act::allocate, p, 4096, 0, 4},
  };
  EXPECT_EQ(rows_of(t.events), expected);
  EXPECT_EQ(t.events[0].time_us, k_t0 + 1);  // the history's first time
  EXPECT_EQ(t.before_history_freed, 1U);
  EXPECT_EQ(t.before_history_alive, 1U);
  EXPECT_EQ(t.completions, 2U);
  EXPECT_EQ(t.completions_before_history, 1U);  // Q's
  EXPECT_EQ(t.late_completions, 0U);
  EXPECT_EQ(t.disagreeing_blocks, 0U);
  EXPECT_EQ(t.stacks[t.event_stacks[1]].at(0).name, "step");  // the block's own frames
  EXPECT_EQ(summarize(t.events).peak_requested_bytes, 2048U + 8192 - 2048 + 4096);
  EXPECT_EQ(t.note(),
            "PyTorch memory snapshot, device 0 (of 1 in device_traces): 4 entries: 1 alloc, 1 "
            "free_requested; 2 allocations made before the history began replayed as live at "
            "its start (1 freed in it, 1 active at the dump); 2 free_completed not replayed (the "
            "free is the request)");
}

TEST(SnapshotReader, DevicesArePickedOrNamed) {
  const auto path = k_data / "two_devices.pickle";
  EXPECT_EQ(rejection(path),
            path.string() +
                ": the snapshot has allocation histories for 2 devices (0: 2 entries, 1: 2 "
                "entries): pick one (cucache-replay --device N, cucache.fit(path, device=N))");
  const torch_snapshot_trace d1 = read_torch_snapshot(path, {1});
  EXPECT_EQ(d1.device, 1);
  EXPECT_EQ(rows_of(d1.events),
            (std::vector<row>{{act::allocate, k_base + 0x1000000, 5000, 0, 1},
                              {act::allocate, k_base + 0x1002000, 7000, 0, 2}}));
  EXPECT_EQ(read_torch_snapshot(path, {0}).events.size(), 2U);
  EXPECT_EQ(rejection(path, {2}),
            path.string() + ": device 2: the snapshot has device_traces for devices 0 to 1");
  EXPECT_THROW((void)read_trace(path), invalid_argument);
}

TEST(SnapshotReader, NoHistorySaysHowToRecordOne) {
  const auto path = k_data / "no_history.pickle";
  EXPECT_EQ(rejection(path),
            path.string() +
                ": the snapshot has no allocation history (device_traces holds no entry): it was "
                "dumped without recording one; record one with "
                "torch.cuda.memory._record_memory_history(max_entries=100000) before the work, "
                "then torch.cuda.memory._dump_snapshot(path) (docs/replay.md, \"PyTorch memory "
                "snapshots\")");
  temp_file f("cucache-snap-empty");
  f.write(to_pickle(json{{"segments", json::array()}}));
  EXPECT_NE(rejection(f.path()).find("(device_traces is missing or empty)"), std::string::npos);
}

TEST(SnapshotReader, CorruptTruncatedAndObjectPicklesAreRefusedClearly) {
  const std::string good = read_bytes(k_data / "basic_p4.pickle");
  temp_file f("cucache-snap-bad");
  f.write(good.substr(0, good.size() / 2));
  const std::string cut = rejection(f.path());
  EXPECT_TRUE(cut.starts_with(f.path().string() + ": pickle: truncated")) << cut;
  // Not a pickle at all: read as a CSV trace, whose reader names the header.
  f.write("hello");
  EXPECT_FALSE(is_torch_snapshot(f.path()));
  // An object: refused at its opcode, nothing executed.
  f.write(std::string("\x80\x04\x95\x16\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x8c\x06system\x93"
                      "\x8c\x04true\x85R.", 33));
  EXPECT_EQ(rejection(f.path()),
            f.path().string() +
                ": pickle: opcode STACK_GLOBAL (0x93) refused: it names or builds a Python "
                "object; only plain data is read, and nothing is executed at byte 23");
  // Snapshot structure errors name the entry.
  const auto with_trace = [&](const json& entries) {
    f.write(to_pickle(json{{"segments", json::array()}, {"device_traces", json::array({entries})}}));
    return rejection(f.path());
  };
  const json alloc = {{"action", "alloc"}, {"addr", 4096}, {"size", 10}, {"stream", 0}};
  const json freed = {{"action", "free_requested"}, {"addr", 4096}, {"size", 10}, {"stream", 0}};
  EXPECT_EQ(with_trace(json::array({alloc, alloc})),
            f.path().string() +
                ": device_traces[0][1]: alloc of 0x1000, which is live (allocated at entry 1 and "
                "not freed since)");
  EXPECT_EQ(with_trace(json::array({alloc, freed, freed})),
            f.path().string() +
                ": device_traces[0][2]: free_requested of 0x1000, which is not live (its last "
                "entry is 2, and no alloc since)");
  EXPECT_EQ(with_trace(json::array({json{{"action", "resize"}}})),
            f.path().string() +
                ": device_traces[0][0]: unknown action 'resize' (PyTorch writes alloc, "
                "free_requested, free_completed, segment_alloc, segment_free, segment_map, "
                "segment_unmap, snapshot, oom)");
  EXPECT_EQ(with_trace(json::array({json{{"action", "alloc"}, {"addr", "x"}}})),
            f.path().string() + ": device_traces[0][0]: 'addr' is a str, not an int");
  EXPECT_EQ(with_trace(json::array({json{{"action", "alloc"}, {"addr", -5}, {"size", 1}}})),
            f.path().string() +
                ": device_traces[0][0]: 'addr' is not an int from 0 to 2^64 - 1");
  EXPECT_EQ(with_trace(json::array({json{{"addr", 1}}})),
            f.path().string() + ": device_traces[0][0]: no 'action'");
  f.write(to_pickle(json::array({1, 2})));
  EXPECT_EQ(rejection(f.path()),
            f.path().string() +
                ": not a PyTorch memory snapshot: the pickle holds a list, not a dict with "
                "'segments' and 'device_traces'");
  f.write(to_pickle(json{{"a", 1}}));
  EXPECT_EQ(rejection(f.path()),
            f.path().string() +
                ": not a PyTorch memory snapshot: its dict has neither 'segments' nor "
                "'device_traces'");
}

// Snapshots written by torch 2.11 on the H200 (tests/data/torch_snapshots/h200/README.md). The
// figures are exact: the counts of each action, the allocations from before the history, and
// the peak of requested bytes, which a 15-line python3 reading of the same pickles (pickle.load,
// the same rules) gave. Independently of the history, the rows leave live exactly the requested
// bytes of the blocks PyTorch lists as active_allocated at the dump.
TEST(SnapshotReader, H200SnapshotsReadExactly) {
  struct expect {
    const char* file;
    std::size_t entries, allocs, frees, completions, pending, completions_before, segment_entries,
        before_alive;
    std::size_t peak_requested;
    bool frames;
  };
  const auto h200 = k_data / "h200";
  for (const expect& x : {
           expect{"mlp_default_python.pickle.gz", 235, 78, 75, 75, 0, 0, 7, 1, 111462404, true},
           // The side stream's tensor, record_stream'ed, is still pending at the dump.
           expect{"transformer_default_python.pickle.gz", 1158, 384, 384, 383, 1, 0, 7, 4,
                  85773320, true},
           // Here the history starts with the completion of a free requested before it.
           expect{"transformer_expandable_nocontext.pickle.gz", 793, 264, 264, 264, 1, 1, 1, 4,
                  84069896, false},
       }) {
    SCOPED_TRACE(x.file);
    const torch_snapshot_trace t = read_torch_snapshot(h200 / x.file);
    EXPECT_EQ(t.device, 0);
    EXPECT_EQ(t.devices, 1U);
    EXPECT_EQ(t.entries, x.entries);
    EXPECT_EQ(t.allocs, x.allocs);
    EXPECT_EQ(t.frees, x.frees);
    EXPECT_EQ(t.ooms, 0U);
    EXPECT_EQ(t.completions, x.completions);
    EXPECT_EQ(t.pending_at_dump, x.pending);
    EXPECT_EQ(t.late_completions, 0U);
    EXPECT_EQ(t.completions_before_history, x.completions_before);
    EXPECT_EQ(t.completions_without_request, 0U);
    EXPECT_EQ(t.segment_entries, x.segment_entries);
    EXPECT_EQ(t.before_history_freed, 0U);
    EXPECT_EQ(t.before_history_alive, x.before_alive);
    EXPECT_EQ(t.disagreeing_blocks, 0U);
    EXPECT_EQ(t.events.size(), x.allocs + x.frees + x.before_alive);
    const trace_summary sum = summarize(t.events);
    EXPECT_EQ(sum.peak_requested_bytes, x.peak_requested);
    std::map<std::uintptr_t, std::size_t> live;
    for (const trace_event& e : t.events) {
      if (e.act == act::allocate) live[e.pointer] = e.size;
      if (e.act == act::free) live.erase(e.pointer);
    }
    std::size_t live_bytes = 0, active_bytes = 0;
    for (const auto& [p, n] : live) live_bytes += n;
    for (const snapshot_segment& seg : t.segments) {
      for (const snapshot_block& b : seg.blocks) {
        if (b.state == "active_allocated") {
          active_bytes += b.requested_size;
          EXPECT_TRUE(live.contains(b.address)) << b.address;
        }
      }
    }
    EXPECT_EQ(live_bytes, active_bytes);
    EXPECT_GT(live_bytes, 0U);
    // Python stacks: allocations made from Python have frames (others, none); context=None: none.
    const auto with_frames = static_cast<std::size_t>(std::count_if(
        t.event_stacks.begin(), t.event_stacks.end(), [](std::uint32_t s) { return s != 0; }));
    if (x.frames) {
      EXPECT_GT(with_frames, x.allocs / 4);
      EXPECT_FALSE(t.stacks.at(t.event_stacks.at(x.before_alive)).empty());  // the first alloc
    } else {
      // The history's rows have none; blocks from before it keep their blocks' frames.
      EXPECT_TRUE(std::all_of(t.event_stacks.begin() + static_cast<std::ptrdiff_t>(x.before_alive),
                              t.event_stacks.end(), [](std::uint32_t s) { return s == 0; }));
    }
  }
  EXPECT_NE(rejection(h200 / "nohistory_default.pickle.gz").find("has no allocation history"),
            std::string::npos);
}

// cucache's own snapshot JSON (CUCACHE_CONF history:N), pickled: the same rows as the CSV trace
// recorded at the same time (trace:PATH). The history keeps the last 40 entries of a 200-call
// program, so the rows before its start come back as allocations live at it.
TEST(SnapshotReader, CucachesOwnSnapshotPickledReadsAsItsCsvTrace) {
  temp_file csv("cucache-snap-trace");
  ::setenv("CUCACHE_BACKEND", "sim", 1);
  ::setenv("CUCACHE_CONF", fmt::format("history:40,trace:{}", csv.path().string()).c_str(), 1);
  detail::reset_for_testing();
  std::mt19937_64 rng(35);
  std::vector<void*> live;
  const stream_handle streams[] = {nullptr, reinterpret_cast<stream_handle>(std::uintptr_t{0x700})};
  for (int i = 0; i < 200; ++i) {
    if (live.empty() || rng() % 3 != 0) {
      const std::size_t size = rng() % 4 == 0 ? (1 + rng() % 8) << 20 : 1 + rng() % 100000;
      live.push_back(cucache::malloc(size, streams[rng() % 2]));
    } else {
      const std::size_t k = rng() % live.size();
      cucache::free(live[k]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  const json snap = json::parse(snapshot());
  flush_trace();
  for (void* p : live) cucache::free(p);
  flush_trace();
  ::unsetenv("CUCACHE_CONF");
  detail::reset_for_testing();

  temp_file pk("cucache-snap-own");
  pk.write(to_pickle(snap));
  const torch_snapshot_trace t = read_torch_snapshot(pk.path());
  std::vector<trace_event> csv_events = read_trace(csv.path());
  // The program's 200 calls, then the frees of what it left live (after the snapshot).
  ASSERT_EQ(csv_events.size(), 200U + live.size());
  csv_events.resize(200);
  // The rows of the history: the last ones of the CSV trace.
  std::size_t before = 0;
  while (before < t.events.size() && t.events[before].line == 0) ++before;
  const std::size_t in_history = t.events.size() - before;
  ASSERT_GT(in_history, 5U);
  ASSERT_LT(in_history, 40U);
  const std::size_t start = csv_events.size() - in_history;
  for (std::size_t k = 0; k < in_history; ++k) {
    const trace_event& s = t.events[before + k];
    const trace_event& c = csv_events[start + k];
    EXPECT_EQ(s.act, c.act) << k;
    EXPECT_EQ(s.pointer, c.pointer) << k;
    EXPECT_EQ(s.size, c.size) << k;
    EXPECT_EQ(s.stream, c.stream) << k;
  }
  // The rows before: exactly the allocations live in the CSV trace where the history starts.
  std::map<std::uintptr_t, std::pair<std::size_t, std::uintptr_t>> live_at_start;
  for (std::size_t i = 0; i < start; ++i) {
    const trace_event& c = csv_events[i];
    if (c.act == act::allocate) live_at_start[c.pointer] = {c.size, c.stream};
    if (c.act == act::free) live_at_start.erase(c.pointer);
  }
  ASSERT_EQ(before, live_at_start.size());
  EXPECT_GT(before, 0U);
  std::size_t k = 0;
  for (const auto& [ptr, size_stream] : live_at_start) {  // by address, as the reader orders them
    EXPECT_EQ(t.events[k].act, act::allocate);
    EXPECT_EQ(t.events[k].pointer, ptr);
    EXPECT_EQ(t.events[k].size, size_stream.first);
    EXPECT_EQ(t.events[k].stream, size_stream.second);
    ++k;
  }
  EXPECT_EQ(t.before_history_freed + t.before_history_alive, before);
  EXPECT_EQ(t.disagreeing_blocks, 0U);
  // So the replay's figures agree: the peak of the CSV's rows from the history's start on, with
  // what was live there, is the snapshot's peak.
  std::vector<trace_event> window;
  for (const auto& [ptr, size_stream] : live_at_start) {
    trace_event e;
    e.act = act::allocate;
    e.pointer = ptr;
    e.size = size_stream.first;
    window.push_back(e);
  }
  window.insert(window.end(), csv_events.begin() + static_cast<std::ptrdiff_t>(start),
                csv_events.end());
  EXPECT_EQ(summarize(t.events).peak_requested_bytes, summarize(window).peak_requested_bytes);
}

}  // namespace
}  // namespace cucache
