// cucache-replay --advise on the bundled trace (traces/resnet50_train.csv.gz), on the simulated
// device, whose figures are exact: the ranked table, the recommendation, each row's minimum
// capacity equal to what --fit finds for that setting, --capacity-gib, --json and bad input; the
// progress line's "setting k of N" and the note that CUCACHE_CONF is not taken. defer_coalescing on
// synthetic traces: added to a recommendation (either mode) whose allocations take the held block
// back at least k_defer_coalescing_min_share of the time.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "advisor.hpp"
#include "peers.hpp"
#include "progress.hpp"
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
  // Expandable segments with coarse handles (their default) tie one handle per page on minimum
  // capacity and peak reserved bytes here, and make a quarter of its device calls (399 against
  // 1,533).
  EXPECT_NE(r.out.find("recommended: CUCACHE_CONF=expandable_segments:True\n"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF: not measured"),
            std::string::npos)
      << r.out;
  const prepared_trace trace = load_trace(k_resnet);
  EXPECT_EQ(advice_candidates(trace).size(), 14u);
  // The table has a legend, as the replay's and --fit's have: every column named.
  const std::size_t legend = r.out.find("\nlegend:\n");
  ASSERT_NE(legend, std::string::npos) << r.out;
  for (const char* column : {"  rank ", "  min capacity ", "  min/req ", "  peak reserved ",
                             "  device calls ", "  VM calls "}) {
    EXPECT_NE(r.out.find(column, legend), std::string::npos) << column << " not in the legend:\n"
                                                             << r.out;
  }
}

TEST(replay_advise, every_row_matches_fit_and_replay_of_its_setting) {
  const cli_run r = run({"--advise", "--json", "--backend", "sim", k_resnet.string()});
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["trace"], "resnet50_train");
  EXPECT_EQ(j["recommended_conf"], "expandable_segments:True");
  EXPECT_TRUE(j["pytorch_cuda_alloc_conf"].is_null());
  EXPECT_TRUE(j["pytorch_alloc_conf"].is_null());
  ASSERT_EQ(j["rows"].size(), 14u);
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
  // Four settings fit 3.05 GiB: expandable segments (three times) and reserve_mb, which makes
  // the fewest device calls; coarse handles (the default) fewer than one handle per page.
  std::vector<std::string> fitting;
  for (const nlohmann::json& row : j["rows"]) {
    if (row["fits"].get<bool>()) fitting.push_back(row["conf"]);
  }
  EXPECT_EQ(fitting, (std::vector<std::string>{"reserve_mb:2740", "expandable_segments:True",
                                               "expandable_segments:True,coarse_handles:0",
                                               "expandable_segments:True,reserve_mb:2740"}));
  EXPECT_EQ(j["recommended_conf"], "reserve_mb:2740");

  const cli_run none =
      run({"--advise", "--backend", "sim", "--capacity-gib", "2", k_resnet.string()});
  ASSERT_EQ(none.status, 0) << none.err;
  EXPECT_NE(none.out.find("recommended: none: no setting fits 2.000 GiB"), std::string::npos)
      << none.out;
}

// Coarse handles are chosen per trace: on gpt2_train_ckpt they need a larger card (1.0081 of the
// peak requested bytes against 1.0026), so one handle per page (coarse_handles:0) ranks first
// there; it is cucache's own key, not a PyTorch option.
TEST(replay_advise, coarse_handles_are_chosen_per_trace) {
  const std::filesystem::path ckpt =
      std::filesystem::path(CUCACHE_SOURCE_DIR) / "traces" / "gpt2_train_ckpt.csv.gz";
  const cli_run r = run({"--advise", "--json", "--backend", "sim", ckpt.string()});
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["recommended_conf"], "expandable_segments:True,coarse_handles:0");
  std::size_t plain = 0;
  std::size_t coarse = 0;
  for (const nlohmann::json& row : j["rows"]) {
    if (row["conf"] == "expandable_segments:True") {
      coarse = row["min_capacity_bytes"];
      EXPECT_TRUE(row["pytorch_option"].get<bool>());
    }
    if (row["conf"] == "expandable_segments:True,coarse_handles:0") {
      plain = row["min_capacity_bytes"];
      EXPECT_FALSE(row["pytorch_option"].get<bool>());
    }
  }
  ASSERT_NE(plain, 0u);
  EXPECT_GT(coarse, plain);
}

