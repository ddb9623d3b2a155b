// Tests of libcucache_preload.so's routing (src/integrations/preload/preload.hpp) on the simulated
// device, with a fake real driver that counts what it is given: cucache answers allocations,
// foreign pointers reach the driver unchanged, a pointer inside cucache memory that is not a live
// allocation never does, IPC handles and VMM handles of cucache memory are refused, address ranges
// are the allocation's own, a forked child's frees fail instead of reaching the driver,
// cuMemGetInfo answers with cucache's view, captures are announced, and stream destructions are
// announced before the driver's destroy, so a cached stream id is asked again after one. The
// exported symbols (dlsym, cuGetProcAddress) are exercised end to end by preload_e2e
// (tests/integrations/preload_e2e.sh) over a fake libcuda.
#include "preload.hpp"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "allocator/stream_id_cache.hpp"
#include "api/registry.hpp"
#include "cucache/cucache.h"
#include "cucache/cucache.hpp"
#include "cucache/errors.hpp"
#include "cucache/sim_backend.hpp"
#include "support/sim_registry.hpp"

namespace {

using namespace cucache::preload;

constexpr std::size_t k_mib = std::size_t{1} << 20;

struct fake_calls {
  int mem_free = 0;
  int mem_free_async = 0;
  int mem_free_async_ptsz = 0;
  int ipc = 0;
  int range = 0;
  int sync = 0;
  int retain = 0;
  int pool_alloc = 0;
  int pool_alloc_ptsz = 0;
  cu_mem_pool last_pool = nullptr;
  cu_device device = 0;  // what cuCtxGetDevice answers; < 0: it fails (no context)
  cu_deviceptr last_ptr = 0;
  cu_stream last_stream = reinterpret_cast<cu_stream>(std::uintptr_t{0xdead});
  // The capture calls: what begin and end answer, what cuStreamIsCapturing says, and the number of
  // announced captures cucache's allocator had when the driver's begin ran.
  cu_result begin_rc = k_success;
  cu_result end_rc = k_success;
  int capturing = 0;  // CU_STREAM_CAPTURE_STATUS_NONE
  int begins = 0;
  int ends = 0;
  std::uint64_t announced_at_begin = 0;
  // The stream destructions: calls of cuStreamDestroy and _v2, and the process's count of
  // announced destructions when the driver's destroy ran.
  int destroys = 0;
  int destroys_v2 = 0;
  std::uint64_t destructions_at_destroy = 0;
};
fake_calls g_calls;

cu_mem_pool default_pool_of(cu_device dev) {
  return reinterpret_cast<cu_mem_pool>(std::uintptr_t{0x100} + static_cast<std::uintptr_t>(dev));
}

std::uint64_t allocator_announced() {
  return cucache::detail::registry::instance().allocator(0).announced_captures();
}
cu_result fake_begin() {
  ++g_calls.begins;
  g_calls.announced_at_begin = allocator_announced();
  if (g_calls.begin_rc == k_success) g_calls.capturing = 1;  // ACTIVE
  return g_calls.begin_rc;
}
cu_result fake_end() {
  ++g_calls.ends;
  if (g_calls.end_rc == k_success || g_calls.end_rc == 901) g_calls.capturing = 0;
  return g_calls.end_rc;
}

cucache::sim_backend& sim0() {
  return dynamic_cast<cucache::sim_backend&>(
      cucache::detail::registry::instance().allocator(0).backend());
}
// The driver's destroy: the simulated device's stream goes (its handle is the next stream's).
cu_result fake_destroy(cu_stream stream) {
  g_calls.destructions_at_destroy = cucache::detail::stream_id_cache::destructions();
  try {
    sim0().destroy_stream(stream);
  } catch (...) {
    return 400;  // CUDA_ERROR_INVALID_HANDLE
  }
  return k_success;
}

real_driver fake_driver() {
  real_driver d;
  d.mem_alloc = [](cu_deviceptr*, std::size_t) -> cu_result { return k_unknown; };
  d.mem_free = [](cu_deviceptr p) -> cu_result {
    ++g_calls.mem_free;
    g_calls.last_ptr = p;
    return k_success;
  };
  d.mem_free_async = [](cu_deviceptr p, cu_stream s) -> cu_result {
    ++g_calls.mem_free_async;
    g_calls.last_ptr = p;
    g_calls.last_stream = s;
    return k_success;
  };
  d.mem_free_async_ptsz = [](cu_deviceptr p, cu_stream s) -> cu_result {
    ++g_calls.mem_free_async_ptsz;
    g_calls.last_ptr = p;
    g_calls.last_stream = s;
    return k_success;
  };
  d.mem_get_info = [](std::size_t*, std::size_t*) -> cu_result { return k_unknown; };
  d.ipc_get_mem_handle = [](void*, cu_deviceptr p) -> cu_result {
    ++g_calls.ipc;
    g_calls.last_ptr = p;
    return k_success;
  };
  d.mem_get_address_range = [](cu_deviceptr* base, std::size_t* size, cu_deviceptr p) -> cu_result {
    ++g_calls.range;
    *base = p;
    *size = 1;
    return k_success;
  };
  d.ctx_synchronize = []() -> cu_result {
    ++g_calls.sync;
    return k_success;
  };
  d.mem_retain_allocation_handle = [](cu_mem_handle* h, void*) -> cu_result {
    ++g_calls.retain;
    *h = 1;
    return k_success;
  };
  d.mem_alloc_from_pool_async = [](cu_deviceptr* p, std::size_t, cu_mem_pool pool,
                                   cu_stream s) -> cu_result {
    ++g_calls.pool_alloc;
    g_calls.last_pool = pool;
    g_calls.last_stream = s;
    *p = 0x1000;
    return k_success;
  };
  d.mem_alloc_from_pool_async_ptsz = [](cu_deviceptr* p, std::size_t, cu_mem_pool pool,
                                        cu_stream s) -> cu_result {
    ++g_calls.pool_alloc_ptsz;
    g_calls.last_pool = pool;
    g_calls.last_stream = s;
    *p = 0x2000;
    return k_success;
  };
  d.ctx_get_device = [](cu_device* dev) -> cu_result {
    if (g_calls.device < 0) return 201;  // CUDA_ERROR_INVALID_CONTEXT
    *dev = g_calls.device;
    return k_success;
  };
  // Device n's default pool is the handle 0x100 + n.
  d.device_get_default_mem_pool = [](cu_mem_pool* pool, cu_device dev) -> cu_result {
    *pool = default_pool_of(dev);
    return k_success;
  };
  d.stream_begin_capture = [](cu_stream, int) -> cu_result { return fake_begin(); };
  d.stream_begin_capture_ptsz = [](cu_stream, int) -> cu_result { return fake_begin(); };
  d.stream_begin_capture_to_graph = [](cu_stream, cu_graph, const cu_graph_node*, const void*,
                                       std::size_t, int) -> cu_result { return fake_begin(); };
  d.stream_end_capture = [](cu_stream, cu_graph*) -> cu_result { return fake_end(); };
  d.stream_end_capture_ptsz = [](cu_stream, cu_graph*) -> cu_result { return fake_end(); };
  d.stream_is_capturing = [](cu_stream, int* status) -> cu_result {
    *status = g_calls.capturing;
    return k_success;
  };
  d.stream_is_capturing_ptsz = d.stream_is_capturing;
  d.stream_destroy = [](cu_stream s) -> cu_result {
    ++g_calls.destroys;
    return fake_destroy(s);
  };
  d.stream_destroy_v2 = [](cu_stream s) -> cu_result {
    ++g_calls.destroys_v2;
    return fake_destroy(s);
  };
  return d;
}

cu_stream stream_n(std::uintptr_t n) {
  return reinterpret_cast<cu_stream>(n << 8);
}

class PreloadRouting : public ::testing::Test {
 protected:
  void SetUp() override { restore(); }
  void TearDown() override { restore(); }
  static void restore() {
    ::unsetenv("CUCACHE_PRELOAD_FREE");
    set_captures_mode(captures_mode::announced);
    set_streams_mode(streams_mode::query);
    cucache::test::use_sim_registry();
    g_calls = {};
  }
  const real_driver real = fake_driver();
};

TEST_F(PreloadRouting, AllocationsAreCucachesAndFreesNeverReachTheDriver) {
  const auto before = stats().allocations.load();
  cu_deviceptr p = 0;
  ASSERT_EQ(mem_alloc(real, &p, 3 * k_mib, nullptr), k_success);
  ASSERT_NE(p, 0U);
  EXPECT_EQ(stats().allocations.load(), before + 1);
  EXPECT_GT(cucache::get().allocation_size(reinterpret_cast<void*>(p)), 0U);
  EXPECT_EQ(mem_free(real, p, free_mode::sync), k_success);
  EXPECT_EQ(g_calls.mem_free, 0);
  EXPECT_EQ(g_calls.sync, 1) << "a plain free of cucache memory synchronizes, as cudaFree does";

  ASSERT_EQ(mem_alloc(real, &p, 3 * k_mib, nullptr), k_success);
  EXPECT_EQ(mem_free(real, p, free_mode::stream), k_success);
  EXPECT_EQ(g_calls.sync, 1) << "stream mode does not synchronize";
  EXPECT_EQ(g_calls.mem_free, 0);
}

TEST_F(PreloadRouting, StreamOrderedAllocationAndFree) {
  cu_deviceptr p = 0;
  ASSERT_EQ(mem_alloc(real, &p, 1000, stream_n(1)), k_success);
  EXPECT_EQ(mem_free_async(real, p, stream_n(2), false), k_success);
  EXPECT_EQ(g_calls.mem_free_async, 0);
  // A _ptsz free of cucache memory on stream 0 is the per-thread stream's, still cucache's.
  ASSERT_EQ(mem_alloc(real, &p, 1000, k_stream_per_thread), k_success);
  EXPECT_EQ(mem_free_async(real, p, nullptr, true), k_success);
  EXPECT_EQ(g_calls.mem_free_async_ptsz, 0);
}

TEST_F(PreloadRouting, ForeignPointersGoToTheDriverUnchanged) {
  cu_deviceptr mine = 0;
  ASSERT_EQ(mem_alloc(real, &mine, k_mib, nullptr), k_success);  // the registry exists
  const cu_deviceptr foreign = 0x7000'0000'0000ULL;
  EXPECT_EQ(mem_free(real, foreign, free_mode::sync), k_success);
  EXPECT_EQ(g_calls.mem_free, 1);
  EXPECT_EQ(g_calls.last_ptr, foreign);
  EXPECT_EQ(g_calls.sync, 0) << "a foreign free is the driver's to synchronize";
  EXPECT_EQ(mem_free_async(real, foreign, nullptr, true), k_success);
  EXPECT_EQ(g_calls.mem_free_async_ptsz, 1);
  EXPECT_EQ(g_calls.last_stream, nullptr) << "the driver's _ptsz variant gets the caller's stream";
  EXPECT_EQ(mem_free_async(real, foreign, stream_n(3), false), k_success);
  EXPECT_EQ(g_calls.mem_free_async, 1);
  EXPECT_EQ(g_calls.last_stream, stream_n(3));
  EXPECT_EQ(mem_free(real, mine, free_mode::sync), k_success);
}

TEST_F(PreloadRouting, ForeignFreeBeforeAnyAllocationGoesToTheDriver) {
  EXPECT_EQ(mem_free(real, 0x1234000, free_mode::sync), k_success);
  EXPECT_EQ(g_calls.mem_free, 1);
  EXPECT_EQ(mem_free(real, 0, free_mode::sync), k_success) << "NULL is a no-op";
  EXPECT_EQ(g_calls.mem_free, 1);
}

TEST_F(PreloadRouting, DoubleAndInteriorFreesOfCucacheMemoryAreRefusedNotForwarded) {
  cu_deviceptr p = 0;
  cu_deviceptr keep = 0;
  ASSERT_EQ(mem_alloc(real, &p, 4096, nullptr), k_success);
  ASSERT_EQ(mem_alloc(real, &keep, 4096, nullptr), k_success);
  EXPECT_EQ(mem_free(real, keep + 256, free_mode::sync), k_invalid_value);
  EXPECT_NE(std::string(cucacheGetLastErrorMessage()).find("into the live allocation"),
            std::string::npos)
      << cucacheGetLastErrorMessage();
  ASSERT_EQ(mem_free(real, p, free_mode::stream), k_success);
  const auto bad = stats().bad_frees.load();
  EXPECT_EQ(mem_free(real, p, free_mode::sync), k_invalid_value);
  EXPECT_EQ(mem_free_async(real, p, nullptr, false), k_invalid_value);
  EXPECT_EQ(stats().bad_frees.load(), bad + 2);
  EXPECT_EQ(g_calls.mem_free, 0) << "forwarding would free a cucache segment under live blocks";
  EXPECT_EQ(g_calls.mem_free_async, 0);
  EXPECT_EQ(mem_free(real, keep, free_mode::sync), k_success);
}

TEST_F(PreloadRouting, ZeroBytesAndNullArgumentsAreInvalid) {
  cu_deviceptr p = 1;
  EXPECT_EQ(mem_alloc(real, &p, 0, nullptr), k_invalid_value);
  EXPECT_EQ(p, 0U);
  EXPECT_EQ(mem_alloc(real, nullptr, 16, nullptr), k_invalid_value);
  std::size_t f = 0;
  EXPECT_EQ(mem_get_info(real, &f, nullptr), k_invalid_value);
}

TEST_F(PreloadRouting, PitchedAllocationFollowsTheDriversRules) {
  cu_deviceptr p = 0;
  std::size_t pitch = 0;
  ASSERT_EQ(mem_alloc_pitch(real, &p, &pitch, 100, 10, 4), k_success);
  EXPECT_EQ(pitch, 512U);
  EXPECT_GE(cucache::get().allocation_size(reinterpret_cast<void*>(p)), 512U * 10);
  EXPECT_EQ(mem_free(real, p, free_mode::sync), k_success);
  EXPECT_EQ(mem_alloc_pitch(real, &p, &pitch, 100, 10, 3), k_invalid_value);
  EXPECT_EQ(mem_alloc_pitch(real, &p, &pitch, 0, 10, 4), k_invalid_value);
  EXPECT_EQ(mem_alloc_pitch(real, &p, &pitch, static_cast<std::size_t>(-1), 2, 4), k_invalid_value);
  EXPECT_EQ(pitch_for(512), 512U);
  EXPECT_EQ(pitch_for(513), 1024U);
}

TEST_F(PreloadRouting, MemGetInfoIsCucachesView) {
  ::setenv("CUCACHE_CONF", "memory_limit:64MiB", 1);
  cucache::detail::reset_for_testing();
  cu_deviceptr p = 0;
  ASSERT_EQ(mem_alloc(real, &p, 16 * k_mib, nullptr), k_success);
  std::size_t f = 0;
  std::size_t t = 0;
  ASSERT_EQ(mem_get_info(real, &f, &t), k_success);
  std::size_t cf = 0;
  std::size_t ct = 0;
  ASSERT_EQ(cucacheMemGetInfo(&cf, &ct), cudaSuccess);
  EXPECT_EQ(t, 64 * k_mib);
  EXPECT_EQ(f, cf);
  EXPECT_EQ(t, ct);
  EXPECT_EQ(f, 48 * k_mib);
  EXPECT_EQ(mem_free(real, p, free_mode::sync), k_success);
}

TEST_F(PreloadRouting, OutOfMemoryIsTheDriversCode) {
  ::setenv("CUCACHE_CONF", "memory_limit:64MiB", 1);
  cucache::detail::reset_for_testing();
  cu_deviceptr p = 1;
  EXPECT_EQ(mem_alloc(real, &p, 128 * k_mib, nullptr), k_out_of_memory);
  EXPECT_EQ(p, 0U);
}

TEST_F(PreloadRouting, BadConfigurationIsNotInitialized) {
  ::setenv("CUCACHE_CONF", "no_such_key:1", 1);
  cucache::detail::reset_for_testing();
  cu_deviceptr p = 0;
  EXPECT_EQ(mem_alloc(real, &p, 16, nullptr), k_not_initialized);
}

TEST_F(PreloadRouting, IpcOnCucacheMemoryIsRefused) {
  cu_deviceptr p = 0;
  ASSERT_EQ(mem_alloc(real, &p, 8192, nullptr), k_success);
  unsigned char handle[64] = {};
  const auto refused = stats().refused.load();
  EXPECT_EQ(ipc_get_mem_handle(real, handle, p), k_not_supported);
  EXPECT_EQ(ipc_get_mem_handle(real, handle, p + 100), k_not_supported);
  EXPECT_EQ(g_calls.ipc, 0);
  EXPECT_EQ(stats().refused.load(), refused + 2);
  // Freed, the block stays in cucache's segment: still refused.
  ASSERT_EQ(mem_free(real, p, free_mode::stream), k_success);
  EXPECT_EQ(ipc_get_mem_handle(real, handle, p), k_not_supported);
  // Foreign memory is the driver's.
  EXPECT_EQ(ipc_get_mem_handle(real, handle, 0x7000'0000'0000ULL), k_success);
  EXPECT_EQ(g_calls.ipc, 1);
}

// Two allocations carved from one segment (or one expandable range): each answers its own start
// and size, as the driver does for its own allocations, never the segment's.
void check_address_ranges(const real_driver& real) {
  cu_deviceptr a = 0;
  cu_deviceptr b = 0;
  ASSERT_EQ(mem_alloc(real, &a, 8192, nullptr), k_success);
  ASSERT_EQ(mem_alloc(real, &b, 3000, nullptr), k_success);
  const std::size_t a_size = cucache::get(0).allocation_size(reinterpret_cast<void*>(a));
  const std::size_t b_size = cucache::get(0).allocation_size(reinterpret_cast<void*>(b));
  ASSERT_GE(a_size, 8192U);
  ASSERT_GE(b_size, 3000U);
  const auto answered = stats().address_ranges.load();
  for (const cu_deviceptr inside : {a, a + 1, a + 8191}) {
    cu_deviceptr base = 0;
    std::size_t size = 0;
    EXPECT_EQ(mem_get_address_range(real, &base, &size, inside), k_success);
    EXPECT_EQ(base, a);
    EXPECT_EQ(size, a_size);
  }
  cu_deviceptr base = 0;
  std::size_t size = 0;
  EXPECT_EQ(mem_get_address_range(real, &base, &size, b + 2999), k_success);
  EXPECT_EQ(base, b);
  EXPECT_EQ(size, b_size);
  // Either output may be NULL, as with the driver.
  EXPECT_EQ(mem_get_address_range(real, nullptr, &size, b), k_success);
  EXPECT_EQ(mem_get_address_range(real, &base, nullptr, b), k_success);
  EXPECT_EQ(stats().address_ranges.load(), answered + 6);
  EXPECT_EQ(g_calls.range, 0);
  // Freed, the address lies in no allocation: not found, as the driver says of freed memory.
  ASSERT_EQ(mem_free(real, b, free_mode::stream), k_success);
  EXPECT_EQ(mem_get_address_range(real, &base, &size, b), k_not_found);
  EXPECT_EQ(g_calls.range, 0);
  // Foreign memory is the driver's.
  EXPECT_EQ(mem_get_address_range(real, &base, &size, 0x7000'0000'0000ULL), k_success);
  EXPECT_EQ(g_calls.range, 1);
  ASSERT_EQ(mem_free(real, a, free_mode::stream), k_success);
}

TEST_F(PreloadRouting, AddressRangeOfCucacheMemoryIsTheAllocationsOwn) {
  for (const char* conf : {"", "expandable_segments:True"}) {
    SCOPED_TRACE(conf);
    ::setenv("CUCACHE_CONF", conf, 1);
    cucache::detail::reset_for_testing();
    g_calls = {};
    check_address_ranges(real);
  }
}

TEST_F(PreloadRouting, AllocationHandleOfCucacheMemoryIsRefusedAsNonVmmMemory) {
  for (const char* conf : {"", "expandable_segments:True"}) {
    ::setenv("CUCACHE_CONF", conf, 1);
    cucache::detail::reset_for_testing();
    g_calls = {};
    cu_deviceptr p = 0;
    ASSERT_EQ(mem_alloc(real, &p, 3 * k_mib, nullptr), k_success);
    cu_mem_handle handle = 0;
    void* addr = reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
    EXPECT_EQ(mem_retain_allocation_handle(real, &handle, addr), k_invalid_value) << conf;
    EXPECT_EQ(mem_retain_allocation_handle(real, &handle, static_cast<char*>(addr) + 4096),
              k_invalid_value)
        << conf;
    EXPECT_EQ(g_calls.retain, 0) << conf;
    ASSERT_EQ(mem_free(real, p, free_mode::stream), k_success);
    EXPECT_EQ(mem_retain_allocation_handle(
                  real, &handle, reinterpret_cast<void*>(std::uintptr_t{0x7000'0000'0000ULL})),
              k_success);
    EXPECT_EQ(g_calls.retain, 1) << conf;
  }
}

TEST_F(PreloadRouting, ForkedChildFailsFreesOfTheParentsPointersInsteadOfForwardingThem) {
  cu_deviceptr p = 0;
  ASSERT_EQ(mem_alloc(real, &p, 8192, nullptr), k_success);
  std::fflush(nullptr);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Exit codes name the first failed expectation; the driver's counters are the child's copy.
    int code = 0;
    if (mem_free(real, p, free_mode::sync) != k_not_initialized) code = 10;
    if (code == 0 && mem_free(real, p, free_mode::stream) != k_not_initialized) code = 11;
    if (code == 0 && mem_free_async(real, p, nullptr, false) != k_not_initialized) code = 12;
    if (code == 0 && mem_free(real, 0x7000'0000'0000ULL, free_mode::sync) != k_not_initialized)
      code = 13;
    if (code == 0 && (g_calls.mem_free != 0 || g_calls.mem_free_async != 0 || g_calls.sync != 0))
      code = 14;
    if (code == 0 &&
        std::string(cucache::detail::thread_last_error()).find("forked") == std::string::npos)
      code = 15;
    cu_deviceptr q = 0;
    if (code == 0 && mem_alloc(real, &q, 16, nullptr) != k_not_initialized) code = 16;
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's expectation " << WEXITSTATUS(status);
  // The parent still owns and frees it.
  EXPECT_EQ(mem_free(real, p, free_mode::stream), k_success);
}

TEST_F(PreloadRouting, ReportPathGivesEachProcessItsOwn) {
  EXPECT_EQ(report_path("/tmp/r.txt", 42), "/tmp/r.txt");
  EXPECT_EQ(report_path("/tmp/r.%p.txt", 42), "/tmp/r.42.txt");
  EXPECT_EQ(report_path("%p-%p", 7), "7-7");
  EXPECT_EQ(report_path("a%", 7), "a%");
  EXPECT_EQ(report_path("stderr", 7), "stderr");
}

TEST_F(PreloadRouting, FreeModeFromEnvironment) {
  EXPECT_EQ(free_mode_from_env(), free_mode::sync);
  ::setenv("CUCACHE_PRELOAD_FREE", "stream", 1);
  EXPECT_EQ(free_mode_from_env(), free_mode::stream);
  ::setenv("CUCACHE_PRELOAD_FREE", "sync", 1);
  EXPECT_EQ(free_mode_from_env(), free_mode::sync);
  ::setenv("CUCACHE_PRELOAD_FREE", "fast", 1);
  EXPECT_THROW(static_cast<void>(free_mode_from_env()), cucache::environment_error);
}

TEST_F(PreloadRouting, DriverCodes) {
  EXPECT_EQ(driver_code(cudaSuccess), k_success);
  EXPECT_EQ(driver_code(cudaErrorMemoryAllocation), k_out_of_memory);
  EXPECT_EQ(driver_code(cudaErrorInvalidValue), k_invalid_value);
  EXPECT_EQ(driver_code(cudaErrorInitializationError), k_not_initialized);
  EXPECT_EQ(driver_code(cudaErrorInvalidDevice), k_invalid_device);
  EXPECT_EQ(driver_code(cudaErrorLaunchFailure), k_unknown);
}

TEST_F(PreloadRouting, ReportShowsCountsAndTheSummary) {
  cu_deviceptr p = 0;
  ASSERT_EQ(mem_alloc(real, &p, 5 * k_mib, nullptr), k_success);
  const std::string text = report_text();
  EXPECT_NE(text.find("cucache preload report:"), std::string::npos) << text;
  EXPECT_NE(text.find("--- device 0 ---"), std::string::npos) << text;
  EXPECT_NE(text.find("backend sim"), std::string::npos) << text;
  EXPECT_EQ(mem_free(real, p, free_mode::sync), k_success);
}

}  // namespace

