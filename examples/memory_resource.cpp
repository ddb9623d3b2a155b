// cucache as a cuda::mr memory resource (CCCL, in the CUDA toolkit): what a library that takes a
// cuda::mr resource reference (as RMM's current versions do) gets from cucache. Runs on a GPU, or
// anywhere with CUCACHE_BACKEND=sim (no memory is touched).
#include <cucache/memory_resource.hpp>

#include <cstdint>
#include <cstdio>
#include <exception>

#include <cucache/cucache.hpp>

#if CCCL_MAJOR_VERSION > 3 || (CCCL_MAJOR_VERSION == 3 && CCCL_MINOR_VERSION >= 1)
// CCCL 3.1 and later: stream-ordered is the default interface.
using device_resource_ref = cuda::mr::resource_ref<cuda::mr::device_accessible>;
void* allocate(device_resource_ref r, cuda::stream_ref s, std::size_t bytes, std::size_t align) {
  return r.allocate(s, bytes, align);
}
void deallocate(device_resource_ref r, cuda::stream_ref s, void* p, std::size_t bytes,
                std::size_t align) {
  r.deallocate(s, p, bytes, align);
}
#else
// CCCL 3.0 (CUDA 13.0) and earlier: the stream-ordered interface is async_resource.
using device_resource_ref = cuda::mr::async_resource_ref<cuda::mr::device_accessible>;
void* allocate(device_resource_ref r, cuda::stream_ref s, std::size_t bytes, std::size_t align) {
  return r.allocate_async(bytes, align, s);
}
void deallocate(device_resource_ref r, cuda::stream_ref s, void* p, std::size_t bytes,
                std::size_t align) {
  r.deallocate_async(p, bytes, align, s);
}
#endif

// A library function that knows nothing of cucache: it takes any device-accessible resource.
static bool scratch_round(device_resource_ref mr, cuda::stream_ref stream) {
  bool aligned = true;
  for (std::size_t align : {256u, 4096u}) {
    void* p = allocate(mr, stream, std::size_t{1} << 20, align);
    aligned = aligned && reinterpret_cast<std::uintptr_t>(p) % align == 0;
    deallocate(mr, stream, p, std::size_t{1} << 20, align);
  }
  return aligned;
}

int main() {
  try {
    cucache::memory_resource mr;  // the current device's global allocator
    cuda::stream_ref stream{};    // the default stream
    bool ok = true;
    for (int i = 0; i < 4; ++i) ok = scratch_round(device_resource_ref{mr}, stream) && ok;
    const cucache::device_stats stats = mr.allocator().stats();
    std::printf("%s: 8 allocations through cuda::mr, %llu device allocations, %lld live\n",
                ok ? "ok" : "FAIL", static_cast<unsigned long long>(stats.device_alloc_count),
                static_cast<long long>(stats.allocation_count[0].current));
    return ok && stats.allocation_count[0].current == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "memory_resource: %s\n", e.what());
    return 1;
  }
}
