// whole_vm_segments: the device steps of a sleepable tag's graph memory (whole_vm_segments.hpp).
#include "allocator/whole_vm_segments.hpp"

#include <optional>

#include "allocator/device_budget.hpp"
#include "allocator/pool_table.hpp"
#include "allocator/stream_pool.hpp"
#include "core/block.hpp"
#include "cucache/backend.hpp"

namespace cucache::detail {

void* whole_vm_segments::make(std::size_t bytes, std::uint64_t& phys) {
  void* va = backend_.va_reserve(bytes);
  if (va == nullptr) return nullptr;
  std::optional<phys_handle> h;
  bool mapped = false;
  try {
    h = backend_.phys_create(bytes);
    if (!h) {
      backend_.va_free(va, bytes);
      return nullptr;
    }
    backend_.map(va, bytes, *h);
    mapped = true;
    backend_.set_access(va, bytes);
  } catch (...) {
    // Undo what was done, in reverse; the first failure's error is the one that propagates.
    try {
      if (mapped) backend_.unmap(va, bytes);
      if (h) backend_.phys_release(*h);
      backend_.va_free(va, bytes);
    } catch (...) {
    }
    throw;
  }
  phys = *h;
  return va;
}

void whole_vm_segments::count_in_pool(segment& s) {
  pool_table::assert_locked(*s.owner);  // every pool is (map's callers)
  s.owner->stats.reserved_bytes.inc(s.kind, static_cast<std::int64_t>(s.size));
  s.owner->stats.segment_count.inc(s.kind, 1);
}

void whole_vm_segments::count_out_of_pool(segment& s) {
  pool_table::assert_locked(*s.owner);  // every pool is (release's callers)
  s.owner->stats.reserved_bytes.dec(s.kind, static_cast<std::int64_t>(s.size));
  s.owner->stats.segment_count.dec(s.kind, 1);
}

void* whole_vm_segments::create(std::size_t bytes, std::uint64_t& phys) {
  return budget_.charge(bytes, [&] { return make(bytes, phys); });
}

void whole_vm_segments::undo_create(void* va, std::size_t bytes, std::uint64_t phys) {
  budget_.refund(bytes, [&] {
    backend_.unmap(va, bytes);
    backend_.phys_release(phys);
    backend_.va_free(va, bytes);
  });
}

void whole_vm_segments::destroy(segment& s) {
  void* va = reinterpret_cast<void*>(s.base);
  if (!s.unmapped) {
    backend_.unmap(va, s.size);
    s.unmapped = true;  // from here the segment holds no memory, whatever follows
    backend_.phys_release(s.phys);
  }
  backend_.va_free(va, s.size);
}

std::size_t whole_vm_segments::release(const std::vector<segment*>& segs, bool& synchronize) {
  std::size_t released = 0;
  for (segment* s : segs) {
    pool_table::assert_locked(*s->owner);  // every pool is
    if (s->unmapped) continue;
    if (synchronize) {
      // The graph's last replay (and any work on its memory) must be done before the unmap.
      backend_.device_synchronize();
      synchronize = false;
    }
    budget_.refund(s->size, [&] {
      pool_table::assert_locked(*s->owner);  // (a lambda: analysed on its own)
      void* va = reinterpret_cast<void*>(s->base);
      backend_.unmap(va, s->size);  // a failure here changes nothing
      try {
        backend_.phys_release(s->phys);
      } catch (...) {
        // The handle is still ours: mapped back, the segment is as it was. Only if that fails
        // too is it left unmapped, its handle held (and charged).
        try {
          backend_.map(va, s->size, s->phys);
          backend_.set_access(va, s->size);
        } catch (...) {
          s->unmapped = true;
          count_out_of_pool(*s);
        }
        throw;
      }
      s->unmapped = true;
    });
    count_out_of_pool(*s);  // no memory while asleep: out of its pool's reserved bytes
    released += s->size;
  }
  return released;
}

bool whole_vm_segments::map(const std::vector<segment*>& segs) {
  for (segment* s : segs) {
    pool_table::assert_locked(*s->owner);  // every pool is
    if (!s->unmapped) continue;
    const std::optional<phys_handle> h =
        budget_.charge(s->size, [&] { return backend_.phys_create(s->size); });
    if (!h) return false;
    void* va = reinterpret_cast<void*>(s->base);
    try {
      backend_.map(va, s->size, *h);
      try {
        backend_.set_access(va, s->size);
      } catch (...) {
        backend_.unmap(va, s->size);
        throw;
      }
    } catch (...) {
      budget_.refund(s->size, [&] { backend_.phys_release(*h); });
      throw;
    }
    s->phys = *h;
    s->unmapped = false;
    count_in_pool(*s);
  }
  return true;
}

}  // namespace cucache::detail
