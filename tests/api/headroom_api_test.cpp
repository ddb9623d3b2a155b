// max_allocatable and reserve through the front ends (cucache.hpp, cucache.h) on the simulated
// device (80 GiB): the same figures as the allocator's own, exact; bad arguments are errors.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "api/registry.hpp"
#include "cucache/cucache.h"
#include "cucache/cucache.hpp"
#include "support/sim_registry.hpp"

namespace {

using cucache::test::MiB;
constexpr std::size_t k_sim_capacity = std::size_t{80} << 30;  // sim_options' default

class HeadroomApi : public ::testing::Test {
 protected:
  void SetUp() override { restore(); }
  void TearDown() override { restore(); }
  static void restore() { cucache::test::use_sim_registry(); }
};

TEST_F(HeadroomApi, CppAndCAgreeAndAreExact) {
  EXPECT_EQ(cucache::max_allocatable(), k_sim_capacity);
  void* p = cucache::malloc(k_sim_capacity / 2);
  std::size_t n = 0;
  ASSERT_EQ(cucacheMaxAllocatable(&n), cudaSuccess) << cucacheGetLastErrorMessage();
  EXPECT_EQ(n, k_sim_capacity / 2);
  EXPECT_EQ(cucache::max_allocatable(0), n);
  EXPECT_EQ(cucache::get(0).max_allocatable(), n);
  void* q = nullptr;
  EXPECT_EQ(cucacheMalloc(&q, n + 512), cudaErrorMemoryAllocation);
  ASSERT_EQ(cucacheMalloc(&q, n), cudaSuccess) << cucacheGetLastErrorMessage();
  EXPECT_EQ(cucacheFree(q), cudaSuccess);
  cucache::free(p);
  EXPECT_EQ(cucacheMaxAllocatable(nullptr), cudaErrorInvalidValue);
  EXPECT_NE(std::string(cucacheGetLastErrorMessage()).find("bytes"), std::string::npos);
}

TEST_F(HeadroomApi, ReserveThroughBothAndTheConfigKey) {
  ASSERT_EQ(cucacheReserve(256 * MiB), cudaSuccess) << cucacheGetLastErrorMessage();
  cucacheStats s{};
  ASSERT_EQ(cucacheGetStats(0, &s), cudaSuccess);
  EXPECT_EQ(s.reservedBytes, 256 * MiB);
  cucache::reserve(64 * MiB, 0);
  ASSERT_EQ(cucacheGetStats(0, &s), cudaSuccess);
  EXPECT_EQ(s.reservedBytes, 320 * MiB);
  EXPECT_EQ(cucacheReserve(2 * k_sim_capacity), cudaErrorMemoryAllocation);
  EXPECT_NE(std::string(cucacheGetLastErrorMessage()).find("reserve"), std::string::npos);
  EXPECT_EQ(cucacheEmptyCache(), cudaSuccess);
  ASSERT_EQ(cucacheGetStats(0, &s), cudaSuccess);
  EXPECT_EQ(s.reservedBytes, 0u);

  ::setenv("CUCACHE_CONF", "reserve_mb:512", 1);
  cucache::detail::reset_for_testing();
  ASSERT_EQ(cucacheGetStats(0, &s), cudaSuccess);  // creates the allocator: reserves
  EXPECT_EQ(s.reservedBytes, 512 * MiB);
  EXPECT_EQ(s.deviceAllocCount, 1u);

  ::setenv("CUCACHE_CONF", "reserve_mb:-1", 1);
  cucache::detail::reset_for_testing();
  void* p = nullptr;
  EXPECT_EQ(cucacheMalloc(&p, 1), cudaErrorInitializationError);
  EXPECT_NE(std::string(cucacheGetLastErrorMessage()).find("reserve_mb"), std::string::npos)
      << cucacheGetLastErrorMessage();
}

}  // namespace
