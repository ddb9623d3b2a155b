// Expandable segments: a segment that is a large reserved virtual range, backed page by page
// (pages of the device's VM granularity) by physical handles mapped on demand. The page table
// records, for every page, the mapping that backs it (if any), and for the pages where blocks
// begin or end how many allocated or pending blocks do; a mapping no block touches is "idle" and
// its physical memory can be moved (stitched) to wherever a request needs it, or released.
//
// Use is counted per run, not per page: blocks are disjoint, so a page strictly inside a block is
// touched by that block alone, and only a block's first and last pages can be shared with a
// neighbour. Carving or freeing a block therefore updates two edge counts and one used-page count
// per mapping its span crosses: work that does not grow with the block's size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/size_policy.hpp"
#include "cucache/backend.hpp"

namespace cucache::detail {

struct vm_range;

/// One physical handle mapped at a run of pages of a range.
struct vm_mapping {
  vm_range* range = nullptr;
  std::size_t first_page = 0;
  std::size_t pages = 0;
  phys_handle handle = 0;
  std::size_t used_pages = 0;       // pages touched by at least one allocated or pending block
  bool accessible = false;          // cuMemSetAccess done (back() grants a batch at once)
  vm_mapping* idle_prev = nullptr;  // the owner pool's list of idle mappings (used_pages == 0)
  vm_mapping* idle_next = nullptr;
  bool idle = false;
  std::uint64_t idle_epoch = 0;  // device synchronizations started when it last became idle
};

struct vm_range {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  std::size_t page_bytes = 0;
  pool_kind kind = pool_kind::large;  // the pool whose stats its mappings count in
  std::vector<vm_mapping*> page_map;  // per page: the mapping backing it, or nullptr
  /// Per page: allocated or pending blocks whose first or last page it is (a block on one page
  /// counts once). A page is touched iff this is nonzero or a live block covers it strictly
  /// inside its span.
  std::vector<std::uint32_t> edge_use;
  std::size_t mapped_pages = 0;

  /// True when [addr, addr + bytes) is a non-empty span inside the range, computed without
  /// overflow: page_of(addr) and page_of(addr + bytes - 1) are then valid page table indices.
  [[nodiscard]] bool holds(std::uintptr_t addr, std::size_t bytes) const noexcept {
    return bytes != 0 && addr >= base && addr - base < size && bytes <= size - (addr - base);
  }
  [[nodiscard]] std::size_t page_of(std::uintptr_t addr) const noexcept {
    return (addr - base) / page_bytes;
  }
  [[nodiscard]] std::uintptr_t page_addr(std::size_t page) const noexcept {
    return base + page * page_bytes;
  }
};

}  // namespace cucache::detail
