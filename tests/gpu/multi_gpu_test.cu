// Two GPUs (issue 15): a free and a record_stream of another device's pointer through the C API
// with the caller's device restored, per-device stats and memory summaries, out of memory on one
// device leaving the other untouched, 8 threads on 2 devices with contents checked by kernels, and
// peer access of expandable mappings (peer_access:auto): kernels on device 1 read and write
// memory that device 0's allocator mapped, and cudaMemcpyPeer copies between the two.
// Every test skips with a one-line reason on a machine with fewer than two GPUs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cucache/backend_factory.hpp"
#include "cucache/cucache.h"
#include "cucache/cucache.hpp"
#include "cucache/cuda_backend.hpp"
#include "cucache/device_allocator.hpp"
#include "gpu/gpu_test_support.hpp"

namespace {

constexpr std::size_t k_mib = std::size_t{1} << 20;

#define CUDA_OK(expr)                                                                         \
  do {                                                                                        \
    const cudaError_t cuda_ok_code = (expr);                                                  \
    ASSERT_EQ(cuda_ok_code, cudaSuccess) << #expr << ": " << cudaGetErrorString(cuda_ok_code) \
                                         << " / " << cucacheGetLastErrorMessage();            \
  } while (false)

#define REQUIRE_TWO_GPUS()                                                                   \
  CUCACHE_REQUIRE_GPU();                                                                     \
  if (cucache::cuda_device_count() < 2)                                                      \
  GTEST_SKIP() << "needs two GPUs: cudaGetDeviceCount found " << cucache::cuda_device_count()

__global__ void fill(std::uint32_t* data, std::size_t n, std::uint32_t tag) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    data[i] = tag ^ static_cast<std::uint32_t>(i);
  }
}

__global__ void count_bad(const std::uint32_t* data, std::size_t n, std::uint32_t tag,
                          unsigned long long* bad) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    if (data[i] != (tag ^ static_cast<std::uint32_t>(i))) atomicAdd(bad, 1ULL);
  }
}

__global__ void add_one(std::uint32_t* data, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    data[i] += 1;
  }
}

class MultiGpu : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ::setenv("CUCACHE_BACKEND", "cuda", 1);
    ::unsetenv("CUCACHE_CONF");
  }
  void SetUp() override { static_cast<void>(cudaGetDevice(&caller_)); }
  void TearDown() override {
    static_cast<void>(cudaSetDevice(caller_));
    static_cast<void>(cucacheEmptyCache());
  }
  int caller_ = 0;
};

cucacheStats stats_of(int d) {
  cucacheStats s{};
  EXPECT_EQ(cucacheGetStats(d, &s), cudaSuccess) << cucacheGetLastErrorMessage();
  return s;
}

TEST_F(MultiGpu, RecordStreamAndFreeOfDevice1sPointerWhileDevice0IsCurrent) {
  REQUIRE_TWO_GPUS();
  CUDA_OK(cudaSetDevice(1));
  cudaStream_t s1 = nullptr;
  cudaStream_t s2 = nullptr;
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  std::uint32_t* p = nullptr;
  const std::size_t n = 4 * k_mib / sizeof(std::uint32_t);
  CUDA_OK(cucacheMallocAsync(&p, n * sizeof(std::uint32_t), s1));
  fill<<<256, 256, 0, s1>>>(p, n, 7);
  CUDA_OK(cudaGetLastError());
  const cucacheStats before = stats_of(1);
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cucacheRecordStream(p, s2));
  int current = -1;
  CUDA_OK(cudaGetDevice(&current));
  EXPECT_EQ(current, 0) << "record_stream left device 1 current";
  CUDA_OK(cucacheFree(p));
  CUDA_OK(cudaGetDevice(&current));
  EXPECT_EQ(current, 0) << "the free left device 1 current";
  const cucacheStats after = stats_of(1);
  EXPECT_EQ(after.allocationCount + 1, before.allocationCount);
  EXPECT_EQ(cucacheFree(p), cudaErrorInvalidValue);
  CUDA_OK(cudaSetDevice(1));
  CUDA_OK(cudaStreamSynchronize(s1));
  CUDA_OK(cudaStreamSynchronize(s2));
  CUDA_OK(cudaStreamDestroy(s1));
  CUDA_OK(cudaStreamDestroy(s2));
}

