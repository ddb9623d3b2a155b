// The C API (cucache.h) over the C++ one (cucache.hpp): every function catches everything and
// answers with the CUDA runtime's error code, keeping the text for cucacheGetLastErrorMessage.
#include "cucache/cucache.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "api/c_boundary.hpp"
#include "api/registry.hpp"
#include "cucache/cucache.hpp"
#include "cucache/errors.hpp"
#include "cucache/stats.hpp"

namespace {

using cucache::detail::guarded;
using cucache::detail::null_argument;

cudaError_t allocate(const char* function, void** devPtr, size_t size,
                     cudaStream_t stream) noexcept {
  if (devPtr == nullptr) return null_argument(function, "devPtr");
  *devPtr = nullptr;
  return guarded(function, [&] { *devPtr = cucache::malloc(size, stream); });
}

// snprintf-style copy of the text `make` returns: the whole length, 0 on failure.
template <class F>
size_t copy_text(const char* function, char* buf, size_t len, F&& make) noexcept {
  if (buf == nullptr && len != 0) {
    null_argument(function, "buf (with len > 0)");
    return 0;
  }
  std::string text;
  if (guarded(function, [&] { text = make(); }) != cudaSuccess) return 0;
  if (len != 0) {
    const std::size_t n = std::min(len - 1, text.size());
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
  return text.size();
}

size_t as_size(std::int64_t v) noexcept {
  return v > 0 ? static_cast<size_t>(v) : 0;
}

// cucacheStats from the field table (cucache/stats.hpp): a fixed subset of device_stats, in the
// order and with the names of cucache.h. X(C field, C type, value from device_stats s).
constexpr auto k_all = static_cast<std::size_t>(cucache::stat_pool::all);
#define CUCACHE_C_STATS(X)                                               \
  X(allocatedBytes, size_t, as_size(s.allocated_bytes[k_all].current))   \
  X(allocatedBytesPeak, size_t, as_size(s.allocated_bytes[k_all].peak))  \
  X(reservedBytes, size_t, as_size(s.reserved_bytes[k_all].current))     \
  X(reservedBytesPeak, size_t, as_size(s.reserved_bytes[k_all].peak))    \
  X(activeBytes, size_t, as_size(s.active_bytes[k_all].current))         \
  X(activeBytesPeak, size_t, as_size(s.active_bytes[k_all].peak))        \
  X(requestedBytes, size_t, as_size(s.requested_bytes[k_all].current))   \
  X(requestedBytesPeak, size_t, as_size(s.requested_bytes[k_all].peak))  \
  X(cachedFreeBytes, size_t, s.free_bytes)                               \
  X(largestFreeBlock, size_t, s.largest_free_block)                      \
  X(allocationCount, size_t, as_size(s.allocation_count[k_all].current)) \
  X(segmentCount, size_t, as_size(s.segment_count[k_all].current))       \
  X(deviceAllocCount, unsigned long long, s.device_alloc_count)          \
  X(deviceFreeCount, unsigned long long, s.device_free_count)            \
  X(oomCount, unsigned long long, s.oom_count)                           \
  X(allocRetryCount, unsigned long long, s.alloc_retry_count)            \
  X(externalFragmentation, double, s.external_fragmentation())           \
  X(overheadFragmentation, double, s.overhead_fragmentation())           \
  X(memoryLimit, size_t, s.memory_limit)                                 \
  X(deviceTotalBytes, size_t, s.device_total_bytes)                      \
  X(sleepingBytes, size_t, s.sleeping_bytes)                             \
  X(sleepingHostBytes, size_t, s.sleeping_host_bytes)

cucacheStats to_c(const cucache::device_stats& s) noexcept {
  cucacheStats out{};
#define CUCACHE_C_FILL_(field, type, value) out.field = static_cast<type>(value);
  CUCACHE_C_STATS(CUCACHE_C_FILL_)
#undef CUCACHE_C_FILL_
  return out;
}

// The list is cucache.h's struct, field for field: same names, types and order, no field left
// out (each field starts where the one before it ends, and the last ends the struct).
#define CUCACHE_C_TYPE_(field, type, value) \
  static_assert(std::is_same_v<decltype(cucacheStats::field), type>, #field);
CUCACHE_C_STATS(CUCACHE_C_TYPE_)
#undef CUCACHE_C_TYPE_
constexpr bool c_layout_matches() {
  std::size_t end = 0;
#define CUCACHE_C_OFFSET_(field, type, value)                                                     \
  if (offsetof(cucacheStats, field) != (end + alignof(type) - 1) / alignof(type) * alignof(type)) \
    return false;                                                                                 \
  end = offsetof(cucacheStats, field) + sizeof(type);
  CUCACHE_C_STATS(CUCACHE_C_OFFSET_)
#undef CUCACHE_C_OFFSET_
  return (end + alignof(cucacheStats) - 1) / alignof(cucacheStats) * alignof(cucacheStats) ==
         sizeof(cucacheStats);
}
static_assert(c_layout_matches(),
              "CUCACHE_C_STATS and cucacheStats (cucache.h) have drifted apart");

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
    const cucacheStats out = to_c(cucache::get(device).stats());
    *stats = out;
  });
}

