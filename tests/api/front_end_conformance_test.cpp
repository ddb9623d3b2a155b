// One conformance suite for every front end over the process registry (src/api/registry.hpp):
// the C++ global API (cucache.hpp), the C API (cucache.h) and the PyTorch plug-in's C ABI
// (cucache_torch.h, libcucache_torch.so, which carries its own copy of the registry). Each
// behaviour is written once against a small adapter (`front_end`) and run against each front end.
//
// The registry reads the environment once per process (and the plug-in's copy cannot be reset),
// so every test runs its behaviour in a child process of its own: the test binary itself, run
// with a filter naming the one test and the environment the behaviour needs (CUCACHE_BACKEND=sim
// always; CUCACHE_SIM_DEVICES, CUCACHE_CONF as given). The parent passes when the child's test
// passed, and shows the child's output when it did not.
//
// ThePluginWritesTheSameTraceAsTheOtherFrontEnds runs the same calls through each front end, each
// in its own process with CUCACHE_CONF=trace:PATH, and compares the files row by row, Time aside.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "api/registry.hpp"
#include "cucache/cucache.h"
#include "cucache/cucache.hpp"
#include "cucache/sim_backend.hpp"
#include "cucache/trace.hpp"
#include "support/sim_registry.hpp"
#if CUCACHE_CONFORMANCE_TORCH
#include "cucache_torch.h"
#endif

extern char** environ;  // NOLINT: POSIX

namespace {

using cucache::stream_handle;

using cucache::test::KiB;
using cucache::test::MiB;

/// Set in the environment of a child: run the behaviour instead of spawning.
constexpr const char* k_child_env = "CUCACHE_CONFORMANCE_CHILD";

constexpr auto stream = &cucache::test::fake_stream<>;
std::string pointer_text(const void* p) {
  return fmt::format("{}", p);
}
void* at(void* p, std::size_t offset) {
  return static_cast<char*>(p) + offset;
}

// --- the adapter ---------------------------------------------------------------------------------

/// What a call did: ok, or the error the front end reported in its own way (an exception, a
/// cudaError_t with cucacheGetLastErrorMessage, a NULL or -1 with cucache_torch_last_error).
struct outcome {
  bool ok = true;
  std::string error;
};

/// The statistics every front end reports (cucacheStats has the fewest).
struct front_stats {
  std::size_t allocated = 0;
  std::size_t allocated_peak = 0;
  std::size_t reserved = 0;
  std::size_t reserved_peak = 0;
  std::size_t active = 0;
  std::size_t requested = 0;
  std::size_t cached_free = 0;
  std::size_t largest_free = 0;
  std::size_t allocations = 0;
  std::size_t segments = 0;
  std::uint64_t device_allocs = 0;
  std::uint64_t device_frees = 0;
  std::uint64_t ooms = 0;
  std::uint64_t retries = 0;
  friend bool operator==(const front_stats&, const front_stats&) = default;
};

std::ostream& operator<<(std::ostream& os, const front_stats& s) {
  return os << "{allocated " << s.allocated << " (peak " << s.allocated_peak << "), reserved "
            << s.reserved << " (peak " << s.reserved_peak << "), active " << s.active
            << ", requested " << s.requested << ", cached free " << s.cached_free << " (largest "
            << s.largest_free << "), " << s.allocations << " allocations, " << s.segments
            << " segments, device allocs/frees " << s.device_allocs << "/" << s.device_frees
            << ", ooms " << s.ooms << ", retries " << s.retries << "}";
}

class front_end {
 public:
  virtual ~front_end() = default;
  [[nodiscard]] virtual const char* name() const = 0;
  /// Allocates `bytes` on `device` for use on `stream`.
  virtual outcome allocate(void** out, std::size_t bytes, stream_handle stream, int device) = 0;
  /// Frees in the order of `stream`: the allocation's own stream for a plain free. `device` is
  /// the caller's idea of the owner (torch passes it; the other front ends find it themselves).
  virtual outcome free(void* p, stream_handle stream, int device) = 0;
  virtual outcome record_stream(void* p, stream_handle stream) = 0;
  virtual outcome empty_cache() = 0;
  virtual outcome stats(int device, front_stats* out) = 0;
  /// The simulated devices' streams catch up: every event recorded so far completes.
  virtual void complete_all() = 0;
  /// Whether the front end can drop its registry so that the next call reads the environment.
  [[nodiscard]] virtual bool can_reset() const = 0;
  virtual void reset() = 0;