TEST_F(MultiGpu, StatsAndSummariesArePerDevice) {
  REQUIRE_TWO_GPUS();
  const cucacheStats base0 = stats_of(0);
  const cucacheStats base1 = stats_of(1);
  CUDA_OK(cudaSetDevice(0));
  void* a = nullptr;
  CUDA_OK(cucacheMalloc(&a, 1000));
  CUDA_OK(cudaSetDevice(1));
  void* b = nullptr;
  void* c = nullptr;
  CUDA_OK(cucacheMalloc(&b, 5 * k_mib));
  CUDA_OK(cucacheMalloc(&c, 5 * k_mib));
  EXPECT_EQ(stats_of(0).allocatedBytes, base0.allocatedBytes + 1024);
  EXPECT_EQ(stats_of(1).allocatedBytes, base1.allocatedBytes + 10 * k_mib);
  EXPECT_EQ(stats_of(1).allocationCount, base1.allocationCount + 2);
  std::vector<char> text(16384);
  ASSERT_GT(cucacheMemorySummary(1, text.data(), text.size()), 0u);
  EXPECT_NE(std::string(text.data()).find("device 1 (cuda)"), std::string::npos) << text.data();
  CUDA_OK(cucacheFree(a));  // device 1 current
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cucacheFree(b));
  CUDA_OK(cucacheFree(c));
  EXPECT_EQ(stats_of(0).allocationCount, base0.allocationCount);
  EXPECT_EQ(stats_of(1).allocationCount, base1.allocationCount);
}

TEST_F(MultiGpu, OutOfMemoryOnDevice1LeavesDevice0Untouched) {
  REQUIRE_TWO_GPUS();
  CUDA_OK(cudaSetDevice(0));
  void* keep = nullptr;
  CUDA_OK(cucacheMalloc(&keep, 8 * k_mib));
  const cucacheStats before0 = stats_of(0);
  const cucacheStats before1 = stats_of(1);
  CUDA_OK(cudaSetDevice(1));
  void* huge = nullptr;
  EXPECT_EQ(cucacheMalloc(&huge, std::size_t{1} << 50), cudaErrorMemoryAllocation);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  const cucacheStats after0 = stats_of(0);
  EXPECT_EQ(after0.allocatedBytes, before0.allocatedBytes);
  EXPECT_EQ(after0.reservedBytes, before0.reservedBytes);
  EXPECT_EQ(after0.deviceAllocCount, before0.deviceAllocCount);
  EXPECT_EQ(after0.deviceFreeCount, before0.deviceFreeCount);
  EXPECT_EQ(after0.oomCount, before0.oomCount);
  EXPECT_EQ(stats_of(1).oomCount, before1.oomCount + 1);
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cucacheFree(keep));
}

