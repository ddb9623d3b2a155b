// The free-block index of one pool: segregated size bins (16 per power of two) with a two-level
// bitmap, in the style of TLSF, each bin in (size, address) order. Best fit -- the smallest free
// block at least as large as the request, lowest address first among equals -- costs one short
// walk plus two bit scans, and no heap allocation.
//
// A bin is a sorted list while it is short (the usual case: a few blocks). A bin that a walk finds
// long -- more than k_list_walk_max blocks passed by an insert or a best fit, e.g. thousands of
// free blocks of one size, each between live ones, freed in any order -- becomes a treap with
// the same order, so that inserts, erases and lookups there cost O(log n) instead of O(n) (a
// sorted list made such a free O(n): 117 us per free at 80,000 blocks; docs/decisions/0028). It
// is a list again once it empties. Both shapes use the block's two free links (list: prev/next;
// treap: left/right children); a treap node's priority is a hash of its address, kept in
// block::priority, so the shape depends on the contents only. A treap bin's head pointer (its
// root) carries a tag bit: the list paths test it on the head they load anyway, and the treap
// paths are calls out of line.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>

#include "core/block.hpp"

namespace cucache::detail {

class free_index {
 public:
  static constexpr unsigned k_sub_bins_log2 = 4;
  static constexpr unsigned k_sub_bins = 1u << k_sub_bins_log2;
  static constexpr unsigned k_levels = 64;
  static constexpr unsigned k_bins = k_levels * k_sub_bins;

  /// Bin of a block size (a multiple of 512 B). Exposed for tests. Inline: every insert and
  /// lookup computes one.
  [[nodiscard]] static std::uint32_t bin_of(std::size_t bytes) noexcept {
    const std::size_t units = bytes / k_min_block_bytes;  // >= 1 for every real block
    if (units < k_sub_bins) return static_cast<std::uint32_t>(units);
    const unsigned level = static_cast<unsigned>(std::bit_width(units)) - 1;  // >= 4
    const unsigned sub =
        static_cast<unsigned>(units >> (level - k_sub_bins_log2)) & (k_sub_bins - 1);
    return (level - k_sub_bins_log2 + 1) * k_sub_bins + sub;
  }

  /// Bins whose walks pass this many blocks become treaps (see above). Exposed for tests.
  static constexpr unsigned k_list_walk_max = 256;
  /// True when bin `bin` is a treap now (for tests).
  [[nodiscard]] bool is_tree_bin(std::uint32_t bin) const noexcept { return tagged(heads_[bin]); }

  /// REQUIRES: b is free and not indexed.
  void insert(block* b) noexcept {
    ++changes_;
    place(b, bin_of(b->size));
  }
  /// REQUIRES: b is indexed here.
  void erase(block* b) noexcept;
  /// Indexes `in` (free, not indexed, its size set) instead of `out` (indexed). When `in` belongs
  /// in the same bin at the same place -- usual when a split or a merge changes a block by a
  /// little -- it takes over out's links without a walk; otherwise erase + insert.
  void replace(block* out, block* in) noexcept;
  /// Changes the size of indexed block b, in place when its bin and position stay right.
  void resize(block* b, std::size_t size) noexcept;
  /// The smallest indexed block with size >= bytes (lowest address among equal sizes), or nullptr.
  [[nodiscard]] block* best_fit(std::size_t bytes) const noexcept;
  /// The indexed block after b in best-fit order, or nullptr. REQUIRES: b is indexed here.
  [[nodiscard]] block* next_after(const block* b) const noexcept {
    block* head = heads_[b->bin];
    if (tagged(head)) {
      if (block* n = tree_successor(untag(head), b)) return n;
    } else if (b->free_next != nullptr) {
      return b->free_next;
    }
    return first_above(b->bin);
  }
  /// The largest indexed block, or nullptr.
  [[nodiscard]] block* largest() const noexcept;
  /// How many times the index's contents changed: every insert, erase, replace and resize
  /// counts at least one, nothing else counts (best_fit's turning a list into a treap changes
  /// the shape, not the contents). Never decreases. Two equal readings of one index therefore
  /// mean the same blocks, of the same sizes, in the same order in between: every best_fit and
  /// next_after answers as it did -- what impl::takes_back's memo relies on.
  [[nodiscard]] std::uint64_t changes() const noexcept { return changes_; }

