// counter and counter_array: one statistic of one pool (current, peak, totals), shaped for the hot
// path, and the same per pool kind with the "all" figures derived.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>

#include "core/block.hpp"
#include "cucache/stats.hpp"

namespace cucache::detail {

/// One statistic of one pool, shaped for the hot path: an increase updates current, allocated and
/// peak; a decrease only current. The public `freed` total is derived, since
/// current = base + allocated - freed, where base is current at the last reset of totals.
struct counter {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;
  std::int64_t base = 0;

  void inc(std::int64_t delta) noexcept {
    current += delta;
    allocated += delta;
    if (current > peak) peak = current;
  }
  void dec(std::int64_t delta) noexcept { current -= delta; }
  [[nodiscard]] stat get() const noexcept { return {current, peak, allocated, freed()}; }
  [[nodiscard]] std::int64_t freed() const noexcept { return base + allocated - current; }
  void reset_peak() noexcept { peak = current; }
  void reset_totals() noexcept {
    allocated = 0;
    base = current;
  }
};

/// One statistic per pool kind. The "all" figures are derived from the two kinds' sums; only
/// their peak needs state of its own (the peak of a sum is not the sum of peaks), kept as the
/// highest sum seen after an increase -- the only time the sum can reach a new peak.
struct counter_array {
  std::array<counter, 2> kind;  // [pool_kind]
  std::int64_t all_peak = 0;

  void inc(pool_kind k, std::int64_t delta) noexcept {
    kind[static_cast<int>(k)].inc(delta);
    all_peak = std::max(all_peak, kind[0].current + kind[1].current);
  }
  void dec(pool_kind k, std::int64_t delta) noexcept { kind[static_cast<int>(k)].dec(delta); }
  /// The statistic at a stat_pool slot: 0 all, 1 small, 2 large.
  [[nodiscard]] counter operator[](std::size_t slot) const noexcept {
    if (slot != 0) return kind[slot - 1];
    return {kind[0].current + kind[1].current, all_peak, kind[0].allocated + kind[1].allocated,
            kind[0].base + kind[1].base};
  }
  void reset_peak() noexcept {
    for (auto& c : kind) c.reset_peak();
    all_peak = kind[0].current + kind[1].current;
  }
  void reset_totals() noexcept {
    for (auto& c : kind) c.reset_totals();
  }
};

}  // namespace cucache::detail
