// block_map: one pool's allocated blocks by address -- what a free looks its pointer up in, once
// the segment directory (segment_directory.hpp) has named the pool. An open-addressing table
// (linear probing, backward-shift deletion, no tombstones) at most a quarter full: a take scans
// the rest of its run, and at half full that made a free 1.5x dearer than the shards before it.
// Not synchronized: the pool's mutex guards it (stream_pool::blocks), the lock the allocation and
// free paths hold anyway, so a cache-hit pair takes no lock of its own for it
// (docs/decisions/0030-pool-block-maps.md).
//
// Contract: insert(addr, b) with addr not in the map (addr != 0) makes find(addr) and take(addr)
// return b until take(addr) removes it; find and take of an absent address return nullptr. An
// empty map holds no storage (a pool that never allocates costs nothing here). insert throws
// std::bad_alloc only when it grows the table (never right after a take), and then changes
// nothing.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/block.hpp"

namespace cucache::detail {

class block_map {
 public:
  block_map() noexcept = default;
  ~block_map();
  block_map(const block_map&) = delete;
  block_map& operator=(const block_map&) = delete;

  /// REQUIRES: addr != 0 and addr not in the map.
  void insert(std::uintptr_t addr, block* b);
  /// Removes and returns the block at addr, or nullptr when none is there.
  [[nodiscard]] block* take(std::uintptr_t addr) noexcept;
  /// The block at addr, or nullptr.
  [[nodiscard]] block* find(std::uintptr_t addr) const noexcept;
  [[nodiscard]] std::size_t size() const noexcept { return used_; }

 private:
  struct slot {
    std::uintptr_t key = 0;  // 0 = empty (no block lives at address 0)
    block* value = nullptr;
  };
  /// The one empty slot every map without storage points at: find and take read it (key 0 ends
  /// their probes), nothing writes it (insert grows first).
  static slot no_slots_[1];
  /// A key's home slot (Fibonacci hashing of the 512 B unit; bits 20 and up of the product
  /// spread the blocks of a segment as well as its top bits do, and cost no variable shift).
  [[nodiscard]] std::size_t home(std::uintptr_t key) const noexcept {
    return static_cast<std::size_t>(((key >> 9) * 0x9E3779B97F4A7C15ULL) >> 20) & mask_;
  }
  /// Puts `in` (a key not in the map) in its slot. REQUIRES: an empty slot exists.
  void place(slot in) noexcept;
  /// Doubles the table (the first: 64 slots), keeping it at most a quarter full.
  void grow();

  slot* slots_ = no_slots_;
  std::size_t mask_ = 0;  // capacity - 1 (capacity a power of two)
  std::size_t used_ = 0;
  std::size_t grow_at_ = 0;  // used count at which an insert doubles the table
};

// The allocation and free paths' steps, inline (cucache-pair-count).

inline block* block_map::find(std::uintptr_t key) const noexcept {
  for (std::size_t i = home(key);; i = (i + 1) & mask_) {
    if (slots_[i].key == key) return slots_[i].value;
    if (slots_[i].key == 0) return nullptr;
  }
}

[[gnu::always_inline]] inline void block_map::insert(std::uintptr_t key, block* value) {
  if (used_ >= grow_at_) [[unlikely]]
    grow();  // (at most a quarter full after the insert)
  place(slot{key, value});
  ++used_;
}

[[gnu::always_inline]] inline void block_map::place(slot in) noexcept {
  std::size_t i = home(in.key);
  while (slots_[i].key != 0) i = (i + 1) & mask_;
  slots_[i] = in;
}

[[gnu::always_inline]] inline block* block_map::take(std::uintptr_t key) noexcept {
  std::size_t i = home(key);
  while (slots_[i].key != key) {
    if (slots_[i].key == 0) return nullptr;
    i = (i + 1) & mask_;
  }
  block* value = slots_[i].value;
  // Backward-shift deletion keeps every probe sequence unbroken without tombstones.
  std::size_t hole = i;
  for (std::size_t j = (i + 1) & mask_; slots_[j].key != 0; j = (j + 1) & mask_) {
    const std::size_t h = home(slots_[j].key);
    // Move j into the hole unless its home lies cyclically in (hole, j].
    const bool home_between = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
    if (!home_between) {
      slots_[hole] = slots_[j];
      hole = j;
    }
  }
  slots_[hole] = slot{};
  --used_;
  return value;
}

}  // namespace cucache::detail