  /// Calls f(block*) for every indexed block, in best-fit order; only the non-empty bins are
  /// visited (the bitmaps name them, read before). f may erase the block it is given, and may
  /// call best_fit, which may turn the bin being walked into a treap: the walk goes on there.
  template <class F>
  void for_each(F&& f) const {
    for (std::uint64_t levels = level_map_; levels != 0; levels &= levels - 1) {
      const unsigned l = static_cast<unsigned>(std::countr_zero(levels));
      for (std::uint32_t subs = sub_map_[l]; subs != 0; subs &= subs - 1) {
        const unsigned bin = l * k_sub_bins + static_cast<unsigned>(std::countr_zero(subs));
        bool tree = tagged(heads_[bin]);
        for (block* b = tree ? leftmost(untag(heads_[bin])) : heads_[bin]; b != nullptr;) {
          // The next block before f, which may erase b.
          block* n = tree ? tree_successor(untag(heads_[bin]), b) : b->free_next;
          f(b);
          tree = tree || tagged(heads_[bin]);  // n is in the treap f's best fit made, if so
          b = n;
        }
      }
    }
  }
  /// The indexed blocks and their bytes, counted in one walk (for_each) when asked -- by the
  /// statistics' summaries and the invariant check. Not kept as running totals: those cost every
  /// insert, erase and re-link a load and a store (about 1.5% of the allocator's instructions on
  /// the bundled traces).
  struct totals_t {
    std::size_t count = 0;
    std::size_t bytes = 0;
  };
  [[nodiscard]] totals_t totals() const noexcept {
    totals_t t;
    for_each([&](const block* b) {
      ++t.count;
      t.bytes += b->size;
    });
    return t;
  }
  /// True when b is linked in this index (walks its bin; for invariant checks).
  [[nodiscard]] bool contains(const block* b) const noexcept;
  /// The index's own invariants, checked in one walk of everything (tests, check_invariants):
  /// the bitmaps name exactly the non-empty bins; each block's `bin` is the bin it is in and its
  /// size's bin; a list is in strict best-fit order with consistent back links; a treap is in
  /// strict best-fit order in-order and a max-heap in priority, each priority the hash of its
  /// block's address.
  [[nodiscard]] bool well_formed() const noexcept;

 private:
  static constexpr std::uintptr_t k_tree_tag = 1;  // in heads_: the bin is a treap (its root)

  [[nodiscard]] static bool tagged(const block* head) noexcept {
    return (reinterpret_cast<std::uintptr_t>(head) & k_tree_tag) != 0;
  }
  [[nodiscard]] static block* untag(block* head) noexcept {
    return reinterpret_cast<block*>(reinterpret_cast<std::uintptr_t>(head) & ~k_tree_tag);
  }
  [[nodiscard]] static block* tag(block* root) noexcept {
    return reinterpret_cast<block*>(reinterpret_cast<std::uintptr_t>(root) | k_tree_tag);
  }
  /// The smallest block of a non-empty bin's head (a list's head, or a treap's leftmost node).
  [[nodiscard]] static block* smallest(block* head) noexcept {
    return tagged(head) ? leftmost(untag(head)) : head;
  }

