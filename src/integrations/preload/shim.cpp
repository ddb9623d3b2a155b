// libcucache_preload.so's exported symbols (docs/preload.md): the driver entry points it
// interposes, cuGetProcAddress (v1 and v2), through which the CUDA runtime -- static or shared --
// finds every driver function since CUDA 11.3, and dlsym, through which the runtime finds
// cuGetProcAddress in libcuda.so.1. Everything else of the library is hidden (exports.map).
//
// No recursion into the shim: cucache's own CUDA runtime (linked statically into this library)
// also looks the driver up through dlsym, and dlsym answers a caller inside this library with the
// real symbol; besides, a thread already inside cucache (t_depth) is always forwarded to the real
// driver, whatever path it took.
#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>

#include "preload.hpp"

namespace cucache::preload {
namespace {

using dlsym_fn = void* (*)(void*, const char*);
using gpa_v1_fn = cu_result (*)(const char*, void**, int, std::uint64_t);
using gpa_v2_fn = cu_result (*)(const char*, void**, int, std::uint64_t, int*);

constexpr std::uint64_t k_per_thread_flag = 2;  // CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM

thread_local int t_depth = 0;  // > 0: this thread is inside cucache
struct inside {
  inside() noexcept { ++t_depth; }
  ~inside() { --t_depth; }
  inside(const inside&) = delete;
  inside& operator=(const inside&) = delete;
};

// glibc's dlsym, found by version so that this library's own dlsym is not found instead.
dlsym_fn real_dlsym() noexcept {
  static const dlsym_fn fn = [] {
    void* f = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (f == nullptr) f = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    if (f == nullptr) f = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.17");  // aarch64
    if (f == nullptr) {
      std::fputs("cucache preload: cannot find glibc's dlsym; giving up\n", stderr);
      std::abort();
    }
    return reinterpret_cast<dlsym_fn>(f);
  }();
  return fn;
}

bool caller_is_self(const void* caller) noexcept {
  static const void* self_base = [] {
    Dl_info info{};
    return dladdr(reinterpret_cast<const void*>(&caller_is_self), &info) != 0 ? info.dli_fbase
                                                                              : nullptr;
  }();
  Dl_info info{};
  return self_base != nullptr && caller != nullptr && dladdr(caller, &info) != 0 &&
         info.dli_fbase == self_base;
}

void* libcuda() noexcept {
  static void* handle = [] {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) h = dlopen("libcuda.so.1", RTLD_NOW);
    return h;
  }();
  return handle;
}

template <typename Fn>
void resolve(Fn& fn, const char* name) noexcept {
  void* h = libcuda();
  fn = h != nullptr ? reinterpret_cast<Fn>(real_dlsym()(h, name)) : nullptr;
}

struct real_entry_points {
  real_driver drv;
  gpa_v1_fn get_proc_address = nullptr;
  gpa_v2_fn get_proc_address_v2 = nullptr;
};

// libcuda's exported symbols of the ABI versions the hooks implement.
const real_entry_points& real() noexcept {
  static const real_entry_points r = [] {
    real_entry_points e;
    resolve(e.drv.mem_alloc, "cuMemAlloc_v2");
    resolve(e.drv.mem_free, "cuMemFree_v2");
    resolve(e.drv.mem_alloc_async, "cuMemAllocAsync");
    resolve(e.drv.mem_free_async, "cuMemFreeAsync");
    resolve(e.drv.mem_alloc_async_ptsz, "cuMemAllocAsync_ptsz");
    resolve(e.drv.mem_free_async_ptsz, "cuMemFreeAsync_ptsz");
    resolve(e.drv.mem_alloc_pitch, "cuMemAllocPitch_v2");
    resolve(e.drv.mem_get_info, "cuMemGetInfo_v2");
    resolve(e.drv.ipc_get_mem_handle, "cuIpcGetMemHandle");
    resolve(e.drv.mem_get_address_range, "cuMemGetAddressRange_v2");
    resolve(e.drv.ctx_synchronize, "cuCtxSynchronize");
    resolve(e.drv.mem_retain_allocation_handle, "cuMemRetainAllocationHandle");
    resolve(e.drv.mem_alloc_from_pool_async, "cuMemAllocFromPoolAsync");
    resolve(e.drv.mem_alloc_from_pool_async_ptsz, "cuMemAllocFromPoolAsync_ptsz");
    resolve(e.drv.ctx_get_device, "cuCtxGetDevice");
    resolve(e.drv.device_get_default_mem_pool, "cuDeviceGetDefaultMemPool");
    resolve(e.drv.stream_begin_capture, "cuStreamBeginCapture_v2");
    resolve(e.drv.stream_begin_capture_ptsz, "cuStreamBeginCapture_v2_ptsz");
    resolve(e.drv.stream_begin_capture_to_graph, "cuStreamBeginCaptureToGraph");
    resolve(e.drv.stream_begin_capture_to_graph_ptsz, "cuStreamBeginCaptureToGraph_ptsz");
    resolve(e.drv.stream_end_capture, "cuStreamEndCapture");
    resolve(e.drv.stream_end_capture_ptsz, "cuStreamEndCapture_ptsz");
    resolve(e.drv.stream_is_capturing, "cuStreamIsCapturing");
    resolve(e.drv.stream_is_capturing_ptsz, "cuStreamIsCapturing_ptsz");
    resolve(e.drv.stream_destroy, "cuStreamDestroy");
    resolve(e.drv.stream_destroy_v2, "cuStreamDestroy_v2");
    resolve(e.get_proc_address, "cuGetProcAddress");
    resolve(e.get_proc_address_v2, "cuGetProcAddress_v2");
    return e;
  }();
  return r;
}

// CUCACHE_PRELOAD_TRACE=1: every lookup of a memory entry point (cuMem*, cuIpc*, cuGetProcAddress)
// that reaches the shim goes to stderr with the object that asked and whether cucache answers it,
// so that a program whose allocations go around the shim shows which path they take
// (docs/preload.md, "Diagnosing a program that goes around the shim").
bool tracing() noexcept {
  static const bool on = [] {
    const char* env = std::getenv("CUCACHE_PRELOAD_TRACE");
    return env != nullptr && env[0] == '1';
  }();
  return on;
}

void trace_lookup(const char* via, const char* name, int version, const void* caller,
                  bool ours) noexcept {
  if (!tracing() || name == nullptr || name[0] != 'c' || name[1] != 'u') return;
  if (std::strncmp(name, "cuMem", 5) != 0 && std::strncmp(name, "cuIpc", 5) != 0 &&
      std::strncmp(name, "cuGetProcAddress", 16) != 0 && std::strncmp(name, "cuStream", 8) != 0) {
    return;
  }
  Dl_info info{};
  const char* who = dladdr(caller, &info) != 0 && info.dli_fname != nullptr ? info.dli_fname : "?";
  std::fprintf(stderr, "cucache preload trace: %s(%s, %d) from %s -> %s\n", via, name, version, who,
               ours ? "cucache" : "driver");
}

free_mode mode() noexcept {
  static const free_mode m = [] {
    try {
      return free_mode_from_env();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "cucache preload: %s; using sync\n", e.what());
      return free_mode::sync;
    }
  }();
  return m;
}

}  // namespace
}  // namespace cucache::preload

