// Internals of device_allocator, shared by its translation units -- the table of contents of the
// allocator layer. impl is a composition of named parts, each owning its lock and what it guards:
//
//   pools   pool_table     the stream pools, the map by stream key, the thread's pool cache
//   budget  device_budget  reserved bytes and their peak, the caps, the device-call counters
//   graphs  graph_pools    graph pools, routes, captures, blocks held for graphs
//   pager   pager          expandable mode: physical memory behind the pools' virtual ranges
//   events  event_cache    CUDA events kept for reuse
//   sleeper tag_sleeper    sleeping domains, what they keep to wake, and the walk of sleep/wake
//   graph_vm whole_vm_segments  a sleepable tag's graph memory: whole-VM segments' device steps
//   directory segment_directory  which pool owns an address (lock-free reads; a leaf mutex)
//
// and each pool (stream_pool) owns its segments, its allocated blocks by address (block_map),
// free indices, pending frees, statistics and the pager's per-pool state under its own mutex.
// impl itself holds no lock: it is the allocation story (device_allocator.cpp) and what asks its
// rules without allocating (headroom.cpp), written in terms of the parts; the error reports
// (error_report.hpp), the statistics (stats_ledger.hpp) and sleep (tag_sleeper.hpp) are their
// parts' own.
//
// Lock order: ledger.readers (statistics readers) -> the pool list (shared) -> stream_pool::mu in
// index order -> device_budget::mu -> event_cache. The segment directory's mutex and the graph
// pools' lock are leaves (the graph pools' is never held while another lock is taken; stream
// filters run under it and must not call the allocator). The rules are clang thread-safety
// annotations (REQUIRES, GUARDED_BY; "every pool locked" is detail::every_pool), checked by
// tools/check_thread_safety.sh.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "allocator/capture_safe_backend.hpp"
#include "allocator/device_budget.hpp"
#include "allocator/event_cache.hpp"
#include "allocator/graph_pools.hpp"
#include "allocator/hot.hpp"
#include "allocator/pager.hpp"
#include "allocator/placement.hpp"
#include "allocator/pool_table.hpp"
#include "allocator/stats_ledger.hpp"
#include "allocator/stream_id_cache.hpp"
#include "allocator/stream_pool.hpp"
#include "allocator/tag_sleeper.hpp"
#include "allocator/whole_vm_segments.hpp"
#include "core/segment_directory.hpp"
#include "core/size_policy.hpp"
#include "cucache/config.hpp"
#include "cucache/device_allocator.hpp"

namespace cucache {
namespace detail {

/// The size rules in force with the configuration they came from (get_config): published whole
/// by set_size_rules, never changed after (docs/decisions/0019-runtime-size-rules.md).
struct rule_set {
  size_policy policy;
  config cfg;
};

}  // namespace detail

struct device_allocator::impl {
  impl(std::shared_ptr<device_backend> b, config c, std::shared_ptr<allocation_observer> o);
  ~impl();

  // --- allocation paths (device_allocator.cpp) ---
  void* allocate(std::size_t bytes, stream_handle stream);
  /// False (nothing changed) when ptr is not the start of a live block. Inline into the public
  /// frees (a call less: 19 instructions a cache-hit pair, 1.5-1.9% of the traces' allocator
  /// instructions in default mode).
  CUCACHE_HOT bool deallocate(void* ptr, stream_handle stream, bool ordered);
  /// deallocate's general path (captures, observer, other streams). REQUIRES: b taken out of
  /// p's block map.
  bool deallocate_locked(detail::stream_pool& p, detail::block* b, void* ptr, stream_handle stream,
                         bool ordered) REQUIRES(p.mu);
  bool record_stream(void* ptr, stream_handle stream);
  /// f(p, b) for the allocated block b that starts at addr, under its pool p's lock (the
  /// directory names the pool, its block map the block); false, f not called, when none does.
  template <class F>
  bool with_block(std::uintptr_t addr, F&& f) {
    detail::stream_pool* p = directory.owner_of(addr);
    if (p == nullptr) return false;
    detail::lock_guard lk(p->mu);
    detail::block* b = p->blocks.find(addr);
    if (b == nullptr) return false;
    f(*p, b);
    return true;
  }
  void empty_cache();

