// Expandable segments: a segment that is a large reserved virtual range, backed page by page
// (pages of the device's VM granularity) by physical handles of one page each, or by a *chunk* --
// one handle of several pages, created for pages that one block covers whole (pager.hpp) --
// mapped on demand.
// The range's page table records, for every mapped page, its handle and whether it has access;
// the maximal runs of mapped pages; for the pages where blocks begin or end, how many allocated or
// pending blocks do; and the runs of idle pages (mapped, touched by no allocated or pending block),
// whose physical memory can be moved (stitched) to wherever a request needs it, or released.
//
// Nothing is per page of a block: blocks are disjoint, so a page strictly inside a block is
// touched by that block alone, and only a block's first and last pages can be shared with a
// neighbour. Carving a block takes its span out of the idle runs; freeing it makes the mapped
// pages of its span idle, as one run (less an edge page a neighbour still touches). The mapped
// runs are in an ordered map (they change only when pages are mapped or unmapped), the idle runs
// in a run_index (bit scans, core/run_index.hpp): a cache hit (every page mapped) costs a few
// lookups, whatever the block's size.
// Host memory follows what is mapped or used: the per-page tables allocate a chunk of 512 pages
// (1 GiB of a 2 MiB-page range) on first use and free it when it empties.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>

#include "core/run_index.hpp"
#include "core/size_policy.hpp"
#include "core/sparse_page_table.hpp"
#include "cucache/backend.hpp"

namespace cucache::detail {

struct vm_range;
class pool_pages;

/// A run of idle pages [first, end) of one range, which went idle at one time: an entry of its
/// owner pool's idle list. Within a run, lower pages went idle first (a freed block's pages go
/// idle in address order), so the least recently idle page of the pool is the first page of the
/// list's tail run.
struct idle_run {
  vm_range* range = nullptr;
  std::size_t first = 0;
  std::size_t end = 0;
  std::uint64_t epoch = 0;       // device synchronizations started when it went idle
  idle_run* newer = nullptr;     // toward the list's head (most recently idle)
  idle_run* older = nullptr;     // toward the list's tail (least recently idle)
  [[nodiscard]] std::size_t pages() const noexcept { return end - first; }
};

/// A mapped page: its handle and whether cuMemSetAccess was done on it. A page of a chunk (a
/// handle of chunk_pages > 1 pages, mapped at once over consecutive pages) records the chunk's
/// handle and its index in the chunk; a page with a handle of its own has chunk_pages 0.
struct vm_page {
  phys_handle handle = 0;
  bool mapped = false;
  bool accessible = false;
  std::uint16_t chunk_pages = 0;
  std::uint16_t chunk_index = 0;
  friend bool operator==(const vm_page&, const vm_page&) = default;
};

/// The pages [first, end) of one mapping (one handle): one page, or a chunk's.
struct page_span {
  std::size_t first = 0;
  std::size_t end = 0;
  [[nodiscard]] std::size_t pages() const noexcept { return end - first; }
};

struct vm_range {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  std::size_t page_bytes = 0;
  pool_kind kind = pool_kind::large;  // the pool whose stats its mappings count in
  std::size_t page_count = 0;
  /// log2(page_bytes) when it is a power of two (the driver's granularity is): page_of shifts
  /// instead of dividing, twice per carve, free and back. 0: divide.
  unsigned page_shift = 0;
  sparse_page_table<vm_page> pages;  // per page: its mapping, if any
  /// Per page: allocated or pending blocks whose first or last page it is (a block on one page
  /// counts once). A page is touched iff this is nonzero or a live block covers it strictly
  /// inside its span.
  sparse_page_table<std::uint32_t> edge_use;
  std::map<std::size_t, std::size_t> mapped_runs;  // maximal runs of mapped pages: first -> end
  run_index<idle_run> idle_runs;                   // the idle runs of this range, by first page
  pool_pages* idle_owner = nullptr;  // the pool's pages whose idle list holds these idle runs
  /// The pool's parked span, when pool_pages::parked names this range: idle pages
  /// [parked_first, parked_end) that went idle after every run of the idle list, kept out of
  /// idle_runs and the list (one per pool). A cache-hit pair frees a block (its pages park) and
  /// carves it again (they leave the parked span): no map insert or erase, no list link. Any
  /// other use of the idle list first links the span as a run (pager::unpark). Empty: 0, 0.
  std::size_t parked_first = 0;
  std::size_t parked_end = 0;
  std::uint64_t parked_epoch = 0;  // as idle_run::epoch
  std::size_t mapped_pages = 0;
  std::size_t no_access_pages = 0;  // mapped pages without access (a batch being backed, a
                                    // failed undo)
  std::size_t chunks = 0;           // mapped chunks (handles of more than one page)