using namespace cucache::preload;

extern "C" {

#define CUCACHE_PRELOAD_API __attribute__((visibility("default")))

CUCACHE_PRELOAD_API cu_result cuMemAlloc_v2(cu_deviceptr* dptr, std::size_t bytes) {
  const real_driver& r = real().drv;
  if (t_depth > 0) return r.mem_alloc != nullptr ? r.mem_alloc(dptr, bytes) : k_not_found;
  inside guard;
  return mem_alloc(r, dptr, bytes, nullptr);
}

CUCACHE_PRELOAD_API cu_result cuMemAllocAsync(cu_deviceptr* dptr, std::size_t bytes,
                                              cu_stream stream) {
  const real_driver& r = real().drv;
  if (t_depth > 0) {
    return r.mem_alloc_async != nullptr ? r.mem_alloc_async(dptr, bytes, stream) : k_not_found;
  }
  inside guard;
  return mem_alloc(r, dptr, bytes, stream);
}

CUCACHE_PRELOAD_API cu_result cuMemAllocAsync_ptsz(cu_deviceptr* dptr, std::size_t bytes,
                                                   cu_stream stream) {
  const real_driver& r = real().drv;
  if (t_depth > 0) {
    return r.mem_alloc_async_ptsz != nullptr ? r.mem_alloc_async_ptsz(dptr, bytes, stream)
                                             : k_not_found;
  }
  inside guard;
  return mem_alloc(r, dptr, bytes, stream == nullptr ? k_stream_per_thread : stream);
}

CUCACHE_PRELOAD_API cu_result cuMemAllocFromPoolAsync(cu_deviceptr* dptr, std::size_t bytes,
                                                      cu_mem_pool pool, cu_stream stream) {
  const real_driver& r = real().drv;
  if (t_depth > 0) {
    return r.mem_alloc_from_pool_async != nullptr
               ? r.mem_alloc_from_pool_async(dptr, bytes, pool, stream)
               : k_not_found;
  }
  inside guard;
  return mem_alloc_from_pool_async(r, dptr, bytes, pool, stream, false);
}

CUCACHE_PRELOAD_API cu_result cuMemAllocFromPoolAsync_ptsz(cu_deviceptr* dptr, std::size_t bytes,
                                                           cu_mem_pool pool, cu_stream stream) {
  const real_driver& r = real().drv;
  if (t_depth > 0) {
    return r.mem_alloc_from_pool_async_ptsz != nullptr
               ? r.mem_alloc_from_pool_async_ptsz(dptr, bytes, pool, stream)
               : k_not_found;
  }
  inside guard;
  return mem_alloc_from_pool_async(r, dptr, bytes, pool, stream, true);
}

CUCACHE_PRELOAD_API cu_result cuMemAllocPitch_v2(cu_deviceptr* dptr, std::size_t* pitch,
                                                 std::size_t width, std::size_t height,
                                                 unsigned int element) {
  const real_driver& r = real().drv;
  if (t_depth > 0) {
    return r.mem_alloc_pitch != nullptr ? r.mem_alloc_pitch(dptr, pitch, width, height, element)
                                        : k_not_found;
  }
  inside guard;
  return mem_alloc_pitch(r, dptr, pitch, width, height, element);
}

CUCACHE_PRELOAD_API cu_result cuMemFree_v2(cu_deviceptr dptr) {
  const real_driver& r = real().drv;
  if (t_depth > 0) return r.mem_free != nullptr ? r.mem_free(dptr) : k_not_found;
  inside guard;
  return mem_free(r, dptr, mode());
}

CUCACHE_PRELOAD_API cu_result cuMemFreeAsync(cu_deviceptr dptr, cu_stream stream) {
  const real_driver& r = real().drv;
  if (t_depth > 0) {
    return r.mem_free_async != nullptr ? r.mem_free_async(dptr, stream) : k_not_found;
  }
  inside guard;
  return mem_free_async(r, dptr, stream, false);
}

CUCACHE_PRELOAD_API cu_result cuMemFreeAsync_ptsz(cu_deviceptr dptr, cu_stream stream) {
  const real_driver& r = real().drv;
  if (t_depth > 0) {
    return r.mem_free_async_ptsz != nullptr ? r.mem_free_async_ptsz(dptr, stream) : k_not_found;
  }
  inside guard;
  return mem_free_async(r, dptr, stream, true);
}

CUCACHE_PRELOAD_API cu_result cuMemGetInfo_v2(std::size_t* free, std::size_t* total) {
  const real_driver& r = real().drv;
  if (t_depth > 0) return r.mem_get_info != nullptr ? r.mem_get_info(free, total) : k_not_found;
  inside guard;
  return mem_get_info(r, free, total);
}

CUCACHE_PRELOAD_API cu_result cuIpcGetMemHandle(void* handle, cu_deviceptr dptr) {
  const real_driver& r = real().drv;
  if (t_depth > 0) {
    return r.ipc_get_mem_handle != nullptr ? r.ipc_get_mem_handle(handle, dptr) : k_not_found;
  }
  inside guard;
  return ipc_get_mem_handle(r, handle, dptr);
}

CUCACHE_PRELOAD_API cu_result cuMemGetAddressRange_v2(cu_deviceptr* base, std::size_t* size,
                                                      cu_deviceptr dptr) {
  const real_driver& r = real().drv;
  if (t_depth > 0) {
    return r.mem_get_address_range != nullptr ? r.mem_get_address_range(base, size, dptr)
                                              : k_not_found;
  }
  inside guard;
  return mem_get_address_range(r, base, size, dptr);
}

CUCACHE_PRELOAD_API cu_result cuMemRetainAllocationHandle(cu_mem_handle* handle, void* addr) {
  const real_driver& r = real().drv;
  if (t_depth > 0) {
    return r.mem_retain_allocation_handle != nullptr ? r.mem_retain_allocation_handle(handle, addr)
                                                     : k_not_found;
  }
  inside guard;
  return mem_retain_allocation_handle(r, handle, addr);
}

// The capture calls: announced to cucache (preload.hpp, stream_begin_capture), so that allocations
// outside captures skip the driver's capture query. cucache's own calls never capture.
CUCACHE_PRELOAD_API cu_result cuStreamBeginCapture_v2(cu_stream stream, int mode) {
  const real_driver& r = real().drv;
  if (t_depth > 0) {
    return r.stream_begin_capture != nullptr ? r.stream_begin_capture(stream, mode) : k_not_found;
  }
  inside guard;
  return stream_begin_capture(r, stream, mode, false);
}

CUCACHE_PRELOAD_API cu_result cuStreamBeginCapture_v2_ptsz(cu_stream stream, int mode) {
  const real_driver& r = real().drv;
  if (t_depth > 0) {
    return r.stream_begin_capture_ptsz != nullptr ? r.stream_begin_capture_ptsz(stream, mode)
                                                  : k_not_found;
  }
  inside guard;
  return stream_begin_capture(r, stream, mode, true);
}

CUCACHE_PRELOAD_API cu_result cuStreamBeginCaptureToGraph(cu_stream stream, cu_graph graph,
                                                          const cu_graph_node* dependencies,
                                                          const void* edge_data, std::size_t count,
                                                          int mode) {
  const real_driver& r = real().drv;
  if (t_depth > 0) {
    return r.stream_begin_capture_to_graph != nullptr
               ? r.stream_begin_capture_to_graph(stream, graph, dependencies, edge_data, count,
                                                 mode)
               : k_not_found;
  }
  inside guard;
  return stream_begin_capture_to_graph(r, stream, graph, dependencies, edge_data, count, mode,
                                       false);
}

CUCACHE_PRELOAD_API cu_result cuStreamBeginCaptureToGraph_ptsz(cu_stream stream, cu_graph graph,
                                                               const cu_graph_node* dependencies,
                                                               const void* edge_data,
                                                               std::size_t count, int mode) {
  const real_driver& r = real().drv;
  if (t_depth > 0) {
    return r.stream_begin_capture_to_graph_ptsz != nullptr
               ? r.stream_begin_capture_to_graph_ptsz(stream, graph, dependencies, edge_data,
                                                      count, mode)
               : k_not_found;
  }
  inside guard;
  return stream_begin_capture_to_graph(r, stream, graph, dependencies, edge_data, count, mode,
                                       true);
}

CUCACHE_PRELOAD_API cu_result cuStreamEndCapture(cu_stream stream, cu_graph* graph) {
  const real_driver& r = real().drv;
  if (t_depth > 0) {
    return r.stream_end_capture != nullptr ? r.stream_end_capture(stream, graph) : k_not_found;
  }
  inside guard;
  return stream_end_capture(r, stream, graph, false);
}

CUCACHE_PRELOAD_API cu_result cuStreamEndCapture_ptsz(cu_stream stream, cu_graph* graph) {
  const real_driver& r = real().drv;
  if (t_depth > 0) {
    return r.stream_end_capture_ptsz != nullptr ? r.stream_end_capture_ptsz(stream, graph)
                                                : k_not_found;
  }
  inside guard;
  return stream_end_capture(r, stream, graph, true);
}

// The stream destructions: announced to cucache before the driver performs them (preload.hpp,
// stream_destroy), so that an allocator caching a stream's id (CUCACHE_PRELOAD_STREAMS=announced)
// asks the id again once the runtime may have handed the handle to a new stream. Announced on
// cucache's own threads too: an atomic increment, and no call into cucache that could recurse.
CUCACHE_PRELOAD_API cu_result cuStreamDestroy(cu_stream stream) {
  return stream_destroy(real().drv, stream, false);
}

CUCACHE_PRELOAD_API cu_result cuStreamDestroy_v2(cu_stream stream) {
  return stream_destroy(real().drv, stream, true);
}

CUCACHE_PRELOAD_API cu_result cuGetProcAddress_v2(const char* symbol, void** pfn, int version,
                                                  std::uint64_t flags, int* status);
CUCACHE_PRELOAD_API cu_result cuGetProcAddress(const char* symbol, void** pfn, int version,
                                               std::uint64_t flags);

}  // extern "C"

