// Size rules of the caching core (see src/core/size_policy.hpp).
#include "core/size_policy.hpp"

#include <algorithm>
#include <bit>
#include <iterator>
#include <limits>
#include <optional>

namespace cucache::detail {
namespace {

/// n rounded up to a multiple of m, or nullopt when that is not representable. REQUIRES: m > 0.
constexpr std::optional<std::size_t> checked_round_up(std::size_t n, std::size_t m) {
  const std::size_t rem = n % m;
  if (rem == 0) return n;
  const std::size_t add = m - rem;
  if (n > std::numeric_limits<std::size_t>::max() - add) return std::nullopt;
  return n + add;
}

}  // namespace

size_policy::size_policy(const config& cfg)
    // Expandable segments split virtual space, which costs no physical memory: the cap has
    // nothing to protect there, and any remainder of 512 B or more is split off.
    : max_split_size_(cfg.expandable_segments ? std::numeric_limits<std::size_t>::max()
                                              : cfg.max_split_size),
      max_non_split_rounding_(cfg.max_non_split_rounding),
      divisions_(cfg.roundup_power2_divisions),
      pow2_divisions_(std::all_of(divisions_.begin(), divisions_.end(),
                                  [](std::uint32_t d) { return d == 0 || std::has_single_bit(d); })),
      split_any_remainder_(cfg.expandable_segments) {}

std::optional<std::size_t> size_policy::round_size_divided(std::size_t bytes) const noexcept {
  if (bytes > k_max_request_bytes) return std::nullopt;
  if (bytes <= k_min_block_bytes) return k_min_block_bytes;
  std::size_t rounded = bytes;
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
      // Near the top of the range the next step lies past SIZE_MAX (0xf000000000000000 with 4
      // divisions would wrap to 0): such a request cannot fit anywhere.
      const std::optional<std::size_t> stepped = checked_round_up(bytes, step);
      if (!stepped) return std::nullopt;
      rounded = *stepped;
    }
  }
  const std::optional<std::size_t> out = checked_round_up(rounded, k_min_block_bytes);
  if (!out || *out > k_max_request_bytes) return std::nullopt;
  return out;
}

std::size_t size_policy::largest_rounded_within(std::size_t bytes) const noexcept {
  // Rounding is monotonic, never rounds down and maps rounded sizes to themselves, so the answer
  // is the largest fixed point of round_size at most `bytes` (and at most k_max_request_bytes,
  // past which nothing is rounded). With power-of-two divisions the fixed points of the interval
  // [f, 2f) (f a power of two, f >= 512) are: f itself, and the multiples of 512 -- or, where the
  // interval's division d > 1 applies to all of it (f > 512 d), the multiples of the step f / d
  // (a power of two above 512, so a multiple of 512). The largest at most x, for x in [f, 2f), is
  // x rounded down to that unit: it is at least f. (Where f <= 512 d the divided rule applies
  // only above 512 d, with a step f / d <= 512 that divides 512: multiples of 512 again.)
  if (!pow2_divisions_) [[unlikely]]
    return largest_rounded_within_by_search(bytes);
  const std::size_t x = std::min(bytes, k_max_request_bytes) & ~(k_min_block_bytes - 1);
  if (x == 0 || divisions_.empty()) return x;
  const std::size_t f = std::bit_floor(x);
  const int log2 = static_cast<int>(std::bit_width(x)) - 1;
  const std::size_t index = log2 <= 20 ? 0 : static_cast<std::size_t>(log2 - 20);
  const std::size_t div = divisions_[index < divisions_.size() ? index : divisions_.size() - 1];
  if (div <= 1 || f <= k_min_block_bytes * div) return x;
  const std::size_t step = f / div;
  return x / step * step;
}

std::size_t size_policy::largest_rounded_within_by_search(std::size_t bytes) const noexcept {
  // Rounding is monotonic, never rounds down and maps rounded sizes to themselves, so the largest
  // multiple of 512 whose rounded size fits is itself a rounded size.
  const auto fits = [&](std::size_t units) {
    const std::optional<std::size_t> r = round_size(units * k_min_block_bytes);
    return r && *r <= bytes;
  };
  std::size_t lo = 0;  // in units of k_min_block_bytes; 0: none
  std::size_t hi = bytes / k_min_block_bytes;
  if (hi != 0 && fits(hi)) return hi * k_min_block_bytes;  // plain 512 B rounding
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo * k_min_block_bytes;
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

std::size_t size_policy::largest_growable_within(std::size_t room, pool_kind kind) const noexcept {
  // segment_size is non-decreasing in the rounded size between the bounds where its rule changes
  // (the shared-segment bound, max_split_size): within each such piece the largest size whose
  // segment fits is found by bisection; the answer is the best piece's.
  const std::size_t top = largest_rounded_within(k_max_request_bytes);
  std::size_t bounds[3] = {k_large_shared_below_bytes - 1,
                           max_split_size_ > 0 ? max_split_size_ - 1 : 0, top};
  std::sort(std::begin(bounds), std::end(bounds));
  std::size_t best = 0;
  std::size_t below = kind == pool_kind::small ? 0 : k_small_request_max_bytes;  // piece: (below, hi]
  const std::size_t kind_top = kind == pool_kind::small ? k_small_request_max_bytes : top;
  for (std::size_t hi : bounds) {
    hi = std::min(hi, kind_top);
    if (hi <= below) continue;
    // The piece's smallest rounded size; rounded sizes in (below, hi] share one monotonic rule.
    const std::optional<std::size_t> first = round_size(below + 1);
    const std::size_t piece_below = below;
    below = hi;
    if (!first || *first > hi || segment_size(*first) > room) continue;
    // In units of k_min_block_bytes (every rounded size is a multiple of it).
    const auto fits = [&](std::size_t units) {
      return segment_size(largest_rounded_within(units * k_min_block_bytes)) <= room;
    };
    std::size_t lo = *first / k_min_block_bytes;  // fits
    std::size_t up = hi / k_min_block_bytes;      // >= lo
    if (fits(up)) {
      lo = up;
    } else {
      while (up - lo > 1) {  // invariant: lo fits, up does not
        const std::size_t mid = lo + (up - lo) / 2;
        (fits(mid) ? lo : up) = mid;
      }
    }
    const std::size_t r = largest_rounded_within(lo * k_min_block_bytes);
    if (r > piece_below) best = std::max(best, r);
  }
  return best;
}

}  // namespace cucache::detail
