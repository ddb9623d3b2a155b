// The one base of every device_backend wrapper (a decorator that adds one behaviour to another
// backend: relaxed capture mode, call counting, a timeline's recording): it forwards every call
// to the wrapped backend, so a wrapper overrides only what it changes and cannot drop a call it
// forgot -- the optional ones with default bodies (IPC export, peer access) included.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "cucache/backend.hpp"

/// Every virtual of device_backend, one X(return type, name, (parameters), (arguments),
/// qualifiers) per call, in declaration order. forwarding_backend is generated from it, and
/// tests/backend/forwarding_backend_test.cpp walks it: it calls each entry through a wrapper and
/// checks that the wrapped backend saw it, and it checks, from the vtable layout, that the table
/// names every virtual of device_backend -- so a virtual added to backend.hpp and not here fails
/// that test. The signatures are checked against device_backend's below (a static_assert each).
#define CUCACHE_DEVICE_BACKEND_CALLS(X)                                                  \
  X(int, device, (), (), const noexcept)                                                 \
  X(const char*, name, (), (), const noexcept)                                           \
  X(void*, segment_malloc, (std::size_t bytes), (bytes), )                               \
  X(void, segment_free, (void* ptr), (ptr), )                                            \
  X(std::size_t, vm_granularity, (), (), )                                               \
  X(void*, va_reserve, (std::size_t bytes), (bytes), )                                   \
  X(void, va_free, (void* base, std::size_t bytes), (base, bytes), )                     \
  X(std::optional<phys_handle>, phys_create, (std::size_t bytes), (bytes), )             \
  X(void, phys_release, (phys_handle handle), (handle), )                                \
  X(void, map, (void* va, std::size_t bytes, phys_handle handle), (va, bytes, handle), ) \
  X(void, unmap, (void* va, std::size_t bytes), (va, bytes), )                           \
  X(void, set_access, (void* va, std::size_t bytes), (va, bytes), )                      \
  X(void, configure_peer_access, (peer_access_mode mode), (mode), )                      \
  X(std::vector<int>, access_devices, (), (), )                                          \
  X(void, enable_phys_export, (), (), )                                                  \
  X(segment_ipc_handle, segment_export, (void* base), (base), )                          \
  X(void*, segment_import, (const segment_ipc_handle& handle), (handle), )               \
  X(void, segment_close, (void* base), (base), )                                         \
  X(int, phys_export_fd, (phys_handle handle), (handle), )                               \
  X(phys_handle, phys_import_fd, (int fd), (fd), )                                       \
  X(event_handle, event_create, (), (), )                                                \
  X(void, event_destroy, (event_handle event), (event), )                                \
  X(void, event_record, (event_handle event, stream_handle stream), (event, stream), )   \
  X(bool, event_query, (event_handle event), (event), )                                  \
  X(void, event_synchronize, (event_handle event), (event), )                            \
  X(void, stream_synchronize, (stream_handle stream), (stream), )                        \
  X(void, device_synchronize, (), (), )                                                  \
  X(std::uint64_t, stream_id, (stream_handle stream), (stream), )                        \
  X(capture_info, capture_status, (stream_handle stream), (stream), )                    \
  X(stream_identity, identify, (stream_handle stream), (stream), )                       \
  X(capture_mode, exchange_capture_mode, (capture_mode mode), (mode), )                  \
  X(memory_info, mem_get_info, (), (), )                                                 \
  X(void*, host_alloc_pinned, (std::size_t bytes), (bytes), )                            \
  X(void, host_free_pinned, (void* ptr), (ptr), )                                        \
  X(void, copy_async, (void* dst, const void* src, std::size_t bytes, stream_handle stream), \
    (dst, src, bytes, stream), )

namespace cucache {

/// A device_backend that forwards every call to another one. Derive from it and override only
/// the calls whose behaviour changes; call the base (forwarding_backend::f) or inner() to reach
/// the wrapped backend. Thread-safe as the wrapped backend is.
class forwarding_backend : public device_backend {
 public:
  /// REQUIRES: inner is not null.
  explicit forwarding_backend(std::shared_ptr<device_backend> inner) : inner_(std::move(inner)) {}

  /// The wrapped backend.
  [[nodiscard]] device_backend& inner() const noexcept { return *inner_; }

// clang-format off
#define CUCACHE_FORWARD_CALL(ret, fn, params, args, quals) \
  ret fn params quals override { return inner_->fn args; }
  CUCACHE_DEVICE_BACKEND_CALLS(CUCACHE_FORWARD_CALL)
#undef CUCACHE_FORWARD_CALL
  // clang-format on

 private:
  std::shared_ptr<device_backend> inner_;
};

namespace detail {
// Each entry of the table has device_backend's own signature: a pointer to the member, of the
// type the table spells, must be device_backend's (an entry with a wrong parameter or qualifier
// fails here, before any wrapper is compiled).
// clang-format off
#define CUCACHE_CHECK_CALL(ret, fn, params, args, quals)                                  \
  static_assert(                                                                          \
      std::is_same_v<decltype(&device_backend::fn), ret(device_backend::*) params quals>, \
      "CUCACHE_DEVICE_BACKEND_CALLS: the entry " #fn " does not have the signature of "   \
      "device_backend::" #fn);
CUCACHE_DEVICE_BACKEND_CALLS(CUCACHE_CHECK_CALL)
#undef CUCACHE_CHECK_CALL
// clang-format on
}  // namespace detail

// A pure virtual of device_backend missing from the table leaves the base abstract.
static_assert(!std::is_abstract_v<forwarding_backend>,
              "forwarding_backend does not override every pure virtual of device_backend: add "
              "the call to CUCACHE_DEVICE_BACKEND_CALLS");

}  // namespace cucache