  // Shorthands for the tests.
  void* alloc(std::size_t bytes, stream_handle s = nullptr, int device = 0) {
    void* p = nullptr;
    const outcome o = allocate(&p, bytes, s, device);
    EXPECT_TRUE(o.ok) << name() << ": allocate(" << bytes << "): " << o.error;
    return p;
  }
  void release(void* p, stream_handle s = nullptr, int device = 0) {
    const outcome o = free(p, s, device);
    EXPECT_TRUE(o.ok) << name() << ": free(" << p << "): " << o.error;
  }
  front_stats stats_of(int device = 0) {
    front_stats s;
    const outcome o = stats(device, &s);
    EXPECT_TRUE(o.ok) << name() << ": stats(" << device << "): " << o.error;
    return s;
  }
};

// The C++ and the C API share the registry of this executable (cucache_api, linked statically).
void complete_all_registry_devices() {
  cucache::detail::registry* r = cucache::detail::registry::if_built();
  for (int d = 0; r != nullptr && d < r->device_count(); ++d) {
    if (auto* sim = dynamic_cast<cucache::sim_backend*>(r->backend_of(d))) sim->complete_all();
  }
}

std::size_t as_size(std::int64_t v) {
  return v > 0 ? static_cast<std::size_t>(v) : 0;
}

class cpp_front_end final : public front_end {
 public:
  [[nodiscard]] const char* name() const override { return "C++ API"; }
  outcome allocate(void** out, std::size_t bytes, stream_handle s, int device) override {
    return guarded([&] {
      *out = nullptr;
      // cucache::malloc allocates on the current device, which on the simulated backend is 0.
      *out = device == 0 ? cucache::malloc(bytes, s) : cucache::get(device).allocate(bytes, s);
    });
  }
  outcome free(void* p, stream_handle s, int /*device*/) override {
    return guarded([&] { s == nullptr ? cucache::free(p) : cucache::free_async(p, s); });
  }
  outcome record_stream(void* p, stream_handle s) override {
    return guarded([&] { cucache::record_stream(p, s); });
  }
  outcome empty_cache() override {
    return guarded([] { cucache::empty_cache(); });
  }
  outcome stats(int device, front_stats* out) override {
    return guarded([&] {
      const cucache::device_stats s = cucache::get(device).stats();
      out->allocated = as_size(s.allocated_bytes[0].current);
      out->allocated_peak = as_size(s.allocated_bytes[0].peak);
      out->reserved = as_size(s.reserved_bytes[0].current);
      out->reserved_peak = as_size(s.reserved_bytes[0].peak);
      out->active = as_size(s.active_bytes[0].current);
      out->requested = as_size(s.requested_bytes[0].current);
      out->cached_free = s.free_bytes;
      out->largest_free = s.largest_free_block;
      out->allocations = as_size(s.allocation_count[0].current);
      out->segments = as_size(s.segment_count[0].current);
      out->device_allocs = s.device_alloc_count;
      out->device_frees = s.device_free_count;
      out->ooms = s.oom_count;
      out->retries = s.alloc_retry_count;
    });
  }
  void complete_all() override { complete_all_registry_devices(); }
  [[nodiscard]] bool can_reset() const override { return true; }
  void reset() override { cucache::detail::reset_for_testing(); }

 private:
  template <class F>
  static outcome guarded(F&& f) {
    try {
      f();
      return {};
    } catch (const std::exception& e) {
      return {false, e.what()};
    }
  }
};

class c_front_end final : public front_end {
 public:
  [[nodiscard]] const char* name() const override { return "C API"; }
  outcome allocate(void** out, std::size_t bytes, stream_handle s, int device) override {
    if (device != 0) {
      // cucache.h allocates on the current device only, which on the simulated backend is always
      // 0: memory of another device comes from the registry's allocator (what cucacheFree must
      // then find is the owner).
      try {
        *out = cucache::get(device).allocate(bytes, s);
        return {};
      } catch (const std::exception& e) {
        return {false, e.what()};
      }
    }
    const cudaError_t code = s == nullptr
                                 ? cucacheMalloc(out, bytes)
                                 : cucacheMallocAsync(out, bytes, static_cast<cudaStream_t>(s));
    return result(code);
  }
  outcome free(void* p, stream_handle s, int /*device*/) override {
    return result(s == nullptr ? cucacheFree(p)
                               : cucacheFreeAsync(p, static_cast<cudaStream_t>(s)));
  }
  outcome record_stream(void* p, stream_handle s) override {
    return result(cucacheRecordStream(p, static_cast<cudaStream_t>(s)));
  }
  outcome empty_cache() override { return result(cucacheEmptyCache()); }
  outcome stats(int device, front_stats* out) override {
    cucacheStats s{};
    const cudaError_t code = cucacheGetStats(device, &s);
    out->allocated = s.allocatedBytes;
    out->allocated_peak = s.allocatedBytesPeak;
    out->reserved = s.reservedBytes;
    out->reserved_peak = s.reservedBytesPeak;
    out->active = s.activeBytes;
    out->requested = s.requestedBytes;
    out->cached_free = s.cachedFreeBytes;
    out->largest_free = s.largestFreeBlock;
    out->allocations = s.allocationCount;
    out->segments = s.segmentCount;
    out->device_allocs = s.deviceAllocCount;
    out->device_frees = s.deviceFreeCount;
    out->ooms = s.oomCount;
    out->retries = s.allocRetryCount;
    return result(code);
  }
  void complete_all() override { complete_all_registry_devices(); }
  [[nodiscard]] bool can_reset() const override { return true; }
  void reset() override { cucache::detail::reset_for_testing(); }