TEST_F(PreloadRouting, AllocationsFromTheDefaultPoolAreCucachesAndOtherPoolsAreTheDrivers) {
  const auto allocations = stats().allocations.load();
  const auto pooled = stats().pool_allocations.load();
  const auto forwarded = stats().forwarded_pool_allocations.load();
  // The default pool of the context's device: cucache's, ordered on the stream as cuMemAllocAsync.
  cu_deviceptr p = 0;
  ASSERT_EQ(mem_alloc_from_pool_async(real, &p, k_mib, default_pool_of(0), stream_n(1), false),
            k_success);
  ASSERT_NE(p, 0U);
  EXPECT_EQ(g_calls.pool_alloc, 0);
  EXPECT_EQ(stats().allocations.load(), allocations + 1);
  EXPECT_EQ(stats().pool_allocations.load(), pooled + 1);
  EXPECT_GE(cucache::get().allocation_size(reinterpret_cast<void*>(p)), k_mib);
  // Its free is cucache's (cuMemFreeAsync), never the driver's.
  ASSERT_EQ(mem_free_async(real, p, stream_n(1), false), k_success);
  EXPECT_EQ(g_calls.mem_free_async, 0);

  // A pool the program made, or another device's default pool: the driver's, untouched.
  const auto own_pool = reinterpret_cast<cu_mem_pool>(std::uintptr_t{0x5000});
  cu_deviceptr q = 0;
  ASSERT_EQ(mem_alloc_from_pool_async(real, &q, k_mib, own_pool, stream_n(2), false), k_success);
  EXPECT_EQ(q, 0x1000U);
  EXPECT_EQ(g_calls.pool_alloc, 1);
  EXPECT_EQ(g_calls.last_pool, own_pool);
  EXPECT_EQ(g_calls.last_stream, stream_n(2));
  ASSERT_EQ(mem_alloc_from_pool_async(real, &q, k_mib, default_pool_of(1), nullptr, true),
            k_success);
  EXPECT_EQ(q, 0x2000U);
  EXPECT_EQ(g_calls.pool_alloc_ptsz, 1);
  EXPECT_EQ(g_calls.last_stream, nullptr);  // the _ptsz entry point gets the program's stream 0
  // No context: the driver cannot say which pool is the default, so the driver answers.
  g_calls.device = -1;
  ASSERT_EQ(mem_alloc_from_pool_async(real, &q, k_mib, default_pool_of(0), nullptr, false),
            k_success);
  EXPECT_EQ(g_calls.pool_alloc, 2);
  EXPECT_EQ(stats().allocations.load(), allocations + 1);
  EXPECT_EQ(stats().pool_allocations.load(), pooled + 1);
  EXPECT_EQ(stats().forwarded_pool_allocations.load(), forwarded + 3);
  // A zero-byte request from the default pool is refused as cuMemAllocAsync's is.
  g_calls.device = 0;
  EXPECT_EQ(mem_alloc_from_pool_async(real, &q, 0, default_pool_of(0), nullptr, false),
            k_invalid_value);
  EXPECT_EQ(g_calls.pool_alloc, 2);
}

