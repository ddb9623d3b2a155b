// run_index: the idle runs of one range (core/vm_range.hpp), by first page -- an ordered set of
// disjoint page runs [first, end) within [0, page_count), with the lookups the pager makes when a
// carve takes pages out of the idle runs and a free puts them back: the run holding a page, the
// first run that meets a span, the next run, the run starting at a page.
//
// A bitmap with a bit per page where a run starts, two summary levels above it (a bit per
// non-zero word of the level below), and a pointer per starting page (sparse_page_table). The run
// holding page pg is the run at the last start <= pg, if it ends after pg: a bit scan in pg's
// word, else one level up, else two. Every operation is a few bit operations; only a search
// that finds no run above (or below) pg in the top level's word scans further top-level words,
// one per 262,144 pages (one word for a range twice the size of a 141 GiB device in 2 MiB pages).
// None walks the runs. A std::map of the runs, its predecessor here, cost a carve or a free
// 200-400 instructions of tree walks and rebalancing once a range held a few thousand runs
// (docs/decisions/0029-run-index.md).
//
// Host memory: the bitmap (page_count / 8 bytes) and its summaries are allocated at the first
// insert; the pointers in chunks of 512 pages where runs start. Under the owner pool's mutex, like
// everything of a range.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/sparse_page_table.hpp"

namespace cucache::detail {

/// Run: a type with `std::size_t first, end` (the pager's idle_run). The index holds pointers;
/// the runs are the caller's. REQUIRES of every operation: the indexed runs are disjoint and
/// non-empty, within [0, page_count), and each is keyed by its current `first` (change it through
/// move_first only).
template <class Run>
class run_index {
 public:
  /// An index of 0 pages (a default-constructed vm_range's): it holds no run, and nothing can
  /// be inserted into it, since no page lies within [0, 0).
  run_index() = default;
  explicit run_index(std::size_t page_count) : pages_(page_count), at_(page_count) {}

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }

  /// Indexes u at u->first. REQUIRES: u disjoint from every indexed run. May throw (host memory):
  /// then nothing changed.
  void insert(Run* u) {
    if (bits_.empty()) {
      std::vector<std::uint64_t> bits((pages_ + 63) / 64);
      std::vector<std::uint64_t> summary((bits.size() + 63) / 64);
      std::vector<std::uint64_t> top((summary.size() + 63) / 64);
      at_.set(u->first, u);
      bits_.swap(bits);
      summary_.swap(summary);
      top_.swap(top);
    } else {
      at_.set(u->first, u);
    }
    set_bit(u->first);
    ++size_;
  }
  /// Removes u (indexed). Allocates nothing.
  void erase(const Run* u) noexcept {
    at_.set(u->first, nullptr);  // clearing an entry never allocates
    clear_bit(u->first);
    --size_;
  }
  /// Moves u's key to `first` and sets u->first: the run lost its lower pages or gained some
  /// below. REQUIRES: u indexed, and still disjoint from the others. May throw (host memory):
  /// then nothing changed.
  void move_first(Run* u, std::size_t first) {
    if (first == u->first) return;
    at_.set(first, u);
    at_.set(u->first, nullptr);
    clear_bit(u->first);
    set_bit(first);
    u->first = first;
  }
  /// The run starting at page pg, or nullptr.
  [[nodiscard]] Run* at(std::size_t pg) const noexcept { return at_.get(pg); }
  /// The run holding page pg (first <= pg < end), or nullptr.
  [[nodiscard]] Run* holding(std::size_t pg) const noexcept {
    Run* u = last_at_or_before(pg);
    return u != nullptr && u->end > pg ? u : nullptr;
  }
  /// The first run, in page order, that ends after pg: the run holding pg, else the first run
  /// after pg; nullptr when none. (Where a walk over the runs meeting [pg, ...] starts.)
  [[nodiscard]] Run* first_meeting(std::size_t pg) const noexcept {
    if (Run* u = holding(pg)) return u;
    return first_after(pg);
  }
  /// The run after u in page order, or nullptr. REQUIRES: u indexed, or u->first a page where
  /// no other run starts.
  [[nodiscard]] Run* next(const Run* u) const noexcept { return first_after(u->first); }
  /// The first run in page order, or nullptr.
  [[nodiscard]] Run* front() const noexcept {
    if (size_ == 0) return nullptr;
    return at_.get(bits_[0] & 1 ? 0 : next_bit(0));
  }
  /// f(Run*) for every run, in page order. f must not change the index.
  template <class F>
  void for_each(F&& f) const {
    for (Run* u = front(); u != nullptr; u = next(u)) f(u);
  }

