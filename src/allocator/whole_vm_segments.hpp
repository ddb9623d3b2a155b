// whole_vm_segments: the graph memory of a sleepable tag (docs/design.md, "Sleep and wake").
//
// A CUDA graph pool created while the creating thread's sleep domain is d gives its parts domain
// d, and in expandable mode their segments are whole-VM segments (segment::whole_vm) -- a
// reserved range wholly mapped to one physical handle -- instead of cudaMalloc'd ones. A graph
// replays on every byte of its pool's segments, free blocks included (a block freed inside the
// capture is reused by the replay), so such a segment sleeps whole: the sleeper's walk
// (tag_sleeper) copies it whole when contents are kept, then `release` unmaps it and gives its
// handle back; `map` puts a new handle over it at the same addresses and the walk copies the
// bytes back. This part owns those device steps and their charge to the budget; which segments
// sleep, and when, is the walk's.
//
// Contract:
//  - create(bytes, phys): a range of `bytes` (a multiple of the VM granularity) reserved, one
//    handle created and mapped over it, made accessible, and charged to the budget. nullptr when
//    the limit, the device or the address space refuses; on every failure nothing is left behind
//    (range, handle, charge).
//  - undo_create(va, bytes, phys): what create made -- never entered in a pool -- unmapped,
//    released and freed, and refunded. Throws on a device failure; then nothing is refunded.
//  - destroy(s): unmaps s and releases its handle (unless s is asleep: s.unmapped), then frees
//    its range. Not charged: the caller refunds (release_segment refunds the segment whatever its
//    kind). Throws on a device failure before anything changed.
//  - release(segs, synchronize): every mapped segment of `segs` unmapped, its handle released,
//    its bytes refunded and taken out of its pool's reserved bytes and segment count (an asleep
//    segment holds no memory); returns the bytes released. One device synchronization comes
//    first when `synchronize` (then cleared), and only if a segment is still mapped. A failure to
//    release a handle maps it back (the segment is as it was) and propagates; only if that fails
//    too is the segment left unmapped with its handle held (and charged). Segments done before
//    a failure stay released.
//  - map(segs): a new handle, charged, mapped over every unmapped segment of `segs`, which counts
//    in its pool again. False when the limit or the device has no room (the segments mapped so far
//    stay mapped); other failures throw with nothing of the failing segment changed.
//
// Locking: release and map change the pools' statistics: every pool lock (the walk holds it).
// create and destroy touch no pool. The budget takes its own lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "allocator/pool_mutex.hpp"

namespace cucache {
class device_backend;
}

namespace cucache::detail {

class device_budget;
struct segment;

class whole_vm_segments {
 public:
  whole_vm_segments(device_backend& backend, device_budget& budget) noexcept
      : backend_(backend), budget_(budget) {}

  [[nodiscard]] void* create(std::size_t bytes, std::uint64_t& phys);
  void undo_create(void* va, std::size_t bytes, std::uint64_t phys);
  void destroy(segment& s);
  std::size_t release(const std::vector<segment*>& segs, bool& synchronize) REQUIRES(every_pool);
  [[nodiscard]] bool map(const std::vector<segment*>& segs) REQUIRES(every_pool);

 private:
  /// create's device steps, uncharged: nullptr when the device or the address space refuses.
  void* make(std::size_t bytes, std::uint64_t& phys);
  /// s's bytes and one segment back into its pool's statistics (mapped again). REQUIRES: s's
  /// pool locked (every pool is, in release and map).
  static void count_in_pool(segment& s);
  /// s's bytes and one segment out of its pool's statistics (unmapped: no memory). REQUIRES: as
  /// count_in_pool.
  static void count_out_of_pool(segment& s);

  device_backend& backend_;
  device_budget& budget_;
};

}  // namespace cucache::detail
