// segment_directory: which pool owns an address. The free path's first step: a pointer leads to
// the pool whose mutex guards its block (each pool keeps its allocated blocks in a block_map of its
// own, under its lock), so that a cache-hit pair takes no lock but its pool's
// (docs/decisions/0030-pool-block-maps.md).
//
// Contract:
// - add(base, bytes, owner) and remove(base) keep the set of live segments, which never
//   overlap. They are serialized by the directory's own mutex, a leaf of the lock order. add gives
//   the strong guarantee (it throws std::bad_alloc or std::invalid_argument with nothing changed);
//   remove never throws.
// - owner_of(addr): while a live segment holds addr (base <= addr < base + bytes) from before the
//   call until after it, returns that segment's owner. Otherwise it returns nullptr, or the owner
//   of a segment that was live during the call in addr's 2 MiB granule: the caller checks, in that
//   pool's block map, that a block starts at addr.
// - Lock-free where addr's 2 MiB granule is covered by segments of one owner only (device memory
//   comes in 2 MiB-aligned allocations; cudaMalloc of 2 MiB or more gives 2 MiB alignment in
//   practice): at most two loads. A granule that segments of two or more owners share, or an
//   address at or above 2^52, is answered from the ordered index of segments under the mutex,
//   held shared.
// - Owners are never dereferenced, must be 4-byte aligned, and must outlive the directory's use
//   of them (pools live as long as their allocator).
//
// The table has two levels: 1 GiB entries (2^22 of them, an anonymous mapping of 32 MiB committed
// only where written: a page per 512 GiB of addresses in use) and nodes of 512 entries of 2 MiB.
// A 1 GiB entry holds an owner when one segment covers the whole GiB (so an expandable range of
// hundreds of GiB costs a few hundred stores, not one per granule), else a node; a 2 MiB entry
// the owner of the granule's segments, or "shared". Nodes are never freed before the directory,
// so a reader that loaded one may always read it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "backend/thread_annotations.hpp"

namespace cucache::detail {

class stream_pool;

class segment_directory {
  /// A live segment in the ordered index (by base).
  struct span {
    std::uintptr_t end;
    stream_pool* owner;
  };

 public:
  static constexpr unsigned k_granule_log2 = 21;  // 2 MiB: the finest entry
  static constexpr unsigned k_node_bits = 9;      // a node: 512 granules (4 KiB)
  static constexpr unsigned k_top_log2 = k_granule_log2 + k_node_bits;  // a top entry: 1 GiB
  static constexpr unsigned k_top_bits = 22;  // 2^22 top entries: addresses below 2^52
  static constexpr unsigned k_address_bits = k_top_log2 + k_top_bits;

  segment_directory();
  ~segment_directory();
  segment_directory(const segment_directory&) = delete;
  segment_directory& operator=(const segment_directory&) = delete;

  /// A live segment [base, base + bytes) of `owner` (not null, 4-byte aligned). Throws
  /// std::invalid_argument when it is empty, wraps around, overlaps a live segment or has no
  /// owner; std::bad_alloc when storage runs out.
  void add(std::uintptr_t base, std::size_t bytes, stream_pool* owner);
  /// The live segment at `base` is gone (nothing happens when none starts there).
  void remove(std::uintptr_t base) noexcept;

  /// A segment taken out before its memory goes back to the device -- once it has, another pool
  /// may be handed the same addresses and add them -- kept so that put_back can add it again,
  /// without allocating, if the device refuses the release.
  class taken_segment {
   public:
    taken_segment() = default;

   private:
    friend class segment_directory;
    std::map<std::uintptr_t, span>::node_type node_;
  };
  /// remove, keeping what put_back needs.
  [[nodiscard]] taken_segment take_out(std::uintptr_t base) noexcept;
  /// Adds a segment take_out took out again (its release failed; its addresses were never given
  /// back, so nothing overlaps it). Never throws: its nodes still exist, its index node is kept.
  void put_back(taken_segment&& t) noexcept;
  /// See the contract above. Inline: the first step of every free.
  [[nodiscard]] [[gnu::always_inline]] stream_pool* owner_of(std::uintptr_t addr) const noexcept {
    if ((addr >> k_address_bits) == 0) [[likely]] {
      if (const std::uintptr_t e = entry(addr); e != k_shared) [[likely]]
        return reinterpret_cast<stream_pool*>(e);
    }
    return owner_by_index(addr);
  }

