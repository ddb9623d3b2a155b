// GPU-tier tests of cuda_backend on a real device: segments, virtual memory (including moving a
// physical handle between addresses), events and memory info. Each test skips with a one-line
// reason where there is no usable GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <thread>
#include <vector>

#include "cucache/cuda_backend.hpp"
#include "cucache/errors.hpp"
#include "gpu/gpu_test_support.hpp"

namespace {

// Evaluates `expr` once, so the failure message reports the same call's error.
#define CUDA_OK(expr)                                                                          \
  do {                                                                                         \
    const cudaError_t cuda_ok_code = (expr);                                                   \
    ASSERT_EQ(cuda_ok_code, cudaSuccess) << #expr << ": " << cudaGetErrorString(cuda_ok_code); \
  } while (false)

constexpr std::size_t gib = std::size_t{1} << 30;

__global__ void fill(std::uint32_t* data, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    data[i] = seed ^ static_cast<std::uint32_t>(i * 2654435761u);
  }
}

__global__ void count_mismatches(const std::uint32_t* data, std::size_t n, std::uint32_t seed,
                                 unsigned long long* mismatches) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    if (data[i] != (seed ^ static_cast<std::uint32_t>(i * 2654435761u)))
      atomicAdd(mismatches, 1ull);
  }
}

