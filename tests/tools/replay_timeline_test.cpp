// Tests of cucache-replay --timeline (tools/replay/timeline.cpp) on the simulated device: the
// page's data for hand-made traces worked out by hand (series per pool and stream, marks, the
// peak and what was alive at it), bucketing that keeps the peak, the bundled trace's peak equal
// to the replay's in both segment modes, bad inputs (nothing left under the output's name), and
// the progress line staying off when stderr is not a terminal. The page in a real browser is the
// timeline_browser ctest (tests/tools/timeline_browser_check.sh).
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cucache/backend_factory.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/errors.hpp"
#include "cucache/sim_backend.hpp"
#include "cucache/trace.hpp"
#include "api/registry.hpp"
#include "cucache/cucache.hpp"
#include "cucache/observe.hpp"
#include "progress.hpp"
#include "replay_engine.hpp"
#include "timeline.hpp"
#include "tools/replay_test_support.hpp"

namespace cucache::replay {
namespace {

using test::trace_builder;

namespace fs = std::filesystem;
using nlohmann::json;
constexpr std::int64_t k_mib = std::int64_t{1} << 20;
const fs::path k_resnet = fs::path(CUCACHE_SOURCE_DIR) / "traces" / "resnet50_train.csv.gz";


options sim() {
  options o;
  o.backend = backend_kind::sim;
  return o;
}

/// A folder of its own for one test, removed afterwards.
class temp_dir {
 public:
  explicit temp_dir(const std::string& stem)
      : path_(fs::temp_directory_path() / (stem + "." + std::to_string(::getpid()))) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~temp_dir() { fs::remove_all(path_); }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  [[nodiscard]] const fs::path& path() const { return path_; }
  [[nodiscard]] std::vector<std::string> entries() const {
    std::vector<std::string> v;
    for (const auto& e : fs::directory_iterator(path_)) v.push_back(e.path().filename().string());
    std::sort(v.begin(), v.end());
    return v;
  }

