// The device as the allocator calls it: every call that is not stream-ordered (cudaMalloc,
// cudaFree, the virtual-memory calls, event queries, memory info, synchronizations) runs with the
// calling thread in relaxed capture mode and its own mode restored afterwards. In global mode the
// runtime refuses such calls -- and invalidates the capture -- whenever any thread captures a
// stream; they are cucache's bookkeeping, never part of the captured work, so relaxed mode is
// their right mode (PyTorch does the same for the cudaMalloc of a capture's private pool). What
// relaxed mode does not permit -- synchronizing the device or a capturing stream, querying an
// event recorded in a capture -- the allocator itself never does while it knows of a capture.
#pragma once

#include <memory>
#include <utility>

#include "cucache/forwarding_backend.hpp"

namespace cucache::detail {

class capture_safe_backend final : public forwarding_backend {
 public:
  using forwarding_backend::forwarding_backend;

  // Calls that are not stream-ordered run relaxed; the others (granularity, access devices,
  // export of a handle, events created, destroyed or recorded, stream ids, capture queries and
  // the mode exchange itself) are forwarded as they are, by the base.
#define CUCACHE_RELAXED_CALL(ret, fn, params, args) \
  ret fn params override {                          \
    const relaxed r(inner());                       \
    return forwarding_backend::fn args;             \
  }
  CUCACHE_RELAXED_CALL(void*, segment_malloc, (std::size_t bytes), (bytes))
  CUCACHE_RELAXED_CALL(void, segment_free, (void* ptr), (ptr))
  CUCACHE_RELAXED_CALL(void*, va_reserve, (std::size_t bytes), (bytes))
  CUCACHE_RELAXED_CALL(void, va_free, (void* base, std::size_t bytes), (base, bytes))
  CUCACHE_RELAXED_CALL(std::optional<phys_handle>, phys_create, (std::size_t bytes), (bytes))
  CUCACHE_RELAXED_CALL(void, phys_release, (phys_handle handle), (handle))
  CUCACHE_RELAXED_CALL(void, map, (void* va, std::size_t bytes, phys_handle handle),
                       (va, bytes, handle))
  CUCACHE_RELAXED_CALL(void, unmap, (void* va, std::size_t bytes), (va, bytes))
  CUCACHE_RELAXED_CALL(void, set_access, (void* va, std::size_t bytes), (va, bytes))
  CUCACHE_RELAXED_CALL(void*, segment_import, (const segment_ipc_handle& handle), (handle))
  CUCACHE_RELAXED_CALL(void, segment_close, (void* base), (base))
  CUCACHE_RELAXED_CALL(bool, event_query, (event_handle event), (event))
  CUCACHE_RELAXED_CALL(void, event_synchronize, (event_handle event), (event))
  CUCACHE_RELAXED_CALL(void, stream_synchronize, (stream_handle stream), (stream))
  CUCACHE_RELAXED_CALL(void, device_synchronize, (), ())
  CUCACHE_RELAXED_CALL(memory_info, mem_get_info, (), ())
#undef CUCACHE_RELAXED_CALL

 private:
  /// The calling thread in relaxed mode for one call. Exchanging the mode is a thread-local
  /// setting that does not fail on a working runtime; if restoring it fails there is nothing a
  /// destructor could do, and the thread stays relaxed (more permissive, never less safe).
  class relaxed {
   public:
    explicit relaxed(device_backend& b)
        : b_(b), previous_(b.exchange_capture_mode(capture_mode::relaxed)) {}
    ~relaxed() {
      try {
        b_.exchange_capture_mode(previous_);
      } catch (...) {
      }
    }
    relaxed(const relaxed&) = delete;
    relaxed& operator=(const relaxed&) = delete;

   private:
    device_backend& b_;
    capture_mode previous_;
  };
};

}  // namespace cucache::detail
