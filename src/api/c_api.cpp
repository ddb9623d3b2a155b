// The C API (cucache.h) over the C++ one (cucache.hpp): every function catches everything and
// answers with the CUDA runtime's error code, keeping the text for cucacheGetLastErrorMessage.
#include "cucache/cucache.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <string_view>

#include "api/registry.hpp"
#include "cucache/cucache.hpp"
#include "cucache/errors.hpp"
#include "cucache/stats.hpp"

namespace {

using cucache::detail::error_code_of_current_exception;
using cucache::detail::set_last_error;

// Runs f, translating every exception into the runtime's vocabulary (registry.hpp).
template <class F>
cudaError_t guarded(const char* function, F&& f) noexcept {
  try {
    f();
    return cudaSuccess;
  } catch (...) {
    return static_cast<cudaError_t>(error_code_of_current_exception(function));
  }
}

cudaError_t null_argument(const char* function, const char* name) noexcept {
  try {
    set_last_error(std::string(function) + ": " + name + " is NULL");
  } catch (...) {
    set_last_error("");
  }
  return cudaErrorInvalidValue;
}

cudaError_t allocate(const char* function, void** devPtr, size_t size,
                     cudaStream_t stream) noexcept {
  if (devPtr == nullptr) return null_argument(function, "devPtr");
  *devPtr = nullptr;
  return guarded(function, [&] { *devPtr = cucache::malloc(size, stream); });
}

size_t as_size(std::int64_t v) noexcept {
  return v > 0 ? static_cast<size_t>(v) : 0;
}

}  // namespace

extern "C" {

cudaError_t cucacheMalloc(void** devPtr, size_t size) noexcept {
  return allocate("cucacheMalloc", devPtr, size, nullptr);
}

cudaError_t cucacheMallocAsync(void** devPtr, size_t size, cudaStream_t stream) noexcept {
  return allocate("cucacheMallocAsync", devPtr, size, stream);
}

cudaError_t cucacheFree(void* devPtr) noexcept {
  if (devPtr == nullptr) return cudaSuccess;
  return guarded("cucacheFree", [&] { cucache::free(devPtr); });
}

cudaError_t cucacheFreeAsync(void* devPtr, cudaStream_t stream) noexcept {
  if (devPtr == nullptr) return cudaSuccess;
  return guarded("cucacheFreeAsync", [&] { cucache::free_async(devPtr, stream); });
}

cudaError_t cucacheRecordStream(void* devPtr, cudaStream_t stream) noexcept {
  if (devPtr == nullptr) return null_argument("cucacheRecordStream", "devPtr");
  return guarded("cucacheRecordStream", [&] { cucache::record_stream(devPtr, stream); });
}

cudaError_t cucacheMemGetInfo(size_t* free, size_t* total) noexcept {
  if (free == nullptr) return null_argument("cucacheMemGetInfo", "free");
  if (total == nullptr) return null_argument("cucacheMemGetInfo", "total");
  return guarded("cucacheMemGetInfo", [&] {
    cucache::device_allocator& a = cucache::get();
    const cucache::memory_info device = a.backend().mem_get_info();
    const cucache::device_stats s = a.stats();
    std::size_t t = device.total_bytes;
    std::size_t f = device.free_bytes + s.free_bytes;
    if (s.memory_limit != 0) {
      // With a cap, what cucacheMalloc can still hand out is bounded by the cap, not the device.
      t = std::min(t, s.memory_limit);
      const std::size_t active = as_size(s.active_bytes[0].current);
      f = std::min(f, t > active ? t - active : 0);
    }
    *free = std::min(f, t);
    *total = t;
  });
}

cudaError_t cucacheEmptyCache(void) noexcept {
  return guarded("cucacheEmptyCache", [] { cucache::empty_cache(); });
}

cudaError_t cucacheMaxAllocatable(size_t* bytes) noexcept {
  if (bytes == nullptr) return null_argument("cucacheMaxAllocatable", "bytes");
  return guarded("cucacheMaxAllocatable", [&] { *bytes = cucache::max_allocatable(); });
}

cudaError_t cucacheReserve(size_t bytes) noexcept {
  return guarded("cucacheReserve", [&] { cucache::reserve(bytes); });
}

cudaError_t cucacheGraphCaptureEnded(unsigned long long captureId) noexcept {
  return guarded("cucacheGraphCaptureEnded", [&] {
    cucache::get().end_allocate_to_pool(cucache::graph_pool_id::of_capture(captureId));
  });
}

cudaError_t cucacheGraphPoolRelease(unsigned long long captureId) noexcept {
  return guarded("cucacheGraphPoolRelease", [&] {
    cucache::get().release_graph_pool(cucache::graph_pool_id::of_capture(captureId));
  });
}

cudaError_t cucacheGetStats(int device, cucacheStats* stats) noexcept {
  if (stats == nullptr) return null_argument("cucacheGetStats", "stats");
  return guarded("cucacheGetStats", [&] {
    const cucache::device_stats s = cucache::get(device).stats();
    constexpr auto all = static_cast<std::size_t>(cucache::stat_pool::all);
    cucacheStats out{};
    out.allocatedBytes = as_size(s.allocated_bytes[all].current);
    out.allocatedBytesPeak = as_size(s.allocated_bytes[all].peak);
    out.reservedBytes = as_size(s.reserved_bytes[all].current);
    out.reservedBytesPeak = as_size(s.reserved_bytes[all].peak);
    out.activeBytes = as_size(s.active_bytes[all].current);
    out.activeBytesPeak = as_size(s.active_bytes[all].peak);
    out.requestedBytes = as_size(s.requested_bytes[all].current);
    out.requestedBytesPeak = as_size(s.requested_bytes[all].peak);
    out.cachedFreeBytes = s.free_bytes;
    out.largestFreeBlock = s.largest_free_block;
    out.allocationCount = as_size(s.allocation_count[all].current);
    out.segmentCount = as_size(s.segment_count[all].current);
    out.deviceAllocCount = s.device_alloc_count;
    out.deviceFreeCount = s.device_free_count;
    out.oomCount = s.oom_count;
    out.allocRetryCount = s.alloc_retry_count;
    out.externalFragmentation = s.external_fragmentation();
    out.overheadFragmentation = s.overhead_fragmentation();
    out.memoryLimit = s.memory_limit;
    out.deviceTotalBytes = s.device_total_bytes;
    *stats = out;
  });
}

cudaError_t cucacheResetPeakStats(int device) noexcept {
  return guarded("cucacheResetPeakStats", [&] { cucache::get(device).reset_peak_stats(); });
}

size_t cucacheMemorySummary(int device, char* buf, size_t len) noexcept {
  if (buf == nullptr && len != 0) {
    null_argument("cucacheMemorySummary", "buf (with len > 0)");
    return 0;
  }
  std::string text;
  if (guarded("cucacheMemorySummary", [&] { text = cucache::memory_summary(device); }) !=
      cudaSuccess) {
    return 0;
  }
  if (len != 0) {
    const std::size_t n = std::min(len - 1, text.size());
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
  return text.size();
}

const char* cucacheGetLastErrorMessage(void) noexcept {
  return cucache::detail::thread_last_error();
}

}  // extern "C"