  // --- treap bins (free_index.cpp): left child = free_prev, right child = free_next ---
  [[nodiscard]] static std::uint32_t priority_of(std::uintptr_t addr) noexcept;
  [[nodiscard]] static block* leftmost(block* t) noexcept;
  [[nodiscard]] static block* rightmost(block* t) noexcept;
  /// The first block of treap t in best-fit order with size >= bytes, or nullptr.
  [[nodiscard]] static block* tree_lower_bound(block* t, std::size_t bytes) noexcept;
  /// The block after b (indexed in treap t, or erased from it) in best-fit order, or nullptr.
  [[nodiscard]] static block* tree_successor(block* t, const block* b) noexcept;
  /// Links n (its priority set) into the treap rooted at `root`, and n->bin is the caller's.
  static void treap_insert(block*& root, block* n) noexcept;
  /// Unlinks n from the treap rooted at `root` (n's links are left as they were).
  static void treap_erase(block*& root, const block* n) noexcept;
  /// Makes list bin `bin` (non-empty) a treap, unless it is one. The representation changes,
  /// not the contents: const, for best_fit (heads_ is mutable for it).
  void to_tree(std::uint32_t bin) const noexcept;
  /// place for a treap bin, or a list bin whose walk passed k_list_walk_max (made a treap first).
  void tree_place(block* b, std::uint32_t bin) noexcept;
  void tree_erase(block* b) noexcept;
  /// best_fit for a treap bin, or a list bin whose walk passed k_list_walk_max (made a treap
  /// first).
  [[nodiscard]] block* best_fit_in_tree(std::uint32_t bin, std::size_t bytes) const noexcept;
  /// well_formed's check of treap subtree t: in strict best-fit order after `last` (updated),
  /// every priority at most `ceiling` and its block's hash, every block of `bin` and sized for it.
  [[nodiscard]] static bool treap_well_formed(const block* t, const block*& last,
                                              std::uint32_t ceiling, std::uint32_t bin) noexcept;
  void set_bits(std::uint32_t bin) noexcept {
    level_map_ |= std::uint64_t{1} << (bin / k_sub_bins);
    sub_map_[bin / k_sub_bins] |= 1u << (bin % k_sub_bins);
  }
  /// Clears bin's bits once it is empty.
  void clear_bits(std::uint32_t bin) noexcept {
    auto& sub = sub_map_[bin / k_sub_bins];
    sub &= ~(1u << (bin % k_sub_bins));
    if (sub == 0) level_map_ &= ~(std::uint64_t{1} << (bin / k_sub_bins));
  }

  [[nodiscard]] block* first_above(std::uint32_t bin) const noexcept;
  /// Links b into `bin` at its place in best-fit order (insert into a known bin).
  void place(block* b, std::uint32_t bin) noexcept;
  /// Best-fit order: size, then address.
  static bool before(std::size_t size_a, std::uintptr_t addr_a, const block* b) noexcept {
    return size_a < b->size || (size_a == b->size && addr_a < b->addr);
  }
  static bool before(const block* a, std::size_t size_b, std::uintptr_t addr_b) noexcept {
    return a->size < size_b || (a->size == size_b && a->addr < addr_b);
  }
  static bool before(const block* a, const block* b) noexcept {
    return before(a, b->size, b->addr);
  }

