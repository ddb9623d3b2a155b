// The observe hub: one allocation observer per device, fed by every allocator the registry
// creates, that keeps what snapshots, leak reports and tag statistics need -- a ring of the last
// N device events (history:N), a record per live allocation when one is needed (a tag, leak
// hunting or call stacks), per-tag bytes, and the live total at every step marker. The trace
// recorder (trace:PATH) is called through it. With nothing on and no tag set, an allocation
// costs the observer one thread-local read and a free one atomic load.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "backend/thread_annotations.hpp"
#include "cucache/config.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/observe.hpp"
#include "observe/backtrace.hpp"

namespace cucache::detail {

// --- tags (process-wide, independent of any registry) ------------------------------------------

/// The calling thread's current tag id, 0 for none. Read on every allocation.
[[nodiscard]] std::uint32_t current_tag_id() noexcept;
/// The name of tag `id` (> 0).
[[nodiscard]] std::string tag_name(std::uint32_t id);
/// The id of `name`, interned. Throws invalid_argument for an empty name.
[[nodiscard]] std::uint32_t tag_id(std::string_view name);
/// The id of `name` if it was ever interned, else 0.
[[nodiscard]] std::uint32_t find_tag_id(std::string_view name);
void push_tag_id(std::uint32_t id);
/// Throws invalid_argument naming `function` when the thread has no current tag.
void pop_tag_id(const char* function);

// --- segment listener (process-wide) -----------------------------------------------------------

/// What a segment listener is told of (the values are cucache_torch.h's CUCACHE_TORCH_SEGMENT_*).
enum class segment_event : int {
  alloc = 0,  ///< a segment created (cudaMalloc)
  free = 1,   ///< a segment returned to the device
  map = 2,    ///< expandable segments: pages of a pool's range mapped and made accessible
  unmap = 3,  ///< expandable segments: an accessible mapping about to be unmapped
};
/// Told of every segment a device allocator creates or returns to the device, and in expandable
/// mode of every range of pages it maps or unmaps, on any device whose allocator reports to the
/// hub (registry::activate_observers). Called under the pool's lock: it must be quick and must not
/// call cucache. The PyTorch extension's SEGMENT_ALLOC / SEGMENT_FREE / SEGMENT_MAP /
/// SEGMENT_UNMAP trace entries (cucache_torch_set_segment_listener), which NCCL's user-buffer
/// registration listens to.
using segment_listener_fn = void (*)(void* ctx, int device, segment_event event,
                                     std::uintptr_t base, std::size_t bytes, stream_handle stream);
/// Sets (fn non-null) or clears (fn null) the process's one listener. Thread-safe; a listener
/// replaced or cleared may still be running on another thread when this returns.
void set_segment_listener(segment_listener_fn fn, void* ctx) noexcept;

// --- the hub ----------------------------------------------------------------------------------

/// One event of a device trace (PyTorch's TraceEntry).
struct history_entry {
  enum class action : std::uint8_t {
    alloc,
    free_requested,
    free_completed,
    segment_alloc,
    segment_free,
    segment_map,
    segment_unmap,
    oom,
    snapshot,
  };
  action act = action::alloc;
  std::uintptr_t addr = 0;  // for oom: 0 (the device's free memory is not known here)
  std::size_t size = 0;
  stream_handle stream = nullptr;
  std::uint64_t time_us = 0;  // microseconds since the Unix epoch
  std::uint32_t tag = 0;
  std::shared_ptr<const backtrace> frames;
};
[[nodiscard]] const char* to_string(history_entry::action a) noexcept;

/// What the hub knows of a live allocation it records.
struct live_record {
  std::size_t size = 0;
  stream_handle stream = nullptr;
  std::uint32_t tag = 0;
  std::uint64_t step = 0;
  std::shared_ptr<const backtrace> frames;
};

class observe_hub {
 public:
  /// `trace`, when not null, is told of every event too. `devices` is the device count.
  observe_hub(const config& cfg, std::shared_ptr<allocation_observer> trace, int devices);
  ~observe_hub();
  observe_hub(const observe_hub&) = delete;
  observe_hub& operator=(const observe_hub&) = delete;

  /// The observer to create `device`'s allocator with. The hub must outlive the allocator.
  [[nodiscard]] std::shared_ptr<allocation_observer> observer_for(int device);

  [[nodiscard]] bool history_on() const noexcept { return history_cap_ != 0; }
  [[nodiscard]] bool leak_on() const noexcept { return leak_steps_ != 0; }

  /// The device's trace, oldest first (empty when history is off).
  [[nodiscard]] std::vector<history_entry> history(int device) const;
  /// Appends a "snapshot" event to every device's trace (history on).
  void note_snapshot();
  /// The records of `device`'s live allocations (those the hub keeps), by address.
  [[nodiscard]] std::unordered_map<std::uintptr_t, live_record> live(int device) const;

