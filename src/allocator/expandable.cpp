// Expandable segments, the allocator's side: one reserved virtual range per pool kind, placement
// of blocks on pages that are already mapped, and the out-of-memory ladder. Backing the pages
// with physical memory is the pager's (pager.hpp): this file places and carves blocks, the pager
// maps their pages.
#include <fmt/format.h>

#include <algorithm>

#include "allocator/allocator_impl.hpp"
#include "cucache/errors.hpp"

namespace cucache {

using detail::block;
using detail::block_state;
using detail::pool_kind;
using detail::segment;
using detail::stream_pool;
using detail::vm_range;

namespace {
/// Free blocks examined, in best-fit order, for a placement whose pages are already mapped.
constexpr int k_placement_probes = 4;
}  // namespace

segment* device_allocator::impl::ensure_range(stream_pool& p, pool_kind kind) {
  const int k = static_cast<int>(kind);
  if (p.ranges[k] != nullptr) return p.ranges[k];
  std::unique_ptr<vm_range> range = pager->reserve_range(kind);
  segment* s = add_segment(p, kind, range->base, range->size, range.get());
  range.release();  // owned by the segment from here (~impl destroys and deletes it)
  p.ranges[k] = s;
  return s;
}

namespace {
std::size_t unmapped_pages(const vm_range& r, std::uintptr_t addr, std::size_t bytes) {
  std::size_t n = 0;
  for (std::size_t pg = r.page_of(addr), last = r.page_of(addr + bytes - 1); pg <= last; ++pg) {
    n += r.page_map[pg] == nullptr;
  }
  return n;
}
}  // namespace

std::pair<block*, bool> device_allocator::impl::place(detail::free_index& index,
                                                      std::size_t rounded) const {
  // Best fit at the front of the block, unless that needs VM calls: then, among the first
  // k_placement_probes candidates in best-fit order, the front or back placement with the fewest
  // unmapped pages. Freed blocks keep their pages, so a request that fits a freed block's place
  // moves nothing; and a buffer that grows step by step (a KV cache) is placed at the back of the
  // hole it leaves, on its own mapped pages, instead of leapfrogging and moving them every step.
  block* best = index.best_fit(rounded);
  if (best == nullptr) return {nullptr, false};
  std::size_t best_cost = unmapped_pages(*best->seg->vm, best->addr, rounded);
  if (best_cost == 0) return {best, false};
  block* choice = best;
  bool back = false;
  block* cand = best;
  for (int i = 0; cand != nullptr && i < k_placement_probes; ++i, cand = index.next_fit(cand)) {
    const vm_range& r = *cand->seg->vm;
    const std::size_t front = i == 0 ? best_cost : unmapped_pages(r, cand->addr, rounded);
    if (front < best_cost) {
      best_cost = front;
      choice = cand;
      back = false;
    }
    if (cand->size > rounded && cand->size - rounded < r.size / 2) {  // not the open tail
      const std::size_t tail = unmapped_pages(r, cand->addr + cand->size - rounded, rounded);
      if (tail < best_cost) {
        best_cost = tail;
        choice = cand;
        back = true;
      }
    }
    if (best_cost == 0) break;
  }
  return {choice, back};
}

block* device_allocator::impl::split_for_back(stream_pool& p, pool_kind kind, block* b,
                                              std::size_t rounded) {
  // REQUIRES: b free and indexed, b->size > rounded. Leaves b's front free and indexed, returns
  // its last `rounded` bytes as a free, indexed block.
  auto& index = p.index_of(kind);
  index.erase(b);
  block* back = split_off(p, b, b->size - rounded);
  b->size -= rounded;
  index.insert(b);
  index.insert(back);
  return back;
}

void device_allocator::impl::undo_carve(stream_pool& p, block* b) {
  const pool_kind kind = b->seg->kind;
  p.stats.on_free(kind, static_cast<std::int64_t>(b->size),
                  static_cast<std::int64_t>(b->requested));
  b->requested = 0;
  release_to_free(p, b);
}

void* device_allocator::impl::allocate_expandable(stream_pool& p, pool_kind kind,
                                                  std::size_t rounded, std::size_t bytes,
                                                  std::unique_lock<detail::pool_mutex>& lk) {
  if (rounded > device_total || (limit != 0 && rounded > limit)) return nullptr;  // never fits
  for (int attempt = 0; attempt < 2; ++attempt) {
    ensure_range(p, kind);
    auto [b, at_back] = place(p.index_of(kind), rounded);
    if (b == nullptr) return nullptr;  // the virtual range itself is exhausted
    // May throw (a failed unmap): before any block changes, so nothing is left half done.
    pager->split_overhang(p, *b->seg->vm, at_back ? b->addr + b->size - rounded : b->addr,
                          rounded);
    if (at_back) b = split_for_back(p, kind, b, rounded);
    b = carve(p, b, kind, rounded, bytes);
    bool mapped = false;
    try {
      mapped = pager->back(p, b);
    } catch (...) {
      undo_carve(p, b);
      throw;
    }
    if (mapped) {
      blocks.insert(b->addr, b);
      return reinterpret_cast<void*>(b->addr);
    }
    undo_carve(p, b);
    if (attempt == 1) break;
    // Out-of-memory ladder: the pager found no room even among the idle pages of the pools it
    // could lock without waiting. Wait for pending frees everywhere, unmap every idle page of
    // every pool into the reusable handle list, and try once more.
    retry_count.fetch_add(1, std::memory_order_relaxed);
    lk.unlock();
    {
      auto all = lock_all();
      for (auto& q : pools) sync_pending(*q);
      for (auto& q : pools) pager->unmap_idle(*q, /*release_handles=*/false);
    }
    lk.lock();
  }
  return nullptr;
}

}  // namespace cucache
