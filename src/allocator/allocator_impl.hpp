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

#include "allocator/pager.hpp"
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
  // --- expandable segments: ranges, placement and the ladder (expandable.cpp); pages: the pager
  // ---
  detail::segment* ensure_range(detail::stream_pool& p, detail::pool_kind kind);
  void undo_carve(detail::stream_pool& p, detail::block* b);
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

  // Expandable segments: the pager backs the pools' virtual ranges with physical memory.
  bool expandable = false;
  std::size_t page_bytes = 0;
  std::unique_ptr<detail::pager> pager;

  std::mutex events_mu_;
  std::vector<event_handle> free_events;
};

}  // namespace cucache
