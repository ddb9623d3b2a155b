// cucache::memory_resource (cucache/memory_resource.hpp) against the CCCL of the CUDA toolkit: the
// resource concepts and the device_accessible property at compile time (each generation's names:
// CCCL <= 3.0 resource / async_resource, CCCL >= 3.1 synchronous_resource / resource), and at run
// time on the simulated device (CUCACHE_BACKEND=sim): allocation through the resource itself,
// through cuda::mr's resource references and (where the toolkit's CCCL has it) any_resource,
// alignments 256 to 4096, equality and bad input.
#include "cucache/memory_resource.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "cucache/cucache.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/sim_backend.hpp"
#include "support/sim_device.hpp"

#if CCCL_MAJOR_VERSION > 3 || (CCCL_MAJOR_VERSION == 3 && CCCL_MINOR_VERSION >= 1)
#define CUCACHE_TEST_CCCL_NEW_NAMES 1
#else
#define CUCACHE_TEST_CCCL_NEW_NAMES 0
#endif
#if __has_include(<cuda/__memory_resource/any_resource.h>)
#define CUCACHE_TEST_CCCL_ANY_RESOURCE 1
#else
#define CUCACHE_TEST_CCCL_ANY_RESOURCE 0
#endif

namespace mr = ::cuda::mr;
using cucache::memory_resource;

static_assert(std::is_nothrow_copy_constructible_v<memory_resource>);
static_assert(::cuda::has_property<memory_resource, mr::device_accessible>);
static_assert(!::cuda::has_property<memory_resource, mr::host_accessible>);
#if CUCACHE_TEST_CCCL_NEW_NAMES
static_assert(mr::synchronous_resource<memory_resource>);
static_assert(mr::resource<memory_resource>);
static_assert(mr::synchronous_resource_with<memory_resource, mr::device_accessible>);
static_assert(mr::resource_with<memory_resource, mr::device_accessible>);
static_assert(!mr::resource_with<memory_resource, mr::host_accessible>);
#else
static_assert(mr::resource<memory_resource>);
static_assert(mr::async_resource<memory_resource>);
static_assert(mr::resource_with<memory_resource, mr::device_accessible>);
static_assert(mr::async_resource_with<memory_resource, mr::device_accessible>);
static_assert(!mr::resource_with<memory_resource, mr::host_accessible>);
#endif

namespace {

std::uintptr_t addr(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p);
}
// The simulator's streams are opaque handles: nothing is ever run on them.
constexpr auto fake_stream = &cucache::test::fake_stream<cudaStream_t>;

// The stream-ordered calls under either generation's names.
#if CUCACHE_TEST_CCCL_NEW_NAMES
template <class R>
void* allocate_on(R& r, ::cuda::stream_ref s, std::size_t bytes, std::size_t alignment) {
  return r.allocate(s, bytes, alignment);
}
template <class R>
void deallocate_on(R& r, ::cuda::stream_ref s, void* p, std::size_t bytes, std::size_t alignment) {
  r.deallocate(s, p, bytes, alignment);
}
template <class R>
void* allocate_now(R& r, std::size_t bytes, std::size_t alignment) {
  return r.allocate_sync(bytes, alignment);
}
template <class R>
void deallocate_now(R& r, void* p, std::size_t bytes, std::size_t alignment) {
  r.deallocate_sync(p, bytes, alignment);
}
using device_ref = mr::resource_ref<mr::device_accessible>;
#else
template <class R>
void* allocate_on(R& r, ::cuda::stream_ref s, std::size_t bytes, std::size_t alignment) {
  return r.allocate_async(bytes, alignment, s);
}
template <class R>
void deallocate_on(R& r, ::cuda::stream_ref s, void* p, std::size_t bytes, std::size_t alignment) {
  r.deallocate_async(p, bytes, alignment, s);
}
template <class R>
void* allocate_now(R& r, std::size_t bytes, std::size_t alignment) {
  return r.allocate(bytes, alignment);
}
template <class R>
void deallocate_now(R& r, void* p, std::size_t bytes, std::size_t alignment) {
  r.deallocate(p, bytes, alignment);
}
using device_ref = mr::async_resource_ref<mr::device_accessible>;
#endif