// One rule says which keys PyTorch's allocator has: c10_settings keeps exactly those, and a
// candidate is a PyTorch option when it drops nothing else.
TEST(replay_advise, c10_settings_keeps_only_the_keys_pytorch_has) {
  EXPECT_EQ(c10_settings(parse_config("")), "");
  EXPECT_EQ(c10_settings(parse_config("expandable_segments:True,coarse_handles:0,reserve_mb:64,"
                                      "nvtx:True,history:100,memory_limit:1GiB")),
            "expandable_segments:True");
  const std::string shared =
      "max_split_size_mb:256,garbage_collection_threshold:0.7,roundup_power2_divisions:4";
  EXPECT_EQ(parse_config(c10_settings(parse_config(shared))), parse_config(shared));
  EXPECT_TRUE(c10_has_every_key(parse_config(shared)));
  EXPECT_TRUE(c10_has_every_key(parse_config("expandable_segments:True,memory_fraction:0.5")));
  for (const char* own : {"coarse_handles:0", "coarse_handles:16", "reserve_mb:64", "nvtx:True",
                          "history:100", "leak_steps:3", "ipc_handles:True"}) {
    SCOPED_TRACE(own);
    EXPECT_FALSE(c10_has_every_key(parse_config(own)));
  }
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

// --- PyTorch's allocator under each setting (--peers c10): the ranking, with a stand-in fitter --

/// A stand-in for PyTorch's allocator: a minimum capacity over the trace's peak requested bytes
/// per setting, one that fails, and every setting it was asked about, in order.
struct scripted_pytorch {
  std::map<std::string, double> over_requested;
  std::optional<std::string> failing;
  std::vector<std::string> asked;
  advice_row operator()(const prepared_trace& trace, const std::string& conf,
                        const fit_options& /*fit*/) {
    asked.push_back(conf);
    advice_row row;
    if (conf == failing) {
      row.error = "scripted failure";
      return row;
    }
    const double over = over_requested.contains(conf) ? over_requested.at(conf) : 1.20;
    row.ok = true;
    row.min_capacity_bytes =
        static_cast<std::size_t>(over * static_cast<double>(trace.summary.peak_requested_bytes));
    row.peak_reserved_bytes = row.min_capacity_bytes + (std::size_t{1} << 20);
    row.device_calls = conf.size();  // distinct, to see them carried through
    return row;
  }
};

TEST(replay_advise, pytorch_settings_are_fitted_in_pytorchs_spelling_and_ranked) {
  const prepared_trace trace = load_trace(k_resnet);
  scripted_pytorch script;
  script.over_requested = {
      {"", 1.10}, {"expandable_segments:True", 1.01}, {"max_split_size_mb:256", 1.05}};
  script.failing = "roundup_power2_divisions:2";
  options o;
  o.backend = backend_kind::sim;
  const advice a = advise_trace(trace, o, fit_options{}, std::nullopt, std::ref(script));
  // The 11 candidates without reserve_mb or coarse_handles (cucache-only keys), PyTorch's
  // defaults first.
  const std::vector<std::string> expected = {"",
                                             "expandable_segments:True",
                                             "max_split_size_mb:64",
                                             "max_split_size_mb:128",
                                             "max_split_size_mb:256",
                                             "max_split_size_mb:512",
                                             "garbage_collection_threshold:0.6",
                                             "garbage_collection_threshold:0.8",
                                             "roundup_power2_divisions:2",
                                             "roundup_power2_divisions:4",
                                             "roundup_power2_divisions:8"};
  EXPECT_EQ(script.asked, expected);
  ASSERT_EQ(a.pytorch_rows.size(), expected.size());
  EXPECT_EQ(a.pytorch_rows[0].conf, "expandable_segments:True");
  EXPECT_EQ(a.pytorch_rows[1].conf, "max_split_size_mb:256");
  EXPECT_EQ(a.pytorch_rows[2].conf, "");
  EXPECT_EQ(a.pytorch_rows[0].device_calls, std::string("expandable_segments:True").size());
  EXPECT_FALSE(a.pytorch_rows.back().ok);  // the failure ranks last, with its reason
  EXPECT_EQ(a.pytorch_rows.back().conf, "roundup_power2_divisions:2");
  EXPECT_EQ(a.pytorch_rows.back().error, "scripted failure");
  ASSERT_TRUE(a.pytorch_conf.has_value());
  EXPECT_EQ(*a.pytorch_conf, "expandable_segments:True");
  // cucache's own ranking is untouched by PyTorch's.
  EXPECT_EQ(a.recommended_conf, "expandable_segments:True");
  EXPECT_EQ(a.rows.size(), 14u);

  const nlohmann::json j = to_json(a);
  EXPECT_EQ(j["pytorch_cuda_alloc_conf"], "expandable_segments:True");
  EXPECT_EQ(j["pytorch_alloc_conf"], "expandable_segments:True");
  ASSERT_EQ(j["pytorch_rows"].size(), expected.size());
  EXPECT_EQ(j["pytorch_rows"][0]["min_capacity_bytes"].get<std::size_t>(),
            a.pytorch_rows[0].min_capacity_bytes);
  EXPECT_EQ(j["pytorch_rows"].back()["error"], "scripted failure");
  const std::string text = format_advice(a);
  // PyTorch reads both names: the advice gives both.
  EXPECT_NE(text.find("recommended for PyTorch: PYTORCH_ALLOC_CONF=expandable_segments:True (older "
                      "PyTorch: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("setting (PYTORCH_ALLOC_CONF)"), std::string::npos);
}

TEST(replay_advise, pytorch_with_a_capacity_ranks_what_fits_and_can_find_none) {
  const prepared_trace trace = load_trace(k_resnet);
  const auto req = static_cast<double>(trace.summary.peak_requested_bytes);
  options o;
  o.backend = backend_kind::sim;
  scripted_pytorch script;
  script.over_requested = {{"", 1.10}, {"max_split_size_mb:512", 1.02}};
  const auto card = static_cast<std::size_t>(1.03 * req);
  advice a = advise_trace(trace, o, fit_options{}, card, std::ref(script));
  ASSERT_TRUE(a.pytorch_conf.has_value());
  EXPECT_EQ(*a.pytorch_conf, "max_split_size_mb:512");
  EXPECT_TRUE(a.pytorch_rows[0].fits.value());
  EXPECT_FALSE(a.pytorch_rows[1].fits.value());

  scripted_pytorch none;  // every setting needs 1.20 x the requested peak
  a = advise_trace(trace, o, fit_options{}, card, std::ref(none));
  EXPECT_FALSE(a.pytorch_conf.has_value());
  EXPECT_NE(a.pytorch_note.find("no PyTorch setting fits"), std::string::npos) << a.pytorch_note;
  EXPECT_TRUE(to_json(a)["pytorch_cuda_alloc_conf"].is_null());
}

TEST(replay_advise, pytorch_defaults_that_cannot_be_replayed_stop_the_rest) {
  const prepared_trace trace = load_trace(k_resnet);
  options o;
  o.backend = backend_kind::sim;
  scripted_pytorch script;
  script.failing = "";
  const advice a = advise_trace(trace, o, fit_options{}, std::nullopt, std::ref(script));
  EXPECT_EQ(script.asked, std::vector<std::string>{""});  // asked once, not eleven times
  ASSERT_EQ(a.pytorch_rows.size(), 11u);
  for (const advice_row& r : a.pytorch_rows) EXPECT_FALSE(r.ok) << r.conf;
  EXPECT_EQ(a.pytorch_rows[1].error, "not tried: scripted failure");
  EXPECT_FALSE(a.pytorch_conf.has_value());
  EXPECT_EQ(a.pytorch_note, "PyTorch's allocator could not be replayed: scripted failure");
}

// The real fitter forks a child per setting; without the c10 shim the child says why, and the
// advice still comes (cucache's rows are on the simulated device).
TEST(replay_advise, peers_c10_without_the_shim_is_a_clear_note_from_the_child) {
  const char* old = std::getenv("CUCACHE_C10_PEER");
  const std::string saved = old != nullptr ? old : "";
  ::setenv("CUCACHE_C10_PEER", "/nonexistent/libcucache_c10_peer.so", 1);
  const cli_run r = run({"--advise", "--json", "--peers", "c10", k_resnet.string()});
  if (old != nullptr) {
    ::setenv("CUCACHE_C10_PEER", saved.c_str(), 1);
  } else {
    ::unsetenv("CUCACHE_C10_PEER");
  }
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["recommended_conf"], "expandable_segments:True");
  EXPECT_TRUE(j["pytorch_cuda_alloc_conf"].is_null());
  EXPECT_TRUE(j["pytorch_alloc_conf"].is_null());
  ASSERT_EQ(j["pytorch_rows"].size(), 11u);
  const std::string note = j["pytorch_note"];
  EXPECT_NE(note.find("c10 peer: /nonexistent/libcucache_c10_peer.so not found"), std::string::npos)
      << note;

  const cli_run bad = run({"--advise", "--peers", "cudaMallocAsync", k_resnet.string()});
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.err.find("--advise --peers cudaMallocAsync: the advisor takes one peer, c10"),
            std::string::npos)
      << bad.err;
  const cli_run gpu = run({"--advise", "--backend", "cuda", k_resnet.string()});
  EXPECT_EQ(gpu.status, 1);
  EXPECT_NE(gpu.err.find("--advise: cucache's candidates replay on the simulated device only"),
            std::string::npos)
      << gpu.err;
}

TEST(replay_advise, the_progress_line_counts_settings_and_traces) {
  // The progress line (a terminal's stderr only) keeps saying which setting of how many is
  // replaying while the phases inside it replace one another, after the CLI's "trace k of N: ".
  const prepared_trace trace = load_trace(k_resnet);
  std::ostringstream quiet;
  progress line(quiet, std::chrono::hours(1));  // never drawn: only its text is read
  line.prefix("trace 2 of 7: ");
  std::vector<std::string> seen;  // the line as each PyTorch fit starts
  scripted_pytorch script;
  const auto fitter = [&](const prepared_trace& t, const std::string& conf, const fit_options& f) {
    seen.push_back(line.line());
    return script(t, conf, f);
  };
  options o;
  o.backend = backend_kind::sim;
  o.progress_line = &line;
  (void)advise_trace(trace, o, fit_options{}, std::nullopt, fitter);
  ASSERT_EQ(seen.size(), 11u);  // the candidates PyTorch shares
  EXPECT_EQ(seen.front(),
            "trace 2 of 7: PyTorch setting 1 of 11 (defaults): resnet50_train: "
            "PyTorch's allocator on the GPU");
  EXPECT_EQ(seen.back(),
            "trace 2 of 7: PyTorch setting 11 of 11 (roundup_power2_divisions:8): resnet50_train: "
            "PyTorch's allocator on the GPU");
  // Afterwards the CLI's prefix is back, alone, with and without PyTorch's loop.
  EXPECT_EQ(line.prefix(), "trace 2 of 7: ");
  (void)advise_trace(trace, o, fit_options{}, std::nullopt);
  EXPECT_EQ(line.prefix(), "trace 2 of 7: ");
  EXPECT_EQ(quiet.str(), "");
}

TEST(replay_advise, says_that_it_ignores_cucache_conf) {
  const char* old = std::getenv("CUCACHE_CONF");
  const std::optional<std::string> saved = old ? std::optional<std::string>(old) : std::nullopt;
  ::setenv("CUCACHE_CONF", "max_split_size_mb:64", 1);
  const cli_run r = run({"--advise", "--backend", "sim", k_resnet.string()});
  if (saved) {
    ::setenv("CUCACHE_CONF", saved->c_str(), 1);
  } else {
    ::unsetenv("CUCACHE_CONF");
  }
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("--advise ignores CUCACHE_CONF in the environment"), std::string::npos)
      << r.err;
  EXPECT_NE(r.out.find("recommended: CUCACHE_CONF=expandable_segments:True\n"), std::string::npos)
      << r.out;
}

