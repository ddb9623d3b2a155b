// GPU-tier tests of the global API (cucache.h / cucache.hpp) with CUCACHE_BACKEND=cuda: memory from
// cucacheMalloc works in kernels, memory info agrees with the runtime, failures answer with
// runtime codes, and a pointer of one device is freed while another is current. Each test skips
// with a one-line reason where there is no usable GPU (or no second GPU).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cucache/cucache.h"
#include "cucache/cucache.hpp"
#include "cucache/cuda_backend.hpp"
#include "gpu/gpu_test_support.hpp"

namespace {

#define CUDA_OK(expr)                                                                         \
  do {                                                                                        \
    const cudaError_t cuda_ok_code = (expr);                                                  \
    ASSERT_EQ(cuda_ok_code, cudaSuccess) << #expr << ": " << cudaGetErrorString(cuda_ok_code) \
                                         << " / " << cucacheGetLastErrorMessage();            \
  } while (false)

__global__ void iota(std::uint32_t* data, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    data[i] = static_cast<std::uint32_t>(i);
  }
}

class GlobalGpu : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // The global state reads the environment once per process: pin the real backend first.
    ::setenv("CUCACHE_BACKEND", "cuda", 1);
    ::unsetenv("CUCACHE_CONF");
  }
};

TEST_F(GlobalGpu, MemoryFromCucacheMallocWorksInKernels) {
  CUCACHE_REQUIRE_GPU();
  const std::size_t n = std::size_t{1} << 22;
  std::uint32_t* data = nullptr;
  CUDA_OK(cucacheMalloc(&data, n * sizeof(std::uint32_t)));
  iota<<<256, 256>>>(data, n);
  CUDA_OK(cudaGetLastError());
  std::uint32_t last = 0;
  CUDA_OK(cudaMemcpy(&last, data + n - 1, sizeof(last), cudaMemcpyDeviceToHost));
  EXPECT_EQ(last, static_cast<std::uint32_t>(n - 1));
  CUDA_OK(cucacheFree(data));
  EXPECT_EQ(cucacheFree(data), cudaErrorInvalidValue);
}

TEST_F(GlobalGpu, MemGetInfoIsAtLeastTheRuntimesFreeMemory) {
  CUCACHE_REQUIRE_GPU();
  void* p = nullptr;
  CUDA_OK(cucacheMalloc(&p, std::size_t{64} << 20));
  CUDA_OK(cucacheFree(p));  // cached: free to cucache, used to the runtime
  std::size_t f = 0;
  std::size_t t = 0;
  CUDA_OK(cucacheMemGetInfo(&f, &t));
  std::size_t rf = 0;
  std::size_t rt = 0;
  CUDA_OK(cudaMemGetInfo(&rf, &rt));
  EXPECT_EQ(t, rt);
  EXPECT_GE(f, rf + (std::size_t{64} << 20) - (std::size_t{32} << 20));  // slack: other users
  CUDA_OK(cucacheEmptyCache());
}

TEST_F(GlobalGpu, FailuresAnswerWithRuntimeCodes) {
  CUCACHE_REQUIRE_GPU();
  void* p = nullptr;
  EXPECT_EQ(cucacheMalloc(&p, std::size_t{1} << 50), cudaErrorMemoryAllocation);
  EXPECT_NE(std::string(cucacheGetLastErrorMessage()).find("out of memory"), std::string::npos);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // the runtime's error slot is left clean
  cucacheStats s{};
  EXPECT_EQ(cucacheGetStats(cucache::cuda_device_count(), &s), cudaErrorInvalidDevice);
}

TEST_F(GlobalGpu, FreesAPointerOfAnotherDevice) {
  CUCACHE_REQUIRE_GPU();
  if (cucache::cuda_device_count() < 2) GTEST_SKIP() << "needs two GPUs";
  int previous = 0;
  CUDA_OK(cudaGetDevice(&previous));
  CUDA_OK(cudaSetDevice(1));
  void* on1 = nullptr;
  CUDA_OK(cucacheMalloc(&on1, 1 << 20));
  CUDA_OK(cudaSetDevice(0));
  void* on0 = nullptr;
  CUDA_OK(cucacheMalloc(&on0, 1 << 20));
  EXPECT_EQ(cucache::get(1).allocation_size(on1), std::size_t{1} << 20);
  CUDA_OK(cucacheFree(on1));  // device 0 current
  int current = -1;
  CUDA_OK(cudaGetDevice(&current));
  EXPECT_EQ(current, 0);  // the backend's device switch is undone
  cucacheStats s{};
  CUDA_OK(cucacheGetStats(1, &s));
  EXPECT_EQ(s.allocationCount, 0u);
  CUDA_OK(cucacheGetStats(0, &s));
  EXPECT_EQ(s.allocationCount, 1u);
  CUDA_OK(cucacheFree(on0));
  CUDA_OK(cudaSetDevice(previous));
}

}  // namespace