 private:
  static outcome result(cudaError_t code) {
    if (code == cudaSuccess) return {};
    return {false,
            fmt::format("error {}: {}", static_cast<int>(code), cucacheGetLastErrorMessage())};
  }
};

#if CUCACHE_CONFORMANCE_TORCH
class torch_front_end final : public front_end {
 public:
  [[nodiscard]] const char* name() const override { return "PyTorch plug-in"; }
  outcome allocate(void** out, std::size_t bytes, stream_handle s, int device) override {
    cucache_torch_set_error("");
    *out = cucache_torch_alloc(bytes, device, static_cast<cucache_torch_stream>(s));
    if (*out == nullptr && bytes != 0) return {false, cucache_torch_last_error()};
    return {};
  }
  outcome free(void* p, stream_handle s, int device) override {
    // Reports to stderr and counts instead of failing: an error is a new count or a message.
    cucache_torch_set_error("");
    const std::uint64_t bad_before = cucache_torch_bad_free_count();
    cucache_torch_free(p, 0, device, static_cast<cucache_torch_stream>(s));
    const std::string error = cucache_torch_last_error();
    if (cucache_torch_bad_free_count() != bad_before || !error.empty()) return {false, error};
    return {};
  }
  outcome record_stream(void* p, stream_handle s) override {
    return result(cucache_torch_record_stream(p, static_cast<cucache_torch_stream>(s)));
  }
  outcome empty_cache() override { return result(cucache_torch_empty_cache()); }
  outcome stats(int device, front_stats* out) override {
    cucache_torch_stats s{};
    const int rc = cucache_torch_get_stats(device, &s);
    out->allocated = as_size(s.allocated_bytes[0].current);
    out->allocated_peak = as_size(s.allocated_bytes[0].peak);
    out->reserved = as_size(s.reserved_bytes[0].current);
    out->reserved_peak = as_size(s.reserved_bytes[0].peak);
    out->active = as_size(s.active_bytes[0].current);
    out->requested = as_size(s.requested_bytes[0].current);
    out->cached_free = s.free_bytes;
    out->largest_free = s.largest_free_block;
    out->allocations = as_size(s.allocation[0].current);
    out->segments = as_size(s.segment[0].current);
    out->device_allocs = s.num_device_alloc;
    out->device_frees = s.num_device_free;
    out->ooms = s.num_ooms;
    out->retries = s.num_alloc_retries;
    return result(rc);
  }
  void complete_all() override {
    EXPECT_EQ(cucache_torch_sim_complete_all(), 0) << cucache_torch_last_error();
  }
  /// The plug-in has no reset: torch loads it once per process.
  [[nodiscard]] bool can_reset() const override { return false; }
  void reset() override { ADD_FAILURE() << "the plug-in cannot be reset"; }