// The capture calls (docs/preload.md, "Captures"): the shim announces each capture to cucache
// before the driver begins it, withdraws it when the driver refuses to begin, and ends it once the
// stream no longer captures; allocations outside captures then skip the capture query.
TEST_F(PreloadRouting, CapturesAreAnnouncedBeforeTheDriverBeginsThemAndEndedAfter) {
  cu_deviceptr p = 0;
  ASSERT_EQ(mem_alloc(real, &p, k_mib, nullptr), k_success);
  cucache::device_allocator& a = cucache::detail::registry::instance().allocator(0);
  EXPECT_TRUE(a.captures_announced());
  ASSERT_EQ(stream_begin_capture(real, stream_n(1), 0, false), k_success);
  EXPECT_EQ(g_calls.announced_at_begin, 1U);  // announced before the driver began it
  EXPECT_EQ(a.announced_captures(), 1U);
  EXPECT_EQ(announced_capture_count(), 1U);
  cu_graph graph = nullptr;
  ASSERT_EQ(stream_end_capture(real, stream_n(1), &graph, false), k_success);
  EXPECT_EQ(a.announced_captures(), 0U);
  EXPECT_EQ(announced_capture_count(), 0U);
  // cuStreamBeginCaptureToGraph the same way.
  ASSERT_EQ(stream_begin_capture_to_graph(real, stream_n(2), nullptr, nullptr, nullptr, 0, 0,
                                          false),
            k_success);
  EXPECT_EQ(a.announced_captures(), 1U);
  ASSERT_EQ(stream_end_capture(real, stream_n(2), &graph, false), k_success);
  EXPECT_EQ(a.announced_captures(), 0U);
  EXPECT_EQ(mem_free(real, p, free_mode::stream), k_success);
}

