// cucache/thrust.hpp without Thrust, on the simulated device (CUCACHE_BACKEND=sim): the allocator
// has the shape Thrust's execution policies need (value_type char, allocate(n) -> char*,
// deallocate(p, n)) and allocates from cucache on its stream; with_temp_storage follows CUB's
// two-call protocol, frees its storage on every path and passes errors through. A real Thrust
// sort on cucache memory is examples/thrust_sort.cu (built with nvcc, run on a GPU).
#include "cucache/thrust.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <type_traits>
#include <utility>

#include "cucache/cucache.hpp"
#include "support/sim_device.hpp"

namespace {

using cucache::thrust_allocator;

static_assert(std::is_same<thrust_allocator::value_type, char>::value, "");
static_assert(std::is_same<decltype(std::declval<thrust_allocator&>().allocate(std::size_t{1})),
                           char*>::value,
              "");
static_assert(noexcept(std::declval<thrust_allocator&>().deallocate(nullptr, std::size_t{1})), "");
static_assert(std::is_nothrow_copy_constructible<thrust_allocator>::value, "");
static_assert(std::is_nothrow_default_constructible<thrust_allocator>::value, "");

constexpr auto fake_stream = &cucache::test::fake_stream<cudaStream_t>;

class Thrust : public ::testing::Test {
 protected:
  void SetUp() override { ::setenv("CUCACHE_BACKEND", "sim", 1); }
  static std::int64_t live() { return cucache::get().stats().allocation_count[0].current; }
  static std::int64_t allocated() { return cucache::get().stats().allocated_bytes[0].current; }
};

TEST_F(Thrust, AllocatorAllocatesFromCucacheOnItsStream) {
  thrust_allocator alloc(fake_stream(1));
  EXPECT_EQ(alloc.stream(), fake_stream(1));
  char* p = alloc.allocate(3000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(live(), 1);
  EXPECT_EQ(cucache::get().allocation_size(p), 3072u);
  alloc.deallocate(p, 3000);
  EXPECT_EQ(live(), 0);
  // Reused on the same stream: no new device allocation.
  const auto segments = cucache::get().stats().device_alloc_count;
  alloc.deallocate(alloc.allocate(3000), 3000);
  EXPECT_EQ(cucache::get().stats().device_alloc_count, segments);
}

TEST_F(Thrust, ZeroBytesIsNull) {
  thrust_allocator alloc;
  EXPECT_EQ(alloc.allocate(0), nullptr);
  alloc.deallocate(nullptr, 0);
  EXPECT_EQ(live(), 0);
}

TEST_F(Thrust, CopiesOnOneStreamAreEqual) {
  const thrust_allocator a(fake_stream(1));
  thrust_allocator b = a;
  EXPECT_TRUE(a == b);
  EXPECT_TRUE(a != thrust_allocator(fake_stream(2)));
  EXPECT_TRUE(thrust_allocator() == thrust_allocator(nullptr));
  char* p = b.allocate(10);
  thrust_allocator(a).deallocate(p, 10);
  EXPECT_EQ(live(), 0);
}

TEST_F(Thrust, OutOfMemoryIsABadAlloc) {
  thrust_allocator alloc;
  // More than the simulated device (80 GiB) has.
  EXPECT_THROW((void)alloc.allocate(std::size_t{1} << 40), std::bad_alloc);
  EXPECT_EQ(live(), 0);
}

TEST_F(Thrust, TempStorageFollowsCubsTwoCalls) {
  int calls = 0;
  void* seen = nullptr;
  const cudaError_t err =
      cucache::with_temp_storage(fake_stream(3), [&](void* temp, std::size_t& bytes) {
        ++calls;
        if (temp == nullptr) {
          bytes = 5000;
          return cudaSuccess;
        }
        EXPECT_EQ(bytes, 5000u);
        EXPECT_GE(cucache::get().allocation_size(temp), 5000u);
        EXPECT_EQ(reinterpret_cast<std::uintptr_t>(temp) % 256, 0u);
        seen = temp;
        return cudaSuccess;
      });
  EXPECT_EQ(err, cudaSuccess);
  EXPECT_EQ(calls, 2);
  EXPECT_NE(seen, nullptr);
  EXPECT_EQ(live(), 0);
}

TEST_F(Thrust, TempStorageOfZeroBytesIsStillNotNull) {
  const cudaError_t err = cucache::with_temp_storage(nullptr, [&](void* temp, std::size_t& bytes) {
    if (temp == nullptr) {
      bytes = 0;
      return cudaSuccess;
    }
    EXPECT_EQ(bytes, 0u);
    return cudaSuccess;
  });
  EXPECT_EQ(err, cudaSuccess);
  EXPECT_EQ(live(), 0);
}

TEST_F(Thrust, TempStorageErrorsPassThroughAndStorageIsFreed) {
  // The sizing call fails: nothing is allocated.
  EXPECT_EQ(cucache::with_temp_storage(nullptr,
                                       [](void*, std::size_t&) { return cudaErrorInvalidValue; }),
            cudaErrorInvalidValue);
  EXPECT_EQ(live(), 0);
  // The run fails: its error is returned and the storage freed.
  EXPECT_EQ(cucache::with_temp_storage(nullptr,
                                       [](void* temp, std::size_t& bytes) {
                                         if (temp == nullptr) bytes = 100;
                                         return temp == nullptr ? cudaSuccess
                                                                : cudaErrorLaunchFailure;
                                       }),
            cudaErrorLaunchFailure);
  EXPECT_EQ(live(), 0);
  // The storage cannot be had: cucache's error.
  EXPECT_EQ(cucache::with_temp_storage(nullptr,
                                       [](void* temp, std::size_t& bytes) {
                                         EXPECT_EQ(temp, nullptr);
                                         bytes = std::size_t{1} << 40;
                                         return cudaSuccess;
                                       }),
            cudaErrorMemoryAllocation);
  EXPECT_NE(std::string(cucacheGetLastErrorMessage()), "");
  // f throws: the exception passes, the storage is freed.
  EXPECT_THROW((void)cucache::with_temp_storage(nullptr,
                                                [](void* temp, std::size_t& bytes) -> cudaError_t {
                                                  if (temp == nullptr) {
                                                    bytes = 100;
                                                    return cudaSuccess;
                                                  }
                                                  throw std::runtime_error("kernel launch");
                                                }),
               std::runtime_error);
  EXPECT_EQ(live(), 0);
  EXPECT_EQ(allocated(), 0);
}

}  // namespace
