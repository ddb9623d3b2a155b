// The device seam: every effect cucache has on a device goes through device_backend. The core and
// the allocator never call CUDA themselves, so the same algorithms run on a real GPU
// (cuda_backend) and on a simulated device (sim_backend) in tests and CI.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace cucache {

/// Which devices get read/write access to expandable-segment mappings (cuMemSetAccess), besides
/// the owning device (docs/config.md, peer_access). cudaMalloc'd segments are not concerned:
/// their peer access follows cudaDeviceEnablePeerAccess.
enum class peer_access_mode : std::uint8_t {
  automatic,  ///< "auto": every other device that cudaDeviceCanAccessPeer says can access it
  all,        ///< every other device; one that cannot access the owner is an error
  none,       ///< the owning device only
};

/// A stream as the runtime knows it (cudaStream_t). nullptr is the legacy default stream.
using stream_handle = void*;
/// An event as the runtime knows it (cudaEvent_t).
using event_handle = void*;
/// A physical memory handle (CUmemGenericAllocationHandle).
using phys_handle = std::uint64_t;

/// The runtime's cudaStreamPerThread: one handle value that names a different stream in each
/// thread.
[[nodiscard]] inline stream_handle per_thread_stream() noexcept {
  return reinterpret_cast<stream_handle>(std::uintptr_t{0x2});
}
/// The runtime's cudaStreamLegacy: the legacy default stream, as nullptr names it.
[[nodiscard]] inline stream_handle legacy_stream() noexcept {
  return reinterpret_cast<stream_handle>(std::uintptr_t{0x1});
}
/// True for the two handles of the legacy default stream, nullptr and cudaStreamLegacy (0x1). That
/// stream is never destroyed and can never be captured (cudaStreamBeginCapture: "Capture may not
/// be initiated if stream is cudaStreamLegacy", CUDA Runtime API reference; cuStreamBeginCapture
/// says the same of CU_STREAM_LEGACY), so its identity is constant per device and nobody needs
/// to ask the driver about it per allocation.
[[nodiscard]] inline bool is_legacy_stream(stream_handle stream) noexcept {
  return reinterpret_cast<std::uintptr_t>(stream) <= 0x1;
}
/// True for the legacy stream's handles and cudaStreamPerThread: the handles whose identity a
/// backend keeps instead of asking per allocation (device_backend::identify).
[[nodiscard]] inline bool is_special_stream(stream_handle stream) noexcept {
  return reinterpret_cast<std::uintptr_t>(stream) <= 0x2;
}

/// Whether a stream is being captured into a CUDA graph (cudaStreamCaptureStatus).
enum class capture_state : std::uint8_t {
  none,         ///< not capturing: work runs
  active,       ///< capturing: work is recorded into a graph, nothing runs
  invalidated,  ///< was capturing, and the capture broke (an illegal call); it must be ended
};

/// A stream's capture (cudaStreamGetCaptureInfo): its state and, unless none, the id of the capture
/// sequence, unique in the process.
struct capture_info {
  capture_state state = capture_state::none;
  std::uint64_t id = 0;
};

/// What an allocation asks about its stream (device_backend::identify): its capture and, only when
/// it is not being captured, its id.
struct stream_identity {
  capture_info capture;
  /// stream_id(stream) when capture.state is none; 0 otherwise (not asked: cudaStreamGetId is
  /// refused on a capturing stream, and the refusal invalidates the capture).
  std::uint64_t id = 0;
};

/// A thread's interaction with captures (cudaStreamCaptureMode): in global mode a thread may not
/// make "potentially unsafe" calls (cudaMalloc, cudaEventQuery, ...) while any thread captures in
/// global mode or it captures itself; in thread-local mode only its own captures count; in relaxed
/// mode nothing is prohibited except the calls that conflict with a capture by nature
/// (synchronizing a capturing stream or the device, querying an event recorded in a capture).
enum class capture_mode : std::uint8_t { global, thread_local_mode, relaxed };

/// Free and total bytes of a device, as cudaMemGetInfo reports them.
struct memory_info {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};

/// An opaque inter-process handle of one cudaMalloc'd segment (cudaIpcMemHandle_t: 64 bytes).
struct segment_ipc_handle {
  unsigned char bytes[64] = {};
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
  /// Reserves `bytes` of virtual address space (multiple of the granularity). nullptr means the
  /// address space has no room (CUDA_ERROR_OUT_OF_MEMORY); other failures throw.
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
  /// Grants read/write access to a mapped range to this device and to the peers of
  /// access_devices(): one cuMemSetAccess with one descriptor per device.
  virtual void set_access(void* va, std::size_t bytes) = 0;

  // --- Peer access of mappings (config key peer_access) ----------------------------------------
  /// Chooses which other devices set_access grants access to, from now on. Throws cuda_error
  /// (cudaErrorPeerAccessUnsupported, 217) for peer_access_mode::all when a device cannot access
  /// this one. The default, for backends without peers, keeps this device alone.
  virtual void configure_peer_access(peer_access_mode mode) { static_cast<void>(mode); }
  /// The devices set_access grants access to: this device first, then its peers, ascending.
  [[nodiscard]] virtual std::vector<int> access_devices() { return {device()}; }

