// Blocks and segments: the plain data the caching core works on. A segment is one device
// allocation (a cudaMalloc'd range); its blocks tile it exactly, in address order, linked through
// prev/next. A block is allocated, free (indexed in its pool's free_index) or pending (freed, but
// waiting for events on other streams before it may be reused). Blocks are the cache-hit path's
// working set: keep them to one cache line.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cucache/backend.hpp"
#include "core/size_policy.hpp"

namespace cucache::detail {

struct segment;
struct vm_range;
class stream_pool;

enum class block_state : std::uint8_t { free, allocated, pending };

/// What a block needs only once it is used on a stream other than its own (record_stream, or a
/// free ordered on another stream): rare, so it lives outside the block, owned through
/// block::uses and deleted when the block becomes free.
struct stream_uses {
  std::vector<stream_handle> streams;  // streams other than seg->owner->stream that used it
  std::uint32_t pending_events = 0;    // events still to complete before reuse (pending blocks)
};

/// One cache line: the fast paths touch a block, its neighbours and their bin neighbours, so each
/// costs one line. Fields that only a free or only a used block needs share storage.
struct alignas(64) block {
  std::uintptr_t addr = 0;
  std::size_t size = 0;   // bytes this block spans in its segment
  block* prev = nullptr;  // address-order neighbours inside the segment
  block* next = nullptr;
  segment* seg = nullptr;
  union {
    block* free_prev = nullptr;  // free: links inside a free_index bin
    std::size_t requested;       // allocated: bytes the caller asked for (0 once freed)
  };
  union {
    block* free_next = nullptr;  // free
    stream_uses* uses;           // allocated or pending: nullptr until used on another stream
  };
  block_state state = block_state::free;
  bool exported = false;  // allocated: handed to another process (note_ipc_export); cleared by carve
  std::uint16_t bin = 0;       // free: its free_index bin
  std::uint32_t priority = 0;  // free, in a treap bin: its heap priority (free_index.hpp)
};
static_assert(sizeof(block) == 64);

struct segment {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  pool_kind kind = pool_kind::small;
  stream_pool* owner = nullptr;
  block* first = nullptr;   // lowest-address block
  segment* prev = nullptr;  // the owner's list of segments
  segment* next = nullptr;
  std::uint64_t id = 0;         // creation order, for snapshots
  vm_range* vm = nullptr;       // expandable segments: the page table; nullptr for cudaMalloc'd
  std::uint64_t free_tick = 0;  // the pool's tick when a block of it last became free: for a
                                // wholly free segment, when it became so (garbage collection age)
  // A segment of a graph pool captured under a sleepable tag (expandable mode) is not
  // cudaMalloc'd: one reserved range wholly mapped to one physical handle, so that sleep can
  // release the memory and wake map it again at the same addresses (whole_vm_segments.hpp).
  bool whole_vm = false;
  bool unmapped = false;  // whole_vm: asleep, its handle released (phys is stale)
  std::uint64_t phys = 0;  // whole_vm: the physical handle mapped over the whole segment
  /// A segment with no live block that holds memory: it can be returned to the device.
  [[nodiscard]] bool whole_free() const noexcept {
    return vm == nullptr && !unmapped && first != nullptr && first->next == nullptr &&
           first->state == block_state::free;
  }
};

}  // namespace cucache::detail
