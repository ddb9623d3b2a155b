// A server that runs for weeks, on a real device (issue 22): 10,000 streams, each created, used
// by a kernel on a block allocated on it, freed in its order and destroyed, in both modes. Before
// issue 22, expandable mode failed from about the 936th stream on the H200 ("cuMemAddressReserve
// failed: out of memory"): every stream's pool reserved virtual ranges of the device's size and
// kept them. Now the pool of a gone stream is handed, with its cache, to the next stream once a
// quiet event recorded on the gone stream has completed (docs/design.md, "What a stream costs").
// Also: a block whose kernel still runs when its stream is destroyed is not given to the next
// stream before the kernel is done. Skips with a one-line reason without a GPU.
// CUCACHE_GPU_STREAMS overrides the number of streams (default 10,000).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "cucache/config.hpp"
#include "cucache/cuda_backend.hpp"
#include "cucache/device_allocator.hpp"
#include "gpu/gpu_test_support.hpp"

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

__global__ void fill_words(unsigned* p, std::size_t n, unsigned v) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = v;
  }
}


__global__ void count_not(const unsigned* p, std::size_t n, unsigned v, unsigned long long* bad) {
  unsigned long long local = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    local += p[i] != v;
  }
  if (local != 0) atomicAdd(bad, local);
}

int stream_count() {
  if (const char* s = std::getenv("CUCACHE_GPU_STREAMS")) {
    const long v = std::strtol(s, nullptr, 10);
    if (v > 0) return static_cast<int>(v);
  }
  return 10'000;
}

class GpuStreams : public ::testing::TestWithParam<const char*> {};

TEST_P(GpuStreams, TenThousandStreamsCreatedUsedDestroyed) {
  CUCACHE_REQUIRE_GPU();
  cucache::device_allocator a(std::make_shared<cucache::cuda_backend>(0),
                              cucache::parse_config(GetParam()));
  const int n = stream_count();
  std::int64_t reserved_max = 0;
  for (int i = 0; i < n; ++i) {
    cudaStream_t s = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    void* p = nullptr;
    try {
      p = a.allocate(1 * mib, s);
    } catch (const std::exception& e) {
      FAIL() << "stream " << i << ": " << e.what();
    }
    fill_words<<<64, 256, 0, s>>>(static_cast<unsigned*>(p), mib / sizeof(unsigned),
                                  static_cast<unsigned>(i));
    CUDA_CHECK(cudaGetLastError());
    a.deallocate(p, s);
    CUDA_CHECK(cudaStreamDestroy(s));
    reserved_max = std::max(reserved_max, a.stats().reserved_bytes[0].current);
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  const cucache::device_stats st = a.stats();
  std::printf("%s: %d streams; reserved at most %lld bytes, at the end %lld; device allocations %llu\n",
              GetParam(), n, static_cast<long long>(reserved_max),
              static_cast<long long>(st.reserved_bytes[0].current),
              static_cast<unsigned long long>(st.device_alloc_count));
  EXPECT_EQ(st.oom_count, 0u);
  // One request's block at a time; a few pools may still wait for their quiet events, each with
  // a 2 MiB segment (or page).
  EXPECT_LE(reserved_max, static_cast<std::int64_t>(256 * mib));
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes[0].current, 0);
}

