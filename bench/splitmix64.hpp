// SplitMix64: the benchmarks' random numbers (churn_plan.hpp, scatter_plan.hpp), drawn before
// timing and the same on every platform (the standard engines' distributions and std::shuffle are
// not).
#pragma once

#include <cstdint>

namespace cucache::bench {

/// SplitMix64: a tiny, well-mixed generator whose sequence is the same on every platform.
class splitmix64 {
 public:
  explicit splitmix64(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() noexcept {
    std::uint64_t z = (state_ += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
  }
  double uniform() noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

 private:
  std::uint64_t state_;
};

}  // namespace cucache::bench