 private:
  static outcome result(int rc) {
    if (rc == 0) return {};
    return {false, cucache_torch_last_error()};
  }
};
#endif

enum class front_end_kind : std::uint8_t { cpp, c, torch };

std::string kind_name(front_end_kind k) {
  switch (k) {
    case front_end_kind::cpp:
      return "cpp";
    case front_end_kind::c:
      return "c";
    case front_end_kind::torch:
      return "torch";
  }
  return "unknown";
}

std::string front_end_name(const ::testing::TestParamInfo<front_end_kind>& param_info) {
  return kind_name(param_info.param);
}

std::vector<front_end_kind> all_front_ends() {
  std::vector<front_end_kind> v = {front_end_kind::cpp, front_end_kind::c};
#if CUCACHE_CONFORMANCE_TORCH
  v.push_back(front_end_kind::torch);
#endif
  return v;
}

front_end& the_front_end(front_end_kind k) {
  static cpp_front_end cpp;
  static c_front_end c;
#if CUCACHE_CONFORMANCE_TORCH
  static torch_front_end torch;
  if (k == front_end_kind::torch) return torch;
#endif
  return k == front_end_kind::c ? static_cast<front_end&>(c) : cpp;
}

// --- child processes -----------------------------------------------------------------------------

struct env_change {
  std::string name;
  std::optional<std::string> value;  // nullopt: unset
};
using env_changes = std::vector<env_change>;

bool in_child() {
  return std::getenv(k_child_env) != nullptr;
}

struct child_result {
  int exit_code = -1;  // -1: did not exit normally
  std::string output;
};

/// Runs this executable on the one test `filter` names, with the current environment less
/// cucache's and gtest's variables, plus CUCACHE_BACKEND=sim and `changes`.
child_result run_child(const std::string& filter, const env_changes& changes) {
  static const std::vector<std::string_view> dropped = {"CUCACHE_BACKEND",
                                                        "CUCACHE_CONF",
                                                        "CUCACHE_SIM_DEVICES",
                                                        "CUCACHE_TORCH_OOM",
                                                        k_child_env,
                                                        "GTEST_OUTPUT",
                                                        "GTEST_FILTER",
                                                        "GTEST_SHARD_INDEX",
                                                        "GTEST_TOTAL_SHARDS",
                                                        "GTEST_REPEAT",
                                                        "GTEST_SHARD_STATUS_FILE",
                                                        "GTEST_ALSO_RUN_DISABLED_TESTS"};
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('='));
    if (std::find(dropped.begin(), dropped.end(), name) == dropped.end()) env.emplace_back(entry);
  }
  env.emplace_back("CUCACHE_BACKEND=sim");
  for (const env_change& c : changes) {
    std::erase_if(env, [&](const std::string& e) { return e.starts_with(c.name + "="); });
    if (c.value) env.push_back(c.name + "=" + *c.value);
  }
  env.push_back(std::string(k_child_env) + "=1");
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);

  std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  std::string filter_arg = "--gtest_filter=" + filter;
  std::string color_arg = "--gtest_color=no";
  std::vector<char*> argv = {exe.data(), filter_arg.data(), color_arg.data(), nullptr};

  child_result result;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    result.output = std::string("pipe2: ") + std::strerror(errno);
    return result;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    result.output = "posix_spawn " + exe + ": " + std::strerror(rc);
    return result;
  }
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n > 0) {
      result.output.append(buf, static_cast<std::size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  return result;
}

/// The child ran the one test it was given, and it passed.
void expect_child_passed(const child_result& r, const std::string& filter) {
  const bool ran_one = r.output.find("[  PASSED  ] 1 test.") != std::string::npos;
  EXPECT_TRUE(r.exit_code == 0 && ran_one)
      << "the child process running " << filter << " exited with " << r.exit_code << ":\n"
      << r.output;
}

std::string current_test_name() {
  const ::testing::TestInfo* t = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string(t->test_suite_name()) + "." + t->name();
}

// --- the fixture ---------------------------------------------------------------------------------

class FrontEnd : public ::testing::TestWithParam<front_end_kind> {
 protected:
  front_end& fe() { return the_front_end(GetParam()); }

  /// In the parent: runs this test in a child process with `changes` applied to the environment
  /// and expects it to pass. In the child: runs `behaviour` against this test's front end.
  void isolated(const env_changes& changes, const std::function<void(front_end&)>& behaviour) {
    if (in_child()) {
      behaviour(fe());
      return;
    }
    const std::string name = current_test_name();
    expect_child_passed(run_child(name, changes), name);
  }
};

// --- behaviours ----------------------------------------------------------------------------------

TEST_P(FrontEnd, AllocateFreeAndReuse) {
  isolated({}, [](front_end& fe) {
    void* p = fe.alloc(1000);
    ASSERT_NE(p, nullptr);
    front_stats s = fe.stats_of();
    EXPECT_EQ(s.allocations, 1u);
    EXPECT_EQ(s.allocated, 1024u);
    EXPECT_EQ(s.requested, 1000u);
    EXPECT_EQ(s.reserved, 2 * MiB);
    EXPECT_EQ(s.segments, 1u);
    EXPECT_EQ(s.device_allocs, 1u);
    fe.release(p);
    s = fe.stats_of();
    EXPECT_EQ(s.allocations, 0u);
    EXPECT_EQ(s.allocated, 0u);
    EXPECT_EQ(s.reserved, 2 * MiB);  // cached, not given back
    void* q = fe.alloc(1000);
    EXPECT_EQ(q, p);  // reused at once on its own stream
    EXPECT_EQ(fe.stats_of().device_allocs, 1u);
    fe.release(q);

    // The runtime's shapes: nothing for zero bytes, freeing NULL does nothing.
    void* z = reinterpret_cast<void*>(0x1);
    EXPECT_TRUE(fe.allocate(&z, 0, nullptr, 0).ok);
    EXPECT_EQ(z, nullptr);
    EXPECT_TRUE(fe.free(nullptr, nullptr, 0).ok);
    EXPECT_EQ(fe.stats_of().allocations, 0u);
  });
}

TEST_P(FrontEnd, ForeignAndDoubleFreesAreErrorsThatChangeNothing) {
  isolated({}, [](front_end& fe) {
    int host = 0;
    // Before anything was allocated: not ours, and nothing is created.
    outcome o = fe.free(&host, nullptr, 0);
    EXPECT_FALSE(o.ok);
    EXPECT_NE(o.error.find(pointer_text(&host)), std::string::npos) << o.error;
    EXPECT_FALSE(fe.record_stream(&host, stream(2)).ok);

    void* p = fe.alloc(4 * KiB);
    void* q = fe.alloc(4 * KiB);
    fe.release(q);
    const front_stats before = fe.stats_of();
    o = fe.free(&host, nullptr, 0);
    EXPECT_FALSE(o.ok);
    EXPECT_NE(o.error.find("not allocated by cucache"), std::string::npos) << o.error;
    o = fe.free(q, nullptr, 0);
    EXPECT_FALSE(o.ok);
    EXPECT_NE(o.error.find("already freed"), std::string::npos) << o.error;
    o = fe.free(at(p, 512), nullptr, 0);
    EXPECT_FALSE(o.ok);
    EXPECT_NE(o.error.find("512 bytes into"), std::string::npos) << o.error;
    o = fe.record_stream(q, stream(2));
    EXPECT_FALSE(o.ok);
    EXPECT_NE(o.error.find("record_stream"), std::string::npos) << o.error;
    EXPECT_EQ(fe.stats_of(), before);
    // Nothing changed: p is still live, q's block is the next one handed out.
    EXPECT_EQ(fe.alloc(4 * KiB), q);
    fe.release(p);
    fe.release(q);
    EXPECT_EQ(fe.stats_of().allocations, 0u);
  });
}

TEST_P(FrontEnd, RecordStreamDefersReuseUntilTheStreamCatchesUp) {
  isolated({}, [](front_end& fe) {
    void* p = fe.alloc(4 * KiB, stream(1));
    ASSERT_TRUE(fe.record_stream(p, stream(2)).ok);
    fe.release(p, stream(1));
    front_stats s = fe.stats_of();
    EXPECT_EQ(s.allocations, 0u);
    EXPECT_EQ(s.active, 4 * KiB);  // waits for stream 2
    void* q = fe.alloc(4 * KiB, stream(1));
    EXPECT_NE(q, p);
    fe.complete_all();
    void* r = fe.alloc(4 * KiB, stream(1));
    EXPECT_EQ(r, p);
    EXPECT_EQ(fe.stats_of().active, 8 * KiB);
    fe.release(q, stream(1));
    fe.release(r, stream(1));
  });
}

TEST_P(FrontEnd, FreeOnAnotherStreamDefersReuseUntilThatStreamCatchesUp) {
  isolated({}, [](front_end& fe) {
    void* p = fe.alloc(4 * KiB, stream(1));
    fe.release(p, stream(2));  // ordered on stream 2
    EXPECT_EQ(fe.stats_of().active, 4 * KiB);
    void* q = fe.alloc(4 * KiB, stream(1));
    EXPECT_NE(q, p);
    fe.complete_all();
    void* r = fe.alloc(4 * KiB, stream(1));
    EXPECT_EQ(r, p);
    fe.release(q, stream(1));
    fe.release(r, stream(1));
    EXPECT_EQ(fe.stats_of().active, 0u);
  });
}

TEST_P(FrontEnd, FreeFindsTheOwnerOfAnotherDevicesPointer) {
  isolated({{"CUCACHE_SIM_DEVICES", "2"}}, [](front_end& fe) {
    void* on0 = fe.alloc(4 * KiB, nullptr, 0);
    void* on1 = fe.alloc(4 * KiB, nullptr, 1);
    ASSERT_NE(on0, nullptr);
    ASSERT_NE(on1, nullptr);
    // As on real GPUs (one virtual address space for all devices), no two devices hand out the
    // same address: otherwise a pointer could not name its owner.
    EXPECT_NE(on0, on1);
    EXPECT_EQ(fe.stats_of(0).allocations, 1u);
    EXPECT_EQ(fe.stats_of(1).allocations, 1u);
    fe.release(on1, nullptr, 0);  // device 0 named (or current): device 1 owns it
    EXPECT_EQ(fe.stats_of(1).allocations, 0u);
    EXPECT_EQ(fe.stats_of(0).allocations, 1u) << "the free took device 0's block";
    fe.release(on0, nullptr, 1);
    EXPECT_EQ(fe.stats_of(0).allocations, 0u);
    EXPECT_FALSE(fe.free(on1, nullptr, 0).ok);  // freed already, on whichever device
    EXPECT_EQ(fe.stats_of(0).device_allocs + fe.stats_of(1).device_allocs, 2u);
  });
}

TEST_P(FrontEnd, ABadEnvironmentIsReportedOnEveryCallAndNeverCached) {
  isolated({{"CUCACHE_BACKEND", "bogus"}}, [](front_end& fe) {
    void* p = nullptr;
    for (int i = 0; i < 3; ++i) {
      const outcome o = fe.allocate(&p, 16, nullptr, 0);
      EXPECT_FALSE(o.ok) << "call " << i;
      EXPECT_NE(o.error.find("CUCACHE_BACKEND"), std::string::npos) << o.error;
      EXPECT_NE(o.error.find("'bogus'"), std::string::npos) << o.error;
    }
    // What needs no allocator does not read the environment: nothing was ever allocated.
    EXPECT_TRUE(fe.empty_cache().ok);
    EXPECT_TRUE(fe.free(nullptr, nullptr, 0).ok);
    ::setenv("CUCACHE_BACKEND", "sim", 1);
    ::setenv("CUCACHE_CONF", "max_split_size_mb:banana", 1);
    for (int i = 0; i < 3; ++i) {
      const outcome o = fe.allocate(&p, 16, nullptr, 0);
      EXPECT_FALSE(o.ok) << "call " << i;
      EXPECT_NE(o.error.find("CUCACHE_CONF"), std::string::npos) << o.error;
      EXPECT_NE(o.error.find("banana"), std::string::npos) << o.error;
    }
    ::setenv("CUCACHE_CONF", "trace:/nonexistent-dir/for/cucache/trace.csv", 1);
    outcome o = fe.allocate(&p, 16, nullptr, 0);
    EXPECT_FALSE(o.ok);
    EXPECT_NE(o.error.find("nonexistent-dir"), std::string::npos) << o.error;
    // Fixed: the next call reads the environment again and works.
    ::unsetenv("CUCACHE_CONF");
    p = fe.alloc(16);
    EXPECT_NE(p, nullptr);
    fe.release(p);
    // Once built, the registry keeps the environment it was built from.
    ::setenv("CUCACHE_CONF", "max_split_size_mb:banana", 1);
    p = fe.alloc(16);
    EXPECT_NE(p, nullptr);
    fe.release(p);
    if (!fe.can_reset()) return;
    // After a reset, the environment is read again: the bad one is reported, every time.
    fe.reset();
    for (int i = 0; i < 2; ++i) {
      o = fe.allocate(&p, 16, nullptr, 0);
      EXPECT_FALSE(o.ok) << "call " << i << " after the reset";
      EXPECT_NE(o.error.find("CUCACHE_CONF"), std::string::npos) << o.error;
    }
    ::unsetenv("CUCACHE_CONF");
    p = fe.alloc(16);
    EXPECT_NE(p, nullptr);
    fe.release(p);
  });
}

TEST_P(FrontEnd, ExactStatisticsAfterAKnownSequence) {
  isolated({}, [](front_end& fe) {
    void* small = fe.alloc(1000);     // 1024 B in a 2 MiB small-pool segment
    void* large = fe.alloc(5 * MiB);  // a 20 MiB large-pool segment, split 5 + 15
    front_stats s = fe.stats_of();
    EXPECT_EQ(s.allocated, 1024 + 5 * MiB);
    EXPECT_EQ(s.allocated_peak, 1024 + 5 * MiB);
    EXPECT_EQ(s.reserved, 22 * MiB);
    EXPECT_EQ(s.reserved_peak, 22 * MiB);
    EXPECT_EQ(s.active, 1024 + 5 * MiB);
    EXPECT_EQ(s.requested, 1000 + 5 * MiB);
    EXPECT_EQ(s.cached_free, 22 * MiB - 1024 - 5 * MiB);
    EXPECT_EQ(s.largest_free, 15 * MiB);
    EXPECT_EQ(s.allocations, 2u);
    EXPECT_EQ(s.segments, 2u);
    EXPECT_EQ(s.device_allocs, 2u);
    EXPECT_EQ(s.device_frees, 0u);
    EXPECT_EQ(s.ooms, 0u);
    EXPECT_EQ(s.retries, 0u);

    fe.release(large);  // coalesces back into one 20 MiB free block
    s = fe.stats_of();
    EXPECT_EQ(s.allocated, 1024u);
    EXPECT_EQ(s.allocated_peak, 1024 + 5 * MiB);
    EXPECT_EQ(s.cached_free, 22 * MiB - 1024);
    EXPECT_EQ(s.largest_free, 20 * MiB);
    EXPECT_EQ(s.allocations, 1u);

    ASSERT_TRUE(fe.empty_cache().ok);  // the wholly free 20 MiB segment goes back
    s = fe.stats_of();
    EXPECT_EQ(s.reserved, 2 * MiB);
    EXPECT_EQ(s.reserved_peak, 22 * MiB);
    EXPECT_EQ(s.segments, 1u);
    EXPECT_EQ(s.device_frees, 1u);
    EXPECT_EQ(s.cached_free, 2 * MiB - 1024);
    // The largest request served from it: small-pool requests stop at 1 MiB (a larger one goes
    // to the large pool, which holds nothing now).
    EXPECT_EQ(s.largest_free, MiB);

    fe.release(small);
    s = fe.stats_of();
    EXPECT_EQ(s.allocated, 0u);
    EXPECT_EQ(s.active, 0u);
    EXPECT_EQ(s.requested, 0u);
    EXPECT_EQ(s.device_allocs, 2u);
  });
}

TEST_P(FrontEnd, EmptyCacheWaitsForPendingFreesAndReleasesWhatIsFree) {
  isolated({}, [](front_end& fe) {
    EXPECT_TRUE(fe.empty_cache().ok);  // nothing allocated yet: nothing to do
    EXPECT_EQ(fe.stats_of(), front_stats{});
    void* p = fe.alloc(1000, stream(1));
    ASSERT_TRUE(fe.record_stream(p, stream(2)).ok);
    fe.release(p, stream(1));
    void* q = fe.alloc(30 * MiB);
    void* keep = fe.alloc(12 * MiB);
    fe.release(q);
    EXPECT_EQ(fe.stats_of().active, 1024 + 12 * MiB);
    ASSERT_TRUE(fe.empty_cache().ok);
    const front_stats s = fe.stats_of();
    EXPECT_EQ(s.active, 12 * MiB);
    EXPECT_EQ(s.reserved, 12 * MiB);  // keep's own segment stays
    EXPECT_EQ(s.device_frees, 2u);
    fe.release(keep);
  });
}

TEST_P(FrontEnd, OutOfMemoryUnderALimitIsReportedAndRecoveredFrom) {
  isolated({{"CUCACHE_CONF", "memory_limit:64MiB"}}, [](front_end& fe) {
    void* p = reinterpret_cast<void*>(0x1);
    const outcome o = fe.allocate(&p, 100 * MiB, nullptr, 0);
    EXPECT_FALSE(o.ok);
    EXPECT_EQ(p, nullptr);
    EXPECT_NE(o.error.find("out of memory"), std::string::npos) << o.error;
    EXPECT_NE(o.error.find("The memory limit is 64.00 MiB"), std::string::npos) << o.error;
    front_stats s = fe.stats_of();
    EXPECT_EQ(s.ooms, 1u);
    EXPECT_EQ(s.reserved, 0u);
    void* q = fe.alloc(60 * MiB);
    EXPECT_NE(q, nullptr);
    fe.release(q);
    EXPECT_EQ(fe.stats_of().ooms, 1u);
  });
}

// The calls of the trace comparison, through the front end under test.
void trace_sequence(front_end& fe) {
  void* a = fe.alloc(1000, stream(1));
  void* b = fe.alloc(3 * MiB);
  void* none = reinterpret_cast<void*>(0x1);
  EXPECT_TRUE(fe.allocate(&none, 0, nullptr, 0).ok);  // no row: nothing to replay
  fe.release(a, stream(1));
  fe.release(b, stream(2));  // a stream-ordered free names its stream
  void* c = nullptr;
  EXPECT_FALSE(fe.allocate(&c, 100 * MiB, stream(3), 0).ok);  // over the limit: a failure row
  int host = 0;
  EXPECT_FALSE(fe.free(&host, nullptr, 0).ok);  // no row: nothing was freed
  void* d = fe.alloc(4 * KiB, stream(1));
  EXPECT_TRUE(fe.record_stream(d, stream(2)).ok);  // no row of its own
  fe.release(d, stream(1));
  void* e = fe.alloc(1000, stream(1));
  fe.release(e, stream(1));
  // No flush: the trace is written when the process exits.
}

constexpr const char* k_trace_conf_extra = ",memory_limit:64MiB";

std::filesystem::path trace_path(const std::string& tag) {
  return std::filesystem::temp_directory_path() /
         fmt::format("cucache-conformance-{}-{}.csv", ::getpid(), tag);
}

/// The rows of a trace file without the Time column.
std::vector<std::string> rows_without_time(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::vector<std::string> rows;
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> fields;
    std::stringstream ss(line);
    for (std::string f; std::getline(ss, f, ',');) fields.push_back(f);
    if (fields.size() > 1) fields.erase(fields.begin() + 1);
    std::string row;
    for (const std::string& f : fields) row += (row.empty() ? "" : ",") + f;
    rows.push_back(row);
  }
  return rows;
}

