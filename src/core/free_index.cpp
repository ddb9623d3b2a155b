// Segregated-fit free index (see src/core/free_index.hpp).
#include "core/free_index.hpp"

#include <bit>

namespace cucache::detail {

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
