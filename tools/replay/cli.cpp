// The command line of cucache-replay: parses the options with CLI11, picks the backend, replays
// each trace and prints a table or JSON Lines. In the engine library so tests run it in-process.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>
#include <string_view>

#include "advisor.hpp"
#include "cucache/backend_factory.hpp"
#include "cucache/config.hpp"
#include "cucache/cuda_backend.hpp"
#include "cucache/errors.hpp"
#include "peers.hpp"
#include "progress.hpp"
#include "replay_engine.hpp"
#include "timeline.hpp"

namespace cucache::replay {
namespace {

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    const auto first = item.find_first_not_of(" \t");
    if (first == std::string::npos) continue;
    const auto last = item.find_last_not_of(" \t");
    items.push_back(item.substr(first, last - first + 1));
  }
  return items;
}

/// A size option (`value` in `unit`s, `bytes` its rounded byte count): at least one byte, at most
/// 1e18 (no device comes near; larger counts lose their exactness as doubles).
void check_bytes_option(const char* option, const char* unit, double value, double bytes) {
  if (!(value > 0.0)) {
    throw invalid_argument(
        fmt::format("{} {}: must be a positive number of {}", option, value, unit));
  }
  if (!(bytes >= 1.0)) {
    throw invalid_argument(fmt::format("{} {}: smaller than one byte", option, value));
  }
  if (bytes > 1e18) {
    const double top =
        1e18 / static_cast<double>(std::string_view(unit) == "GiB" ? 1ULL << 30 : 1ULL << 20);
    throw invalid_argument(
        fmt::format("{} {}: too large (at most {:.0f} {}, 1e18 bytes)", option, value, top, unit));
  }
}

/// --peers: every name one of k_peer_names, or "none" alone.
void check_peer_names(const std::vector<std::string>& names) {
  for (const std::string& name : names) {
    if (name == "none" && names.size() == 1) continue;
    if (std::find(std::begin(k_peer_names), std::end(k_peer_names), name) ==
        std::end(k_peer_names)) {
      throw invalid_argument(fmt::format("--peers: unknown peer '{}' (valid: {}, or none alone)",
                                         name, fmt::join(k_peer_names, ", ")));
    }
  }
}

/// PyTorch's figures for the same traces, when a reference.json sits beside them (as in the
/// bundled traces/): the comparison a CPU-only run can make. Memory ratios compare across
/// machines (the simulated device makes the same segments as a GPU); host time does not (the
/// simulated device makes no device calls), so the H200's times are a table of their own.
std::string format_reference(const std::vector<std::string>& paths,
                             const std::vector<trace_result>& results) {
  std::string memory;
  std::string time;
  for (std::size_t i = 0; i < paths.size() && i < results.size(); ++i) {
    const auto ref_path = std::filesystem::path(paths[i]).parent_path() / "reference.json";
    std::ifstream in(ref_path);
    if (!in) continue;
    const nlohmann::json ref = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    const trace_result& r = results[i];
    if (!ref.is_object() || !ref.contains(r.trace)) continue;
    const nlohmann::json& t = ref[r.trace];
    if (memory.empty()) {
      memory += fmt::format(
          "\npeak reserved / peak requested: cucache in this run ({}) beside PyTorch 2.11 "
          "recorded on an H200 ({})\n",
          r.backend, ref_path.string());
      memory += fmt::format("{:<20} {:>12} {:>12} {:>12} {:>15}\n", "trace", "cucache",
                            "torch dflt", "torch exp.", "torch split128");
      memory += fmt::format("{:<20} {:>12} {:>12} {:>12} {:>15}\n", "", "(this run)", "(H200)",
                            "(H200)", "(H200)");
      time += fmt::format(
          "\nhost ns per event recorded on the H200 ({}); {}\n", ref_path.string(),
          r.backend == "sim"
              ? "not comparable with this run's ns/op: the simulated device makes no device calls"
              : "another run, on another machine: compare peers measured in this run instead "
                "(--peers)");
      time += fmt::format("{:<20} {:>16} {:>16} {:>16}\n", "trace", "c10 default", "c10 expandable",
                          "cudaMallocAsync");
    }
    memory += fmt::format("{:<20} {:>12.3f} {:>12.3f} {:>12.3f} {:>15.3f}\n", r.trace,
                          r.reserved_over_requested, t.value("torch_default_ratio", 0.0),
                          t.value("torch_expandable_ratio", 0.0),
                          t.value("torch_max_split_128_ratio", 0.0));
    time += fmt::format("{:<20} {:>16.1f} {:>16.1f} {:>16.1f}\n", r.trace,
                        t.value("c10_replay_ns_per_op_default", 0.0),
                        t.value("c10_replay_ns_per_op_expandable", 0.0),
                        t.value("cuda_async_replay_ns_per_op", 0.0));
  }
  if (!memory.empty()) {
    memory +=
        "torch dflt / torch exp. / torch split128: PyTorch's allocator with its defaults / "
        "with expandable_segments:True / with max_split_size_mb:128\n";
  }
  return memory + time;
}