 private:
  static constexpr std::size_t k_none = ~std::size_t{0};

  // Three levels: bits_ (a bit per page), summary_ (a bit per non-zero word of bits_), top_ (a
  // bit per non-zero word of summary_). A search that leaves its word climbs a level at a time.
  static constexpr std::uint64_t bit(std::size_t i) noexcept {
    return std::uint64_t{1} << (i % 64);
  }
  /// The bits of a word above position i (i % 64), and those at or below it.
  static constexpr std::uint64_t above(std::size_t i) noexcept {
    return i % 64 == 63 ? 0 : ~((std::uint64_t{2} << (i % 64)) - 1);
  }
  static constexpr std::uint64_t below(std::size_t i) noexcept { return bit(i) - 1; }
  static std::size_t lowest(std::size_t word, std::uint64_t v) noexcept {
    return word * 64 + static_cast<std::size_t>(std::countr_zero(v));
  }
  static std::size_t highest(std::size_t word, std::uint64_t v) noexcept {
    return word * 64 + 63 - static_cast<std::size_t>(std::countl_zero(v));
  }

  void set_bit(std::size_t pg) noexcept {
    bits_[pg / 64] |= bit(pg);
    summary_[pg / 4096] |= bit(pg / 64);
    top_[pg / 262144] |= bit(pg / 4096);
  }
  void clear_bit(std::size_t pg) noexcept {
    if ((bits_[pg / 64] &= ~bit(pg)) != 0) return;
    if ((summary_[pg / 4096] &= ~bit(pg / 64)) != 0) return;
    top_[pg / 262144] &= ~bit(pg / 4096);
  }
  /// The highest set bit <= pg, or k_none.
  [[nodiscard]] std::size_t prev_bit(std::size_t pg) const noexcept {
    const std::size_t w = pg / 64;
    if (const std::uint64_t v = bits_[w] & (below(pg) | bit(pg))) return highest(w, v);
    std::size_t s = w / 64;
    std::uint64_t sum = summary_[s] & below(w);
    if (sum == 0) {
      std::size_t t = s / 64;
      std::uint64_t top = top_[t] & below(s);
      while (top == 0) {
        if (t == 0) return k_none;
        top = top_[--t];
      }
      s = highest(t, top);
      sum = summary_[s];
    }
    const std::size_t w2 = highest(s, sum);
    return highest(w2, bits_[w2]);
  }
  /// The lowest set bit > pg, or k_none.
  [[nodiscard]] std::size_t next_bit(std::size_t pg) const noexcept {
    const std::size_t w = pg / 64;
    if (const std::uint64_t v = bits_[w] & above(pg)) return lowest(w, v);
    std::size_t s = w / 64;
    std::uint64_t sum = summary_[s] & above(w);
    if (sum == 0) {
      std::size_t t = s / 64;
      std::uint64_t top = top_[t] & above(s);
      while (top == 0) {
        if (++t == top_.size()) return k_none;
        top = top_[t];
      }
      s = lowest(t, top);
      sum = summary_[s];
    }
    const std::size_t w2 = lowest(s, sum);
    return lowest(w2, bits_[w2]);
  }
  [[nodiscard]] Run* last_at_or_before(std::size_t pg) const noexcept {
    if (size_ == 0) return nullptr;
    const std::size_t b = prev_bit(pg);
    return b == k_none ? nullptr : at_.get(b);
  }
  [[nodiscard]] Run* first_after(std::size_t pg) const noexcept {
    if (size_ == 0) return nullptr;
    const std::size_t b = next_bit(pg);
    return b == k_none ? nullptr : at_.get(b);
  }

  std::size_t pages_ = 0;
  std::size_t size_ = 0;
  std::vector<std::uint64_t> bits_;     // bit pg: a run starts at page pg
  std::vector<std::uint64_t> summary_;  // bit w: bits_[w] != 0
  std::vector<std::uint64_t> top_;      // bit s: summary_[s] != 0
  sparse_page_table<Run*> at_;          // the run starting at each page
};

}  // namespace cucache::detail
