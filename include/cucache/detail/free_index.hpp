// The free-block index of one pool: segregated size bins (16 per power of two) with a two-level
// bitmap, in the style of TLSF, each bin a list sorted by (size, address). Best fit -- the smallest
// free block at least as large as the request, lowest address first among equals -- costs one
// short list walk plus two bit scans, and no heap allocation.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "cucache/detail/block.hpp"

namespace cucache::detail {

class free_index {
 public:
  static constexpr unsigned k_sub_bins_log2 = 4;
  static constexpr unsigned k_sub_bins = 1u << k_sub_bins_log2;
  static constexpr unsigned k_levels = 64;
  static constexpr unsigned k_bins = k_levels * k_sub_bins;

  /// Bin of a block size (a multiple of 512 B). Exposed for tests.
  [[nodiscard]] static std::uint32_t bin_of(std::size_t bytes) noexcept;

  /// REQUIRES: b is free and not indexed.
  void insert(block* b) noexcept;
  /// REQUIRES: b is indexed here.
  void erase(block* b) noexcept;
  /// The smallest indexed block with size >= bytes (lowest address among equal sizes), or nullptr.
  [[nodiscard]] block* best_fit(std::size_t bytes) const noexcept;
  /// The indexed block after b in best-fit order (size, then address), or nullptr.
  [[nodiscard]] block* next_fit(const block* b) const noexcept;
  /// The largest indexed block, or nullptr.
  [[nodiscard]] block* largest() const noexcept;

  [[nodiscard]] std::size_t count() const noexcept { return count_; }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }
  [[nodiscard]] bool empty() const noexcept { return count_ == 0; }
  /// Calls f(block*) for every indexed block, in bin order.
  template <class F>
  void for_each(F&& f) const {
    for (unsigned i = 0; i < k_bins; ++i) {
      for (block* b = heads_[i]; b != nullptr;) {
        block* n = b->free_next;  // f may erase b
        f(b);
        b = n;
      }
    }
  }
  /// True when b is linked in this index (walks its bin; for invariant checks).
  [[nodiscard]] bool contains(const block* b) const noexcept;

 private:
  std::array<block*, k_bins> heads_{};
  std::uint64_t level_map_ = 0;                  // bit l: some bin of level l is non-empty
  std::array<std::uint32_t, k_levels> sub_map_{};  // bit s of level l: bin l*16+s is non-empty
  std::size_t count_ = 0;
  std::size_t bytes_ = 0;
};

}  // namespace cucache::detail