namespace cucache::preload {
namespace {

// This library's replacement for the entry point the driver returned for `symbol` at `version`
// (the driver's default search: ABI `version`, per-thread stream variants when `flags` asks), or
// nullptr to keep the driver's. Only the ABI versions the hooks implement are replaced: an older
// caller asking for cuMemAlloc at 3.1 keeps the driver's 32-bit cuMemAlloc.
void* replacement(const char* symbol, int version, std::uint64_t flags) noexcept {
  const bool ptsz = (flags & k_per_thread_flag) != 0;
  struct entry {
    const char* name;
    int since;
    void* fn;
    void* fn_ptsz;
  };
  static const entry table[] = {
      {"cuMemAlloc", 3020, reinterpret_cast<void*>(&cuMemAlloc_v2), nullptr},
      {"cuMemFree", 3020, reinterpret_cast<void*>(&cuMemFree_v2), nullptr},
      {"cuMemAllocPitch", 3020, reinterpret_cast<void*>(&cuMemAllocPitch_v2), nullptr},
      {"cuMemGetInfo", 3020, reinterpret_cast<void*>(&cuMemGetInfo_v2), nullptr},
      {"cuMemGetAddressRange", 3020, reinterpret_cast<void*>(&cuMemGetAddressRange_v2), nullptr},
      {"cuIpcGetMemHandle", 4010, reinterpret_cast<void*>(&cuIpcGetMemHandle), nullptr},
      {"cuMemAllocAsync", 11020, reinterpret_cast<void*>(&cuMemAllocAsync),
       reinterpret_cast<void*>(&cuMemAllocAsync_ptsz)},
      {"cuMemFreeAsync", 11020, reinterpret_cast<void*>(&cuMemFreeAsync),
       reinterpret_cast<void*>(&cuMemFreeAsync_ptsz)},
      {"cuMemAllocFromPoolAsync", 11020, reinterpret_cast<void*>(&cuMemAllocFromPoolAsync),
       reinterpret_cast<void*>(&cuMemAllocFromPoolAsync_ptsz)},
      {"cuMemRetainAllocationHandle", 11000, reinterpret_cast<void*>(&cuMemRetainAllocationHandle),
       nullptr},
      // CUDA 10.0's one-argument cuStreamBeginCapture keeps the driver's (docs/preload.md).
      {"cuStreamBeginCapture", 10010, reinterpret_cast<void*>(&cuStreamBeginCapture_v2),
       reinterpret_cast<void*>(&cuStreamBeginCapture_v2_ptsz)},
      {"cuStreamBeginCaptureToGraph", 12030, reinterpret_cast<void*>(&cuStreamBeginCaptureToGraph),
       reinterpret_cast<void*>(&cuStreamBeginCaptureToGraph_ptsz)},
      {"cuStreamEndCapture", 10000, reinterpret_cast<void*>(&cuStreamEndCapture),
       reinterpret_cast<void*>(&cuStreamEndCapture_ptsz)},
  };
  if (std::strcmp(symbol, "cuGetProcAddress") == 0) {
    return version >= 12000 ? reinterpret_cast<void*>(&cuGetProcAddress_v2)
                            : reinterpret_cast<void*>(&cuGetProcAddress);
  }
  // Both ABIs of cuStreamDestroy destroy a stream (the driver answers cuStreamDestroy_v2 from
  // 4000 and the CUDA 2.0 one before): each is replaced by the shim's of the same ABI.
  if (std::strcmp(symbol, "cuStreamDestroy") == 0) {
    return version >= 4000 ? reinterpret_cast<void*>(&cuStreamDestroy_v2)
                           : reinterpret_cast<void*>(&cuStreamDestroy);
  }
  for (const entry& e : table) {
    if (std::strcmp(symbol, e.name) != 0) continue;
    if (version < e.since) return nullptr;
    return ptsz && e.fn_ptsz != nullptr ? e.fn_ptsz : e.fn;
  }
  return nullptr;
}

// This library's function for an exported driver symbol name (dlsym's view), else nullptr.
void* exported(const char* name) noexcept {
  struct entry {
    const char* name;
    void* fn;
  };
  static const entry table[] = {
      {"cuGetProcAddress", reinterpret_cast<void*>(&cuGetProcAddress)},
      {"cuGetProcAddress_v2", reinterpret_cast<void*>(&cuGetProcAddress_v2)},
      {"cuMemAlloc_v2", reinterpret_cast<void*>(&cuMemAlloc_v2)},
      {"cuMemFree_v2", reinterpret_cast<void*>(&cuMemFree_v2)},
      {"cuMemAllocAsync", reinterpret_cast<void*>(&cuMemAllocAsync)},
      {"cuMemAllocAsync_ptsz", reinterpret_cast<void*>(&cuMemAllocAsync_ptsz)},
      {"cuMemFreeAsync", reinterpret_cast<void*>(&cuMemFreeAsync)},
      {"cuMemFreeAsync_ptsz", reinterpret_cast<void*>(&cuMemFreeAsync_ptsz)},
      {"cuMemAllocFromPoolAsync", reinterpret_cast<void*>(&cuMemAllocFromPoolAsync)},
      {"cuMemAllocFromPoolAsync_ptsz", reinterpret_cast<void*>(&cuMemAllocFromPoolAsync_ptsz)},
      {"cuMemAllocPitch_v2", reinterpret_cast<void*>(&cuMemAllocPitch_v2)},
      {"cuMemGetInfo_v2", reinterpret_cast<void*>(&cuMemGetInfo_v2)},
      {"cuIpcGetMemHandle", reinterpret_cast<void*>(&cuIpcGetMemHandle)},
      {"cuMemGetAddressRange_v2", reinterpret_cast<void*>(&cuMemGetAddressRange_v2)},
      {"cuMemRetainAllocationHandle", reinterpret_cast<void*>(&cuMemRetainAllocationHandle)},
      {"cuStreamBeginCapture_v2", reinterpret_cast<void*>(&cuStreamBeginCapture_v2)},
      {"cuStreamBeginCapture_v2_ptsz", reinterpret_cast<void*>(&cuStreamBeginCapture_v2_ptsz)},
      {"cuStreamBeginCaptureToGraph", reinterpret_cast<void*>(&cuStreamBeginCaptureToGraph)},
      {"cuStreamBeginCaptureToGraph_ptsz",
       reinterpret_cast<void*>(&cuStreamBeginCaptureToGraph_ptsz)},
      {"cuStreamEndCapture", reinterpret_cast<void*>(&cuStreamEndCapture)},
      {"cuStreamEndCapture_ptsz", reinterpret_cast<void*>(&cuStreamEndCapture_ptsz)},
      {"cuStreamDestroy", reinterpret_cast<void*>(&cuStreamDestroy)},
      {"cuStreamDestroy_v2", reinterpret_cast<void*>(&cuStreamDestroy_v2)},
  };
  if (name == nullptr || name[0] != 'c' || name[1] != 'u') return nullptr;
  for (const entry& e : table) {
    if (std::strcmp(name, e.name) == 0) return e.fn;
  }
  return nullptr;
}

}  // namespace
}  // namespace cucache::preload

