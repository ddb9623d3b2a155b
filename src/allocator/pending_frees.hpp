// pending_frees: the freed blocks of one pool that wait for events recorded on other streams, one
// queue per recording stream.
#pragma once

#include <algorithm>
#include <cstddef>
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

}  // namespace cucache::detail
