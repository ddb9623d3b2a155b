// Metrics in Prometheus' text exposition format (metrics.hpp).
#include "observe/metrics.hpp"

#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <iterator>
#include <type_traits>

namespace cucache::detail {

#define CUCACHE_SLEEP_STAT_SIZE_(member, ...) +sizeof(sleep_stat::member)
static_assert(sizeof(sleep_stat) ==
                  sizeof(std::string) CUCACHE_SLEEP_STAT_FIELDS(CUCACHE_SLEEP_STAT_SIZE_),
              "a member of sleep_stat is missing from CUCACHE_SLEEP_STAT_FIELDS (metrics.hpp)");
#undef CUCACHE_SLEEP_STAT_SIZE_

namespace {

constexpr std::array<stat_part, 4> k_parts = {stat_part::current, stat_part::peak,
                                              stat_part::allocated, stat_part::freed};

bool ends_with(std::string_view s, std::string_view tail) {
  return s.size() >= tail.size() && s.substr(s.size() - tail.size()) == tail;
}

const char* unit_words(stat_unit u) {
  switch (u) {
    case stat_unit::bytes:
      return "bytes";
    case stat_unit::count:
      return "count";
    case stat_unit::ns:
      return "seconds";
    case stat_unit::ratio:
      return "ratio in [0, 1]";
  }
  return "";
}

const char* part_words(stat_part p) {
  switch (p) {
    case stat_part::current:
      return "current value";
    case stat_part::peak:
      return "peak since the last peak reset";
    case stat_part::allocated:
      return "sum of increases since the last reset of accumulated stats";
    case stat_part::freed:
      return "sum of decreases since the last reset of accumulated stats";
  }
  return "";
}

bool is_counter(const stat_field& f, stat_part p) {
  if (f.shape == stat_shape::per_pool) return p == stat_part::allocated || p == stat_part::freed;
  return f.kind == stat_kind::counter;
}

std::int64_t part_of(const stat& s, stat_part p) {
  switch (p) {
    case stat_part::current:
      return s.current;
    case stat_part::peak:
      return s.peak;
    case stat_part::allocated:
      return s.allocated;
    case stat_part::freed:
      return s.freed;
  }
  return 0;
}

void header(std::string& out, std::string_view name, std::string_view help, bool counter) {
  fmt::format_to(std::back_inserter(out), "# HELP {} {}\n# TYPE {} {}\n", name, help, name,
                 counter ? "counter" : "gauge");
}

// One device_stats field: its metric families, each with a sample per device (and pool).
void append_field(std::string& out, std::size_t index, const std::vector<device_metrics>& devices) {
  const stat_field& f = k_stat_fields[index];
  const std::size_t parts = f.shape == stat_shape::per_pool ? k_parts.size() : 1;
  for (std::size_t pi = 0; pi < parts; ++pi) {
    const stat_part part = k_parts[pi];
    const std::string name = metric_name(f, part);
    const std::string help =
        f.shape == stat_shape::per_pool
            ? fmt::format("cucache device statistic {} ({}.<pool>.{} in PyTorch's memory_stats), "
                          "{}; {}",
                          f.name, f.torch_name,
                          std::array{"current", "peak", "allocated", "freed"}[pi],
                          part_words(part), unit_words(f.unit))
            : fmt::format("cucache device statistic {} ({} in PyTorch's vocabulary); {}", f.name,
                          f.torch_name, unit_words(f.unit));
    header(out, name, help, is_counter(f, part));
    for (const device_metrics& d : devices) {
      std::size_t i = 0;
      for_each_stat(d.stats, [&](const stat_field&, const auto& value) {
        if (i++ != index) return;
        using V = std::decay_t<decltype(value)>;
        if constexpr (std::is_same_v<V, stat_array>) {
          for (std::size_t pool = 0; pool < k_stat_pools; ++pool) {
            fmt::format_to(std::back_inserter(out), "{}{{device=\"{}\",pool=\"{}\"}} {}\n", name,
                           d.device, k_stat_pool_names[pool], part_of(value[pool], part));
          }
        } else if constexpr (std::is_same_v<V, std::uint64_t>) {
          if (f.unit == stat_unit::ns) {
            fmt::format_to(std::back_inserter(out), "{}{{device=\"{}\"}} {}\n", name, d.device,
                           static_cast<double>(value) / 1e9);
          } else {
            fmt::format_to(std::back_inserter(out), "{}{{device=\"{}\"}} {}\n", name, d.device,
                           value);
          }
        } else {
          fmt::format_to(std::back_inserter(out), "{}{{device=\"{}\"}} {}\n", name, d.device,
                         static_cast<double>(value));
        }
      });
    }
  }
}

}  // namespace

std::string metric_name(const stat_field& f, stat_part part) {
  std::string name = "cucache_";
  std::string_view base = f.name;
  if (f.unit == stat_unit::ns && ends_with(base, "_ns")) {
    name += base.substr(0, base.size() - 3);
    name += "_seconds";
  } else {
    name += base;
  }
  switch (f.shape) {
    case stat_shape::per_pool:
      if (part == stat_part::peak) name += "_peak";
      if (part == stat_part::allocated) name += "_allocated_total";
      if (part == stat_part::freed) name += "_freed_total";
      break;
    case stat_shape::counter:
      if (f.unit == stat_unit::bytes && !ends_with(base, "_bytes")) name += "_bytes";
      if (f.kind == stat_kind::counter) name += "_total";
      break;
    case stat_shape::rate:
      name += "_ratio";
      break;
  }
  return name;
}

std::string escape_label_value(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

void append_metrics(std::string& out, const std::vector<device_metrics>& devices) {
  for (std::size_t i = 0; i < k_stat_field_count; ++i) append_field(out, i, devices);
  // Tags: one family per field of CUCACHE_TAG_STAT_FIELDS, a sample per device and tag. A limit
  // has a sample only where one is set (no limit is not a number of bytes).
#define CUCACHE_TAG_METRIC_(member, metric, kind, unit, help)                                   \
  header(out, #metric, help, std::string_view(#kind) == "counter");                              \
  for (const device_metrics& d : devices) {                                                      \
    for (const tag_stat& t : d.tags) {                                                           \
      if (std::string_view(#member) == "limit_bytes" && t.limit_bytes == k_no_tag_limit) continue; \
      fmt::format_to(std::back_inserter(out), "{}{{device=\"{}\",tag=\"{}\"}} {}\n", #metric,   \
                     d.device, escape_label_value(t.tag), static_cast<std::uint64_t>(t.member)); \
    }                                                                                            \
  }
  CUCACHE_TAG_STAT_FIELDS(CUCACHE_TAG_METRIC_)
#undef CUCACHE_TAG_METRIC_
  // Sleeping tags (sleep and wake): gauges with a sample per tag asleep.
#define CUCACHE_SLEEP_METRIC_(member, metric, unit, help)                                      \
  header(out, #metric, help, false);                                                            \
  for (const device_metrics& d : devices) {                                                     \
    for (const sleep_stat& t : d.sleeping) {                                                    \
      fmt::format_to(std::back_inserter(out), "{}{{device=\"{}\",tag=\"{}\"}} {}\n", #metric,  \
                     d.device, escape_label_value(t.tag), t.member);                            \
    }                                                                                           \
  }
  CUCACHE_SLEEP_STAT_FIELDS(CUCACHE_SLEEP_METRIC_)
#undef CUCACHE_SLEEP_METRIC_
}

}  // namespace cucache::detail