cudaError_t cucacheResetPeakStats(int device) noexcept {
  return guarded("cucacheResetPeakStats", [&] { cucache::get(device).reset_peak_stats(); });
}

size_t cucacheMemorySummary(int device, char* buf, size_t len) noexcept {
  return copy_text("cucacheMemorySummary", buf, len,
                   [&] { return cucache::memory_summary(device); });
}

cudaError_t cucacheSnapshot(const char* path) noexcept {
  if (path == nullptr) return null_argument("cucacheSnapshot", "path");
  return guarded("cucacheSnapshot", [&] { cucache::write_snapshot(path); });
}

cudaError_t cucacheStepMarker(void) noexcept {
  return guarded("cucacheStepMarker", [] { cucache::mark_step(); });
}

size_t cucacheLeakReport(unsigned long long steps, char* buf, size_t len) noexcept {
  return copy_text("cucacheLeakReport", buf, len,
                   [&] { return cucache::leak_report_json(steps); });
}

cudaError_t cucachePushTag(const char* tag) noexcept {
  if (tag == nullptr) return null_argument("cucachePushTag", "tag");
  return guarded("cucachePushTag", [&] { cucache::push_tag(tag); });
}

cudaError_t cucachePopTag(void) noexcept {
  return guarded("cucachePopTag", [] { cucache::pop_tag(); });
}

cudaError_t cucacheGetTagStats(int device, const char* tag, size_t* currentBytes,
                               size_t* peakBytes) noexcept {
  if (tag == nullptr) return null_argument("cucacheGetTagStats", "tag");
  if (currentBytes == nullptr) return null_argument("cucacheGetTagStats", "currentBytes");
  if (peakBytes == nullptr) return null_argument("cucacheGetTagStats", "peakBytes");
  return guarded("cucacheGetTagStats", [&] {
    const cucache::tag_stat t = cucache::tag_stats(device, tag);
    *currentBytes = t.current_bytes;
    *peakBytes = t.peak_bytes;
  });
}

cudaError_t cucacheSetTagLimit(int device, const char* tag, size_t bytes) noexcept {
  if (tag == nullptr) return null_argument("cucacheSetTagLimit", "tag");
  return guarded("cucacheSetTagLimit", [&] { cucache::set_tag_limit(device, tag, bytes); });
}

cudaError_t cucacheGetTagLimit(int device, const char* tag, size_t* bytes) noexcept {
  if (tag == nullptr) return null_argument("cucacheGetTagLimit", "tag");
  if (bytes == nullptr) return null_argument("cucacheGetTagLimit", "bytes");
  return guarded("cucacheGetTagLimit", [&] { *bytes = cucache::tag_limit(device, tag); });
}