__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Writes a pattern through `data` with one kernel and counts mismatches with another, so both the
// store and the load path through the mapping are exercised.
unsigned long long write_then_count(std::uint32_t* data, std::size_t bytes, std::uint32_t seed,
                                    bool write = true) {
  const std::size_t n = bytes / sizeof(std::uint32_t);
  unsigned long long* mismatches = nullptr;
  EXPECT_EQ(cudaMalloc(&mismatches, sizeof(*mismatches)), cudaSuccess);
  EXPECT_EQ(cudaMemset(mismatches, 0, sizeof(*mismatches)), cudaSuccess);
  if (write) fill<<<256, 256>>>(data, n, seed);
  count_mismatches<<<256, 256>>>(data, n, seed, mismatches);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  unsigned long long result = ~0ull;
  EXPECT_EQ(cudaMemcpy(&result, mismatches, sizeof(result), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaFree(mismatches), cudaSuccess);
  return result;
}

TEST(CudaBackendGpu, ConstructsAndReportsDevice) {
  CUCACHE_REQUIRE_GPU();
  cucache::cuda_backend backend(0);
  EXPECT_EQ(backend.device(), 0);
  EXPECT_STREQ(backend.name(), "cuda");
  EXPECT_TRUE(cucache::cuda_unavailable_reason().empty());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// The stream queries go to the driver's entry points, with the runtime's wrappers as fallback: the
// answers must be the runtime's, for user streams, the special handles, a thread that has never
// called CUDA (no current context: the driver refuses the special handles there) and a capturing
// stream (its id is never asked: that would invalidate the capture).
TEST(CudaBackendGpu, StreamQueriesAgreeWithTheRuntime) {
  CUCACHE_REQUIRE_GPU();
  cucache::cuda_backend backend(0);
  CUDA_OK(cudaSetDevice(0));
  cudaStream_t s = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned long long id = 0;
  CUDA_OK(cudaStreamGetId(s, &id));
  EXPECT_EQ(backend.stream_id(s), id);
  cucache::stream_identity who = backend.identify(s);
  EXPECT_EQ(who.capture.state, cucache::capture_state::none);
  EXPECT_EQ(who.id, id);
  for (cudaStream_t special : {cudaStreamPerThread, cudaStreamLegacy}) {
    CUDA_OK(cudaStreamGetId(special, &id));
    EXPECT_EQ(backend.identify(special).id, id);
  }
  // A fresh thread with no current context, asking the backend first.
  unsigned long long backend_id = 0;
  unsigned long long runtime_id = 1;
  std::thread([&] {
    backend_id = backend.identify(cudaStreamPerThread).id;
    static_cast<void>(cudaStreamGetId(cudaStreamPerThread, &runtime_id));
  }).join();
  EXPECT_EQ(backend_id, runtime_id);

  // Capturing: the capture is reported, its id is not asked, and the capture stays valid.
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  who = backend.identify(s);
  EXPECT_EQ(who.capture.state, cucache::capture_state::active);
  EXPECT_NE(who.capture.id, 0u);
  EXPECT_EQ(who.id, 0u);
  EXPECT_EQ(backend.capture_status(s).state, cucache::capture_state::active);
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamEndCapture(s, &graph));  // fails if the capture was invalidated
  CUDA_OK(cudaGraphDestroy(graph));
  CUDA_OK(cudaStreamDestroy(s));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(CudaBackendGpu, SegmentRoundTrip) {
  CUCACHE_REQUIRE_GPU();
  cucache::cuda_backend backend(0);
  constexpr std::size_t bytes = std::size_t{64} << 20;
  void* ptr = backend.segment_malloc(bytes);
  ASSERT_NE(ptr, nullptr);
  EXPECT_EQ(write_then_count(static_cast<std::uint32_t*>(ptr), bytes, 0x1234u), 0ull);
  backend.segment_free(ptr);
}

TEST(CudaBackendGpu, ImpossibleSegmentReturnsNullAndLeavesNoError) {
  CUCACHE_REQUIRE_GPU();
  cucache::cuda_backend backend(0);
  EXPECT_EQ(backend.segment_malloc(std::size_t{1} << 50), nullptr);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  void* ptr = backend.segment_malloc(std::size_t{1} << 20);
  ASSERT_NE(ptr, nullptr);
  backend.segment_free(ptr);
  void* raw = nullptr;
  CUDA_OK(cudaMalloc(&raw, 1 << 20));
  CUDA_OK(cudaFree(raw));
}

TEST(CudaBackendGpu, GranularityIsAPowerOfTwo) {
  CUCACHE_REQUIRE_GPU();
  cucache::cuda_backend backend(0);
  const std::size_t g = backend.vm_granularity();
  if (g == 0) GTEST_SKIP() << "device 0 has no virtual memory management support";
  EXPECT_EQ(g & (g - 1), 0u) << g;
}

TEST(CudaBackendGpu, VirtualMemoryMapWriteReadAndTeardown) {
  CUCACHE_REQUIRE_GPU();
  cucache::cuda_backend backend(0);
  const std::size_t g = backend.vm_granularity();
  if (g == 0) GTEST_SKIP() << "device 0 has no virtual memory management support";
  const std::size_t bytes = 4 * g;
  void* va = backend.va_reserve(bytes);
  ASSERT_NE(va, nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(va) % g, 0u);
  const std::optional<cucache::phys_handle> handle = backend.phys_create(bytes);
  ASSERT_TRUE(handle.has_value());
  backend.map(va, bytes, *handle);
  backend.set_access(va, bytes);
  EXPECT_EQ(write_then_count(static_cast<std::uint32_t*>(va), bytes, 0xabcdu), 0ull);
  CUDA_OK(cudaDeviceSynchronize());
  backend.unmap(va, bytes);
  backend.phys_release(*handle);
  backend.va_free(va, bytes);
}

TEST(CudaBackendGpu, PhysicalHandleKeepsContentsWhenMovedToAnotherAddress) {
  CUCACHE_REQUIRE_GPU();
  cucache::cuda_backend backend(0);
  const std::size_t g = backend.vm_granularity();
  if (g == 0) GTEST_SKIP() << "device 0 has no virtual memory management support";
  // One reservation, two slots: the handle is mapped at A, written, unmapped, mapped at B, read.
  void* base = backend.va_reserve(2 * g);
  auto* a = static_cast<std::uint32_t*>(base);
  auto* b = reinterpret_cast<std::uint32_t*>(static_cast<char*>(base) + g);
  const std::optional<cucache::phys_handle> handle = backend.phys_create(g);
  ASSERT_TRUE(handle.has_value());

  backend.map(a, g, *handle);
  backend.set_access(a, g);
  EXPECT_EQ(write_then_count(a, g, 0x5eedu), 0ull);
  CUDA_OK(cudaDeviceSynchronize());
  backend.unmap(a, g);

  backend.map(b, g, *handle);
  backend.set_access(b, g);
  EXPECT_EQ(write_then_count(b, g, 0x5eedu, /*write=*/false), 0ull);
  std::vector<std::uint32_t> host(4);
  CUDA_OK(cudaMemcpy(host.data(), b, host.size() * sizeof(std::uint32_t), cudaMemcpyDeviceToHost));
  EXPECT_EQ(host[1], 0x5eedu ^ 2654435761u);
  CUDA_OK(cudaDeviceSynchronize());
  backend.unmap(b, g);
  backend.phys_release(*handle);
  backend.va_free(base, 2 * g);
}

TEST(CudaBackendGpu, PhysCreateBeyondCapacityReturnsNullopt) {
  CUCACHE_REQUIRE_GPU();
  cucache::cuda_backend backend(0);
  const std::size_t g = backend.vm_granularity();
  if (g == 0) GTEST_SKIP() << "device 0 has no virtual memory management support";
  const std::size_t too_big = (2 * backend.mem_get_info().total_bytes + g - 1) / g * g;
  const std::optional<cucache::phys_handle> handle = backend.phys_create(too_big);
  EXPECT_FALSE(handle.has_value());
  if (handle) backend.phys_release(*handle);
}

TEST(CudaBackendGpu, EventTracksALongKernel) {
  CUCACHE_REQUIRE_GPU();
  cucache::cuda_backend backend(0);
  int clock_khz = 0;
  CUDA_OK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  ASSERT_GT(clock_khz, 0);
  cudaStream_t stream = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const cucache::event_handle event = backend.event_create();

  // About 50 ms at the peak clock; longer if the SMs run slower, which only helps the test.
  spin<<<1, 1, 0, stream>>>(static_cast<long long>(clock_khz) * 50);
  CUDA_OK(cudaGetLastError());
  backend.event_record(event, stream);
  EXPECT_FALSE(backend.event_query(event));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess) << "cudaErrorNotReady leaked";
  backend.event_synchronize(event);
  EXPECT_TRUE(backend.event_query(event));
  backend.stream_synchronize(stream);
  backend.device_synchronize();

  backend.event_destroy(event);
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST(CudaBackendGpu, MemGetInfoDropsByAtLeastAGibibyteAfterAGibibyteSegment) {
  CUCACHE_REQUIRE_GPU();
  cucache::cuda_backend backend(0);
  const cucache::memory_info before = backend.mem_get_info();
  ASSERT_GT(before.total_bytes, 0u);
  ASSERT_GE(before.free_bytes, 2 * gib) << "too little free memory for this test";
  void* ptr = backend.segment_malloc(gib);
  ASSERT_NE(ptr, nullptr);
  const cucache::memory_info after = backend.mem_get_info();
  EXPECT_EQ(after.total_bytes, before.total_bytes);
  ASSERT_LE(after.free_bytes, before.free_bytes) << "another process freed memory meanwhile";
  EXPECT_GE(before.free_bytes - after.free_bytes, gib);
  backend.segment_free(ptr);
}

TEST(CudaBackendGpu, RestoresTheCallersDevice) {
  CUCACHE_REQUIRE_GPU();
  if (cucache::cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  CUDA_OK(cudaSetDevice(0));
  cucache::cuda_backend backend(1);
  void* ptr = backend.segment_malloc(std::size_t{1} << 20);
  ASSERT_NE(ptr, nullptr);
  int current = -1;
  CUDA_OK(cudaGetDevice(&current));
  EXPECT_EQ(current, 0);
  cudaPointerAttributes attributes{};
  CUDA_OK(cudaPointerGetAttributes(&attributes, ptr));
  EXPECT_EQ(attributes.device, 1);
  backend.segment_free(ptr);
  CUDA_OK(cudaGetDevice(&current));
  EXPECT_EQ(current, 0);
}

}  // namespace