  vm_range() = default;
  vm_range(std::uintptr_t b, std::size_t bytes, std::size_t page, pool_kind k)
      : base(b),
        size(bytes),
        page_bytes(page),
        kind(k),
        page_count(bytes / page),
        page_shift(std::has_single_bit(page) ? static_cast<unsigned>(std::countr_zero(page)) : 0),
        pages(bytes / page),
        edge_use(bytes / page),
        idle_runs(bytes / page) {}

  /// True when [addr, addr + bytes) is a non-empty span inside the range, computed without
  /// overflow: page_of(addr) and page_of(addr + bytes - 1) are then valid page table indices.
  [[nodiscard]] bool holds(std::uintptr_t addr, std::size_t bytes) const noexcept {
    return bytes != 0 && addr >= base && addr - base < size && bytes <= size - (addr - base);
  }
  [[nodiscard]] std::size_t page_of(std::uintptr_t addr) const noexcept {
    return page_shift != 0 ? (addr - base) >> page_shift : (addr - base) / page_bytes;
  }
  [[nodiscard]] std::uintptr_t page_addr(std::size_t page) const noexcept {
    return base + page * page_bytes;
  }
  [[nodiscard]] bool mapped(std::size_t pg) const noexcept { return pages.get(pg).mapped; }
  /// The pages of the mapping holding pg (pg alone when pg is unmapped or has a handle of its
  /// own). O(1).
  [[nodiscard]] page_span mapping_of(std::size_t pg) const noexcept {
    const vm_page e = pages.get(pg);
    if (e.chunk_pages == 0) return {pg, pg + 1};
    return {pg - e.chunk_index, pg - e.chunk_index + e.chunk_pages};
  }
  /// The pages that the span [addr, addr + bytes) covers whole, [first, end) (empty when none):
  /// the pages no other block can touch while a block of that span is live.
  [[nodiscard]] page_span whole_pages(std::uintptr_t addr, std::size_t bytes) const noexcept {
    const std::size_t lo = addr - base;
    const std::size_t hi = lo + bytes;
    const std::size_t first = (lo + page_bytes - 1) / page_bytes;
    const std::size_t end = hi / page_bytes;
    return {first, end > first ? end : first};
  }
  /// The chunks a block of span [addr, addr + bytes) with pages [first, last] would touch in part
  /// (0, 1 or 2), counting a chunk's page that a neighbour may share: a chunk holding its first or
  /// last page that does not lie within the pages it covers whole. (A chunk is contiguous, so one
  /// that meets the span but does not lie within its whole pages holds the span's first or last
  /// page.) O(1).
  [[nodiscard]] std::size_t cut_chunks(std::uintptr_t addr, std::size_t bytes, std::size_t first,
                                       std::size_t last) const noexcept {
    const vm_page a = pages.get(first);
    const vm_page z = last == first ? a : pages.get(last);
    if (a.chunk_pages == 0 && z.chunk_pages == 0) return 0;
    const page_span whole = whole_pages(addr, bytes);
    const auto cut = [&](std::size_t pg, const vm_page& e) {
      if (e.chunk_pages <= 1) return false;
      const std::size_t lo = pg - e.chunk_index;
      return lo < whole.first || lo + e.chunk_pages > whole.end;
    };
    const bool cut_a = cut(first, a);
    // The last page's chunk counts apart from the first's unless it is the same chunk (always so
    // when last == first and that page is a chunk's).
    const bool same = z.chunk_pages > 1 && a.chunk_pages > 1 &&
                      last - z.chunk_index == first - a.chunk_index;
    const bool cut_z = !same && cut(last, z);
    return (cut_a ? 1 : 0) + (cut_z ? 1 : 0);
  }
  /// Every page of [first, end) is idle. O(pages).
  [[nodiscard]] bool all_idle(page_span s) const {
    for (std::size_t pg = s.first; pg < s.end; ++pg) {
      if (!idle(pg)) return false;
    }
    return true;
  }
  /// The idle pages of [first, end) of mapping m when m is a chunk that is not idle as a whole
  /// (straddled: a block touches part of it), else 0: mapped memory that no unmap gives back
  /// until the whole chunk is idle. O(pages of m).
  [[nodiscard]] std::size_t straddled_idle_pages(page_span m, std::size_t first,
                                                 std::size_t end) const {
    if (m.pages() == 1) return 0;
    std::size_t idle_n = 0;  // of the chunk
    std::size_t n = 0;       // of the chunk within [first, end)
    for (std::size_t pg = m.first; pg < m.end; ++pg) {
      if (!idle(pg)) continue;
      ++idle_n;
      n += pg >= first && pg < end ? 1 : 0;
    }
    return idle_n == m.pages() ? 0 : n;
  }
  /// The latest epoch of the idle pages of [first, end) (their idle runs and the parked span):
  /// the epoch after which a synchronization covers all of them. O(runs met).
  [[nodiscard]] std::uint64_t idle_epoch(page_span s) const {
    std::uint64_t epoch = 0;
    if (parked_end > s.first && parked_first < s.end) epoch = parked_epoch;
    for (const idle_run* u = idle_runs.first_meeting(s.first); u != nullptr && u->first < s.end;
         u = idle_runs.next(u)) {
      epoch = u->epoch > epoch ? u->epoch : epoch;
    }
    return epoch;
  }
  [[nodiscard]] std::uint32_t edge(std::size_t pg) const noexcept { return edge_use.get(pg); }