TEST_F(PreloadRouting, ACaptureTheDriverRefusesIsNotLeftAnnounced) {
  g_calls.begin_rc = 900;  // CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (the legacy stream, say)
  EXPECT_EQ(stream_begin_capture(real, nullptr, 0, false), 900);
  EXPECT_EQ(g_calls.announced_at_begin, 1U);
  EXPECT_EQ(allocator_announced(), 0U);
  EXPECT_EQ(announced_capture_count(), 0U);
}

TEST_F(PreloadRouting, AnEndThatLeavesTheStreamCapturingKeepsTheAnnouncement) {
  ASSERT_EQ(stream_begin_capture(real, stream_n(3), 0, false), k_success);
  g_calls.end_rc = 908;  // CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD: the capture goes on
  cu_graph graph = nullptr;
  EXPECT_EQ(stream_end_capture(real, stream_n(3), &graph, false), 908);
  EXPECT_EQ(allocator_announced(), 1U);
  g_calls.end_rc = 901;  // CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: ended, no graph
  EXPECT_EQ(stream_end_capture(real, stream_n(3), &graph, false), 901);
  EXPECT_EQ(allocator_announced(), 0U);
  EXPECT_EQ(announced_capture_count(), 0U);
}

TEST_F(PreloadRouting, TheEndOfACaptureTheShimDidNotBeginChangesNothing) {
  cu_graph graph = nullptr;
  EXPECT_EQ(stream_end_capture(real, stream_n(4), &graph, false), k_success);
  EXPECT_EQ(g_calls.ends, 1);
  EXPECT_EQ(allocator_announced(), 0U);
}

