// One pool's pointer -> block map (see src/core/block_map.hpp).
#include "core/block_map.hpp"

namespace cucache::detail {
namespace {
constexpr std::size_t k_initial_capacity = 64;
}  // namespace

block_map::slot block_map::no_slots_[1];

block_map::~block_map() {
  if (slots_ != no_slots_) delete[] slots_;
}

void block_map::grow() {
  const std::size_t old_cap = slots_ == no_slots_ ? 0 : mask_ + 1;
  const std::size_t cap = old_cap == 0 ? k_initial_capacity : old_cap * 2;
  slot* fresh = new slot[cap];  // the only throw: nothing changed yet
  slot* old = slots_;
  slots_ = fresh;
  mask_ = cap - 1;
  grow_at_ = cap / 4;
  for (std::size_t i = 0; i < old_cap; ++i) {
    if (old[i].key != 0) place(old[i]);
  }
  if (old_cap != 0) delete[] old;
}

}  // namespace cucache::detail
