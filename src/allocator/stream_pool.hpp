// The per-stream state of a device allocator: its segments, its two free indices (small and
// large pool), its freed-but-pending blocks and its statistics, all under one mutex. A block is
// reused only on its own stream, so pools never share blocks and threads on different streams
// never contend here.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "allocator/pool_mutex.hpp"
#include "core/block.hpp"
#include "core/free_index.hpp"
#include "core/vm_range.hpp"
#include "cucache/backend.hpp"
#include "cucache/stats.hpp"

namespace cucache::detail {

/// Recycles objects of one type without touching the heap in steady state. Not thread-safe:
/// each stream_pool owns one, used under the pool's mutex.
template <class T>
class object_arena {
 public:
  T* make() {
    if (free_ == nullptr) refill();
    T* t = free_;
    free_ = *reinterpret_cast<T**>(t);
    return new (t) T{};
  }
  void recycle(T* t) noexcept {
    t->~T();
    *reinterpret_cast<T**>(t) = free_;
    free_ = t;
  }

 private:
  static constexpr std::size_t k_chunk = 256;
  void refill() {
    auto& chunk = chunks_.emplace_back(std::make_unique<storage[]>(k_chunk));
    for (std::size_t i = 0; i < k_chunk; ++i) {
      T* t = reinterpret_cast<T*>(&chunk[i]);
      *reinterpret_cast<T**>(t) = free_;
      free_ = t;
    }
  }
  struct storage {
    alignas(T) unsigned char bytes[sizeof(T)];
  };
  std::vector<std::unique_ptr<storage[]>> chunks_;
  T* free_ = nullptr;
};

/// A freed block waiting for one event.
struct pending_free {
  block* b;
  event_handle event;
};

/// Freed blocks waiting for events: one queue per stream the events were recorded on, each in
/// order of recording. Events recorded on one stream complete in that order, so a poll looks at
/// the front of each queue and stops at its first incomplete event: an allocation behind a busy
/// stream costs one event query per stream with pending frees, not one per pending free. (A
/// handle that names several streams -- cudaStreamPerThread from several threads, a destroyed
/// handle reused -- only delays a release until the ladder or empty_cache synchronizes: a block
/// is never released early.) Steady state allocates nothing: a drained queue keeps its storage,
/// and a queue's consumed prefix is compacted away once it is half of the queue.
class pending_frees {
 public:
  struct queue {
    stream_handle stream = nullptr;
    std::vector<pending_free> items;  // items[head...] wait, oldest first
    std::size_t head = 0;
    [[nodiscard]] bool empty() const noexcept { return head == items.size(); }
    [[nodiscard]] const pending_free& front() const noexcept { return items[head]; }
  };

  [[nodiscard]] bool empty() const noexcept { return count_ == 0; }
  /// Number of pending events (a block used on several streams waits on one per stream).
  [[nodiscard]] std::size_t size() const noexcept { return count_; }
  [[nodiscard]] std::vector<queue>& queues() noexcept { return queues_; }
  [[nodiscard]] const std::vector<queue>& queues() const noexcept { return queues_; }

  /// Appends a free whose event was recorded on `stream`. May throw std::bad_alloc, adding nothing.
  void push(stream_handle stream, block* b, event_handle event) {
    queue* q = nullptr;
    for (queue& x : queues_) {
      if (x.stream == stream) {
        q = &x;
        break;
      }
    }
    if (q == nullptr) q = &queues_.emplace_back(queue{stream, {}, 0});
    q->items.push_back({b, event});
    ++count_;
  }
  /// Removes the oldest entry of q.
  void pop_front(queue& q) noexcept {
    --count_;
    if (++q.head == q.items.size()) {
      q.items.clear();
      q.head = 0;
    } else if (q.head >= k_compact_at && 2 * q.head >= q.items.size()) {
      q.items.erase(q.items.begin(), q.items.begin() + static_cast<std::ptrdiff_t>(q.head));
      q.head = 0;
    }
  }
  /// Calls keep(entry) on every entry of q, oldest first, and keeps, in order, those for which it
  /// returns true.
  template <class F>
  void retain(queue& q, F&& keep) {
    auto out = q.items.begin();
    for (auto it = q.items.begin() + static_cast<std::ptrdiff_t>(q.head); it != q.items.end();
         ++it) {
      if (keep(*it)) {
        *out++ = *it;
      } else {
        --count_;
      }
    }
    q.items.erase(out, q.items.end());
    q.head = 0;
  }
  /// Forgets drained queues once there are more than a few: programs that record on a new stream
  /// every step must not make every poll walk all the streams they ever used.
  void drop_drained_queues() noexcept {
    if (queues_.size() <= k_kept_drained) return;
    std::erase_if(queues_, [](const queue& q) { return q.empty(); });
  }
  template <class F>
  void for_each(F&& f) const {
    for (const queue& q : queues_) {
      for (std::size_t i = q.head; i < q.items.size(); ++i) f(q.items[i]);
    }
  }

