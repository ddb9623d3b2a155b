// The pager of expandable segments: it owns what backs the reserved virtual ranges with physical
// memory -- the page table of each range (which handle backs a page, which blocks begin or end on
// it, the runs of mapped and of idle pages), the idle pages (no block touches them), the unmapped handles kept for reuse -- and the
// sources of physical memory a block's pages are backed from, each a named function. It never
// calls the allocator: the allocator places and carves blocks, the pager backs their pages.
//
// Chunks (docs/design.md, "Chunks"): while memory is plentiful, a run of missing pages that the
// block being backed covers whole -- a block of at least k_min_chunked_pages whole pages -- gets
// one handle of up to k_max_chunk_pages pages, mapped at once. A chunk is touched as a whole by
// one block or by none: a carve that would touch part of an idle chunk (or reach a chunk's page
// with a partial edge page, which a neighbour may share) first unmaps and releases the whole
// chunk (touch), and every path that needs an idle page of a chunk -- moves, reclaim,
// unmap_idle, evict -- releases the whole chunk. So an idle chunk pins no page a block touches,
// and what a limit needs is given back as with one-page handles. The one exception: while the
// synchronization gate is closed nothing can be unmapped, so such a carve uses the chunk as it is
// (a straddled chunk, counted); it is given back once all of its pages are idle again. With coarse
// handles (set_coarse_handles, config coarse_handles), while half the capacity is to spare beyond
// a growth, every block's whole pages get chunks and a cut idle chunk is straddled, not released.
//
// Locking: a pool's page tables and idle list are under that pool's mutex, which the caller
// holds; the unmapped handles and the device-wide reservation are under the budget's mutex.
// Another pool's idle pages are taken only under try_lock, which never waits, so the pool lock
// order (creation order) is never violated.
#pragma once

