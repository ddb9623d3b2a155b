// fork(): a child forked after cucache was used must not use its parent's device state (CUDA
// contexts, allocations, streams and events do not survive fork). The registry's atfork child
// handler takes the parent's registry out of the child's reach: every call that would use it fails
// with cudaErrorInitializationError and a message naming the fork, empty_cache and flush_trace do
// nothing, and the child's exit handler neither frees the parent's memory nor writes the parent's
// trace rows. The parent is unaffected. Each test forks on the simulated device; the child reports
// through its exit code (0: every expectation held; otherwise the number of the first that failed)
// and the parent checks it.
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "api/registry.hpp"
#include "cucache/cucache.h"
#include "cucache/cucache.hpp"
#include "cucache/trace.hpp"
#include "support/sim_registry.hpp"

namespace {

constexpr std::size_t k_mib = std::size_t{1} << 20;

class Fork : public ::testing::Test {
 protected:
  void SetUp() override { restore(); }
  void TearDown() override { restore(); }
  static void restore() { cucache::test::use_sim_registry(); }
};

/// Runs `child` in a forked child, which ends with _exit(child()) (or with exit() when
/// `run_exit_handlers`), and returns its exit status; -1 when it did not exit normally.
template <class F>
int in_child(F&& child, bool run_exit_handlers = false) {
  std::fflush(nullptr);  // nothing buffered in the parent is written twice
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int code = child();
    if (run_exit_handlers) std::exit(code);
    ::_exit(code);
  }
  if (pid < 0) return -2;
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -3;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

bool names_the_fork(const char* message) {
  const std::string m = message;
  return m.find("forked") != std::string::npos && m.find("exec") != std::string::npos;
}

TEST_F(Fork, ChildOfAProcessThatUsedCucacheGetsAClearErrorAndTheParentCarriesOn) {
  void* p = nullptr;
  ASSERT_EQ(cucacheMalloc(&p, 4 * k_mib), cudaSuccess);
  cucacheStats before{};
  ASSERT_EQ(cucacheGetStats(0, &before), cudaSuccess);

  const int child = in_child([p] {
    void* q = reinterpret_cast<void*>(0x1);
    if (cucacheMalloc(&q, 512) != cudaErrorInitializationError) return 1;
    if (q != nullptr) return 2;
    if (!names_the_fork(cucacheGetLastErrorMessage())) return 3;
    // The parent's pointer: not freed, not diagnosed as unknown, but refused for the fork.
    if (cucacheFree(p) != cudaErrorInitializationError) return 4;
    if (!names_the_fork(cucacheGetLastErrorMessage())) return 5;
    if (cucacheFreeAsync(p, nullptr) != cudaErrorInitializationError) return 6;
    if (cucacheRecordStream(p, nullptr) != cudaErrorInitializationError) return 7;
    cucacheStats s{};
    if (cucacheGetStats(0, &s) != cudaErrorInitializationError) return 8;
    std::size_t free_bytes = 0;
    std::size_t total_bytes = 0;
    if (cucacheMemGetInfo(&free_bytes, &total_bytes) != cudaErrorInitializationError) return 9;
    // Nothing of the child's is cached: emptying succeeds and does nothing.
    if (cucacheEmptyCache() != cudaSuccess) return 10;
    if (!cucache::detail::registry::forked_child()) return 11;
    if (cucache::detail::registry::if_built() != nullptr) return 12;
    // reset_for_testing does not make the parent's state usable again.
    cucache::detail::reset_for_testing();
    if (cucacheMalloc(&q, 512) != cudaErrorInitializationError) return 13;
    try {
      static_cast<void>(cucache::malloc(512));
      return 14;
    } catch (const cucache::cuda_error& e) {
      if (e.code() != cudaErrorInitializationError || !names_the_fork(e.what())) return 15;
    }
    return 0;
  });
  EXPECT_EQ(child, 0);

  // The parent is untouched and keeps working.
  EXPECT_FALSE(cucache::detail::registry::forked_child());
  cucacheStats after{};
  ASSERT_EQ(cucacheGetStats(0, &after), cudaSuccess);
  EXPECT_EQ(after.allocatedBytes, before.allocatedBytes);
  EXPECT_EQ(after.reservedBytes, before.reservedBytes);
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
  void* q = nullptr;
  EXPECT_EQ(cucacheMalloc(&q, 4 * k_mib), cudaSuccess);
  EXPECT_EQ(q, p);
  EXPECT_EQ(cucacheFree(q), cudaSuccess);
}

TEST_F(Fork, ChildExitWritesNoneOfTheParentsTraceRowsAndFreesNothing) {
  const std::filesystem::path trace = std::filesystem::temp_directory_path() /
                                      ("cucache-fork-trace." + std::to_string(::getpid()) + ".csv");
  ::setenv("CUCACHE_CONF", ("trace:" + trace.string()).c_str(), 1);
  cucache::detail::reset_for_testing();
  void* p = nullptr;
  void* r = nullptr;
  ASSERT_EQ(cucacheMalloc(&p, k_mib), cudaSuccess);
  ASSERT_EQ(cucacheMalloc(&r, 3 * k_mib), cudaSuccess);
  ASSERT_EQ(cucacheFree(r), cudaSuccess);  // two rows buffered in this thread, not yet written

  // exit(): the child runs the exit handlers it inherited (cucache's flushes the trace and empties
  // the cache of a registry it can reach).
  EXPECT_EQ(in_child([] { return 0; }, /*run_exit_handlers=*/true), 0);

  cucacheStats s{};
  ASSERT_EQ(cucacheGetStats(0, &s), cudaSuccess);
  EXPECT_EQ(s.allocatedBytes, k_mib);
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
  cucache::flush_trace();
  // Each row once: read_trace refuses an allocation of a live pointer, and the counts are exact.
  const auto events = cucache::read_trace(trace);
  EXPECT_EQ(events.size(), 4u);
  cucache::detail::reset_for_testing();
  std::filesystem::remove(trace);
}

TEST_F(Fork, ChildForkedBeforeFirstUseHasNoParentStateAndMayUseCucache) {
  ASSERT_EQ(cucache::detail::registry::if_built(), nullptr);
  const int child = in_child([] {
    void* q = nullptr;
    if (cucacheMalloc(&q, 512) != cudaSuccess || q == nullptr) return 1;
    if (cucacheFree(q) != cudaSuccess) return 2;
    return cucache::detail::registry::forked_child() ? 3 : 0;
  });
  EXPECT_EQ(child, 0);
}

TEST_F(Fork, GrandchildOfAForkedChildIsRefusedToo) {
  void* p = nullptr;
  ASSERT_EQ(cucacheMalloc(&p, 512), cudaSuccess);
  const int child = in_child([] {
    const int grandchild = in_child([] {
      void* q = nullptr;
      return cucacheMalloc(&q, 512) == cudaErrorInitializationError ? 0 : 1;
    });
    return grandchild == 0 ? 0 : 10 + grandchild;
  });
  EXPECT_EQ(child, 0);
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
}

}  // namespace
