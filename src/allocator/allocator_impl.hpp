// Internals of device_allocator, shared by its translation units (allocation paths, invariant
// checker, observers). Lock order: pools_mu_ (shared) -> stream_pool::mu in index order ->
// grow_mu_ -> events_mu_. block_map shard locks and graph_mu_ are leaves (graph_mu_ is never held
// while another lock is taken; stream filters run under it and must not call the allocator).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocator/capture_safe_backend.hpp"
#include "allocator/pager.hpp"
#include "allocator/stream_pool.hpp"
#include "core/block_map.hpp"
#include "core/size_policy.hpp"
#include "cucache/config.hpp"
#include "cucache/device_allocator.hpp"

/// Hot-path helpers: inline into allocate and deallocate, defined in device_allocator.cpp (the only
/// translation unit that calls them).
#define CUCACHE_HOT [[gnu::always_inline]] inline

namespace cucache {

namespace detail {

/// The pool key of the legacy default stream (nullptr), which is never destroyed nor captured:
/// no stream_id call for it. Real and simulated stream ids never take this value.
inline constexpr std::uint64_t k_legacy_stream_key = ~std::uint64_t{0};

/// A block of some pool held pending for a graph pool until its release (and a device
/// synchronization) proves that no replay can touch it.
struct retained_block {
  stream_pool* pool;
  block* b;
};

/// A private pool of graph memory: one stream_pool ("part") per stream that allocated into it, so
/// that a block freed on a stream is reused on that stream only, as everywhere else.
struct graph_pool {
  graph_pool_id id;
  std::uint64_t uses = 0;  // owners not yet released
  bool routed = false;     // a begin_allocate_to_pool route is active
  bool released = false;   // uses reached 0 (or never had any: sync_waiters)
  bool settled = false;    // released, and a device synchronization completed since
  std::unordered_map<std::uint64_t, stream_pool*> parts;  // by stream key
  std::vector<retained_block> retained;
};

/// A stream cucache saw capturing (an allocation on it, or a free that used it).
struct known_capture {
  std::uint64_t capture_id;
  std::uint64_t stream_key;
  graph_pool* pool;
};

struct graph_route {
  graph_pool* pool;
  stream_filter filter;
};

}  // namespace detail

struct device_allocator::impl {
  impl(std::shared_ptr<device_backend> b, config c, std::shared_ptr<allocation_observer> o);
  ~impl();

  /// `fraction` of `base` bytes, rounded down, for config key `key`; throws invalid_argument
  /// naming the key and value when that is 0 bytes, which would mean `zero_means`.
  [[nodiscard]] std::size_t bytes_of_fraction(const char* key, double fraction, std::size_t base,
                                              const char* of_what, const char* zero_means) const;

  // --- allocation paths (device_allocator.cpp) ---
  void* allocate(std::size_t bytes, stream_handle stream);
  /// False (nothing changed) when ptr is not the start of a live block.
  bool deallocate(void* ptr, stream_handle stream, bool ordered);
  /// deallocate's general path (captures, observer, other streams). REQUIRES: p.mu held, b
  /// taken out of the block map.
  bool deallocate_locked(detail::stream_pool& p, detail::block* b, void* ptr,
                         stream_handle stream, bool ordered);
  bool record_stream(void* ptr, stream_handle stream);
  void empty_cache();
  void begin_allocate_to_pool(graph_pool_id pool, stream_filter filter);
  void end_allocate_to_pool(graph_pool_id pool);
  void release_graph_pool(graph_pool_id pool);
  [[nodiscard]] graph_pool_info graph_pool_state(graph_pool_id pool) const;

