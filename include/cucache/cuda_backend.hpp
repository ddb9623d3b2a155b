// The real device: cuda_backend implements device_backend on one GPU. Segments, events and streams
// use the CUDA runtime; virtual memory uses driver entry points looked up at run time through the
// runtime, so nothing links libcuda and every binary loads on a machine without a driver.
#pragma once

#if (defined(_MSVC_LANG) ? _MSVC_LANG : __cplusplus) < 201709L
#error \
    "cucache/cuda_backend.hpp requires C++20: compile with -std=c++20 (CMake: link cucache::cucache, which asks for cxx_std_20; a .cu file needs CUDA_STANDARD 20). C++17 and older take cucache.h, thrust.hpp and memory_resource.hpp only (docs/api.md)."
#endif

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "cucache/backend.hpp"

namespace cucache {

/// Number of visible CUDA devices; 0 when there is no usable driver or no device. Never throws.
[[nodiscard]] int cuda_device_count() noexcept;
/// True when at least one CUDA device is usable.
[[nodiscard]] bool cuda_available() noexcept;
/// One line saying why CUDA is unusable here (for a test to print when it skips); empty when
/// cuda_available().
[[nodiscard]] std::string cuda_unavailable_reason();

/// device_backend on a real GPU. Every call makes the backend's device current for its duration and
/// restores the caller's current device afterwards. Holds no per-call state, so it is thread-safe.
class cuda_backend final : public device_backend {
 public:
  /// Binds to CUDA device ordinal `device` and initializes its primary context.
  ///
  /// Throws cuda_error when CUDA is unusable: without a usable driver or device, call() is
  /// "cudaGetDeviceCount" and code() the runtime's error (cudaErrorInsufficientDriver without a
  /// driver, cudaErrorNoDevice without a GPU). A negative or out-of-range ordinal gives call()
  /// "cuda_backend" and code() cudaErrorInvalidDevice. A driver that lacks one of the needed entry
  /// points gives call() "cudaGetDriverEntryPointByVersion(<symbol>)".
  explicit cuda_backend(int device = 0);
  ~cuda_backend() override = default;
  cuda_backend(const cuda_backend&) = delete;
  cuda_backend& operator=(const cuda_backend&) = delete;

  [[nodiscard]] int device() const noexcept override { return device_; }
  [[nodiscard]] const char* name() const noexcept override { return "cuda"; }

  [[nodiscard]] void* segment_malloc(std::size_t bytes) override;
  void segment_free(void* ptr) override;

  /// CU_MEM_ALLOC_GRANULARITY_RECOMMENDED for pinned memory on this device; 0 without VMM support,
  /// in which case every other virtual memory call throws cuda_error (CUDA_ERROR_NOT_SUPPORTED).
  [[nodiscard]] std::size_t vm_granularity() override { return granularity_; }
  /// The reservation is aligned to vm_granularity().
  [[nodiscard]] void* va_reserve(std::size_t bytes) override;
  void va_free(void* base, std::size_t bytes) override;
  [[nodiscard]] std::optional<phys_handle> phys_create(std::size_t bytes) override;
  void phys_release(phys_handle handle) override;
  void map(void* va, std::size_t bytes, phys_handle handle) override;
  void unmap(void* va, std::size_t bytes) override;
  /// cuMemSetAccess with one read/write descriptor per device of access_devices().
  void set_access(void* va, std::size_t bytes) override;
  /// Peers by cudaDeviceCanAccessPeer(peer, device()), asked once here.
  void configure_peer_access(peer_access_mode mode) override;
  [[nodiscard]] std::vector<int> access_devices() override;
  /// Requires CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED; phys_create then
  /// requests CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.
  void enable_phys_export() override;
  /// cudaIpcGetMemHandle / cudaIpcOpenMemHandle (cudaIpcMemLazyEnablePeerAccess) /
  /// cudaIpcCloseMemHandle.
  [[nodiscard]] segment_ipc_handle segment_export(void* base) override;
  [[nodiscard]] void* segment_import(const segment_ipc_handle& handle) override;
  void segment_close(void* base) override;
  /// cuMemExportToShareableHandle / cuMemImportFromShareableHandle, POSIX file descriptors.
  [[nodiscard]] int phys_export_fd(phys_handle handle) override;
  [[nodiscard]] phys_handle phys_import_fd(int fd) override;

  [[nodiscard]] event_handle event_create() override;
  void event_destroy(event_handle event) override;
  void event_record(event_handle event, stream_handle stream) override;
  [[nodiscard]] bool event_query(event_handle event) override;
  void event_synchronize(event_handle event) override;
  void stream_synchronize(stream_handle stream) override;
  void device_synchronize() override;
  /// cuStreamGetId (the driver's entry point; cudaStreamGetId where the driver call fails);
  /// nullptr (the legacy stream) included.
  [[nodiscard]] std::uint64_t stream_id(stream_handle stream) override;
  /// cuStreamGetCaptureInfo (cudaStreamGetCaptureInfo where the driver call fails).
  [[nodiscard]] capture_info capture_status(stream_handle stream) override;
  /// capture_status, then stream_id when not capturing: two driver calls on a created stream;
  /// on cudaStreamPerThread the capture query only (its id kept per thread); on the legacy stream
  /// (nullptr, cudaStreamLegacy) none (its id asked once per backend).
  [[nodiscard]] stream_identity identify(stream_handle stream) override;
  /// cudaThreadExchangeStreamCaptureMode.
  capture_mode exchange_capture_mode(capture_mode mode) override;

  [[nodiscard]] memory_info mem_get_info() override;
  [[nodiscard]] void* host_alloc_pinned(std::size_t bytes) override;
  void host_free_pinned(void* ptr) override;
  void copy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream) override;

 private:
  void require_vmm(const char* call) const;
  /// stream_id of cudaStreamLegacy or cudaStreamPerThread with this device current.
  std::uint64_t special_stream_id(stream_handle stream);

  static constexpr std::uint64_t k_unknown_id = ~std::uint64_t{0};

  int device_;
  int cu_device_ = 0;  // The driver's CUdevice for device_.
  std::size_t granularity_ = 0;
  std::atomic<bool> export_fd_{false};
  mutable std::mutex access_mu_;
  std::vector<int> access_devices_;  // runtime ordinals, this device first
  std::vector<int> access_cu_;       // their CUdevice numbers
  std::atomic<std::uint64_t> legacy_id_{k_unknown_id};  // the legacy stream's id, once asked
};

}  // namespace cucache