extern "C" {

cu_result cuGetProcAddress_v2(const char* symbol, void** pfn, int version, std::uint64_t flags,
                              int* status) {
  const real_entry_points& r = real();
  cu_result rc = k_not_found;
  if (r.get_proc_address_v2 != nullptr) {
    rc = r.get_proc_address_v2(symbol, pfn, version, flags, status);
  } else if (r.get_proc_address != nullptr) {
    rc = r.get_proc_address(symbol, pfn, version, flags);
  }
  if (rc == k_success && t_depth == 0 && symbol != nullptr && pfn != nullptr && *pfn != nullptr) {
    void* mine = replacement(symbol, version, flags);
    if (mine != nullptr) *pfn = mine;
    trace_lookup("cuGetProcAddress_v2", symbol, version, __builtin_return_address(0),
                 mine != nullptr);
  }
  return rc;
}

cu_result cuGetProcAddress(const char* symbol, void** pfn, int version, std::uint64_t flags) {
  const real_entry_points& r = real();
  cu_result rc = k_not_found;
  if (r.get_proc_address != nullptr) {
    rc = r.get_proc_address(symbol, pfn, version, flags);
  } else if (r.get_proc_address_v2 != nullptr) {
    rc = r.get_proc_address_v2(symbol, pfn, version, flags, nullptr);
  }
  if (rc == k_success && t_depth == 0 && symbol != nullptr && pfn != nullptr && *pfn != nullptr) {
    void* mine = replacement(symbol, version, flags);
    if (mine != nullptr) *pfn = mine;
    trace_lookup("cuGetProcAddress", symbol, version, __builtin_return_address(0), mine != nullptr);
  }
  return rc;
}

}  // extern "C"

