// The churn sequences of cucache-bench and cucache-fastpath: precomputed, so that no random
// numbers are drawn while timing, and the same on every platform (splitmix64.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "splitmix64.hpp"

namespace cucache::bench {

/// An operation is one free of a random live block plus one allocation of a log-uniform size into
/// its slot.
struct churn_plan {
  struct op {
    std::uint32_t slot;
    std::uint32_t bytes;
  };
  std::vector<std::uint32_t> initial;  // sizes of the first `live` blocks
  std::vector<op> ops;                 // a power-of-two count, replayed cyclically
};

inline churn_plan make_churn_plan(std::size_t live, std::size_t min_bytes, std::size_t max_bytes,
                                  std::uint64_t seed) {
  constexpr std::size_t k_ops = std::size_t{1} << 16;
  splitmix64 rng(seed);
  const double lo = std::log(static_cast<double>(min_bytes));
  const double hi = std::log(static_cast<double>(max_bytes));
  auto log_uniform = [&] {
    const auto b = static_cast<std::size_t>(std::exp(lo + rng.uniform() * (hi - lo)));
    return static_cast<std::uint32_t>(std::clamp(b, min_bytes, max_bytes));
  };
  churn_plan plan;
  plan.initial.reserve(live);
  for (std::size_t i = 0; i < live; ++i) plan.initial.push_back(log_uniform());
  plan.ops.reserve(k_ops);
  for (std::size_t i = 0; i < k_ops; ++i) {
    const auto slot = static_cast<std::uint32_t>(rng.next() % live);
    plan.ops.push_back({slot, log_uniform()});
  }
  return plan;
}

inline const churn_plan& small_churn_plan() {
  static const churn_plan plan = make_churn_plan(2000, 512, std::size_t{1} << 20, 0xC0FFEE01);
  return plan;
}
inline const churn_plan& large_churn_plan() {
  static const churn_plan plan = make_churn_plan(1000, 512, std::size_t{32} << 20, 0xC0FFEE02);
  return plan;
}

}  // namespace cucache::bench
