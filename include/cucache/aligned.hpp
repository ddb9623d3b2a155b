// Allocations aligned beyond cucache's own 512 B, from any device_allocator. C++17-clean (it only
// names device_allocator), so headers for nvcc's default standard can build on it
// (cucache/memory_resource.hpp does).
#pragma once

#include <cstddef>

#include "cucache/backend.hpp"

namespace cucache {

class device_allocator;

/// The alignment of every block cucache hands out.
inline constexpr std::size_t k_block_alignment = 512;

/// Allocates `bytes` aligned to `alignment` (a power of two) for use on `stream`. Up to
/// k_block_alignment this is alloc.allocate(bytes, stream); above, the block is over-allocated by
/// alignment - 512 B and the aligned pointer inside it is remembered, so that deallocate_aligned
/// returns the whole block (statistics count the whole block). bytes == 0 returns nullptr.
/// Throws invalid_argument naming the alignment when it is not a power of two, and what
/// device_allocator::allocate throws (out_of_memory, cuda_error).
[[nodiscard]] void* allocate_aligned(device_allocator& alloc, std::size_t bytes,
                                     std::size_t alignment, stream_handle stream = nullptr);

/// Frees memory from allocate_aligned(alloc, ...) of any alignment (and anything else `alloc`
/// handed out): in the order of `stream` when `ordered` (device_allocator::deallocate(ptr,
/// stream)), else as device_allocator::deallocate(ptr). nullptr is a no-op. Throws
/// invalid_argument for a pointer that is not one `alloc` handed out, changing nothing.
/// Over-aligned allocations must be freed before their allocator is destroyed.
void deallocate_aligned(device_allocator& alloc, void* ptr, stream_handle stream = nullptr,
                        bool ordered = false);

}  // namespace cucache
