// pool_pages: the pager's state for one stream_pool in expandable mode -- its two virtual ranges,
// its idle mappings and their storage. One member of the pool (stream_pool::pages), under the
// pool's mutex; only the pager and the allocator's placement of blocks in the ranges touch it.
#pragma once

#include <cstddef>

#include "allocator/object_arena.hpp"
#include "core/block.hpp"
#include "core/vm_range.hpp"

namespace cucache::detail {

struct pool_pages {
  /// One range per pool kind, created on first use (the segment that owns the vm_range).
  segment* ranges[2] = {nullptr, nullptr};
  vm_mapping* idle_head = nullptr;  // mappings no block touches, most recently idle first
  vm_mapping* idle_tail = nullptr;  // least recently idle
  std::size_t idle_bytes = 0;       // bytes of the mappings on the idle list
  object_arena<vm_mapping> maps;    // storage of this pool's mappings
};

}  // namespace cucache::detail