  void mark_step();
  [[nodiscard]] std::uint64_t steps() const noexcept { return step_.load(); }
  /// K = steps, or the config's leak_steps when 0. Errors as cucache::leak_report.
  [[nodiscard]] std::vector<leak_candidate> leak_report(std::uint64_t steps) const;
  [[nodiscard]] std::uint64_t leak_window(std::uint64_t steps) const;

  [[nodiscard]] std::vector<tag_stat> tag_stats(int device) const;

  // Tag limits (cucache::set_tag_limit). `device` must be in [0, devices).
  void set_tag_limit(int device, std::uint32_t tag, std::size_t bytes);
  [[nodiscard]] std::size_t tag_limit(int device, std::uint32_t tag) const;
  /// Whether any tag ever had a limit: until then an allocation pays nothing for them.
  [[nodiscard]] bool limits_on() const noexcept {
    return limits_on_.load(std::memory_order_acquire);
  }
  /// Counts `requested` bytes against `tag`'s limit on `device` until record_allocate or
  /// refund_admission settles them (the calling thread's next allocation event), or throws
  /// tag_limit_error, changing nothing but the tag's refusal count.
  void admit(int device, std::uint32_t tag, std::size_t requested);
  /// An allocation admit counted failed: its bytes no longer count.
  void refund_admission(int device) noexcept;

  // The observer's entry points (observe_hub.cpp).
  void record_allocate(int device, const void* ptr, std::size_t size, stream_handle stream,
                       std::uint32_t tag) noexcept;
  void record_free(int device, const void* ptr, std::size_t size, stream_handle stream) noexcept;
  void record_event(int device, history_entry::action act, std::uintptr_t addr, std::size_t size,
                    stream_handle stream) noexcept;
  /// Nonzero when an allocation needs record_allocate even without a tag.
  [[nodiscard]] bool always_record() const noexcept { return always_record_; }
  /// Nonzero when a free needs record_free.
  [[nodiscard]] bool free_needs_record() const noexcept {
    return always_record_ || tagged_live_.load(std::memory_order_relaxed) != 0;
  }
  [[nodiscard]] allocation_observer* trace() const noexcept { return trace_.get(); }

 private:
  struct tag_counter {
    std::size_t current = 0;
    std::size_t peak = 0;
    std::uint64_t live = 0;
    std::uint64_t total = 0;
    std::size_t limit = k_no_tag_limit;
    std::size_t admitted = 0;  // bytes of allocations under way that admit counted
    std::uint64_t refusals = 0;
  };
  struct device_state {
    mutable mutex mu;
    std::unordered_map<std::uintptr_t, live_record> live GUARDED_BY(mu);
    std::vector<tag_counter> tags GUARDED_BY(mu);  // by tag id
    std::vector<history_entry> ring GUARDED_BY(mu);
    std::size_t ring_next GUARDED_BY(mu) = 0;  // where the next event goes once the ring is full
    std::size_t live_total GUARDED_BY(mu) = 0;
    // live_total at each marker; [0]: at the start
    std::vector<std::size_t> step_totals GUARDED_BY(mu){0};
  };
  void push_locked(device_state& d, history_entry e) REQUIRES(d.mu);

  std::shared_ptr<allocation_observer> trace_;
  std::size_t history_cap_ = 0;
  std::uint64_t leak_steps_ = 0;
  bool backtraces_ = false;
  bool always_record_ = false;  // leak hunting or call stacks: every allocation is recorded
  std::atomic<std::uint64_t> step_{0};
  std::atomic<std::uint64_t> tagged_live_{0};
  std::atomic<bool> limits_on_{false};
  // The observers handed out (observer_for), told when the first limit is set.
  mutex observers_mu_;
  std::vector<std::weak_ptr<allocation_observer>> observers_ GUARDED_BY(observers_mu_);
  mutable mutex step_mu_;  // one step marker at a time (mark_step, leak_report)
  std::vector<std::unique_ptr<device_state>> devices_;
};

/// The snapshot of PyTorch's memory viewer (torch.cuda.memory._snapshot()) as JSON, for the
/// allocators of `by_device` (index = device; nullptr for a device never used). torch_snapshot.cpp.
[[nodiscard]] std::string torch_snapshot_json(const std::vector<const device_allocator*>& by_device,
                                              const observe_hub& hub);
/// Tag statistics as a JSON array of {tag, current_bytes, peak_bytes, allocations,
/// total_allocations, limit_bytes (null: none), limit_refusals} (CUCACHE_TAG_STAT_FIELDS; the
/// Python package's cucache.tag_stats).
[[nodiscard]] std::string tag_stats_json(const std::vector<tag_stat>& tags);
/// Sleeping tags as a JSON array of {tag, bytes, host_bytes, copy_seconds} (the Python package's
/// cucache.sleeping).
[[nodiscard]] std::string sleeping_json(const std::vector<sleep_stat>& tags);
/// leak_report as JSON (cucache::leak_report_json).
[[nodiscard]] std::string leak_report_json(const observe_hub& hub, std::uint64_t steps);

}  // namespace cucache::detail
