// The CUDA allocators cucache is compared against, as the replay and the benchmark both drive
// them: cudaMalloc/cudaFree (no cache, the floor) and CUDA's stream-ordered allocator on a pool of
// its own. Both act on the calling thread's current device. Out of memory is a null pointer (the
// runtime's error cleared); every other failure throws cucache::cuda_error.
#pragma once

#include <cstddef>

#include "cucache/backend.hpp"

namespace cucache::tools {

/// cudaMalloc / cudaFree.
class cuda_malloc_device {
 public:
  /// nullptr when the device is out of memory.
  [[nodiscard]] void* allocate(std::size_t bytes);
  void deallocate(void* ptr);
};

/// cudaMallocFromPoolAsync / cudaFreeAsync on a fresh pool of device `device`, whose release
/// threshold is UINT64_MAX: it keeps what it has, as a caching allocator does (the default
/// threshold 0 trims the pool at every synchronization). The destructor synchronizes the device
/// and destroys the pool.
class cuda_async_pool {
 public:
  /// `max_bytes` becomes cudaMemPoolProps::maxSize, the most the pool may reserve; 0 is the
  /// driver's default (no cap).
  explicit cuda_async_pool(int device, std::size_t max_bytes = 0);
  ~cuda_async_pool();
  cuda_async_pool(const cuda_async_pool&) = delete;
  cuda_async_pool& operator=(const cuda_async_pool&) = delete;

  /// nullptr when the pool or the device is out of memory.
  [[nodiscard]] void* allocate(std::size_t bytes, stream_handle stream);
  /// Frees on `stream`: reuse then follows that stream's order, as cudaFreeAsync promises.
  void deallocate(void* ptr, stream_handle stream);
  /// cudaMemPoolAttrReservedMemHigh: the most the pool has reserved since it was made.
  [[nodiscard]] std::size_t reserved_high() const;

 private:
  void* pool_ = nullptr;  // cudaMemPool_t
};

}  // namespace cucache::tools