// --- defer_coalescing: added to the recommendation when allocations take back -----------------

using test::trace_builder;

constexpr std::size_t k_kib = std::size_t{1} << 10;
constexpr std::size_t k_mib_bytes = std::size_t{1} << 20;

/// A long-lived block, then `pairs` allocations of one size each freed before the next: every
/// allocation after the first takes the held block back.
prepared_trace same_size_pairs(int pairs) {
  trace_builder t;
  t.alloc(0x100000, 4 * k_kib);
  for (int i = 0; i < pairs; ++i) t.alloc(0x200000, 512 * k_kib).free(0x200000, 512 * k_kib);
  return prepare(parse_trace(t.text()), "same_size_pairs");
}

/// Each allocation is larger than the one freed before it: none can take a held block back.
prepared_trace growing_sizes(int pairs) {
  trace_builder t;
  t.alloc(0x100000, 4 * k_kib);
  for (int i = 0; i < pairs; ++i) {
    const std::size_t size = static_cast<std::size_t>(i + 1) * 2 * k_kib;
    t.alloc(0x200000, size).free(0x200000, size);
  }
  return prepare(parse_trace(t.text()), "growing_sizes");
}

/// Every allocation first, then every free: no allocation follows a free.
prepared_trace all_then_free(int n) {
  trace_builder t;
  for (int i = 0; i < n; ++i) t.alloc(0x100000 + 0x100000 * i, 256 * k_kib);
  for (int i = 0; i < n; ++i) t.free(0x100000 + 0x100000 * i, 256 * k_kib);
  return prepare(parse_trace(t.text()), "all_then_free");
}

