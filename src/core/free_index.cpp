// Segregated-fit free index (see src/core/free_index.hpp).
#include "core/free_index.hpp"

#include <bit>

namespace cucache::detail {

void free_index::link(block* b, std::uint32_t bin) noexcept {
  b->bin = bin;
  block* prev = nullptr;
  block* cur = heads_[bin];
  while (cur != nullptr && (cur->size < b->size || (cur->size == b->size && cur->addr < b->addr))) {
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
    level_map_ |= std::uint64_t{1} << (bin / k_sub_bins);
    sub_map_[bin / k_sub_bins] |= 1u << (bin % k_sub_bins);
  }
  ++count_;
  bytes_ += b->size;
}

void free_index::erase(block* b) noexcept {
  const std::uint32_t bin = b->bin;
  if (b->free_prev != nullptr) {
    b->free_prev->free_next = b->free_next;
  } else {
    heads_[bin] = b->free_next;
    if (heads_[bin] == nullptr) {
      auto& sub = sub_map_[bin / k_sub_bins];
      sub &= ~(1u << (bin % k_sub_bins));
      if (sub == 0) level_map_ &= ~(std::uint64_t{1} << (bin / k_sub_bins));
    }
  }
  if (b->free_next != nullptr) b->free_next->free_prev = b->free_prev;
  b->free_prev = b->free_next = nullptr;
  --count_;
  bytes_ -= b->size;
}

void free_index::replace(block* out, block* in) noexcept {
  const std::uint32_t bin = bin_of(in->size);
  block* p = out->free_prev;
  block* n = out->free_next;
  if (bin == out->bin && (p == nullptr || before(p, in->size, in->addr)) &&
      (n == nullptr || before(in->size, in->addr, n))) {
    in->bin = bin;
    in->free_prev = p;
    in->free_next = n;
    if (p != nullptr) {
      p->free_next = in;
    } else {
      heads_[bin] = in;
    }
    if (n != nullptr) n->free_prev = in;
    out->free_prev = out->free_next = nullptr;
    bytes_ = bytes_ - out->size + in->size;
    return;
  }
  erase(out);
  link(in, bin);
}

void free_index::resize(block* b, std::size_t size) noexcept {
  block* p = b->free_prev;
  block* n = b->free_next;
  const std::uint32_t bin = bin_of(size);
  if (bin == b->bin && (p == nullptr || before(p, size, b->addr)) &&
      (n == nullptr || before(size, b->addr, n))) {
    bytes_ = bytes_ - b->size + size;
    b->size = size;
    return;
  }
  erase(b);
  b->size = size;
  link(b, bin);
}

block* free_index::first_above(std::uint32_t bin) const noexcept {
  // The head of the first non-empty bin above `bin`: its smallest block, larger than any in `bin`.
  const unsigned level = bin / k_sub_bins;
  const unsigned sub = bin % k_sub_bins;
  const std::uint32_t above_in_level =
      sub + 1 < k_sub_bins ? sub_map_[level] & ~((2u << sub) - 1) : 0u;
  if (above_in_level != 0) {
    return heads_[level * k_sub_bins + static_cast<unsigned>(std::countr_zero(above_in_level))];
  }
  const std::uint64_t levels_above =
      level + 1 < k_levels ? level_map_ & ~((std::uint64_t{2} << level) - 1) : 0;
  if (levels_above == 0) return nullptr;
  const unsigned l = static_cast<unsigned>(std::countr_zero(levels_above));
  return heads_[l * k_sub_bins + static_cast<unsigned>(std::countr_zero(sub_map_[l]))];
}

block* free_index::best_fit(std::size_t bytes) const noexcept {
  const std::uint32_t bin = bin_of(bytes);
  for (block* b = heads_[bin]; b != nullptr; b = b->free_next) {
    if (b->size >= bytes) return b;
  }
  return first_above(bin);
}

block* free_index::next_fit(const block* b) const noexcept {
  return b->free_next != nullptr ? b->free_next : first_above(b->bin);
}

block* free_index::largest() const noexcept {
  if (level_map_ == 0) return nullptr;
  const unsigned l = 63u - static_cast<unsigned>(std::countl_zero(level_map_));
  const unsigned s = 31u - static_cast<unsigned>(std::countl_zero(sub_map_[l]));
  block* b = heads_[l * k_sub_bins + s];
  while (b->free_next != nullptr) b = b->free_next;
  return b;
}

bool free_index::contains(const block* b) const noexcept {
  if (b->bin >= k_bins) return false;
  for (const block* c = heads_[b->bin]; c != nullptr; c = c->free_next) {
    if (c == b) return true;
  }
  return false;
}

}  // namespace cucache::detail