  /// The end of the run of mapped pages holding pg, or pg when pg is unmapped. O(log mapped runs).
  [[nodiscard]] std::size_t mapped_run_end(std::size_t pg) const {
    if (hint_valid_ && hint_->first <= pg && hint_->second > pg) return hint_->second;
    auto it = mapped_runs.upper_bound(pg);
    if (it == mapped_runs.begin()) return pg;
    --it;
    if (it->second <= pg) return pg;
    hint_ = it;
    hint_valid_ = true;
    return it->second;
  }
  /// pg is in an idle run or the parked span (mapped, touched by no block). O(1) bit scans.
  [[nodiscard]] bool idle(std::size_t pg) const {
    if (pg >= parked_first && pg < parked_end) return true;
    return idle_runs.holding(pg) != nullptr;
  }
  /// Every page of [first, last] is mapped. O(log mapped runs).
  [[nodiscard]] bool all_mapped(std::size_t first, std::size_t last) const {
    return mapped_run_end(first) > last;
  }
  /// f(first, end) for each maximal run of mapped pages clipped to [first, last], in page order.
  template <class F>
  void for_each_mapped_run(std::size_t first, std::size_t last, F&& f) const {
    auto it = mapped_runs.upper_bound(first);
    if (it != mapped_runs.begin() && std::prev(it)->second > first) --it;
    for (; it != mapped_runs.end() && it->first <= last; ++it) {
      const std::size_t a = it->first < first ? first : it->first;
      const std::size_t e = it->second > last + 1 ? last + 1 : it->second;
      if (a < e) f(a, e);
    }
  }
  /// Unmapped pages of [first, last]. O(log mapped runs + runs crossed).
  [[nodiscard]] std::size_t unmapped_in(std::size_t first, std::size_t last) const {
    std::size_t mapped_n = 0;
    for_each_mapped_run(first, last, [&](std::size_t a, std::size_t e) { mapped_n += e - a; });
    return last - first + 1 - mapped_n;
  }

  /// Records pg as mapped by h, without access: a handle of its own (chunk_pages 0), or page
  /// `chunk_index` of a chunk of `chunk_pages` pages. REQUIRES: pg unmapped.
  void add_page(std::size_t pg, phys_handle h, std::uint16_t chunk_pages = 0,
                std::uint16_t chunk_index = 0) {
    hint_valid_ = false;
    pages.set(pg, vm_page{h, true, false, chunk_pages, chunk_index});
    ++mapped_pages;
    ++no_access_pages;
    std::size_t end = pg + 1;
    auto next = mapped_runs.lower_bound(pg);  // the first run after pg (pg is unmapped)
    if (next != mapped_runs.begin()) {
      auto prev = std::prev(next);
      if (prev->second == pg) {  // pg continues prev (and joins it to next when next follows)
        if (next != mapped_runs.end() && next->first == end) {
          end = next->second;
          mapped_runs.erase(next);
        }
        prev->second = end;
        return;
      }
    }
    if (next != mapped_runs.end() && next->first == end) {  // pg starts next: rekey it
      auto node = mapped_runs.extract(next);
      node.key() = pg;
      mapped_runs.insert(std::move(node));
      return;
    }
    mapped_runs.emplace(pg, end);
  }
  /// Forgets pg's mapping; returns its handle. REQUIRES: pg mapped.
  phys_handle remove_page(std::size_t pg) {
    hint_valid_ = false;
    const vm_page e = pages.get(pg);
    pages.set(pg, vm_page{});
    --mapped_pages;
    if (!e.accessible) --no_access_pages;
    auto it = std::prev(mapped_runs.upper_bound(pg));  // the run holding pg
    const std::size_t run_first = it->first;
    const std::size_t run_end = it->second;
    if (run_first == pg) {
      mapped_runs.erase(it);
    } else {
      it->second = pg;
    }
    if (pg + 1 < run_end) mapped_runs.emplace(pg + 1, run_end);
    return e.handle;
  }
  // The run of mapped_runs last found by mapped_run_end (valid until mapped_runs changes): a loop
  // frees and carves in the same run. Under the owner pool's mutex, like everything here.
  mutable std::map<std::size_t, std::size_t>::const_iterator hint_;
  mutable bool hint_valid_ = false;

  void grant(std::size_t pg) {
    vm_page e = pages.get(pg);
    if (e.accessible) return;
    e.accessible = true;
    pages.set(pg, e);
    --no_access_pages;
  }
};

}  // namespace cucache::detail
