// The process-wide C++ API: one caching allocator per device, created on first use, that
// cucache::malloc and cucache::free route to, plus an owning pointer type. This is the layer that
// replaces cudaMalloc/cudaFree in a program; the C API (cucache.h) is a thin shell over it.
#pragma once

#if (defined(_MSVC_LANG) ? _MSVC_LANG : __cplusplus) < 201709L
#error \
    "cucache/cucache.hpp requires C++20: compile with -std=c++20 (CMake: link cucache::cucache, which asks for cxx_std_20; a .cu file needs CUDA_STANDARD 20). C++17 and older take cucache.h, thrust.hpp and memory_resource.hpp only (docs/api.md)."
#endif

#include <cstddef>
#include <cstdint>
#include <limits>
#include <new>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cucache/backend.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/errors.hpp"
#include "cucache/observe.hpp"
#include "cucache/ipc.h"

namespace cucache {

/// The environment cucache reads on first use is unusable: CUCACHE_BACKEND has an unknown value,
/// CUCACHE_CONF does not parse or asks for something this build cannot do, or the trace file it
/// names cannot be created. Nothing is cached after this error: the next call reads the
/// environment again. The C API reports it as cudaErrorInitializationError.
class environment_error : public invalid_argument {
 public:
  using invalid_argument::invalid_argument;
};

/// Allocates `bytes` on the current device (cudaGetDevice) for use on `stream`, from that
/// device's global allocator. bytes == 0 returns nullptr. Throws out_of_memory (a std::bad_alloc)
/// when the device is full after the out-of-memory ladder, cuda_error when CUDA fails (no driver,
/// no device), environment_error on a bad CUCACHE_BACKEND / CUCACHE_CONF.
///
/// Memory from malloc(bytes) (the default stream) is reused by the next allocation on the default
/// stream as soon as it is freed; when other streams use it, call record_stream or free_async.
[[nodiscard]] void* malloc(std::size_t bytes, stream_handle stream = nullptr);

/// Frees memory from cucache::malloc, on whichever device it lives: the current device's
/// allocator is tried first, then every other one. nullptr is a no-op. Unlike cudaFree this does
/// not synchronize the device. Throws invalid_argument for a pointer that is not the start of a
/// live cucache allocation (unknown, interior, already freed).
void free(void* ptr);

/// Frees in the order of `stream` (cudaFreeAsync): the memory is reused only after the work
/// queued on `stream` so far. Errors as free().
void free_async(void* ptr, stream_handle stream);

/// Marks a live allocation as used on `stream` as well, so that after it is freed it is not
/// reused until the work queued on `stream` at free time has completed. Throws invalid_argument
/// for a pointer that is not the start of a live cucache allocation.
void record_stream(void* ptr, stream_handle stream);

/// The global allocator of `device`, created on first use. Throws cuda_error (code
/// cudaErrorInvalidDevice, or the reason CUDA is unusable) for a device that does not exist, and
/// environment_error as malloc does. The reference stays valid for the life of the process.
[[nodiscard]] device_allocator& get(int device);
/// The global allocator of the current device.
[[nodiscard]] device_allocator& get();

/// Returns the cached free memory of every allocator created so far to the device. Creates none.
void empty_cache();

/// The largest single request on `stream` that `device`'s allocator (created if needed) would
/// serve now; see device_allocator::max_allocatable. Without a device: the current one.
[[nodiscard]] std::size_t max_allocatable(int device, stream_handle stream = nullptr);
[[nodiscard]] std::size_t max_allocatable();
/// Caches `bytes` of free memory on `device` for `stream` (device_allocator::reserve). Without a
/// device: the current one.
void reserve(std::size_t bytes, int device, stream_handle stream = nullptr);
void reserve(std::size_t bytes);

/// PyTorch-style statistics table of `device`'s allocator (creating it if needed).
[[nodiscard]] std::string memory_summary(int device);

/// Writes buffered trace rows (CUCACHE_CONF=trace:PATH) to the file. The trace is also flushed
/// at normal process exit (std::exit or return from main); call this before reading the file
/// while the process runs. No-op when tracing is off or nothing has been allocated yet.
void flush_trace();

// --- Inter-process sharing (docs/api.md, "IPC"; the C API's cucacheIpc* say it in full) -------

/// A handle naming the live allocation `ptr` (of any device) for another process. Throws
/// invalid_argument when ptr is not the start of a live cucache allocation, cuda_error
/// (cudaErrorNotSupported) in expandable mode without ipc_handles:True or past
/// CUCACHE_IPC_MAX_PIECES handles (the fixed struct's limit: use ipc_get_long_handle), cuda_error
/// for a runtime failure.
[[nodiscard]] cucacheIpcHandle ipc_get_handle(void* ptr);
/// Opens another process's handle on the current device; the block's address here.
[[nodiscard]] void* ipc_open_handle(const cucacheIpcHandle& handle);
/// Closes one ipc_open_handle of `ptr`. Throws invalid_argument when ptr is not open.
void ipc_close_handle(void* ptr);
/// Sends / receives a handle over a connected unix socket, file descriptors as SCM_RIGHTS.
void ipc_send_handle(int socket, const cucacheIpcHandle& handle);
[[nodiscard]] cucacheIpcHandle ipc_recv_handle(int socket);
/// Closes the handle's file descriptors, setting them to -1.
void ipc_release_fds(cucacheIpcHandle& handle) noexcept;

/// A handle of any number of pieces (cucacheIpcLongHandle): the header, pieceCount equal to
/// pieces.size(). bytes() is its wire form (CUCACHE_IPC_LONG_HANDLE_BYTES), from_bytes reads one
/// back, validated (throws invalid_argument for a malformed, truncated or padded one).
struct ipc_long_handle {
  cucacheIpcLongHandle head{};
  std::vector<cucacheIpcPiece> pieces;
  [[nodiscard]] std::vector<std::byte> bytes() const;
  [[nodiscard]] static ipc_long_handle from_bytes(const void* data, std::size_t size);
};
/// As ipc_get_handle, without the piece limit (either kind).
[[nodiscard]] ipc_long_handle ipc_get_long_handle(void* ptr);
[[nodiscard]] void* ipc_open_handle(const ipc_long_handle& handle);
/// Sends the bytes, and the fds as SCM_RIGHTS in batches of at most 253.
void ipc_send_handle(int socket, const ipc_long_handle& handle);
[[nodiscard]] ipc_long_handle ipc_recv_long_handle(int socket);
void ipc_release_fds(ipc_long_handle& handle) noexcept;

/// An owning pointer to `count` objects of T in device memory from cucache::malloc, returned with
/// cucache::free when destroyed. Move-only. The objects are never constructed or destroyed on the
/// host, so T must be trivially destructible (plain data, as in any cudaMalloc buffer).
template <class T = std::byte>
class unique_device_ptr {
  static_assert(std::is_trivially_destructible_v<T>,
                "device memory is never constructed on the host: T must be trivially destructible");

