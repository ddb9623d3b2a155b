// Size rules of the caching core (see src/core/size_policy.hpp).
#include "core/size_policy.hpp"

#include <bit>

namespace cucache::detail {
namespace {

constexpr std::size_t round_up(std::size_t n, std::size_t m) {
  return (n + m - 1) / m * m;
}

}  // namespace

size_policy::size_policy(const config& cfg)
    // Expandable segments split virtual space, which costs no physical memory: the cap has
    // nothing to protect there, and any remainder of 512 B or more is split off.
    : max_split_size_(cfg.expandable_segments ? std::numeric_limits<std::size_t>::max()
                                              : cfg.max_split_size),
      max_non_split_rounding_(cfg.max_non_split_rounding),
      divisions_(cfg.roundup_power2_divisions),
      split_any_remainder_(cfg.expandable_segments) {}

std::size_t size_policy::round_size(std::size_t bytes) const noexcept {
  if (bytes <= k_min_block_bytes) return k_min_block_bytes;
  if (!divisions_.empty()) {
    // Interval i covers [2^(20+i), 2^(21+i)); interval 0 also covers everything below 2 MiB.
    const int log2 = static_cast<int>(std::bit_width(bytes)) - 1;
    const std::size_t index = log2 <= 20 ? 0 : static_cast<std::size_t>(log2 - 20);
    const std::size_t div = divisions_[index < divisions_.size() ? index : divisions_.size() - 1];
    if (div > 1 && bytes > k_min_block_bytes * div) {
      // Round up to the next of `div` equal steps between the two surrounding powers of two.
      if (std::has_single_bit(bytes)) return bytes;
      const std::size_t floor = std::bit_floor(bytes);
      const std::size_t step = std::max<std::size_t>(floor / div, 1);
      return round_up(round_up(bytes, step), k_min_block_bytes);
    }
  }
  return round_up(bytes, k_min_block_bytes);
}

std::size_t size_policy::segment_size(std::size_t rounded) const noexcept {
  if (rounded <= k_small_request_max_bytes) return k_small_segment_bytes;
  std::size_t seg = rounded < k_large_shared_below_bytes
                        ? k_large_segment_bytes
                        : round_up(rounded, k_large_segment_round_bytes);
  // With a cap under 20 MiB a shared 20 MiB segment would itself be oversize and its remainder
  // useless to requests under the cap; give such a request a segment of its own size instead.
  if (rounded < max_split_size_ && seg >= max_split_size_) {
    seg = round_up(rounded, k_large_segment_round_bytes);
  }
  return seg;
}

bool size_policy::should_split(pool_kind pool, std::size_t block_bytes,
                               std::size_t rounded) const noexcept {
  const std::size_t remaining = block_bytes - rounded;
  if (pool == pool_kind::small || split_any_remainder_) return remaining >= k_min_block_bytes;
  return rounded < max_split_size_ && remaining > k_large_split_remainder_bytes;
}

bool size_policy::may_take(std::size_t block_bytes, std::size_t rounded) const noexcept {
  if (block_bytes < rounded) return false;
  if (!is_oversize(block_bytes)) return true;
  if (rounded < max_split_size_) return false;
  return block_bytes - rounded < max_non_split_rounding_;
}

}  // namespace cucache::detail