// The shared CUDA runtime's allocation calls (docs/preload.md, "Without a GPU"). Without a driver
// no runtime gets as far as the driver calls above: it fails in its first call with
// cudaErrorInsufficientDriver. So with CUCACHE_BACKEND=sim the shim also answers the allocation
// calls of libcudart.so itself -- a program linked with the shared runtime then runs its
// allocations on the simulated device. A static runtime has no symbol to interpose. Without the
// sim (a real device), each call goes on to the runtime's own, which reaches the driver hooks above.
//
// The hooks carry libcudart's symbol versions (non-default, ".symver ..., remove"): a program's
// reference to cudaMalloc@libcudart.so.13 binds to them, while cucache's own calls inside this
// library keep binding to its static runtime's cudaMalloc at link time (no clash of names).
namespace cucache::preload {
namespace {

bool sim_backend() noexcept {
  static const bool on = [] {
    const char* env = std::getenv("CUCACHE_BACKEND");
    return env != nullptr && std::strcmp(env, "sim") == 0;
  }();
  return on;
}

// The runtime's error code for a driver code the routing returned; the two share the values of
// the codes the routing produces, except CUDA_ERROR_NOT_FOUND (a free of a pointer nobody holds),
// which the runtime answers with cudaErrorInvalidValue.
int runtime_code(cu_result rc) noexcept { return rc == k_not_found ? k_invalid_value : rc; }

constexpr int k_runtime_insufficient_driver = 35;  // cudaErrorInsufficientDriver

const real_driver& no_driver() noexcept {
  static const real_driver none{};
  return none;
}

template <typename Fn>
Fn next_runtime(const char* name, const char* version) noexcept {
  return reinterpret_cast<Fn>(dlvsym(RTLD_NEXT, name, version));
}

}  // namespace
}  // namespace cucache::preload

