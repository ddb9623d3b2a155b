// The engine of cucache-replay: turns a trace into a flat array of operations, replays it through
// a fresh cucache device_allocator (simulated or real device) and through peer allocators, and
// reports memory and host-time figures as a table or JSON Lines. A library so tests can drive it.
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cucache/backend.hpp"
#include "cucache/backend_factory.hpp"
#include "cucache/config.hpp"
#include "cucache/stats.hpp"
#include "cucache/snapshot_reader.hpp"
#include "cucache/trace.hpp"

namespace cucache::replay {

/// What one event does in a replay. Events that need no call (failure rows, null or zero-byte
/// allocations and their frees) stay in the array as `none` so event indices stay slot indices.
/// sleep, sleep_keep (keep contents) and wake are a trace's sleep and wake rows: calls of the
/// allocator's sleep / wake on the op's sleep domain (expandable mode).
enum class op_kind : std::uint8_t {
  none,
  allocate,
  free,
  free_on_other_stream,
  sleep,
  sleep_keep,
  wake
};

/// One trace event, resolved ahead of the timed loop so the loop does no lookups.
struct replay_op {
  std::size_t size = 0;
  /// allocate: the slot its replay pointer goes to (its own index); free: its allocate's slot.
  std::uint32_t slot = 0;
  /// Index into prepared_trace::stream_ids.
  std::uint32_t stream = 0;
  op_kind kind = op_kind::none;
  /// allocate: the sleep domain it is made in (0: none); sleep and wake: the domain they act on.
  /// Domain d is prepared_trace::sleep_tags[d - 1].
  std::uint16_t domain = 0;
};

/// A trace ready to replay.
struct prepared_trace {
  std::string name;
  std::vector<replay_op> ops;
  /// Distinct trace stream ids, in order of first appearance.
  std::vector<std::uintptr_t> stream_ids;
  trace_summary summary;
  /// allocate + free events: the divisor of ns per op.
  std::size_t timed_events = 0;
  /// "allocate failure" rows, skipped.
  std::size_t skipped_failures = 0;
  /// Allocations of a null pointer or of zero bytes, which make no call.
  std::size_t skipped_empty = 0;
  /// The tags the trace sleeps, by first appearance: replayed as sleepable tags, allocations
  /// under them in their sleep domain (index + 1). Tags never slept are replayed untagged, as
  /// the allocator places an unsleepable tag's blocks like untagged ones.
  std::vector<std::string> sleep_tags;
  /// sleep and wake rows, and the trace line of the first sleep (0: none).
  std::size_t sleeps = 0;
  std::size_t wakes = 0;
  std::size_t first_sleep_line = 0;
  /// A PyTorch memory snapshot read as this trace (load_trace): what the reading did
  /// (torch_snapshot_trace::note), and its call stacks and segments, which the timeline shows.
  /// Empty and null for a CSV trace.
  std::string source_note;
  std::shared_ptr<const torch_snapshot_trace> snapshot;
};

/// Throws cucache::invalid_argument naming the first sleep row when `trace` sleeps and `opts`
/// cannot replay it: default mode (sleep needs expandable segments, as the API says), or peers
/// (which have no sleep).
void check_sleep_replayable(const prepared_trace& trace, bool expandable, bool peers);

/// Resolves events: every free gets the slot of the latest live allocate of its pointer.
[[nodiscard]] prepared_trace prepare(const std::vector<trace_event>& events, std::string name);
/// A trace file's rows: a CSV trace's (read_trace), or a PyTorch memory snapshot's
/// (read_torch_snapshot of `snapshot_device`, told apart by content), with its note and stacks.
struct loaded_events {
  std::vector<trace_event> events;
  std::string note;
  std::shared_ptr<const torch_snapshot_trace> snapshot;  // events moved out
};
/// Throws cucache::invalid_argument for `snapshot_device` with a CSV trace (it has no devices).
[[nodiscard]] loaded_events read_events(const std::filesystem::path& path,
                                        std::optional<int> snapshot_device = std::nullopt);
/// read_events + prepare; the name is the file name without ".gz", ".csv" and ".pickle".
[[nodiscard]] prepared_trace load_trace(const std::filesystem::path& path,
                                        std::optional<int> snapshot_device = std::nullopt);
/// prepare, carrying over what read_events found besides the rows.
[[nodiscard]] prepared_trace prepare(const loaded_events& loaded, std::string name);
/// The name load_trace gives a trace file.
[[nodiscard]] std::string trace_name(const std::filesystem::path& path);

/// Default simulated capacity: large enough that any trace fits.
inline constexpr std::size_t k_unbounded_sim_capacity = std::size_t{1} << 40;

class progress;

struct options {
  backend_kind backend = backend_kind::sim;
  config cfg;
  /// --capacity-gib in bytes: the simulated device's capacity, or a memory_limit on cuda.
  std::optional<std::size_t> capacity_bytes;
  unsigned repeat = 1;
  /// Peer names (see k_peer_names) to replay the same events through; cuda backend only.
  std::vector<std::string> peers;
  /// --warm: each timed run replays the trace twice through the same allocator (what the first
  /// pass leaves live is freed, untimed, in between) and times the second pass too, against a
  /// filled cache.
  bool warm = false;
  /// Told what is being done (progress.hpp), when set: the stderr line on a terminal.
  progress* progress_line = nullptr;
};

/// Allocator state at the moment reserved memory reached its peak.
struct fragmentation_sample {
  double external = 0.0;  // 1 - largest free block / free bytes
  double overhead = 0.0;  // device_stats::overhead_fragmentation: unused share of reserved
  std::size_t reserved_bytes = 0;
  std::size_t allocated_bytes = 0;
  std::size_t free_bytes = 0;
  std::size_t largest_free_block = 0;
  device_stats stats;  // all of them (the figures above are from it)
};

/// The memory figures of one cucache replay; on the simulated device every run must agree.
struct memory_figures {
  std::size_t peak_reserved_bytes = 0;
  std::size_t peak_allocated_bytes = 0;
  std::size_t peak_requested_bytes = 0;
  std::uint64_t device_alloc_calls = 0;
  std::uint64_t device_free_calls = 0;
  std::uint64_t oom_count = 0;
  // Expandable segments (where device allocs and frees are cuMemCreate and cuMemRelease): driver
  // mapping calls and pages moved rather than created.
  std::uint64_t vm_map_calls = 0;
  std::uint64_t vm_unmap_calls = 0;
  std::uint64_t stitched_pages = 0;
  std::uint64_t shared_pages = 0;
  std::uint64_t vm_sync_calls = 0;  // device synchronizations before unmaps
  std::uint64_t vm_splits = 0;      // idle mappings released because a block used them in part
  std::uint64_t vm_reclaims = 0;    // times memory was short and idle memory was given back
  // Sleep and wake rows replayed, and the most device bytes asleep at once (sleeping_bytes).
  std::uint64_t sleeps = 0;
  std::uint64_t wakes = 0;
  std::size_t peak_sleeping_bytes = 0;
  /// Wakes refused for lack of room (under a capacity): the tag stayed asleep.
  std::uint64_t failed_wakes = 0;

