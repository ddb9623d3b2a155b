// Internals of device_allocator, shared by its translation units (allocation paths, invariant
// checker, observers). Lock order: pools_mu_ (shared) -> stream_pool::mu in index order ->
// grow_mu_ -> events_mu_. block_map shard locks are leaves.
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

#include "allocator/stream_pool.hpp"
#include "core/block_map.hpp"
#include "core/size_policy.hpp"
#include "cucache/config.hpp"
#include "cucache/device_allocator.hpp"

namespace cucache {

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
  bool record_stream(void* ptr, stream_handle stream);
  void empty_cache();

  detail::stream_pool& pool_for(stream_handle stream);
  detail::block* find_free(detail::stream_pool& p, detail::pool_kind kind, std::size_t rounded);
  detail::block* grow(detail::stream_pool& p, detail::pool_kind kind, std::size_t rounded,
                      std::unique_lock<detail::pool_mutex>& lk);
  detail::block* new_segment(detail::stream_pool& p, detail::pool_kind kind, std::size_t bytes);
  detail::block* carve(detail::stream_pool& p, detail::block* b, detail::pool_kind kind,
                       std::size_t rounded, std::size_t requested);
  void release_to_free(detail::stream_pool& p, detail::block* b);
  detail::segment* add_segment(detail::stream_pool& p, detail::pool_kind kind, std::uintptr_t base,
                               std::size_t bytes, detail::vm_range* vm);
  void release_segment(detail::stream_pool& p, detail::segment* s);
  detail::block* split_off(detail::stream_pool& p, detail::block* b, std::size_t front_bytes);
  void poll_pending(detail::stream_pool& p);
  void sync_pending(detail::stream_pool& p);
  void release_oversize(detail::stream_pool& p);
  void release_free_segments(std::size_t target_reserved, bool oldest_first);
  void collect_garbage(std::size_t incoming);
  // --- expandable segments (expandable.cpp) ---
  detail::segment* ensure_range(detail::stream_pool& p, detail::pool_kind kind);
  /// Maps every page b touches. False when no physical memory could be found (b unchanged).
  bool ensure_mapped(detail::stream_pool& p, detail::block* b);
  void undo_carve(detail::stream_pool& p, detail::block* b);
  bool may_grow_in_place(detail::stream_pool& p, std::size_t extra);
  std::pair<detail::block*, bool> place(detail::free_index& index, std::size_t rounded) const;
  detail::block* split_for_back(detail::stream_pool& p, detail::pool_kind kind, detail::block* b,
                                std::size_t rounded);
  void split_idle_overhang(detail::stream_pool& p, detail::vm_range& r, std::uintptr_t addr,
                           std::size_t bytes);
  void touch_pages(detail::stream_pool& p, const detail::block* b, int delta);
  std::optional<phys_handle> create_handle(detail::stream_pool& p, std::size_t bytes);
  void release_handle(phys_handle h, std::size_t bytes);
  void map_handle(detail::stream_pool& p, detail::vm_range& r, std::size_t first_page,
                  std::size_t pages, phys_handle h, bool stitched);
  phys_handle unmap_mapping(detail::stream_pool& p, detail::vm_mapping* m);
  void record_mapping(detail::stream_pool& p, detail::vm_range& r, std::size_t first_page,
                      std::size_t pages, phys_handle h);
  /// Puts an unmapped handle on the reusable list (_locked: REQUIRES grow_mu_ held).
  void keep_handle(phys_handle h, std::size_t bytes);
  void keep_handle_locked(phys_handle h, std::size_t bytes);
  void idle_link(detail::stream_pool& p, detail::vm_mapping* m);
  void idle_unlink(detail::stream_pool& p, detail::vm_mapping* m);
  /// Waits until no queued work can still use an idle page, before any unmap: a device-wide
  /// synchronization, which names no stream. Every unmap path calls it; the pool's own stream is
  /// never synchronized, because the program may have destroyed it (docs/design.md).
  void wait_until_idle_pages_unused();
  /// Unmaps every idle mapping of p (after wait_until_idle_pages_unused); handles go to the free
  /// list, or are released when `release` is set.
  void unmap_idle(detail::stream_pool& p, bool release);
  void release_free_handles(std::size_t target_reserved);
  void destroy_range(detail::stream_pool& p, detail::segment* s) noexcept;
  void* allocate_expandable(detail::stream_pool& p, detail::pool_kind kind, std::size_t rounded,
                            std::size_t bytes, std::unique_lock<detail::pool_mutex>& lk);

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

  // --- observers (observe/*.cpp) ---
  device_stats stats_locked() const;  // REQUIRES: all pools locked

  std::shared_ptr<device_backend> backend;
  config cfg;
  std::shared_ptr<allocation_observer> observer;  // null: nobody listens
  detail::size_policy policy;
  std::uint64_t id;  // unique per allocator instance, for the thread-local pool cache
  std::size_t device_total = 0;
  std::size_t limit = 0;     // cap on reserved bytes; 0 = none
  std::size_t gc_bytes = 0;  // garbage-collection trigger on reserved bytes; 0 = off

  detail::block_map blocks;
  mutable std::shared_mutex pools_mu_;
  std::vector<std::unique_ptr<detail::stream_pool>> pools;
  std::unordered_map<stream_handle, detail::stream_pool*> pool_by_stream;

  // Device-wide reservation, changed only by device calls under grow_mu_.
  mutable std::mutex grow_mu_;
  std::size_t reserved = 0;
  std::size_t reserved_peak = 0;
  std::atomic<std::uint64_t> device_alloc_count{0};
  std::atomic<std::uint64_t> device_free_count{0};
  std::atomic<std::uint64_t> oom_count{0};
  std::atomic<std::uint64_t> retry_count{0};
  std::atomic<std::uint64_t> segment_ids{0};

  // Expandable segments. Physical handles not mapped anywhere, by size; under grow_mu_.
  bool expandable = false;
  std::size_t page_bytes = 0;
  std::multimap<std::size_t, phys_handle> free_handles;
  std::size_t free_handle_bytes = 0;
  std::atomic<std::uint64_t> vm_create_count{0};
  std::atomic<std::uint64_t> vm_release_count{0};
  std::atomic<std::uint64_t> vm_map_count{0};
  std::atomic<std::uint64_t> vm_unmap_count{0};
  std::atomic<std::uint64_t> stitched_pages{0};

  std::mutex events_mu_;
  std::vector<event_handle> free_events;
};

}  // namespace cucache