TEST_F(PreloadRouting, PerThreadStreamCapturesBelongToTheirThread) {
  // Stream 0 of a _ptsz entry point is the calling thread's own stream.
  ASSERT_EQ(stream_begin_capture(real, nullptr, 0, true), k_success);
  EXPECT_EQ(allocator_announced(), 1U);
  std::thread other([&] {
    cu_graph graph = nullptr;
    g_calls.capturing = 0;  // the other thread's stream is not capturing
    EXPECT_EQ(stream_end_capture(real, nullptr, &graph, true), k_success);
  });
  other.join();
  EXPECT_EQ(allocator_announced(), 1U);  // another thread's per-thread stream: not this capture
  cu_graph graph = nullptr;
  EXPECT_EQ(stream_end_capture(real, k_stream_per_thread, &graph, true), k_success);
  EXPECT_EQ(allocator_announced(), 0U);
}

TEST_F(PreloadRouting, QueryModeAnnouncesNothing) {
  set_captures_mode(captures_mode::query);
  cu_deviceptr p = 0;
  ASSERT_EQ(mem_alloc(real, &p, k_mib, nullptr), k_success);
  EXPECT_FALSE(cucache::detail::registry::instance().allocator(0).captures_announced());
  ASSERT_EQ(stream_begin_capture(real, stream_n(5), 0, false), k_success);
  EXPECT_EQ(g_calls.announced_at_begin, 0U);
  EXPECT_EQ(announced_capture_count(), 0U);
  cu_graph graph = nullptr;
  EXPECT_EQ(stream_end_capture(real, stream_n(5), &graph, false), k_success);
  EXPECT_EQ(mem_free(real, p, free_mode::stream), k_success);
}