TEST_P(GpuStreams, ARunningKernelsBlockIsNotTheNextStreamsUntilItIsDone) {
  CUCACHE_REQUIRE_GPU();
  cucache::device_allocator a(std::make_shared<cucache::cuda_backend>(0),
                              cucache::parse_config(GetParam()));
  constexpr std::size_t words = mib / sizeof(unsigned);
  cudaStream_t s = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  void* p = a.allocate(1 * mib, s);
  spin_then_fill<<<1, 256, 0, s>>>(static_cast<unsigned*>(p), words, 0xAAAAAAAAu,
                                   200'000'000ull);  // 0.2 s, then writes p
  CUDA_CHECK(cudaGetLastError());
  a.deallocate(p, s);
  CUDA_CHECK(cudaStreamDestroy(s));  // returns at once; the kernel goes on
  cudaStream_t t = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking));
  void* q = a.allocate(1 * mib, t);
  fill_words<<<64, 256, 0, t>>>(static_cast<unsigned*>(q), words, 0x55555555u);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaDeviceSynchronize());  // the spinning kernel is done too
  unsigned long long* bad = nullptr;
  CUDA_CHECK(cudaMalloc(&bad, sizeof(*bad)));
  CUDA_CHECK(cudaMemset(bad, 0, sizeof(*bad)));
  count_not<<<64, 256, 0, t>>>(static_cast<const unsigned*>(q), words, 0x55555555u, bad);
  unsigned long long host_bad = 0;
  CUDA_CHECK(cudaMemcpy(&host_bad, bad, sizeof(host_bad), cudaMemcpyDeviceToHost));
  EXPECT_EQ(host_bad, 0u) << "the gone stream's kernel wrote the new stream's block";
  CUDA_CHECK(cudaFree(bad));
  a.deallocate(q, t);
  CUDA_CHECK(cudaStreamDestroy(t));
  // Its work done, the gone stream's pool serves the next new stream.
  cudaStream_t u = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&u, cudaStreamNonBlocking));
  void* r = a.allocate(1 * mib, u);
  EXPECT_TRUE(r == p || r == q);
  a.deallocate(r, u);
  CUDA_CHECK(cudaStreamDestroy(u));
  CUDA_CHECK(cudaDeviceSynchronize());
}

// Streams live at once, each holding a block and with cached memory in both pools (expandable
// mode: each pool's ranges; before, the ~936th live stream found no address space on the H200).
// CUCACHE_GPU_LIVE_STREAMS overrides the number (default 3,000).
TEST_P(GpuStreams, ThreeThousandLiveStreamsWithCachedMemory) {
  CUCACHE_REQUIRE_GPU();
  cucache::device_allocator a(std::make_shared<cucache::cuda_backend>(0),
                              cucache::parse_config(GetParam()));
  int n = 3'000;
  if (const char* v = std::getenv("CUCACHE_GPU_LIVE_STREAMS")) n = std::max(1, std::atoi(v));
  std::vector<cudaStream_t> streams(static_cast<std::size_t>(n));
  std::vector<void*> held(streams.size());
  for (std::size_t i = 0; i < streams.size(); ++i) {
    CUDA_CHECK(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking));
    try {
      held[i] = a.allocate(64 * 1024, streams[i]);
      void* large = a.allocate(8 * mib, streams[i]);
      fill_words<<<64, 256, 0, streams[i]>>>(static_cast<unsigned*>(large),
                                             8 * mib / sizeof(unsigned),
                                             static_cast<unsigned>(i));
      CUDA_CHECK(cudaGetLastError());
      a.deallocate(large, streams[i]);  // cached in the stream's pool
    } catch (const std::exception& e) {
      FAIL() << "stream " << i << ": " << e.what();
    }
  }
  // Every stream again, from its own cache.
  const std::uint64_t allocs = a.stats().device_alloc_count;
  for (cudaStream_t s : streams) a.deallocate(a.allocate(8 * mib, s), s);
  CUDA_CHECK(cudaDeviceSynchronize());
  const cucache::device_stats st = a.stats();
  std::size_t address = 0;
  for (const cucache::segment_view& v : a.segments()) address += v.expandable ? v.size : 0;
  std::printf("%s: %d live streams; reserved %lld bytes, %zu bytes of address space; device "
              "allocations %llu (%llu in the second pass)\n",
              GetParam(), n, static_cast<long long>(st.reserved_bytes[0].current), address,
              static_cast<unsigned long long>(st.device_alloc_count),
              static_cast<unsigned long long>(st.device_alloc_count - allocs));
  EXPECT_EQ(st.oom_count, 0u);
  EXPECT_EQ(st.device_alloc_count, allocs);
  for (std::size_t i = 0; i < streams.size(); ++i) {
    a.deallocate(held[i], streams[i]);
    CUDA_CHECK(cudaStreamDestroy(streams[i]));
  }
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes[0].current, 0);
}

INSTANTIATE_TEST_SUITE_P(Modes, GpuStreams,
                         ::testing::Values("", "expandable_segments:True"));

}  // namespace