cudaError_t cucacheWriteMetrics(char* buf, size_t size, size_t* needed) noexcept {
  if (needed == nullptr) return null_argument("cucacheWriteMetrics", "needed");
  if (buf == nullptr && size != 0) return null_argument("cucacheWriteMetrics", "buf (with size > 0)");
  return guarded("cucacheWriteMetrics", [&] {
    const std::string text = cucache::metrics();
    *needed = text.size() + 1;
    if (size >= text.size() + 1) {
      std::memcpy(buf, text.data(), text.size());
      buf[text.size()] = '\0';
      return;
    }
    if (size != 0) buf[0] = '\0';
    if (buf == nullptr) return;  // a size query
    throw cucache::invalid_argument(
        "a buffer of " + std::to_string(size) + " bytes is too small: the metrics need " +
        std::to_string(text.size() + 1) + " (call with buf NULL and size 0 to ask)");
  });
}

cudaError_t cucacheMakeTagSleepable(const char* tag) noexcept {
  if (tag == nullptr) return null_argument("cucacheMakeTagSleepable", "tag");
  return guarded("cucacheMakeTagSleepable", [&] { cucache::make_sleepable(tag); });
}

cudaError_t cucacheSleep(int device, const char* tag, int keepContents) noexcept {
  if (tag == nullptr) return null_argument("cucacheSleep", "tag");
  return guarded("cucacheSleep", [&] { cucache::sleep(device, tag, keepContents != 0); });
}

cudaError_t cucacheSleepTags(int device, const char* const* tags, const int* keepContents,
                             size_t count) noexcept {
  if (tags == nullptr) return null_argument("cucacheSleepTags", "tags");
  if (keepContents == nullptr) return null_argument("cucacheSleepTags", "keepContents");
  return guarded("cucacheSleepTags", [&] {
    std::vector<cucache::tag_sleep_request> requests;
    requests.reserve(count);
    for (std::size_t i = 0; i < count; ++i) {
      if (tags[i] == nullptr) {
        throw cucache::invalid_argument("tags[" + std::to_string(i) +
                                        "] is NULL; nothing changed");
      }
      requests.push_back({tags[i], keepContents[i] != 0});
    }
    cucache::sleep(device, requests);
  });
}

cudaError_t cucacheWakeTags(int device, const char* const* tags, size_t count) noexcept {
  if (tags == nullptr) return null_argument("cucacheWakeTags", "tags");
  return guarded("cucacheWakeTags", [&] {
    std::vector<std::string_view> names;
    names.reserve(count);
    for (std::size_t i = 0; i < count; ++i) {
      if (tags[i] == nullptr) {
        throw cucache::invalid_argument("tags[" + std::to_string(i) +
                                        "] is NULL; nothing changed");
      }
      names.emplace_back(tags[i]);
    }
    cucache::wake(device, names);
  });
}

cudaError_t cucacheSleepPrepare(int device, const char* tag, size_t bytes,
                                size_t* pinnedBytes) noexcept {
  if (tag == nullptr) return null_argument("cucacheSleepPrepare", "tag");
  return guarded("cucacheSleepPrepare", [&] {
    const std::size_t n = cucache::prepare_sleep(device, tag, bytes);
    if (pinnedBytes != nullptr) *pinnedBytes = n;
  });
}

cudaError_t cucacheWake(int device, const char* tag) noexcept {
  if (tag == nullptr) return null_argument("cucacheWake", "tag");
  return guarded("cucacheWake", [&] { cucache::wake(device, tag); });
}

cudaError_t cucacheGetSleepingBytes(int device, const char* tag, size_t* deviceBytes,
                                    size_t* hostBytes) noexcept {
  if (tag == nullptr) return null_argument("cucacheGetSleepingBytes", "tag");
  if (deviceBytes == nullptr) return null_argument("cucacheGetSleepingBytes", "deviceBytes");
  if (hostBytes == nullptr) return null_argument("cucacheGetSleepingBytes", "hostBytes");
  return guarded("cucacheGetSleepingBytes", [&] {
    *deviceBytes = 0;
    *hostBytes = 0;
    for (const cucache::sleep_stat& st : cucache::sleeping(device)) {
      if (st.tag != tag) continue;
      *deviceBytes = st.bytes;
      *hostBytes = st.host_bytes;
    }
  });
}

const char* cucacheGetLastErrorMessage(void) noexcept {
  return cucache::detail::thread_last_error();
}

}  // extern "C"