 private:
  fs::path path_;
};

struct cli_run {
  int status = 0;
  std::string out, err;
};
cli_run run(std::vector<std::string> args) {
  args.insert(args.begin(), "cucache-replay");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  cli_run r;
  r.status = run_cli(static_cast<int>(argv.size()), argv.data(), out, err);
  r.out = out.str();
  r.err = err.str();
  return r;
}

const json& series(const json& data, const std::string& group, const std::string& metric) {
  for (const json& s : data["series"]) {
    if (s["group"] == group && s["metric"] == metric) return s;
  }
  throw std::runtime_error("no series " + group + " " + metric);
}
std::vector<std::int64_t> values(const json& s, const char* which) {
  return s[which].get<std::vector<std::int64_t>>();
}
const json* mark(const json& data, const std::string& name) {
  for (const json& m : data["marks"]) {
    if (m["name"] == name) return &m;
  }
  return nullptr;
}

TEST(replay_timeline, two_streams_by_hand) {
  // One small 2 MiB segment per stream (each stream has its own pool); the free on the other
  // stream returns the block to stream 0x10's pool; sizes round to 512 bytes.
  trace_builder t{7, "00:00:01"};
  t.alloc(0x1000, 4000, 0x10).alloc(0x2000, 4096, 0x20).free(0x1000, 4000, 0x20);
  const std::vector<trace_event> events = parse_trace(t.text(), "two");
  const prepared_trace trace = prepare(events, "two");
  const json d = timeline_data(trace, &events, sim());
  EXPECT_EQ(d["events"], 3);
  EXPECT_EQ(d["buckets"], 3);  // one event per bucket: min == max
  EXPECT_EQ(d["streams"], json::array({"0x10", "0x20"}));
  using v = std::vector<std::int64_t>;
  EXPECT_EQ(values(series(d, "all", "requested"), "max"), (v{4000, 8096, 4096}));
  EXPECT_EQ(values(series(d, "all", "allocated"), "max"), (v{4096, 8192, 4096}));
  EXPECT_EQ(values(series(d, "all", "reserved"), "max"), (v{2 * k_mib, 4 * k_mib, 4 * k_mib}));
  EXPECT_EQ(values(series(d, "all", "reserved"), "min"), (v{2 * k_mib, 4 * k_mib, 4 * k_mib}));
  EXPECT_EQ(values(series(d, "small pool", "reserved"), "max"),
            (v{2 * k_mib, 4 * k_mib, 4 * k_mib}));
  EXPECT_EQ(values(series(d, "large pool", "reserved"), "max"), (v{0, 0, 0}));
  EXPECT_EQ(values(series(d, "stream 0x10", "reserved"), "max"), (v{2 * k_mib, 2 * k_mib, 2 * k_mib}));
  EXPECT_EQ(values(series(d, "stream 0x20", "reserved"), "max"), (v{0, 2 * k_mib, 2 * k_mib}));
  EXPECT_EQ(values(series(d, "stream 0x10", "allocated"), "max"), (v{4096, 4096, 0}));
  EXPECT_EQ(values(series(d, "stream 0x20", "requested"), "max"), (v{0, 4096, 4096}));
  const json* malloc_mark = mark(d, "cudaMalloc");
  ASSERT_NE(malloc_mark, nullptr);
  EXPECT_EQ((*malloc_mark)["total"], 2);
  EXPECT_EQ((*malloc_mark)["buckets"], json::array({0, 1}));
  EXPECT_EQ((*malloc_mark)["counts"], json::array({1, 1}));
  EXPECT_EQ(mark(d, "cudaFree"), nullptr);  // marks that never happened are left out
  const json& p = d["peak"];
  EXPECT_EQ(p["reserved_bytes"], 4 * k_mib);
  EXPECT_EQ(p["event"], 1);
  EXPECT_EQ(p["line"], 3);  // the header is line 1
  EXPECT_EQ(p["allocated_bytes"], 8192);
  EXPECT_EQ(p["requested_bytes"], 8096);
  EXPECT_EQ(p["alive_count"], 2);
  ASSERT_EQ(p["allocations"].size(), 2u);
  // Largest first: the 4096-byte request, then the 4000-byte one (both round to 4096).
  EXPECT_EQ(p["allocations"][0]["size"], 4096);
  EXPECT_EQ(p["allocations"][0]["stream"], 1);
  EXPECT_EQ(p["allocations"][0]["event"], 1);
  EXPECT_EQ(p["allocations"][0]["line"], 3);
  EXPECT_EQ(p["allocations"][0]["thread"], 7);
  EXPECT_EQ(p["allocations"][0]["time_us"], 1000002);
  EXPECT_EQ(p["allocations"][1]["size"], 4000);
  EXPECT_EQ(p["allocations"][1]["rounded"], 4096);
  EXPECT_EQ(p["snapshot"]["segments"].size(), 2u);
  EXPECT_EQ(p["snapshot"]["reserved_bytes"], 4 * k_mib);
}

TEST(replay_timeline, buckets_keep_the_peak) {
  // 20 MiB segment for a 5 MiB request, an 18 MiB one for 16 MiB + 1, freed and reused.
  trace_builder t{7, "00:00:01"};
  t.alloc(0x1000, 5 * k_mib).alloc(0x2000, 16 * k_mib + 1).free(0x2000, 0).free(0x1000, 0);
  t.alloc(0x3000, 1000).free(0x3000, 0);
  const prepared_trace trace = prepare(parse_trace(t.text(), "b"), "b");
  timeline_options topts;
  topts.max_buckets = 4;  // 6 events: buckets {0,1}, {2}, {3,4}, {5}
  const json d = timeline_data(trace, nullptr, sim(), topts);
  EXPECT_EQ(d["buckets"], 4);
  using v = std::vector<std::int64_t>;
  EXPECT_EQ(values(series(d, "all", "requested"), "max"), (v{21 * k_mib + 1, 5 * k_mib, 1000, 0}));
  EXPECT_EQ(values(series(d, "all", "requested"), "min"), (v{5 * k_mib, 5 * k_mib, 0, 0}));
  EXPECT_EQ(values(series(d, "all", "reserved"), "max"), (v{38 * k_mib, 38 * k_mib, 40 * k_mib, 40 * k_mib}));
  EXPECT_EQ(values(series(d, "large pool", "reserved"), "min"), (v{20 * k_mib, 38 * k_mib, 38 * k_mib, 38 * k_mib}));
  EXPECT_EQ(d["peak"]["reserved_bytes"], 40 * k_mib);
  EXPECT_EQ(d["peak"]["event"], 4);
  EXPECT_EQ(d["peak"]["bucket"], 2);
  EXPECT_EQ(d["peak"]["requested_bytes"], 21 * k_mib + 1);
  EXPECT_EQ(d["bucket_time_us"], json::array());  // no rows given
}

TEST(replay_timeline, out_of_memory_is_a_mark) {
  trace_builder t{7, "00:00:01"};
  t.alloc(0x1000, 4 * k_mib).alloc(0x2000, 8 * k_mib).free(0x1000, 0);
  options o = sim();
  o.cfg = parse_config("expandable_segments:True");
  o.capacity_bytes = 8 * k_mib;
  const json d = timeline_data(prepare(parse_trace(t.text()), "oom"), nullptr, o);
  const json* oom = mark(d, "out of memory");
  ASSERT_NE(oom, nullptr);
  EXPECT_EQ((*oom)["total"], 1);
  EXPECT_EQ((*oom)["buckets"], json::array({1}));
  EXPECT_EQ(d["peak"]["reserved_bytes"], 4 * k_mib);
  EXPECT_EQ(d["totals"]["oom_count"], 1);
  EXPECT_NE(mark(d, "VM map"), nullptr);
}

class replay_timeline_resnet : public ::testing::TestWithParam<const char*> {};

TEST_P(replay_timeline_resnet, peak_is_the_replays) {
  const std::vector<trace_event> events = read_trace(k_resnet);
  const prepared_trace trace = prepare(events, "resnet50_train");
  options o = sim();
  o.cfg = parse_config(GetParam());
  const trace_result r = replay_trace(trace, o);
  const json d = timeline_data(trace, &events, o);
  const json& p = d["peak"];
  EXPECT_EQ(p["reserved_bytes"].get<std::size_t>(), r.figures.peak_reserved_bytes);
  EXPECT_EQ(p["snapshot"]["reserved_bytes"].get<std::size_t>(), r.figures.peak_reserved_bytes);
  EXPECT_EQ(p["requested_bytes"].get<std::size_t>(), r.peak_requested_bytes);  // one stream
  EXPECT_EQ(p["allocated_bytes"].get<std::size_t>(), r.figures.peak_allocated_bytes);
  EXPECT_EQ(d["buckets"], 13683);
  const auto reserved = values(series(d, "all", "reserved"), "max");
  EXPECT_EQ(*std::max_element(reserved.begin(), reserved.end()),
            static_cast<std::int64_t>(r.figures.peak_reserved_bytes));
  // Alive at the peak, largest first, and their sum is what the allocator held then.
  std::size_t rounded = 0;
  std::size_t previous = SIZE_MAX;
  for (const json& a : p["allocations"]) {
    EXPECT_LE(a["rounded"].get<std::size_t>(), previous);
    previous = a["rounded"].get<std::size_t>();
    rounded += previous;
  }
  EXPECT_EQ(p["allocations"].size(), p["alive_count"].get<std::size_t>());
  EXPECT_EQ(rounded, p["alive_rounded_bytes"].get<std::size_t>());
  EXPECT_EQ(p["snapshot"]["allocated_bytes"].get<std::size_t>(), rounded);
  const json* malloc_mark = mark(d, o.cfg.expandable_segments ? "VM create" : "cudaMalloc");
  ASSERT_NE(malloc_mark, nullptr);
  // cudaMalloc calls, or in expandable mode cuMemCreate calls: both are device_alloc_calls.
  EXPECT_EQ((*malloc_mark)["total"].get<std::uint64_t>(), r.figures.device_alloc_calls);
}

INSTANTIATE_TEST_SUITE_P(modes, replay_timeline_resnet,
                         ::testing::Values("", "expandable_segments:True"));

// Sleep and wake rows (cucache's trace extension): a tag's allocations go to its sleep domain,
// the sleep gives its pages back and the wake maps them again at the same addresses.
options sim_expandable() {
  options o = sim();
  o.cfg.expandable_segments = true;
  return o;
}

trace_builder sleeping_trace() {
  trace_builder t{1, "00:00:02"};
  t.alloc(0x1000, 1 << 20)                       // 0: untagged, 1 MiB
      .alloc_tagged(0x2000, 4 << 20, "train")    // 1: the tag's, 4 MiB: two 2 MiB pages
      .alloc_tagged(0x3000, 1000, "train")       // 2: the tag's small block: a page of its own
      .sleep("train", 6 << 20)                   // 3
      .wake("train", 6 << 20);                   // 4
  return t;
}

TEST(replay_timeline, sleep_and_wake_by_hand) {
  trace_builder t = sleeping_trace();
  t.free(0x2000, 4 << 20).free(0x3000, 1000).free(0x1000, 1 << 20);  // 5, 6, 7
  const std::vector<trace_event> events = parse_trace(t.text(), "sleepy");
  const prepared_trace trace = prepare(events, "sleepy");
  EXPECT_EQ(trace.sleep_tags, std::vector<std::string>{"train"});
  EXPECT_EQ(trace.sleeps, 1u);
  EXPECT_EQ(trace.first_sleep_line, 5u);
  const json d = timeline_data(trace, &events, sim_expandable());
  ASSERT_EQ(d["buckets"], 8);
  using v = std::vector<std::int64_t>;
  const v reserved = values(series(d, "all", "reserved"), "max");
  const v sleeping = values(series(d, "all", "sleeping"), "max");
  EXPECT_EQ(sleeping, (v{0, 0, 0, 6 * k_mib, 0, 0, 0, 0}));
  // Reserved falls at the sleep by the tag's 6 MiB and returns at the wake. 8 MiB before: the
  // untagged 1 MiB block's small page, the tag's own small page and its two large pages. A
  // bucket's envelope holds every value reserved took in its event: the sleep releases handle by
  // handle down to its min, the wake maps them back up to its max.
  ASSERT_EQ(reserved.size(), 8u);
  const v reserved_min = values(series(d, "all", "reserved"), "min");
  EXPECT_EQ(reserved[2], 8 * k_mib);
  EXPECT_EQ(reserved_min[3], 2 * k_mib) << d["series"].dump();
  // Coarse handles (the default): the tag's 4 MiB block is one handle, released and mapped again
  // in one step.
  EXPECT_EQ(reserved[3], 4 * k_mib);  // after the first handle released: the 4 MiB chunk
  EXPECT_EQ(reserved_min[4], 6 * k_mib);  // after the first handle mapped again
  EXPECT_EQ(reserved[4], 8 * k_mib);
  EXPECT_EQ(reserved_min[5], 8 * k_mib);  // nothing is given back at the frees (cached)
  // Allocated bytes are the program's: a sleeping block is still allocated.
  EXPECT_EQ(values(series(d, "all", "requested"), "max")[3], (1 << 20) + (4 << 20) + 1000);
  const json* sleep_mark = mark(d, "sleep");
  const json* wake_mark = mark(d, "wake");
  ASSERT_NE(sleep_mark, nullptr);
  ASSERT_NE(wake_mark, nullptr);
  EXPECT_EQ((*sleep_mark)["buckets"], json::array({3}));
  EXPECT_EQ((*wake_mark)["buckets"], json::array({4}));
  EXPECT_EQ(d["totals"]["sleeps"], 1);
  EXPECT_EQ(d["totals"]["wakes"], 1);
  EXPECT_EQ(d["totals"]["peak_sleeping_bytes"], 6 * k_mib);
  EXPECT_EQ(d["peak"]["event"], 2);  // reached before the sleep; the wake only returns to it

  // The replay's report: the same peak, the sleeping peak and the counts.
  const trace_result r = replay_trace(trace, sim_expandable());
  EXPECT_EQ(r.figures.peak_reserved_bytes, d["peak"]["reserved_bytes"].get<std::size_t>());
  EXPECT_EQ(r.figures.sleeps, 1u);
  EXPECT_EQ(r.figures.wakes, 1u);
  EXPECT_EQ(r.figures.peak_sleeping_bytes, std::size_t{6} << 20);
  const json j = to_json(r);
  EXPECT_EQ(j["sleeps"], 1);
  EXPECT_EQ(j["wakes"], 1);
  EXPECT_EQ(j["peak_sleeping_bytes"], 6 * k_mib);
  const trace_result rs[] = {r};
  EXPECT_NE(format_table(rs).find("sleep and wake"), std::string::npos) << format_table(rs);

  // The page carries the sleeping series and the marks.
  const std::string html = timeline_html(d);
  EXPECT_NE(html.find("\"metric\":\"sleeping\""), std::string::npos);
  EXPECT_NE(html.find("\"name\":\"sleep\""), std::string::npos);
  EXPECT_NE(html.find("\"name\":\"wake\""), std::string::npos);
}

TEST(replay_timeline, a_woken_tag_keeps_its_addresses) {
  // The peak's allocations list addresses: before the sleep (the trace above) and after the wake
  // (one more block after it moves the peak there), the tag's blocks are at the same ones.
  trace_builder before = sleeping_trace();
  trace_builder after = sleeping_trace();
  after.alloc(0x4000, 8 << 20);
  const auto addresses = [](const trace_builder& t) {
    const std::vector<trace_event> events = parse_trace(t.text());
    const json d = timeline_data(prepare(events, "t"), &events, sim_expandable());
    std::map<std::size_t, std::uintptr_t> by_line;
    for (const json& a : d["peak"]["allocations"]) by_line[a["line"]] = a["address"];
    return std::make_pair(d["peak"]["event"].get<std::size_t>(), by_line);
  };
  const auto [peak_before, at_before] = addresses(before);
  const auto [peak_after, at_after] = addresses(after);
  EXPECT_EQ(peak_before, 2u);
  EXPECT_EQ(peak_after, 5u);
  ASSERT_EQ(at_before.size(), 3u);
  ASSERT_EQ(at_after.size(), 4u);
  for (const std::size_t line : {2u, 3u, 4u}) EXPECT_EQ(at_after.at(line), at_before.at(line));
}

TEST(replay_timeline, a_wake_without_room_is_refused_and_the_replay_goes_on) {
  // Under a 10 MiB capacity: the tag sleeps (8 MiB reserved -> 2), an 8 MiB block takes the room,
  // and the wake, needing the tag's 6 MiB again, is refused; the tag stays asleep and its frees
  // make no call. With room the same trace fits.
  trace_builder u{1, "00:00:02"};
  u.alloc(0x1000, 1 << 20)
      .alloc_tagged(0x2000, 4 << 20, "train")
      .alloc_tagged(0x3000, 1000, "train")
      .sleep("train", 6 << 20)
      .alloc(0x4000, 8 << 20)
      .wake("train", 6 << 20)
      .free(0x2000, 4 << 20)
      .free(0x3000, 1000)
      .free(0x4000, 8 << 20);
  const prepared_trace trace = prepare(parse_trace(u.text()), "tight");
  options o = sim_expandable();
  o.capacity_bytes = std::size_t{10} << 20;
  const trace_result r = replay_trace(trace, o);
  EXPECT_EQ(r.figures.failed_wakes, 1u);
  EXPECT_EQ(r.figures.wakes, 0u);
  EXPECT_EQ(r.figures.sleeps, 1u);
  EXPECT_EQ(r.figures.oom_count, 0u);
  EXPECT_EQ(r.fits, false);
  const json d = timeline_data(trace, nullptr, o);
  ASSERT_NE(mark(d, "out of memory"), nullptr);
  EXPECT_EQ((*mark(d, "out of memory"))["buckets"], json::array({5}));
  EXPECT_EQ(mark(d, "wake"), nullptr);
  EXPECT_EQ(values(series(d, "all", "sleeping"), "max").back(), 6 * k_mib);
  o.capacity_bytes = std::size_t{16} << 20;
  const trace_result roomy = replay_trace(trace, o);
  EXPECT_EQ(roomy.figures.failed_wakes, 0u);
  EXPECT_EQ(roomy.figures.wakes, 1u);
  EXPECT_EQ(roomy.fits, true);
}

TEST(replay_timeline, sleep_in_default_mode_names_the_first_sleep_row) {
  const std::vector<trace_event> events = parse_trace(sleeping_trace().text());
  const prepared_trace trace = prepare(events, "sleepy");
  using replay_fn = void (*)(const prepared_trace&);
  const replay_fn timeline = [](const prepared_trace& t) { (void)timeline_data(t, nullptr, sim()); };
  const replay_fn replay = [](const prepared_trace& t) { (void)replay_trace(t, sim()); };
  for (const replay_fn attempt : {timeline, replay}) {
    try {
      attempt(trace);
      ADD_FAILURE() << "no exception";
    } catch (const invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("sleepy:5: the trace sleeps tag 'train', and sleep "
                                           "needs expandable segments"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(replay_timeline, page_is_self_contained) {
  trace_builder t{7, "00:00:01"};
  t.alloc(0x1000, 4096).free(0x1000, 4096);
  json d = timeline_data(prepare(parse_trace(t.text()), "a</script>b"), nullptr, sim());
  const std::string html = timeline_html(d);
  EXPECT_EQ(html.find("http://"), std::string::npos);
  EXPECT_EQ(html.find("https://"), std::string::npos);
  EXPECT_EQ(html.find("<script src"), std::string::npos);
  EXPECT_EQ(html.find("<link"), std::string::npos);
  EXPECT_EQ(html.find("@CUCACHE_"), std::string::npos);  // every placeholder filled
  // The trace's name cannot close the data's <script> element early.
  EXPECT_EQ(html.find("a</script>b"), std::string::npos);
  EXPECT_NE(html.find("a<\\/script>b"), std::string::npos);
  EXPECT_NE(html.find("id=\"peak-reserved\""), std::string::npos);
}

TEST(replay_timeline, cli_writes_the_page) {
  temp_dir dir("cucache_timeline_cli");
  const fs::path out = dir.path() / "page.html";
  const cli_run r = run({"--backend", "sim", "--json", "--timeline", out.string(), k_resnet.string()});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("wrote the timeline of resnet50_train to " + out.string()),
            std::string::npos);
  EXPECT_EQ(r.err.find('\r'), std::string::npos);  // no progress line: stderr is no terminal
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"page.html"});  // no temporary left
  std::ifstream in(out);
  const std::string html((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto peak = nlohmann::json::parse(r.out)["peak_reserved_bytes"].get<std::size_t>();
  EXPECT_NE(html.find("\"reserved_bytes\":" + std::to_string(peak) + ","), std::string::npos);
}

TEST(replay_timeline, bad_inputs_name_the_file_and_leave_nothing) {
  temp_dir dir("cucache_timeline_bad");
  // An output in a folder that does not exist: refused before the replay.
  const fs::path nowhere = dir.path() / "no_such_dir" / "page.html";
  cli_run r = run({"--backend", "sim", "--timeline", nowhere.string(), k_resnet.string()});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("--timeline " + nowhere.string() + ": cannot write"), std::string::npos)
      << r.err;
  EXPECT_EQ(r.out, "");
  // An output that is a folder.
  r = run({"--backend", "sim", "--timeline", dir.path().string(), k_resnet.string()});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("--timeline " + dir.path().string() + ": not a file name"),
            std::string::npos)
      << r.err;
  // A malformed trace: the error names it, and a page already there is left as it was.
  const fs::path bad = dir.path() / "bad.csv";
  std::ofstream(bad) << k_trace_header << "\n1,00:00:01.0,allocate,0x1000,12x,0\n";
  const fs::path out = dir.path() / "page.html";
  std::ofstream(out) << "old";
  r = run({"--backend", "sim", "--timeline", out.string(), bad.string()});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find(bad.filename().string() + ":2:"), std::string::npos) << r.err;
  std::ifstream in(out);
  std::string kept;
  std::getline(in, kept);
  EXPECT_EQ(kept, "old");
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"bad.csv", "page.html"}));
  // A missing trace.
  r = run({"--backend", "sim", "--timeline", out.string(), (dir.path() / "none.csv").string()});
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.err.find("none.csv"), std::string::npos) << r.err;
  // One page, one trace.
  r = run({"--backend", "sim", "--timeline", out.string(), k_resnet.string(), k_resnet.string()});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("give exactly one trace (got 2)"), std::string::npos) << r.err;
  // --timeline and --fit do not go together.
  r = run({"--backend", "sim", "--fit", "--timeline", out.string(), k_resnet.string()});
  EXPECT_NE(r.status, 0);
  // The writer itself: an unwritable place throws naming the file and leaves no temporary.
  EXPECT_THROW(write_file_atomically(nowhere, "x"), invalid_argument);
  try {
    write_file_atomically(nowhere, "x");
  } catch (const invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(nowhere.string()), std::string::npos) << e.what();
  }
  EXPECT_EQ(dir.entries(), (std::vector<std::string>{"bad.csv", "page.html"}));
}

