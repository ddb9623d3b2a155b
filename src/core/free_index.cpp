// Segregated-fit free index (see src/core/free_index.hpp): the rare paths, and the treap bins.
#include "core/free_index.hpp"

#include <bit>

namespace cucache::detail {

block* free_index::largest() const noexcept {
  if (level_map_ == 0) return nullptr;
  const unsigned l = 63u - static_cast<unsigned>(std::countl_zero(level_map_));
  const unsigned s = 31u - static_cast<unsigned>(std::countl_zero(sub_map_[l]));
  block* b = heads_[l * k_sub_bins + s];
  if (tagged(b)) return rightmost(untag(b));
  while (b->free_next != nullptr) b = b->free_next;
  return b;
}

bool free_index::contains(const block* b) const noexcept {
  const std::uint32_t bin = b->bin;
  if (bin >= k_bins) return false;
  if (tagged(heads_[bin])) {
    for (const block* t = untag(heads_[bin]); t != nullptr;) {
      if (t == b) return true;
      t = before(b, t) ? t->free_prev : t->free_next;
    }
    return false;
  }
  for (const block* c = heads_[bin]; c != nullptr; c = c->free_next) {
    if (c == b) return true;
  }
  return false;
}

bool free_index::well_formed() const noexcept {
  for (std::uint32_t bin = 0; bin < k_bins; ++bin) {
    const bool marked = ((sub_map_[bin / k_sub_bins] >> (bin % k_sub_bins)) & 1u) != 0;
    if (marked != (heads_[bin] != nullptr)) return false;
    if (((level_map_ >> (bin / k_sub_bins)) & 1u) != (sub_map_[bin / k_sub_bins] != 0)) {
      return false;
    }
    if (heads_[bin] == nullptr) continue;
    if (tagged(heads_[bin])) {
      const block* last = nullptr;
      if (!treap_well_formed(untag(heads_[bin]), last, ~std::uint32_t{0}, bin)) return false;
      continue;
    }
    const block* prev = nullptr;
    for (const block* b = heads_[bin]; b != nullptr; prev = b, b = b->free_next) {
      if (b->bin != bin || bin_of(b->size) != bin || b->free_prev != prev) return false;
      if (prev != nullptr && !before(prev, b)) return false;
    }
  }
  return true;
}

bool free_index::treap_well_formed(const block* t, const block*& last, std::uint32_t ceiling,
                                   std::uint32_t bin) noexcept {
  if (t == nullptr) return true;
  if (t->priority > ceiling || t->priority != priority_of(t->addr) || t->bin != bin ||
      bin_of(t->size) != bin) {
    return false;
  }
  if (!treap_well_formed(t->free_prev, last, t->priority, bin)) return false;
  if (last != nullptr && !before(last, t)) return false;
  last = t;
  return treap_well_formed(t->free_next, last, t->priority, bin);
}

// --- treap bins -------------------------------------------------------------------------------
// A binary search tree in best-fit order that is a max-heap in block::priority, a hash of the
// block's (unique) address that follows no order of the keys', so the expected depth is O(log n)
// whatever order blocks come and go in. Insert and erase are iterative: a walk down to the link
// where the node goes (or is), then a split (insert) or a merge (erase) of one subtree, each one
// path long.

std::uint32_t free_index::priority_of(std::uintptr_t addr) noexcept {
  // MurmurHash3's 64-bit finalizer, its high half.
  std::uint64_t k = addr;
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  k *= 0xc4ceb9fe1a85ec53ULL;
  k ^= k >> 33;
  return static_cast<std::uint32_t>(k >> 32);
}

block* free_index::leftmost(block* t) noexcept {
  while (t->free_prev != nullptr) t = t->free_prev;
  return t;
}

block* free_index::rightmost(block* t) noexcept {
  while (t->free_next != nullptr) t = t->free_next;
  return t;
}

block* free_index::tree_lower_bound(block* t, std::size_t bytes) noexcept {
  block* found = nullptr;
  while (t != nullptr) {
    if (t->size >= bytes) {
      found = t;  // fits: the first fit is here or to its left
      t = t->free_prev;
    } else {
      t = t->free_next;
    }
  }
  return found;
}

block* free_index::tree_successor(block* t, const block* b) noexcept {
  block* after = nullptr;
  while (t != nullptr) {
    if (before(b, t)) {
      after = t;
      t = t->free_prev;
    } else {
      t = t->free_next;
    }
  }
  return after;
}

void free_index::treap_insert(block*& root, block* n) noexcept {
  // Down to the first node n outranks: n takes its place...
  block** link = &root;
  while (*link != nullptr && (*link)->priority >= n->priority) {
    link = before(n, *link) ? &(*link)->free_prev : &(*link)->free_next;
  }
  // ...and the subtree there splits around n's key: the nodes before n become its left subtree,
  // the others its right one, each side keeping its order and heap.
  block* t = *link;
  block** left = &n->free_prev;
  block** right = &n->free_next;
  while (t != nullptr) {
    if (before(t, n)) {
      *left = t;
      left = &t->free_next;
      t = t->free_next;
    } else {
      *right = t;
      right = &t->free_prev;
      t = t->free_prev;
    }
  }
  *left = nullptr;
  *right = nullptr;
  *link = n;
}

void free_index::treap_erase(block*& root, const block* n) noexcept {
  block** link = &root;
  while (*link != n) {
    if (*link == nullptr) return;  // (n not here: a broken REQUIRES; nothing changes)
    link = before(n, *link) ? &(*link)->free_prev : &(*link)->free_next;
  }
  // n's two subtrees merge into its place: the higher priority of the two heads goes first.
  block* l = n->free_prev;
  block* r = n->free_next;
  while (l != nullptr && r != nullptr) {
    if (l->priority > r->priority) {
      *link = l;
      link = &l->free_next;
      l = l->free_next;
    } else {
      *link = r;
      link = &r->free_prev;
      r = r->free_prev;
    }
  }
  *link = l != nullptr ? l : r;
}

void free_index::to_tree(std::uint32_t bin) const noexcept {
  if (tagged(heads_[bin])) return;
  block* root = nullptr;
  for (block* b = heads_[bin]; b != nullptr;) {
    block* const n = b->free_next;
    b->priority = priority_of(b->addr);
    treap_insert(root, b);
    b = n;
  }
  heads_[bin] = tag(root);
}

void free_index::tree_place(block* b, std::uint32_t bin) noexcept {
  // REQUIRES: bin is non-empty (its bits are set).
  to_tree(bin);
  b->bin = static_cast<std::uint16_t>(bin);
  b->priority = priority_of(b->addr);
  block* root = untag(heads_[bin]);
  treap_insert(root, b);
  heads_[bin] = tag(root);
}

void free_index::tree_erase(block* b) noexcept {
  const std::uint32_t bin = b->bin;
  block* root = untag(heads_[bin]);
  treap_erase(root, b);
  if (root == nullptr) {
    heads_[bin] = nullptr;  // empty: a list bin again
    clear_bits(bin);
  } else {
    heads_[bin] = tag(root);
  }
  b->free_prev = b->free_next = nullptr;
}

block* free_index::best_fit_in_tree(std::uint32_t bin, std::size_t bytes) const noexcept {
  to_tree(bin);
  if (block* t = tree_lower_bound(untag(heads_[bin]), bytes)) return t;
  return first_above(bin);
}

}  // namespace cucache::detail