/// PyTorch's and cudaMallocAsync's minimum capacities for the same traces, when a
/// min_capacity.json sits beside them (as in traces/), for --fit. The file also keeps a cucache
/// figure of the build it was recorded with; it is not shown: this run's figure is the current
/// one, and an older build's beside it would read as current.
std::string format_min_capacity_reference(const std::vector<std::string>& paths,
                                          const std::vector<fit_result>& results) {
  std::string s;
  for (std::size_t i = 0; i < paths.size() && i < results.size(); ++i) {
    const auto ref_path = std::filesystem::path(paths[i]).parent_path() / "min_capacity.json";
    std::ifstream in(ref_path);
    if (!in) continue;
    const nlohmann::json ref = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    const fit_result& r = results[i];
    if (!ref.is_object() || !ref.contains(r.trace) || !ref[r.trace].is_object()) continue;
    const nlohmann::json& t = ref[r.trace];
    if (s.empty()) {
      s += fmt::format(
          "\nminimum capacity / peak requested: cucache in this run ({}, config {}) beside "
          "PyTorch 2.11 and cudaMallocAsync recorded on an H200 ({})\n",
          r.backend, r.config.empty() ? "(defaults)" : r.config, ref_path.string());
      s += fmt::format("{:<20} {:>12} {:>12} {:>12} {:>16}\n", "trace", "cucache", "torch dflt",
                       "torch exp.", "cudaMallocAsync");
      s += fmt::format("{:<20} {:>12} {:>12} {:>12} {:>16}\n", "", "(this run)", "(H200)", "(H200)",
                       "(H200)");
    }
    const auto req = static_cast<double>(r.peak_requested_bytes);
    s += fmt::format("{:<20} {:>12.4f} {:>12.4f} {:>12.4f} {:>16.4f}\n", r.trace,
                     req == 0.0 ? 0.0 : static_cast<double>(r.cucache.min_capacity_bytes) / req,
                     t.value("torch_default_min_capacity_ratio", 0.0),
                     t.value("torch_expandable_min_capacity_ratio", 0.0),
                     t.value("cudaMallocAsync_min_capacity_ratio", 0.0));
  }
  if (!s.empty()) {
    s += "torch dflt / torch exp.: PyTorch's allocator with its defaults / with "
         "expandable_segments:True (PYTORCH_ALLOC_CONF); cucache's own H200 figures: "
         "docs/benchmarks.md\n";
  }
  return s;
}

/// What the replay table's abbreviations mean (docs/replay.md, "The table"), and where the
/// settings came from.
std::string format_legend(const std::vector<trace_result>& results, const std::string& source) {
  if (results.empty()) return {};
  const trace_result& first = results.front();
  std::string s = "\nlegend:\n";
  const auto line = [&](const char* name, const std::string& text) {
    s += fmt::format("  {:<10} {}\n", name, text);
  };
  line("peak req", "peak of the bytes the trace held at once (requested)");
  line("peak resv", "peak of the device memory cucache held (reserved)");
  line("resv/req", "peak resv / peak req; 1.0 is the floor");
  line("dev alloc",
       "device allocations cucache made: cudaMalloc calls (cuMemCreate with "
       "expandable segments)");
  line("ns/op", first.backend == "sim"
                    ? "host time per allocate or free event, median of the repeats; on the "
                      "simulated device no device call is timed"
                    : "host time per allocate or free event, median of the repeats");
  line("frag ext",
       "external fragmentation at the reserved peak: 1 - largest free block / free "
       "bytes");
  line("frag ovh", "overhead fragmentation at the reserved peak: unused share of reserved");
  if (first.capacity_bytes) {
    line("fits, ooms", "whether every allocation succeeded under --capacity-gib; how many failed");
  }
  if (first.warm) {
    line("warm", "the second pass through the cache the first pass filled (cold ns: the first)");
  }
  const bool any_peers = std::any_of(results.begin(), results.end(),
                                     [](const trace_result& r) { return !r.peers.empty(); });
  if (any_peers) {
    line("cucache/peer", "cucache's figure over the peer's, same run (below 1: cucache lower)");
  }
  s += fmt::format("config from: {}\n", source);
  return s;
}