class MemoryResource : public ::testing::Test {
 protected:
  void SetUp() override { ::setenv("CUCACHE_BACKEND", "sim", 1); }
  static std::int64_t live(const memory_resource& r) {
    return r.allocator().stats().allocation_count[0].current;
  }
};

TEST_F(MemoryResource, GlobalResourceIsTheCurrentDevicesAllocator) {
  memory_resource r;
  EXPECT_EQ(&r.allocator(), &cucache::get());
  EXPECT_EQ(r, memory_resource(0));
  void* p = r.allocate_sync(1000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(cucache::get().allocation_size(p), 1024u);
  r.deallocate_sync(p, 1000);
  EXPECT_EQ(live(r), 0);
}

TEST_F(MemoryResource, EqualityIsTheAllocator) {
  cucache::device_allocator own(std::make_shared<cucache::sim_backend>());
  memory_resource a(own);
  memory_resource b(own);
  const memory_resource global;
  EXPECT_TRUE(a == b);
  EXPECT_FALSE(a != b);
  EXPECT_TRUE(a != global);
  memory_resource copy = a;
  EXPECT_EQ(copy, a);
  // Memory from one is deallocated through an equal one.
  void* p = allocate_now(copy, 256, 256);
  deallocate_now(b, p, 256, 256);
  EXPECT_EQ(live(a), 0);
}

TEST_F(MemoryResource, AlignmentsFrom256To4096AreHonouredOnBothPaths) {
  memory_resource r;
  void* spacer = r.allocate_sync(100);  // so that the next small blocks start off 1024 and 4096
  for (const std::size_t alignment :
       {std::size_t{256}, std::size_t{512}, std::size_t{1024}, std::size_t{4096}}) {
    SCOPED_TRACE("alignment " + std::to_string(alignment));
    std::vector<void*> sync_ptrs;
    std::vector<void*> async_ptrs;
    for (const std::size_t bytes : {std::size_t{8}, std::size_t{3000}, std::size_t{1} << 20}) {
      void* s = allocate_now(r, bytes, alignment);
      void* a = allocate_on(r, fake_stream(3), bytes, alignment);
      EXPECT_EQ(addr(s) % alignment, 0u);
      EXPECT_EQ(addr(a) % alignment, 0u);
      sync_ptrs.push_back(s);
      async_ptrs.push_back(a);
    }
    r.allocator().check_invariants();
    for (void* p : sync_ptrs) deallocate_now(r, p, 1, alignment);
    for (void* p : async_ptrs) deallocate_on(r, fake_stream(3), p, 1, alignment);
  }
  r.deallocate_sync(spacer, 100);
  EXPECT_EQ(live(r), 0);
  r.allocator().check_invariants();
}

TEST_F(MemoryResource, BothGenerationsOfNamesReachTheSameMemory) {
  memory_resource r;
  void* a = r.allocate(1000, 4096);                        // CCCL <= 3.0: synchronous
  void* b = r.allocate_async(1000, 4096, fake_stream(1));  // CCCL <= 3.0: stream-ordered
  void* c = r.allocate(::cuda::stream_ref(fake_stream(1)), 1000, 4096);  // CCCL >= 3.1
  void* d = r.allocate_sync(1000, 4096);                                 // CCCL >= 3.1
  for (void* p : {a, b, c, d}) EXPECT_EQ(addr(p) % 4096, 0u);
  r.deallocate_sync(a, 1000, 4096);
  r.deallocate(::cuda::stream_ref(fake_stream(1)), b, 1000, 4096);
  r.deallocate_async(c, 1000, 4096, fake_stream(1));
  r.deallocate(d, 1000, 4096);
  EXPECT_EQ(live(r), 0);
}

TEST_F(MemoryResource, BadAlignmentIsRejectedNamingIt) {
  memory_resource r;
  try {
    (void)r.allocate_sync(64, 768);
    FAIL() << "alignment 768 accepted";
  } catch (const cucache::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("alignment 768"), std::string::npos) << e.what();
  }
  EXPECT_THROW((void)allocate_on(r, fake_stream(1), 64, 0), cucache::invalid_argument);
  EXPECT_EQ(live(r), 0);
}