  /// Live segments (for invariant checks).
  [[nodiscard]] std::size_t segments() const;
  /// Nodes allocated below the top level (4 KiB of host memory each).
  [[nodiscard]] std::size_t nodes() const;
  /// Whether addr is answered from the ordered index (a shared granule, or beyond 2^52): tests.
  [[nodiscard]] bool shared_granule(std::uintptr_t addr) const noexcept;

 private:
  static constexpr std::uintptr_t k_node_mask = (std::uintptr_t{1} << k_node_bits) - 1;
  /// Entry tags: k_shared (a granule of several owners; the finest level only) and k_node (a
  /// child node's address | k_node). 0 is "no segment"; anything else an owner.
  static constexpr std::uintptr_t k_shared = 1;
  static constexpr std::uintptr_t k_node = 2;
  [[gnu::always_inline]] static std::uintptr_t load(const std::uintptr_t& w) noexcept {
    return std::atomic_ref<const std::uintptr_t>(w).load(std::memory_order_acquire);
  }
  static void store(std::uintptr_t& w, std::uintptr_t v) noexcept {
    std::atomic_ref<std::uintptr_t>(w).store(v, std::memory_order_release);
  }
  [[nodiscard]] static std::uintptr_t* node(std::uintptr_t e) noexcept {
    return reinterpret_cast<std::uintptr_t*>(e & ~k_node);
  }
  /// The table's entry for addr, below 2^52: its GiB's, or its granule's where the GiB has a
  /// node. Two loads at most, no lock.
  [[nodiscard]] [[gnu::always_inline]] std::uintptr_t entry(std::uintptr_t addr) const noexcept {
    const std::uintptr_t e = load(top_[addr >> k_top_log2]);
    if ((e & k_node) == 0) return e;
    return load(node(e)[(addr >> k_granule_log2) & k_node_mask]);
  }
  /// owner_of where the granule is shared or beyond the table: the ordered index, shared lock.
  [[gnu::noinline]] stream_pool* owner_by_index(std::uintptr_t addr) const noexcept;
  /// The entry granule [lo, lo + 2 MiB) must hold now, from the ordered index.
  [[nodiscard]] std::uintptr_t granule_entry(std::uintptr_t lo) const noexcept REQUIRES(mu_);
  /// Creates (zeroed, so that no answer changes) the nodes that the 1 GiB entries [base, end)
  /// covers only in part need. May throw std::bad_alloc; what it made stays, harmless.
  void make_nodes(std::uintptr_t base, std::uintptr_t end) REQUIRES(mu_);
  /// Sets the entries that [base, end) meets: `whole` where it covers an entry's span (a node's
  /// granules too), granule_entry where it covers a granule in part. REQUIRES: make_nodes ran.
  void fill(std::uintptr_t base, std::uintptr_t end, std::uintptr_t whole) noexcept REQUIRES(mu_);
  /// fill's step in one node: its granules from `lo` on.
  void fill_node(std::uintptr_t* granules, std::uintptr_t lo, std::uintptr_t base,
                 std::uintptr_t end, std::uintptr_t whole) noexcept REQUIRES(mu_);

  mutable shared_mutex mu_;
  // The top level: 2^22 entries, an anonymous mapping committed only where written. Read with
  // atomic loads without the mutex; written under it.
  std::uintptr_t* top_ = nullptr;
  std::map<std::uintptr_t, span> index_ GUARDED_BY(mu_);  // live segments by base
  std::vector<std::uintptr_t*> nodes_ GUARDED_BY(mu_);    // to free them
};

}  // namespace cucache::detail
