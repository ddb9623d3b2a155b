// The memory timeline page of cucache-replay (--timeline OUT.html): one untimed replay of a trace
// through a fresh cucache allocator, watched through its backend (device calls) and after every
// event (bytes per pool and per stream), rendered as one self-contained HTML file. The page's
// script and style live in tools/replay/timeline/ and are embedded at build time; the data is
// JSON (nlohmann-json) in the page. See docs/timeline.md and docs/design.md ("Memory timeline").
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

#include "replay_engine.hpp"

namespace cucache::replay {

/// The most buckets a series is stored with in the page: traces with more events are stored as
/// min/max envelopes over runs of consecutive events (the maximum of every run is kept, so no
/// peak is lost); the page builds coarser levels from these for the zoomed-out views.
inline constexpr std::size_t k_timeline_max_buckets = 32768;
/// The most allocations alive at the peak that the page lists (largest first); the rest are
/// counted.
inline constexpr std::size_t k_timeline_max_peak_allocations = 2000;

struct timeline_options {
  std::size_t max_buckets = k_timeline_max_buckets;
  std::size_t max_peak_allocations = k_timeline_max_peak_allocations;
};

/// Replays `trace` (with the backend and config of `opts`, as replay_trace does) and returns the
/// page's data: bucketed series, device-call marks, the reserved peak with the allocations alive
/// at it and the segment map at that moment. `events`, when given, are the trace's rows (the
/// ones `trace` was prepared from): they add each allocation's trace line, thread and time.
/// Throws cucache::error when its own accounting disagrees with the allocator's statistics.
[[nodiscard]] nlohmann::json timeline_data(const prepared_trace& trace,
                                           const std::vector<trace_event>* events,
                                           const options& opts,
                                           const timeline_options& topts = {});

/// The complete HTML page for `data` (inline script and style, nothing fetched).
[[nodiscard]] std::string timeline_html(const nlohmann::json& data);

/// Writes `html` to `out` through a temporary file beside it, renamed into place: on any failure
/// nothing is left under `out`'s name (nor the temporary). Throws cucache::invalid_argument
/// naming the file.
void write_file_atomically(const std::filesystem::path& out, const std::string& html);

}  // namespace cucache::replay