/// Runs trace_sequence through front end `k` in its own process, tracing into `path`.
void trace_in_child(front_end_kind k, const std::filesystem::path& path) {
  const std::string filter = "Conformance/FrontEnd.TracesEveryCallAtExit/" + kind_name(k);
  const std::string conf = "trace:" + path.string() + k_trace_conf_extra;
  expect_child_passed(run_child(filter, {{"CUCACHE_CONF", conf}}), filter);
}

TEST_P(FrontEnd, TracesEveryCallAtExit) {
  if (in_child()) {
    trace_sequence(fe());
    return;
  }
  const std::filesystem::path path = trace_path(kind_name(GetParam()));
  trace_in_child(GetParam(), path);
  std::vector<cucache::trace_event> events;
  ASSERT_NO_THROW(events = cucache::read_trace(path)) << "no valid trace at " << path;
  std::filesystem::remove(path);
  using act = cucache::trace_event::action;
  const auto s = [](std::uintptr_t n) { return reinterpret_cast<std::uintptr_t>(stream(n)); };
  struct row {
    act action;
    std::size_t size;
    std::uintptr_t stream;
  };
  const std::vector<row> expected = {
      {act::allocate, 1000, s(1)},
      {act::allocate, 3 * MiB, 0},
      {act::free, 1000, s(1)},
      {act::free, 3 * MiB, s(2)},
      {act::allocate_failure, 100 * MiB, s(3)},
      {act::allocate, 4 * KiB, s(1)},
      {act::free, 4 * KiB, s(1)},
      {act::allocate, 1000, s(1)},
      {act::free, 1000, s(1)},
  };
  ASSERT_EQ(events.size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    SCOPED_TRACE("row " + std::to_string(i + 2));
    EXPECT_EQ(events[i].act, expected[i].action);
    EXPECT_EQ(events[i].size, expected[i].size);
    EXPECT_EQ(events[i].stream, expected[i].stream);
    EXPECT_EQ(events[i].thread, 1u);
  }
  EXPECT_EQ(events[4].pointer, 0u);
  EXPECT_EQ(events[2].pointer, events[0].pointer);
  EXPECT_EQ(events[3].pointer, events[1].pointer);
  EXPECT_EQ(cucache::summarize(events).live_at_end, 0u);
}

