// cucache-replay --advise on the bundled trace (traces/resnet50_train.csv.gz), on the simulated
// device, whose figures are exact: the ranked table, the recommendation, each row's minimum
// capacity equal to what --fit finds for that setting, --capacity-gib, --json and bad input.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "advisor.hpp"
#include "replay_engine.hpp"
#include "tools/replay_test_support.hpp"

namespace cucache::replay {
namespace {

using test::cli_run;
using test::run;

const std::filesystem::path k_resnet =
    std::filesystem::path(CUCACHE_SOURCE_DIR) / "traces" / "resnet50_train.csv.gz";


TEST(replay_advise, ranks_the_candidates_and_recommends_expandable_segments_for_resnet50) {
  const cli_run r = run({"--advise", "--backend", "sim", k_resnet.string()});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("recommended: CUCACHE_CONF=expandable_segments:True\n"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("PYTORCH_CUDA_ALLOC_CONF: not available on the simulated device"),
            std::string::npos);
  const prepared_trace trace = load_trace(k_resnet);
  EXPECT_EQ(advice_candidates(trace).size(), 13u);
}

TEST(replay_advise, every_row_matches_fit_and_replay_of_its_setting) {
  const cli_run r = run({"--advise", "--json", "--backend", "sim", k_resnet.string()});
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["trace"], "resnet50_train");
  EXPECT_EQ(j["recommended_conf"], "expandable_segments:True");
  EXPECT_TRUE(j["pytorch_cuda_alloc_conf"].is_null());
  ASSERT_EQ(j["rows"].size(), 13u);
  const prepared_trace trace = load_trace(k_resnet);
  std::size_t previous = 0;
  for (const nlohmann::json& row : j["rows"]) {
    SCOPED_TRACE(row.dump());
    ASSERT_TRUE(row["ok"].get<bool>());
    options o;
    o.backend = backend_kind::sim;
    o.cfg = parse_config(row["conf"].get<std::string>());
    const fit_result f = fit_trace(trace, o, fit_options{});
    EXPECT_EQ(row["min_capacity_bytes"].get<std::size_t>(), f.cucache.min_capacity_bytes);
    const trace_result t = replay_trace(trace, o);
    EXPECT_EQ(row["peak_reserved_bytes"].get<std::size_t>(), t.figures.peak_reserved_bytes);
    EXPECT_EQ(row["device_calls"].get<std::uint64_t>(),
              t.figures.device_alloc_calls + t.figures.device_free_calls);
    EXPECT_EQ(row["vm_calls"].get<std::uint64_t>(),
              t.figures.vm_map_calls + t.figures.vm_unmap_calls);
    // Ranked by minimum capacity first.
    EXPECT_GE(f.cucache.min_capacity_bytes, previous);
    previous = f.cucache.min_capacity_bytes;
  }
}

TEST(replay_advise, capacity_ranks_what_fits_by_device_calls) {
  const cli_run r =
      run({"--advise", "--json", "--backend", "sim", "--capacity-gib", "3.05", k_resnet.string()});
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["capacity_bytes"].get<std::size_t>(), 3274912563u);  // round(3.05 GiB)
  // Three settings fit 3.05 GiB: expandable segments (twice) and reserve_mb, which makes the
  // fewest device calls.
  std::vector<std::string> fitting;
  for (const nlohmann::json& row : j["rows"]) {
    if (row["fits"].get<bool>()) fitting.push_back(row["conf"]);
  }
  EXPECT_EQ(fitting, (std::vector<std::string>{"reserve_mb:2740", "expandable_segments:True",
                                               "expandable_segments:True,reserve_mb:2740"}));
  EXPECT_EQ(j["recommended_conf"], "reserve_mb:2740");

  const cli_run none =
      run({"--advise", "--backend", "sim", "--capacity-gib", "2", k_resnet.string()});
  ASSERT_EQ(none.status, 0) << none.err;
  EXPECT_NE(none.out.find("recommended: none: no setting fits 2.000 GiB"), std::string::npos)
      << none.out;
}

TEST(replay_advise, bad_input_is_a_clear_error_naming_the_file_or_flag) {
  const auto bad = std::filesystem::temp_directory_path() / "cucache_advise_bad.csv";
  {
    std::ofstream f(bad);
    f << "garbage\n";
  }
  cli_run r = run({"--advise", "--backend", "sim", bad.string()});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find(bad.string()), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;  // nothing printed for a run that failed
  // The good trace before the bad one is not advised on either: every trace is read first.
  r = run({"--advise", "--backend", "sim", k_resnet.string(), bad.string()});
  EXPECT_EQ(r.status, 1);
  EXPECT_TRUE(r.out.empty()) << r.out;
  std::filesystem::remove(bad);

  r = run({"--advise", "--backend", "sim", "/nonexistent/trace.csv.gz"});
  EXPECT_NE(r.status, 0);
  EXPECT_NE((r.err + r.out).find("/nonexistent/trace.csv.gz"), std::string::npos);
  r = run(
      {"--advise", "--backend", "sim", "--config", "expandable_segments:True", k_resnet.string()});
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.err.find("--advise: --config"), std::string::npos) << r.err;
  r = run({"--advise", "--fit", "--backend", "sim", k_resnet.string()});
  EXPECT_NE(r.status, 0);
  r = run({"--advise", "--backend", "sim", "--capacity-gib", "-1", k_resnet.string()});
  EXPECT_NE(r.status, 0);
  EXPECT_NE((r.err + r.out).find("--capacity-gib"), std::string::npos);
}

}  // namespace
}  // namespace cucache::replay
