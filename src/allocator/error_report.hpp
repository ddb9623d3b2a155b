// error_report: the errors a caller sees when the allocator cannot help -- the out-of-memory
// report, and the diagnosis of a pointer that is not a live allocation (docs/errors.md).
//
// Contract:
//  - oom_message(f): one paragraph built from the facts alone: the request (and its rounded
//    size, or "beyond any device" when rounded is 0), the stream, the device's capacity and free
//    bytes ("unknown" when the query failed), what cucache holds (reserved, allocated, reserved
//    but unallocated in how many free blocks, the largest), both fragmentation rates; then, each
//    only where it applies: the memory limit, the address space (when that is what refused), a
//    capture that forbids giving memory back, and the expandable_segments hint when more than
//    half of the reserved free memory is fragmented and the free bytes would have held the
//    request.
//  - locate_pointer(pools, ptr): the segment and the block of `pools` that hold ptr, and whether
//    that block is allocated (device_allocator::locate). Takes every pool lock to read; changes
//    nothing.
//  - explain_pointer(pools, device, ptr, what): "cucache: what(ptr) on device N: <why>", where
//    why, from locate_pointer's answer, is: already freed (ptr starts a block), an interior
//    pointer of a live allocation (its offset and start), a pointer into free memory, or not
//    cucache's on this device.
#pragma once

#include <cstddef>
#include <optional>
#include <string>

#include "allocator/pool_mutex.hpp"
#include "cucache/backend.hpp"
#include "cucache/device_allocator.hpp"

namespace cucache::detail {

class pool_table;

/// What an out-of-memory report says: gathered by the allocator (impl::throw_oom).
struct oom_facts {
  int device = 0;
  std::string device_name;
  std::size_t bytes = 0;    // the request
  std::size_t rounded = 0;  // its rounded size; 0: it passes any device
  stream_handle stream = nullptr;
  std::size_t device_total = 0;
  std::optional<std::size_t> device_free;  // empty: the query failed
  std::size_t reserved = 0;
  std::size_t allocated = 0;
  std::size_t free_blocks = 0;
  std::size_t largest_free_block = 0;
  double external_fragmentation = 0;
  double overhead_fragmentation = 0;
  std::size_t limit = 0;  // the memory limit in force (0: none)
  /// The address space refused a new range of expandable segments; the bytes cucache's ranges
  /// on the device span.
  bool address_space = false;
  std::size_t address_bytes = 0;
  bool capture_underway = false;  // a capture forbids giving cached memory back
};

[[nodiscard]] std::string oom_message(const oom_facts& f);

[[nodiscard]] device_allocator::address_info locate_pointer(const pool_table& pools,
                                                            const void* ptr) EXCLUDES(every_pool);

[[nodiscard]] std::string explain_pointer(const pool_table& pools, int device, const void* ptr,
                                          const char* what) EXCLUDES(every_pool);

}  // namespace cucache::detail
