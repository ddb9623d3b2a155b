// The device seam: every effect cucache has on a device goes through device_backend. The core and
// the allocator never call CUDA themselves, so the same algorithms run on a real GPU
// (cuda_backend) and on a simulated device (sim_backend) in tests and CI.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

namespace cucache {

/// A stream as the runtime knows it (cudaStream_t). nullptr is the legacy default stream.
using stream_handle = void*;
/// An event as the runtime knows it (cudaEvent_t).
using event_handle = void*;
/// A physical memory handle (CUmemGenericAllocationHandle).
using phys_handle = std::uint64_t;

/// Free and total bytes of a device, as cudaMemGetInfo reports them.
struct memory_info {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};

/// Every device effect the allocator uses. One instance serves one device.
///
/// Error contract: calls that can run out of device memory (segment_malloc, phys_create) report it
/// by returning nullptr / std::nullopt; every other failure throws cucache::cuda_error naming the
/// call. Implementations are thread-safe: the allocator may call them from several threads.
class device_backend {
 public:
  virtual ~device_backend() = default;

  /// The device ordinal this backend serves.
  [[nodiscard]] virtual int device() const noexcept = 0;
  /// A short name for reports ("cuda", "sim").
  [[nodiscard]] virtual const char* name() const noexcept = 0;

  // --- Segments (cudaMalloc / cudaFree) -------------------------------------------------------
  /// Allocates `bytes` of device memory. nullptr means the device is out of memory.
  [[nodiscard]] virtual void* segment_malloc(std::size_t bytes) = 0;
  /// Frees memory from segment_malloc. Implies a device-wide synchronization on real hardware.
  virtual void segment_free(void* ptr) = 0;

  // --- Virtual memory (cuMemAddressReserve, cuMemCreate, cuMemMap, ...) ------------------------
  /// Allocation granularity of physical handles; 0 if the device has no virtual memory support.
  [[nodiscard]] virtual std::size_t vm_granularity() = 0;
  /// Reserves `bytes` of virtual address space (multiple of the granularity). Throws on failure.
  [[nodiscard]] virtual void* va_reserve(std::size_t bytes) = 0;
  /// Releases a reservation; every mapping inside it must have been unmapped.
  virtual void va_free(void* base, std::size_t bytes) = 0;
  /// Creates a physical allocation of `bytes` (multiple of the granularity); nullopt when the
  /// device is out of memory.
  [[nodiscard]] virtual std::optional<phys_handle> phys_create(std::size_t bytes) = 0;
  /// Releases a physical allocation that is no longer mapped.
  virtual void phys_release(phys_handle handle) = 0;
  /// Maps the whole of `handle` (of `bytes`) at `va`. The driver maps whole handles only.
  virtual void map(void* va, std::size_t bytes, phys_handle handle) = 0;
  /// Unmaps exactly one earlier mapping of `bytes` at `va`.
  virtual void unmap(void* va, std::size_t bytes) = 0;
  /// Grants this device read/write access to a mapped range.
  virtual void set_access(void* va, std::size_t bytes) = 0;

  // --- Events and streams ------------------------------------------------------------------------
  [[nodiscard]] virtual event_handle event_create() = 0;
  virtual void event_destroy(event_handle event) = 0;
  virtual void event_record(event_handle event, stream_handle stream) = 0;
  /// True when all work captured by the event has completed.
  [[nodiscard]] virtual bool event_query(event_handle event) = 0;
  virtual void event_synchronize(event_handle event) = 0;
  virtual void stream_wait_event(stream_handle stream, event_handle event) = 0;
  virtual void stream_synchronize(stream_handle stream) = 0;
  virtual void device_synchronize() = 0;

  /// Free and total memory of the device (cudaMemGetInfo).
  [[nodiscard]] virtual memory_info mem_get_info() = 0;
};

}  // namespace cucache
