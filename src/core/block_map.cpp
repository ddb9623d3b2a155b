// Sharded pointer -> block map (see src/core/block_map.hpp).
#include "core/block_map.hpp"

#include <mutex>

namespace cucache::detail {
namespace {
constexpr std::size_t k_initial_capacity = 64;

}  // namespace

block_map::block_map() : shards_(std::make_unique<shard[]>(k_shards)) {
  for (std::size_t i = 0; i < k_shards; ++i) {
    lock_guard lock(shards_[i].mu);  // (no other thread yet: for the analysis)
    shards_[i].grow();
  }
}

block_map::~block_map() {
  for (std::size_t i = 0; i < k_shards; ++i) delete[] shards_[i].slots;
}

void block_map::shard::grow() {
  const std::size_t cap = slots == nullptr ? k_initial_capacity : (mask + 1) * 2;
  slot* old = slots;
  const std::size_t old_cap = slots == nullptr ? 0 : mask + 1;
  slots = new slot[cap];
  mask = cap - 1;
  grow_at = cap / 2;
  for (std::size_t i = 0; i < old_cap; ++i) {
    if (old[i].key == 0) continue;
    std::size_t j = block_map::slot_hash(old[i].key) & mask;
    while (slots[j].key != 0) j = (j + 1) & mask;
    slots[j] = old[i];
  }
  delete[] old;
}

std::size_t block_map::size() const noexcept {
  std::size_t n = 0;
  for (std::size_t i = 0; i < k_shards; ++i) {
    lock_guard lock(shards_[i].mu);
    n += shards_[i].used;
  }
  return n;
}

}  // namespace cucache::detail
