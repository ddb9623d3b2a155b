// What a CUDA runtime does to find the driver -- dlopen("libcuda.so.1"), dlsym(cuGetProcAddress),
// then cuGetProcAddress for everything -- against the fake libcuda (fake_libcuda.cpp), to check
// libcucache_preload.so's dlsym and cuGetProcAddress interposition without a GPU.
//   preload_e2e_check preloaded   (LD_PRELOAD=libcucache_preload.so CUCACHE_BACKEND=sim)
//   preload_e2e_check plain       (no preload: every call reaches the fake driver)
//   preload_e2e_check fork VERDICT_FILE   (preloaded: a forked child's free and exit report)
#include <dlfcn.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

using cu_result = int;
using cu_deviceptr = unsigned long long;
using cu_stream = struct CUstream_st*;
using gpa_v1 = cu_result (*)(const char*, void**, int, std::uint64_t);
using gpa_v2 = cu_result (*)(const char*, void**, int, std::uint64_t, int*);
using alloc_fn = cu_result (*)(cu_deviceptr*, std::size_t);
using alloc_async_fn = cu_result (*)(cu_deviceptr*, std::size_t, cu_stream);
using free_fn = cu_result (*)(cu_deviceptr);
using free_async_fn = cu_result (*)(cu_deviceptr, cu_stream);
using info_fn = cu_result (*)(std::size_t*, std::size_t*);
using ipc_fn = cu_result (*)(void*, cu_deviceptr);
using range_fn = cu_result (*)(cu_deviceptr*, std::size_t*, cu_deviceptr);
using retain_fn = cu_result (*)(unsigned long long*, void*);
using cu_mem_pool = struct CUmemPoolHandle_st*;
using pool_alloc_fn = cu_result (*)(cu_deviceptr*, std::size_t, cu_mem_pool, cu_stream);
using count_fn = int (*)(int);
using begin_capture_fn = cu_result (*)(cu_stream, int);
using end_capture_fn = cu_result (*)(cu_stream, void**);
using stream_destroy_fn = cu_result (*)(cu_stream);
using raw_alloc_fn = cu_deviceptr (*)(std::size_t);

namespace {
int failures = 0;
void expect(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "preload_e2e_check: FAILED: %s\n", what);
    ++failures;
  }
}
// fake_count's counters (fake_libcuda.cpp).
enum counter {
  c_alloc,
  c_free,
  c_alloc_async,
  c_free_async,
  c_alloc_ptsz,
  c_free_ptsz,
  c_pitch,
  c_info,
  c_ipc,
  c_range,
  c_sync,
  c_v1_alloc,
  c_retain,
  c_pool_alloc,
  c_begin_capture,
  c_end_capture,
  c_stream_destroy_v1,
  c_stream_destroy_v2
};
}  // namespace

// fork mode (preloaded): the parent allocates, forks, allocates twice more, frees all three and
// exits; the child tries to free the parent's pointer (it must fail with
// CUDA_ERROR_NOT_INITIALIZED, never reaching the driver), waits until the parent is gone, writes
// its verdict to `verdict` and exits normally -- after the parent, so that a child writing
// CUCACHE_REPORT would overwrite the parent's report.
int fork_check(alloc_fn mem_alloc, free_fn mem_free, count_fn count, const char* verdict) {
  cu_deviceptr a = 0;
  expect(mem_alloc(&a, 1 << 20) == 0 && a != 0, "fork: cuMemAlloc before the fork");
  std::fflush(nullptr);
  const pid_t parent = getpid();
  const pid_t child = fork();
  if (child < 0) return 1;
  if (child == 0) {
    expect(mem_free(a) == 3, "fork: the child's free of the parent's pointer fails (3)");
    expect(count(c_free) == 0, "fork: the child's free never reaches the driver");
    for (int i = 0; i < 2000 && getppid() == parent; ++i) usleep(5000);
    expect(getppid() != parent, "fork: the parent exited first");
    if (std::FILE* f = std::fopen(verdict, "w")) {
      std::fputs(failures == 0 ? "OK\n" : "FAILED\n", f);
      std::fclose(f);
    }
    std::exit(failures == 0 ? 0 : 1);  // runs the exit handlers, the shim's report included
  }
  cu_deviceptr b = 0;
  cu_deviceptr c = 0;
  expect(mem_alloc(&b, 4096) == 0 && mem_alloc(&c, 4096) == 0, "fork: the parent allocates on");
  expect(mem_free(a) == 0 && mem_free(b) == 0 && mem_free(c) == 0, "fork: the parent frees");
  std::printf("preload_e2e_check fork (parent): %s\n", failures == 0 ? "OK" : "FAILED");
  return failures == 0 ? 0 : 1;
}

