// The pager of expandable segments: it owns what backs the reserved virtual ranges with physical
// memory -- the page table of each range (which mapping backs a page, how many blocks touch it),
// the idle mappings (no block touches them), the unmapped handles kept for reuse -- and the
// sources of physical memory a block's pages are backed from, each a named function. It never
// calls the allocator: the allocator places and carves blocks, the pager backs their pages.
//
// Locking: a pool's page tables and idle list are under that pool's mutex, which the caller
// holds; the unmapped handles and the device-wide reservation are under the budget's mutex.
// Another pool's idle pages are taken only under try_lock, which never waits, so the pool lock
// order (creation order) is never violated.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <vector>

#include "allocator/device_budget.hpp"
#include "allocator/pool_table.hpp"
#include "allocator/stream_pool.hpp"
#include "core/vm_range.hpp"
#include "cucache/backend.hpp"

namespace cucache::detail {

/// What the pager did, for stats (its cuMemCreate and cuMemRelease calls are the budget's
/// device_allocs and device_frees). Relaxed counters.
struct pager_counters {
  std::atomic<std::uint64_t> map{0};             // cuMemMap
  std::atomic<std::uint64_t> set_access{0};      // cuMemSetAccess (one per run of new mappings)
  std::atomic<std::uint64_t> unmap{0};           // cuMemUnmap
  std::atomic<std::uint64_t> stitched_pages{0};  // idle pages moved to where a request needed them
  std::atomic<std::uint64_t> shared_pages{0};    // of those, pages taken from another pool
  std::atomic<std::uint64_t> synchronizations{0};  // device synchronizations before an unmap
  // Idle mappings released because a block used them in part: none since every handle is one
  // page (docs/design.md); kept so that device_stats::vm_split_count keeps its meaning.
  std::atomic<std::uint64_t> splits{0};
  std::atomic<std::uint64_t> reclaims{0};  // times memory was short and idle memory was released
  std::atomic<std::uint64_t> vm_ns{0};     // host time in cuMemCreate/Map/SetAccess/Unmap/Release
  std::atomic<std::uint64_t> sync_ns{0};   // host time in the synchronizations counted above
  void reset() noexcept {
    for (auto* c : {&map, &set_access, &unmap, &stitched_pages, &shared_pages, &synchronizations,
                    &splits, &reclaims, &vm_ns, &sync_ns}) {
      c->store(0, std::memory_order_relaxed);
    }
  }
};

/// Runs f() and adds the host time it took, in steady-clock nanoseconds, to `ns` (also when it
/// throws): the pager's driver calls, timed for stats.
template <class F>
decltype(auto) timed(std::atomic<std::uint64_t>& ns, F&& f) {
  struct add_elapsed {
    std::atomic<std::uint64_t>& ns;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    ~add_elapsed() {
      const auto d = std::chrono::steady_clock::now() - start;
      ns.fetch_add(static_cast<std::uint64_t>(
                       std::chrono::duration_cast<std::chrono::nanoseconds>(d).count()),
                   std::memory_order_relaxed);
    }
  } guard{ns};
  return f();
}

class pager {
 public:
  /// A pager over `backend`'s VM calls, charging physical memory to `budget`, backing the ranges
  /// of the pools of `pools` (whose idle pages it may move between them) in pages of
  /// `page_bytes`. `budget` and `pools` outlive the pager.
  pager(device_backend& backend, device_budget& budget, std::size_t page_bytes,
        const pool_table& pools);
  ~pager();  // releases the unmapped handles; ranges are destroyed by their owner first
  pager(const pager&) = delete;
  pager& operator=(const pager&) = delete;

  [[nodiscard]] std::size_t page_bytes() const noexcept { return page_bytes_; }
  /// `gate` answers whether the device may be synchronized now (false while a CUDA graph capture
  /// is underway). While it says no, nothing is unmapped: idle pages are neither moved, split
  /// nor reclaimed, and back() uses only unmapped handles and new memory.
  void set_synchronization_gate(std::function<bool()> gate) { may_synchronize_ = std::move(gate); }

  /// Reserves a virtual range for one pool kind and its (empty) page table.
  [[nodiscard]] std::unique_ptr<vm_range> reserve_range(pool_kind kind);
  /// Unmaps and releases every mapping of r and frees its virtual range. Never throws.
  void destroy_range(vm_range& r) noexcept;