 public:
  using element_type = T;

  constexpr unique_device_ptr() noexcept = default;
  constexpr unique_device_ptr(std::nullptr_t) noexcept {}
  /// Takes ownership of `ptr` (from cucache::malloc, holding `count` objects).
  explicit unique_device_ptr(T* ptr, std::size_t count = 0) noexcept : ptr_(ptr), count_(count) {}
  unique_device_ptr(unique_device_ptr&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), count_(std::exchange(other.count_, 0)) {}
  unique_device_ptr& operator=(unique_device_ptr&& other) noexcept {
    if (this != &other) reset(other.release(), std::exchange(other.count_, 0));
    return *this;
  }
  unique_device_ptr(const unique_device_ptr&) = delete;
  unique_device_ptr& operator=(const unique_device_ptr&) = delete;
  /// Frees the memory. noexcept: a free that fails here means the pointer was freed behind this
  /// object's back, a bug that terminates the program (as glibc aborts on a double free).
  ~unique_device_ptr() { reset(); }

  [[nodiscard]] T* get() const noexcept { return ptr_; }
  /// Number of objects, as given to make_unique_device or the constructor.
  [[nodiscard]] std::size_t size() const noexcept { return count_; }
  [[nodiscard]] std::size_t size_bytes() const noexcept { return count_ * sizeof(T); }
  explicit operator bool() const noexcept { return ptr_ != nullptr; }

  /// Gives up ownership without freeing.
  [[nodiscard]] T* release() noexcept {
    count_ = 0;
    return std::exchange(ptr_, nullptr);
  }
  /// Frees the current memory (if any) and takes `ptr`. Terminates if the free fails, as above.
  void reset(T* ptr = nullptr, std::size_t count = 0) noexcept {
    T* old = std::exchange(ptr_, ptr);
    count_ = count;
    if (old != nullptr) cucache::free(old);
  }
  void swap(unique_device_ptr& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(count_, other.count_);
  }

  friend bool operator==(const unique_device_ptr& p, std::nullptr_t) noexcept {
    return p.ptr_ == nullptr;
  }

 private:
  T* ptr_ = nullptr;
  std::size_t count_ = 0;
};

/// Allocates `count` objects of T (uninitialized) with cucache::malloc on `stream`. count == 0
/// gives an empty pointer. Throws std::bad_array_new_length when count * sizeof(T) overflows, and
/// whatever cucache::malloc throws.
template <class T = std::byte>
[[nodiscard]] unique_device_ptr<T> make_unique_device(std::size_t count,
                                                      stream_handle stream = nullptr) {
  if (count > std::numeric_limits<std::size_t>::max() / sizeof(T)) {
    throw std::bad_array_new_length();
  }
  return unique_device_ptr<T>(static_cast<T*>(cucache::malloc(count * sizeof(T), stream)), count);
}

}  // namespace cucache
