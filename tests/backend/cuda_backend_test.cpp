// CPU-tier tests of cuda_backend: what it does on a machine without a GPU or driver (CI). The GPU
// behaviour is covered by tests/gpu/cuda_backend_gpu_test.cu. Tests of the no-GPU path skip where a
// GPU is present, so this executable passes on both kinds of machine.
#include "cucache/cuda_backend.hpp"

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <string>

#include "cucache/errors.hpp"

namespace {

#define CUCACHE_SKIP_IF_GPU()                                                                  \
  do {                                                                                         \
    if (cucache::cuda_available()) GTEST_SKIP() << "checks the no-GPU path; a GPU is present"; \
  } while (false)

TEST(CudaBackend, DeviceCountAndReasonAgree) {
  int count = -1;
  EXPECT_NO_THROW(count = cucache::cuda_device_count());
  EXPECT_GE(count, 0);
  EXPECT_EQ(cucache::cuda_available(), count > 0);
  EXPECT_EQ(cucache::cuda_unavailable_reason().empty(), count > 0);
}

TEST(CudaBackend, NoGpuMeansZeroDevicesAndAOneLineReason) {
  CUCACHE_SKIP_IF_GPU();
  EXPECT_EQ(cucache::cuda_device_count(), 0);
  const std::string reason = cucache::cuda_unavailable_reason();
  EXPECT_FALSE(reason.empty());
  EXPECT_NE(reason.find("cudaGetDeviceCount"), std::string::npos) << reason;
  EXPECT_EQ(reason.find('\n'), std::string::npos) << reason;
}

TEST(CudaBackend, ConstructingWithoutGpuThrowsCudaErrorNamingTheProbe) {
  CUCACHE_SKIP_IF_GPU();
  try {
    cucache::cuda_backend backend(0);
    FAIL() << "constructed a cuda_backend without a GPU";
  } catch (const cucache::cuda_error& e) {
    EXPECT_EQ(e.call(), "cudaGetDeviceCount");
    EXPECT_NE(e.code(), 0);
    const std::string what = e.what();
    EXPECT_NE(what.find("cudaGetDeviceCount failed: "), std::string::npos) << what;
  }
  // No last-error check here: without a driver the runtime's initialization fails on every call,
  // so even cudaGetLastError keeps answering cudaErrorInsufficientDriver.
}

TEST(CudaBackend, NegativeOrdinalThrowsInvalidDevice) {
  try {
    cucache::cuda_backend backend(-1);
    FAIL() << "constructed a cuda_backend for device -1";
  } catch (const cucache::cuda_error& e) {
    EXPECT_EQ(e.call(), "cuda_backend");
    EXPECT_EQ(e.code(), static_cast<int>(cudaErrorInvalidDevice));
  }
}

TEST(CudaBackend, OutOfRangeOrdinalThrowsCudaError) {
  EXPECT_THROW(cucache::cuda_backend backend(1 << 20), cucache::cuda_error);
}

}  // namespace