TEST(replay_timeline, from_a_trace_recorded_from_a_live_allocator) {
  // What CUCACHE_CONF=trace:PATH writes (the trace observer over a live allocator) is the format
  // the timeline reads: record a program's allocations, then draw them.
  temp_dir dir("cucache_timeline_live");
  const fs::path csv = dir.path() / "live.csv";
  {
    auto recorder = std::make_shared<trace_recorder>(csv);
    device_allocator a(make_backend(backend_kind::sim, 0, sim_options{}), config{},
                       make_trace_observer(recorder));
    auto* s1 = reinterpret_cast<stream_handle>(std::uintptr_t{0x30});
    void* x = a.allocate(3 * std::size_t{1} << 20);
    void* y = a.allocate(1000, s1);
    a.deallocate(x);
    void* z = a.allocate(600);
    a.deallocate(y);
    a.deallocate(z);
    recorder->flush();
  }
  const fs::path out = dir.path() / "live.html";
  const cli_run r = run({"--backend", "sim", "--json", "--timeline", out.string(), csv.string()});
  ASSERT_EQ(r.status, 0) << r.err;
  const std::vector<trace_event> events = read_trace(csv);
  ASSERT_EQ(events.size(), 6u);
  const json d = timeline_data(prepare(events, "live"), &events, sim());
  // 20 MiB for the 3 MiB request, one 2 MiB small segment per stream.
  EXPECT_EQ(d["peak"]["reserved_bytes"], 24 * k_mib);
  EXPECT_EQ(nlohmann::json::parse(r.out)["peak_reserved_bytes"], 24 * k_mib);
  EXPECT_EQ(d["streams"], json::array({"0x0", "0x30"}));
  EXPECT_TRUE(fs::exists(out));
}