// One set of hooks per runtime major version V (the symbol version libcudart.so.V).
#define CUCACHE_PRELOAD_RUNTIME_HOOKS(V)                                                          \
  extern "C" CUCACHE_PRELOAD_API int cucache_rt##V##_cudaMalloc(void** ptr, std::size_t bytes) { \
    if (!sim_backend() || t_depth > 0) {                                                          \
      static const auto fn =                                                                      \
          next_runtime<int (*)(void**, std::size_t)>("cudaMalloc", "libcudart.so." #V);           \
      return fn != nullptr ? fn(ptr, bytes) : k_runtime_insufficient_driver;                      \
    }                                                                                             \
    inside guard;                                                                                 \
    return runtime_code(mem_alloc(no_driver(), reinterpret_cast<cu_deviceptr*>(ptr), bytes,       \
                                  nullptr));                                                      \
  }                                                                                               \
  __asm__(".symver cucache_rt" #V "_cudaMalloc, cudaMalloc@libcudart.so." #V ", remove");        \
  extern "C" CUCACHE_PRELOAD_API int cucache_rt##V##_cudaMallocAsync(void** ptr,                  \
                                                                    std::size_t bytes,            \
                                                                    cu_stream stream) {           \
    if (!sim_backend() || t_depth > 0) {                                                          \
      static const auto fn = next_runtime<int (*)(void**, std::size_t, cu_stream)>(              \
          "cudaMallocAsync", "libcudart.so." #V);                                                 \
      return fn != nullptr ? fn(ptr, bytes, stream) : k_runtime_insufficient_driver;              \
    }                                                                                             \
    inside guard;                                                                                 \
    return runtime_code(mem_alloc(no_driver(), reinterpret_cast<cu_deviceptr*>(ptr), bytes,       \
                                  stream));                                                       \
  }                                                                                               \
  __asm__(".symver cucache_rt" #V "_cudaMallocAsync, cudaMallocAsync@libcudart.so." #V          \
          ", remove");                                                                            \
  extern "C" CUCACHE_PRELOAD_API int cucache_rt##V##_cudaMallocPitch(                             \
      void** ptr, std::size_t* pitch, std::size_t width, std::size_t height) {                    \
    if (!sim_backend() || t_depth > 0) {                                                          \
      static const auto fn =                                                                      \
          next_runtime<int (*)(void**, std::size_t*, std::size_t, std::size_t)>(                  \
              "cudaMallocPitch", "libcudart.so." #V);                                             \
      return fn != nullptr ? fn(ptr, pitch, width, height) : k_runtime_insufficient_driver;       \
    }                                                                                             \
    inside guard;                                                                                 \
    return runtime_code(mem_alloc_pitch(no_driver(), reinterpret_cast<cu_deviceptr*>(ptr), pitch, \
                                        width, height, 4));                                       \
  }                                                                                               \
  __asm__(".symver cucache_rt" #V "_cudaMallocPitch, cudaMallocPitch@libcudart.so." #V          \
          ", remove");                                                                            \
  extern "C" CUCACHE_PRELOAD_API int cucache_rt##V##_cudaFree(void* ptr) {                        \
    if (!sim_backend() || t_depth > 0) {                                                          \
      static const auto fn = next_runtime<int (*)(void*)>("cudaFree", "libcudart.so." #V);       \
      return fn != nullptr ? fn(ptr) : k_runtime_insufficient_driver;                             \
    }                                                                                             \
    inside guard;                                                                                 \
    return runtime_code(mem_free(no_driver(), reinterpret_cast<cu_deviceptr>(ptr), mode()));      \
  }                                                                                               \
  __asm__(".symver cucache_rt" #V "_cudaFree, cudaFree@libcudart.so." #V ", remove");            \
  extern "C" CUCACHE_PRELOAD_API int cucache_rt##V##_cudaFreeAsync(void* ptr, cu_stream stream) { \
    if (!sim_backend() || t_depth > 0) {                                                          \
      static const auto fn =                                                                      \
          next_runtime<int (*)(void*, cu_stream)>("cudaFreeAsync", "libcudart.so." #V);          \
      return fn != nullptr ? fn(ptr, stream) : k_runtime_insufficient_driver;                     \
    }                                                                                             \
    inside guard;                                                                                 \
    return runtime_code(                                                                          \
        mem_free_async(no_driver(), reinterpret_cast<cu_deviceptr>(ptr), stream, false));         \
  }                                                                                               \
  __asm__(".symver cucache_rt" #V "_cudaFreeAsync, cudaFreeAsync@libcudart.so." #V ", remove");  \
  extern "C" CUCACHE_PRELOAD_API int cucache_rt##V##_cudaMemGetInfo(std::size_t* free,            \
                                                                   std::size_t* total) {          \
    if (!sim_backend() || t_depth > 0) {                                                          \
      static const auto fn = next_runtime<int (*)(std::size_t*, std::size_t*)>(                   \
          "cudaMemGetInfo", "libcudart.so." #V);                                                  \
      return fn != nullptr ? fn(free, total) : k_runtime_insufficient_driver;                     \
    }                                                                                             \
    inside guard;                                                                                 \
    return runtime_code(mem_get_info(no_driver(), free, total));                                  \
  }                                                                                               \
  __asm__(".symver cucache_rt" #V "_cudaMemGetInfo, cudaMemGetInfo@libcudart.so." #V ", remove");

CUCACHE_PRELOAD_RUNTIME_HOOKS(12)
CUCACHE_PRELOAD_RUNTIME_HOOKS(13)

#undef CUCACHE_PRELOAD_RUNTIME_HOOKS

// CUCACHE_REPORT set and nothing reached cucache: a line on stderr at exit that says so and why,
// instead of silence (docs/preload.md). Registered when the shim is loaded; the report of a
// process that used cucache is written by the routing's own exit handler.
namespace cucache::preload {
namespace {
void notice_if_nothing_reached() noexcept {
  if (used_cucache()) return;
  const char* env = std::getenv("CUCACHE_REPORT");
  if (env == nullptr || *env == '\0') return;
  // Loaded already, or not at all: RTLD_NOLOAD never loads the driver at exit.
  void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  const bool driver_loaded = driver != nullptr;
  if (driver != nullptr) dlclose(driver);
  const std::string text = nothing_reached_text(driver_loaded, sim_backend());
  std::fputs(text.c_str(), stderr);
}

__attribute__((constructor)) void arm_notice() noexcept {
  const char* env = std::getenv("CUCACHE_REPORT");
  if (env != nullptr && *env != '\0') static_cast<void>(std::atexit(notice_if_nothing_reached));
}
}  // namespace
}  // namespace cucache::preload

extern "C" {

// dlsym as glibc's, except that a caller outside this library asking any library for one of the
// driver symbols above gets this library's function (when the library has the symbol at all).
CUCACHE_PRELOAD_API void* dlsym(void* __restrict handle, const char* __restrict name) noexcept {
  void* found = real_dlsym()(handle, name);
  const void* caller = __builtin_return_address(0);
  if (found == nullptr || t_depth > 0 || caller_is_self(caller)) return found;
  void* mine = exported(name);
  trace_lookup("dlsym", name, 0, caller, mine != nullptr);
  return mine != nullptr ? mine : found;
}

}  // extern "C"
