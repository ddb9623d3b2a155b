// Tests of tools/common on the CPU: the CUDA error helper's results and exceptions, and the c10
// peer loader against stand-in shims (fake_c10_peer.c): search path, interface version, the
// settings it hands to c10, and the reasons it gives when it cannot load.
#include <cuda_runtime_api.h>
#include <signal.h>
#include <stdlib.h>

#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "common/c10_loader.hpp"
#include "common/child_process.hpp"
#include "common/cuda_check.hpp"
#include "cucache/errors.hpp"

namespace cucache::tools {
namespace {

TEST(child_process, returns_the_answer_of_the_child_and_leaves_the_parent_untouched) {
  int in_parent = 1;
  const cucache::tools::child_answer a = cucache::tools::run_in_child([&] {
    in_parent = 2;  // the child's copy
    return std::string(100000, 'x') + "end";  // larger than a pipe's buffer
  });
  ASSERT_TRUE(a.ok) << a.error;
  EXPECT_EQ(a.text.size(), 100003u);
  EXPECT_EQ(a.text.substr(a.text.size() - 3), "end");
  EXPECT_EQ(in_parent, 1);
  const cucache::tools::child_answer empty = cucache::tools::run_in_child([] { return std::string(); });
  EXPECT_TRUE(empty.ok) << empty.error;
  EXPECT_TRUE(empty.text.empty());
}

TEST(child_process, says_what_the_child_threw_or_died_of) {
  const cucache::tools::child_answer thrown =
      cucache::tools::run_in_child([]() -> std::string { throw cucache::error("no such peer"); });
  EXPECT_FALSE(thrown.ok);
  EXPECT_EQ(thrown.error, "no such peer");
  const cucache::tools::child_answer killed = cucache::tools::run_in_child([]() -> std::string {
    ::raise(SIGKILL);
    return "unreachable";
  });
  EXPECT_FALSE(killed.ok);
  EXPECT_NE(killed.error.find("died of signal 9"), std::string::npos) << killed.error;
}

TEST(cuda_check, success_passes_and_a_failure_names_the_call_and_code) {
  EXPECT_NO_THROW(check_cuda(cudaSuccess, "cudaFree"));
  try {
    check_cuda(cudaErrorInvalidValue, "cudaMemPoolCreate");
    FAIL() << "no exception";
  } catch (const cuda_error& e) {
    EXPECT_EQ(e.call(), "cudaMemPoolCreate");
    EXPECT_EQ(e.code(), static_cast<int>(cudaErrorInvalidValue));
  }
}

TEST(cuda_check, the_expected_failure_is_a_result_any_other_throws) {
  EXPECT_TRUE(check_cuda_expecting(cudaSuccess, cudaErrorMemoryAllocation, "cudaMalloc"));
  EXPECT_FALSE(
      check_cuda_expecting(cudaErrorMemoryAllocation, cudaErrorMemoryAllocation, "cudaMalloc"));
  EXPECT_THROW(
      (void)check_cuda_expecting(cudaErrorInvalidValue, cudaErrorMemoryAllocation, "cudaMalloc"),
      cuda_error);
}

/// Sets CUCACHE_C10_PEER for one test.
class peer_path {
 public:
  explicit peer_path(const std::string& path) { ::setenv("CUCACHE_C10_PEER", path.c_str(), 1); }
  ~peer_path() { ::unsetenv("CUCACHE_C10_PEER"); }
  peer_path(const peer_path&) = delete;
  peer_path& operator=(const peer_path&) = delete;
};

std::string load_error(const std::string& conf = "") {
  try {
    (void)load_c10_peer(conf);
  } catch (const error& e) {
    return e.what();
  }
  return "loaded";
}

// The failures first: none of them counts as the process's one load.
TEST(c10_loader, says_why_it_cannot_load) {
  {
    const peer_path p("/nonexistent/libcucache_c10_peer.so");
    EXPECT_EQ(c10_peer_path(), "/nonexistent/libcucache_c10_peer.so");
    const std::string why = load_error();
    EXPECT_NE(why.find("/nonexistent/libcucache_c10_peer.so not found"), std::string::npos) << why;
    EXPECT_NE(why.find("tools/build_c10_peer.sh"), std::string::npos) << why;
  }
  {
    const peer_path p(FAKE_C10_PEER_WRONG_ABI);
    const std::string why = load_error();
    EXPECT_NE(why.find("has interface version 999, expected"), std::string::npos) << why;
  }
  {
    const peer_path p(NOT_A_C10_PEER);  // a shared library without the shim's functions
    const std::string why = load_error();
    EXPECT_NE(why.find("lacks cucache_peer_c10_abi"), std::string::npos) << why;
  }
}

TEST(c10_loader, without_the_variable_looks_beside_the_executable) {
  ::unsetenv("CUCACHE_C10_PEER");
  EXPECT_EQ(c10_peer_path().filename(), "libcucache_c10_peer.so");
}

TEST(c10_loader, loads_once_with_the_settings_asked_for) {
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64", 1);  // the caller's, replaced
  ::setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:128", 1);      // PyTorch's newer name, too
  const peer_path p(FAKE_C10_PEER);
  const c10_peer_library& lib = load_c10_peer("expandable_segments:True");
  EXPECT_STREQ(std::getenv("PYTORCH_ALLOC_CONF"), "expandable_segments:True");
  EXPECT_STREQ(std::getenv("PYTORCH_CUDA_ALLOC_CONF"), "expandable_segments:True");
  EXPECT_EQ(lib.path(), FAKE_C10_PEER);
  EXPECT_EQ(lib.conf(), "expandable_segments:True");
  // What the peer saw at its init: both of PyTorch's names already say the settings asked for.
  EXPECT_EQ(lib.last_error(),
            "init conf=[expandable_segments:True] env=[expandable_segments:True] "
            "alloc_env=[expandable_segments:True]");
  void* ptr = lib.allocate(4096, nullptr);
  ASSERT_NE(ptr, nullptr);
  EXPECT_EQ(lib.stats().num_device_alloc, 1);
  lib.deallocate(ptr);
  lib.reset();
  EXPECT_EQ(lib.stats().num_device_alloc, 0);
  EXPECT_NO_THROW(lib.set_memory_fraction(0.5));
  try {
    lib.set_memory_fraction(2.0);
    FAIL() << "no exception";
  } catch (const error& e) {
    EXPECT_STREQ(e.what(), "c10 peer: set_memory_fraction failed: fraction 2 out of range");
  }
  // c10's state is process-wide: a second load is refused.
  EXPECT_NE(load_error().find("already loaded"), std::string::npos);
  ::unsetenv("PYTORCH_CUDA_ALLOC_CONF");
  ::unsetenv("PYTORCH_ALLOC_CONF");
}

}  // namespace
}  // namespace cucache::tools
