// The process registry (src/api/registry.cpp): what it says about the environment it reads.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "api/registry.hpp"
#include "cucache/cucache.hpp"

namespace cucache::test {
namespace {

// Before main: two simulated devices (the announced-captures test creates the second late).
const bool k_two_devices = [] {
  ::setenv("CUCACHE_SIM_DEVICES", "2", 1);
  return true;
}();

TEST(Registry, PytorchsVariablesAloneAreNamedNotSilentlyDropped) {
  // PYTORCH_ALLOC_CONF configures PyTorch's allocator; with CUCACHE_CONF unset cucache runs with
  // its defaults, and says so once, when the registry is built.
  ::setenv("CUCACHE_BACKEND", "sim", 1);
  ::unsetenv("CUCACHE_CONF");
  ::setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True", 1);
  testing::internal::CaptureStderr();
  void* p = cucache::malloc(4096);
  cucache::free(p);
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_NE(said.find("PYTORCH_ALLOC_CONF is set, but it configures PyTorch's allocator"),
            std::string::npos)
      << said;
  EXPECT_FALSE(get().get_config().expandable_segments);

  // The older name too; and nothing when CUCACHE_CONF is given.
  ::unsetenv("PYTORCH_ALLOC_CONF");
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64", 1);
  testing::internal::CaptureStderr();
  detail::registry::note_pytorch_settings();
  EXPECT_NE(testing::internal::GetCapturedStderr().find("PYTORCH_CUDA_ALLOC_CONF is set"),
            std::string::npos);
  ::setenv("CUCACHE_CONF", "max_split_size_mb:64", 1);
  testing::internal::CaptureStderr();
  detail::registry::note_pytorch_settings();
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

TEST(Registry, CapturesAnnouncedReachEveryAllocatorAndThoseCreatedLater) {
  ::setenv("CUCACHE_BACKEND", "sim", 1);
  detail::registry& r = detail::registry::instance();
  ASSERT_EQ(r.device_count(), 2);
  device_allocator& first = r.allocator(0);
  EXPECT_FALSE(first.captures_announced());
  r.set_captures_announced(true);
  EXPECT_TRUE(first.captures_announced());
  r.announce_capture_begin();
  EXPECT_EQ(first.announced_captures(), 1u);
  // Created while the mode is on and a capture is announced: both carried over.
  ASSERT_EQ(r.find(1), nullptr);
  device_allocator& second = r.allocator(1);
  EXPECT_TRUE(second.captures_announced());
  EXPECT_EQ(second.announced_captures(), 1u);
  r.announce_capture_end();
  EXPECT_EQ(first.announced_captures(), 0u);
  EXPECT_EQ(second.announced_captures(), 0u);
  EXPECT_THROW(r.announce_capture_end(), invalid_argument);  // nothing changed
  EXPECT_EQ(second.announced_captures(), 0u);
  r.set_captures_announced(false);
  EXPECT_FALSE(first.captures_announced());
  EXPECT_FALSE(second.captures_announced());
}

}  // namespace
}  // namespace cucache::test