INSTANTIATE_TEST_SUITE_P(Conformance, FrontEnd, ::testing::ValuesIn(all_front_ends()),
                         front_end_name);

// --- across front ends ---------------------------------------------------------------------------

TEST(FrontEnds, ThePluginWritesTheSameTraceAsTheOtherFrontEnds) {
  if (in_child()) GTEST_SKIP() << "spawns the children itself";
  std::vector<std::pair<std::string, std::vector<std::string>>> traces;
  for (front_end_kind k : all_front_ends()) {
    const std::filesystem::path path = trace_path("same-" + kind_name(k));
    trace_in_child(k, path);
    traces.emplace_back(kind_name(k), rows_without_time(path));
    std::filesystem::remove(path);
  }
  // The C API's trace is the reference.
  const auto c_api = std::find_if(traces.begin(), traces.end(), [](const auto& t) {
    return t.first == kind_name(front_end_kind::c);
  });
  ASSERT_NE(c_api, traces.end());
  const auto& [reference_name, reference] = *c_api;
  ASSERT_GE(reference.size(), 2u) << "the " << reference_name << " trace is empty";
  EXPECT_EQ(reference.front(), "Thread,Action,Pointer,Size,Stream");
  for (const auto& [name, rows] : traces) {
    EXPECT_EQ(rows, reference) << "the " << name << " trace differs from the " << reference_name
                               << " one (Time aside)";
  }
#if !CUCACHE_CONFORMANCE_TORCH
  GTEST_SKIP() << "libcucache_torch.so is not built: only the C++ and C traces were compared";
#endif
}

}  // namespace
