// cuda_backend: device_backend on a real GPU. The virtual memory calls reach the driver through
// entry points that the runtime looks up at run time, so libcucache links only cudart_static and
// loads on machines without libcuda.
#include "cucache/cuda_backend.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backend/device_guard.hpp"
#include "cucache/errors.hpp"

namespace cucache {
namespace detail {
namespace {

// Every entry point below has had one ABI since its introduction (cudaTypedefs.h of CUDA 13.0
// lists a single version of each), so any version from 10.2 on returns the functions the typedefs
// describe. Asking for 12.0 rather than CUDA_VERSION keeps the lookup valid when the driver is
// older than the toolkit under minor-version compatibility.
constexpr unsigned int driver_abi_version = 12000;

struct driver_api {
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_get_attribute = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 mem_get_allocation_granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 mem_address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 mem_address_free = nullptr;
  PFN_cuMemCreate_v10020 mem_create = nullptr;
  PFN_cuMemRelease_v10020 mem_release = nullptr;
  PFN_cuMemMap_v10020 mem_map = nullptr;
  PFN_cuMemUnmap_v10020 mem_unmap = nullptr;
  PFN_cuMemSetAccess_v10020 mem_set_access = nullptr;
  PFN_cuMemExportToShareableHandle_v10020 mem_export_to_shareable_handle = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 mem_import_from_shareable_handle = nullptr;
  // The stream queries every allocation makes (identify). Optional: where the driver lacks one,
  // the runtime's wrapper answers. Asked at ABI 12000, cuStreamGetCaptureInfo is its second
  // version (CUDA 11.3's signature: the graph and dependency outputs may be null).
  PFN_cuStreamGetCaptureInfo_v11030 stream_get_capture_info = nullptr;
  PFN_cuStreamGetId_v12000 stream_get_id = nullptr;
};

/// The driver's entry point `symbol` at driver_abi_version: the runtime's answer as it gave it.
struct entry_point {
  cudaError_t code = cudaSuccess;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  void* address = nullptr;
  [[nodiscard]] bool found() const noexcept {
    return code == cudaSuccess && status == cudaDriverEntryPointSuccess && address != nullptr;
  }
};
entry_point look_up(const char* symbol) {
  entry_point e;
  e.code = cudaGetDriverEntryPointByVersion(symbol, &e.address, driver_abi_version,
                                            cudaEnableDefault, &e.status);
  return e;
}

template <typename Fn>
void resolve(const char* symbol, Fn& fn) {
  const entry_point e = look_up(symbol);
  const std::string call = fmt::format("cudaGetDriverEntryPointByVersion({})", symbol);
  if (e.code != cudaSuccess) throw_runtime_error(call, e.code);
  if (!e.found()) {
    throw cuda_error(call, static_cast<int>(cudaErrorSymbolNotFound),
                     fmt::format("the CUDA driver has no {} for CUDA ABI {} (query result {})",
                                 symbol, driver_abi_version, static_cast<int>(e.status)));
  }
  fn = std::bit_cast<Fn>(e.address);
}

/// resolve(), but a symbol the driver does not have leaves fn null instead of throwing.
template <typename Fn>
void resolve_optional(const char* symbol, Fn& fn) {
  const entry_point e = look_up(symbol);
  if (e.code != cudaSuccess) clear_expected_error(e.code);
  fn = e.found() ? std::bit_cast<Fn>(e.address) : nullptr;
}

driver_api load_driver_api() {
  driver_api api;
  resolve("cuGetErrorString", api.get_error_string);
  resolve("cuDeviceGet", api.device_get);
  resolve("cuDeviceGetAttribute", api.device_get_attribute);
  resolve("cuMemGetAllocationGranularity", api.mem_get_allocation_granularity);
  resolve("cuMemAddressReserve", api.mem_address_reserve);
  resolve("cuMemAddressFree", api.mem_address_free);
  resolve("cuMemCreate", api.mem_create);
  resolve("cuMemRelease", api.mem_release);
  resolve("cuMemMap", api.mem_map);
  resolve("cuMemUnmap", api.mem_unmap);
  resolve("cuMemSetAccess", api.mem_set_access);
  resolve("cuMemExportToShareableHandle", api.mem_export_to_shareable_handle);
  resolve("cuMemImportFromShareableHandle", api.mem_import_from_shareable_handle);
  resolve_optional("cuStreamGetCaptureInfo", api.stream_get_capture_info);
  resolve_optional("cuStreamGetId", api.stream_get_id);
  return api;
}

// Resolved once per process. A throwing load leaves the static uninitialized, so a later backend
// retries instead of caching the failure.
const driver_api& driver() {
  static const driver_api api = load_driver_api();
  return api;
}

[[noreturn]] void throw_driver_error(const char* call, CUresult code) {
  const char* message = nullptr;
  if (driver().get_error_string(code, &message) != CUDA_SUCCESS || message == nullptr) {
    message = "unrecognized CUDA driver error";
  }
  throw cuda_error(call, static_cast<int>(code), message);
}

void check_driver(CUresult code, const char* call) {
  if (code != CUDA_SUCCESS) throw_driver_error(call, code);
}

CUdeviceptr to_device_ptr(void* ptr) {
  return static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(ptr));
}

void* from_device_ptr(CUdeviceptr ptr) {
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(ptr));
}

CUmemAllocationProp pinned_device_memory(int cu_device, bool export_fd = false) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes =
      export_fd ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = cu_device;
  return prop;
}