 private:
  static constexpr std::size_t k_compact_at = 64;
  static constexpr std::size_t k_kept_drained = 8;
  std::vector<queue> queues_;
  std::size_t count_ = 0;
};

/// One statistic of one pool, shaped for the hot path: an increase updates current, allocated and
/// peak; a decrease only current. The public `freed` total is derived, since
/// current = base + allocated - freed, where base is current at the last reset of totals.
struct counter {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;
  std::int64_t base = 0;

  void inc(std::int64_t delta) noexcept {
    current += delta;
    allocated += delta;
    if (current > peak) peak = current;
  }
  void dec(std::int64_t delta) noexcept { current -= delta; }
  [[nodiscard]] stat get() const noexcept { return {current, peak, allocated, freed()}; }
  [[nodiscard]] std::int64_t freed() const noexcept { return base + allocated - current; }
  void reset_peak() noexcept { peak = current; }
  void reset_totals() noexcept {
    allocated = 0;
    base = current;
  }
};

/// One statistic per pool kind. The "all" figures are derived from the two kinds' sums; only
/// their peak needs state of its own (the peak of a sum is not the sum of peaks), kept as the
/// highest sum seen after an increase -- the only time the sum can reach a new peak.
struct counter_array {
  std::array<counter, 2> kind;  // [pool_kind]
  std::int64_t all_peak = 0;

  void inc(pool_kind k, std::int64_t delta) noexcept {
    kind[static_cast<int>(k)].inc(delta);
    all_peak = std::max(all_peak, kind[0].current + kind[1].current);
  }
  void dec(pool_kind k, std::int64_t delta) noexcept { kind[static_cast<int>(k)].dec(delta); }
  /// The statistic at a stat_pool slot: 0 all, 1 small, 2 large.
  [[nodiscard]] counter operator[](std::size_t slot) const noexcept {
    if (slot != 0) return kind[slot - 1];
    return {kind[0].current + kind[1].current, all_peak, kind[0].allocated + kind[1].allocated,
            kind[0].base + kind[1].base};
  }
  void reset_peak() noexcept {
    for (auto& c : kind) c.reset_peak();
    all_peak = kind[0].current + kind[1].current;
  }
  void reset_totals() noexcept {
    for (auto& c : kind) c.reset_totals();
  }
};

/// Per-pool statistics, updated under the pool's mutex.
///
/// Active figures (allocated plus pending) are not kept as counters of their own: a cache-hit pair
/// would update them exactly as it updates the allocated ones. They are derived from the allocated
/// and the pending counters instead, exactly:
/// - current = allocated + pending;
/// - allocated total = allocated's (both grow only when a block is carved);
/// - freed total from the same identity as `counter`, with base = both bases;
/// - peak: active only grows when a block is carved. While nothing is pending it equals allocated,
///   so allocated's peak covers it; `active_*_peak` records the value whenever a block is carved
///   while something is pending. Both are lower bounds of the true peak and one of them reaches
///   it, so the maximum of the two is exact.
struct pool_stats {
  counter_array allocated_bytes, requested_bytes, allocation_count;
  counter_array reserved_bytes, segment_count;
  counter_array pending_bytes, pending_count;  // freed blocks waiting for events
  std::array<std::int64_t, k_stat_pools> active_bytes_peak{}, active_count_peak{};
  std::uint64_t oversize_allocations = 0;
  std::uint64_t oversize_segments = 0;

  static std::size_t slot(pool_kind k) noexcept { return k == pool_kind::small ? 1 : 2; }