  /// The segment path's placement (placement.hpp, place_in_segments): the free block of p a
  /// request of `rounded` bytes is carved from, or nullptr.
  CUCACHE_HOT detail::block* find_free(const detail::stream_pool& p, detail::pool_kind kind,
                                       std::size_t rounded) const REQUIRES(p.mu);
  /// find_free for the other translation units: out of line.
  detail::block* find_free_outline(const detail::stream_pool& p, detail::pool_kind kind,
                                   std::size_t rounded) const REQUIRES(p.mu);
  /// The segment path's miss: a new segment, after the oversize release, garbage collection and,
  /// if the device refuses, the out-of-memory ladder.
  /// `segment_bytes`: the new segment's size (0: the size policy's for `rounded`).
  detail::block* grow(detail::stream_pool& p, detail::pool_kind kind, std::size_t rounded,
                      detail::pool_lock& lk, std::size_t segment_bytes = 0) REQUIRES(p.mu);
  /// The allocation path of a graph pool that never splits (PyTorch's MemPool(no_split=True)):
  /// a free block that holds the request is taken whole, else a segment of the request's size
  /// in 2 MiB granules is made for it. lk holds p.mu. Never inlined into allocate.
  [[gnu::noinline]] void* allocate_unsplit(detail::stream_pool& p, detail::pool_kind kind,
                                           std::size_t rounded, std::size_t bytes,
                                           stream_handle stream, detail::pool_lock& lk)
      REQUIRES(p.mu);
  /// The expandable path: place in p's ranges (a new range if none holds it), back the pages,
  /// the ladder once if that fails. nullptr when nothing could serve the request; then
  /// `no_address_space` says whether the last try found no address space for a new range.
  void* allocate_expandable(detail::stream_pool& p, detail::pool_kind kind, std::size_t rounded,
                            std::size_t bytes, detail::pool_lock& lk, bool& no_address_space)
      REQUIRES(p.mu);
  /// What the out-of-memory ladder gives back besides pending frees and settled graph pools.
  enum class ladder_release : bool { free_segments, idle_pages };
  /// The out-of-memory ladder, one rung: unlocks p (held by lk; p keeps its stream meanwhile),
  /// waits for every pending free, settles released graph pools and gives back what `what` names
  /// from every pool (unless a capture forbids synchronizing the device), and locks p again. The
  /// caller retries once.
  void run_ladder(detail::stream_pool& p, detail::pool_lock& lk, ladder_release what)
      REQUIRES(p.mu);