cudaEvent_t as_event(event_handle event) {
  return static_cast<cudaEvent_t>(event);
}
cudaStream_t as_stream(stream_handle stream) {
  return static_cast<cudaStream_t>(stream);
}

}  // namespace
}  // namespace detail

int cuda_device_count() noexcept {
  int count = 0;
  const cudaError_t code = cudaGetDeviceCount(&count);
  if (code != cudaSuccess) {
    detail::clear_expected_error(code);
    return 0;
  }
  return count;
}

bool cuda_available() noexcept {
  return cuda_device_count() > 0;
}

std::string cuda_unavailable_reason() {
  int count = 0;
  const cudaError_t code = cudaGetDeviceCount(&count);
  if (code == cudaSuccess) {
    return count > 0 ? std::string{} : "no CUDA device: cudaGetDeviceCount found 0 devices";
  }
  detail::clear_expected_error(code);
  const char* what = "CUDA unusable";
  if (code == cudaErrorInsufficientDriver) what = "no usable CUDA driver (missing or too old)";
  if (code == cudaErrorNoDevice) what = "no CUDA device";
  return fmt::format("{}: cudaGetDeviceCount returned {} ({})", what, cudaGetErrorName(code),
                     cudaGetErrorString(code));
}

cuda_backend::cuda_backend(int device) : device_(device) {
  // An ordinal check first, so a bad ordinal is reported as such even where there is no driver.
  if (device < 0) {
    throw cuda_error("cuda_backend", static_cast<int>(cudaErrorInvalidDevice),
                     fmt::format("device ordinal {} is negative", device));
  }
  int count = 0;
  detail::check_runtime(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (device >= count) {
    throw cuda_error(
        "cuda_backend", static_cast<int>(cudaErrorInvalidDevice),
        fmt::format("device ordinal {} is out of range: {} CUDA device(s) visible", device, count));
  }
  // Creates the primary context now, without touching the caller's current device, so the first
  // allocation does not pay for it and a prohibited compute mode fails here.
  detail::check_runtime(cudaInitDevice(device_, 0, 0), "cudaInitDevice");

  const detail::driver_api& api = detail::driver();
  detail::check_driver(api.device_get(&cu_device_, device_), "cuDeviceGet");
  // The runtime's cudaDeviceAttr has no virtual-memory attribute, hence the driver query.
  int vmm_supported = 0;
  detail::check_driver(
      api.device_get_attribute(&vmm_supported,
                               CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, cu_device_),
      "cuDeviceGetAttribute");
  if (vmm_supported != 0) {
    const CUmemAllocationProp prop = detail::pinned_device_memory(cu_device_);
    detail::check_driver(api.mem_get_allocation_granularity(&granularity_, &prop,
                                                            CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
                         "cuMemGetAllocationGranularity");
  }
}

void cuda_backend::require_vmm(const char* call) const {
  if (granularity_ == 0) {
    throw cuda_error(
        call, static_cast<int>(CUDA_ERROR_NOT_SUPPORTED),
        fmt::format("CUDA device {} does not support virtual memory management", device_));
  }
}

// --- Segments ------------------------------------------------------------------------------------

void* cuda_backend::segment_malloc(std::size_t bytes) {
  const detail::device_guard guard(device_);
  void* ptr = nullptr;
  const cudaError_t code = cudaMalloc(&ptr, bytes);
  if (code == cudaSuccess) return ptr;
  if (code == cudaErrorMemoryAllocation) {
    // Out of memory is an answer, not an error: the allocator frees cache and retries, and the
    // user must not find a stale cudaErrorMemoryAllocation later.
    detail::clear_expected_error(code);
    return nullptr;
  }
  detail::throw_runtime_error("cudaMalloc", code);
}

void cuda_backend::segment_free(void* ptr) {
  const detail::device_guard guard(device_);
  detail::check_runtime(cudaFree(ptr), "cudaFree");
}

// --- Virtual memory ------------------------------------------------------------------------------

void* cuda_backend::va_reserve(std::size_t bytes) {
  require_vmm("cuMemAddressReserve");
  const detail::device_guard guard(device_);
  CUdeviceptr base = 0;
  const CUresult code = detail::driver().mem_address_reserve(&base, bytes, granularity_, 0, 0);
  if (code == CUDA_ERROR_OUT_OF_MEMORY) return nullptr;
  detail::check_driver(code, "cuMemAddressReserve");
  return detail::from_device_ptr(base);
}

void cuda_backend::va_free(void* base, std::size_t bytes) {
  require_vmm("cuMemAddressFree");
  const detail::device_guard guard(device_);
  detail::check_driver(detail::driver().mem_address_free(detail::to_device_ptr(base), bytes),
                       "cuMemAddressFree");
}

std::optional<phys_handle> cuda_backend::phys_create(std::size_t bytes) {
  require_vmm("cuMemCreate");
  const detail::device_guard guard(device_);
  const CUmemAllocationProp prop =
      detail::pinned_device_memory(cu_device_, export_fd_.load(std::memory_order_relaxed));
  CUmemGenericAllocationHandle handle = 0;
  const CUresult code = detail::driver().mem_create(&handle, bytes, &prop, 0);
  if (code == CUDA_ERROR_OUT_OF_MEMORY) return std::nullopt;
  detail::check_driver(code, "cuMemCreate");
  return phys_handle{handle};
}

void cuda_backend::phys_release(phys_handle handle) {
  require_vmm("cuMemRelease");
  const detail::device_guard guard(device_);
  detail::check_driver(detail::driver().mem_release(handle), "cuMemRelease");
}

void cuda_backend::map(void* va, std::size_t bytes, phys_handle handle) {
  require_vmm("cuMemMap");
  const detail::device_guard guard(device_);
  // The driver only accepts offset 0: a handle is always mapped from its start.
  detail::check_driver(detail::driver().mem_map(detail::to_device_ptr(va), bytes, 0, handle, 0),
                       "cuMemMap");
}

void cuda_backend::unmap(void* va, std::size_t bytes) {
  require_vmm("cuMemUnmap");
  const detail::device_guard guard(device_);
  detail::check_driver(detail::driver().mem_unmap(detail::to_device_ptr(va), bytes), "cuMemUnmap");
}

void cuda_backend::set_access(void* va, std::size_t bytes) {
  require_vmm("cuMemSetAccess");
  const detail::device_guard guard(device_);
  std::vector<CUmemAccessDesc> access;
  {
    std::lock_guard lock(access_mu_);
    if (access_cu_.empty()) {
      access.resize(1);
      access[0].location.id = cu_device_;
    } else {
      access.resize(access_cu_.size());
      for (std::size_t i = 0; i < access_cu_.size(); ++i) access[i].location.id = access_cu_[i];
    }
  }
  for (CUmemAccessDesc& a : access) {
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  detail::check_driver(detail::driver().mem_set_access(detail::to_device_ptr(va), bytes,
                                                       access.data(), access.size()),
                       "cuMemSetAccess");
}

void cuda_backend::configure_peer_access(peer_access_mode mode) {
  std::vector<int> devices{device_};
  std::vector<int> cu{cu_device_};
  if (mode != peer_access_mode::none) {
    int count = 0;
    detail::check_runtime(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
    for (int d = 0; d < count; ++d) {
      if (d == device_) continue;
      int can = 0;
      detail::check_runtime(cudaDeviceCanAccessPeer(&can, d, device_), "cudaDeviceCanAccessPeer");
      if (can == 0) {
        if (mode == peer_access_mode::all) {
          throw cuda_error("cudaDeviceCanAccessPeer",
                           static_cast<int>(cudaErrorPeerAccessUnsupported),
                           fmt::format("peer_access:all: CUDA device {} cannot access device {}; "
                                       "use peer_access:auto",
                                       d, device_));
        }
        continue;
      }
      CUdevice c = 0;
      detail::check_driver(detail::driver().device_get(&c, d), "cuDeviceGet");
      devices.push_back(d);
      cu.push_back(c);
    }
  }
  std::lock_guard lock(access_mu_);
  access_devices_ = std::move(devices);
  access_cu_ = std::move(cu);
}

std::vector<int> cuda_backend::access_devices() {
  std::lock_guard lock(access_mu_);
  if (access_devices_.empty()) return {device_};
  return access_devices_;
}

void cuda_backend::enable_phys_export() {
  require_vmm("enable_phys_export");
  int supported = 0;
  detail::check_driver(
      detail::driver().device_get_attribute(
          &supported, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, cu_device_),
      "cuDeviceGetAttribute");
  if (supported == 0) {
    throw cuda_error("ipc_handles", static_cast<int>(cudaErrorNotSupported),
                     fmt::format("CUDA device {} cannot export physical memory as POSIX file "
                                 "descriptors (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_"
                                 "DESCRIPTOR_SUPPORTED is 0); use ipc_handles:False",
                                 device_));
  }
  export_fd_.store(true, std::memory_order_relaxed);
}

segment_ipc_handle cuda_backend::segment_export(void* base) {
  const detail::device_guard guard(device_);
  cudaIpcMemHandle_t h{};
  detail::check_runtime(cudaIpcGetMemHandle(&h, base), "cudaIpcGetMemHandle");
  static_assert(sizeof(h) == sizeof(segment_ipc_handle::bytes));
  segment_ipc_handle out;
  std::memcpy(out.bytes, &h, sizeof(h));
  return out;
}

void* cuda_backend::segment_import(const segment_ipc_handle& handle) {
  const detail::device_guard guard(device_);
  cudaIpcMemHandle_t h{};
  std::memcpy(&h, handle.bytes, sizeof(h));
  void* ptr = nullptr;
  detail::check_runtime(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess),
                        "cudaIpcOpenMemHandle");
  return ptr;
}

void cuda_backend::segment_close(void* base) {
  const detail::device_guard guard(device_);
  detail::check_runtime(cudaIpcCloseMemHandle(base), "cudaIpcCloseMemHandle");
}

int cuda_backend::phys_export_fd(phys_handle handle) {
  require_vmm("cuMemExportToShareableHandle");
  const detail::device_guard guard(device_);
  int fd = -1;
  detail::check_driver(detail::driver().mem_export_to_shareable_handle(
                           &fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                       "cuMemExportToShareableHandle");
  return fd;
}

phys_handle cuda_backend::phys_import_fd(int fd) {
  require_vmm("cuMemImportFromShareableHandle");
  const detail::device_guard guard(device_);
  CUmemGenericAllocationHandle h = 0;
  // The driver takes the descriptor's value itself, cast to a pointer.
  detail::check_driver(detail::driver().mem_import_from_shareable_handle(
                           &h, reinterpret_cast<void*>(static_cast<std::intptr_t>(fd)),
                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                       "cuMemImportFromShareableHandle");
  return phys_handle{h};
}

// --- Events and streams --------------------------------------------------------------------------

event_handle cuda_backend::event_create() {
  const detail::device_guard guard(device_);
  cudaEvent_t event = nullptr;
  // The allocator only orders work with its events; timing would make every record costlier.
  detail::check_runtime(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                        "cudaEventCreateWithFlags");
  return event;
}

void cuda_backend::event_destroy(event_handle event) {
  const detail::device_guard guard(device_);
  detail::check_runtime(cudaEventDestroy(detail::as_event(event)), "cudaEventDestroy");
}

void cuda_backend::event_record(event_handle event, stream_handle stream) {
  // The guard matters here: a null stream names the current device's legacy default stream.
  const detail::device_guard guard(device_);
  detail::check_runtime(cudaEventRecord(detail::as_event(event), detail::as_stream(stream)),
                        "cudaEventRecord");
}

bool cuda_backend::event_query(event_handle event) {
  const detail::device_guard guard(device_);
  const cudaError_t code = cudaEventQuery(detail::as_event(event));
  if (code == cudaSuccess) return true;
  if (code == cudaErrorNotReady) {
    detail::clear_expected_error(code);
    return false;
  }
  detail::throw_runtime_error("cudaEventQuery", code);
}

void cuda_backend::event_synchronize(event_handle event) {
  const detail::device_guard guard(device_);
  detail::check_runtime(cudaEventSynchronize(detail::as_event(event)), "cudaEventSynchronize");
}

void cuda_backend::stream_synchronize(stream_handle stream) {
  const detail::device_guard guard(device_);
  detail::check_runtime(cudaStreamSynchronize(detail::as_stream(stream)), "cudaStreamSynchronize");
}

void cuda_backend::device_synchronize() {
  const detail::device_guard guard(device_);
  detail::check_runtime(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

// Stream identity and capture state belong to the stream, not to the current device: no guard.
//
// Every allocation on a stream asks both (identify), so they go to the driver's entry points
// directly: the runtime's wrappers cost 74 ns (cudaStreamGetId) and 90 ns
// (cudaStreamGetCaptureInfo) on the H200 (docs/benchmarks.md). Where a driver call fails, the
// runtime's wrapper is asked instead and its answer (or error) stands: it makes the device's
// primary context current on a thread that has none -- the driver refuses the special handles
// (cudaStreamPerThread, cudaStreamLegacy) without a current context -- and reports errors with
// the runtime's codes. A failed driver call changes no state (the runtime's last error included).
namespace detail {
namespace {

CUstream as_cu_stream(stream_handle stream) {
  return static_cast<CUstream>(stream);
}

/// The capture of `stream` from the driver; false when the driver cannot answer.
bool driver_capture_info(stream_handle stream, capture_info& out) {
  const driver_api& api = driver();
  if (api.stream_get_capture_info == nullptr) return false;
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  cuuint64_t id = 0;
  if (api.stream_get_capture_info(as_cu_stream(stream), &status, &id, nullptr, nullptr, nullptr) !=
      CUDA_SUCCESS) {
    return false;
  }
  switch (status) {
    case CU_STREAM_CAPTURE_STATUS_ACTIVE:
      out = {capture_state::active, id};
      break;
    case CU_STREAM_CAPTURE_STATUS_INVALIDATED:
      out = {capture_state::invalidated, id};
      break;
    default:
      out = {};
  }
  return true;
}

/// The id of `stream` from the driver; false when the driver cannot answer. REQUIRES: stream is
/// not being captured (the driver refuses, and the refusal invalidates the capture).
bool driver_stream_id(stream_handle stream, std::uint64_t& out) {
  const driver_api& api = driver();
  if (api.stream_get_id == nullptr) return false;
  unsigned long long id = 0;
  if (api.stream_get_id(as_cu_stream(stream), &id) != CUDA_SUCCESS) return false;
  out = id;
  return true;
}

std::uint64_t runtime_stream_id(stream_handle stream) {
  unsigned long long id = 0;
  check_runtime(cudaStreamGetId(as_stream(stream), &id), "cudaStreamGetId");
  return id;
}

capture_info runtime_capture_info(stream_handle stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  check_runtime(cudaStreamGetCaptureInfo(as_stream(stream), &status, &id),
                "cudaStreamGetCaptureInfo");
  switch (status) {
    case cudaStreamCaptureStatusActive:
      return {capture_state::active, id};
    case cudaStreamCaptureStatusInvalidated:
      return {capture_state::invalidated, id};
    default:
      return {};
  }
}

}  // namespace
}  // namespace detail

std::uint64_t cuda_backend::stream_id(stream_handle stream) {
  std::uint64_t id = 0;
  if (detail::driver_stream_id(stream, id)) [[likely]]
    return id;
  return detail::runtime_stream_id(stream);
}

capture_info cuda_backend::capture_status(stream_handle stream) {
  capture_info info;
  if (detail::driver_capture_info(stream, info)) [[likely]]
    return info;
  return detail::runtime_capture_info(stream);
}

namespace {
// The id of each device's per-thread stream in this thread, plus one (0: not asked yet), by
// runtime ordinal; devices beyond the table ask every time. A thread's per-thread stream of a
// device lives as long as the thread (and the device's primary context: cudaDeviceReset ends
// both, and everything an allocator holds with them).
constexpr int k_cached_devices = 64;
thread_local std::array<std::uint64_t, k_cached_devices> t_per_thread_ids{};
}  // namespace

std::uint64_t cuda_backend::special_stream_id(stream_handle stream) {
  // cudaStreamLegacy and cudaStreamPerThread name the stream of the *current* context: asked
  // with this backend's device current, so that the id kept is this device's.
  const detail::device_guard guard(device_);
  return cuda_backend::stream_id(stream);
}

stream_identity cuda_backend::identify(stream_handle stream) {
  // The base's rule (backend.hpp), with the calls bound statically (no virtual dispatch per
  // allocation), and the two special handles answered from what was asked before:
  //
  // - The legacy stream (nullptr, cudaStreamLegacy): no driver call. It can never be captured --
  //   cudaStreamBeginCapture: "Capture may not be initiated if stream is cudaStreamLegacy" (CUDA
  //   Runtime API reference, Stream Management; cuStreamBeginCapture: "... if hStream is
  //   CU_STREAM_LEGACY") -- and never destroyed, so its capture status is always none and its id
  //   is constant per device: asked once (cuStreamGetId) and kept in legacy_id_. (While another,
  //   blocking stream captures, cudaStreamIsCapturing on the legacy stream is refused with
  //   cudaErrorStreamCaptureImplicit -- the legacy stream itself is still not captured, and
  //   work the program enqueues on it then fails in the runtime, not here.)
  // - cudaStreamPerThread: the capture query stays (its capture is allowed and may begin between
  //   any two allocations); its id is fixed for the thread's life, so kept per thread and device.
  //   The id kept is that of this backend's device (asked with it current), the capture query
  //   asks about the current device's per-thread stream, as the runtime resolves the handle:
  //   the two agree when the allocation's device is current, as with every front end (the C API
  //   allocates on the current device; PyTorch makes the tensor's device current).
  // - Any other stream: both queries. A destroyed stream's handle value is handed to the next
  //   stream the runtime creates, and nothing cheaper than cuStreamGetId tells the two apart
  //   (docs/design.md, "Streams that die"): ~55 ns of driver queries on the H200.
  if (is_special_stream(stream)) [[unlikely]] {
    if (is_legacy_stream(stream)) {
      std::uint64_t id = legacy_id_.load(std::memory_order_acquire);
      if (id == k_unknown_id) [[unlikely]] {
        id = special_stream_id(legacy_stream());
        legacy_id_.store(id, std::memory_order_release);  // racing threads store the same id
      }
      return {{}, id};
    }
    const capture_info capture = cuda_backend::capture_status(stream);
    if (capture.state != capture_state::none) return {capture, 0};
    if (device_ < 0 || device_ >= k_cached_devices) return {capture, special_stream_id(stream)};
    std::uint64_t& slot = t_per_thread_ids[static_cast<std::size_t>(device_)];
    if (slot == 0) [[unlikely]]
      slot = special_stream_id(stream) + 1;
    return {capture, slot - 1};
  }
  const capture_info capture = cuda_backend::capture_status(stream);
  if (capture.state != capture_state::none) return {capture, 0};
  return {capture, cuda_backend::stream_id(stream)};
}

capture_mode cuda_backend::exchange_capture_mode(capture_mode mode) {
  cudaStreamCaptureMode m = cudaStreamCaptureModeGlobal;
  if (mode == capture_mode::thread_local_mode) m = cudaStreamCaptureModeThreadLocal;
  if (mode == capture_mode::relaxed) m = cudaStreamCaptureModeRelaxed;
  detail::check_runtime(cudaThreadExchangeStreamCaptureMode(&m),
                        "cudaThreadExchangeStreamCaptureMode");
  if (m == cudaStreamCaptureModeThreadLocal) return capture_mode::thread_local_mode;
  if (m == cudaStreamCaptureModeRelaxed) return capture_mode::relaxed;
  return capture_mode::global;
}

memory_info cuda_backend::mem_get_info() {
  const detail::device_guard guard(device_);
  memory_info info;
  detail::check_runtime(cudaMemGetInfo(&info.free_bytes, &info.total_bytes), "cudaMemGetInfo");
  return info;
}

// --- host copies (sleep with keepContents) ------------------------------------------------------

void* cuda_backend::host_alloc_pinned(std::size_t bytes) {
  const detail::device_guard guard(device_);
  void* p = nullptr;
  const cudaError_t code = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
  if (code == cudaErrorMemoryAllocation) {
    detail::clear_expected_error(code);
    return nullptr;
  }
  detail::check_runtime(code, "cudaHostAlloc");
  return p;
}

void cuda_backend::host_free_pinned(void* ptr) {
  const detail::device_guard guard(device_);
  detail::check_runtime(cudaFreeHost(ptr), "cudaFreeHost");
}

void cuda_backend::copy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream) {
  const detail::device_guard guard(device_);
  detail::check_runtime(
      cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, detail::as_stream(stream)),
      "cudaMemcpyAsync");
}

}  // namespace cucache
