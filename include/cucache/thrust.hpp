// cucache for Thrust and CUB: an allocator for Thrust's CUDA execution policy, so that an
// algorithm's temporary storage comes from cucache's cache instead of cudaMalloc/cudaFree on
// every call,
//
//   cucache::thrust_allocator alloc(stream);
//   thrust::sort(thrust::cuda::par(alloc).on(stream), keys, keys + n);
//
// and a helper that runs a CUB device-wide algorithm with its temporary storage from cucache,
//
//   cudaError_t err = cucache::with_temp_storage(stream, [&](void* temp, std::size_t& bytes) {
//     return cub::DeviceRadixSort::SortKeys(temp, bytes, in, out, n, 0, 32, stream);
//   });
//
// Both go through the C API (cucache.h: the current device's global allocator, configured by
// CUCACHE_CONF). This header includes no Thrust or CUB header and compiles as C++14, so nvcc's
// default standard compiles it. See docs/api.md#thrust-and-cub-cucachethrusthpp.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "cucache/cucache.h"
#include "cucache/errors.hpp"

namespace cucache {

namespace detail {
/// Throws what the C++ API would for a failed cucache C call: out_of_memory (a std::bad_alloc,
/// what() = the out-of-memory report) for cudaErrorMemoryAllocation, cuda_error naming `call`
/// otherwise.
[[noreturn]] inline void throw_c_api_error(const char* call, cudaError_t err) {
  if (err == cudaErrorMemoryAllocation) throw out_of_memory(cucacheGetLastErrorMessage());
  throw cuda_error(call, static_cast<int>(err), cucacheGetLastErrorMessage());
}
}  // namespace detail

/// An allocator of bytes from cucache, in the order of one stream: what Thrust's execution
/// policies take (thrust::cuda::par(alloc), thrust::cuda::par_nosync(alloc)) for an algorithm's
/// temporary storage, and usable wherever a byte allocator with Thrust's allocator shape is.
///
/// Give it the stream the policy runs on (`.on(stream)`): Thrust does not tell its allocator the
/// stream, and the storage must be allocated and freed in that stream's order (freed storage is
/// reused by later work on the same stream only). The default stream when none is given.
/// Copies are equal when they use the same stream: memory from one may be freed through another.
class thrust_allocator {
 public:
  using value_type = char;
  using pointer = char*;
  using size_type = std::size_t;
  using difference_type = std::ptrdiff_t;

  thrust_allocator() noexcept = default;
  explicit thrust_allocator(cudaStream_t stream) noexcept : stream_(stream) {}

  /// `bytes` from cucache on the allocator's stream (cucacheMallocAsync); nullptr for 0. Throws
  /// out_of_memory (a std::bad_alloc) when the device is full, cuda_error on any other failure.
  [[nodiscard]] char* allocate(std::size_t bytes) {
    void* p = nullptr;
    const cudaError_t err = cucacheMallocAsync(&p, bytes, stream_);
    if (err != cudaSuccess) detail::throw_c_api_error("cucacheMallocAsync", err);
    return static_cast<char*>(p);
  }
  /// Frees in the order of the allocator's stream (cucacheFreeAsync). nullptr is a no-op. A
  /// pointer cucache did not hand out terminates the program (Thrust frees from destructors), as
  /// a bad free does.
  void deallocate(char* p, std::size_t /*bytes*/) noexcept {
    const cudaError_t err = cucacheFreeAsync(p, stream_);
    if (err != cudaSuccess)
      detail::throw_c_api_error("cucacheFreeAsync", err);  // noexcept: terminates
  }

  [[nodiscard]] cudaStream_t stream() const noexcept { return stream_; }

  friend bool operator==(const thrust_allocator& a, const thrust_allocator& b) noexcept {
    return a.stream_ == b.stream_;
  }
  friend bool operator!=(const thrust_allocator& a, const thrust_allocator& b) noexcept {
    return a.stream_ != b.stream_;
  }

 private:
  cudaStream_t stream_ = nullptr;
};

/// Runs a CUB device-wide algorithm with its temporary storage from cucache. `f(void* temp,
/// std::size_t& temp_bytes)` calls the algorithm, CUB-style: it is called first with temp ==
/// nullptr to learn the size, then with storage of that size (at least one byte, so that CUB
/// never mistakes it for a size query), allocated from cucache on `stream` and freed in the
/// order of `stream` right after (once the algorithm has queued its work; no synchronization).
/// Returns the first error: f's, or cucache's (cudaErrorMemoryAllocation, ...: see
/// cucacheGetLastErrorMessage()). The storage is freed also when f throws.
template <class F>
cudaError_t with_temp_storage(cudaStream_t stream, F&& f) {
  std::size_t bytes = 0;
  cudaError_t err = f(static_cast<void*>(nullptr), bytes);
  if (err != cudaSuccess) return err;
  void* temp = nullptr;
  err = cucacheMallocAsync(&temp, bytes == 0 ? 1 : bytes, stream);
  if (err != cudaSuccess) return err;
  struct release {  // frees the storage also when f throws
    void* p;
    cudaStream_t s;
    cudaError_t& result;
    ~release() {
      const cudaError_t freed = cucacheFreeAsync(p, s);
      if (result == cudaSuccess) result = freed;
    }
  };
  cudaError_t ran = cudaSuccess;
  {
    release guard{temp, stream, ran};
    ran = std::forward<F>(f)(temp, bytes);
  }
  return ran;
}

}  // namespace cucache