  /// A new device segment of `bytes` for p (its one block free and indexed); nullptr when the
  /// device or the memory limit refuses.
  detail::segment* new_segment(detail::stream_pool& p, detail::pool_kind kind, std::size_t bytes)
      REQUIRES(p.mu);
  /// Expandable mode: where a request of `rounded` bytes of `kind` goes in p -- the placement
  /// rule's free block of p's ranges, else the one free block of a new range of p that holds it
  /// (pager::next_range_bytes). nullptr when the address space has no room for that range.
  /// Inline: the usual case is the allocation's fast path; the growth is out of line.
  CUCACHE_HOT detail::block* place_or_grow(detail::stream_pool& p, detail::pool_kind kind,
                                           std::size_t rounded) REQUIRES(p.mu) {
    if (detail::block* b = detail::place_in_range(p.index_of(kind), rounded)) [[likely]]
      return b;
    return grow_and_place(p, kind, rounded);
  }
  /// place_or_grow's miss: a new range of p that holds `rounded` bytes of `kind`, and the
  /// placement rule's block in it (its one free block). nullptr when the address space has no
  /// room for that range. REQUIRES: no free block of p's ranges of `kind` holds the request.
  detail::block* grow_and_place(detail::stream_pool& p, detail::pool_kind kind, std::size_t rounded)
      REQUIRES(p.mu);
  /// A new virtual range of p for `kind` that holds `need` bytes, its one block free and
  /// indexed; nullptr when the address space has no room.
  detail::segment* add_range(detail::stream_pool& p, detail::pool_kind kind, std::size_t need)
      REQUIRES(p.mu);
  /// Gives range s of p back: its one free block leaves the index, its segment the pool, its
  /// address space the process. REQUIRES: s is empty (one free block, no page mapped).
  void drop_range(detail::stream_pool& p, detail::segment* s) noexcept REQUIRES(p.mu);
  detail::block* carve(detail::stream_pool& p, detail::block* b, detail::pool_kind kind,
                       std::size_t rounded, std::size_t requested) REQUIRES(p.mu);
  /// Takes a carved block that could not be backed -- or published -- back to free.
  void undo_carve(detail::stream_pool& p, detail::block* b) REQUIRES(p.mu);
  /// An allocation's last step: the carved block b goes into p's block map, where a free finds
  /// it. Where the map cannot grow (std::bad_alloc), the carve is undone and the error passed on.
  CUCACHE_HOT void publish(detail::stream_pool& p, detail::block* b) REQUIRES(p.mu);
  void release_to_free(detail::stream_pool& p, detail::block* b) REQUIRES(p.mu);
  // carve and release_to_free as the allocation and free paths inline them (the named functions
  // call these, for the other translation units).
  CUCACHE_HOT detail::block* carve_inline(detail::stream_pool& p, detail::block* b,
                                          detail::pool_kind kind, std::size_t rounded,
                                          std::size_t requested) REQUIRES(p.mu);
  CUCACHE_HOT void release_to_free_inline(detail::stream_pool& p, detail::block* b) REQUIRES(p.mu);
  /// carve's last step, and a take-back's only one: free block b (out of the index, its size
  /// set) becomes allocated for `requested` bytes, counted in p's statistics.
  CUCACHE_HOT void mark_allocated(detail::stream_pool& p, detail::block* b, detail::pool_kind kind,
                                  std::size_t requested) REQUIRES(p.mu);
  /// defer_coalescing: whether an allocation of `rounded` bytes of `kind` in p may take back h,
  /// p's held block -- true exactly when best fit over p with h merged would carve h itself, at
  /// its address and size, and leave every other block as it is (docs/config.md). Its best-fit
  /// test is remembered in p.fit_memo while it passes: the cache-hit pair runs it once.
  [[nodiscard]] CUCACHE_HOT bool takes_back(detail::stream_pool& p, const detail::block* h,
                                            detail::pool_kind kind, std::size_t rounded) const
      REQUIRES(p.mu);
  /// defer_coalescing: the fast free's last step for block b of p -- held unmerged (the previous
  /// held block merged first by the caller), or merged now where it can never be taken back.
  CUCACHE_HOT void hold_or_release(detail::stream_pool& p, detail::block* b) REQUIRES(p.mu);
  detail::segment* add_segment(detail::stream_pool& p, detail::pool_kind kind, std::uintptr_t base,
                               std::size_t bytes, detail::vm_range* vm) REQUIRES(p.mu);
  void release_segment(detail::stream_pool& p, detail::segment* s) REQUIRES(p.mu);
  CUCACHE_HOT detail::block* split_off(detail::stream_pool& p, detail::block* b,
                                       std::size_t front_bytes) REQUIRES(p.mu);
  /// split_off for the other translation units: out of line.
  detail::block* split_off_outline(detail::stream_pool& p, detail::block* b,
                                   std::size_t front_bytes) REQUIRES(p.mu);
  /// Marks a freed block pending (stats); its events or retentions are added by the caller.
  void mark_pending(detail::stream_pool& p, detail::block* b) REQUIRES(p.mu);
  void poll_pending(detail::stream_pool& p) REQUIRES(p.mu);
  void sync_pending(detail::stream_pool& p) REQUIRES(p.mu);
  void release_oversize(detail::stream_pool& p) REQUIRES(p.mu);
  void release_free_segments(std::size_t target_reserved, bool oldest_first)
      REQUIRES(detail::every_pool);
  void collect_garbage(std::size_t incoming) REQUIRES(detail::every_pool);
  /// Released graph pools: after one device synchronization, their retained blocks go back to
  /// their pools and their wholly free segments to the device. REQUIRES: no capture blocking.
  void settle_graph_pools() REQUIRES(detail::every_pool);

