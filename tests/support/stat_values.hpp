// Every statistic of a device_stats as numbers, for comparing two readings field by field: the
// field table's order (stats.hpp's for_each_stat), a stat_array as the four counts of each entry.
#pragma once

#include <algorithm>
#include <initializer_list>
#include <string_view>
#include <type_traits>
#include <vector>

#include "cucache/stats.hpp"

namespace cucache::test {

/// The values of every field of s but those named in `except` (fields that differ by design
/// between the two readings compared: host times, a counter of the setting under test).
inline std::vector<double> stat_values(const device_stats& s,
                                       std::initializer_list<std::string_view> except = {}) {
  std::vector<double> v;
  for_each_stat(s, [&](const stat_field& f, const auto& value) {
    if (std::find(except.begin(), except.end(), f.name) != except.end()) return;
    using V = std::decay_t<decltype(value)>;
    if constexpr (std::is_same_v<V, stat_array>) {
      for (const stat& x : value) {
        v.insert(v.end(),
                 {double(x.current), double(x.peak), double(x.allocated), double(x.freed)});
      }
    } else {
      v.push_back(static_cast<double>(value));
    }
  });
  return v;
}

}  // namespace cucache::test