TEST_F(PreloadRouting, CapturesModeFromEnvironment) {
  ::unsetenv("CUCACHE_PRELOAD_CAPTURES");
  EXPECT_EQ(captures_mode_from_env(), captures_mode::announced);
  ::setenv("CUCACHE_PRELOAD_CAPTURES", "query", 1);
  EXPECT_EQ(captures_mode_from_env(), captures_mode::query);
  ::setenv("CUCACHE_PRELOAD_CAPTURES", "announced", 1);
  EXPECT_EQ(captures_mode_from_env(), captures_mode::announced);
  ::setenv("CUCACHE_PRELOAD_CAPTURES", "on", 1);
  try {
    static_cast<void>(captures_mode_from_env());
    ADD_FAILURE() << "no error for CUCACHE_PRELOAD_CAPTURES=on";
  } catch (const cucache::environment_error& e) {
    EXPECT_NE(std::string(e.what()).find("CUCACHE_PRELOAD_CAPTURES: 'on'"), std::string::npos)
        << e.what();
  }
  ::unsetenv("CUCACHE_PRELOAD_CAPTURES");
}

// The stream destructions (docs/preload.md, "Stream destructions"): with
// CUCACHE_PRELOAD_STREAMS=announced each thread caches the id of the stream it last allocated on,
// and the shim's cuStreamDestroy announces each destruction before the driver performs it, so the
// stream that next gets the dead one's handle asks its own id.
namespace {

using cucache::sim_call;

cu_stream created_stream() {
  return static_cast<cu_stream>(sim0().create_stream());
}

// Allocates `n` blocks on `stream`, then frees them there; the stream id calls the allocations
// made (and in `capture_queries`, when given, their capture status calls).
std::uint64_t id_queries_of_allocations(const real_driver& real, cu_stream stream, int n,
                                        std::uint64_t* capture_queries = nullptr) {
  const std::uint64_t ids = sim0().calls(sim_call::stream_id);
  const std::uint64_t queries = sim0().calls(sim_call::capture_status);
  std::vector<cu_deviceptr> blocks(static_cast<std::size_t>(n));
  for (cu_deviceptr& p : blocks) {
    EXPECT_EQ(mem_alloc(real, &p, 4096, stream), k_success);
  }
  const std::uint64_t asked = sim0().calls(sim_call::stream_id) - ids;
  if (capture_queries != nullptr) {
    *capture_queries = sim0().calls(sim_call::capture_status) - queries;
  }
  for (const cu_deviceptr p : blocks) EXPECT_EQ(mem_free_async(real, p, stream, false), k_success);
  return asked;
}

}  // namespace

