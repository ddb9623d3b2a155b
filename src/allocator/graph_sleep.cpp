// Graph memory of a sleepable tag (docs/design.md, "Sleep and wake"): a CUDA graph pool created
// while the creating thread's sleep domain is d (graph_pool::domain) gives its parts domain d, and
// in expandable mode their segments are whole-VM segments -- a reserved range wholly mapped to one
// physical handle -- instead of cudaMalloc'd ones. A graph replays on every byte of its pool's
// segments, free blocks included (a block freed inside the capture is reused by the replay), so
// such a segment sleeps whole: sleep (sleep.cpp) copies it whole when contents are kept, then
// unmaps and releases its handle here; wake maps a new handle over it at the same addresses and
// copies it back. These are the steps sleep.cpp calls; the walk stays there.
#include <stdexcept>

#include "allocator/allocator_impl.hpp"

namespace cucache {

using detail::segment;

void* device_allocator::impl::whole_vm_create(std::size_t bytes, std::uint64_t& phys) {
  void* va = backend->va_reserve(bytes);
  if (va == nullptr) return nullptr;
  std::optional<phys_handle> h;
  try {
    h = backend->phys_create(bytes);
    if (!h) {
      backend->va_free(va, bytes);
      return nullptr;
    }
    backend->map(va, bytes, *h);
  } catch (...) {
    try {
      if (h) backend->phys_release(*h);
      backend->va_free(va, bytes);
    } catch (...) {
    }
    throw;
  }
  try {
    backend->set_access(va, bytes);
  } catch (...) {
    try {
      backend->unmap(va, bytes);
      backend->phys_release(*h);
      backend->va_free(va, bytes);
    } catch (...) {
    }
    throw;
  }
  phys = *h;
  return va;
}

void device_allocator::impl::whole_vm_destroy(segment& s) {
  void* va = reinterpret_cast<void*>(s.base);
  if (!s.unmapped) {
    backend->unmap(va, s.size);
    s.unmapped = true;  // from here the segment holds no memory, whatever follows
    backend->phys_release(s.phys);
  }
  backend->va_free(va, s.size);
}

std::size_t device_allocator::impl::release_graph_segments(const std::vector<segment*>& segs,
                                                           bool& synchronize) {
  std::size_t released = 0;
  for (segment* s : segs) {
    detail::pool_table::assert_locked(*s->owner);  // every pool is
    if (s->unmapped) continue;
    if (synchronize) {
      // The graph's last replay (and any work on its memory) must be done before the unmap.
      backend->device_synchronize();
      synchronize = false;
    }
    budget.refund(s->size, [&] {
      detail::pool_table::assert_locked(*s->owner);  // (a lambda: analysed on its own)
      void* va = reinterpret_cast<void*>(s->base);
      backend->unmap(va, s->size);  // a failure here changes nothing
      try {
        backend->phys_release(s->phys);
      } catch (...) {
        // The handle is still ours: mapped back, the segment is as it was (rollback maps the
        // others). Only if that fails too is it left unmapped, its handle held (and charged).
        try {
          backend->map(va, s->size, s->phys);
          backend->set_access(va, s->size);
        } catch (...) {
          s->unmapped = true;
          s->owner->stats.reserved_bytes.dec(s->kind, static_cast<std::int64_t>(s->size));
          s->owner->stats.segment_count.dec(s->kind, 1);
        }
        throw;
      }
      s->unmapped = true;
    });
    // The segment holds no memory while asleep: out of the pool's reserved bytes and segments.
    s->owner->stats.reserved_bytes.dec(s->kind, static_cast<std::int64_t>(s->size));
    s->owner->stats.segment_count.dec(s->kind, 1);
    released += s->size;
  }
  return released;
}

bool device_allocator::impl::map_graph_segments(const std::vector<segment*>& segs) {
  for (segment* s : segs) {
    detail::pool_table::assert_locked(*s->owner);  // every pool is
    if (!s->unmapped) continue;
    const std::optional<phys_handle> h =
        budget.charge(s->size, [&] { return backend->phys_create(s->size); });
    if (!h) return false;
    void* va = reinterpret_cast<void*>(s->base);
    try {
      backend->map(va, s->size, *h);
      try {
        backend->set_access(va, s->size);
      } catch (...) {
        backend->unmap(va, s->size);
        throw;
      }
    } catch (...) {
      budget.refund(s->size, [&] { backend->phys_release(*h); });
      throw;
    }
    s->phys = *h;
    s->unmapped = false;
    s->owner->stats.reserved_bytes.inc(s->kind, static_cast<std::int64_t>(s->size));
    s->owner->stats.segment_count.inc(s->kind, 1);
  }
  return true;
}

}  // namespace cucache