TEST_F(MultiGpu, EightThreadsOnTwoDevicesKeepEveryBlocksContents) {
  REQUIRE_TWO_GPUS();
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([t, &failures] {
      const int device = t % 2;
      if (cudaSetDevice(device) != cudaSuccess) {
        failures.fetch_add(1);
        return;
      }
      cudaStream_t s = nullptr;
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      unsigned long long* bad = nullptr;
      if (cucacheMallocAsync(&bad, sizeof(*bad), s) != cudaSuccess) {
        failures.fetch_add(1);
        return;
      }
      cudaMemsetAsync(bad, 0, sizeof(*bad), s);
      std::mt19937_64 rng(static_cast<std::uint64_t>(t) + 11);
      struct live {
        std::uint32_t* p;
        std::size_t n;
        std::uint32_t tag;
      };
      std::vector<live> held;
      for (int op = 0; op < 400; ++op) {
        if (held.size() >= 12 || (!held.empty() && rng() % 3 == 0)) {
          const std::size_t i = rng() % held.size();
          count_bad<<<64, 256, 0, s>>>(held[i].p, held[i].n, held[i].tag, bad);
          if (cucacheFreeAsync(held[i].p, s) != cudaSuccess) failures.fetch_add(1);
          held[i] = held.back();
          held.pop_back();
          continue;
        }
        const std::size_t n = 1 + rng() % (rng() % 4 == 0 ? 3 * k_mib : 16 * 1024);
        std::uint32_t* p = nullptr;
        if (cucacheMallocAsync(&p, n * sizeof(std::uint32_t), s) != cudaSuccess) {
          failures.fetch_add(1);
          continue;
        }
        const auto tag = static_cast<std::uint32_t>((t << 24) ^ op);
        fill<<<64, 256, 0, s>>>(p, n, tag);
        held.push_back({p, n, tag});
      }
      for (const live& l : held) {
        count_bad<<<64, 256, 0, s>>>(l.p, l.n, l.tag, bad);
        if (cucacheFreeAsync(l.p, s) != cudaSuccess) failures.fetch_add(1);
      }
      unsigned long long host = 1;
      cudaMemcpyAsync(&host, bad, sizeof(host), cudaMemcpyDeviceToHost, s);
      if (cudaStreamSynchronize(s) != cudaSuccess || host != 0) failures.fetch_add(1);
      cucacheFreeAsync(bad, s);
      cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  cucache::get(0).check_invariants();
  cucache::get(1).check_invariants();
}

TEST_F(MultiGpu, PeerKernelsReadAndWriteExpandableMemory) {
  REQUIRE_TWO_GPUS();
  int can = 0;
  CUDA_OK(cudaDeviceCanAccessPeer(&can, 1, 0));
  if (can == 0) GTEST_SKIP() << "device 1 cannot access device 0 (cudaDeviceCanAccessPeer is 0)";
  cucache::config cfg;
  cfg.expandable_segments = true;  // peer_access:auto, the default
  cucache::device_allocator a0(cucache::make_backend(cucache::backend_kind::cuda, 0), cfg);
  EXPECT_EQ(a0.backend().access_devices(), (std::vector<int>{0, 1}));
  const std::size_t n = 6 * k_mib / sizeof(std::uint32_t);
  auto* p = static_cast<std::uint32_t*>(a0.allocate(n * sizeof(std::uint32_t)));
  CUDA_OK(cudaSetDevice(1));
  fill<<<256, 256>>>(p, n, 0x5eed);  // device 1 writes device 0's mapping
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaSetDevice(0));
  add_one<<<256, 256>>>(p, n);
  CUDA_OK(cudaDeviceSynchronize());
  // A copy onto device 1 (cucache memory there, default mode), checked on device 1.
  CUDA_OK(cudaSetDevice(1));
  std::uint32_t* q = nullptr;
  CUDA_OK(cucacheMalloc(&q, n * sizeof(std::uint32_t)));
  CUDA_OK(cudaMemcpyPeer(q, 1, p, 0, n * sizeof(std::uint32_t)));
  std::uint32_t first = 0;
  std::uint32_t last = 0;
  CUDA_OK(cudaMemcpy(&first, q, sizeof(first), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(&last, q + n - 1, sizeof(last), cudaMemcpyDeviceToHost));
  EXPECT_EQ(first, (0x5eedu ^ 0u) + 1);
  EXPECT_EQ(last, (0x5eedu ^ static_cast<std::uint32_t>(n - 1)) + 1);
  CUDA_OK(cucacheFree(q));
  CUDA_OK(cudaSetDevice(0));
  a0.deallocate(p);
  a0.check_invariants();
}

}  // namespace
