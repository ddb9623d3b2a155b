// The pointer -> block map of allocated blocks: the free path's only global structure. It is
// split into shards by address hash, each an open-addressing table (linear probing, backward-shift
// deletion, no tombstones) under its own spin lock, so threads freeing different pointers rarely
// meet on one cache line.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>

#include "backend/thread_annotations.hpp"
#include "core/block.hpp"

namespace cucache::detail {

/// A test-and-test-and-set spin lock. Critical sections under it are a few dozen instructions.
class CAPABILITY("mutex") spin_lock {
 public:
  [[gnu::always_inline]] void lock() noexcept ACQUIRE() {  // (spin_guard)
    for (;;) {
      if (!flag_.exchange(true, std::memory_order_acquire)) return;
      while (flag_.load(std::memory_order_relaxed)) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      }
    }
  }
  void unlock() noexcept RELEASE() {
    flag_.store(false, std::memory_order_release);
  }

 private:
  std::atomic<bool> flag_{false};
};

/// lock_guard for spin_lock, always inlined with the lock itself: the allocation and free paths
/// take a shard lock once per cache hit (cucache-pair-count), and GCC stopped inlining the generic
/// guard into allocate when it grew by one load (docs/decisions/0019-runtime-size-rules.md).
class SCOPED_CAPABILITY spin_guard {
 public:
  [[gnu::always_inline]] explicit spin_guard(spin_lock& m) ACQUIRE(m) : m_(m) { m_.lock(); }
  [[gnu::always_inline]] ~spin_guard() RELEASE() { m_.unlock(); }
  spin_guard(const spin_guard&) = delete;
  spin_guard& operator=(const spin_guard&) = delete;

 private:
  spin_lock& m_;
};

class block_map {
 public:
  static constexpr std::size_t k_shards = 64;

  block_map();
  ~block_map();
  block_map(const block_map&) = delete;
  block_map& operator=(const block_map&) = delete;

  /// REQUIRES: addr is not in the map.
  void insert(std::uintptr_t addr, block* b);
  /// Removes and returns the block at addr, or nullptr when none is live there.
  [[nodiscard]] block* take(std::uintptr_t addr) noexcept;
  /// The block at addr, or nullptr. `f(block*)` runs under the shard lock, so the block cannot be
  /// freed meanwhile; returns f's result, or nullptr-equivalent when absent.
  template <class F>
  bool with(std::uintptr_t addr, F&& f) {
    shard& s = shard_of(addr);
    lock_guard lock(s.mu);
    block* b = s.find(addr);
    if (b == nullptr) return false;
    f(b);
    return true;
  }
  [[nodiscard]] block* find(std::uintptr_t addr) const noexcept;
  [[nodiscard]] std::size_t size() const noexcept;

 private:
  struct slot {
    std::uintptr_t key = 0;  // 0 = empty (no block lives at address 0)
    block* value = nullptr;
  };
  struct alignas(64) shard {
    spin_lock mu;
    slot* slots GUARDED_BY(mu) = nullptr;  // allocated by the map's constructor: never null
    std::size_t mask GUARDED_BY(mu) = 0;   // capacity - 1 (capacity a power of two)
    std::size_t used GUARDED_BY(mu) = 0;
    std::size_t grow_at GUARDED_BY(mu) = 0;  // used count at which an insert doubles the table
    block* find(std::uintptr_t key) const noexcept REQUIRES(mu);
    void insert(std::uintptr_t key, block* value) REQUIRES(mu);
    block* take(std::uintptr_t key) noexcept REQUIRES(mu);
    void grow() REQUIRES(mu);
  };
  static std::size_t hash(std::uintptr_t addr) noexcept {
    // Blocks are 512 B aligned; mix the significant bits (Fibonacci hashing).
    return static_cast<std::size_t>((addr >> 9) * 0x9E3779B97F4A7C15ULL);
  }
  shard& shard_of(std::uintptr_t addr) const noexcept { return shards_[hash(addr) >> 58]; }
  /// A key's home slot in its shard's table (other bits than those that pick the shard).
  static std::size_t slot_hash(std::uintptr_t key) noexcept {
    return static_cast<std::size_t>(((key >> 9) * 0xC2B2AE3D27D4EB4FULL) >> 17);
  }

  std::unique_ptr<shard[]> shards_;
};

// The free and allocation paths' lookups, inline.

inline block* block_map::shard::find(std::uintptr_t key) const noexcept {
  for (std::size_t i = block_map::slot_hash(key) & mask;; i = (i + 1) & mask) {
    if (slots[i].key == key) return slots[i].value;
    if (slots[i].key == 0) return nullptr;
  }
}

// always_inline (and insert below): a cache hit publishes its block here (cucache-pair-count).
[[gnu::always_inline]] inline void block_map::shard::insert(std::uintptr_t key, block* value) {
  if (used >= grow_at) grow();  // (at most half full after the insert)
  std::size_t i = block_map::slot_hash(key) & mask;
  while (slots[i].key != 0) i = (i + 1) & mask;
  slots[i] = slot{key, value};
  ++used;
}

inline block* block_map::shard::take(std::uintptr_t key) noexcept {
  std::size_t i = block_map::slot_hash(key) & mask;
  while (slots[i].key != key) {
    if (slots[i].key == 0) return nullptr;
    i = (i + 1) & mask;
  }
  block* value = slots[i].value;
  // Backward-shift deletion keeps every probe sequence unbroken without tombstones.
  std::size_t hole = i;
  for (std::size_t j = (i + 1) & mask; slots[j].key != 0; j = (j + 1) & mask) {
    const std::size_t home = block_map::slot_hash(slots[j].key) & mask;
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

[[gnu::always_inline]] inline void block_map::insert(std::uintptr_t addr, block* b) {
  shard& s = shard_of(addr);
  spin_guard lock(s.mu);
  s.insert(addr, b);
}

inline block* block_map::take(std::uintptr_t addr) noexcept {
  shard& s = shard_of(addr);
  spin_guard lock(s.mu);
  return s.take(addr);
}

inline block* block_map::find(std::uintptr_t addr) const noexcept {
  shard& s = shard_of(addr);
  spin_guard lock(s.mu);
  return s.find(addr);
}

}  // namespace cucache::detail
