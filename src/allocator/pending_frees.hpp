// pending_frees: the freed blocks of one pool that wait for events recorded on other streams, one
// queue per recording stream.
#pragma once

#include <algorithm>
#include <cstddef>
#include <unordered_map>
#include <vector>

#include "core/block.hpp"
#include "cucache/backend.hpp"

namespace cucache::detail {

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
///
/// Time is proportional to what changed, not to the streams ever used (issue 22): a push finds
/// its stream's queue through a map (O(1)); a poll looks at no more than k_poll_queues queues,
/// taking turns (next_poll); drained queues are forgotten once they are half of the queues
/// (amortized O(1) per drained queue).
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

  /// Appends a free whose event was recorded on `stream`. May throw std::bad_alloc, adding nothing
  /// (a new stream's queue may stay, empty and counted as drained). Amortized O(1): the queue
  /// table grows geometrically.
  void push(stream_handle stream, block* b, event_handle event) {
    auto found = where_.find(stream);
    if (found == where_.end()) {
      // Room for the new queue before the map names it, so that the push_back below cannot
      // throw (a map entry without its queue would index past the end). Grows geometrically:
      // reserving one more each time moved the whole table per new stream (issue 30 item 7:
      // 100,000 stalled streams took 80 s).
      if (queues_.size() == queues_.capacity()) {
        queues_.reserve(std::max<std::size_t>(k_min_queues, 2 * queues_.capacity()));  // may throw
      }
      found = where_.emplace(stream, queues_.size()).first;
      queues_.push_back(queue{stream, {}, 0});
      ++drained_;  // empty until the push below
    }
    queue& q = queues_[found->second];
    const bool was_empty = q.empty();
    q.items.push_back({b, event});
    if (was_empty) --drained_;
    ++count_;
  }
  /// Removes the oldest entry of q.
  void pop_front(queue& q) noexcept {
    --count_;
    if (++q.head == q.items.size()) {
      q.items.clear();
      q.head = 0;
      ++drained_;
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
    const bool had = q.head != q.items.size();
    q.items.erase(out, q.items.end());
    q.head = 0;
    if (had && q.items.empty()) ++drained_;
  }
  /// Forgets drained queues once there are more than a few and they are half of the queues:
  /// programs that record on a new stream every step must not make every poll walk all the
  /// streams they ever used, nor every poll walk the queues to find the drained ones.
  void drop_drained_queues() noexcept {
    if (drained_ <= k_kept_drained || 2 * drained_ < queues_.size()) return;
    std::erase_if(queues_, [](const queue& q) { return q.empty(); });
    drained_ = 0;
    next_poll_ = 0;
    where_.clear();
    try {
      for (std::size_t i = 0; i < queues_.size(); ++i) where_.emplace(queues_[i].stream, i);
    } catch (...) {
      // Out of memory rebuilding the map: keep the queues, and the map partial -- a stream not
      // found gets a second queue, which a poll also drains (two queues of one stream only delay
      // a release, never make it early).
    }
  }
  /// The queues a poll looks at now: up to k_poll_queues of them from where the last poll
  /// stopped, in turn ([first, first + n) modulo the number of queues). Each call advances.
  [[nodiscard]] std::pair<std::size_t, std::size_t> next_poll() noexcept {
    const std::size_t n = std::min(queues_.size(), k_poll_queues);
    if (queues_.empty()) return {0, 0};
    const std::size_t first = next_poll_ % queues_.size();
    next_poll_ = (first + n) % queues_.size();
    return {first, n};
  }
  static constexpr std::size_t k_poll_queues = 32;
  template <class F>
  void for_each(F&& f) const {
    for (const queue& q : queues_) {
      for (std::size_t i = q.head; i < q.items.size(); ++i) f(q.items[i]);
    }
  }

 private:
  static constexpr std::size_t k_compact_at = 64;
  static constexpr std::size_t k_kept_drained = 8;
  static constexpr std::size_t k_min_queues = 8;  // the table's first capacity
  std::vector<queue> queues_;
  std::unordered_map<stream_handle, std::size_t> where_;  // stream -> its queue's index
  std::size_t count_ = 0;
  std::size_t drained_ = 0;    // queues that are empty
  std::size_t next_poll_ = 0;  // the queue the next poll starts at
};

}  // namespace cucache::detail