  friend bool operator==(const memory_figures&, const memory_figures&) = default;
};

/// The driver calls of the sampling replay, counted as the backend saw them, and what they would
/// cost on the H200 (docs/benchmarks.md, "Cost of each device call", medians of cucache-vm-cost;
/// a size between the measured 2, 32 and 256 MiB is interpolated on log2 of the size). A model,
/// not a measurement: on the simulated device it estimates the host time expandable mode spends
/// in VM calls.
struct vm_call_model {
  std::uint64_t create = 0, release = 0, map = 0, unmap = 0, set_access = 0;
  std::uint64_t device_synchronize = 0, mem_get_info = 0;
  double create_us = 0, release_us = 0, map_us = 0, unmap_us = 0, set_access_us = 0;
  double device_synchronize_us = 0, mem_get_info_us = 0;
  [[nodiscard]] double total_us() const noexcept {
    return create_us + release_us + map_us + unmap_us + set_access_us + device_synchronize_us +
           mem_get_info_us;
  }
  /// cuMemCreate, cuMemRelease, cuMemMap, cuMemUnmap and cuMemSetAccess calls.
  [[nodiscard]] std::uint64_t vm_calls() const noexcept {
    return create + release + map + unmap + set_access;
  }
  /// The calls and modelled time of `after` less those of `before` (a second pass).
  friend vm_call_model operator-(vm_call_model after, const vm_call_model& before) noexcept {
    after.create -= before.create;
    after.release -= before.release;
    after.map -= before.map;
    after.unmap -= before.unmap;
    after.set_access -= before.set_access;
    after.device_synchronize -= before.device_synchronize;
    after.mem_get_info -= before.mem_get_info;
    after.create_us -= before.create_us;
    after.release_us -= before.release_us;
    after.map_us -= before.map_us;
    after.unmap_us -= before.unmap_us;
    after.set_access_us -= before.set_access_us;
    after.device_synchronize_us -= before.device_synchronize_us;
    after.mem_get_info_us -= before.mem_get_info_us;
    return after;
  }
};

/// --warm: the second pass of each timed run, through the allocator the first pass filled.
struct warm_figures {
  double host_ns_per_op = 0.0;  // median over repeats
  std::vector<double> host_ns_per_op_runs;
  /// Device calls the second pass made (first run; cucache only): 0 when the first pass left
  /// everything the second needs in the cache.
  std::uint64_t device_alloc_calls = 0;
  std::uint64_t device_free_calls = 0;
  std::uint64_t vm_create_calls = 0;
  std::uint64_t vm_map_calls = 0;
  std::uint64_t vm_unmap_calls = 0;
  std::uint64_t oom_count = 0;  // allocations the second pass could not make
  /// Peak reserved over both passes (first run; cucache only).
  std::size_t peak_reserved_bytes = 0;
  /// Every driver call of the second pass of the sampling run, counted at the backend, with its
  /// modelled H200 cost (cucache only): a steady loop should make none.
  vm_call_model vm_model;
};

struct peer_result {
  std::string name;
  double host_ns_per_op = 0.0;  // median over repeats
  std::vector<double> host_ns_per_op_runs;
  std::optional<warm_figures> warm;  // --warm: host time only
  std::size_t peak_reserved_bytes = 0;
  std::uint64_t oom_count = 0;
  /// How peak_reserved_bytes was measured.
  std::string peak_source;
};

struct trace_result {
  std::string trace;
  std::string backend;
  std::string config;  // to_string of the --config given (capacity not folded in)
  std::size_t events = 0;
  std::size_t allocations = 0;
  std::size_t frees = 0;
  std::size_t streams = 0;
  std::size_t skipped_failures = 0;
  std::size_t peak_requested_bytes = 0;  // from the trace summary
  memory_figures figures;                // from cucache's stats, first run
  double reserved_over_requested = 0.0;
  double host_ns_per_op = 0.0;  // median over repeats
  std::vector<double> host_ns_per_op_runs;
  fragmentation_sample fragmentation_at_peak;
  vm_call_model vm_model;   // from the sampling run
  device_stats stats;       // at the end of the sampling run
  bool expandable = false;  // expandable_segments:True
  std::optional<std::size_t> capacity_bytes;
  std::optional<bool> fits;          // only with a capacity
  std::optional<warm_figures> warm;  // --warm
  std::vector<peer_result> peers;
};

/// Peer names accepted by --peers.
inline constexpr const char* k_peer_names[] = {"cudaMalloc", "cudaMallocAsync", "c10"};

class peer;

/// Replays one trace: `opts.repeat` timed runs, each through a fresh allocator (with --warm each
/// run times a second pass through the same allocator too), then one untimed run that samples
/// the stats at the reserved peak; then each peer, the same way. Throws cucache::error when
/// figures that must agree do not (sim runs, trace vs allocator requested peak).
[[nodiscard]] trace_result replay_trace(const prepared_trace& trace, const options& opts,
                                        std::span<peer* const> peers = {});

/// --fit: the bisection for a trace's minimum capacity, the smallest memory limit under which it
/// replays with no out-of-memory (see fit_trace).
struct fit_options {
  /// The bisection's resolution: every limit tried is a multiple of it, so the minimum found is
  /// at most this much above the true one (when failing and passing are monotonic in the limit).
  /// The default, 2 MiB, is the granule of every segment and physical handle both cucache and
  /// the simulated device allocate, so on `sim` the minimum found is the exact one.
  std::size_t resolution_bytes = std::size_t{2} << 20;
};

/// One allocator's minimum capacity for a trace.
struct capacity_fit {
  /// The smallest limit seen to pass (a multiple of the resolution).
  std::size_t min_capacity_bytes = 0;
  /// min_capacity_bytes - resolution, a limit that fails: replayed and seen to fail, or below the
  /// trace's peak requested bytes, where it cannot hold the bytes live at that moment.
  std::size_t fails_at_bytes = 0;
  bool fails_at_replayed = false;
  /// The allocator's peak reserved bytes in a replay without a limit; rounded up to the
  /// resolution, it is the bisection's upper bound.
  std::size_t unconstrained_peak_reserved_bytes = 0;
  /// The first limit seen to pass: the rounded upper bound, doubled for every time it failed
  /// (upper_bound_raises; possible when a limit changes what the allocator does).
  std::size_t upper_bound_bytes = 0;
  unsigned upper_bound_raises = 0;
  /// Replays under a limit (each stops at its first out-of-memory).
  unsigned replays = 0;
  /// Wall time of the whole fit, the unconstrained replay included.
  double seconds = 0.0;
};

struct peer_fit {
  std::string name;
  capacity_fit fit;
};

struct fit_result {
  std::string trace;
  std::string backend;
  std::string config;  // to_string of the --config given
  std::size_t events = 0;
  std::size_t allocations = 0;
  std::size_t streams = 0;
  std::size_t peak_requested_bytes = 0;  // from the trace summary: the bisection's lower bound
  std::size_t resolution_bytes = 0;
  capacity_fit cucache;
  std::vector<peer_fit> peers;
};

/// Throws cucache::invalid_argument naming the flag when `opts` and `fit` cannot go together: a
/// zero resolution, a capacity (--capacity-gib) or a memory_limit / memory_fraction in the config
/// (the fit sets the limit itself).
void check_fit(const options& opts, const fit_options& fit);

/// Finds the minimum capacity of `trace` by bisection, for cucache and for each peer, with limits
/// applied as --capacity-gib applies them (`opts.capacity_bytes` must be empty): the simulated
/// device's capacity or, on cuda, cucache's memory limit, the c10 peer's memory fraction and the
/// async pool's maxSize. Lower bound: the trace's peak requested bytes; upper bound: the peak
/// reserved of an unconstrained replay, which is replayed under and must pass (it is doubled
/// while it does not). Throws cucache::invalid_argument as check_fit does, and for a trace that
/// requests no memory or a peer that cannot be limited; cucache::error when no limit passes.
[[nodiscard]] fit_result fit_trace(const prepared_trace& trace, const options& opts,
                                   const fit_options& fit, std::span<peer* const> peers = {});

/// fit_trace's bisection for one peer alone, on the CUDA streams `streams` (one per trace stream
/// id) with `slots` (one per trace op) as scratch: an unconstrained run for the upper bound, then
/// limits applied by peer::fits. Throws cucache::invalid_argument for a peer that cannot be
/// limited, a zero resolution or a trace that requests no memory; cucache::error when no limit
/// passes.
[[nodiscard]] capacity_fit fit_peer(const prepared_trace& trace,
                                    std::span<const stream_handle> streams, std::span<void*> slots,
                                    peer& p, const fit_options& fit,
                                    progress* progress_line = nullptr);

/// The JSON object of one result (one line of --json output).
[[nodiscard]] nlohmann::json to_json(const trace_result& result);
/// The human table of several results.
[[nodiscard]] std::string format_table(std::span<const trace_result> results);
/// The same for --fit.
[[nodiscard]] nlohmann::json to_json(const fit_result& result);
[[nodiscard]] std::string format_table(std::span<const fit_result> results);

/// The whole command line tool; returns the exit status. Output goes to `out` (table or JSON
/// Lines), notes and errors to `err`.
int run_cli(int argc, const char* const* argv, std::ostream& out, std::ostream& err);

}  // namespace cucache::replay