advice advise_sim(const prepared_trace& trace, std::optional<std::size_t> capacity = std::nullopt) {
  options o;
  o.backend = backend_kind::sim;
  return advise_trace(trace, o, fit_options{}, capacity);
}

TEST(replay_advise, same_size_pairs_get_defer_coalescing) {
  const advice a = advise_sim(same_size_pairs(200));
  ASSERT_FALSE(a.no_fit);
  const advice_row& best = a.rows.front();
  ASSERT_TRUE(best.ok) << best.error;
  ASSERT_FALSE(parse_config(best.conf).expandable_segments) << best.conf;
  ASSERT_TRUE(a.take_back_share.has_value()) << a.defer_note;
  EXPECT_EQ(a.allocations, 201u);
  EXPECT_EQ(a.take_backs, 199u);  // all but the long-lived block and the first of the pairs
  EXPECT_GT(*a.take_back_share, 0.98);
  EXPECT_TRUE(a.defer_coalescing);
  EXPECT_EQ(a.defer_min_share, k_defer_coalescing_min_share);
  // The best row's setting with the key appended, comma-joined: what a user sets.
  EXPECT_EQ(a.recommended_conf, best.conf.empty() ? std::string("defer_coalescing:True")
                                                  : best.conf + ",defer_coalescing:True");
  config expected = parse_config(best.conf);
  expected.defer_coalescing = true;
  EXPECT_EQ(parse_config(a.recommended_conf), expected);
  // The rows themselves are measured without it.
  for (const advice_row& r : a.rows) EXPECT_FALSE(parse_config(r.conf).defer_coalescing) << r.conf;

  const nlohmann::json j = to_json(a);
  EXPECT_EQ(j["recommended_conf"], a.recommended_conf);
  EXPECT_TRUE(j["defer_coalescing"]["recommended"].get<bool>());
  EXPECT_DOUBLE_EQ(j["defer_coalescing"]["take_back_share"].get<double>(), *a.take_back_share);
  EXPECT_EQ(j["defer_coalescing"]["take_backs"].get<std::uint64_t>(), 199u);
  EXPECT_EQ(j["defer_coalescing"]["allocations"].get<std::size_t>(), 201u);
  EXPECT_DOUBLE_EQ(j["defer_coalescing"]["min_share"].get<double>(), k_defer_coalescing_min_share);
  const std::string text = format_advice(a);
  EXPECT_NE(text.find("recommended: CUCACHE_CONF=" + a.recommended_conf + "\n"), std::string::npos)
      << text;
  EXPECT_NE(text.find("defer_coalescing: 99.0% of allocations took the held freed block back (199 "
                      "of 201)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("at or above the 75% break-even"), std::string::npos) << text;
  EXPECT_NE(text.find(": added to the recommendation\n"), std::string::npos) << text;
}

TEST(replay_advise, same_size_pairs_through_the_cli_print_a_parseable_conf) {
  const auto path = std::filesystem::temp_directory_path() / "cucache_advise_pairs.csv";
  {
    trace_builder t;
    t.alloc(0x100000, 4 * k_kib);
    for (int i = 0; i < 300; ++i) t.alloc(0x200000, 512 * k_kib).free(0x200000, 512 * k_kib);
    std::ofstream(path) << t.text();
  }
  const cli_run r = run({"--advise", "--json", "--backend", "sim", path.string()});
  std::filesystem::remove(path);
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  const std::string conf = j["recommended_conf"];
  EXPECT_TRUE(parse_config(conf).defer_coalescing) << conf;
  EXPECT_GT(j["defer_coalescing"]["take_back_share"].get<double>(), 0.99);
}

TEST(replay_advise, frees_never_followed_by_their_size_do_not_get_defer_coalescing) {
  for (const prepared_trace& trace : {growing_sizes(200), all_then_free(64)}) {
    SCOPED_TRACE(trace.name);
    const advice a = advise_sim(trace);
    ASSERT_FALSE(a.no_fit);
    const advice_row& best = a.rows.front();
    ASSERT_TRUE(best.ok) << best.error;
    ASSERT_FALSE(parse_config(best.conf).expandable_segments) << best.conf;
    ASSERT_TRUE(a.take_back_share.has_value()) << a.defer_note;
    EXPECT_EQ(a.take_backs, 0u);
    EXPECT_EQ(*a.take_back_share, 0.0);
    EXPECT_FALSE(a.defer_coalescing);
    EXPECT_EQ(a.recommended_conf, best.conf);
    EXPECT_FALSE(parse_config(a.recommended_conf).defer_coalescing);
    const nlohmann::json j = to_json(a);
    EXPECT_FALSE(j["defer_coalescing"]["recommended"].get<bool>());
    EXPECT_EQ(j["defer_coalescing"]["take_back_share"].get<double>(), 0.0);
    const std::string text = format_advice(a);
    EXPECT_NE(text.find("below the 75% break-even"), std::string::npos) << text;
    EXPECT_NE(text.find(": not added\n"), std::string::npos) << text;
  }
}

// The break-even share itself is enough: 150 take-backs in 200 allocations (0.75) add the key,
// 150 in 201 do not.
TEST(replay_advise, the_break_even_share_is_inclusive) {
  ASSERT_EQ(k_defer_coalescing_min_share, 0.75);  // the counts below are built for it
  for (const int others : {48, 49}) {
    SCOPED_TRACE(others);
    trace_builder t;
    t.alloc(0x100000, 4 * k_kib);
    for (int i = 0; i < 151; ++i) {  // every allocation after the first a take-back
      t.alloc(0x200000, 512 * k_kib).free(0x200000, 512 * k_kib);
    }
    for (int i = 0; i < others; ++i) {
      const std::size_t size = static_cast<std::size_t>(i + 1) * 8 * k_kib;  // never the last size
      t.alloc(0x300000, size).free(0x300000, size);
    }
    const advice a = advise_sim(prepare(parse_trace(t.text()), "take_backs_at_the_break_even"));
    ASSERT_FALSE(parse_config(a.rows.front().conf).expandable_segments) << a.rows.front().conf;
    ASSERT_TRUE(a.take_back_share.has_value()) << a.defer_note;
    EXPECT_EQ(a.defer_min_share, k_defer_coalescing_min_share);
    EXPECT_EQ(a.take_backs, 150u);
    EXPECT_EQ(a.allocations, static_cast<std::size_t>(152 + others));
    EXPECT_EQ(a.defer_coalescing, others == 48);
    EXPECT_EQ(parse_config(a.recommended_conf).defer_coalescing, others == 48)
        << a.recommended_conf;
  }
}

// An expandable recommendation is weighed too (decision 0032: the key holds a range's block too),
// against expandable mode's break-even: resnet50_train rarely takes a block back, a trace
// whose fragmenting start only expandable segments fit tightly, then same-size pairs, nearly
// always.
TEST(replay_advise, an_expandable_recommendation_is_weighed_too) {
  const prepared_trace trace = load_trace(k_resnet);
  const advice a = advise_sim(trace);
  ASSERT_EQ(a.rows.front().conf, "expandable_segments:True");
  ASSERT_TRUE(a.take_back_share.has_value()) << a.defer_note;
  EXPECT_EQ(a.allocations, 6843u);
  EXPECT_LT(*a.take_back_share, 0.01);
  EXPECT_FALSE(a.defer_coalescing);
  EXPECT_EQ(a.recommended_conf, "expandable_segments:True");
  EXPECT_NE(format_advice(a).find("below the 50% break-even"), std::string::npos);
  EXPECT_FALSE(to_json(a)["defer_coalescing"]["recommended"].get<bool>());

  // Three 4 MiB blocks kept out of five in one segment, then 8 MiB; then 200 same-size pairs.
  trace_builder t;
  for (int i = 0; i < 5; ++i) t.alloc(0x10000000 + 0x1000000 * i, 4 * k_mib_bytes);
  t.free(0x11000000, 4 * k_mib_bytes).free(0x13000000, 4 * k_mib_bytes);
  t.alloc(0x20000000, 8 * k_mib_bytes);
  for (int i = 0; i < 200; ++i)
    t.alloc(0x30000000, 4 * k_mib_bytes).free(0x30000000, 4 * k_mib_bytes);
  const advice e = advise_sim(prepare(parse_trace(t.text()), "fragmenting_then_pairs"));
  ASSERT_FALSE(e.no_fit);
  ASSERT_TRUE(parse_config(e.rows.front().conf).expandable_segments) << format_advice(e);
  ASSERT_TRUE(e.take_back_share.has_value()) << e.defer_note;
  EXPECT_EQ(e.defer_min_share, k_defer_coalescing_min_share_expandable);
  EXPECT_EQ(e.allocations, 206u);
  EXPECT_EQ(e.take_backs, 199u);
  EXPECT_TRUE(e.defer_coalescing);
  EXPECT_EQ(e.recommended_conf, e.rows.front().conf + ",defer_coalescing:True");
}

// With a card, the recommendation is the cheapest setting that fits; in the default mode the share
// is measured on that card (resnet50_train: reserve_mb:2740 on 3.05 GiB, rarely taken back).
TEST(replay_advise, a_default_mode_pick_on_a_card_is_weighed_too) {
  const prepared_trace trace = load_trace(k_resnet);
  const advice a = advise_sim(trace, std::size_t{3274912563});  // 3.05 GiB
  ASSERT_EQ(a.rows.front().conf, "reserve_mb:2740");
  ASSERT_TRUE(a.take_back_share.has_value()) << a.defer_note;
  EXPECT_EQ(a.allocations, 6843u);
  EXPECT_LT(*a.take_back_share, 0.01);
  EXPECT_EQ(a.recommended_conf, "reserve_mb:2740");
}

TEST(replay_advise, no_recommendation_weighs_nothing) {
  const prepared_trace trace = load_trace(k_resnet);
  const advice a = advise_sim(trace, std::size_t{2} << 30);
  ASSERT_TRUE(a.no_fit);
  EXPECT_FALSE(a.take_back_share.has_value());
  EXPECT_TRUE(to_json(a)["recommended_conf"].is_null());
}

}  // namespace
}  // namespace cucache::replay
