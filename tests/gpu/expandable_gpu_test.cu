// Expandable segments on a real device: pages moved between addresses (stitching) keep what a
// kernel writes through their new address, neighbours are untouched, a block freed after use on
// another stream is not remapped while that stream runs. Skips with a one-line reason without a
// GPU. Out of memory, empty_cache and the other rules that need no kernel are in the typed suite
// (tests/allocator/allocator_suite.cpp, allocator_suite_cuda_test).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "allocator/churn_script.hpp"
#include "cucache/config.hpp"
#include "cucache/cuda_backend.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/errors.hpp"
#include "gpu/gpu_test_support.hpp"

namespace {

constexpr std::size_t mib = std::size_t{1} << 20;

__global__ void fill_bytes(unsigned char* p, std::size_t n, unsigned char v) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = v;
  }
}

__global__ void count_mismatches(const unsigned char* p, std::size_t n, unsigned char v,
                                 unsigned long long* bad) {
  unsigned long long local = 0;
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    local += p[i] != v;
  }
  if (local != 0) atomicAdd(bad, local);
}


/// Idle pages stay mapped while memory is plentiful and move only when it is short: the tests
/// that watch pages move give the allocator a memory limit (`limit`, a CUCACHE_CONF value).
cucache::device_allocator make_allocator(const char* limit = nullptr) {
  std::string conf = "expandable_segments:True";
  if (limit != nullptr) conf += std::string(",memory_limit:") + limit;
  return cucache::device_allocator(std::make_shared<cucache::cuda_backend>(0),
                                   cucache::parse_config(conf));
}

class ExpandableGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    CUCACHE_REQUIRE_GPU();
    ASSERT_EQ(cudaMalloc(&bad_, sizeof(unsigned long long)), cudaSuccess);
  }
  void TearDown() override {
    if (bad_ != nullptr) cudaFree(bad_);
  }
  void fill(void* p, std::size_t n, unsigned char v, cudaStream_t s = nullptr) {
    fill_bytes<<<1024, 256, 0, s>>>(static_cast<unsigned char*>(p), n, v);
    CUDA_CHECK(cudaGetLastError());
  }
  std::uint64_t mismatches(void* p, std::size_t n, unsigned char v) {
    cudaMemset(bad_, 0, sizeof(unsigned long long));
    count_mismatches<<<1024, 256>>>(static_cast<const unsigned char*>(p), n, v, bad_);
    unsigned long long host = ~0ull;
    cudaMemcpy(&host, bad_, sizeof host, cudaMemcpyDeviceToHost);
    return host;
  }
  unsigned long long* bad_ = nullptr;
};

TEST_F(ExpandableGpu, KernelsSeeStitchedPagesAtTheirNewAddress) {
  // x's 32 pages and y's 4 hold 72 MiB; under 112 MiB, z's 50 pages need 30 of x's idle pages.
  auto alloc = make_allocator("112MiB");
  void* x = alloc.allocate(64 * mib);
  void* y = alloc.allocate(6 * mib + 1000);
  fill(x, 64 * mib, 1);
  fill(y, 6 * mib + 1000, 2);
  CUDA_CHECK(cudaDeviceSynchronize());
  alloc.deallocate(x);
  const auto before = alloc.stats();
  void* z = alloc.allocate(100 * mib);  // behind y: x's idle pages are moved here
  const auto after = alloc.stats();
  EXPECT_GT(after.stitched_pages, before.stitched_pages);
  EXPECT_LE(after.reserved_bytes[0].current,
            before.reserved_bytes[0].current + static_cast<std::int64_t>(40 * mib));
  fill(z, 100 * mib, 3);
  EXPECT_EQ(mismatches(z, 100 * mib, 3), 0u);
  EXPECT_EQ(mismatches(y, 6 * mib + 1000, 2), 0u);
  alloc.check_invariants();
  alloc.deallocate(y);
  alloc.deallocate(z);
}

TEST_F(ExpandableGpu, ChurnKeepsEveryBlocksContents) {
  // Without a limit this churn touches 1,288 MiB of pages and never moves one; under 1,200 MiB
  // pages move while every block's contents are checked (its sim mirror in expandable_test.cpp,
  // ChurnUnderALimitMovesPagesAndNeverRunsOut, makes the same 596 moves).
  auto alloc = make_allocator("1200MiB");
  struct live {
    void* p;
    std::size_t n;
    unsigned char v;
  };
  std::vector<live> blocks;
  cucache::test::churn_script script;
  for (int op = 0; op < cucache::test::churn_script::k_steps; ++op) {
    const auto st = script.next(blocks.size());
    if (st.allocate) {
      void* p = alloc.allocate(st.bytes);
      fill(p, st.bytes, st.value);
      blocks.push_back({p, st.bytes, st.value});
    } else {
      const std::size_t i = st.victim;
      ASSERT_EQ(mismatches(blocks[i].p, blocks[i].n, blocks[i].v), 0u) << "op " << op;
      alloc.deallocate(blocks[i].p);
      blocks[i] = blocks.back();
      blocks.pop_back();
    }
  }
  for (auto& b : blocks) {
    EXPECT_EQ(mismatches(b.p, b.n, b.v), 0u);
    alloc.deallocate(b.p);
  }
  const auto s = alloc.stats();
  EXPECT_GT(s.stitched_pages, 0u);
  alloc.check_invariants();
}

TEST_F(ExpandableGpu, BlockUsedOnAnotherStreamIsNotRemappedWhileThatStreamRuns) {
  auto alloc = make_allocator();
  cudaStream_t s2 = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  void* a = alloc.allocate(8 * mib);
  CUDA_CHECK(cudaDeviceSynchronize());
  spin_then_fill<unsigned char><<<1, 256, 0, s2>>>(static_cast<unsigned char*>(a), 8 * mib, 7,
                                                  200'000'000ull);
  CUDA_CHECK(cudaGetLastError());
  alloc.record_stream(a, s2);
  alloc.deallocate(a);
  // While s2 still runs, a request that could take A's pages must not: they are pending.
  void* b = alloc.allocate(8 * mib);
  EXPECT_NE(b, a);
  CUDA_CHECK(cudaStreamSynchronize(s2));
  EXPECT_EQ(mismatches(a, 8 * mib, 7), 0u) << "s2's late write did not land in A's pages";
  alloc.deallocate(b);
  alloc.check_invariants();
  CUDA_CHECK(cudaStreamDestroy(s2));
}

}  // namespace
