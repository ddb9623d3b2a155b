// Every size rule of the caching core in one place: request rounding, pool choice, segment sizes,
// split rules and the max_split_size cap. The numbers are PyTorch's (see docs/design.md), so that
// figures measured against it compare like with like.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "cucache/config.hpp"

namespace cucache::detail {

inline constexpr std::size_t k_mib = std::size_t{1} << 20;
/// Every request is rounded up to a multiple of this; it is also the smallest block.
inline constexpr std::size_t k_min_block_bytes = 512;
/// Rounded requests up to and including this size go to the small pool.
inline constexpr std::size_t k_small_request_max_bytes = 1 * k_mib;
/// The small pool carves its blocks from segments of this size.
inline constexpr std::size_t k_small_segment_bytes = 2 * k_mib;
/// Large requests below this size get a shared segment of k_large_segment_bytes.
inline constexpr std::size_t k_large_shared_below_bytes = 10 * k_mib;
inline constexpr std::size_t k_large_segment_bytes = 20 * k_mib;
/// Larger requests get a segment of their own size rounded up to this.
inline constexpr std::size_t k_large_segment_round_bytes = 2 * k_mib;
/// A large-pool block is split only when strictly more than this would remain.
inline constexpr std::size_t k_large_split_remainder_bytes = 1 * k_mib;
/// The largest request, and the largest rounded size, the size rules accept: segment sizes
/// (rounded up to 2 MiB, or 20 MiB) of anything up to it do not overflow.
inline constexpr std::size_t k_max_request_bytes =
    std::numeric_limits<std::size_t>::max() - 2 * k_large_segment_bytes;

/// n rounded up to a multiple of m (m > 0).
[[nodiscard]] constexpr std::size_t round_up(std::size_t n, std::size_t m) noexcept {
  return (n + m - 1) / m * m;
}

enum class pool_kind : std::uint8_t { small = 0, large = 1 };

/// Size rules for one allocator, built from its config. Immutable after construction.
class size_policy {
 public:
  size_policy() = default;
  explicit size_policy(const config& cfg);

  /// Rounds a request up: to 512 B, or to the next power-of-two division where
  /// roundup_power2_divisions asks for it. nullopt when the request or its rounded size passes
  /// k_max_request_bytes: no device can hold it (the caller reports out of memory). The
  /// arithmetic is checked, so nothing wraps around. REQUIRES: bytes > 0.
  [[nodiscard]] std::optional<std::size_t> round_size(std::size_t bytes) const noexcept {
    if (!divisions_.empty()) [[unlikely]]
      return round_size_divided(bytes);
    // Plain 512 B rounding, inline. k_max_request_bytes is 511 mod 512, so the sum cannot wrap
    // and a rounded size past it is refused exactly as the general path refuses it.
    if (bytes > k_max_request_bytes) return std::nullopt;
    const std::size_t rounded = (bytes + (k_min_block_bytes - 1)) & ~(k_min_block_bytes - 1);
    if (rounded > k_max_request_bytes) return std::nullopt;
    return rounded < k_min_block_bytes ? k_min_block_bytes : rounded;
  }
  /// The largest rounded size at most `bytes` (0 if none): a request of that many bytes is
  /// rounded to itself, and every larger request to more than `bytes`. O(1) when every division
  /// is 0 or a power of two (what config accepts): the largest multiple of 512 -- or, where
  /// roundup_power2_divisions steps, of the step -- at most `bytes`; otherwise
  /// largest_rounded_within_by_search. Called per free block and per page boundary by the
  /// statistics' largest request (the pager's dry run), so it must not cost a search (issue 30).
  [[nodiscard]] std::size_t largest_rounded_within(std::size_t bytes) const noexcept;
  /// The same by a binary search over round_size (O(log bytes) calls): the definition, for
  /// divisions that are not powers of two, and the reference of the tests.
  [[nodiscard]] std::size_t largest_rounded_within_by_search(std::size_t bytes) const noexcept;
  [[nodiscard]] static pool_kind pool_for(std::size_t rounded) noexcept {
    return rounded <= k_small_request_max_bytes ? pool_kind::small : pool_kind::large;
  }
  /// Size of the segment to create for a rounded request that missed the cache.
  [[nodiscard]] std::size_t segment_size(std::size_t rounded) const noexcept;
  /// The largest rounded size of pool `kind` whose new segment (segment_size) is at most `room`
  /// bytes; 0 when there is none. What a new segment can serve, asked of the rule that sizes
  /// segments, so that headroom (max_allocatable) and growth cannot disagree. O(log room) calls
  /// of round_size and segment_size.
  [[nodiscard]] std::size_t largest_growable_within(std::size_t room, pool_kind kind) const noexcept;
  /// True when a free block of `block_bytes` taken for `rounded` should be split.
  [[nodiscard]] bool should_split(pool_kind pool, std::size_t block_bytes,
                                  std::size_t rounded) const noexcept {
    const std::size_t remaining = block_bytes - rounded;
    if (pool == pool_kind::small || split_any_remainder_) return remaining >= k_min_block_bytes;
    return rounded < max_split_size_ && remaining > k_large_split_remainder_bytes;
  }
  /// Blocks at or above the cap are "oversize": never split, and only taken by requests at or
  /// above the cap that waste less than max_non_split_rounding.
  [[nodiscard]] bool is_oversize(std::size_t block_bytes) const noexcept {
    return block_bytes >= max_split_size_;
  }
  /// May a free block of `block_bytes` serve a rounded request under the cap rules?
  [[nodiscard]] bool may_take(std::size_t block_bytes, std::size_t rounded) const noexcept {
    if (block_bytes < rounded) return false;
    if (!is_oversize(block_bytes)) return true;
    if (rounded < max_split_size_) return false;
    return block_bytes - rounded < max_non_split_rounding_;
  }
  [[nodiscard]] std::size_t max_split_size() const noexcept { return max_split_size_; }
  [[nodiscard]] std::size_t max_non_split_rounding() const noexcept {
    return max_non_split_rounding_;
  }

 private:
  /// round_size with roundup_power2_divisions set.
  [[nodiscard]] std::optional<std::size_t> round_size_divided(std::size_t bytes) const noexcept;

  std::size_t max_split_size_ = std::numeric_limits<std::size_t>::max();
  std::size_t max_non_split_rounding_ = 20 * k_mib;
  std::vector<std::uint32_t> divisions_;  // empty: plain 512 B rounding
  bool pow2_divisions_ = true;            // every division 0 or a power of two
  bool split_any_remainder_ = false;      // expandable segments: split both pools like the small
};

}  // namespace cucache::detail
