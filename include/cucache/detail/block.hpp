// Blocks and segments: the plain data the caching core works on. A segment is one device
// allocation (a cudaMalloc'd range); its blocks tile it exactly, in address order, linked through
// prev/next. A block is allocated, free (indexed in its pool's free_index) or pending (freed, but
// waiting for events on other streams before it may be reused).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cucache/backend.hpp"
#include "cucache/detail/size_policy.hpp"

namespace cucache::detail {

struct segment;
struct vm_range;
class stream_pool;

enum class block_state : std::uint8_t { free, allocated, pending };

struct block {
  std::uintptr_t addr = 0;
  std::size_t size = 0;       // bytes this block spans in its segment
  std::size_t requested = 0;  // bytes the caller asked for (allocated blocks only)
  block* prev = nullptr;      // address-order neighbours inside the segment
  block* next = nullptr;
  block* free_prev = nullptr;  // links inside a free_index bin (free blocks only)
  block* free_next = nullptr;
  segment* seg = nullptr;
  block_state state = block_state::free;
  std::uint32_t bin = 0;             // free_index bin while free
  std::uint32_t pending_events = 0;  // events still to complete before reuse (pending blocks)
  std::uint64_t free_tick = 0;       // when the block last became free (garbage collection age)
  std::vector<stream_handle> recorded_streams;  // streams other than seg->stream that used it
};

struct segment {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  pool_kind kind = pool_kind::small;
  stream_pool* owner = nullptr;
  block* first = nullptr;      // lowest-address block
  segment* prev = nullptr;     // the owner's list of segments
  segment* next = nullptr;
  std::uint64_t id = 0;        // creation order, for snapshots
  vm_range* vm = nullptr;      // expandable segments: the page table; nullptr for cudaMalloc'd
  /// A cudaMalloc'd segment with no live block: it can be returned to the device.
  [[nodiscard]] bool whole_free() const noexcept {
    return vm == nullptr && first != nullptr && first->next == nullptr &&
           first->state == block_state::free;
  }
};

}  // namespace cucache::detail
