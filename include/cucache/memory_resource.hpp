// cucache as a CCCL memory resource (cuda::mr, <cuda/memory_resource> of the CUDA toolkit): a
// cucache::memory_resource satisfies cuda::mr's resource concepts with the device_accessible
// property, so it is usable through cuda::mr::resource_ref and any_resource, the interface RAPIDS
// RMM's current versions consume. See docs/api.md#cudamr-cucachememory_resourcehpp.
//
// This header needs CCCL's headers (CUDA 13: <toolkit>/include/cccl, which nvcc searches itself;
// a host compiler needs it on the include path) and compiles as C++17: cucache's C++20 parts stay
// in the library.
#pragma once

#include <cuda/version>

// CCCL 3.0 and older hide the memory-resource interface behind this macro (it was
// "experimental"); 3.1 and later ignore it. It must be seen before CCCL's memory-resource headers
// are first included, which a header included earlier may already have done without it.
#if !defined(LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE)
#if CCCL_MAJOR_VERSION < 3 || (CCCL_MAJOR_VERSION == 3 && CCCL_MINOR_VERSION < 1)
#if defined(_CUDA_MEMORY_RESOURCE) || defined(_CUDA__MEMORY_RESOURCE_RESOURCE_H)
#error \
    "cucache/memory_resource.hpp: <cuda/memory_resource> was included before it without LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE (CCCL < 3.1 needs it): include cucache/memory_resource.hpp first or define the macro for the whole target"
#endif
#endif
#define LIBCUDACXX_ENABLE_EXPERIMENTAL_MEMORY_RESOURCE
#endif

#include <cuda/memory_resource>
#include <cuda/stream_ref>

#include <cstddef>

#include "cucache/aligned.hpp"
#include "cucache/backend.hpp"

namespace cucache {

class device_allocator;
// The global allocators, as declared in cucache/cucache.hpp (which needs C++20; this header does
// not).
[[nodiscard]] device_allocator& get(int device);
[[nodiscard]] device_allocator& get();

/// A cuda::mr memory resource over one cucache device_allocator: by default the global allocator
/// of the current device (the one cucache::malloc and cucacheMalloc use), or of a given device,
/// or any allocator you own. Copies are cheap (one pointer) and compare equal when they use the
/// same allocator: memory from one may be deallocated through any equal one.
///
/// It has both generations of CCCL's member names, so it satisfies the concepts of the toolkit's
/// CCCL whichever it is:
///   CCCL >= 3.1: cuda::mr::synchronous_resource (allocate_sync, deallocate_sync) and
///                cuda::mr::resource (allocate(stream, ...), deallocate(stream, ...));
///   CCCL <= 3.0: cuda::mr::resource (allocate, deallocate) and cuda::mr::async_resource
///                (allocate_async, deallocate_async).
/// The property is cuda::mr::device_accessible.
///
/// Alignment: any power of two. cucache's blocks are 512-B aligned; a larger alignment is honoured
/// by over-allocating (by alignment - 512 B), and any other value throws invalid_argument naming
/// it. Synchronous allocations come from the legacy default stream's pool, as cucacheMalloc's
/// (nothing synchronizes); stream-ordered ones from the stream's pool, and a stream-ordered
/// deallocate is ordered after the work queued on that stream, as cudaFreeAsync. Deallocating a
/// pointer that this resource's allocator did not hand out throws invalid_argument and changes
/// nothing (through CCCL's noexcept wrappers that terminates the program, as a bad free does).
class memory_resource {
 public:
  /// The alignment every cucache block has.
  static constexpr std::size_t native_alignment = k_block_alignment;
  /// The alignment used when none is given (cudaMalloc's guarantee, as CCCL's own resources).
  static constexpr std::size_t default_alignment = 256;

  /// The global allocator of the current device, chosen now (as cucache::get()). Throws what
  /// cucache::get throws (e.g. environment_error on a bad CUCACHE_BACKEND or CUCACHE_CONF).
  memory_resource() : alloc_(&cucache::get()) {}
  /// The global allocator of `device` (as cucache::get(device)).
  explicit memory_resource(int device) : alloc_(&cucache::get(device)) {}
  /// An allocator you own; it must outlive the resource and every allocation from it.
  explicit memory_resource(device_allocator& allocator) noexcept : alloc_(&allocator) {}

  // --- Stream-ordered (CCCL >= 3.1: cuda::mr::resource) -----------------------------------------
  [[nodiscard]] void* allocate(::cuda::stream_ref stream, std::size_t bytes,
                               std::size_t alignment = default_alignment) {
    return allocate_aligned(*alloc_, bytes, alignment, stream.get());
  }
  void deallocate(::cuda::stream_ref stream, void* ptr, std::size_t /*bytes*/,
                  std::size_t /*alignment*/ = default_alignment) {
    deallocate_aligned(*alloc_, ptr, stream.get(), true);
  }

  // --- Synchronous (CCCL >= 3.1: cuda::mr::synchronous_resource) -----------------------------
  [[nodiscard]] void* allocate_sync(std::size_t bytes, std::size_t alignment = default_alignment) {
    return allocate_aligned(*alloc_, bytes, alignment, nullptr);
  }
  void deallocate_sync(void* ptr, std::size_t /*bytes*/,
                       std::size_t /*alignment*/ = default_alignment) {
    deallocate_aligned(*alloc_, ptr, nullptr, false);
  }

  // --- The same under CCCL <= 3.0's names (cuda::mr::resource, cuda::mr::async_resource) ------
  [[nodiscard]] void* allocate(std::size_t bytes, std::size_t alignment = default_alignment) {
    return allocate_sync(bytes, alignment);
  }
  void deallocate(void* ptr, std::size_t bytes, std::size_t alignment = default_alignment) {
    deallocate_sync(ptr, bytes, alignment);
  }
  [[nodiscard]] void* allocate_async(std::size_t bytes, std::size_t alignment,
                                     ::cuda::stream_ref stream) {
    return allocate(stream, bytes, alignment);
  }
  [[nodiscard]] void* allocate_async(std::size_t bytes, ::cuda::stream_ref stream) {
    return allocate(stream, bytes, default_alignment);
  }
  void deallocate_async(void* ptr, std::size_t bytes, std::size_t alignment,
                        ::cuda::stream_ref stream) {
    deallocate(stream, ptr, bytes, alignment);
  }
  void deallocate_async(void* ptr, std::size_t bytes, ::cuda::stream_ref stream) {
    deallocate(stream, ptr, bytes, default_alignment);
  }

  /// The allocator this resource allocates from (for statistics: allocator().stats()).
  [[nodiscard]] device_allocator& allocator() const noexcept { return *alloc_; }

  friend bool operator==(const memory_resource& a, const memory_resource& b) noexcept {
    return a.alloc_ == b.alloc_;
  }
  friend bool operator!=(const memory_resource& a, const memory_resource& b) noexcept {
    return a.alloc_ != b.alloc_;
  }
  /// Memory from cucache is device memory.
  friend constexpr void get_property(const memory_resource&,
                                     ::cuda::mr::device_accessible) noexcept {}

 private:
  device_allocator* alloc_;
};

}  // namespace cucache
