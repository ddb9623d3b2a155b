// The config advisor of cucache-replay (--advise): replays a trace on the simulated device under
// candidate settings, finds each one's minimum capacity with the --fit bisection (fit_trace),
// measures its peak reserved memory and device calls in a replay (replay_trace), and ranks them.
// With --peers c10 on a GPU it also fits PyTorch's own allocator (the c10 peer) under each
// candidate that PyTorch shares, and ranks those for the PYTORCH_CUDA_ALLOC_CONF line.
// docs/replay.md ("--advise") and docs/advisor.md.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "replay_engine.hpp"

namespace cucache::replay {

/// One candidate setting and what it did on the trace.
struct advice_row {
  /// CUCACHE_CONF text ("" = the defaults); in advice::pytorch_rows, PYTORCH_CUDA_ALLOC_CONF text.
  std::string conf;
  bool pytorch_option = true;  ///< only keys PyTorch's allocator has too (not reserve_mb)
  bool ok = false;             ///< replayed and fitted; else `error` says why
  std::string error;
  std::size_t min_capacity_bytes = 0;   ///< fit_trace's minimum capacity
  std::size_t peak_reserved_bytes = 0;  ///< in the measuring replay
  std::uint64_t device_calls = 0;       ///< cudaMalloc + cudaFree (or cuMemCreate + cuMemRelease)
  std::uint64_t vm_calls = 0;           ///< cuMemMap + cuMemUnmap
  std::optional<bool> fits;             ///< with a capacity: min capacity <= it
};

/// defer_coalescing:True (docs/advisor.md, "defer_coalescing"): added to the recommendation when at
/// least this share of the allocations, replayed under the recommended setting with the deferral
/// on, took the pool's held freed block back -- the break-even of host time on a GPU host
/// (decisions 0033 and 0034; tools/gpu_defer_break_even.sh, warm pass): since a take-back's
/// best-fit test is remembered (0034), in default mode the key cost 4-8% at every share up to 55%,
/// saved 1-2% at 73% and 7% at 97%, in each of two runs; so 75%.
/// (Instruction counts put the break-even near 20%: a free not taken back costs more time than
/// its instructions say.)
inline constexpr double k_defer_coalescing_min_share = 0.75;
/// The same in expandable mode, where a take-back also skips the page steps (decision 0032): the
/// key cost 5-23% at shares up to 22% and 0-6% at 31-44%; at 58% it saved 4% in two runs and
/// cost 2% in the third; it saved 8-15% at 76% and 8-24% at 100%. With the remembered test (0034),
/// two runs: 0-1% cost at 44%, 3-4% saved at 58%, 13-14% at 76%, 18-19% at 100%.
inline constexpr double k_defer_coalescing_min_share_expandable = 0.50;

struct advice {
  std::string trace;
  std::string backend;
  std::size_t events = 0;
  std::size_t peak_requested_bytes = 0;
  std::size_t resolution_bytes = 0;
  std::optional<std::size_t> capacity_bytes;
  std::vector<advice_row> rows;  ///< ranked, best first (see rank in advisor.cpp)
  /// The best row's CUCACHE_CONF, or "" with no_fit true when nothing fits the capacity.
  std::string recommended_conf;
  bool no_fit = false;
  /// defer_coalescing: the share of allocations that took the held block back (take_back_count /
  /// allocations) in one more replay under the best row's setting plus defer_coalescing:True; set
  /// only when that row is ok (either mode). At least defer_min_share: recommended_conf ends with
  /// ",defer_coalescing:True"
  /// (or is just that), and defer_coalescing is true.
  std::optional<double> take_back_share;
  std::uint64_t take_backs = 0;  ///< take_back_count of that replay
  std::size_t allocations = 0;   ///< the trace's allocations (that replay's)
  /// The break-even share the decision used (the mode's: k_defer_coalescing_min_share*).
  double defer_min_share = k_defer_coalescing_min_share;
  bool defer_coalescing = false;
  /// Why take_back_share is absent, or what it decided (format_advice prints it).
  std::string defer_note;
  /// PYTORCH_CUDA_ALLOC_CONF: what the advisor can say about it (see advise_trace).
  std::string pytorch_note;
  /// With a PyTorch fitter: PyTorch's own allocator under each candidate PyTorch shares, ranked
  /// as `rows` are (device_calls: c10's segment allocations and frees; vm_calls: not known, 0).
  std::vector<advice_row> pytorch_rows;
  /// The best pytorch_rows entry's PYTORCH_CUDA_ALLOC_CONF ("" = PyTorch's defaults); none when
  /// no PyTorch row was measured, or none fits the capacity.
  std::optional<std::string> pytorch_conf;
};

/// Fits PyTorch's allocator on one trace under `pytorch_conf` (PYTORCH_CUDA_ALLOC_CONF text):
/// its minimum capacity (the --fit bisection), and the peak reserved bytes and device calls of an
/// unconstrained replay. Returns a row with ok false and `error` set when it cannot.
using pytorch_fitter = std::function<advice_row(
    const prepared_trace& trace, const std::string& pytorch_conf, const fit_options& fit)>;

/// The fitter --advise --peers c10 uses: the c10 peer (libcucache_c10_peer.so, PyTorch's caching
/// allocator) on GPU 0, in a child process per setting, because c10 takes its settings once per
/// process and cannot be set back to its defaults. The child is forked: the calling process must
/// not have initialized CUDA (a forked child cannot use a CUDA context its parent made).
[[nodiscard]] advice_row fit_c10_in_child(const prepared_trace& trace,
                                          const std::string& pytorch_conf, const fit_options& fit);

/// The candidate settings for a trace: the defaults, expandable segments (coarse handles, their
/// default, and coarse_handles:0), max_split_size_mb 64, 128, 256 and 512,
/// garbage_collection_threshold 0.6 and 0.8, roundup_power2_divisions 2, 4 and 8, and reserve_mb
/// (90% of the trace's peak requested bytes) in both modes.
[[nodiscard]] std::vector<std::string> advice_candidates(const prepared_trace& trace);

/// Throws invalid_argument unless `base` replays on the simulated device (--backend sim), where
/// the advisor replays cucache's candidates. The CLI calls it before reading any trace.
void check_advise(const options& base);

/// Advises on one trace. `base.backend` must be sim (check_advise); `capacity` turns the ranking
/// into "which settings fit on a card of that many bytes". Each candidate's replay
/// and fit run on a fresh simulated device; a candidate that fails (no limit passes, a reserve
/// that does not fit) is kept as a row with its error, ranked last. With `pytorch`, each
/// candidate PyTorch shares is also fitted on PyTorch's allocator, in its PYTORCH_CUDA_ALLOC_CONF
/// spelling (c10_settings), and ranked into pytorch_rows.
[[nodiscard]] advice advise_trace(const prepared_trace& trace, const options& base,
                                  const fit_options& fit, std::optional<std::size_t> capacity,
                                  const pytorch_fitter& pytorch = {});

[[nodiscard]] nlohmann::json to_json(const advice& a);
[[nodiscard]] std::string format_advice(const advice& a);

}  // namespace cucache::replay