TEST(replay_timeline, a_recorded_sleep_and_wake_replay_to_the_programs_figures) {
  // A program on the simulated device (CUCACHE_CONF=trace:PATH, expandable segments) allocates
  // under a sleepable tag and untagged, sleeps the tag (keeping contents), wakes it and frees:
  // the recorded trace names the tag and the sleep and wake, and replays to the program's peak
  // reserved and sleeping bytes.
  temp_dir dir("cucache_timeline_sleep_roundtrip");
  const fs::path csv = dir.path() / "sleepy.csv";
  ::setenv("CUCACHE_BACKEND", "sim", 1);
  ::setenv("CUCACHE_CONF", ("expandable_segments:True,trace:" + csv.string()).c_str(), 1);
  detail::reset_for_testing();
  std::size_t program_peak = 0, program_sleeping = 0;
  {
    make_sleepable("infer");
    void* untagged = cucache::malloc(3 << 20);
    push_tag("infer");
    void* weights = cucache::malloc(40 << 20);
    void* cache = cucache::malloc(4096);
    pop_tag();
    sleep(0, "infer", /*keep_contents=*/true);
    program_sleeping = get(0).stats().sleeping_bytes;
    void* other = cucache::malloc(20 << 20);  // uses the room the sleep gave back
    wake(0, "infer");
    cucache::free(weights);
    cucache::free(cache);
    cucache::free(other);
    cucache::free(untagged);
    program_peak = static_cast<std::size_t>(get(0).stats().reserved_bytes[0].peak);
    flush_trace();
  }
  detail::reset_for_testing();
  ::setenv("CUCACHE_CONF", "", 1);
  detail::reset_for_testing();
  ASSERT_GT(program_sleeping, 0u);

  std::ifstream in(csv);
  std::string header;
  std::getline(in, header);
  EXPECT_EQ(header, "Thread,Time,Action,Pointer,Size,Stream,Tag");
  const std::vector<trace_event> events = read_trace(csv);
  ASSERT_EQ(events.size(), 10u);
  EXPECT_EQ(trace_tag_name(events[1].tag), "infer");
  EXPECT_EQ(trace_tag_name(events[2].tag), "infer");
  EXPECT_EQ(events[0].tag, 0u);
  EXPECT_EQ(events[3].act, trace_event::action::sleep);
  EXPECT_TRUE(events[3].keep_contents);
  EXPECT_EQ(events[3].size, program_sleeping);
  EXPECT_EQ(events[5].act, trace_event::action::wake);
  EXPECT_EQ(events[5].size, program_sleeping);

  const prepared_trace trace = prepare(events, "sleepy");
  const trace_result r = replay_trace(trace, sim_expandable());
  EXPECT_EQ(r.figures.peak_reserved_bytes, program_peak);
  EXPECT_EQ(r.figures.peak_sleeping_bytes, program_sleeping);
  EXPECT_EQ(r.figures.sleeps, 1u);
  EXPECT_EQ(r.figures.wakes, 1u);
  const json d = timeline_data(trace, &events, sim_expandable());
  EXPECT_EQ(d["peak"]["reserved_bytes"], program_peak);
  EXPECT_EQ(d["totals"]["peak_sleeping_bytes"], program_sleeping);
  // The command line too: the JSON report carries the figures.
  const fs::path out = dir.path() / "sleepy.html";
  const cli_run c = run({"--backend", "sim", "--config", "expandable_segments:True", "--json",
                         "--timeline", out.string(), csv.string()});
  ASSERT_EQ(c.status, 0) << c.err;
  const json j = json::parse(c.out);
  EXPECT_EQ(j["peak_reserved_bytes"], program_peak);
  EXPECT_EQ(j["peak_sleeping_bytes"], program_sleeping);
  EXPECT_EQ(j["sleeps"], 1);
  EXPECT_EQ(j["wakes"], 1);
  // In default mode the replay refuses it, naming the sleep row (line 5: header, three allocates).
  const cli_run dflt = run({"--backend", "sim", "--json", csv.string()});
  EXPECT_EQ(dflt.status, 1);
  EXPECT_NE(dflt.err.find("sleepy:5: the trace sleeps tag 'infer'"), std::string::npos) << dflt.err;
}

TEST(replay_progress, off_unless_stderr_is_the_terminal) {
  std::ostringstream err;
  EXPECT_EQ(progress::for_terminal(err), nullptr);  // not std::cerr
}

TEST(replay_progress, the_line_is_erased_at_the_end) {
  // Whether the thread drew before being stopped depends on timing; either way nothing is left
  // on the line afterwards.
  std::ostringstream err;
  {
    progress p(err, std::chrono::milliseconds(0));
    p.phase("trace: run 1/1");
  }
  const std::string s = err.str();
  if (!s.empty()) {
    EXPECT_EQ(s.rfind("\r\033[K", 0), 0u) << s;
    EXPECT_NE(s.find("cucache-replay: trace: run 1/1 ("), std::string::npos) << s;
    EXPECT_TRUE(s.ends_with("\r\033[K")) << s;
  }
  std::ostringstream quiet;
  { progress p(quiet, std::chrono::hours(1)); }
  EXPECT_EQ(quiet.str(), "");  // stopped within its delay: never shown
}

}  // namespace
}  // namespace cucache::replay