TEST_F(MemoryResource, AForeignPointerThrowsAndChangesNothing) {
  memory_resource r;
  cucache::device_allocator own(std::make_shared<cucache::sim_backend>());
  memory_resource other(own);
  void* p = r.allocate_sync(4096, 4096);
  EXPECT_THROW(other.deallocate_sync(p, 4096, 4096), cucache::invalid_argument);
  EXPECT_THROW(r.deallocate_sync(static_cast<char*>(p) + 256, 4096), cucache::invalid_argument);
  EXPECT_EQ(live(r), 1);
  r.deallocate_sync(p, 4096, 4096);
  EXPECT_EQ(live(r), 0);
}

TEST_F(MemoryResource, ThroughResourceRef) {
  memory_resource r;
  device_ref ref{r};
  void* p = allocate_on(ref, fake_stream(2), 5000, 1024);
  EXPECT_EQ(addr(p) % 1024, 0u);
  EXPECT_EQ(live(r), 1);
  deallocate_on(ref, fake_stream(2), p, 5000, 1024);
  // The synchronous half of the same reference.
  void* q = allocate_now(ref, 100, 256);
  deallocate_now(ref, q, 100, 256);
  EXPECT_EQ(live(r), 0);
  // Two references to equal resources compare equal.
  memory_resource same;
  EXPECT_TRUE(ref == device_ref{same});
  cucache::device_allocator own(std::make_shared<cucache::sim_backend>());
  memory_resource other(own);
  EXPECT_FALSE(ref == device_ref{other});
}

#if CUCACHE_TEST_CCCL_NEW_NAMES
TEST_F(MemoryResource, ThroughSynchronousResourceRef) {
  memory_resource r;
  mr::synchronous_resource_ref<mr::device_accessible> ref{r};
  void* p = ref.allocate_sync(5000, 4096);
  EXPECT_EQ(addr(p) % 4096, 0u);
  ref.deallocate_sync(p, 5000, 4096);
  EXPECT_EQ(live(r), 0);
}
#else
TEST_F(MemoryResource, ThroughSynchronousResourceRef) {
  memory_resource r;
  mr::resource_ref<mr::device_accessible> ref{r};
  void* p = ref.allocate(5000, 4096);
  EXPECT_EQ(addr(p) % 4096, 0u);
  ref.deallocate(p, 5000, 4096);
  EXPECT_EQ(live(r), 0);
}
#endif

#if CUCACHE_TEST_CCCL_ANY_RESOURCE
TEST_F(MemoryResource, ThroughAnyResource) {
  memory_resource r;
  mr::any_resource<mr::device_accessible> any{r};
  void* p = any.allocate(::cuda::stream_ref(fake_stream(4)), 3000, 2048);
  EXPECT_EQ(addr(p) % 2048, 0u);
  EXPECT_EQ(live(r), 1);
  any.deallocate(::cuda::stream_ref(fake_stream(4)), p, 3000, 2048);
  EXPECT_EQ(live(r), 0);
}
#else
TEST_F(MemoryResource, ThroughAnyResource) {
  GTEST_SKIP() << "the toolkit's CCCL " << CCCL_MAJOR_VERSION << "." << CCCL_MINOR_VERSION
               << " has no cuda::mr::any_resource (it is in cudax, not in the toolkit)";
}
#endif

}  // namespace
