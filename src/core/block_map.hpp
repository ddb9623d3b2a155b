// The pointer -> block map of allocated blocks: the free path's only global structure. It is
// split into shards by address hash, each an open-addressing table (linear probing, backward-shift
// deletion, no tombstones) under its own spin lock, so threads freeing different pointers rarely
// meet on one cache line.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>

#include "core/block.hpp"

namespace cucache::detail {

/// A test-and-test-and-set spin lock. Critical sections under it are a few dozen instructions.
class spin_lock {
 public:
  void lock() noexcept {
    for (;;) {
      if (!flag_.exchange(true, std::memory_order_acquire)) return;
      while (flag_.load(std::memory_order_relaxed)) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
      }
    }
  }
  void unlock() noexcept {
    flag_.store(false, std::memory_order_release);
  }

 private:
  std::atomic<bool> flag_{false};
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
    std::lock_guard lock(s.mu);
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
    slot* slots = nullptr;
    std::size_t mask = 0;  // capacity - 1 (capacity a power of two)
    std::size_t used = 0;
    block* find(std::uintptr_t key) const noexcept;
    void insert(std::uintptr_t key, block* value);
    block* take(std::uintptr_t key) noexcept;
    void grow();
  };
  static std::size_t hash(std::uintptr_t addr) noexcept {
    // Blocks are 512 B aligned; mix the significant bits (Fibonacci hashing).
    return static_cast<std::size_t>((addr >> 9) * 0x9E3779B97F4A7C15ULL);
  }
  shard& shard_of(std::uintptr_t addr) const noexcept { return shards_[hash(addr) >> 58]; }

  std::unique_ptr<shard[]> shards_;
};

}  // namespace cucache::detail