TEST_F(PreloadRouting, AnnouncedStreamsAskTheIdOnceUntilTheShimDestroysAStream) {
  set_streams_mode(streams_mode::announced);
  cu_deviceptr p = 0;
  ASSERT_EQ(mem_alloc(real, &p, k_mib, nullptr), k_success);  // builds and arms the registry
  const cucache::device_allocator& a = cucache::detail::registry::instance().allocator(0);
  EXPECT_TRUE(a.captures_announced());
  EXPECT_TRUE(a.stream_destructions_announced());
  const cu_stream s = created_stream();
  std::uint64_t queries = 1;
  EXPECT_EQ(id_queries_of_allocations(real, s, 6, &queries), 1U)
      << "asked once, then the thread's cache";
  EXPECT_EQ(queries, 0U) << "no capture is underway";
  EXPECT_EQ(id_queries_of_allocations(real, s, 4), 0U);

  // The shim's cuStreamDestroy_v2: announced, then the driver's destroy.
  const std::uint64_t destructions = cucache::detail::stream_id_cache::destructions();
  const std::uint64_t announced = stats().stream_destructions.load();
  ASSERT_EQ(stream_destroy(real, s, true), k_success);
  EXPECT_EQ(g_calls.destroys_v2, 1);
  EXPECT_EQ(g_calls.destroys, 0);
  EXPECT_EQ(g_calls.destructions_at_destroy, destructions + 1) << "announced before the driver's";
  EXPECT_EQ(stats().stream_destructions.load(), announced + 1);
  EXPECT_TRUE(sim0().stream_destroyed(s));

  // The next stream gets the dead one's handle, as from the runtime: its first allocation asks
  // its own id (a cached one would be the dead stream's, and serve from the dead stream's pool).
  const cu_stream t = created_stream();
  ASSERT_EQ(t, s) << "the sim hands the destroyed stream's handle to the next stream";
  EXPECT_EQ(id_queries_of_allocations(real, t, 5), 1U);
  EXPECT_EQ(id_queries_of_allocations(real, t, 5), 0U);

  // The CUDA 2.0 cuStreamDestroy the same way.
  ASSERT_EQ(stream_destroy(real, t, false), k_success);
  EXPECT_EQ(g_calls.destroys, 1);
  EXPECT_EQ(g_calls.destructions_at_destroy, destructions + 2);
  EXPECT_EQ(stats().stream_destructions.load(), announced + 2);
  const cu_stream u = created_stream();
  EXPECT_EQ(id_queries_of_allocations(real, u, 3), 1U);
  ASSERT_EQ(stream_destroy(real, u, true), k_success);
  EXPECT_EQ(mem_free(real, p, free_mode::stream), k_success);

  const std::string report = report_text();
  EXPECT_NE(report.find("streams: announced (CUCACHE_PRELOAD_STREAMS), "), std::string::npos)
      << report;
}

