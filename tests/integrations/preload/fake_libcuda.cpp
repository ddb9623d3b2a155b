// A fake libcuda.so.1 for preload_e2e (preload_e2e.sh): the driver entry points the shim
// interposes, each counting its calls, cuGetProcAddress (v1, v2) answering with them by name and
// ABI version as the driver does, and fake_* helpers for the check program. "Device" memory is
// host memory from malloc. Linked -Bsymbolic: its cuGetProcAddress returns its own functions even
// with the shim preloaded, as the real driver's does.
#include <cstdint>
#include <cstdlib>
#include <cstring>

using cu_result = int;
using cu_deviceptr = unsigned long long;
using cu_stream = struct CUstream_st*;
using cu_mem_pool = struct CUmemPoolHandle_st*;

namespace {
int g_counts[32];
enum counter {
  alloc,
  free_,
  alloc_async,
  free_async,
  alloc_ptsz,
  free_ptsz,
  pitch,
  info,
  ipc,
  range,
  sync,
  v1_alloc,
  retain,
  pool_alloc,
  begin_capture,
  end_capture,
  stream_destroy_v1,
  stream_destroy_v2
};
int g_capturing = 0;  // what cuStreamIsCapturing answers
cu_deviceptr host_alloc(std::size_t n) {
  return static_cast<cu_deviceptr>(reinterpret_cast<std::uintptr_t>(std::malloc(n)));
}
void host_free(cu_deviceptr p) {
  std::free(reinterpret_cast<void*>(static_cast<std::uintptr_t>(p)));
}
}  // namespace