  // --- Inter-process sharing (docs/design.md, "IPC") -------------------------------------------
  /// Makes phys_create request POSIX-file-descriptor export (CU_MEM_HANDLE_TYPE_POSIX_FILE_
  /// DESCRIPTOR) from now on (config key ipc_handles). Throws cuda_error (cudaErrorNotSupported,
  /// 801) naming why when the device or driver cannot export such handles.
  virtual void enable_phys_export();
  /// The IPC handle of a live segment from segment_malloc, by its base (cudaIpcGetMemHandle).
  [[nodiscard]] virtual segment_ipc_handle segment_export(void* base);
  /// Opens another process's segment handle (cudaIpcOpenMemHandle with
  /// cudaIpcMemLazyEnablePeerAccess): the segment's base in this process.
  [[nodiscard]] virtual void* segment_import(const segment_ipc_handle& handle);
  /// Closes what segment_import opened (cudaIpcCloseMemHandle).
  virtual void segment_close(void* base);
  /// A new POSIX file descriptor for a physical handle created after enable_phys_export
  /// (cuMemExportToShareableHandle); the caller owns it.
  [[nodiscard]] virtual int phys_export_fd(phys_handle handle);
  /// Imports a physical handle from a file descriptor of phys_export_fd, possibly of another
  /// process (cuMemImportFromShareableHandle). The descriptor stays the caller's.
  [[nodiscard]] virtual phys_handle phys_import_fd(int fd);

  // --- Events and streams ------------------------------------------------------------------------
  [[nodiscard]] virtual event_handle event_create() = 0;
  virtual void event_destroy(event_handle event) = 0;
  virtual void event_record(event_handle event, stream_handle stream) = 0;
  /// True when all work captured by the event has completed.
  [[nodiscard]] virtual bool event_query(event_handle event) = 0;
  virtual void event_synchronize(event_handle event) = 0;
  virtual void stream_synchronize(stream_handle stream) = 0;
  virtual void device_synchronize() = 0;

  /// The stream's id for the life of the process (cudaStreamGetId): the runtime hands a destroyed
  /// stream's handle value to the next stream it creates, but never its id. For
  /// per_thread_stream(), the calling thread's per-thread stream. REQUIRES: stream is alive.
  [[nodiscard]] virtual std::uint64_t stream_id(stream_handle stream) = 0;
  /// Whether `stream` is being captured (cudaStreamGetCaptureInfo). REQUIRES: stream is alive.
  [[nodiscard]] virtual capture_info capture_status(stream_handle stream) = 0;
  /// capture_status(stream), then stream_id(stream) only if it is not being captured: what every
  /// allocation on a stream other than the legacy default one asks, in one call, so that a backend
  /// can answer both at its cheapest. The rule every backend follows (docs/design.md, "Streams
  /// that die"): the legacy stream (is_legacy_stream: nullptr, cudaStreamLegacy) costs no query
  /// -- it cannot be captured nor destroyed, so its id is asked once and kept; cudaStreamPerThread
  /// costs the capture query only -- its id is fixed for the thread's life, kept per thread; any
  /// other stream costs both -- a destroyed stream's handle value comes back with the next created
  /// stream, and nothing cheaper than the id query tells the two apart. The default makes the two
  /// calls for every stream (correct for any backend, only slower). REQUIRES: stream is alive.
  [[nodiscard]] virtual stream_identity identify(stream_handle stream) {
    const capture_info capture = capture_status(stream);
    if (capture.state != capture_state::none) return {capture, 0};
    return {capture, stream_id(stream)};
  }
  /// Sets the calling thread's capture mode and returns the one it had
  /// (cudaThreadExchangeStreamCaptureMode).
  virtual capture_mode exchange_capture_mode(capture_mode mode) = 0;

  /// Free and total memory of the device (cudaMemGetInfo).
  [[nodiscard]] virtual memory_info mem_get_info() = 0;

  // --- host copies (sleep with keepContents: docs/design.md, "Sleep and wake") ---
  /// Allocates `bytes` of page-locked host memory (cudaHostAlloc); nullptr when the host cannot
  /// pin that much (out of memory is not an exception, as with segment_malloc).
  [[nodiscard]] virtual void* host_alloc_pinned(std::size_t bytes) = 0;
  /// Frees memory from host_alloc_pinned (cudaFreeHost; synchronizes like it).
  virtual void host_free_pinned(void* ptr) = 0;
  /// Queues a copy of `bytes` from `src` to `dst` on `stream` (cudaMemcpyAsync, cudaMemcpyDefault):
  /// one side pinned host memory from host_alloc_pinned, the other mapped device memory of this
  /// device. Complete after stream_synchronize(stream) or device_synchronize(). Throws cuda_error
  /// when the runtime refuses (a device range that is not mapped, a capturing stream).
  virtual void copy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream) = 0;
};

}  // namespace cucache