  // --- retirement of pools whose streams are gone (device_allocator.cpp) ---
  /// An ordered free on p's own stream left p with no allocated block: records p's quiet event on
  /// that stream (rate-limited) and queues p for retirement.
  void note_quiet(detail::stream_pool& p) REQUIRES(p.mu);
  /// Quiet pools without device memory: their virtual ranges are given back and they are queued
  /// for the next new stream; other pools give back every empty range but the newest of each
  /// kind (expandable mode).
  void retire_empty_pools() REQUIRES(detail::every_pool);

  // --- graph pools: the public calls (device_allocator.cpp, on graphs) ---
  void begin_allocate_to_pool(graph_pool_id pool, stream_filter filter);
  void end_allocate_to_pool(graph_pool_id pool);
  void release_graph_pool(graph_pool_id pool);
  [[nodiscard]] graph_pool_info graph_pool_state(graph_pool_id pool) const;
  [[nodiscard]] bool sync_blocked() const noexcept { return graphs.sync_blocked(); }
  /// The pool key of created stream `stream` in the captures-announced mode while nothing may be
  /// capturing: its id, with no capture query (cached in stream_ids where its mode is on). Where
  /// the id is refused because the stream is being captured after all (a capture nobody
  /// announced), throw_if_unannounced's error. Inline into allocate (a call cost the pair 13
  /// instructions).
  CUCACHE_HOT std::uint64_t announced_stream_key(stream_handle stream);
  /// The stream's id asked of the backend; a refusal runs throw_if_unannounced first.
  std::uint64_t asked_stream_id(stream_handle stream);
  /// announced_stream_key where stream destructions are announced too and the thread's entry
  /// (stream_ids) missed: the id asked and cached.
  [[gnu::noinline]] std::uint64_t cached_stream_key(stream_handle stream);
  /// Throws cuda_error 901 naming the capture when `stream` is being captured; else returns.
  [[gnu::noinline]] void throw_if_unannounced(stream_handle stream);
  /// Allocations refused by throw_if_unannounced.
  std::atomic<std::uint64_t> unannounced_captures{0};
  /// The thread's cached stream id where stream destructions are announced
  /// (stream_id_cache.hpp): consulted only where announced_stream_key would be asked.
  detail::stream_id_cache stream_ids;

  // --- headroom and reserve (headroom.cpp) ---
  /// The largest request on `stream` that allocate would serve now (docs/api.md).
  std::size_t max_allocatable(stream_handle stream);
  /// Pre-creates `bytes` of cached free memory for `stream` (a segment, or mapped idle pages).
  void reserve(std::size_t bytes, stream_handle stream);
  /// The largest request n whose rounded size is at most `rounded` (0 when none).
  [[nodiscard]] std::size_t largest_request_within(std::size_t rounded) const;
  /// Would the out-of-memory ladder (release_free_segments) give segment s of pool p back?
  [[nodiscard]] static bool ladder_may_release(const detail::stream_pool& p,
                                               const detail::segment& s) noexcept REQUIRES(p.mu) {
    return (p.graph == nullptr || p.graph->released) && s.whole_free();
  }

  // --- graph memory of a sleepable tag (the part: whole_vm_segments.hpp) ---
  /// Whether p's new segments are whole-VM segments (segment::whole_vm): p is a part of a graph
  /// pool created under a sleep domain, in expandable mode.
  [[nodiscard]] bool graph_sleeps(const detail::stream_pool& p) const noexcept {
    return p.graph != nullptr && p.domain != 0 && cfg.expandable_segments;
  }

  // --- sleep and wake (the sleeper: tag_sleeper.hpp; its parts are built here, in
  //     device_allocator.cpp; sleep.cpp holds the public calls) ---
  /// The parts the sleeper works with (tag_sleeper::parts). Its walk calls the steps of the
  /// allocation story in it under every pool lock.
  detail::tag_sleeper::parts sleeper_parts();

