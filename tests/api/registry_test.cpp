// The process registry (src/api/registry.cpp): what it says about the environment it reads.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "api/registry.hpp"
#include "cucache/cucache.hpp"

namespace cucache::test {
namespace {

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

}  // namespace
}  // namespace cucache::test