int main(int argc, char** argv) {
  const bool preloaded = argc > 1 && std::strcmp(argv[1], "plain") != 0;
  void* h = dlopen("libcuda.so.1", RTLD_NOW);
  if (h == nullptr) {
    std::fprintf(stderr, "preload_e2e_check: %s\n", dlerror());
    return 1;
  }
  auto count = reinterpret_cast<count_fn>(dlsym(h, "fake_count"));
  auto raw_alloc = reinterpret_cast<raw_alloc_fn>(dlsym(h, "fake_raw_alloc"));
  auto gpa = reinterpret_cast<gpa_v1>(dlsym(h, "cuGetProcAddress"));
  expect(count != nullptr && raw_alloc != nullptr && gpa != nullptr, "dlsym finds the driver");
  if (failures != 0) return 1;
  // The runtime of CUDA 12+ asks cuGetProcAddress for cuGetProcAddress (the v2 one).
  gpa_v2 gpa2 = nullptr;
  expect(gpa("cuGetProcAddress", reinterpret_cast<void**>(&gpa2), 12000, 0) == 0 && gpa2 != nullptr,
         "cuGetProcAddress(cuGetProcAddress)");
  if (failures != 0) return 1;
  auto get = [&](const char* name, int version, std::uint64_t flags) {
    void* fn = nullptr;
    int status = -1;
    expect(gpa2(name, &fn, version, flags, &status) == 0 && fn != nullptr && status == 0, name);
    return fn;
  };
  auto mem_alloc = reinterpret_cast<alloc_fn>(get("cuMemAlloc", 12000, 0));
  auto mem_free = reinterpret_cast<free_fn>(get("cuMemFree", 12000, 0));
  auto alloc_ptsz = reinterpret_cast<alloc_async_fn>(get("cuMemAllocAsync", 12000, 2));
  auto free_ptsz = reinterpret_cast<free_async_fn>(get("cuMemFreeAsync", 12000, 2));
  auto alloc_async = reinterpret_cast<alloc_async_fn>(get("cuMemAllocAsync", 12000, 0));
  auto free_async = reinterpret_cast<free_async_fn>(get("cuMemFreeAsync", 12000, 0));
  auto mem_info = reinterpret_cast<info_fn>(get("cuMemGetInfo", 12000, 0));
  auto ipc_get = reinterpret_cast<ipc_fn>(get("cuIpcGetMemHandle", 12000, 0));
  auto range = reinterpret_cast<range_fn>(get("cuMemGetAddressRange", 12000, 0));
  auto retain = reinterpret_cast<retain_fn>(get("cuMemRetainAllocationHandle", 12000, 0));
  auto pool_alloc = reinterpret_cast<pool_alloc_fn>(get("cuMemAllocFromPoolAsync", 12000, 0));
  auto begin_capture = reinterpret_cast<begin_capture_fn>(get("cuStreamBeginCapture", 12000, 0));
  auto end_capture = reinterpret_cast<end_capture_fn>(get("cuStreamEndCapture", 12000, 0));
  auto stream_destroy = reinterpret_cast<stream_destroy_fn>(get("cuStreamDestroy", 12000, 0));
  auto stream_destroy_v1 = reinterpret_cast<stream_destroy_fn>(get("cuStreamDestroy", 3000, 0));
  auto old_alloc = get("cuMemAlloc", 3000, 0);
  if (failures != 0) return 1;
  if (argc > 2 && std::strcmp(argv[1], "fork") == 0)
    return fork_check(mem_alloc, mem_free, count, argv[2]);

  const int n = preloaded ? 0 : 1;  // what the fake driver sees of each call
  cu_deviceptr p = 0;
  expect(mem_alloc(&p, 1 << 20) == 0 && p != 0, "cuMemAlloc");
  expect(count(c_alloc) == n, "cuMemAlloc reaches cucache, not the driver");
  expect(mem_free(p) == 0, "cuMemFree");
  expect(count(c_free) == n, "cuMemFree of cucache memory stays in cucache");
  expect(alloc_ptsz(&p, 4096, nullptr) == 0 && free_ptsz(p, nullptr) == 0, "_ptsz pair");
  expect(count(c_alloc_ptsz) == n && count(c_free_ptsz) == n, "_ptsz variants are cucache's");
  expect(alloc_async(&p, 4096, nullptr) == 0, "cuMemAllocAsync");
  unsigned char handle[64];
  expect(ipc_get(handle, p) == (preloaded ? 801 : 0), "cuIpcGetMemHandle on cucache memory");
  expect(free_async(p, nullptr) == 0, "cuMemFreeAsync");
  expect(count(c_alloc_async) == n && count(c_free_async) == n, "async pair is cucache's");
  {
    // The allocation's own range, from inside it (the fake driver answers {p, 1}).
    cu_deviceptr q = 0;
    expect(mem_alloc(&q, 5000) == 0, "cuMemAlloc for the range");
    cu_deviceptr base = 0;
    std::size_t size = 0;
    expect(range(&base, &size, q + 4999) == 0, "cuMemGetAddressRange");
    expect(base == (preloaded ? q : q + 4999) && (preloaded ? size >= 5000 : size == 1),
           "cuMemGetAddressRange answers the allocation's own base and size");
    expect(count(c_range) == n, "cuMemGetAddressRange of cucache memory is cucache's");
    unsigned long long vmm = 0;
    expect(retain(&vmm, reinterpret_cast<void*>(static_cast<std::uintptr_t>(q))) ==
               (preloaded ? 1 : 0),
           "cuMemRetainAllocationHandle of cucache memory is refused");
    expect(count(c_retain) == n, "cuMemRetainAllocationHandle of cucache memory is cucache's");
    expect(mem_free(q) == 0, "cuMemFree after the range");
    if (!preloaded) expect(count(c_free) == 2, "plain: the fake freed both");
  }
  std::size_t f = 0;
  std::size_t t = 0;
  expect(mem_info(&f, &t) == 0 && (preloaded ? t > 2 : t == 2), "cuMemGetInfo answers");
  expect(count(c_info) == n, "cuMemGetInfo is cucache's view");
  // A pointer the driver allocated, freed through the interposed cuMemFree: the driver's.
  const cu_deviceptr foreign = raw_alloc(256);
  expect(mem_free(foreign) == 0 && count(c_free) == 2 * n + 1, "a foreign free reaches the driver");
  const cu_deviceptr foreign2 = raw_alloc(256);
  expect(ipc_get(handle, foreign2) == 0, "IPC on foreign memory is the driver's");
  expect(mem_free(foreign2) == 0, "the second foreign block goes back to the driver");
  // cuMemAllocFromPoolAsync: from the device's default pool (the fake's 0x100) cucache's, from a
  // pool the program made the driver's; both freed through cuMemFreeAsync.
  {
    const auto default_pool = reinterpret_cast<cu_mem_pool>(std::uintptr_t{0x100});
    const auto own_pool = reinterpret_cast<cu_mem_pool>(std::uintptr_t{0x200});
    cu_deviceptr q = 0;
    expect(pool_alloc(&q, 8192, default_pool, nullptr) == 0 && q != 0, "default pool allocation");
    expect(count(c_pool_alloc) == n, "an allocation from the default pool is cucache's");
    expect(free_async(q, nullptr) == 0, "cuMemFreeAsync of the default pool's allocation");
    expect(count(c_free_async) == 2 * n, "its free stays in cucache");
    expect(pool_alloc(&q, 8192, own_pool, nullptr) == 0 && q != 0, "own pool allocation");
    expect(count(c_pool_alloc) == n + 1, "an allocation from the program's own pool is the driver's");
    expect(free_async(q, nullptr) == 0 && count(c_free_async) == 2 * n + 1,
           "its free is the driver's");
  }
  // The capture calls reach the driver either way; preloaded, through the shim (which announces
  // them to cucache: preload_routing_test checks what it announces).
  {
    const auto stream = reinterpret_cast<cu_stream>(std::uintptr_t{0x5000});
    void* graph = &graph;
    expect(begin_capture(stream, 0) == 0 && count(c_begin_capture) == 1, "cuStreamBeginCapture");
    expect(end_capture(stream, &graph) == 0 && count(c_end_capture) == 1 && graph == nullptr,
           "cuStreamEndCapture");
    Dl_info info{};
    expect(dladdr(reinterpret_cast<void*>(begin_capture), &info) != 0 &&
               info.dli_fname != nullptr &&
               (std::strstr(info.dli_fname, "cucache_preload") != nullptr) == preloaded,
           preloaded ? "cuStreamBeginCapture is the shim's" : "cuStreamBeginCapture is the fake's");
  }
  // cuStreamDestroy reaches the driver either way; preloaded, through the shim (which announces
  // each destruction to cucache first: preload_routing_test checks what the announcement does).
  // Both ABIs, through cuGetProcAddress and through dlsym. Preloaded, the report counts the four.
  {
    const auto stream = reinterpret_cast<cu_stream>(std::uintptr_t{0x6000});
    auto shims = [&](void* fn) {
      Dl_info info{};
      return dladdr(fn, &info) != 0 && info.dli_fname != nullptr &&
             std::strstr(info.dli_fname, "cucache_preload") != nullptr;
    };
    expect(stream_destroy(stream) == 0 && count(c_stream_destroy_v2) == 1,
           "cuStreamDestroy (ABI 12000) is the driver's cuStreamDestroy_v2");
    expect(shims(reinterpret_cast<void*>(stream_destroy)) == preloaded,
           preloaded ? "cuStreamDestroy is the shim's" : "cuStreamDestroy is the fake's");
    expect(stream_destroy_v1(stream) == 0 && count(c_stream_destroy_v1) == 1,
           "cuStreamDestroy (ABI 3000) is the driver's cuStreamDestroy");
    expect(shims(reinterpret_cast<void*>(stream_destroy_v1)) == preloaded,
           preloaded ? "the CUDA 2.0 cuStreamDestroy is the shim's"
                     : "the CUDA 2.0 cuStreamDestroy is the fake's");
    auto direct_v2 = reinterpret_cast<stream_destroy_fn>(dlsym(h, "cuStreamDestroy_v2"));
    auto direct_v1 = reinterpret_cast<stream_destroy_fn>(dlsym(h, "cuStreamDestroy"));
    expect(direct_v2 == stream_destroy && direct_v1 == stream_destroy_v1,
           "dlsym(cuStreamDestroy_v2, cuStreamDestroy) are cuGetProcAddress's");
    expect(direct_v2 != nullptr && direct_v2(stream) == 0 && count(c_stream_destroy_v2) == 2,
           "dlsym(cuStreamDestroy_v2) reaches the driver");
    expect(direct_v1 != nullptr && direct_v1(stream) == 0 && count(c_stream_destroy_v1) == 2,
           "dlsym(cuStreamDestroy) reaches the driver");
  }
  // An old ABI is not replaced: the fake's own 32-bit cuMemAlloc.
  expect(old_alloc == dlsym(h, "cuMemAlloc"), "cuMemAlloc at ABI 3000 is the driver's");
  // Direct dlsym of an interposed symbol gives the shim's when preloaded.
  void* direct = dlsym(h, "cuMemAlloc_v2");
  expect(direct == reinterpret_cast<void*>(mem_alloc),
         "dlsym(cuMemAlloc_v2) is cuGetProcAddress's");
  // Unrelated symbols pass through.
  expect(dlsym(RTLD_DEFAULT, "printf") != nullptr, "dlsym(printf)");
  std::printf("preload_e2e_check %s: %s\n", preloaded ? "preloaded" : "plain",
              failures == 0 ? "OK" : "FAILED");
  return failures == 0 ? 0 : 1;
}
