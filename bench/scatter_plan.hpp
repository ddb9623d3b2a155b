// The scatter case of cucache-bench and cucache-fastpath: 2N blocks of one size allocated, then
// every other one freed in a seeded random order, so that N free blocks of one size sit between
// live ones and none can merge with another (an allocator that keeps one size's free blocks in a
// sorted list pays O(N) per free: docs/decisions/0028-treap-bins.md). Both programs take the
// order from here, so that they time the same program.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "splitmix64.hpp"

namespace cucache::bench {

/// The free counts cucache-bench registers (512 B blocks, twice as many allocated first).
inline constexpr int k_scatter_counts[] = {1'000, 10'000, 80'000};
inline constexpr std::size_t k_scatter_bytes = 512;

/// The order in which the scatter case frees: the odd slots 1, 3, ..., 2n-1 of 2n live blocks,
/// shuffled (Fisher-Yates over SplitMix64 with a fixed seed).
inline std::vector<std::size_t> scatter_free_order(std::size_t n) {
  std::vector<std::size_t> order(n);
  for (std::size_t k = 0; k < n; ++k) order[k] = 2 * k + 1;
  splitmix64 rng(0x5CA77E2);
  for (std::size_t k = n; k > 1; --k) std::swap(order[k - 1], order[rng.next() % k]);
  return order;
}

}  // namespace cucache::bench