  /// A block of `bytes` was carved: allocated, and active.
  void on_allocate(pool_kind k, std::int64_t bytes, std::int64_t requested) noexcept {
    allocation_count.inc(k, 1);
    allocated_bytes.inc(k, bytes);
    requested_bytes.inc(k, requested);
    if (pending_count[0].current != 0) [[unlikely]] {
      for (std::size_t i : {std::size_t{0}, slot(k)}) {
        active_bytes_peak[i] =
            std::max(active_bytes_peak[i], allocated_bytes[i].current + pending_bytes[i].current);
        active_count_peak[i] =
            std::max(active_count_peak[i], allocation_count[i].current + pending_count[i].current);
      }
    }
  }
  /// A block was freed by its caller (it may still be active, pending).
  void on_free(pool_kind k, std::int64_t bytes, std::int64_t requested) noexcept {
    allocation_count.dec(k, 1);
    allocated_bytes.dec(k, bytes);
    requested_bytes.dec(k, requested);
  }

  [[nodiscard]] static stat active(const counter& alloc, const counter& pend,
                                   std::int64_t pending_peak) noexcept {
    const std::int64_t current = alloc.current + pend.current;
    return {current, std::max(alloc.peak, pending_peak), alloc.allocated,
            alloc.base + pend.base + alloc.allocated - current};
  }
  [[nodiscard]] stat active_bytes(std::size_t i) const noexcept {
    return active(allocated_bytes[i], pending_bytes[i], active_bytes_peak[i]);
  }
  [[nodiscard]] stat active_count(std::size_t i) const noexcept {
    return active(allocation_count[i], pending_count[i], active_count_peak[i]);
  }
  void reset_peaks() noexcept {
    for (auto* arr : {&allocated_bytes, &requested_bytes, &allocation_count, &reserved_bytes,
                      &segment_count, &pending_bytes, &pending_count}) {
      arr->reset_peak();
    }
    for (std::size_t i = 0; i < k_stat_pools; ++i) {
      active_bytes_peak[i] = active_bytes(i).current;
      active_count_peak[i] = active_count(i).current;
    }
  }
  void reset_totals() noexcept {
    for (auto* arr : {&allocated_bytes, &requested_bytes, &allocation_count, &reserved_bytes,
                      &segment_count, &pending_bytes, &pending_count}) {
      arr->reset_totals();
    }
  }
};

struct graph_pool;

class stream_pool {
 public:
  stream_pool(stream_handle s, std::uint64_t k, std::size_t idx, graph_pool* g = nullptr)
      : stream(s), key(k), index(idx), graph(g) {}

  /// The handle the pool was created for. Another stream may have this value now (the runtime
  /// hands a destroyed stream's handle to the next one it creates); `key` tells them apart.
  const stream_handle stream;
  /// The stream's id (device_backend::stream_id), never reused: what pools are looked up by.
  const std::uint64_t key;
  const std::size_t index;  // creation order; pools are always locked in this order
  /// Non-null for a part of a graph pool: only allocations routed to that pool reach it.
  graph_pool* const graph;
  /// Blocks of this pool held pending by graph pools (each also counts in uses->pending_events).
  std::size_t retained = 0;
  alignas(64) pool_mutex mu;
  free_index free[2];           // [pool_kind]
  segment* segments = nullptr;  // doubly linked, newest first
  pending_frees pending;        // freed blocks waiting on events
  pool_stats stats;
  std::uint64_t tick = 0;  // free order, for garbage collection
  object_arena<block>
      block_arena;  // storage of this pool's blocks (the pointer map is impl::blocks)
  object_arena<segment> segment_arena;

  // Expandable segments: one range per pool kind, created on first use.
  segment* ranges[2] = {nullptr, nullptr};
  vm_mapping* idle_head = nullptr;  // mappings no block touches, most recently idle first
  vm_mapping* idle_tail = nullptr;  // least recently idle
  std::size_t idle_bytes = 0;
  object_arena<vm_mapping> maps;

  free_index& index_of(pool_kind k) noexcept { return free[static_cast<int>(k)]; }
  const free_index& index_of(pool_kind k) const noexcept { return free[static_cast<int>(k)]; }
};

}  // namespace cucache::detail