/// "trace k of N: " before the progress line's phases, when there is more than one trace.
void set_trace_prefix(progress* line, std::size_t index, std::size_t count) {
  if (line != nullptr && count > 1) line->prefix(fmt::format("trace {} of {}: ", index + 1, count));
}

/// What the --fit table's columns mean.
std::string format_fit_legend() {
  std::string s = "\nlegend:\n";
  const auto line = [&](const char* name, const char* text) {
    s += fmt::format("  {:<14} {}\n", name, text);
  };
  line("peak req", "peak of the bytes the trace held at once (requested)");
  line("min capacity",
       "the smallest memory limit under which the trace replays with no "
       "out-of-memory, found in this run");
  line("min/req", "min capacity / peak req; 1.0 is the floor");
  line("fails at",
       "the largest limit tried that failed (one resolution step below min capacity, "
       "or below peak req)");
  line("unconstr resv", "peak reserved of a replay without a limit (the bisection's upper bound)");
  line("resv/req", "unconstr resv / peak req");
  line("replays", "replays the bisection made; seconds: their host time");
  return s;
}

/// --timeline: one trace, and an output that names a file in an existing directory (checked
/// before the replay; the page itself is written through a temporary file, renamed).
void check_timeline_output(const std::string& out, std::size_t traces) {
  namespace fs = std::filesystem;
  if (traces != 1) {
    throw invalid_argument(
        fmt::format("--timeline {}: give exactly one trace (got {})", out, traces));
  }
  const fs::path p(out);
  std::error_code ec;
  if (p.filename().empty() || fs::is_directory(p, ec)) {
    throw invalid_argument(fmt::format("--timeline {}: not a file name", out));
  }
  const fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  if (!fs::is_directory(dir, ec)) {
    throw invalid_argument(
        fmt::format("--timeline {}: cannot write: no directory {}", out, dir.string()));
  }
}

/// load_trace that keeps the rows too (the timeline shows each allocation's line and thread).
prepared_trace load_trace_keeping(const std::string& path, std::optional<int> device,
                                  std::vector<trace_event>& events) {
  loaded_events loaded = read_events(path, device);
  prepared_trace t = prepare(loaded, trace_name(path));
  events = std::move(loaded.events);
  return t;
}

/// A PyTorch snapshot's note (what its reading did), one line on stderr.
void say_note(const prepared_trace& t, progress* line, std::ostream& err) {
  if (t.source_note.empty()) return;
  if (line != nullptr) line->clear();
  err << "cucache-replay: " << t.name << ": " << t.source_note << '\n';
}

void write_timeline(const std::string& out, const prepared_trace& trace,
                    const std::vector<trace_event>& events, const options& opts,
                    const trace_result& r, progress* line, std::ostream& err) {
  report(line, fmt::format("{}: timeline replay", trace.name));
  const nlohmann::json data = timeline_data(trace, &events, opts);
  const auto peak = data["peak"]["reserved_bytes"].get<std::size_t>();
  if (opts.backend == backend_kind::sim && peak != r.figures.peak_reserved_bytes) {
    throw error(
        fmt::format("--timeline: {}: the timeline's reserved peak {} differs from the "
                    "replay's {}",
                    trace.name, peak, r.figures.peak_reserved_bytes));
  }
  const std::string html = timeline_html(data);
  write_file_atomically(out, html);
  if (line != nullptr) line->clear();
  err << fmt::format("cucache-replay: wrote the timeline of {} to {} ({:.1f} MiB)\n", trace.name,
                     out, static_cast<double>(html.size()) / static_cast<double>(1 << 20));
}

}  // namespace

