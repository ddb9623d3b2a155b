// Human-readable byte counts for reports ("512 B", "1.50 MiB", "3.21 GiB").
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <string>

namespace cucache::detail {

inline std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  const bool negative = bytes < 0;
  double v = negative ? -bytes : bytes;
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  if (u == 0) return fmt::format("{}{:.0f} B", negative ? "-" : "", v);
  return fmt::format("{}{:.2f} {}", negative ? "-" : "", v, units[u]);
}

/// The width of every row of memory_summary()'s text, its frame included (src/observe's table and
/// the tags' tables the API appends): the width of PyTorch's stat rows.
inline constexpr int k_summary_width = 86;

}  // namespace cucache::detail