  // --- errors (the report: error_report.hpp) ---
  /// What an out-of-memory error reports as its cause.
  enum class oom_cause : bool { memory, address_space };
  /// Gathers the facts (statistics, device, limit, capture) and throws out_of_memory with
  /// error_report's message.
  [[noreturn]] void throw_oom(std::size_t bytes, std::size_t rounded, stream_handle stream,
                              oom_cause cause = oom_cause::memory);

  // --- statistics (the ledger: stats_ledger.hpp / .cpp) ---
  /// What the ledger reads of the other parts (stats_ledger::parts).
  [[nodiscard]] detail::stats_ledger::parts ledger_parts() const;
  /// The largest request p serves from cached memory alone -- no device allocation -- on its
  /// stream (device_stats::largest_free_block is the largest over the pools; docs/design.md,
  /// "Free memory"). The placement rules' answer, for the ledger (headroom.cpp).
  std::size_t largest_cached_request(const detail::stream_pool& p) const REQUIRES(p.mu);
  /// The statistics ledger; its `readers` mutex is first in the lock order.
  mutable detail::stats_ledger ledger;

  std::shared_ptr<device_backend> raw;      // the backend as given (public backend())
  std::shared_ptr<device_backend> backend;  // raw behind capture_safe_backend: what is called
  config cfg;
  /// defer_coalescing in force (docs/config.md). A free on the fast path then holds its block in
  /// the pool's lock (pool_mutex::hold) instead of merging it -- in expandable mode with its pages
  /// still touched (pager::hold_pages).
  const bool defer_frees = cfg.defer_coalescing;
  /// Who listens (null: nobody). Published once -- at construction or by attach_observer -- and
  /// read without a lock on every allocation and free: one load, as cheap as a plain pointer.
  std::atomic<allocation_observer*> observer{nullptr};
  std::shared_ptr<allocation_observer> observer_owner;  // keeps *observer alive
  detail::mutex observer_mu_;                           // serializes attach_observer
  /// The size rules in force, for readers that hold a pool lock (any one): set_size_rules
  /// changes them with every pool locked. Reading them without a pool lock is a data race; the
  /// lock-free start of allocate reads `rules` instead.
  detail::size_policy policy;
  /// The same rules (and the configuration with them) as an immutable published object, for
  /// readers without a pool lock: one acquire load. Every rule set ever published stays in
  /// `rules_kept` until the allocator dies, so a reader never sees freed memory.
  std::atomic<const detail::rule_set*> rules{nullptr};
  std::vector<std::unique_ptr<const detail::rule_set>> rules_kept GUARDED_BY(detail::every_pool);
  /// set_size_rules with every pool locked: publishes `next`, recounts the oversize counters.
  void set_size_rules(const config& next, std::size_t gc_bytes) REQUIRES(detail::every_pool);
  /// p's oversize segments (cudaMalloc'd) and oversize allocated blocks under the rules in
  /// force, counted by walking its segments: what its statistics must say.
  [[nodiscard]] std::pair<std::uint64_t, std::uint64_t> recount_oversize(
      const detail::stream_pool& p) const REQUIRES(p.mu);
  /// The physical page size in expandable mode (0 otherwise).
  std::size_t page_bytes = 0;

  detail::device_budget budget;
  /// Whole-VM segments: a sleepable tag's graph memory (after backend and budget, which it uses).
  detail::whole_vm_segments graph_vm{*backend, budget};
  /// The memory fraction in force (set_memory_fraction, else the config's; negative: none set).
  std::atomic<double> memory_fraction{-1.0};
  /// Which pool owns an address: every segment is added with add_segment and removed with
  /// release_segment or drop_range.
  detail::segment_directory directory;
  detail::pool_table pools;
  detail::graph_pools graphs;
  detail::event_cache events;
  detail::tag_sleeper sleeper;  // sleeping domains (expandable mode)
  std::atomic<std::uint64_t> segment_ids{0};
  // Expandable segments: the pager backs the pools' virtual ranges with physical memory.
  std::unique_ptr<detail::pager> pager;
};

}  // namespace cucache
