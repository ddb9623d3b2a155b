// cucache-replay on PyTorch memory snapshots (tests/data/torch_snapshots, written by python3's
// pickle): plain replay, --fit, --advise and --timeline take them as they take CSV traces, with
// exact figures; the note on stderr says what the reading did; --device picks a device; bad
// snapshots fail with one line naming the problem.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include <fmt/format.h>

#include "replay_test_support.hpp"

namespace cucache::replay::test {
namespace {

const std::filesystem::path k_data = std::filesystem::path(CUCACHE_SOURCE_DIR) / "tests" / "data" /
                                     "torch_snapshots";

std::string data(const char* file) { return (k_data / file).string(); }

TEST(ReplaySnapshot, PlainReplayHasTheHistorysExactFigures) {
  for (const auto& [file, name] : {std::pair{"basic_p2.pickle", "basic_p2"},
                                   std::pair{"basic_p5.pickle", "basic_p5"},
                                   std::pair{"basic_p4.pickle.gz", "basic_p4"}}) {
    SCOPED_TRACE(file);
    const cli_run r = run({"--backend", "sim", "--json", data(file)});
    ASSERT_EQ(r.status, 0) << r.err;
    const auto lines = json_lines(r.out);
    ASSERT_EQ(lines.size(), 1U);
    const nlohmann::json& j = lines[0];
    EXPECT_EQ(j["events"], 9);           // 5 allocs, 3 frees, 1 oom row
    EXPECT_EQ(j["allocations"], 5);
    EXPECT_EQ(j["frees"], 3);
    EXPECT_EQ(j["skipped_failures"], 1);  // the oom: an allocate failure, not replayed
    EXPECT_EQ(j["peak_requested_bytes"], 1000 + 3000 - 1000 + 500 + (4 << 20));
    // cucache rounds 1000 and 3000 to 1024 and 3072; with two streams the peak is the sum of
    // each stream's (docs/api.md: an upper bound): A and B on stream 0, D on the side stream.
    EXPECT_EQ(j["peak_allocated_bytes"], 1024 + 3072 + (4 << 20));
    EXPECT_EQ(j["streams"], 2);
    EXPECT_EQ(j["trace"], name);  // the file name without .gz and .pickle
    EXPECT_NE(r.err.find(": PyTorch memory snapshot, device 0 (of 1 in device_traces): 15 "
                         "entries: 5 alloc, 3 free_requested, 1 oom"),
              std::string::npos)
        << r.err;
  }
}

TEST(ReplaySnapshot, HistoryWithoutItsStartReplaysTheBlocksBeforeIt) {
  const cli_run r = run({"--backend", "sim", "--json", data("wrapped.pickle")});
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = json_lines(r.out).at(0);
  EXPECT_EQ(j["allocations"], 3);  // 2 from before the history, 1 in it
  EXPECT_EQ(j["frees"], 1);
  EXPECT_EQ(j["peak_requested_bytes"], 8192 + 4096);
  EXPECT_EQ(j["peak_allocated_bytes"], 8192 + 4096);
  EXPECT_NE(r.err.find("2 allocations made before the history began replayed as live at its "
                       "start (1 freed in it, 1 active at the dump)"),
            std::string::npos)
      << r.err;
}

TEST(ReplaySnapshot, FitAndAdviseTakeSnapshots) {
  const cli_run fit = run({"--backend", "sim", "--fit", "--json", data("basic_p4.pickle")});
  ASSERT_EQ(fit.status, 0) << fit.err;
  const nlohmann::json f = json_lines(fit.out).at(0);
  EXPECT_EQ(f["mode"], "fit");
  EXPECT_EQ(f["peak_requested_bytes"], 1000 + 3000 - 1000 + 500 + (4 << 20));
  const auto min = f["min_capacity_bytes"].get<std::size_t>();
  EXPECT_EQ(min % (std::size_t{2} << 20), 0U);
  EXPECT_GE(min, f["peak_requested_bytes"].get<std::size_t>());
  EXPECT_LE(min, f["unconstrained_peak_reserved_bytes"].get<std::size_t>());
  // The answer passes and one step below fails, as --capacity-gib replays them.
  const auto gib = [](std::size_t b) {
    return fmt::format("{:.17g}", static_cast<double>(b) / (1 << 30));
  };
  const nlohmann::json at =
      json_lines(run({"--backend", "sim", "--json", "--capacity-gib", gib(min), data("basic_p4.pickle")}).out)
          .at(0);
  EXPECT_EQ(at["fits"], true);
  const nlohmann::json below = json_lines(run({"--backend", "sim", "--json", "--capacity-gib",
                                               gib(min - (2 << 20)), data("basic_p4.pickle")})
                                              .out)
                                   .at(0);
  EXPECT_EQ(below["fits"], false);

  const cli_run advise = run({"--advise", "--json", "--capacity-gib", "1", data("wrapped.pickle")});
  ASSERT_EQ(advise.status, 0) << advise.err;
  const nlohmann::json a = json_lines(advise.out).at(0);
  EXPECT_EQ(a["peak_requested_bytes"], 8192 + 4096);
  EXPECT_FALSE(a["recommended_conf"].is_null());
}

// Snapshots written by torch 2.11 on the H200 (tests/data/torch_snapshots/h200): --fit's answer on
// the simulated device passes under --capacity-gib and one 2 MiB step below fails, for PyTorch's
// default and expandable recordings alike.
TEST(ReplaySnapshot, FitOnH200Snapshots) {
  for (const char* file : {"h200/mlp_default_python.pickle.gz",
                           "h200/transformer_default_python.pickle.gz",
                           "h200/transformer_expandable_nocontext.pickle.gz"}) {
    SCOPED_TRACE(file);
    const cli_run fit = run({"--backend", "sim", "--fit", "--json", data(file)});
    ASSERT_EQ(fit.status, 0) << fit.err;
    const nlohmann::json f = json_lines(fit.out).at(0);
    const auto min = f["min_capacity_bytes"].get<std::size_t>();
    const auto gib = [](std::size_t b) {
      return fmt::format("{:.17g}", static_cast<double>(b) / (1 << 30));
    };
    EXPECT_EQ(json_lines(run({"--backend", "sim", "--json", "--capacity-gib", gib(min), data(file)}).out)
                  .at(0)["fits"],
              true);
    EXPECT_EQ(json_lines(run({"--backend", "sim", "--json", "--capacity-gib", gib(min - (2 << 20)),
                              data(file)})
                             .out)
                  .at(0)["fits"],
              false);
  }
  const cli_run r = run({"--backend", "sim", "--json", data("h200/transformer_default_python.pickle.gz")});
  EXPECT_NE(r.err.find("1 free_requested still waiting to complete at the dump (record_stream)"),
            std::string::npos)
      << r.err;
}

TEST(ReplaySnapshot, TimelineShowsCallSites) {
  const auto out = std::filesystem::temp_directory_path() /
                   ("cucache-snap-timeline." + std::to_string(::getpid()) + ".html");
  const cli_run r =
      run({"--backend", "sim", "--timeline", out.string(), data("basic_p4.pickle")});
  ASSERT_EQ(r.status, 0) << r.err;
  std::ifstream in(out);
  const std::string html{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  std::filesystem::remove(out);
  EXPECT_NE(html.find("\"forward at model.py:42\""), std::string::npos);
  EXPECT_NE(html.find("\"snapshot\":true"), std::string::npos);
}

TEST(ReplaySnapshot, DevicesAndBadSnapshotsAreNamed) {
  const cli_run both = run({"--backend", "sim", "--json", data("two_devices.pickle")});
  EXPECT_EQ(both.status, 1);
  EXPECT_EQ(both.out, "");
  EXPECT_NE(both.err.find("pick one (cucache-replay --device N"), std::string::npos) << both.err;
  const cli_run d1 = run({"--backend", "sim", "--json", "--device", "1", data("two_devices.pickle")});
  ASSERT_EQ(d1.status, 0) << d1.err;
  EXPECT_EQ(json_lines(d1.out).at(0)["peak_requested_bytes"], 5000 + 7000);

  const cli_run none = run({"--backend", "sim", data("no_history.pickle")});
  EXPECT_EQ(none.status, 1);
  EXPECT_NE(none.err.find("_record_memory_history(max_entries=100000)"), std::string::npos)
      << none.err;

  const std::string csv = (std::filesystem::path(CUCACHE_SOURCE_DIR) / "traces" /
                           "resnet50_train.csv.gz")
                              .string();
  const cli_run dev_csv = run({"--backend", "sim", "--device", "0", csv});
  EXPECT_EQ(dev_csv.status, 1);
  EXPECT_NE(dev_csv.err.find("is a CSV trace, not a PyTorch memory snapshot"), std::string::npos)
      << dev_csv.err;
}

}  // namespace
}  // namespace cucache::replay::test