  // A list bin's head, or a treap bin's root | k_tree_tag. Mutable: best_fit (const) may turn a
  // long list into a treap of the same blocks in the same order.
  mutable std::array<block*, k_bins> heads_{};
  std::uint64_t level_map_ = 0;                    // bit l: some bin of level l is non-empty
  std::array<std::uint32_t, k_levels> sub_map_{};  // bit s of level l: bin l*16+s is non-empty
  std::uint64_t changes_ = 0;                      // see changes()
};

// The fast paths, inline: every allocation and free runs several of them.

inline void free_index::place(block* b, std::uint32_t bin) noexcept {
  block* cur = heads_[bin];
  // The two rare paths are tail calls, so that the list path saves no registers.
  if (tagged(cur)) [[unlikely]]
    return tree_place(b, bin);
  b->bin = static_cast<std::uint16_t>(bin);
  block* prev = nullptr;
  unsigned walked = 0;
  // (Spelled out rather than before(cur, b), which costs the traces 1-3% more instructions.)
  while (cur != nullptr && (cur->size < b->size || (cur->size == b->size && cur->addr < b->addr))) {
    if (++walked > k_list_walk_max) [[unlikely]]
      return tree_place(b, bin);
    prev = cur;
    cur = cur->free_next;
  }
  b->free_prev = prev;
  b->free_next = cur;
  if (cur != nullptr) cur->free_prev = b;
  if (prev != nullptr) {
    prev->free_next = b;
  } else {
    heads_[bin] = b;
    set_bits(bin);
  }
}

inline void free_index::erase(block* b) noexcept {
  ++changes_;
  const std::uint32_t bin = b->bin;
  if (tagged(heads_[bin])) [[unlikely]]
    return tree_erase(b);
  block* const p = b->free_prev;
  block* const n = b->free_next;
  if (p != nullptr) {
    p->free_next = n;
  } else {
    heads_[bin] = n;
    if (n == nullptr) clear_bits(bin);
  }
  if (n != nullptr) n->free_prev = p;
  b->free_prev = b->free_next = nullptr;
}

[[gnu::always_inline]] inline void free_index::replace(block* out, block* in) noexcept {
  // Two fast paths for list bins (a treap bin's links are children: erase + place).
  ++changes_;
  const std::uint32_t bin = bin_of(in->size);
  block* p = out->free_prev;
  block* n = out->free_next;
  if (bin == out->bin && !tagged(heads_[bin]) && (p == nullptr || before(p, in->size, in->addr)) &&
      (n == nullptr || before(in->size, in->addr, n))) {
    in->bin = static_cast<std::uint16_t>(bin);
    in->free_prev = p;
    in->free_next = n;
    if (p != nullptr) {
      p->free_next = in;
    } else {
      heads_[bin] = in;
    }
    if (n != nullptr) n->free_prev = in;
    out->free_prev = out->free_next = nullptr;
    return;
  }
  if (const std::uint32_t old_bin = out->bin;
      heads_[old_bin] == out && n == nullptr && heads_[bin] == nullptr) {
    // out alone in its list bin (a treap's head is tagged), in's bin empty (a split or merge of a
    // segment's tail, every cache-hit pair of a small block): the two heads and their bits, no
    // walk.
    heads_[old_bin] = nullptr;
    clear_bits(old_bin);
    in->bin = static_cast<std::uint16_t>(bin);
    in->free_prev = in->free_next = nullptr;
    heads_[bin] = in;
    set_bits(bin);
    return;
  }
  erase(out);
  place(in, bin);
}

inline void free_index::resize(block* b, std::size_t size) noexcept {
  ++changes_;
  block* p = b->free_prev;
  block* n = b->free_next;
  const std::uint32_t bin = bin_of(size);
  if (bin == b->bin && !tagged(heads_[bin]) && (p == nullptr || before(p, size, b->addr)) &&
      (n == nullptr || before(size, b->addr, n))) {
    b->size = size;
    return;
  }
  erase(b);
  b->size = size;
  place(b, bin);
}

[[gnu::always_inline]] inline block* free_index::first_above(std::uint32_t bin) const noexcept {
  // The head of the first non-empty bin above `bin`: its smallest block, larger than any in `bin`.
  const unsigned level = bin / k_sub_bins;
  const unsigned sub = bin % k_sub_bins;
  const std::uint32_t above_in_level =
      sub + 1 < k_sub_bins ? sub_map_[level] & ~((2u << sub) - 1) : 0u;
  if (above_in_level != 0) {
    return smallest(
        heads_[level * k_sub_bins + static_cast<unsigned>(std::countr_zero(above_in_level))]);
  }
  const std::uint64_t levels_above =
      level + 1 < k_levels ? level_map_ & ~((std::uint64_t{2} << level) - 1) : 0;
  if (levels_above == 0) return nullptr;
  const unsigned l = static_cast<unsigned>(std::countr_zero(levels_above));
  return smallest(heads_[l * k_sub_bins + static_cast<unsigned>(std::countr_zero(sub_map_[l]))]);
}

// always_inline: the placement of every allocation (cucache-pair-count).
[[gnu::always_inline]] inline block* free_index::best_fit(std::size_t bytes) const noexcept {
  const std::uint32_t bin = bin_of(bytes);
  block* b = heads_[bin];
  if (tagged(b)) [[unlikely]]
    return best_fit_in_tree(bin, bytes);
  for (unsigned walked = 0; b != nullptr; b = b->free_next) {
    if (b->size >= bytes) return b;
    if (++walked > k_list_walk_max) [[unlikely]]
      return best_fit_in_tree(bin, bytes);
  }
  return first_above(bin);
}

}  // namespace cucache::detail