  /// The pool of `stream`, whose key (stream_key) is `key`: a thread-local one-entry cache in
  /// front of pool_for_key. The key comes from the caller, who asked the backend once for the
  /// stream's capture and id (device_backend::identify).
  CUCACHE_HOT detail::stream_pool& pool_for(stream_handle stream, std::uint64_t key);
  /// pool_for and find_free for the other translation units (headroom.cpp): out of line.
  detail::stream_pool& pool_for_outline(stream_handle stream);
  detail::block* find_free_outline(const detail::stream_pool& p, detail::pool_kind kind,
                                   std::size_t rounded) const;
  detail::stream_pool& pool_for_key(stream_handle stream, std::uint64_t key);
  /// The key of `stream`'s pool: its stream id.
  [[nodiscard]] std::uint64_t stream_key(stream_handle stream) const {
    return stream == nullptr ? detail::k_legacy_stream_key : raw->stream_id(stream);
  }
  /// The key of a stream that is being captured. cudaStreamGetId is refused on a capturing stream
  /// in every capture mode, relaxed included, and the refusal invalidates the capture (seen on the
  /// H200), so a capturing stream is keyed by its handle, tagged so that it never equals an id
  /// (ids are small counters). A stream cannot be destroyed while it is being captured, so the
  /// handle names one stream for as long as the capture lasts; graph pools and the list of known
  /// captures are the only places such keys go.
  [[nodiscard]] static std::uint64_t capture_key(stream_handle stream) noexcept {
    return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(stream)) | k_capture_key_tag;
  }
  static constexpr std::uint64_t k_capture_key_tag = std::uint64_t{1} << 63;
  /// The key of any stream: its capture key while it is being captured, its id otherwise.
  [[nodiscard]] std::uint64_t any_stream_key(stream_handle stream) const {
    if (stream == nullptr) return detail::k_legacy_stream_key;
    return raw->capture_status(stream).state != capture_state::none ? capture_key(stream)
                                                                     : raw->stream_id(stream);
  }
  /// True when `stream`, named by the caller, is the stream p serves (handles equal, and for the
  /// per-thread handle the ids too). A destroyed stream's pool is never confused with a live one
  /// on the allocation path (keys differ); here equal handles of different streams can only mean
  /// that p's stream was destroyed, and p's blocks are then reachable only through paths that
  /// synchronize the device, so treating them as p's own stream is safe.
  [[nodiscard]] bool names_pool_stream(const detail::stream_pool& p, stream_handle stream) const {
    return stream == p.stream && (stream != per_thread_stream() || any_stream_key(stream) == p.key);
  }
  detail::stream_pool& new_pool(stream_handle stream, std::uint64_t key, detail::graph_pool* g);

  // --- graph capture (device_allocator.cpp) ---
  /// The graph pool part an allocation on `stream` goes to (routes first, then its capture), or
  /// nullptr for the stream's own pool. Throws cuda_error 901 for an invalidated capture.
  detail::stream_pool* graph_part_for(stream_handle stream, capture_info cap);
  /// The graph pool for work on capturing stream `stream` (a route's, else the capture's own,
  /// created with one owner), noting the capture. REQUIRES: graph_mu_ held.
  detail::graph_pool* capture_pool_locked(stream_handle stream, std::uint64_t key,
                                          capture_info cap);
  /// The pool of the capture cucache knows on stream key `key`, or nullptr. REQUIRES graph_mu_.
  detail::graph_pool* known_capture_locked(std::uint64_t key) const;
  /// Holds b (pending, of pool p) for g. REQUIRES: p.mu held.
  void retain(detail::graph_pool& g, detail::stream_pool& p, detail::block* b);
  /// Marks a freed block pending (stats); its events or retentions are added by the caller.
  void mark_pending(detail::stream_pool& p, detail::block* b);
  /// Recomputes the blocker counts. REQUIRES: graph_mu_ held.
  void update_blockers_locked();
  /// True while a capture cucache knows of may be underway (a route, or a capture not seen ended):
  /// nothing may synchronize the device.
  [[nodiscard]] bool sync_blocked() const noexcept {
    return routes_n.load(std::memory_order_acquire) != 0 ||
           captures_n.load(std::memory_order_acquire) != 0;
  }
  /// Released graph pools: after one device synchronization, their retained blocks go back to
  /// their pools and their wholly free segments to the device. REQUIRES: all pools locked, no
  /// capture blocking.
  void settle_graph_pools();
  [[nodiscard]] detail::graph_pool* find_graph_pool(graph_pool_id id) const;  // REQUIRES graph_mu_
  [[noreturn]] void throw_capture_blocks(const char* what) const;
  CUCACHE_HOT detail::block* find_free(const detail::stream_pool& p, detail::pool_kind kind,
                                       std::size_t rounded) const;
  detail::block* grow(detail::stream_pool& p, detail::pool_kind kind, std::size_t rounded,
                      std::unique_lock<detail::pool_mutex>& lk);
  /// A new device segment of `bytes` for p (its one block free and indexed); nullptr when the
  /// device or the memory limit refuses.
  detail::segment* new_segment(detail::stream_pool& p, detail::pool_kind kind, std::size_t bytes);
  detail::block* carve(detail::stream_pool& p, detail::block* b, detail::pool_kind kind,
                       std::size_t rounded, std::size_t requested);
  void release_to_free(detail::stream_pool& p, detail::block* b);
  // carve and release_to_free as the allocation and free paths inline them (the named functions
  // call these, for the other translation units).
  CUCACHE_HOT detail::block* carve_inline(detail::stream_pool& p, detail::block* b,
                                          detail::pool_kind kind, std::size_t rounded,
                                          std::size_t requested);
  CUCACHE_HOT void release_to_free_inline(detail::stream_pool& p, detail::block* b);
  detail::segment* add_segment(detail::stream_pool& p, detail::pool_kind kind, std::uintptr_t base,
                               std::size_t bytes, detail::vm_range* vm);
  void release_segment(detail::stream_pool& p, detail::segment* s);
  CUCACHE_HOT detail::block* split_off(detail::stream_pool& p, detail::block* b,
                                       std::size_t front_bytes);
  void poll_pending(detail::stream_pool& p);
  void sync_pending(detail::stream_pool& p);
  void release_oversize(detail::stream_pool& p);
  void release_free_segments(std::size_t target_reserved, bool oldest_first);
  void collect_garbage(std::size_t incoming);
  // --- expandable segments: ranges, placement and the ladder (expandable.cpp); pages: the pager
  // ---
  detail::segment* ensure_range(detail::stream_pool& p, detail::pool_kind kind);
  void undo_carve(detail::stream_pool& p, detail::block* b);
  void* allocate_expandable(detail::stream_pool& p, detail::pool_kind kind, std::size_t rounded,
                            std::size_t bytes, std::unique_lock<detail::pool_mutex>& lk);

