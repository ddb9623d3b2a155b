// Metrics: every statistics field of the device allocators and their tags in Prometheus' text
// exposition format (version 0.0.4), produced from the field tables (cucache/stats.hpp's
// CUCACHE_STAT_*_FIELDS, cucache/observe.hpp's CUCACHE_TAG_STAT_FIELDS): a field added there is
// exported without a change here, and one without a metric kind does not compile.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "cucache/observe.hpp"
#include "cucache/stats.hpp"

namespace cucache::detail {

/// What one device contributes: its statistics, its tags' (tag_stats order: by name) and its
/// sleeping tags' (cucache::sleeping).
struct device_metrics {
  int device = 0;
  device_stats stats;
  std::vector<tag_stat> tags;
  std::vector<sleep_stat> sleeping;
};

/// The field table of sleep_stat (after its name): X(member, metric name, unit, help), every one
/// a gauge with a sample per sleeping tag. metrics.cpp checks that it lists every member.
#define CUCACHE_SLEEP_STAT_FIELDS(X)                                                           \
  X(bytes, cucache_tag_sleeping_bytes, bytes,                                                  \
    "Device bytes a sleeping tag released, that wake maps again (no sample while awake)")     \
  X(host_bytes, cucache_tag_sleeping_host_bytes, bytes,                                        \
    "Pinned host bytes holding a sleeping tag's contents (keep_contents)")                    \
  X(copy_seconds, cucache_tag_sleep_copy_seconds, seconds,                                     \
    "Seconds the sleep of a sleeping tag spent copying its contents to the host")

/// The sub-statistic of a per-pool field a metric carries (stat's members).
enum class stat_part : std::uint8_t { current, peak, allocated, freed };

/// The metric name of `field` (for a per-pool field, of its part `part`; ignored otherwise):
/// "cucache_" + the field's name, then "_peak" / "_allocated_total" / "_freed_total" for the
/// parts of per-pool fields, "_total" for scalar counters, "_bytes" for byte scalars whose name
/// does not say so, "_ratio" for rates; a field counted in nanoseconds is exported in seconds
/// ("_ns" becomes "_seconds").
[[nodiscard]] std::string metric_name(const stat_field& field, stat_part part = stat_part::current);

/// The exposition of `devices` (in the order given), appended to `out`.
void append_metrics(std::string& out, const std::vector<device_metrics>& devices);

/// `text` as a label value: backslash, double quote and line feed escaped.
[[nodiscard]] std::string escape_label_value(std::string_view text);

}  // namespace cucache::detail
