// Tests of the cucache-replay engine on the simulated device: exact figures of a hand-made trace
// worked out from the size rules, the bundled resnet50 trace's counts and peaks, determinism,
// capacity limits, and the command line's JSON Lines output, its legend, where its settings come
// from (--config, CUCACHE_CONF) and how it labels the H200 reference figures.
#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "cucache/cuda_backend.hpp"
#include "cucache/errors.hpp"
#include "cucache/stats.hpp"
#include "cucache/trace.hpp"
#include "replay_engine.hpp"
#include "tools/replay_test_support.hpp"

namespace cucache::replay {
namespace {

using test::cli_run;
using test::json_lines;
using test::run;
using test::trace_builder;

constexpr std::size_t k_mib = std::size_t{1} << 20;
const std::filesystem::path k_resnet =
    std::filesystem::path(CUCACHE_SOURCE_DIR) / "traces" / "resnet50_train.csv.gz";

class temp_file {
 public:
  explicit temp_file(const std::string& stem, const std::string& text)
      : path_(std::filesystem::temp_directory_path() /
              (stem + "." + std::to_string(::getpid()) + ".csv")) {
    std::ofstream(path_, std::ios::binary) << text;
  }
  ~temp_file() { std::filesystem::remove(path_); }
  temp_file(const temp_file&) = delete;
  temp_file& operator=(const temp_file&) = delete;
  [[nodiscard]] const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

options sim_options_for_tests() {
  options o;
  o.backend = backend_kind::sim;
  return o;
}

// Every step's expectation follows PyTorch's rules, which cucache shares: requests up to 1 MiB
// come from 2 MiB small segments; a large request under 10 MiB gets a 20 MiB segment; a larger one
// a segment of its own size rounded up to 2 MiB; a large block splits only when more than 1 MiB
// would remain; best fit decides which free block serves.
std::string hand_made_trace() {
  trace_builder t;
  t.alloc(0x1000, 1000);            // small segment 1 (2 MiB): reserved 2 MiB
  t.alloc(0x2000, 800 * 1024);      // fits in segment 1
  t.alloc(0x3000, 800 * 1024);      // fits in segment 1 (448 KiB left)
  t.alloc(0x4000, 800 * 1024);      // small segment 2: reserved 4 MiB
  t.alloc(0x5000, 5 * k_mib);       // 20 MiB segment, split: 15 MiB left; reserved 24 MiB
  t.alloc(0x6000, 16 * k_mib + 1);  // rounds to 16 MiB + 512: own 18 MiB segment; reserved 42 MiB
  t.alloc(0x7000, 8 * k_mib);       // best fit: the 15 MiB remainder; reserved stays 42 MiB
  t.free(0x6000, 16 * k_mib + 1);   // the 18 MiB segment is whole and free again
  t.alloc(0x8000, 17 * k_mib);      // takes the 18 MiB block unsplit (exactly 1 MiB would remain)
  for (std::uintptr_t p : {0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x7000, 0x8000}) {
    t.free(p, 0);  // a free's size is not checked against its allocation's
  }
  t.alloc(0x9000, 30 * k_mib);  // nothing cached holds 30 MiB: new segment; reserved 72 MiB
  t.free(0x9000, 30 * k_mib);
  t.alloc(0xa000, 600 * 1024);  // reuses a cached small segment
  return t.text();
}

TEST(replay_engine, hand_made_trace_has_exact_figures) {
  const prepared_trace trace = prepare(parse_trace(hand_made_trace()), "hand_made");
  EXPECT_EQ(trace.summary.allocations, 10u);
  EXPECT_EQ(trace.summary.frees, 9u);
  EXPECT_EQ(trace.timed_events, 19u);
  // Live at the high point (after the 17 MiB allocation): everything but the freed 16 MiB + 1.
  const std::size_t expected_requested = 1000 + 3 * 800 * 1024 + 5 * k_mib + 8 * k_mib + 17 * k_mib;
  EXPECT_EQ(trace.summary.peak_requested_bytes, expected_requested);

  const trace_result r = replay_trace(trace, sim_options_for_tests());
  EXPECT_EQ(r.peak_requested_bytes, expected_requested);
  EXPECT_EQ(r.figures.peak_requested_bytes, expected_requested);
  EXPECT_EQ(r.figures.peak_reserved_bytes, 72 * k_mib);
  EXPECT_EQ(r.figures.device_alloc_calls, 5u);
  EXPECT_EQ(r.figures.device_free_calls, 0u);
  EXPECT_EQ(r.figures.oom_count, 0u);
  EXPECT_FALSE(r.fits.has_value());
  // At the reserved peak only the 30 MiB block is allocated; the largest free block is the whole
  // 20 MiB segment.
  EXPECT_EQ(r.fragmentation_at_peak.reserved_bytes, 72 * k_mib);
  EXPECT_EQ(r.fragmentation_at_peak.allocated_bytes, 30 * k_mib);
  EXPECT_EQ(r.fragmentation_at_peak.free_bytes, 42 * k_mib);
  EXPECT_EQ(r.fragmentation_at_peak.largest_free_block, 20 * k_mib);
  EXPECT_DOUBLE_EQ(r.fragmentation_at_peak.overhead, 1.0 - 30.0 / 72.0);
  EXPECT_DOUBLE_EQ(r.fragmentation_at_peak.external, 1.0 - 20.0 / 42.0);
}

TEST(replay_engine, max_split_size_keeps_large_blocks_whole) {
  // With a 20 MiB cap a shared 20 MiB segment would itself be oversize, so a 5 MiB request gets a
  // segment of its own size rounded to 2 MiB (6 MiB), whose 1 MiB remainder is too small to split
  // off: the second request needs another segment.
  trace_builder t;
  t.alloc(0x1000, 5 * k_mib).alloc(0x2000, 5 * k_mib);
  options o = sim_options_for_tests();
  o.cfg = parse_config("max_split_size_mb:20");
  const trace_result r = replay_trace(prepare(parse_trace(t.text()), "split"), o);
  EXPECT_EQ(r.figures.device_alloc_calls, 2u);
  EXPECT_EQ(r.figures.peak_reserved_bytes, 12 * k_mib);
  EXPECT_EQ(r.config, "max_split_size_mb:20");
}

TEST(replay_engine, frees_match_the_latest_allocation_of_a_reused_pointer) {
  trace_builder t;
  t.alloc(0x1000, 4096).free(0x1000, 4096).alloc(0x1000, 8192).free(0x1000, 8192);
  const prepared_trace trace = prepare(parse_trace(t.text()), "reuse");
  ASSERT_EQ(trace.ops.size(), 4u);
  EXPECT_EQ(trace.ops[1].kind, op_kind::free);
  EXPECT_EQ(trace.ops[1].slot, 0u);
  EXPECT_EQ(trace.ops[3].slot, 2u);
  const trace_result r = replay_trace(trace, sim_options_for_tests());
  EXPECT_EQ(r.figures.peak_requested_bytes, 8192u);
  EXPECT_EQ(r.figures.peak_reserved_bytes, 2 * k_mib);
}

TEST(replay_engine, streams_and_skipped_rows) {
  trace_builder t;
  t.alloc(0x1000, 4096, 0x10).alloc(0x2000, 4096, 0x20).free(0x1000, 4096, 0x20);
  std::string text = t.text() + "1,00:00:01.000000,allocate failure,(nil),1024,0x10\n";
  const prepared_trace trace = prepare(parse_trace(text), "streams");
  EXPECT_EQ(trace.stream_ids.size(), 2u);
  EXPECT_EQ(trace.ops[2].kind, op_kind::free_on_other_stream);
  EXPECT_EQ(trace.skipped_failures, 1u);
  EXPECT_EQ(trace.timed_events, 3u);
  const trace_result r = replay_trace(trace, sim_options_for_tests());
  // One small segment per stream: each stream has its own pool.
  EXPECT_EQ(r.figures.peak_reserved_bytes, 4 * k_mib);
  EXPECT_EQ(r.streams, 2u);
  EXPECT_EQ(r.skipped_failures, 1u);
}

TEST(replay_engine, resnet50_counts_and_peaks) {
  const prepared_trace trace = load_trace(k_resnet);
  EXPECT_EQ(trace.name, "resnet50_train");
  options o = sim_options_for_tests();
  o.repeat = 2;  // the engine itself checks that both runs agree
  const trace_result r = replay_trace(trace, o);
  EXPECT_EQ(r.events, 13683u);
  EXPECT_EQ(r.allocations, 6843u);
  EXPECT_EQ(r.frees, 6840u);
  EXPECT_EQ(r.peak_requested_bytes, 3192592912u);
  EXPECT_EQ(r.figures.peak_requested_bytes, 3192592912u);
  EXPECT_GE(r.figures.peak_reserved_bytes, r.peak_requested_bytes);
  EXPECT_GE(r.reserved_over_requested, 1.0);
  EXPECT_EQ(r.figures.oom_count, 0u);
  EXPECT_EQ(r.host_ns_per_op_runs.size(), 2u);
  EXPECT_GT(r.host_ns_per_op, 0.0);
  EXPECT_GT(r.figures.device_alloc_calls, 0u);
}

TEST(replay_engine, simulated_figures_are_identical_run_to_run) {
  const prepared_trace trace = load_trace(k_resnet);
  const trace_result a = replay_trace(trace, sim_options_for_tests());
  const trace_result b = replay_trace(trace, sim_options_for_tests());
  EXPECT_EQ(a.figures, b.figures);
  EXPECT_EQ(a.fragmentation_at_peak.reserved_bytes, b.fragmentation_at_peak.reserved_bytes);
  EXPECT_EQ(a.fragmentation_at_peak.allocated_bytes, b.fragmentation_at_peak.allocated_bytes);
  EXPECT_EQ(a.fragmentation_at_peak.largest_free_block, b.fragmentation_at_peak.largest_free_block);
  EXPECT_EQ(to_json(a)["peak_reserved_bytes"], to_json(b)["peak_reserved_bytes"]);
}

TEST(replay_cli, json_lines_have_every_key) {
  const cli_run r =
      run({"--backend", "sim", "--json", "--repeat", "2", k_resnet.string(), k_resnet.string()});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto lines = json_lines(r.out);
  ASSERT_EQ(lines.size(), 2u);  // one per trace, nothing else on stdout
  for (const auto& j : lines) {
    for (const char* key :
         {"trace", "backend", "config", "events", "allocations", "peak_requested_bytes",
          "peak_reserved_bytes", "reserved_over_requested", "device_alloc_calls",
          "device_free_calls", "host_ns_per_op", "fragmentation_at_peak", "oom_count", "peers"}) {
      EXPECT_TRUE(j.contains(key)) << key;
    }
    EXPECT_TRUE(j["fragmentation_at_peak"].contains("external"));
    EXPECT_TRUE(j["fragmentation_at_peak"].contains("overhead"));
    EXPECT_FALSE(j.contains("fits"));  // only with --capacity-gib
    EXPECT_EQ(j["trace"], "resnet50_train");
    EXPECT_EQ(j["backend"], "sim");
    EXPECT_EQ(j["events"], 13683);
    EXPECT_EQ(j["allocations"], 6843);
    EXPECT_EQ(j["peak_requested_bytes"], 3192592912u);
    EXPECT_TRUE(j["peers"].empty());
  }
  EXPECT_EQ(lines[0]["peak_reserved_bytes"], lines[1]["peak_reserved_bytes"]);
  EXPECT_EQ(lines[0]["device_alloc_calls"], lines[1]["device_alloc_calls"]);
}

// --warm: the second pass of each run replays the bundled trace through the cache the first pass
// filled. Exact figures only (no timing): the first pass's are those of a plain run, and the
// second makes no device call at all -- every block it needs is cached -- in both modes.
struct warm_case {
  const char* config;
  std::uint64_t cold_device_allocs;
  std::uint64_t cold_peak_reserved;
};

class replay_warm : public ::testing::TestWithParam<warm_case> {};

TEST_P(replay_warm, second_pass_makes_no_device_call) {
  const warm_case c = GetParam();
  std::vector<std::string> args{"--backend", "sim", "--json", "--warm", "--repeat", "2"};
  if (*c.config != '\0') {
    args.emplace_back("--config");
    args.emplace_back(c.config);
  }
  args.push_back(k_resnet.string());
  const cli_run r = run(args);
  ASSERT_EQ(r.status, 0) << r.err;
  const auto lines = json_lines(r.out);
  ASSERT_EQ(lines.size(), 1u);
  const auto& j = lines[0];
  EXPECT_TRUE(j.contains("host_ns_per_op"));
  EXPECT_EQ(j["device_alloc_calls"], c.cold_device_allocs);
  EXPECT_EQ(j["peak_reserved_bytes"], c.cold_peak_reserved);
  ASSERT_TRUE(j.contains("warm")) << j.dump();
  const auto& w = j["warm"];
  for (const char* key : {"host_ns_per_op", "host_ns_per_op_runs", "device_alloc_calls",
                          "device_free_calls", "vm_calls", "oom_count", "peak_reserved_bytes"}) {
    EXPECT_TRUE(w.contains(key)) << key;
  }
  EXPECT_EQ(w["host_ns_per_op_runs"].size(), 2u);
  EXPECT_EQ(w["device_alloc_calls"], 0u);
  EXPECT_EQ(w["device_free_calls"], 0u);
  for (const char* kind : {"create", "release", "map", "unmap", "set_access", "total"}) {
    EXPECT_EQ(w["vm_calls"][kind], 0u) << kind;
  }
  EXPECT_EQ(w["device_synchronizations"], 0u);
  EXPECT_EQ(w["device_calls"]["device_synchronize"], 0u);
  EXPECT_EQ(w["device_calls"]["mem_get_info"], 0u);
  EXPECT_EQ(w["vm_model_us"]["total"], 0.0);
  EXPECT_EQ(w["oom_count"], 0u);
  EXPECT_EQ(w["peak_reserved_bytes"], c.cold_peak_reserved);  // the cache did not grow
  // The text table prints VM calls per 1,000 events for each pass.
  args.erase(args.begin() + 2);  // --json
  const cli_run text = run(args);
  ASSERT_EQ(text.status, 0) << text.err;
  EXPECT_NE(text.out.find("vm/1k ev"), std::string::npos) << text.out;
}

// Expandable segments in a steady loop (issue 20): the traces whose warm pass made the most VM
// calls before (gpt2_train_ckpt 423 per 1,000 events, bert_serve 197) make none now, and no device
// synchronization: every page the second pass touches is still mapped where the first left it.
TEST(replay_cli, expandable_warm_pass_makes_no_vm_call_on_the_worst_traces) {
  for (const char* name : {"gpt2_train_ckpt", "bert_serve"}) {
    SCOPED_TRACE(name);
    const std::filesystem::path trace = k_resnet.parent_path() / (std::string(name) + ".csv.gz");
    const cli_run r = run({"--backend", "sim", "--json", "--warm", "--config",
                           "expandable_segments:True", trace.string()});
    ASSERT_EQ(r.status, 0) << r.err;
    const auto lines = json_lines(r.out);
    ASSERT_EQ(lines.size(), 1u);
    const auto& j = lines[0];
    EXPECT_GT(j["vm_calls"]["total"], 0u);  // the cold pass maps what it touches
    EXPECT_EQ(j["warm"]["vm_calls"]["total"], 0u);
    EXPECT_EQ(j["warm"]["device_synchronizations"], 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(modes, replay_warm,
                         ::testing::Values(warm_case{"", 117, 3592421376u},
                                           warm_case{"expandable_segments:True", 399,
                                                     3214934016u},
                                           warm_case{"expandable_segments:True,coarse_handles:0",
                                                     1533, 3214934016u}));

TEST(replay_cli, without_warm_there_is_no_warm_object) {
  const cli_run r = run({"--backend", "sim", "--json", k_resnet.string()});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto lines = json_lines(r.out);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_FALSE(lines[0].contains("warm"));
}

// The replay's statistics are the field table's (cucache/stats.hpp), and its shorthand keys agree
// with them, in both modes.
TEST(replay_cli, json_stats_come_from_the_field_table) {
  for (const char* conf : {"", "expandable_segments:True"}) {
    SCOPED_TRACE(conf);
    std::vector<std::string> args = {"--backend", "sim", "--json", k_resnet.string()};
    if (*conf != '\0') args.insert(args.begin(), {"--config", conf});
    const cli_run r = run(args);
    ASSERT_EQ(r.status, 0) << r.err;
    const auto j = json_lines(r.out).at(0);
    for (const char* object : {"stats", "stats_at_reserved_peak"}) {
      ASSERT_EQ(j[object].size(), k_stat_field_count) << object;
      for (const stat_field& f : k_stat_fields) {
        ASSERT_TRUE(j[object].contains(std::string(f.name))) << object << "." << f.name;
      }
    }
    const auto& peak = j["stats_at_reserved_peak"];
    const auto& frag = j["fragmentation_at_peak"];
    EXPECT_EQ(frag["largest_free_block"], peak["largest_free_block"]);
    EXPECT_EQ(frag["free_bytes"], peak["free_bytes"]);
    EXPECT_EQ(frag["reserved_bytes"], peak["reserved_bytes"]["all"]["current"]);
    EXPECT_EQ(frag["external"], peak["external_fragmentation"]);
    EXPECT_EQ(j["peak_reserved_bytes"], j["stats"]["reserved_bytes"]["all"]["peak"]);
    EXPECT_EQ(j["device_alloc_calls"], j["stats"]["device_alloc_count"]);
    EXPECT_EQ(j["vm_calls"]["map"], j["stats"]["vm_map_count"]);
    EXPECT_EQ(j["vm_calls"]["create"], *conf != '\0' ? j["device_alloc_calls"] : nlohmann::json(0));
    // Issue 9: at the peak, expandable mode had free bytes and a largest free block of 0. Now the
    // figure is the largest request served there without cuMemCreate (free_space_test checks
    // that definition on this trace request by request).
    if (*conf != '\0') {
      EXPECT_EQ(frag["free_bytes"], 487603712u);
      EXPECT_EQ(frag["largest_free_block"], 395968512u);
    }
  }
}

TEST(replay_cli, capacity_decides_whether_the_trace_fits) {
  const cli_run small =
      run({"--backend", "sim", "--json", "--capacity-gib", "1", k_resnet.string()});
  ASSERT_EQ(small.status, 0) << small.err;
  const auto s = json_lines(small.out);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0]["fits"], false);
  EXPECT_GT(s[0]["oom_count"].get<std::uint64_t>(), 0u);
  EXPECT_LE(s[0]["peak_reserved_bytes"].get<std::uint64_t>(), std::uint64_t{1} << 30);
  EXPECT_EQ(s[0]["capacity_bytes"], std::uint64_t{1} << 30);

  const cli_run large =
      run({"--backend", "sim", "--json", "--capacity-gib", "8", k_resnet.string()});
  ASSERT_EQ(large.status, 0) << large.err;
  const auto l = json_lines(large.out);
  ASSERT_EQ(l.size(), 1u);
  EXPECT_EQ(l[0]["fits"], true);
  EXPECT_EQ(l[0]["oom_count"], 0);
}

TEST(replay_engine, a_failed_allocation_may_hold_the_reserved_peak) {
  // Expandable segments on an 8 MiB device: the 8 MiB request (4 pages) is refused. The pager
  // makes room for all the pages a block lacks before it creates any, so the refused call raises
  // nothing: the allocator's peak and the sample after successful allocations are both 4 MiB.
  // (Before, handles for some of its pages were created first: a 6 MiB peak inside the call.)
  trace_builder t;
  t.alloc(0x1000, 4 * k_mib).alloc(0x2000, 8 * k_mib);
  options o = sim_options_for_tests();
  o.cfg = parse_config("expandable_segments:True");
  o.capacity_bytes = 8 * k_mib;
  const trace_result r = replay_trace(prepare(parse_trace(t.text()), "oom_peak"), o);
  EXPECT_EQ(r.fits, false);
  EXPECT_EQ(r.figures.oom_count, 1u);
  EXPECT_EQ(r.figures.peak_reserved_bytes, 4 * k_mib);
  EXPECT_EQ(r.fragmentation_at_peak.reserved_bytes, 4 * k_mib);
}

// The replay wraps the device in counting and recording backends; both forward every call
// (forwarding_backend), so the IPC and peer-access keys reach the simulated device in every mode:
// before, ipc_handles:True failed with "cannot share memory between processes (code 801)" and
// peer_access was dropped. The figures are those of the same run without the keys (the sim's
// one device has no peers; exportable handles cost no memory).
TEST(replay_cli, ipc_handles_and_peer_access_reach_the_simulated_device) {
  const std::filesystem::path bert =
      std::filesystem::path(CUCACHE_SOURCE_DIR) / "traces" / "bert_serve.csv.gz";
  const auto peak_of = [&](const std::vector<std::string>& extra, const std::string& config) {
    std::vector<std::string> args{"--backend", "sim", "--json", "--config", config};
    args.insert(args.end(), extra.begin(), extra.end());
    args.push_back(bert.string());
    const cli_run r = run(args);
    EXPECT_EQ(r.status, 0) << config << ": " << r.err;
    EXPECT_EQ(r.err.find("code 801"), std::string::npos) << r.err;
    const auto lines = json_lines(r.out);
    return lines.size() == 1 ? lines[0]["peak_reserved_bytes"].get<std::uint64_t>() : 0;
  };
  const std::filesystem::path page = std::filesystem::temp_directory_path() /
                                     ("cucache_replay_ipc." + std::to_string(::getpid()) + ".html");
  const std::vector<std::vector<std::string>> modes = {
      {}, {"--warm"}, {"--timeline", page.string()}};
  for (const auto& mode : modes) {
    const std::uint64_t plain = peak_of(mode, "expandable_segments:True");
    ASSERT_GT(plain, 0u);
    for (const char* keys : {"ipc_handles:True", "peer_access:all", "peer_access:none",
                             "ipc_handles:True,peer_access:auto"}) {
      EXPECT_EQ(peak_of(mode, std::string("expandable_segments:True,") + keys), plain) << keys;
    }
    EXPECT_GT(peak_of(mode, "ipc_handles:True"), 0u);  // default mode: cudaMalloc'd segments
  }
  std::filesystem::remove(page);
}

TEST(replay_cli, table_by_default) {
  const cli_run r =
      run({"--backend", "sim", "--config", "max_split_size_mb:128", k_resnet.string()});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("resnet50_train"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("max_split_size_mb:128"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("resv/req"), std::string::npos) << r.out;
}

/// Sets (or, with nullptr, unsets) an environment variable for one scope; puts it back after.
class scoped_env {
 public:
  scoped_env(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value != nullptr) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~scoped_env() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(replay_cli, takes_cucache_conf_from_the_environment_unless_config_is_given) {
  {
    const scoped_env env("CUCACHE_CONF", nullptr);
    const cli_run r = run({"--backend", "sim", k_resnet.string()});
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("config: (defaults)"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("config from: the defaults (neither --config nor CUCACHE_CONF)"),
              std::string::npos)
        << r.out;
  }
  const scoped_env env("CUCACHE_CONF", "max_split_size_mb:128");
  const cli_run from_env = run({"--backend", "sim", k_resnet.string()});
  ASSERT_EQ(from_env.status, 0) << from_env.err;
  EXPECT_NE(from_env.out.find("config: max_split_size_mb:128"), std::string::npos) << from_env.out;
  EXPECT_NE(from_env.out.find("config from: CUCACHE_CONF=max_split_size_mb:128 in the environment"),
            std::string::npos)
      << from_env.out;
  EXPECT_NE(from_env.err.find("settings from the environment: CUCACHE_CONF=max_split_size_mb:128"),
            std::string::npos)
      << from_env.err;
  const cli_run json = run({"--backend", "sim", "--json", k_resnet.string()});
  ASSERT_EQ(json.status, 0) << json.err;
  EXPECT_EQ(json_lines(json.out).at(0)["config"], "max_split_size_mb:128");

  // --config wins, and stderr says what was set aside.
  const cli_run given =
      run({"--backend", "sim", "--config", "expandable_segments:True", k_resnet.string()});
  ASSERT_EQ(given.status, 0) << given.err;
  EXPECT_NE(given.out.find("config: expandable_segments:True"), std::string::npos) << given.out;
  EXPECT_EQ(given.out.find("config: max_split_size_mb"), std::string::npos) << given.out;
  EXPECT_EQ(given.out.find("CUCACHE_CONF=max_split_size_mb"), std::string::npos) << given.out;
  EXPECT_NE(given.out.find("config from: --config"), std::string::npos) << given.out;
  EXPECT_NE(given.err.find("CUCACHE_CONF=max_split_size_mb:128 in the environment is ignored"),
            std::string::npos)
      << given.err;

  // --fit takes it too.
  const cli_run fit =
      run({"--backend", "sim", "--fit", "--fit-resolution-mib", "64", k_resnet.string()});
  ASSERT_EQ(fit.status, 0) << fit.err;
  EXPECT_NE(fit.out.find("config: max_split_size_mb:128"), std::string::npos) << fit.out;

  // A bad value is an error naming the variable.
  const scoped_env bad("CUCACHE_CONF", "no_such_key:1");
  const cli_run r = run({"--backend", "sim", k_resnet.string()});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("CUCACHE_CONF"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("no_such_key"), std::string::npos) << r.err;
}

TEST(replay_cli, the_table_explains_its_abbreviations_and_keeps_h200_times_apart) {
  const scoped_env env("CUCACHE_CONF", nullptr);
  const cli_run r = run({"--backend", "sim", k_resnet.string()});
  ASSERT_EQ(r.status, 0) << r.err;
  for (const char* abbreviation :
       {"peak req", "peak resv", "resv/req", "dev alloc", "ns/op", "frag ext", "frag ovh"}) {
    // Each column heading has a line of its own in the legend: "  <name>  <meaning>".
    EXPECT_NE(r.out.find(fmt::format("\n  {:<10} ", abbreviation)), std::string::npos)
        << abbreviation << "\n"
        << r.out;
  }
  // traces/ has reference.json: PyTorch's memory ratios beside this run's, and the H200's host
  // times in a table of their own that says they do not compare with the simulated device's.
  const auto memory = r.out.find("peak reserved / peak requested: cucache in this run (sim)");
  const auto times = r.out.find("host ns per event recorded on the H200");
  ASSERT_NE(memory, std::string::npos) << r.out;
  ASSERT_NE(times, std::string::npos) << r.out;
  EXPECT_LT(memory, times);
  const std::string memory_part = r.out.substr(memory, times - memory);
  EXPECT_EQ(memory_part.find("ns/op"), std::string::npos) << r.out;
  EXPECT_EQ(memory_part.find("1292.8"), std::string::npos) << r.out;  // c10's ns on the H200
  EXPECT_NE(r.out.find("1292.8", times), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("not comparable with this run's ns/op", times), std::string::npos) << r.out;
}

TEST(replay_cli, falls_back_to_the_simulated_device_with_a_note) {
  if (cuda_available()) GTEST_SKIP() << "a GPU is usable here; the default is the cuda backend";
  const cli_run r = run({"--json", k_resnet.string()});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("no GPU: "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("; using the simulated device"), std::string::npos) << r.err;
  EXPECT_EQ(json_lines(r.out).at(0)["backend"], "sim");
}

TEST(replay_cli, rejects_what_it_cannot_do) {
  const cli_run peers_on_sim = run({"--backend", "sim", "--peers", "c10", k_resnet.string()});
  EXPECT_EQ(peers_on_sim.status, 1);
  EXPECT_NE(peers_on_sim.err.find("--peers: the peers run on a GPU only"), std::string::npos)
      << peers_on_sim.err;
  const cli_run bad_config =
      run({"--backend", "sim", "--config", "no_such_key:1", k_resnet.string()});
  EXPECT_EQ(bad_config.status, 1);
  EXPECT_NE(bad_config.err.find("no_such_key"), std::string::npos) << bad_config.err;
  EXPECT_NE(run({"--backend", "sim", "--repeat", "0", k_resnet.string()}).status, 0);
  EXPECT_NE(run({"--backend", "sim"}).status, 0);  // a trace is required
  const temp_file bad("replay_bad_trace", "not a trace\n");
  const cli_run r = run({"--backend", "sim", bad.path().string()});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("cucache-replay: error:"), std::string::npos) << r.err;
  // --peers none is always accepted.
  EXPECT_EQ(run({"--backend", "sim", "--peers", "none", k_resnet.string()}).status, 0);
}

TEST(replay_cli, a_file_that_is_not_a_trace_fails_at_once) {
  // /dev/zero never ends: the reader stops at its first line, 4096 bytes in.
  if (!std::filesystem::exists("/dev/zero")) GTEST_SKIP() << "no /dev/zero";
  const cli_run r = run({"--backend", "sim", "/dev/zero"});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("cucache-replay: error: /dev/zero:1: expected header"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("not an RMM-format CSV trace"), std::string::npos) << r.err;
}

TEST(replay_cli, bad_option_values_are_named_in_words) {
  // Each bad value gets one line that names the option, the value and what is wrong with it.
  const auto says = [](std::vector<std::string> args, const std::string& want) {
    args.insert(args.begin(), {"--backend", "sim"});
    args.push_back(k_resnet.string());
    const cli_run r = run(args);
    EXPECT_EQ(r.status, 1) << want;
    EXPECT_NE(r.err.find("cucache-replay: error: " + want), std::string::npos) << r.err;
    EXPECT_LT(r.err.size(), 200U) << "a one-line message, not " << r.err.size() << " bytes";
  };
  says({"--capacity-gib", "0"}, "--capacity-gib 0: must be a positive number of GiB");
  says({"--capacity-gib", "-3"}, "--capacity-gib -3: must be a positive number of GiB");
  says({"--capacity-gib", "1e-12"}, "--capacity-gib 1e-12: smaller than one byte");
  says({"--capacity-gib", "1e12"}, "--capacity-gib 1000000000000: too large (at most");
  says({"--fit", "--fit-resolution-mib", "1e12"},
       "--fit-resolution-mib 1000000000000: too large (at most");
  says({"--fit", "--fit-resolution-mib", "0"},
       "--fit-resolution-mib 0: must be a positive number of MiB");
  says({"--fit", "--fit-resolution-mib", "1e-9"},
       "--fit-resolution-mib 1e-09: smaller than one byte");
  // An unknown peer is named, with the valid ones, before where the peers may run is considered.
  says({"--peers", "bogus"},
       "--peers: unknown peer 'bogus' (valid: cudaMalloc, cudaMallocAsync, c10, or none alone)");
  says({"--peers", "c10,bogus"}, "--peers: unknown peer 'bogus'");
  says({"--peers", "none,c10"}, "--peers: unknown peer 'none'");
}

// --- --fit -----------------------------------------------------------------------------------

TEST(replay_fit, hand_made_trace_has_its_exact_minimum_capacity) {
  // Replayed under a limit, the trace needs what it holds just before the 30 MiB request: two
  // small segments (2 + 2 MiB), the 20 MiB segment and the 18 MiB one, 42 MiB. The 30 MiB request
  // itself then fits after the out-of-memory ladder releases the (by then wholly free) cache. At
  // 40 MiB the 16 MiB + 1 request finds no room and nothing to release.
  const prepared_trace trace = prepare(parse_trace(hand_made_trace()), "hand_made");
  const fit_result r = fit_trace(trace, sim_options_for_tests(), fit_options{});
  EXPECT_EQ(r.trace, "hand_made");
  EXPECT_EQ(r.backend, "sim");
  EXPECT_EQ(r.resolution_bytes, 2 * k_mib);
  EXPECT_EQ(r.peak_requested_bytes, trace.summary.peak_requested_bytes);
  EXPECT_EQ(r.cucache.min_capacity_bytes, 42 * k_mib);
  EXPECT_EQ(r.cucache.fails_at_bytes, 40 * k_mib);
  EXPECT_TRUE(r.cucache.fails_at_replayed);
  EXPECT_EQ(r.cucache.unconstrained_peak_reserved_bytes, 72 * k_mib);
  EXPECT_EQ(r.cucache.upper_bound_bytes, 72 * k_mib);
  EXPECT_EQ(r.cucache.upper_bound_raises, 0u);
  // 72 MiB passes; then 52, 42 pass and 36, 38, 40 fail (limits k * 2 MiB, k from 16 to 36).
  EXPECT_EQ(r.cucache.replays, 6u);
  EXPECT_TRUE(r.peers.empty());

  // A finer grid finds the same minimum, with a failing limit 1 MiB below it.
  fit_options fine;
  fine.resolution_bytes = k_mib;
  const fit_result f = fit_trace(trace, sim_options_for_tests(), fine);
  EXPECT_EQ(f.cucache.min_capacity_bytes, 42 * k_mib);
  EXPECT_EQ(f.cucache.fails_at_bytes, 41 * k_mib);

  // The limits found, replayed in full with --capacity-gib's mechanism.
  options at = sim_options_for_tests();
  at.capacity_bytes = 42 * k_mib;
  EXPECT_EQ(replay_trace(trace, at).fits, true);
  at.capacity_bytes = 42 * k_mib - 1;
  EXPECT_EQ(replay_trace(trace, at).fits, false);
}

TEST(replay_fit, a_trace_that_fits_in_its_requested_bytes_needs_no_more) {
  // One 20 MiB request: its own 20 MiB segment, exactly the peak requested; the lower bound (a
  // limit below the peak requested) fails without a replay.
  trace_builder t;
  t.alloc(0x1000, 20 * k_mib).free(0x1000, 20 * k_mib);
  const fit_result r =
      fit_trace(prepare(parse_trace(t.text()), "exact"), sim_options_for_tests(), fit_options{});
  EXPECT_EQ(r.cucache.min_capacity_bytes, 20 * k_mib);
  EXPECT_EQ(r.cucache.fails_at_bytes, 18 * k_mib);
  EXPECT_FALSE(r.cucache.fails_at_replayed);
  EXPECT_EQ(r.cucache.replays, 1u);
}

TEST(replay_fit, rejects_what_it_cannot_do) {
  const prepared_trace trace = prepare(parse_trace(hand_made_trace()), "hand_made");
  fit_options zero;
  zero.resolution_bytes = 0;
  EXPECT_THROW((void)fit_trace(trace, sim_options_for_tests(), zero), invalid_argument);
  options capped = sim_options_for_tests();
  capped.capacity_bytes = std::size_t{1} << 30;
  EXPECT_THROW((void)fit_trace(trace, capped, fit_options{}), invalid_argument);
  options limited = sim_options_for_tests();
  limited.cfg = parse_config("memory_limit:1GiB");
  EXPECT_THROW((void)fit_trace(trace, limited, fit_options{}), invalid_argument);
  const prepared_trace empty = prepare(parse_trace(std::string(k_trace_header) + "\n"), "empty");
  EXPECT_THROW((void)fit_trace(empty, sim_options_for_tests(), fit_options{}), invalid_argument);

  const auto fails_naming = [](std::vector<std::string> args, const std::string& flag) {
    args.insert(args.begin(), {"--backend", "sim"});
    args.push_back(k_resnet.string());
    const cli_run r = run(args);
    EXPECT_NE(r.status, 0) << flag;
    EXPECT_NE((r.err + r.out).find(flag), std::string::npos) << r.err << r.out;
  };
  fails_naming({"--fit", "--fit-resolution-mib", "0"}, "--fit-resolution-mib");
  fails_naming({"--fit", "--fit-resolution-mib", "-2"}, "--fit-resolution-mib");
  fails_naming({"--fit-resolution-mib", "2"}, "--fit-resolution-mib requires --fit");
  fails_naming({"--fit", "--capacity-gib", "4"}, "--capacity-gib excludes --fit");
  fails_naming({"--fit", "--repeat", "3"}, "--repeat excludes --fit");
  fails_naming({"--fit", "--config", "memory_limit:4GiB"}, "--fit: sets the limit itself");
}

TEST(replay_fit, table_names_the_resolution) {
  const cli_run r =
      run({"--backend", "sim", "--fit", "--fit-resolution-mib", "64", k_resnet.string()});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("resolution 64 MiB"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("min capacity"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("resnet50_train"), std::string::npos) << r.out;
}

TEST(replay_fit, says_what_each_figure_is) {
  const cli_run r = run({"--backend", "sim", "--fit", "--fit-resolution-mib", "64", "--config",
                         "expandable_segments:True", k_resnet.string()});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("\n  min capacity   the smallest memory limit"), std::string::npos) << r.out;
  // traces/min_capacity.json: this run's figure beside PyTorch's and cudaMallocAsync's on the
  // H200, each column saying where it comes from; the file's own cucache figure for resnet50_train
  // (1.0041, an older build's) is not shown as if it were current.
  EXPECT_NE(r.out.find("minimum capacity / peak requested: cucache in this run (sim, config "
                       "expandable_segments:True) beside PyTorch 2.11 and cudaMallocAsync "
                       "recorded on an H200"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("(this run)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("cucache exp."), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("1.0041"), std::string::npos)
      << r.out;  // min_capacity.json's cucache figure
  EXPECT_NE(r.out.find("1.0064"), std::string::npos) << r.out;  // PyTorch expandable on the H200
}

/// Runs the cucache-replay binary; its stdout.
std::string run_binary(const std::string& args, int& status) {
  const std::string command = std::string(CUCACHE_REPLAY_BIN) + " " + args + " 2>/dev/null";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) {
    status = -1;
    return {};
  }
  std::string out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, pipe)) > 0;) out.append(buf, n);
  status = ::pclose(pipe);
  return out;
}

/// --capacity-gib for exactly `bytes`: the shortest decimal that reads back as the same double
/// (bytes / 2^30 is exact for any multiple of 512 B below 2^62).
std::string gib_arg(std::uint64_t bytes) {
  return fmt::format("{}", static_cast<double>(bytes) / static_cast<double>(1ULL << 30));
}

class replay_fit_binary : public ::testing::TestWithParam<std::string> {};

// cucache-replay --fit on the bundled trace, checked against the binary itself: the minimum found
// passes a full replay under --capacity-gib, one resolution below it does not.
TEST_P(replay_fit_binary, resnet50_minimum_capacity_holds) {
  const std::string config = GetParam().empty() ? "" : " --config " + GetParam();
  int status = 0;
  const std::string out =
      run_binary("--backend sim --fit --json" + config + " " + k_resnet.string(), status);
  ASSERT_EQ(status, 0) << out;
  const auto lines = json_lines(out);
  ASSERT_EQ(lines.size(), 1u) << out;
  const nlohmann::json& j = lines[0];
  EXPECT_EQ(j["mode"], "fit");
  EXPECT_EQ(j["trace"], "resnet50_train");
  EXPECT_EQ(j["config"], GetParam());
  const auto requested = j["peak_requested_bytes"].get<std::uint64_t>();
  const auto resolution = j["fit_resolution_bytes"].get<std::uint64_t>();
  const auto min = j["min_capacity_bytes"].get<std::uint64_t>();
  const auto fails_at = j["fails_at_bytes"].get<std::uint64_t>();
  const auto unconstrained = j["unconstrained_peak_reserved_bytes"].get<std::uint64_t>();
  EXPECT_EQ(requested, 3192592912u);
  EXPECT_EQ(resolution, 2 * k_mib);
  EXPECT_GE(min, requested);
  EXPECT_EQ(min % resolution, 0u);
  EXPECT_EQ(fails_at, min - resolution);
  EXPECT_LE(min, j["upper_bound_bytes"].get<std::uint64_t>());
  EXPECT_EQ(j["upper_bound_raises"], 0);
  EXPECT_GE(unconstrained, min);
  EXPECT_DOUBLE_EQ(j["min_capacity_over_requested"].get<double>(),
                   static_cast<double>(min) / static_cast<double>(requested));
  EXPECT_TRUE(j["peers"].empty());

  const auto replay_under = [&](std::uint64_t bytes) {
    int rc = 0;
    const auto r = json_lines(run_binary(
        "--backend sim --json --capacity-gib " + gib_arg(bytes) + config + " " + k_resnet.string(),
        rc));
    EXPECT_EQ(rc, 0);
    EXPECT_EQ(r.size(), 1u);
    EXPECT_EQ(r.at(0)["capacity_bytes"], bytes);
    return r.at(0);
  };
  const nlohmann::json at = replay_under(min);
  EXPECT_EQ(at["fits"], true);
  EXPECT_EQ(at["oom_count"], 0);
  const nlohmann::json below = replay_under(fails_at);
  EXPECT_EQ(below["fits"], false);
  EXPECT_GT(below["oom_count"].get<std::uint64_t>(), 0u);
  // The unconstrained run is the replay's own peak reserved.
  EXPECT_EQ(replay_under(unconstrained)["peak_reserved_bytes"], unconstrained);
}

INSTANTIATE_TEST_SUITE_P(modes, replay_fit_binary,
                         ::testing::Values(std::string(), std::string("expandable_segments:True")),
                         [](const ::testing::TestParamInfo<std::string>& param) {
                           return param.param.empty() ? std::string("default")
                                                      : std::string("expandable");
                         });

}  // namespace
}  // namespace cucache::replay
