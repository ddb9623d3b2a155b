// cucache-replay --advise (advisor.hpp): candidate settings, each fitted with fit_trace (the --fit
// bisection) and measured with replay_trace, ranked.
#include "advisor.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <sstream>

#include "common/child_process.hpp"
#include "cucache/errors.hpp"
#include "peers.hpp"
#include "progress.hpp"
#include "replay_setup.hpp"

namespace cucache::replay {
namespace {

constexpr double k_gib = static_cast<double>(std::size_t{1} << 30);
constexpr std::size_t k_mib = std::size_t{1} << 20;

std::string gib(std::size_t bytes) {
  return fmt::format("{:.3f} GiB", static_cast<double>(bytes) / k_gib);
}

std::uint64_t calls(const advice_row& r) {
  return r.device_calls + r.vm_calls;
}

/// Best first. Without a capacity: the smallest minimum capacity (the smallest card the job runs
/// on), then the lowest peak reserved, then the fewest device and VM calls. With one: the rows
/// that fit first, and among them the fewest device and VM calls (all of them fit, so the
/// cheapest to run wins), then the smallest minimum capacity. Rows that failed come last. Ties
/// keep the candidate order (the defaults first).
void rank(std::vector<advice_row>& rows, bool with_capacity) {
  std::stable_sort(rows.begin(), rows.end(), [&](const advice_row& a, const advice_row& b) {
    if (a.ok != b.ok) return a.ok;
    if (!a.ok) return false;
    if (with_capacity) {
      const bool fa = a.fits.value_or(false);
      const bool fb = b.fits.value_or(false);
      if (fa != fb) return fa;
      if (fa) {
        if (calls(a) != calls(b)) return calls(a) < calls(b);
        return a.min_capacity_bytes < b.min_capacity_bytes;
      }
    }
    if (a.min_capacity_bytes != b.min_capacity_bytes) {
      return a.min_capacity_bytes < b.min_capacity_bytes;
    }
    if (a.peak_reserved_bytes != b.peak_reserved_bytes) {
      return a.peak_reserved_bytes < b.peak_reserved_bytes;
    }
    return calls(a) < calls(b);
  });
}

/// Whether PyTorch's allocator has every key of candidate `conf` (c10_has_every_key: reserve_mb
/// and coarse_handles are cucache's own).
bool pytorch_shares(const std::string& conf) {
  return c10_has_every_key(parse_config(conf));
}

}  // namespace

std::vector<std::string> advice_candidates(const prepared_trace& trace) {
  std::vector<std::string> c = {
      "",
      // Coarse handles (the default in expandable mode, docs/decisions/0022 and 0023): fewer,
      // larger handles while half the capacity is to spare; under a limit near the minimum capacity
      // it behaves as one handle per page. One handle per page (coarse_handles:0) wins where its
      // minimum capacity is lower (a program that grows from plenty into pressure).
      "expandable_segments:True",
      "expandable_segments:True,coarse_handles:0",
      "max_split_size_mb:64",
      "max_split_size_mb:128",
      "max_split_size_mb:256",
      "max_split_size_mb:512",
      "garbage_collection_threshold:0.6",
      "garbage_collection_threshold:0.8",
      "roundup_power2_divisions:2",
      "roundup_power2_divisions:4",
      "roundup_power2_divisions:8",
  };
  // reserve_mb: 90% of the peak requested bytes, in whole 2 MiB units (so that every limit the
  // bisection tries, none below the peak requested bytes, holds the reserve).
  const std::size_t reserve_mb = trace.summary.peak_requested_bytes / 10 * 9 / (2 * k_mib) * 2;
  if (reserve_mb > 0) {
    c.push_back(fmt::format("reserve_mb:{}", reserve_mb));
    c.push_back(fmt::format("expandable_segments:True,reserve_mb:{}", reserve_mb));
  }
  return c;
}

void check_advise(const options& base) {
  if (base.backend != backend_kind::sim) {
    throw invalid_argument(
        "--advise: cucache's candidates replay on the simulated device only (--backend sim); "
        "PyTorch's allocator is replayed on the GPU with --peers c10");
  }
}

namespace {

/// The first row of ranked `rows` when it was measured and, with a capacity, fits it.
const advice_row* best_row(const std::vector<advice_row>& rows,
                           std::optional<std::size_t> capacity) {
  const advice_row& top = rows.front();
  return top.ok && (!capacity || top.fits.value_or(false)) ? &top : nullptr;
}

/// defer_coalescing on top of the recommended row (advice::take_back_share): one more replay
/// under its setting with the deferral on, on the card when a capacity is given, as the measuring
/// replay is. Placement and every memory figure are the same with the deferral as without it, so
/// the row's ranking stands; only the host time differs, by the share of allocations that take
/// the held block back (k_defer_coalescing_min_share, or its expandable twin).
void weigh_defer_coalescing(advice& a, const advice_row& best, const prepared_trace& trace,
                            const options& base, std::optional<std::size_t> capacity) {
  config cfg = parse_config(best.conf);
  a.defer_min_share = cfg.expandable_segments ? k_defer_coalescing_min_share_expandable
                                              : k_defer_coalescing_min_share;
  if (cfg.defer_coalescing) {
    a.defer_note = "already in the recommended setting";
    return;
  }
  cfg.defer_coalescing = true;
  try {
    options opts = base;
    opts.cfg = cfg;
    opts.capacity_bytes = capacity;
    opts.repeat = 1;
    opts.peers.clear();
    const trace_result r = replay_trace(trace, opts);
    a.take_backs = r.stats.take_back_count;
    a.allocations = r.allocations;
  } catch (const std::exception& e) {
    a.defer_note = fmt::format("not measured: {}", e.what());
    return;
  }
  const double share = a.allocations == 0
                           ? 0.0
                           : static_cast<double>(a.take_backs) / static_cast<double>(a.allocations);
  a.take_back_share = share;
  a.defer_coalescing = share >= a.defer_min_share;
  a.defer_note = a.defer_coalescing
                     ? "added: the take-back share is at least the break-even share"
                     : "not added: the take-back share is below the break-even share";
  if (a.defer_coalescing) {
    a.recommended_conf = a.recommended_conf.empty() ? "defer_coalescing:True"
                                                    : a.recommended_conf + ",defer_coalescing:True";
  }
}

}  // namespace

advice advise_trace(const prepared_trace& trace, const options& base, const fit_options& fit,
                    std::optional<std::size_t> capacity, const pytorch_fitter& pytorch) {
  check_advise(base);
  advice a;
  a.trace = trace.name;
  a.backend = to_string(base.backend);
  a.events = trace.summary.events;
  a.peak_requested_bytes = trace.summary.peak_requested_bytes;
  a.resolution_bytes = fit.resolution_bytes;
  a.capacity_bytes = capacity;
  const std::vector<std::string> candidates = advice_candidates(trace);
  prefix_scope where(base.progress_line);
  for (std::size_t k = 0; k < candidates.size(); ++k) {
    const std::string& conf = candidates[k];
    where.set(fmt::format("cucache setting {} of {} ({}): ", k + 1, candidates.size(),
                          conf.empty() ? std::string("defaults") : conf));
    advice_row row;
    row.conf = conf;
    row.pytorch_option = pytorch_shares(conf);
    try {
      options opts = base;
      opts.cfg = parse_config(conf);
      opts.capacity_bytes.reset();
      opts.repeat = 1;
      opts.peers.clear();
      const fit_result f = fit_trace(trace, opts, fit);
      row.min_capacity_bytes = f.cucache.min_capacity_bytes;
      // The measuring replay: on the card when a capacity is given, else unconstrained.
      opts.capacity_bytes = capacity;
      const trace_result r = replay_trace(trace, opts);
      row.peak_reserved_bytes = r.figures.peak_reserved_bytes;
      row.device_calls = r.figures.device_alloc_calls + r.figures.device_free_calls;
      row.vm_calls = r.figures.vm_map_calls + r.figures.vm_unmap_calls;
      if (capacity) row.fits = row.min_capacity_bytes <= *capacity;
      row.ok = true;
    } catch (const std::exception& e) {
      row.error = e.what();
    }
    a.rows.push_back(std::move(row));
  }
  rank(a.rows, capacity.has_value());
  if (const advice_row* best = best_row(a.rows, capacity)) {
    a.recommended_conf = best->conf;
    where.set("defer_coalescing: ");
    weigh_defer_coalescing(a, *best, trace, base, capacity);
  } else {
    a.no_fit = true;
    a.defer_note = "not considered: no setting is recommended";
  }
  if (!pytorch) {
    a.pytorch_note =
        "not measured: the best PYTORCH_ALLOC_CONF (older PyTorch: PYTORCH_CUDA_ALLOC_CONF) "
        "needs PyTorch's own allocator replayed under each setting on a GPU (--peers c10)";
    const auto shared = std::find_if(a.rows.begin(), a.rows.end(), [&](const advice_row& r) {
      return r.ok && r.pytorch_option && (!capacity || r.fits.value_or(false));
    });
    if (shared != a.rows.end()) {
      a.pytorch_note += fmt::format(
          "; cucache's best among the keys PyTorch shares is '{}' (cucache's figures, not "
          "PyTorch's)",
          shared->conf.empty() ? std::string("(defaults)") : shared->conf);
    }
    return a;
  }
  // PyTorch's allocator under the same candidates, in PyTorch's spelling (c10_settings drops
  // nothing here: every candidate PyTorch shares uses shared keys only).
  const auto shared_count =
      static_cast<std::size_t>(std::count_if(candidates.begin(), candidates.end(), pytorch_shares));
  for (const std::string& conf : candidates) {
    if (!pytorch_shares(conf)) continue;
    const std::string torch_conf = c10_settings(parse_config(conf));
    advice_row row;
    if (!a.pytorch_rows.empty() && !a.pytorch_rows.front().ok) {
      // PyTorch's defaults (the first candidate) could not be replayed: neither can the rest.
      row.error = "not tried: " + a.pytorch_rows.front().error;
    } else {
      where.set(fmt::format("PyTorch setting {} of {} ({}): ", a.pytorch_rows.size() + 1,
                            shared_count,
                            torch_conf.empty() ? std::string("defaults") : torch_conf));
      report(base.progress_line, fmt::format("{}: PyTorch's allocator on the GPU", trace.name));
      row = pytorch(trace, torch_conf, fit);
    }
    row.conf = torch_conf;
    row.pytorch_option = true;
    if (row.ok && capacity) row.fits = row.min_capacity_bytes <= *capacity;
    a.pytorch_rows.push_back(std::move(row));
  }
  rank(a.pytorch_rows, capacity.has_value());
  if (const advice_row* best = best_row(a.pytorch_rows, capacity)) {
    a.pytorch_conf = best->conf;
    a.pytorch_note = "PyTorch's own allocator (c10) replayed on the GPU under each setting";
  } else if (!a.pytorch_rows.front().ok) {
    a.pytorch_note =
        fmt::format("PyTorch's allocator could not be replayed: {}", a.pytorch_rows.front().error);
  } else {
    a.pytorch_note =
        fmt::format("no PyTorch setting fits {} (PyTorch's allocator, replayed)", gib(*capacity));
  }
  return a;
}

// --- PyTorch's allocator in a child process ---------------------------------------------------

advice_row fit_c10_in_child(const prepared_trace& trace, const std::string& pytorch_conf,
                            const fit_options& fit) {
  // The child: the c10 peer under `pytorch_conf`, fitted, and replayed once more without a limit.
  const tools::child_answer answer = tools::run_in_child([&] {
    options o;
    o.backend = backend_kind::cuda;
    o.cfg = parse_config(pytorch_conf);
    o.peers = {"c10"};
    std::ostringstream notes;
    const auto peers = make_peers(o.peers, /*requested=*/true, o, notes);
    const replay_streams streams(trace, backend_kind::cuda);
    std::vector<void*> slots(trace.ops.size(), nullptr);
    const capacity_fit f = fit_peer(trace, streams.handles(), slots, *peers.front(), fit);
    const peer_run free_run = peers.front()->run(trace, streams.handles(), slots, false);
    return nlohmann::json{{"min_capacity_bytes", f.min_capacity_bytes},
                          {"peak_reserved_bytes", free_run.peak_reserved_bytes},
                          {"device_calls", free_run.device_calls}}
        .dump();
  });
  advice_row row;
  row.conf = pytorch_conf;
  if (!answer.ok) {
    row.error = answer.error;
    return row;
  }
  const nlohmann::json j = nlohmann::json::parse(answer.text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    row.error = "the c10 child process answered no result";
    return row;
  }
  row.ok = true;
  row.min_capacity_bytes = j.at("min_capacity_bytes").get<std::size_t>();
  row.peak_reserved_bytes = j.at("peak_reserved_bytes").get<std::size_t>();
  row.device_calls = j.at("device_calls").get<std::uint64_t>();
  return row;
}

namespace {

nlohmann::json rows_json(const std::vector<advice_row>& rows_in) {
  nlohmann::json rows = nlohmann::json::array();
  for (std::size_t i = 0; i < rows_in.size(); ++i) {
    const advice_row& r = rows_in[i];
    nlohmann::json j = {
        {"rank", i + 1}, {"conf", r.conf}, {"pytorch_option", r.pytorch_option}, {"ok", r.ok}};
    if (r.ok) {
      j["min_capacity_bytes"] = r.min_capacity_bytes;
      j["peak_reserved_bytes"] = r.peak_reserved_bytes;
      j["device_calls"] = r.device_calls;
      j["vm_calls"] = r.vm_calls;
      if (r.fits) j["fits"] = *r.fits;
    } else {
      j["error"] = r.error;
    }
    rows.push_back(std::move(j));
  }
  return rows;
}

}  // namespace

nlohmann::json to_json(const advice& a) {
  nlohmann::json out = {{"trace", a.trace},
                        {"backend", a.backend},
                        {"advise", true},
                        {"events", a.events},
                        {"peak_requested_bytes", a.peak_requested_bytes},
                        {"resolution_bytes", a.resolution_bytes},
                        {"rows", rows_json(a.rows)},
                        {"pytorch_cuda_alloc_conf", nullptr},
                        {"pytorch_note", a.pytorch_note}};
  if (!a.pytorch_rows.empty()) out["pytorch_rows"] = rows_json(a.pytorch_rows);
  // PyTorch reads the setting as PYTORCH_ALLOC_CONF and still as PYTORCH_CUDA_ALLOC_CONF.
  out["pytorch_alloc_conf"] = out["pytorch_cuda_alloc_conf"];
  if (a.pytorch_conf) {
    out["pytorch_alloc_conf"] = *a.pytorch_conf;
    out["pytorch_cuda_alloc_conf"] = *a.pytorch_conf;
  }
  if (a.capacity_bytes) out["capacity_bytes"] = *a.capacity_bytes;
  if (a.no_fit) {
    out["recommended_conf"] = nullptr;
  } else {
    out["recommended_conf"] = a.recommended_conf;
  }
  nlohmann::json defer = {{"recommended", a.defer_coalescing},
                          {"min_share", a.defer_min_share},
                          {"take_back_share", nullptr},
                          {"note", a.defer_note}};
  if (a.take_back_share) {
    defer["take_back_share"] = *a.take_back_share;
    defer["take_backs"] = a.take_backs;
    defer["allocations"] = a.allocations;
  }
  out["defer_coalescing"] = std::move(defer);
  return out;
}

namespace {

/// The ranked table of `rows`; `heading` names the setting column, `vm` whether VM calls are
/// known.
std::string rows_table(const advice& a, const std::vector<advice_row>& rows, const char* heading,
                       bool vm) {
  std::string s = fmt::format("{:>4}  {:<52} {:>13} {:>8} {:>14} {:>13} {:>9}{}\n", "rank", heading,
                              "min capacity", "min/req", "peak reserved", "device calls",
                              "VM calls", a.capacity_bytes ? "  fits" : "");
  const auto req = static_cast<double>(a.peak_requested_bytes);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const advice_row& r = rows[i];
    const std::string name = r.conf.empty() ? "(defaults)" : r.conf;
    if (!r.ok) {
      s += fmt::format("{:>4}  {:<52} error: {}\n", i + 1, name, r.error);
      continue;
    }
    s += fmt::format("{:>4}  {:<52} {:>13} {:>8.4f} {:>14} {:>13} {:>9}{}\n", i + 1, name,
                     gib(r.min_capacity_bytes),
                     req == 0.0 ? 0.0 : static_cast<double>(r.min_capacity_bytes) / req,
                     gib(r.peak_reserved_bytes), r.device_calls,
                     vm ? fmt::format("{}", r.vm_calls) : std::string("-"),
                     r.fits ? (*r.fits ? "  yes" : "  no") : "");
  }
  return s;
}

/// What the ranked table's columns and order mean (as the replay's and --fit's tables have).
std::string advice_legend(const advice& a) {
  std::string s = "\nlegend:\n";
  const auto line = [&](const char* name, const std::string& text) {
    s += fmt::format("  {:<14} {}\n", name, text);
  };
  line("rank", a.capacity_bytes
                   ? "best first: the settings that fit the card, fewest device and VM calls first "
                     "(then the smallest min capacity); then those that do not fit, by min capacity"
                   : "best first: the smallest min capacity, then the lowest peak reserved, then "
                     "the fewest device and VM calls; ties keep the order tried (defaults first)");
  line("min capacity",
       "the smallest memory limit under which the trace replays with no out-of-memory "
       "(bisection at the resolution above): the smallest card the job runs on");
  line("min/req", "min capacity / the trace's peak requested bytes; 1.0 is the floor");
  line("peak reserved", a.capacity_bytes ? "peak reserved bytes of a replay on the card"
                                         : "peak reserved bytes of a replay without a limit");
  line("device calls",
       "cudaMalloc and cudaFree calls of that replay (with expandable segments: "
       "cuMemCreate and cuMemRelease)");
  line("VM calls", "cuMemMap and cuMemUnmap calls of that replay (expandable segments only)");
  if (a.capacity_bytes)
    line("fits", "whether min capacity is within the card given (--capacity-gib)");
  return s;
}

/// What the advisor decided about defer_coalescing:True (advice::take_back_share).
std::string defer_line(const advice& a) {
  if (!a.take_back_share) return fmt::format("defer_coalescing: {}\n", a.defer_note);
  return fmt::format(
      "defer_coalescing: {:.1f}% of allocations took the held freed block back ({} of {}) under "
      "the recommended setting with defer_coalescing:True; {} the {:.0f}% break-even (host time "
      "only; memory figures are the same): {}\n",
      100.0 * *a.take_back_share, a.take_backs, a.allocations,
      a.defer_coalescing ? "at or above" : "below", 100.0 * a.defer_min_share,
      a.defer_coalescing ? "added to the recommendation" : "not added");
}

}  // namespace

