// cudaMalloc and cudaMallocAsync as the tools drive them (device_peers.hpp).
#include "common/device_peers.hpp"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>

#include "common/cuda_check.hpp"

namespace cucache::tools {
namespace {

cudaMemPool_t as_pool(void* p) {
  return static_cast<cudaMemPool_t>(p);
}

}  // namespace

void* cuda_malloc_device::allocate(std::size_t bytes) {
  void* p = nullptr;
  if (!check_cuda_expecting(cudaMalloc(&p, bytes), cudaErrorMemoryAllocation, "cudaMalloc")) {
    return nullptr;
  }
  return p;
}

void cuda_malloc_device::deallocate(void* ptr) {
  check_cuda(cudaFree(ptr), "cudaFree");
}

cuda_async_pool::cuda_async_pool(int device, std::size_t max_bytes) {
  cudaMemPoolProps props{};
  props.allocType = cudaMemAllocationTypePinned;
  props.handleTypes = cudaMemHandleTypeNone;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  props.maxSize = max_bytes;
  cudaMemPool_t pool = nullptr;
  check_cuda(cudaMemPoolCreate(&pool, &props), "cudaMemPoolCreate");
  std::uint64_t threshold = std::numeric_limits<std::uint64_t>::max();
  if (const cudaError_t e =
          cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold);
      e != cudaSuccess) {
    static_cast<void>(cudaMemPoolDestroy(pool));
    check_cuda(e, "cudaMemPoolSetAttribute(cudaMemPoolAttrReleaseThreshold)");
  }
  pool_ = pool;
}

cuda_async_pool::~cuda_async_pool() {
  // A destructor cannot report a failure; the pool's memory is returned by the destroy either way.
  static_cast<void>(cudaDeviceSynchronize());
  static_cast<void>(cudaMemPoolDestroy(as_pool(pool_)));
}

void* cuda_async_pool::allocate(std::size_t bytes, stream_handle stream) {
  void* p = nullptr;
  if (!check_cuda_expecting(
          cudaMallocFromPoolAsync(&p, bytes, as_pool(pool_), static_cast<cudaStream_t>(stream)),
          cudaErrorMemoryAllocation, "cudaMallocFromPoolAsync")) {
    return nullptr;
  }
  return p;
}

void cuda_async_pool::deallocate(void* ptr, stream_handle stream) {
  check_cuda(cudaFreeAsync(ptr, static_cast<cudaStream_t>(stream)), "cudaFreeAsync");
}

std::size_t cuda_async_pool::reserved_high() const {
  std::uint64_t high = 0;
  check_cuda(cudaMemPoolGetAttribute(as_pool(pool_), cudaMemPoolAttrReservedMemHigh, &high),
             "cudaMemPoolGetAttribute(cudaMemPoolAttrReservedMemHigh)");
  return static_cast<std::size_t>(high);
}

}  // namespace cucache::tools