  /// Adds delta (+1 carve, -1 free) to the use of the pages b touches (its edge pages' counts, and
  /// the used pages of each mapping its span crosses: O(mappings), not O(pages)); mappings whose
  /// pages become untouched go on the pool's idle list, and come off it when touched again.
  void touch(stream_pool& p, const block* b, int delta);

  /// Maps every page carved block b touches, each with a handle of its own (one page: an idle page
  /// then pins nothing but itself), and grants access to what it mapped with one cuMemSetAccess
  /// per run of adjacent new mappings. False when no physical memory could be
  /// found (the pages already mapped stay mapped, with access, idle once the caller un-carves b).
  /// A failed VM call throws and leaves no half-mapped block (what this call mapped is unmapped
  /// again) and no untracked handle.
  [[nodiscard]] bool back(stream_pool& p, const block* b);

  /// Bytes that backing new pages could take without a new device allocation now or after the
  /// out-of-memory ladder: the unmapped handles kept for reuse and, when `with_idle` (the ladder
  /// may unmap), the idle mappings of every pool (max_allocatable, headroom.cpp).
  [[nodiscard]] std::size_t reclaimable_bytes(bool with_idle) const {
    std::size_t n = with_idle ? idle_total_.load(std::memory_order_relaxed) : 0;
    std::lock_guard lock(budget_.mu);
    return n + free_handle_bytes;
  }

  /// reserve: maps every unmapped page of [addr, addr + bytes) of r with a handle of its own (an
  /// unmapped one-page handle, else a new one), idle until a block touches it. False when the
  /// device or the limit has no room (the pages mapped so far stay mapped, idle).
  [[nodiscard]] bool map_idle_pages(stream_pool& p, vm_range& r, std::uintptr_t addr,
                                    std::size_t bytes);

  /// Unmaps every idle mapping of p: handles go to the reusable list, or are released.
  void unmap_idle(stream_pool& p, bool release);

  /// Sleep (tag_sleeper.hpp, docs/design.md "Sleep and wake"): unmaps every mapping of p's
  /// ranges -- touched by blocks or idle -- and releases its handle to the device. The virtual
  /// ranges, the blocks and the page-use counts (vm_range::edge_use) stay as they are: the pages
  /// live blocks touch stay counted as touched, with no mapping behind them, until back() maps
  /// them again (wake). With `synchronize`, one device synchronization first (the pager's own,
  /// so it counts for every idle mapping); without, the caller guarantees that no work has used
  /// the pages since they were mapped (wake undoing its own mappings). Returns the bytes
  /// released. REQUIRES: p locked; nothing allocates in or frees into p until back() has mapped
  /// its live blocks again. A failed VM call throws; the page table is consistent either way:
  /// what was released is gone, the rest stays mapped and recorded.
  std::size_t evict(stream_pool& p, bool synchronize);
  /// Bytes that back() could take for new pages right now without moving another pool's idle
  /// pages: the unmapped handles plus what the memory limit and the device leave room for (the
  /// smaller of the two). Changes nothing.
  [[nodiscard]] std::size_t room_bytes();
  /// Releases unmapped handles, largest first, until reserved <= target.
  void release_unmapped(std::size_t target_reserved);

  /// The largest rounded request of pool kind `kind` that, placed in p's range as the allocator
  /// places it (best fit, at the front of the free block), back() serves with no new physical
  /// memory: every page it touches is mapped already, or backed by an unmapped handle
  /// (docs/design.md, "Free memory"). 0 when none is. Changes nothing. REQUIRES: p locked.
  [[nodiscard]] std::size_t largest_cached_request(const stream_pool& p, pool_kind kind,
                                                   const size_policy& policy) const;

  // Under the budget's mutex (read by stats and the invariant check).
  std::multimap<std::size_t, phys_handle> free_handles;  // unmapped handles by size
  std::size_t free_handle_bytes = 0;
  pager_counters counters;
  /// NVTX ranges around backing, page moves and reclaims (config nvtx:True); set before use.
  bool nvtx = false;

 private:
  /// A piece of physical memory found for a run of pages.
  struct piece {
    phys_handle handle = 0;
    std::size_t bytes = 0;
    bool moved = false;  // taken from an idle mapping (stitched)
  };

  // --- physical-memory sources, in the order back() asks them ---
  /// 1. An unmapped handle kept for reuse that fits `want` (every handle is one page).
  std::optional<piece> take_unmapped(std::size_t want);
  /// 2. An idle mapping of p that fits `want`, unmapped where it sits (its data is dead).
  std::optional<piece> take_idle(stream_pool& p, std::size_t want);
  /// 3. An idle mapping of another pool that fits `want` (pools that are busy are skipped).
  std::optional<piece> take_peer_idle(stream_pool& p, std::size_t want);
  /// 4. New physical memory; none above the memory limit or the device's capacity.
  std::optional<piece> create(std::size_t bytes);

