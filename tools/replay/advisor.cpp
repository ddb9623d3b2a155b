// cucache-replay --advise (advisor.hpp): candidate settings, each fitted with fit_trace (the --fit
// bisection) and measured with replay_trace, ranked.
#include "advisor.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "cucache/errors.hpp"

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

}  // namespace

std::vector<std::string> advice_candidates(const prepared_trace& trace) {
  std::vector<std::string> c = {
      "",
      "expandable_segments:True",
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

advice advise_trace(const prepared_trace& trace, const options& base, const fit_options& fit,
                    std::optional<std::size_t> capacity) {
  if (base.backend != backend_kind::sim) {
    throw invalid_argument(
        "--advise replays on the simulated device only (--backend sim): ranking PyTorch's own "
        "allocator under each setting would need the c10 peer on a GPU, which the advisor does "
        "not replay");
  }
  advice a;
  a.trace = trace.name;
  a.backend = to_string(base.backend);
  a.events = trace.summary.events;
  a.peak_requested_bytes = trace.summary.peak_requested_bytes;
  a.resolution_bytes = fit.resolution_bytes;
  a.capacity_bytes = capacity;
  for (const std::string& conf : advice_candidates(trace)) {
    advice_row row;
    row.conf = conf;
    row.pytorch_option = conf.find("reserve_mb") == std::string::npos;
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
  const advice_row& best = a.rows.front();
  if (best.ok && (!capacity || best.fits.value_or(false))) {
    a.recommended_conf = best.conf;
  } else {
    a.no_fit = true;
  }
  const auto torch_best = std::find_if(a.rows.begin(), a.rows.end(), [&](const advice_row& r) {
    return r.ok && r.pytorch_option && (!capacity || r.fits.value_or(false));
  });
  a.pytorch_note =
      "not available on the simulated device: the best PYTORCH_CUDA_ALLOC_CONF needs PyTorch's "
      "own allocator (the c10 peer) replayed under each setting on a GPU, which the advisor does "
      "not do";
  if (torch_best != a.rows.end()) {
    a.pytorch_note += fmt::format(
        "; cucache's best among the keys PyTorch shares is '{}' (cucache's figures, not "
        "PyTorch's)",
        torch_best->conf.empty() ? std::string("(defaults)") : torch_best->conf);
  }
  return a;
}

nlohmann::json to_json(const advice& a) {
  nlohmann::json rows = nlohmann::json::array();
  for (std::size_t i = 0; i < a.rows.size(); ++i) {
    const advice_row& r = a.rows[i];
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
  nlohmann::json out = {{"trace", a.trace},
                        {"backend", a.backend},
                        {"advise", true},
                        {"events", a.events},
                        {"peak_requested_bytes", a.peak_requested_bytes},
                        {"resolution_bytes", a.resolution_bytes},
                        {"rows", std::move(rows)},
                        {"pytorch_cuda_alloc_conf", nullptr},
                        {"pytorch_note", a.pytorch_note}};
  if (a.capacity_bytes) out["capacity_bytes"] = *a.capacity_bytes;
  if (a.no_fit) {
    out["recommended_conf"] = nullptr;
  } else {
    out["recommended_conf"] = a.recommended_conf;
  }
  return out;
}

std::string format_advice(const advice& a) {
  std::string s = fmt::format(
      "cucache-replay --advise: {} ({} events, peak requested {}) on the simulated device; "
      "minimum capacity by bisection at {} MiB{}\n",
      a.trace, a.events, gib(a.peak_requested_bytes),
      static_cast<double>(a.resolution_bytes) / static_cast<double>(k_mib),
      a.capacity_bytes ? fmt::format("; card: {}", gib(*a.capacity_bytes)) : std::string());
  s += fmt::format("{:>4}  {:<52} {:>13} {:>8} {:>14} {:>13} {:>9}{}\n", "rank",
                   "setting (CUCACHE_CONF)", "min capacity", "min/req", "peak reserved",
                   "device calls", "VM calls", a.capacity_bytes ? "  fits" : "");
  const auto req = static_cast<double>(a.peak_requested_bytes);
  for (std::size_t i = 0; i < a.rows.size(); ++i) {
    const advice_row& r = a.rows[i];
    const std::string name = r.conf.empty() ? "(defaults)" : r.conf;
    if (!r.ok) {
      s += fmt::format("{:>4}  {:<52} error: {}\n", i + 1, name, r.error);
      continue;
    }
    s += fmt::format("{:>4}  {:<52} {:>13} {:>8.4f} {:>14} {:>13} {:>9}{}\n", i + 1, name,
                     gib(r.min_capacity_bytes),
                     req == 0.0 ? 0.0 : static_cast<double>(r.min_capacity_bytes) / req,
                     gib(r.peak_reserved_bytes), r.device_calls, r.vm_calls,
                     r.fits ? (*r.fits ? "  yes" : "  no") : "");
  }
  if (a.no_fit) {
    s += fmt::format("recommended: none: no setting fits {}\n",
                     a.capacity_bytes ? gib(*a.capacity_bytes) : std::string("the device"));
  } else {
    s += fmt::format("recommended: CUCACHE_CONF={}{}\n",
                     a.recommended_conf.empty() ? "\"\"" : a.recommended_conf,
                     a.recommended_conf.empty() ? " (the defaults)" : "");
  }
  s += fmt::format("PYTORCH_CUDA_ALLOC_CONF: {}\n", a.pytorch_note);
  return s;
}

}  // namespace cucache::replay