int run_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err) {
  CLI::App app{
      "Replays allocation traces (RMM CSV, plain or gzip) and PyTorch memory snapshots "
      "(torch.cuda.memory._dump_snapshot pickles) through cucache and reports peak "
      "reserved memory, fragmentation and host time per allocate/free, optionally beside peer "
      "allocators on a GPU.",
      "cucache-replay"};
  std::string backend_name;
  std::string config_text;
  double capacity_gib = 0.0;
  unsigned repeat = 1;
  bool json = false;
  std::string peers_text;
  std::vector<std::string> traces;
  app.add_option("--backend", backend_name,
                 "sim or cuda (default: cuda when a GPU is usable, else sim)")
      ->check(CLI::IsMember({"sim", "cuda"}));
  auto* config_opt = app.add_option(
      "--config", config_text,
      "allocator settings in CUCACHE_CONF syntax (default: CUCACHE_CONF from the environment, "
      "else the defaults)");
  auto* capacity_opt =
      app.add_option("--capacity-gib", capacity_gib,
                     "device capacity (sim) or memory limit (cuda) in GiB; reports whether the "
                     "trace fits");
  auto* repeat_opt = app.add_option("--repeat", repeat,
                                    "timed replays per trace, each with a fresh allocator; the "
                                    "median is reported")
                         ->check(CLI::Range(1U, 1000000U));
  app.add_flag("--json", json, "one JSON object per trace per line, nothing else on stdout");
  bool warm = false;
  auto* warm_opt = app.add_flag(
      "--warm", warm,
      "steady state: each timed run replays the trace a second time through the same allocator "
      "(for cucache and every peer), after freeing what the first pass left live, and times "
      "both passes (JSON: host_ns_per_op and warm.host_ns_per_op)");
  auto* peers_opt = app.add_option(
      "--peers", peers_text,
      "comma-separated peers: cudaMalloc,cudaMallocAsync,c10 or none (default: every available "
      "one on cuda, none on sim)");
  bool fit = false;
  double fit_resolution_mib = 0.0;
  auto* fit_opt = app.add_flag(
      "--fit", fit,
      "find each trace's minimum capacity, the smallest limit under which it replays with no "
      "out-of-memory, by bisection between its peak requested bytes and its unconstrained peak "
      "reserved (for cucache, and on cuda for cudaMallocAsync and c10)");
  auto* fit_resolution_opt = app.add_option(
      "--fit-resolution-mib", fit_resolution_mib,
      "with --fit: the bisection's resolution in MiB; every limit tried is a multiple of it "
      "(default 2, the allocation granule, at which the simulated device's answer is exact)");
  std::string timeline_path;
  auto* timeline_opt = app.add_option(
      "--timeline", timeline_path,
      "also write the memory timeline of the (one) trace to this HTML file: bytes per pool and "
      "stream over the events, the peak and what was alive at it, the segment map there, device "
      "calls (docs/timeline.md)");
  timeline_opt->excludes(fit_opt);
  fit_opt->excludes(capacity_opt);
  fit_opt->excludes(repeat_opt);
  bool advise = false;
  auto* advise_opt = app.add_flag(
      "--advise", advise,
      "config advisor: replay each trace on the simulated device under candidate settings, rank "
      "them (minimum capacity by the --fit bisection, peak reserved, device and VM calls) and "
      "print the recommended CUCACHE_CONF; with --capacity-gib N, which settings fit an N GiB "
      "card; with --peers c10 (GPU), also PyTorch's allocator under each setting PyTorch shares "
      "and the recommended PYTORCH_ALLOC_CONF (PYTORCH_CUDA_ALLOC_CONF) (docs/replay.md)");
  advise_opt->excludes(fit_opt);
  advise_opt->excludes(repeat_opt);
  fit_opt->excludes(warm_opt);
  advise_opt->excludes(warm_opt);
  timeline_opt->excludes(advise_opt);
  int snapshot_device = -1;
  auto* device_opt = app.add_option(
      "--device", snapshot_device,
      "for PyTorch memory snapshots: the device whose allocation history is replayed (default: "
      "the one device that has a history)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("trace", traces,
                 "trace files: RMM CSV (plain or gzip), or PyTorch memory snapshots "
                 "(torch.cuda.memory._dump_snapshot pickles, plain or gzip)")
      ->required()
      ->check(CLI::ExistingFile);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e, out, err);
  }

  try {
    if (timeline_opt->count() > 0) check_timeline_output(timeline_path, traces.size());
    options opts;
    // The advisor replays cucache on the simulated device and PyTorch's allocator in forked
    // children: this process must not initialize CUDA (advisor.hpp, fit_c10_in_child).
    const bool have_gpu = !advise && count_devices(backend_kind::cuda).count > 0;
    if (advise) {
      opts.backend =
          backend_name.empty() ? backend_kind::sim : parse_backend_kind(backend_name, "--backend");
      check_advise(opts);
    } else if (backend_name.empty()) {
      opts.backend = have_gpu ? backend_kind::cuda : backend_kind::sim;
      if (!have_gpu) {
        err << "cucache-replay: no GPU: " << cuda_unavailable_reason()
            << "; using the simulated device\n";
      }
    } else {
      opts.backend = parse_backend_kind(backend_name, "--backend");
      if (opts.backend == backend_kind::cuda && !have_gpu) {
        throw error(fmt::format("--backend cuda: {}", cuda_unavailable_reason()));
      }
    }
    // The settings: --config, else CUCACHE_CONF from the environment (as every cucache front end
    // reads it), else the defaults; the table says which, stderr says what was ignored.
    const char* env_conf = std::getenv("CUCACHE_CONF");
    std::string config_source = "the defaults (neither --config nor CUCACHE_CONF)";
    if (advise) {
      if (env_conf != nullptr) {
        err << "cucache-replay: --advise ignores CUCACHE_CONF in the environment (the advisor "
               "tries its own candidate settings)\n";
      }
    } else if (config_opt->count() > 0) {
      opts.cfg = parse_config(config_text);
      config_source = "--config";
      if (env_conf != nullptr) {
        err << fmt::format(
            "cucache-replay: --config {} is used; CUCACHE_CONF={} in the environment is "
            "ignored\n",
            config_text, env_conf);
      }
    } else if (env_conf != nullptr) {
      opts.cfg = config_from_env();  // an error names the variable
      config_source = fmt::format("CUCACHE_CONF={} in the environment", env_conf);
      err << fmt::format("cucache-replay: settings from the environment: CUCACHE_CONF={}\n",
                         env_conf);
    }
    if (fit_resolution_opt->count() > 0 && !fit && !advise) {
      throw invalid_argument("--fit-resolution-mib requires --fit or --advise");
    }
    if (advise) {
      if (config_opt->count() > 0) {
        throw invalid_argument(
            "--advise: --config is not taken (the advisor tries its own "
            "candidate settings)");
      }
      if (peers_opt->count() > 0 && split_list(peers_text) != std::vector<std::string>{"c10"}) {
        throw invalid_argument(fmt::format(
            "--advise --peers {}: the advisor takes one peer, c10 (PyTorch's allocator, replayed "
            "on the GPU under each PYTORCH_ALLOC_CONF candidate)",
            peers_text));
      }
    }
    fit_options fit_opts;
    if (fit_resolution_opt->count() > 0) {
      const double bytes =
          std::round(fit_resolution_mib * static_cast<double>(std::size_t{1} << 20));
      check_bytes_option("--fit-resolution-mib", "MiB", fit_resolution_mib, bytes);
      fit_opts.resolution_bytes = static_cast<std::size_t>(bytes);
    }
    if (fit) check_fit(opts, fit_opts);  // before any peer is made
    if (advise && fit_opts.resolution_bytes == 0) {
      throw invalid_argument("--fit-resolution-mib: must be positive");
    }
    if (capacity_opt->count() > 0) {
      const double bytes = std::round(capacity_gib * static_cast<double>(std::size_t{1} << 30));
      check_bytes_option("--capacity-gib", "GiB", capacity_gib, bytes);
      opts.capacity_bytes = static_cast<std::size_t>(bytes);
    }
    opts.repeat = repeat;
    opts.warm = warm;
    const std::optional<int> device =
        device_opt->count() > 0 ? std::optional<int>(snapshot_device) : std::nullopt;
    std::unique_ptr<progress> progress_line = progress::for_terminal(err);
    opts.progress_line = progress_line.get();

    if (advise) {
      // Every trace is read before any advice is printed: a bad file fails the run up front.
      std::vector<prepared_trace> loaded;
      for (const std::string& path : traces) {
        loaded.push_back(load_trace(path, device));
        say_note(loaded.back(), progress_line.get(), err);
      }
      const std::optional<std::size_t> card = opts.capacity_bytes;
      opts.capacity_bytes.reset();
      for (std::size_t k = 0; k < loaded.size(); ++k) {
        const prepared_trace& trace = loaded[k];
        set_trace_prefix(progress_line.get(), k, loaded.size());
        const advice a = advise_trace(trace, opts, fit_opts, card,
                                      peers_opt->count() > 0 ? pytorch_fitter(fit_c10_in_child)
                                                             : pytorch_fitter());
        if (progress_line) progress_line->clear();
        out << (json ? to_json(a).dump() + "\n" : format_advice(a)) << std::flush;
      }
      return 0;
    }

    bool requested = false;
    if (peers_opt->count() > 0) {
      opts.peers = split_list(peers_text);
      check_peer_names(opts.peers);  // a wrong name is named before where the peers may run
      if (opts.peers.size() == 1 && opts.peers.front() == "none") opts.peers.clear();
      requested = true;
      if (!opts.peers.empty() && opts.backend == backend_kind::sim) {
        throw invalid_argument("--peers: the peers run on a GPU only (--backend cuda)");
      }
    } else if (opts.backend == backend_kind::cuda) {
      opts.peers.assign(std::begin(k_peer_names), std::end(k_peer_names));
    }
    const auto peers = make_peers(opts.peers, requested, opts, err);
    std::vector<peer*> peer_ptrs;
    for (const auto& p : peers) {
      // --fit by default fits every peer a limit can hold; one asked for by name that cannot
      // be held is an error (fit_trace).
      if (fit && !requested && !p->limitable()) continue;
      peer_ptrs.push_back(p.get());
    }

    if (fit) {
      std::vector<fit_result> fits;
      for (std::size_t k = 0; k < traces.size(); ++k) {
        const std::string& path = traces[k];
        set_trace_prefix(progress_line.get(), k, traces.size());
        report(progress_line.get(), fmt::format("reading {}", path));
        const prepared_trace trace = load_trace(path, device);
        say_note(trace, progress_line.get(), err);
        fit_result r = fit_trace(trace, opts, fit_opts, peer_ptrs);
        if (progress_line) progress_line->clear();
        if (json) {
          out << to_json(r).dump() << '\n' << std::flush;
        } else {
          fits.push_back(std::move(r));
        }
      }
      progress_line.reset();
      if (!json) {
        out << format_table(fits);
        out << format_fit_legend();
        out << format_min_capacity_reference(traces, fits);
        out << fmt::format("config from: {}\n", config_source);
      }
      return 0;
    }

    std::vector<trace_result> results;
    for (std::size_t k = 0; k < traces.size(); ++k) {
      const std::string& path = traces[k];
      set_trace_prefix(progress_line.get(), k, traces.size());
      report(progress_line.get(), fmt::format("reading {}", path));
      std::vector<trace_event> events;
      const prepared_trace trace =
          timeline_path.empty() ? load_trace(path, device) : load_trace_keeping(path, device, events);
      say_note(trace, progress_line.get(), err);
      trace_result r = replay_trace(trace, opts, peer_ptrs);
      if (!timeline_path.empty()) {
        write_timeline(timeline_path, trace, events, opts, r, progress_line.get(), err);
      }
      if (progress_line) progress_line->clear();
      if (json) {
        out << to_json(r).dump() << '\n' << std::flush;
      } else {
        results.push_back(std::move(r));
      }
    }
    progress_line.reset();
    if (!json) {
      out << format_table(results);
      out << format_legend(results, config_source);
      out << format_reference(traces, results);
    }
    return 0;
  } catch (const std::exception& e) {
    err << "cucache-replay: error: " << e.what() << '\n';
    return 1;
  }
}

}  // namespace cucache::replay