  /// Memory is short for `bytes` more: gives back idle pages of p and of the other pools, least
  /// recently idle first, page by page, until the device, the limit and the garbage-collection
  /// threshold have room. True when they have. (Unmapped handles are kept: back() takes them
  /// before it creates, so `bytes` is what they cannot back.)
  bool reclaim(stream_pool& p, std::size_t bytes);
  /// Memory is plentiful for `extra` more: the device, the limit and the garbage-collection
  /// threshold have room for it, so missing pages are created and idle pages stay mapped.
  bool may_grow(stream_pool& p, std::size_t extra);

  /// Unmapping is not stream-ordered: work queued before a free may still use the page at its
  /// old address. The one wait that is always safe is the device's -- the pool's stream may have
  /// been destroyed by the program -- and it is skipped when a device synchronization completed
  /// after the mapping became idle.
  void wait_until_unmappable(const vm_mapping& m);
  void synchronize_device();

  /// An idle mapping of q of at most `want` bytes to move, or nullptr (a bounded walk).
  vm_mapping* idle_within(const stream_pool& q, std::size_t want) const;
  struct span_state {
    std::size_t missing_bytes = 0;  // b's pages that no mapping backs
    bool needs_access = false;      // a mapping of b's span without access (a failed undo)
  };
  /// What b's pages lack: one step per mapping.
  span_state scan(const vm_range& r, const block* b) const;
  /// back() without the access grant: maps pieces over b's missing pages.
  bool back_pages(stream_pool& p, vm_range& r, const block* b, std::size_t missing,
                  std::vector<vm_mapping*>& batch);
  /// cuMemSetAccess over each run of adjacent mappings without access in pages [first, last];
  /// on failure, revoke(batch) and rethrow.
  void grant_access(stream_pool& p, vm_range& r, std::size_t first, std::size_t last,
                    const std::vector<vm_mapping*>& batch);
  /// Unmaps the mappings of `batch` (made by this back()) that have no access yet, keeping their
  /// handles.
  void revoke(stream_pool& p, const std::vector<vm_mapping*>& batch) noexcept;
  void idle_link(stream_pool& p, vm_mapping* m);
  void idle_unlink(stream_pool& p, vm_mapping* m);
  phys_handle unmap(stream_pool& p, vm_mapping* m);
  /// What a new mapping's pages are to the blocks: touched by the carved block being backed
  /// (back), or by none (map_idle_pages: the mapping starts idle).
  enum class mapping_use : bool { touched, idle };
  /// Maps pc at first_page (no access yet) and adds the mapping to `batch`.
  void map(stream_pool& p, vm_range& r, std::size_t first_page, const piece& pc,
           std::vector<vm_mapping*>& batch, mapping_use use = mapping_use::touched);
  vm_mapping* record_mapping(stream_pool& p, vm_range& r, std::size_t first_page, std::size_t pages,
                             phys_handle h, mapping_use use);
  void keep(phys_handle h, std::size_t bytes);
  void keep_locked(phys_handle h, std::size_t bytes);  // REQUIRES budget.mu
  void release(phys_handle h, std::size_t bytes);
  /// Unmaps the idle mapping m of q and releases its handle.
  void release_idle(stream_pool& q, vm_mapping* m);
  /// Would `bytes` more pass the memory limit or the garbage-collection threshold?
  bool over_caps(std::size_t bytes);
  /// Room for `bytes` more under the caps and on the device.
  bool fits(std::size_t bytes);

  device_backend& backend_;
  device_budget& budget_;
  const std::size_t page_bytes_;
  const std::size_t device_total_;
  // The pool table's list and its lock, for the walks over other pools that must not wait
  // (take_peer_idle, reclaim: try_lock only).
  std::shared_mutex& pools_mu_;
  const std::vector<std::unique_ptr<stream_pool>>& pools_;
  std::function<bool()> may_synchronize_ = [] { return true; };
  std::atomic<std::uint64_t> syncs_started_{0};
  std::atomic<std::uint64_t> syncs_done_{0};
  std::atomic<std::size_t> idle_total_{0};  // bytes of idle mappings, every pool
};

}  // namespace cucache::detail
