// Sharded pointer -> block map (see src/core/block_map.hpp).
#include "core/block_map.hpp"

#include <mutex>

namespace cucache::detail {
namespace {
constexpr std::size_t k_initial_capacity = 64;

std::size_t slot_hash(std::uintptr_t key) noexcept {
  return static_cast<std::size_t>(((key >> 9) * 0xC2B2AE3D27D4EB4FULL) >> 17);
}
}  // namespace

block_map::block_map() : shards_(std::make_unique<shard[]>(k_shards)) {}

block_map::~block_map() {
  for (std::size_t i = 0; i < k_shards; ++i) delete[] shards_[i].slots;
}

block* block_map::shard::find(std::uintptr_t key) const noexcept {
  if (slots == nullptr) return nullptr;
  for (std::size_t i = slot_hash(key) & mask;; i = (i + 1) & mask) {
    if (slots[i].key == key) return slots[i].value;
    if (slots[i].key == 0) return nullptr;
  }
}

void block_map::shard::grow() {
  const std::size_t cap = slots == nullptr ? k_initial_capacity : (mask + 1) * 2;
  slot* old = slots;
  const std::size_t old_cap = slots == nullptr ? 0 : mask + 1;
  slots = new slot[cap];
  mask = cap - 1;
  for (std::size_t i = 0; i < old_cap; ++i) {
    if (old[i].key == 0) continue;
    std::size_t j = slot_hash(old[i].key) & mask;
    while (slots[j].key != 0) j = (j + 1) & mask;
    slots[j] = old[i];
  }
  delete[] old;
}

void block_map::shard::insert(std::uintptr_t key, block* value) {
  if (slots == nullptr || (used + 1) * 2 > mask + 1) grow();
  std::size_t i = slot_hash(key) & mask;
  while (slots[i].key != 0) i = (i + 1) & mask;
  slots[i] = slot{key, value};
  ++used;
}

block* block_map::shard::take(std::uintptr_t key) noexcept {
  if (slots == nullptr) return nullptr;
  std::size_t i = slot_hash(key) & mask;
  while (slots[i].key != key) {
    if (slots[i].key == 0) return nullptr;
    i = (i + 1) & mask;
  }
  block* value = slots[i].value;
  // Backward-shift deletion keeps every probe sequence unbroken without tombstones.
  std::size_t hole = i;
  for (std::size_t j = (i + 1) & mask; slots[j].key != 0; j = (j + 1) & mask) {
    const std::size_t home = slot_hash(slots[j].key) & mask;
    // Move j into the hole unless its home lies cyclically in (hole, j].
    const bool home_between = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
    if (!home_between) {
      slots[hole] = slots[j];
      hole = j;
    }
  }
  slots[hole] = slot{};
  --used;
  return value;
}

void block_map::insert(std::uintptr_t addr, block* b) {
  shard& s = shard_of(addr);
  std::lock_guard lock(s.mu);
  s.insert(addr, b);
}

block* block_map::take(std::uintptr_t addr) noexcept {
  shard& s = shard_of(addr);
  std::lock_guard lock(s.mu);
  return s.take(addr);
}

block* block_map::find(std::uintptr_t addr) const noexcept {
  shard& s = shard_of(addr);
  std::lock_guard lock(s.mu);
  return s.find(addr);
}

std::size_t block_map::size() const noexcept {
  std::size_t n = 0;
  for (std::size_t i = 0; i < k_shards; ++i) {
    std::lock_guard lock(shards_[i].mu);
    n += shards_[i].used;
  }
  return n;
}

}  // namespace cucache::detail
