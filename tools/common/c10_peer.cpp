// libcucache_c10_peer.so: PyTorch's CUDA caching allocator behind the C interface of c10_peer.h,
// so cucache-replay can replay traces through it without linking PyTorch. Built by CMake when a
// torch installation is found, or on any machine with torch by tools/build_c10_peer.sh.
#include "c10_peer.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/Exception.h>
#if __has_include(<c10/core/AllocatorConfig.h>)
#include <c10/core/AllocatorConfig.h>
#endif

#include <cstring>
#include <exception>
#include <string>

namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;

thread_local std::string t_last_error;

int fail(const char* what, const std::exception& e) {
  t_last_error = std::string(what) + ": " + e.what();
  return 1;
}

void apply_settings(const std::string& conf) {
#if __has_include(<c10/core/AllocatorConfig.h>)
  // PyTorch >= 2.9: one parser for every accelerator, which forwards CUDA's own keys to CUDA's.
  c10::CachingAllocator::setAllocatorSettings(conf);
#else
  alloc::setAllocatorSettings(conf);
#endif
}

}  // namespace

extern "C" {

int cucache_peer_c10_abi(void) {
  return CUCACHE_C10_PEER_ABI;
}

int cucache_peer_c10_init(const char* conf) {
  try {
    // c10 reads PYTORCH_ALLOC_CONF (or its older name PYTORCH_CUDA_ALLOC_CONF) when the library
    // loads; the replay sets both before dlopen.
    // Applying the string again covers a caller that did not.
    if (conf != nullptr && conf[0] != '\0') apply_settings(conf);
    // Python does this in torch.cuda's lazy init; from C++ nobody else will, and an allocator
    // without per-device state refuses every request.
    alloc::init(static_cast<int>(c10::cuda::device_count()));
    return 0;
  } catch (const std::exception& e) {
    return fail("init", e);
  }
}

void* cucache_peer_c10_alloc(size_t bytes, void* stream) {
  try {
    return alloc::raw_alloc_with_stream(bytes, static_cast<cudaStream_t>(stream));
  } catch (const c10::OutOfMemoryError& e) {
    fail("raw_alloc_with_stream (out of memory)", e);
    return nullptr;
  } catch (const std::exception& e) {
    fail("raw_alloc_with_stream", e);
    return nullptr;
  }
}

void cucache_peer_c10_free(void* ptr) {
  try {
    alloc::raw_delete(ptr);
  } catch (const std::exception& e) {
    fail("raw_delete", e);
  }
}

int cucache_peer_c10_set_memory_fraction(double fraction) {
  try {
    alloc::setMemoryFraction(fraction, 0);
    return 0;
  } catch (const std::exception& e) {
    return fail("setMemoryFraction", e);
  }
}

int cucache_peer_c10_stats(cucache_c10_stats* out) {
  try {
    const auto s = alloc::getDeviceStats(0);
    out->reserved_bytes = s.reserved_bytes[0].current;
    out->peak_reserved_bytes = s.reserved_bytes[0].peak;
    out->allocated_bytes = s.allocated_bytes[0].current;
    out->peak_allocated_bytes = s.allocated_bytes[0].peak;
    out->peak_requested_bytes = s.requested_bytes[0].peak;
    out->num_device_alloc = s.num_device_alloc;
    out->num_device_free = s.num_device_free;
    out->num_alloc_retries = s.num_alloc_retries;
    out->num_ooms = s.num_ooms;
    return 0;
  } catch (const std::exception& e) {
    return fail("getDeviceStats", e);
  }
}

int cucache_peer_c10_reset(void) {
  try {
    alloc::emptyCache();
    alloc::resetPeakStats(0);
    alloc::resetAccumulatedStats(0);
    return 0;
  } catch (const std::exception& e) {
    return fail("reset", e);
  }
}

const char* cucache_peer_c10_last_error(void) {
  return t_last_error.c_str();
}

}  // extern "C"