TEST_F(PreloadRouting, QueriedStreamsAskTheIdAtEveryAllocationAndDestructionsAreStillAnnounced) {
  cu_deviceptr p = 0;
  ASSERT_EQ(mem_alloc(real, &p, k_mib, nullptr), k_success);
  EXPECT_TRUE(cucache::detail::registry::instance().allocator(0).captures_announced());
  EXPECT_FALSE(cucache::detail::registry::instance().allocator(0).stream_destructions_announced());
  const cu_stream s = created_stream();
  EXPECT_EQ(id_queries_of_allocations(real, s, 6), 6U);
  const std::uint64_t destructions = cucache::detail::stream_id_cache::destructions();
  const std::uint64_t announced = stats().stream_destructions.load();
  ASSERT_EQ(stream_destroy(real, s, true), k_success);
  EXPECT_EQ(g_calls.destructions_at_destroy, destructions + 1);
  EXPECT_EQ(stats().stream_destructions.load(), announced + 1);
  // The driver's refusal is its answer (a destroyed stream, say).
  EXPECT_EQ(stream_destroy(real, s, true), 400);
  EXPECT_EQ(g_calls.destroys_v2, 2);
  // A driver without the entry point: nothing destroyed, nothing announced.
  real_driver none = fake_driver();
  none.stream_destroy_v2 = nullptr;
  EXPECT_EQ(stream_destroy(none, s, true), k_not_found);
  EXPECT_EQ(stats().stream_destructions.load(), announced + 2);
  EXPECT_EQ(mem_free(real, p, free_mode::stream), k_success);
  const std::string report = report_text();
  EXPECT_NE(report.find("streams: query (CUCACHE_PRELOAD_STREAMS), "), std::string::npos) << report;
}

TEST_F(PreloadRouting, AnnouncedStreamsNeedAnnouncedCaptures) {
  set_captures_mode(captures_mode::query);
  set_streams_mode(streams_mode::announced);
  cu_deviceptr p = 0;
  ASSERT_EQ(mem_alloc(real, &p, k_mib, nullptr), k_success);
  const cucache::device_allocator& a = cucache::detail::registry::instance().allocator(0);
  EXPECT_FALSE(a.captures_announced());
  EXPECT_FALSE(a.stream_destructions_announced());
  const cu_stream s = created_stream();
  std::uint64_t queries = 0;
  EXPECT_EQ(id_queries_of_allocations(real, s, 4, &queries), 4U);
  EXPECT_EQ(queries, 4U) << "every allocation asks the capture status, then the id";
  ASSERT_EQ(stream_destroy(real, s, true), k_success);
  EXPECT_EQ(mem_free(real, p, free_mode::stream), k_success);
  const std::string report = report_text();
  EXPECT_NE(report.find("streams: announced (CUCACHE_PRELOAD_STREAMS), without effect: "
                        "CUCACHE_PRELOAD_CAPTURES=query, "),
            std::string::npos)
      << report;
}

TEST_F(PreloadRouting, StreamsModeFromEnvironment) {
  ::unsetenv("CUCACHE_PRELOAD_STREAMS");
  EXPECT_EQ(streams_mode_from_env(), streams_mode::query);
  ::setenv("CUCACHE_PRELOAD_STREAMS", "", 1);
  EXPECT_EQ(streams_mode_from_env(), streams_mode::query);
  ::setenv("CUCACHE_PRELOAD_STREAMS", "announced", 1);
  EXPECT_EQ(streams_mode_from_env(), streams_mode::announced);
  ::setenv("CUCACHE_PRELOAD_STREAMS", "query", 1);
  EXPECT_EQ(streams_mode_from_env(), streams_mode::query);
  ::setenv("CUCACHE_PRELOAD_STREAMS", "cached", 1);
  try {
    static_cast<void>(streams_mode_from_env());
    ADD_FAILURE() << "no error for CUCACHE_PRELOAD_STREAMS=cached";
  } catch (const cucache::environment_error& e) {
    EXPECT_NE(std::string(e.what()).find("CUCACHE_PRELOAD_STREAMS: 'cached'"), std::string::npos)
        << e.what();
  }
  ::unsetenv("CUCACHE_PRELOAD_STREAMS");
}