std::string format_advice(const advice& a) {
  std::string s = fmt::format(
      "cucache-replay --advise: {} ({} events, peak requested {}) on the simulated device; "
      "minimum capacity by bisection at {} MiB{}\n",
      a.trace, a.events, gib(a.peak_requested_bytes),
      static_cast<double>(a.resolution_bytes) / static_cast<double>(k_mib),
      a.capacity_bytes ? fmt::format("; card: {}", gib(*a.capacity_bytes)) : std::string());
  s += rows_table(a, a.rows, "setting (CUCACHE_CONF)", true);
  if (a.no_fit) {
    s += fmt::format("recommended: none: no setting fits {}\n",
                     a.capacity_bytes ? gib(*a.capacity_bytes) : std::string("the device"));
  } else {
    s += fmt::format("recommended: CUCACHE_CONF={}{}\n",
                     a.recommended_conf.empty() ? "\"\"" : a.recommended_conf,
                     a.recommended_conf.empty() ? " (the defaults)" : "");
  }
  s += defer_line(a);
  if (!a.pytorch_rows.empty()) {
    s += "PyTorch's allocator (c10, on the GPU) under the settings PyTorch shares:\n";
    s += rows_table(a, a.pytorch_rows, "setting (PYTORCH_ALLOC_CONF)", false);
  }
  s += advice_legend(a);
  if (a.pytorch_conf) {
    // PyTorch reads PYTORCH_ALLOC_CONF and still PYTORCH_CUDA_ALLOC_CONF (older versions read only
    // the latter): both are named.
    const std::string value = a.pytorch_conf->empty() ? "\"\"" : *a.pytorch_conf;
    s += fmt::format(
        "recommended for PyTorch: PYTORCH_ALLOC_CONF={}{} (older PyTorch: "
        "PYTORCH_CUDA_ALLOC_CONF={}) ({})\n",
        value, a.pytorch_conf->empty() ? " (the defaults)" : "", value, a.pytorch_note);
  } else {
    s += fmt::format("PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF: {}\n", a.pytorch_note);
  }
  return s;
}

}  // namespace cucache::replay