  // --- headroom and reserve (headroom.cpp) ---
  /// The largest request on `stream` that allocate would serve now (docs/api.md).
  std::size_t max_allocatable(stream_handle stream);
  /// Pre-creates `bytes` of cached free memory for `stream` (a segment, or mapped idle pages).
  void reserve(std::size_t bytes, stream_handle stream);
  /// The largest request n whose rounded size is at most `rounded` (0 when none).
  [[nodiscard]] std::size_t largest_request_within(std::size_t rounded) const;
  /// Would the out-of-memory ladder (release_free_segments) give segment s of pool p back?
  [[nodiscard]] static bool ladder_may_release(const detail::stream_pool& p,
                                               const detail::segment& s) noexcept {
    return (p.graph == nullptr || p.graph->released) && s.whole_free();
  }

  [[noreturn]] void throw_oom(std::size_t bytes, std::size_t rounded, stream_handle stream);
  [[noreturn]] void throw_bad_pointer(const void* ptr, const char* what);
  [[nodiscard]] std::string explain_bad_pointer(const void* ptr, const char* what) const;

  /// All pools, locked in index order, for device-wide work.
  struct all_locked {
    std::shared_lock<std::shared_mutex> list;
    std::vector<std::unique_lock<detail::pool_mutex>> locks;
  };
  all_locked lock_all() const;

  event_handle take_event();
  void return_event(event_handle e) noexcept;

  // --- statistics (stats.cpp) ---
  device_stats stats_locked() const;  // REQUIRES: all pools locked
  /// The largest request the allocator serves from cached memory alone -- no device allocation
  /// -- on the stream of some pool (device_stats::largest_free_block; docs/design.md, "Free
  /// memory"). REQUIRES: all pools locked.
  std::size_t largest_cached_request() const;

  std::shared_ptr<device_backend> raw;      // the backend as given (public backend())
  std::shared_ptr<device_backend> backend;  // raw behind capture_safe_backend: what is called
  config cfg;
  /// Who listens (null: nobody). Published once -- at construction or by attach_observer -- and
  /// read without a lock on every allocation and free: one load, as cheap as a plain pointer.
  std::atomic<allocation_observer*> observer{nullptr};
  std::shared_ptr<allocation_observer> observer_owner;  // keeps *observer alive
  std::mutex observer_mu_;                              // serializes attach_observer
  detail::size_policy policy;
  std::uint64_t id;  // unique per allocator instance, for the thread-local pool cache
  std::size_t device_total = 0;
  std::size_t limit = 0;     // cap on reserved bytes; 0 = none
  std::size_t gc_bytes = 0;  // garbage-collection trigger on reserved bytes; 0 = off

  detail::block_map blocks;  // the pointer map: allocated blocks by address
  mutable std::shared_mutex pools_mu_;
  std::vector<std::unique_ptr<detail::stream_pool>> pools;
  std::unordered_map<std::uint64_t, detail::stream_pool*> pool_by_stream;  // by stream key

  // Graph capture, under graph_mu_ (a leaf).
  mutable std::mutex graph_mu_;
  std::map<graph_pool_id, std::unique_ptr<detail::graph_pool>> graph_pools;
  std::vector<detail::graph_route> routes;
  std::vector<detail::known_capture> captures;
  detail::graph_pool sync_waiters;           // blocks waiting for the next device synchronization
  std::atomic<std::uint32_t> routes_n{0};    // routes.size()
  std::atomic<std::uint32_t> captures_n{0};  // captures.size()

  // Device-wide reservation, changed only by device calls under grow_mu_.
  mutable std::mutex grow_mu_;
  std::size_t reserved = 0;
  std::size_t reserved_peak = 0;
  // Physical memory created and released: segments, or in expandable mode physical handles.
  std::atomic<std::uint64_t> device_alloc_count{0};
  std::atomic<std::uint64_t> device_free_count{0};
  std::atomic<std::uint64_t> oom_count{0};
  std::atomic<std::uint64_t> retry_count{0};
  std::atomic<std::uint64_t> segment_ids{0};

  // Expandable segments: the pager backs the pools' virtual ranges with physical memory.
  std::size_t page_bytes = 0;
  std::unique_ptr<detail::pager> pager;

  std::mutex events_mu_;
  std::vector<event_handle> free_events;
};

}  // namespace cucache