extern "C" {
__attribute__((visibility("default"))) int fake_count(int which) {
  return g_counts[which];
}
__attribute__((visibility("default"))) cu_deviceptr fake_raw_alloc(std::size_t n) {
  return host_alloc(n);
}
__attribute__((visibility("default"))) cu_result cuMemAlloc_v2(cu_deviceptr* p, std::size_t n) {
  ++g_counts[alloc];
  *p = host_alloc(n);
  return 0;
}
__attribute__((visibility("default"))) cu_result cuMemAlloc(unsigned int* p, unsigned int) {
  ++g_counts[v1_alloc];
  *p = 0;
  return 1;
}
__attribute__((visibility("default"))) cu_result cuMemFree_v2(cu_deviceptr p) {
  ++g_counts[free_];
  host_free(p);
  return 0;
}
__attribute__((visibility("default"))) cu_result cuMemAllocAsync(cu_deviceptr* p, std::size_t n,
                                                                 cu_stream) {
  ++g_counts[alloc_async];
  *p = host_alloc(n);
  return 0;
}
__attribute__((visibility("default"))) cu_result cuMemFreeAsync(cu_deviceptr p, cu_stream) {
  ++g_counts[free_async];
  host_free(p);
  return 0;
}
__attribute__((visibility("default"))) cu_result cuMemAllocAsync_ptsz(cu_deviceptr* p,
                                                                      std::size_t n, cu_stream) {
  ++g_counts[alloc_ptsz];
  *p = host_alloc(n);
  return 0;
}
__attribute__((visibility("default"))) cu_result cuMemFreeAsync_ptsz(cu_deviceptr p, cu_stream) {
  ++g_counts[free_ptsz];
  host_free(p);
  return 0;
}
__attribute__((visibility("default"))) cu_result cuMemAllocPitch_v2(cu_deviceptr* p,
                                                                    std::size_t* pp, std::size_t w,
                                                                    std::size_t h, unsigned) {
  ++g_counts[pitch];
  *pp = w;
  *p = host_alloc(w * h);
  return 0;
}
__attribute__((visibility("default"))) cu_result cuMemGetInfo_v2(std::size_t* f, std::size_t* t) {
  ++g_counts[info];
  *f = 1;
  *t = 2;
  return 0;
}
__attribute__((visibility("default"))) cu_result cuIpcGetMemHandle(void* h, cu_deviceptr) {
  ++g_counts[ipc];
  std::memset(h, 0, 64);
  return 0;
}
__attribute__((visibility("default"))) cu_result cuMemGetAddressRange_v2(cu_deviceptr* b,
                                                                         std::size_t* s,
                                                                         cu_deviceptr p) {
  ++g_counts[range];
  *b = p;
  *s = 1;
  return 0;
}
__attribute__((visibility("default"))) cu_result cuMemRetainAllocationHandle(unsigned long long* h,
                                                                             void*) {
  ++g_counts[retain];
  *h = 1;
  return 0;
}
// Every device's default pool is 0x100 + its ordinal; the context's device is 0.
__attribute__((visibility("default"))) cu_result cuCtxGetDevice(int* dev) {
  *dev = 0;
  return 0;
}
__attribute__((visibility("default"))) cu_result cuDeviceGetDefaultMemPool(cu_mem_pool* pool,
                                                                           int dev) {
  *pool = reinterpret_cast<cu_mem_pool>(std::uintptr_t{0x100} + static_cast<std::uintptr_t>(dev));
  return 0;
}
__attribute__((visibility("default"))) cu_result cuMemAllocFromPoolAsync(cu_deviceptr* p,
                                                                         std::size_t n,
                                                                         cu_mem_pool, cu_stream) {
  ++g_counts[pool_alloc];
  *p = host_alloc(n);
  return 0;
}
__attribute__((visibility("default"))) cu_result cuCtxSynchronize() {
  ++g_counts[sync];
  return 0;
}

__attribute__((visibility("default"))) cu_result cuStreamBeginCapture_v2(cu_stream, int) {
  ++g_counts[begin_capture];
  g_capturing = 1;
  return 0;
}
__attribute__((visibility("default"))) cu_result cuStreamEndCapture(cu_stream, void** graph) {
  ++g_counts[end_capture];
  g_capturing = 0;
  *graph = nullptr;
  return 0;
}
__attribute__((visibility("default"))) cu_result cuStreamIsCapturing(cu_stream, int* status) {
  *status = g_capturing;
  return 0;
}
// CUDA 2.0's cuStreamDestroy and CUDA 4.0's cuStreamDestroy_v2 (what cuda.h's name means).
__attribute__((visibility("default"))) cu_result cuStreamDestroy(cu_stream) {
  ++g_counts[stream_destroy_v1];
  return 0;
}
__attribute__((visibility("default"))) cu_result cuStreamDestroy_v2(cu_stream) {
  ++g_counts[stream_destroy_v2];
  return 0;
}
__attribute__((visibility("default"))) cu_result cuGetProcAddress_v2(const char* symbol, void** pfn,
                                                                     int version,
                                                                     std::uint64_t flags,
                                                                     int* status);
__attribute__((visibility("default"))) cu_result cuGetProcAddress(const char* symbol, void** pfn,
                                                                  int version,
                                                                  std::uint64_t flags) {
  return cuGetProcAddress_v2(symbol, pfn, version, flags, nullptr);
}

cu_result cuGetProcAddress_v2(const char* symbol, void** pfn, int version, std::uint64_t flags,
                              int* status) {
  const bool ptsz = (flags & 2) != 0;
  struct entry {
    const char* name;
    void* fn;
  };
  const entry table[] = {
      {"cuMemAlloc", version >= 3020 ? reinterpret_cast<void*>(&cuMemAlloc_v2)
                                     : reinterpret_cast<void*>(&cuMemAlloc)},
      {"cuMemFree", reinterpret_cast<void*>(&cuMemFree_v2)},
      {"cuMemAllocAsync", ptsz ? reinterpret_cast<void*>(&cuMemAllocAsync_ptsz)
                               : reinterpret_cast<void*>(&cuMemAllocAsync)},
      {"cuMemFreeAsync", ptsz ? reinterpret_cast<void*>(&cuMemFreeAsync_ptsz)
                              : reinterpret_cast<void*>(&cuMemFreeAsync)},
      {"cuMemAllocPitch", reinterpret_cast<void*>(&cuMemAllocPitch_v2)},
      {"cuMemGetInfo", reinterpret_cast<void*>(&cuMemGetInfo_v2)},
      {"cuIpcGetMemHandle", reinterpret_cast<void*>(&cuIpcGetMemHandle)},
      {"cuMemGetAddressRange", reinterpret_cast<void*>(&cuMemGetAddressRange_v2)},
      {"cuCtxSynchronize", reinterpret_cast<void*>(&cuCtxSynchronize)},
      {"cuMemAllocFromPoolAsync", reinterpret_cast<void*>(&cuMemAllocFromPoolAsync)},
      {"cuMemRetainAllocationHandle", reinterpret_cast<void*>(&cuMemRetainAllocationHandle)},
      {"cuStreamBeginCapture", reinterpret_cast<void*>(&cuStreamBeginCapture_v2)},
      {"cuStreamEndCapture", reinterpret_cast<void*>(&cuStreamEndCapture)},
      {"cuStreamIsCapturing", reinterpret_cast<void*>(&cuStreamIsCapturing)},
      {"cuStreamDestroy", version >= 4000 ? reinterpret_cast<void*>(&cuStreamDestroy_v2)
                                          : reinterpret_cast<void*>(&cuStreamDestroy)},
      {"cuGetProcAddress", version >= 12000 ? reinterpret_cast<void*>(&cuGetProcAddress_v2)
                                            : reinterpret_cast<void*>(&cuGetProcAddress)},
  };
  for (const entry& e : table) {
    if (std::strcmp(symbol, e.name) == 0) {
      *pfn = e.fn;
      if (status != nullptr) *status = 0;
      return 0;
    }
  }
  *pfn = nullptr;
  if (status != nullptr) *status = 1;
  return 500;
}
}
