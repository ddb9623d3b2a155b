// pool_pages: the pager's state for one stream_pool in expandable mode -- its virtual ranges,
// its idle list and its storage. One member of the pool (stream_pool::pages), under the pool's
// mutex. Its state is private: the pager (pager.hpp/.cpp) changes it through the steps below,
// each of which keeps the list whole (its range list and byte counts agree; the idle list is
// linked both ways); everyone else reads it (pager::check_invariants checks it).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <vector>

#include "allocator/object_arena.hpp"
#include "core/block.hpp"
#include "core/vm_range.hpp"

namespace cucache::detail {

class pager;

/// A count (bytes, or events) written by one thread at a time (under its pool's mutex) and read
/// by others without that mutex: relaxed loads and stores, plain moves on x86 -- no
/// read-modify-write of a line that other pools' threads write (a device-wide atomic sum did
/// that on every expandable cache hit).
class owned_bytes {
 public:
  [[gnu::always_inline]] owned_bytes& operator+=(std::size_t n) noexcept {
    v_.store(v_.load(std::memory_order_relaxed) + n, std::memory_order_relaxed);
    return *this;
  }
  [[gnu::always_inline]] owned_bytes& operator-=(std::size_t n) noexcept {
    v_.store(v_.load(std::memory_order_relaxed) - n, std::memory_order_relaxed);
    return *this;
  }
  operator std::size_t() const noexcept { return v_.load(std::memory_order_relaxed); }

 private:
  std::atomic<std::size_t> v_{0};
};

class pool_pages {
 public:
  pool_pages() = default;
  pool_pages(const pool_pages&) = delete;
  pool_pages& operator=(const pool_pages&) = delete;

  // --- reads ----------------------------------------------------------------------------------
  /// The pool's virtual ranges, both kinds, oldest first: each the segment that owns its
  /// vm_range, also linked in the pool's segment list. A range is added when no free block of the
  /// pool's ranges of its kind holds a request (pager::next_range_bytes sizes it; pager::
  /// add_range) and given back when it is empty (pager::drop_range). A const view, for walks
  /// (tag_sleeper.cpp's among them).
  [[nodiscard]] const std::vector<segment*>& ranges() const noexcept { return ranges_; }
  /// The address space those ranges span, of pool kind k.
  [[nodiscard]] std::size_t range_bytes(pool_kind k) const noexcept {
    return range_bytes_[static_cast<int>(k)];
  }
  /// The idle runs of this pool's ranges, most recently idle first: the order in which their
  /// pages went idle (within a run, lower pages first), kept when a carve splits a run.
  [[nodiscard]] idle_run* idle_head() const noexcept { return idle_head_; }
  [[nodiscard]] idle_run* idle_tail() const noexcept { return idle_tail_; }  // least recently idle
  /// Bytes of the pages of the idle runs and the parked span. Written under the pool's mutex;
  /// read without it by idle_bytes_of_every_pool_locked (reserve, max_allocatable).
  [[nodiscard]] std::size_t idle_bytes() const noexcept { return idle_bytes_; }
  /// The range holding the pool's parked span (vm_range::parked_first), or nullptr: the most
  /// recently idle pages, not linked in the idle list until something else needs the list.
  [[nodiscard]] vm_range* parked() const noexcept { return parked_; }
  [[nodiscard]] bool has_idle() const noexcept {
    return idle_head_ != nullptr || parked_ != nullptr;
  }
  /// Chunks of this pool's ranges that carves touched in part and left mapped (straddled), one
  /// per chunk per carve; never reset. Written under the pool's mutex; read without it by
  /// pager::straddled_chunks.
  [[nodiscard]] std::uint64_t straddles() const noexcept { return straddles_; }

  // --- the pager's steps ----------------------------------------------------------------------
  /// Room for one more range, so that add_range cannot fail. May throw.
  void reserve_range() { ranges_.reserve(ranges_.size() + 1); }
  /// s (a segment owning a vm_range) joins the ranges. REQUIRES: reserve_range since the last add.
  void add_range(segment* s) noexcept {
    ranges_.push_back(s);
    range_bytes_[static_cast<int>(s->kind)] += s->size;
  }
  /// s leaves the ranges. REQUIRES: s listed.
  void remove_range(const segment* s) noexcept {
    ranges_.erase(std::find(ranges_.begin(), ranges_.end(), s));
    range_bytes_[static_cast<int>(s->kind)] -= s->size;
  }
  [[gnu::always_inline]] void add_idle_bytes(std::size_t bytes) noexcept { idle_bytes_ += bytes; }
  [[gnu::always_inline]] void sub_idle_bytes(std::size_t bytes) noexcept { idle_bytes_ -= bytes; }
  void add_straddles(std::size_t n) noexcept { straddles_ += n; }
  void set_parked(vm_range* r) noexcept { parked_ = r; }
  /// The pool's held block (defer_coalescing) has its pages still touched: `by` makes them idle
  /// at its settling, as at `epoch` (pager::hold_pages, settle_pages).
  void note_hold(pager* by, std::uint64_t epoch) noexcept {
    holder_ = by;
    held_epoch_ = epoch;
  }
  [[nodiscard]] pager* holder() const noexcept { return holder_; }
  [[nodiscard]] std::uint64_t held_epoch() const noexcept { return held_epoch_; }
  /// u leaves the idle list (its own links are left as they were).
  void unlink(idle_run* u) noexcept {
    (u->newer != nullptr ? u->newer->older : idle_head_) = u->older;
    (u->older != nullptr ? u->older->newer : idle_tail_) = u->newer;
  }
  /// u becomes the most recently idle run.
  void push_newest(idle_run* u) noexcept {
    idle_run* h = idle_head_;
    u->older = h;
    (h != nullptr ? h->newer : idle_tail_) = u;
    idle_head_ = u;
  }
  /// hi joins the list just newer than u.
  void insert_newer(idle_run* u, idle_run* hi) noexcept {
    hi->older = u;
    hi->newer = u->newer;
    (u->newer != nullptr ? u->newer->older : idle_head_) = hi;
    u->newer = hi;
  }
  /// Storage of this pool's idle runs.
  idle_run* make_run() { return runs_.make(); }
  void recycle_run(idle_run* u) noexcept { runs_.recycle(u); }

 private:
  std::vector<segment*> ranges_;
  std::size_t range_bytes_[2] = {0, 0};
  idle_run* idle_head_ = nullptr;
  idle_run* idle_tail_ = nullptr;
  owned_bytes idle_bytes_;
  owned_bytes straddles_;
  vm_range* parked_ = nullptr;
  pager* holder_ = nullptr;
  std::uint64_t held_epoch_ = 0;
  object_arena<idle_run> runs_;
};

}  // namespace cucache::detail