#include <algorithm>
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
#include "allocator/hot.hpp"
#include "allocator/pool_table.hpp"
#include "allocator/stream_pool.hpp"
#include "core/vm_range.hpp"
#include "cucache/backend.hpp"
#include "cucache/device_allocator.hpp"

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
  // Idle chunks released because a carve touched them in part (converted to one-page handles).
  std::atomic<std::uint64_t> splits{0};
  std::atomic<std::uint64_t> chunks{0};  // chunks created (handles of more than one page)
  std::atomic<std::uint64_t> reclaims{0};  // times memory was short and idle memory was released
  std::atomic<std::uint64_t> vm_ns{0};     // host time in cuMemCreate/Map/SetAccess/Unmap/Release
  std::atomic<std::uint64_t> sync_ns{0};   // host time in the synchronizations counted above
  void reset() noexcept {
    for (auto* c : {&map, &set_access, &unmap, &stitched_pages, &shared_pages, &synchronizations,
                    &splits, &chunks, &reclaims, &vm_ns, &sync_ns}) {
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
  /// The largest chunk, in pages (64 MiB at the H200's 2 MiB): cuMemCreate costs about the same
  /// per call from 2 to 256 MiB, cuMemRelease grows with the size (docs/design.md, "Chunks").
  static constexpr std::size_t k_max_chunk_pages = 32;
  /// Only a block that covers at least this many pages whole (256 MiB at 2 MiB) gets chunks:
  /// smaller blocks' chunks were mostly cut by a later carve of another layout and released
  /// again, which cost more VM time than they saved (docs/design.md, "Chunks").
  static constexpr std::size_t k_min_chunked_pages = 128;

  /// A pager over `backend`'s VM calls, charging physical memory to `budget`, backing the ranges
  /// of the pools of `pools` (whose idle pages it may move between them) in pages of
  /// `page_bytes`. `budget` and `pools` outlive the pager.
  pager(device_backend& backend, device_budget& budget, std::size_t page_bytes,
        pool_table& pools);
  ~pager();  // releases the unmapped handles; ranges are destroyed by their owner first
  pager(const pager&) = delete;
  pager& operator=(const pager&) = delete;

  [[nodiscard]] std::size_t page_bytes() const noexcept { return page_bytes_; }
  /// The largest chunk back() creates, in pages (1: no chunks, every handle one page), and the
  /// fewest whole pages of a block that gets chunks (defaults k_max_chunk_pages,
  /// k_min_chunked_pages). For tests and measurements; set before use. REQUIRES: max_pages <
  /// 65536 (vm_page::chunk_pages).
  void set_chunking(std::size_t max_pages, std::size_t min_block_pages) noexcept {
    max_chunk_pages_ = max_pages;
    min_chunked_pages_ = min_block_pages;
  }
  /// Coarse handles (config key coarse_handles, docs/design.md "Coarse handles"): while memory is
  /// plentiful with room to spare -- the device, the limit and the garbage-collection threshold
  /// have room for the pages a block lacks plus half the capacity (coarse_room) -- every run of
  /// missing pages the block covers whole gets one chunk of up to `pages` pages, whatever the
  /// block's size, and a carve that cuts an idle chunk uses it as it is (straddled) instead of
  /// releasing it. Otherwise the pager behaves as without. 0 (the default): off. REQUIRES: pages
  /// is 0 or in [2, k_max_coarse_pages]; set before use.
  void set_coarse_handles(std::size_t pages) noexcept { coarse_pages_ = pages; }
  [[nodiscard]] std::size_t coarse_handles() const noexcept { return coarse_pages_; }
  /// The largest coarse_handles setting (the cap of chunks, vm_page::chunk_pages aside).
  static constexpr std::size_t k_max_coarse_pages = 32;
  /// The largest chunk any setting makes, in pages (the invariant check's bound).
  [[nodiscard]] std::size_t largest_chunk_pages() const noexcept {
    return std::max(max_chunk_pages_, coarse_pages_);
  }
  /// Chunks that carves touched in part and left mapped (straddled), one per chunk per carve:
  /// while coarse handles were plentiful (set_coarse_handles), or while a chunk could not be
  /// unmapped (the gate closed, or an unmap that failed). The sum of every pool's count
  /// (pool_pages::straddles), read without their locks. Never reset.
  [[nodiscard]] std::uint64_t straddled_chunks() const EXCLUDES(pools_mu_) {
    detail::shared_lock list(pools_mu_);
    return straddles_of_every_pool();
  }
  /// `gate` answers whether the device may be synchronized now (false while a CUDA graph capture
  /// is underway). While it says no, nothing is unmapped: idle pages are neither moved, split
  /// nor reclaimed, and back() uses only unmapped handles and new memory.
  void set_synchronization_gate(std::function<bool()> gate) { may_synchronize_ = std::move(gate); }
  /// Who is told of mappings made accessible and of accessible mappings about to be unmapped
  /// (allocation_observer::on_segment_map / on_segment_unmap): the allocator's observer slot,
  /// read at each event (null: nobody). Set before use; `*slot` outlives the pager.
  void set_observer(const std::atomic<allocation_observer*>* slot) noexcept { observer_ = slot; }

  /// Address space for a pool's next range of kind `kind`, given that its ranges of that kind
  /// span `held` bytes already and that the range must hold a request of `need` bytes
  /// (docs/design.md, "What a stream costs"). A pool's first range of a kind spans the device's
  /// capacity (twice for the large kind: holes between live blocks then never exhaust it) while
  /// the ranges of every pool of the device span less than k_address_budget_devices times the
  /// device; past that budget -- many pools live at once -- a first range spans
  /// k_first_small_range_pages and each later one doubles what the pool holds, up to the
  /// full size: a pool's address space stays within about twice what it has needed.
  [[nodiscard]] std::size_t next_range_bytes(pool_kind kind, std::size_t need,
                                             std::size_t held) const noexcept;
  /// Reserves a virtual range of `bytes` (a multiple of the page) for one pool kind and its
  /// (empty) page table; nullptr when the process's address space has no room for it (the
  /// backend's out-of-memory error). Other failures throw.
  [[nodiscard]] std::unique_ptr<vm_range> reserve_range(pool_kind kind, std::size_t bytes);
  /// Unmaps and releases every mapping of r, takes its idle runs off their pool's idle list and
  /// frees its virtual range. Never throws.
  void destroy_range(vm_range& r) noexcept;

  // --- a pool's ranges (pool_pages: changed only through these and the pager's own steps) ---
  /// Room in p's range list for one more range, so that add_range cannot fail. May throw.
  void make_room_for_range(stream_pool& p) REQUIRES(p.mu) { p.pages.reserve_range(); }
  /// s, a segment of p that owns a vm_range, joins p's ranges. REQUIRES: make_room_for_range
  /// since p's last add_range.
  void add_range(stream_pool& p, segment* s) noexcept REQUIRES(p.mu) { p.pages.add_range(s); }
  /// s leaves p's ranges, and its vm_range is destroyed (destroy_range; the caller deletes the
  /// object). Never throws.
  void drop_range(stream_pool& p, segment* s) noexcept REQUIRES(p.mu) {
    p.pages.remove_range(s);
    destroy_range(*s->vm);
  }
  /// s leaves p's ranges; its vm_range is left as it is (a caller that owns it otherwise).
  void forget_range(stream_pool& p, const segment* s) noexcept REQUIRES(p.mu) {
    p.pages.remove_range(s);
  }
  /// The pool's pages agree with its segments and page tables: its range list is exactly its
  /// segments that own a vm_range, each once, their sizes summed per kind; its idle list holds
  /// every idle run of its ranges once, linked both ways, in its ranges' tables, epochs never
  /// rising toward the tail; the parked span is in a range of its own and went idle after the
  /// list's head; idle_bytes counts the listed and parked pages. Throws std::logic_error naming
  /// the first violation (check_invariants composes it).
  void check_invariants(const stream_pool& p) const REQUIRES(p.mu);
  /// The device-wide half: the address space counted equals `ranges_bytes`, what every pool's
  /// ranges span (the caller's walk), and the unmapped handle list sums to its counter. Returns
  /// the list's bytes (memory the budget holds besides the pools'). Takes the budget's mutex;
  /// throws std::logic_error naming the first violation.
  std::size_t check_device_wide(std::size_t ranges_bytes) const;
  /// The address space every range of the device spans now.
  [[nodiscard]] std::size_t reserved_address_bytes() const noexcept {
    return address_bytes_.load(std::memory_order_relaxed);
  }
  /// The budget of address space within which pools get full-size first ranges, in devices.
  static constexpr std::size_t k_address_budget_devices = 32;
  /// The pages of a pool's first range of a kind once the budget is spent (64 MiB of 2 MiB pages).
  static constexpr std::size_t k_first_small_range_pages = 32;

  /// Block b was carved (touch_carved) or freed (touch_freed): adds 1 to, or takes 1 from, the
  /// use of the pages b touches -- its edge pages' counts; on a carve its span leaves the idle
  /// runs, on a free the mapped pages of its span that no other block touches go idle as one run
  /// at the head of the pool's idle list (one per run of mapped pages). O(log runs) when every
  /// page of b is mapped, whatever b's size. A carve that would touch part of an idle chunk first
  /// unmaps and releases it (after wait_until_unmappable); when it cannot (gate closed, a failed
  /// call), the chunk stays, straddled. Throws nothing that a VM call raised. (One function per
  /// direction: each saves fewer registers than one taking the direction, 12 instructions a
  /// cache-hit pair.)
  void touch_carved(stream_pool& p, const block* b) REQUIRES(p.mu);
  void touch_freed(stream_pool& p, const block* b) REQUIRES(p.mu);

  // --- the held block (defer_coalescing, pool_mutex.hpp) in expandable mode ---
  // A held block's pages stay touched: its free's touch_freed is deferred to its settling, and a
  // take-back skips both touches -- they would leave the edge counts and the idle order as they
  // were. Every lock of the pool but the fast paths' settles first, so nobody else sees the
  // pages touched (docs/decisions/0032-held-block-in-expandable-mode.md).
  /// b, freed on the fast path, may be held: true, and its free's epoch noted (pool_pages::
  /// note_hold), when every page of b is mapped; the span parked now is linked first, so that
  /// settle_pages parks without linking. False (nothing changed) when b must be released now.
  /// May throw (host memory, linking the parked span): nothing changed then.
  bool hold_pages(stream_pool& p, const block* b) REQUIRES(p.mu);
  /// The held block b settles: touch_freed as at its free (its epoch). Throws nothing (it parks
  /// into an empty slot).
  void settle_pages(stream_pool& p, const block* b) noexcept REQUIRES(p.mu);
  /// The allocation that takes back held block b: what touch_carved after the deferred
  /// touch_freed would change -- the straddle count of chunks it cuts, where coarse handles are
  /// plentiful -- and true; false, with nothing changed, where that carve could change mappings
  /// (it would release cut idle chunks, or b's range has pages without access) and the block
  /// must settle and take the allocation's general path instead. Inline: the take-back's step.
  [[nodiscard]] CUCACHE_HOT bool retake_pages(stream_pool& p, const block* b) noexcept
      REQUIRES(p.mu) {
    const vm_range& r = *b->seg->vm;
    if (r.no_access_pages != 0) [[unlikely]]
      return false;
    if (r.chunks == 0) [[likely]]
      return true;
    const std::size_t cut = r.cut_chunks(b->addr, b->size, r.page_of(b->addr),
                                         r.page_of(b->addr + b->size - 1));
    if (cut == 0) return true;
    if (!coarse_now_.load(std::memory_order_relaxed)) return false;
    p.pages.add_straddles(cut);
    return true;
  }
  /// The pages [first, last] of a span carved from a free block that the carve touches anew: all
  /// of them but an edge page that another block touches already (`first_touched`,
  /// `last_touched`: its edge count is nonzero; a page strictly inside a free block's span is
  /// touched by no block). touch_carved asks it whether a carve may leave the idle runs alone
  /// (0 new pages), and headroom (max_allocatable) counts with it what a request placed in a hole
  /// needs.
  [[nodiscard]] static constexpr std::size_t fresh_pages(std::size_t first, std::size_t last,
                                                         bool first_touched,
                                                         bool last_touched) noexcept {
    return last - first + 1 - (first_touched ? 1 : 0) - (last > first && last_touched ? 1 : 0);
  }
  /// fresh_pages of a request of `bytes` at `addr`, inside a free block of r, as a carve of it
  /// would find them now.
  [[nodiscard]] static std::size_t fresh_pages(const vm_range& r, std::uintptr_t addr,
                                               std::size_t bytes) noexcept {
    const std::size_t first = r.page_of(addr);
    const std::size_t last = r.page_of(addr + bytes - 1);
    return fresh_pages(first, last, r.edge(first) != 0, r.edge(last) != 0);
  }

  /// Maps every page carved block b touches -- while memory is plentiful, runs of new pages that b
  /// covers whole in chunks of up to max_chunk_pages pages, else each page with a handle of its
  /// own -- and grants access to what it mapped with one cuMemSetAccess per run of adjacent new
  /// mappings. O(log runs) when every page is mapped already (a cache
  /// hit). False when no physical memory could be
  /// found (the pages already mapped stay mapped, with access, idle once the caller un-carves b).
  /// A failed VM call throws and leaves no half-mapped block (what this call mapped is unmapped
  /// again) and no untracked handle. Inline when every page of b is mapped with access (a cache
  /// hit: no call).
  [[nodiscard]] CUCACHE_HOT bool back(stream_pool& p, const block* b) REQUIRES(p.mu) {
    const vm_range& r = *b->seg->vm;
    if (r.no_access_pages == 0 &&
        r.all_mapped(r.page_of(b->addr), r.page_of(b->addr + b->size - 1))) [[likely]]
      return true;
    return back_slow(p, b);
  }

  /// Bytes that backing new pages could take without a new device allocation now or after the
  /// out-of-memory ladder: the unmapped handles kept for reuse plus `idle` (the caller's sum of
  /// the idle mappings the ladder may unmap: idle_bytes_of_every_pool_locked, or 0 when it may
  /// not; max_allocatable and reserve, headroom.cpp).
  [[nodiscard]] std::size_t reclaimable_bytes(std::size_t idle) const {
    detail::lock_guard lock(budget_.mu);
    return idle + free_handle_bytes;
  }

  /// The bytes of the unmapped one-page handles (those back() reuses; what every expandable
  /// pool's largest_cached_request depends on besides the pool).
  [[nodiscard]] std::size_t unmapped_page_handle_bytes() const {
    detail::lock_guard lock(budget_.mu);
    return page_handle_bytes_locked();
  }

  /// What every expandable pool's largest_cached_request depends on besides the pool: the
  /// unmapped one-page handles' bytes (a multiple of the page), plus 1 while coarse handles are
  /// plentiful (a carve then keeps the idle chunks it cuts). The statistics ledger summarizes
  /// every pool again when it changes.
  [[nodiscard]] std::size_t largest_request_key() const {
    return unmapped_page_handle_bytes() + (coarse_now_.load(std::memory_order_relaxed) ? 1 : 0);
  }

  /// The idle bytes of every pool, read without their locks (a snapshot, as any figure about
  /// other pools is once read). REQUIRES: the caller holds the pool table's list lock (lock_all).
  /// Not analysed: it reads each pool's atomic idle_bytes without the pool's lock, by design, and
  /// the caller's list lock is the table's mu_, which the analysis cannot match to pools_mu_.
  [[nodiscard]] std::size_t idle_bytes_of_every_pool_locked() const noexcept
      NO_THREAD_SAFETY_ANALYSIS {
    std::size_t n = 0;
    for (const auto& q : pools_) n += q->pages.idle_bytes();
    return n;
  }
  /// The idle bytes of p's straddled chunks (vm_range::straddled_idle_pages): counted in its
  /// idle_bytes, yet no ladder can unmap them while a block touches part of their chunk (a carve
  /// that used them as they were, under coarse handles or while nothing could be unmapped).
  /// O(mapped pages of p's ranges that hold chunks).
  [[nodiscard]] std::size_t straddled_idle_bytes(const stream_pool& p) const REQUIRES(p.mu);

  /// reserve: maps every unmapped page of [addr, addr + bytes) of r with a handle of its own (an
  /// unmapped one-page handle, else a new one), idle until a block touches it. False when the
  /// device or the limit has no room (the pages mapped so far stay mapped, idle).
  [[nodiscard]] bool map_idle_pages(stream_pool& p, vm_range& r, std::uintptr_t addr,
                                    std::size_t bytes) REQUIRES(p.mu);

  /// Unmaps every idle page of p, most recently idle first: handles go to the reusable list, or
  /// are released.
  void unmap_idle(stream_pool& p, bool release) REQUIRES(p.mu);

  /// Sleep (tag_sleeper.hpp, docs/design.md "Sleep and wake"): unmaps every mapping of p's
  /// ranges -- touched by blocks or idle -- and releases its handle to the device. The virtual
  /// ranges, the blocks and the page-use counts (vm_range::edge_use) stay as they are: the pages
  /// live blocks touch stay counted as touched, with no mapping behind them, until back() maps
  /// them again (wake). With `synchronize`, one device synchronization first (the pager's own,
  /// so it counts for every idle mapping); without, the caller guarantees that no work has used
  /// the pages since they were mapped (wake undoing its own mappings). Returns the bytes
  /// released. REQUIRES: nothing allocates in or frees into p until back() has mapped
  /// its live blocks again. A failed VM call throws; the page table is consistent either way:
  /// what was released is gone, the rest stays mapped and recorded.
  std::size_t evict(stream_pool& p, bool synchronize) REQUIRES(p.mu);
  /// Bytes that back() could take for new pages right now without moving another pool's idle
  /// pages: the unmapped one-page handles plus what the memory limit and the device leave room
  /// for (the smaller of the two). Changes nothing.
  [[nodiscard]] std::size_t room_bytes();
  /// Releases unmapped handles, largest first, until reserved <= target.
  void release_unmapped(std::size_t target_reserved);

  /// The largest rounded request of pool kind `kind` that, placed in p's range as the allocator
  /// places it (best fit, at the front of the free block), back() serves with no new physical
  /// memory: every page it touches is mapped already, or backed by an unmapped handle
  /// (docs/design.md, "Free memory"). 0 when none is. Changes nothing.
  [[nodiscard]] std::size_t largest_cached_request(const stream_pool& p, pool_kind kind,
                                                   const size_policy& policy) const REQUIRES(p.mu);

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
  /// 1. An unmapped handle kept for reuse that fits `want` (one page; a chunk's handle is listed
  /// only after its release failed, and is never reused).
  std::optional<piece> take_unmapped(std::size_t want);
  /// 2. p's least recently idle page that can be unmapped, unmapped where it sits (its data is
  /// dead). When it is a chunk's, the whole chunk is unmapped and released instead: a piece of 0
  /// bytes (room made, nothing to map).
  std::optional<piece> take_idle(stream_pool& p, std::size_t want) REQUIRES(p.mu);
  /// 3. The same from another pool (pools that are busy are skipped).
  std::optional<piece> take_peer_idle(stream_pool& p, std::size_t want) REQUIRES(p.mu);
  /// take_idle's work on q (locked).
  std::optional<piece> take_oldest_idle(stream_pool& q, std::size_t want) REQUIRES(q.mu);
  /// 4. New physical memory; none above the memory limit or the device's capacity.
  std::optional<piece> create(std::size_t bytes);

  /// Memory is short for `bytes` more: gives back idle pages of p and of the other pools, least
  /// recently idle first, page by page, until the device, the limit and the garbage-collection
  /// threshold have room. True when they have. (Unmapped handles are kept: back() takes them
  /// before it creates, so `bytes` is what they cannot back.)
  bool reclaim(stream_pool& p, std::size_t bytes) REQUIRES(p.mu);
  /// Memory is plentiful for `extra` more: the device, the limit and the garbage-collection
  /// threshold have room for it, so missing pages are created and idle pages stay mapped.
  bool may_grow(stream_pool& p, std::size_t extra) REQUIRES(p.mu);
  /// Coarse handles are on and memory is plentiful for `extra` more with half the capacity (the
  /// smaller of the device and the limit) to spare.
  bool coarse_room(std::size_t extra);

  /// Unmapping is not stream-ordered: work queued before a free may still use the page at its
  /// old address. The one wait that is always safe is the device's -- the pool's stream may have
  /// been destroyed by the program -- and it is skipped when a device synchronization completed
  /// after the page became idle (`idle_epoch`: the idle run's epoch).
  void wait_until_unmappable(std::uint64_t idle_epoch);
  void synchronize_device();

  /// q's least recently idle page whose whole mapping is idle (the first page of the idle list's
  /// tail run, unless it belongs to a straddled chunk), or nullopt. Idle runs are linked with the
  /// count of synchronizations started at the time, so epochs never rise toward the tail: the
  /// least recently idle page is also the one most likely to need no synchronization.
  /// REQUIRES: q unparked.
  struct idle_page {
    vm_range* range;
    std::size_t page;
  };
  std::optional<idle_page> oldest_unmappable(const stream_pool& q) const REQUIRES(q.mu);
  /// The same, most recently idle first (the last page of the head run).
  std::optional<idle_page> newest_unmappable(const stream_pool& q) const REQUIRES(q.mu);
  /// The idle chunks holding b's first or last page that b does not cover whole are unmapped and
  /// released (touch, before b's span leaves the idle runs, while coarse handles are not
  /// plentiful); one that cannot be is counted as straddled.
  void convert_cut_chunks(stream_pool& p, vm_range& r, const block* b, std::size_t first,
                          std::size_t last) noexcept REQUIRES(p.mu);
  struct span_state {
    std::size_t missing_bytes = 0;  // b's pages that no mapping backs
    bool needs_access = false;      // a mapped page of b's span without access (a failed undo)
  };
  /// What b's pages lack: O(log runs) when every page is mapped.
  span_state scan(const vm_range& r, const block* b) const;
  /// back() past its inline test: some page of b unmapped, or some mapped page of r without
  /// access.
  bool back_slow(stream_pool& p, const block* b) REQUIRES(p.mu);
  /// back() without the access grant: maps pieces over b's missing pages.
  bool back_pages(stream_pool& p, vm_range& r, const block* b, std::size_t missing,
                  std::vector<std::size_t>& batch) REQUIRES(p.mu);
  /// cuMemSetAccess over each run of adjacent mapped pages without access in pages [first, last];
  /// on failure, revoke(batch) and rethrow.
  void grant_access(stream_pool& p, vm_range& r, std::size_t first, std::size_t last,
                    const std::vector<std::size_t>& batch) REQUIRES(p.mu);
  /// Unmaps the pages of `batch` (mapped by this call in r) that have no access yet, keeping
  /// their handles.
  void revoke(stream_pool& p, vm_range& r, const std::vector<std::size_t>& batch) noexcept
      REQUIRES(p.mu);

  // --- the idle runs (docs/design.md, "The pager's page table") ---
  /// Pages [first, end) of r, all mapped and untouched, went idle now: a run at the head of p's
  /// idle list (joined to the head run when it continues it with the same epoch: the order of the
  /// pages is the same).
  /// `epoch`: syncs_started_ when they went idle (wait_until_unmappable).
  void idle_add(stream_pool& p, vm_range& r, std::size_t first, std::size_t end,
                std::uint64_t epoch) REQUIRES(p.mu);
  /// idle_add for the free of a block whose pages are all mapped: the pages become the pool's
  /// parked span (vm_range::parked_first) instead of a run, the span parked before is linked
  /// first (unpark) unless the new pages continue it. Allocates nothing (and throws nothing)
  /// when nothing is parked.
  void park(stream_pool& p, vm_range& r, std::size_t first, std::size_t end, std::uint64_t epoch)
      REQUIRES(p.mu);
  /// Links p's parked span, if any, as the head run of its idle list (the idle list then holds
  /// every idle page of p). Changes nothing when it throws.
  void unpark(stream_pool& p) REQUIRES(p.mu);
  /// Links [first, end) of r, of epoch `epoch`, as the head run of p's idle list (joined to the
  /// head run when it continues it with the same epoch). Counts no bytes.
  void link_run(stream_pool& p, vm_range& r, std::size_t first, std::size_t end,
                std::uint64_t epoch) REQUIRES(p.mu);
  /// The mapped pages of [first, last] of r, untouched now, went idle: one run per run of mapped
  /// pages, in address order (one run when all are mapped, as on every free after back()).
  void make_idle(stream_pool& p, vm_range& r, std::size_t first, std::size_t last,
                 std::uint64_t epoch) REQUIRES(p.mu);
  /// touch_freed, for pages that went idle at `epoch`.
  void touch_freed_at(stream_pool& p, const block* b, std::uint64_t epoch) REQUIRES(p.mu);
  /// Pages [first, last] of r are idle no more (touched, or unmapped): they leave the idle runs,
  /// which are trimmed or split in place (the rest keeps its order). O(log runs + runs removed).
  void idle_remove(stream_pool& p, vm_range& r, std::size_t first, std::size_t last) REQUIRES(p.mu);
  /// idle_remove's case of a cache hit: [first, last] is the parked span or one end of it, and
  /// leaves it. False (nothing changed) otherwise.
  bool take_parked(stream_pool& p, vm_range& r, std::size_t first, std::size_t last) noexcept
      REQUIRES(p.mu);
  void list_unlink(stream_pool& p, idle_run* u) noexcept REQUIRES(p.mu);
  void add_idle_bytes(stream_pool& p, std::size_t pages, bool add) noexcept REQUIRES(p.mu);

  /// Unmaps the mapping holding page pg of r -- one page, or a whole chunk -- (every page of it
  /// idle, wait_until_unmappable done; or mapped by this call, no access; or evict) and returns
  /// its handle and bytes.
  piece unmap(stream_pool& p, vm_range& r, std::size_t pg) REQUIRES(p.mu);
  /// An unmapped mapping's handle: kept for reuse when it is one page, else released.
  void keep_or_release(const piece& pc);
  /// What a new mapping's page is to the blocks: touched by the carved block being backed
  /// (back), or by none (map_idle_pages: the page starts idle).
  enum class mapping_use : bool { touched, idle };
  /// Maps pc at page pg -- a chunk over pages [pg, pg + its pages) -- (no access yet) and adds
  /// its pages to `batch`.
  void map(stream_pool& p, vm_range& r, std::size_t pg, const piece& pc,
           std::vector<std::size_t>& batch, mapping_use use = mapping_use::touched) REQUIRES(p.mu);
  void keep(phys_handle h, std::size_t bytes);
  void keep_locked(phys_handle h, std::size_t bytes) REQUIRES(budget_.mu);
  void release(phys_handle h, std::size_t bytes);
  /// Unmaps the least recently idle page of q that can be unmapped (oldest_unmappable) and
  /// releases its handle: a chunk's page releases the whole chunk. False when none can.
  bool release_oldest_idle(stream_pool& q) REQUIRES(q.mu);
  /// Bytes of the one-page handles among the unmapped ones (the ones back() reuses).
  [[nodiscard]] std::size_t page_handle_bytes_locked() const REQUIRES(budget_.mu) {
    return free_handles.count(page_bytes_) * page_bytes_;
  }
  /// Room for `bytes` more under the caps and on the device.
  bool fits(std::size_t bytes);

  device_backend& backend_;
  device_budget& budget_;
  const std::size_t page_bytes_;
  const std::size_t device_total_;
  // The pool table's list and its lock, for the walks over other pools that must not wait
  // (take_peer_idle, reclaim: try_lock only).
  pool_table& table_;  // note_change of a pool the pager locks (another pool's, by try_lock)
  shared_mutex& pools_mu_;
  const std::vector<std::unique_ptr<stream_pool>>& pools_;
  std::function<bool()> may_synchronize_ = [] { return true; };
  const std::atomic<allocation_observer*>* observer_ = nullptr;
  [[nodiscard]] allocation_observer* observer() const noexcept {
    return observer_ != nullptr ? observer_->load(std::memory_order_acquire) : nullptr;
  }
  std::atomic<std::uint64_t> syncs_started_{0};
  std::atomic<std::uint64_t> syncs_done_{0};
  /// The address space of every range of the device (reserve_range adds, destroy_range
  /// subtracts; ranges are made and destroyed under their pool's lock, so pools of the device
  /// change it concurrently).
  std::atomic<std::size_t> address_bytes_{0};
  std::size_t max_chunk_pages_ = k_max_chunk_pages;
  std::size_t min_chunked_pages_ = k_min_chunked_pages;
  std::size_t coarse_pages_ = 0;  // set_coarse_handles; 0: off
  /// straddled_chunks' sum. REQUIRES: the list lock. Not analysed: it reads each pool's owned
  /// counter without the pool's lock, by design (as idle_bytes_of_every_pool_locked).
  [[nodiscard]] std::uint64_t straddles_of_every_pool() const noexcept NO_THREAD_SAFETY_ANALYSIS {
    std::uint64_t n = 0;
    for (const auto& q : pools_) n += q->pages.straddles();
    return n;
  }
  /// The last back() that lacked pages found coarse_room (and no reclaim ran since): a carve that
  /// cuts an idle chunk then straddles it instead of releasing it (no device call to decide).
  std::atomic<bool> coarse_now_{false};
};

}  // namespace cucache::detail
