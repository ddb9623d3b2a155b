// Two processes share a cucache block (cucacheIpc*, docs/api.md "IPC"). Each test is an
// orchestrator that touches no device memory itself: it makes a unix socket pair and starts this
// executable twice (posix_spawn: fork + exec, so each role has a CUDA context of its own), once
// as the exporter and once as the importer (CUCACHE_IPC_ROLE), with CUCACHE_CONF set for the mode.
//
// Exporter: three 4 MiB blocks; a kernel writes a pattern into the middle one (default mode: 4 MiB
// into a 20 MiB segment); the neighbours are zeroed; it exports the middle block and sends the
// handle (file descriptors as SCM_RIGHTS in expandable mode), waits, then checks that the importer
// incremented every word of the block and touched no neighbour. Importer: receives, opens, checks
// the pattern with a kernel, increments it, closes (a second close is refused), reports.
// A third pair shares a 600 MiB block of 300 single-page handles as a cucacheIpcLongHandle.
// Skips with a one-line reason without a GPU, or (expandable) when the driver cannot export POSIX
// file descriptors.
#include <cuda_runtime.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "cucache/cucache.h"
#include "cucache/cuda_backend.hpp"
#include "gpu/gpu_test_support.hpp"

extern char** environ;  // NOLINT: POSIX

namespace {

constexpr std::size_t k_mib = std::size_t{1} << 20;
constexpr std::size_t k_block = 4 * k_mib;
constexpr std::size_t k_words = k_block / sizeof(std::uint32_t);
constexpr int k_skip = 77;

__host__ __device__ std::uint32_t pattern(std::size_t i) {
  return static_cast<std::uint32_t>(i * 2654435761u) ^ 0xC0FFEEu;
}

__global__ void fill(std::uint32_t* data, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    data[i] = pattern(i);
  }
}

// Counts the words that differ from pattern(i) + add, then (when bump) increments every word.
__global__ void check_and_bump(std::uint32_t* data, std::size_t n, std::uint32_t add, bool bump,
                               unsigned long long* mismatches) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    if (data[i] != pattern(i) + add) atomicAdd(mismatches, 1ULL);
    if (bump) data[i] += 1;
  }
}

#define ROLE_CHECK(expr)                                                                  \
  do {                                                                                    \
    const cudaError_t role_code = (expr);                                                 \
    if (role_code != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s: %s failed: %s / %s\n", role, #expr,                      \
                   cudaGetErrorString(role_code), cucacheGetLastErrorMessage());          \
      return 1;                                                                           \
    }                                                                                     \
  } while (false)

unsigned long long mismatches_in(std::uint32_t* data, std::size_t n, std::uint32_t add, bool bump,
                                 const char* role, bool* ok) {
  unsigned long long* count = nullptr;
  *ok = false;
  if (cucacheMalloc(&count, sizeof(*count)) != cudaSuccess) return 0;
  cudaMemset(count, 0, sizeof(*count));
  check_and_bump<<<256, 256>>>(data, n, add, bump, count);
  unsigned long long host = 0;
  const cudaError_t e = cudaMemcpy(&host, count, sizeof(host), cudaMemcpyDeviceToHost);
  cucacheFree(count);
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: check kernel: %s\n", role, cudaGetErrorString(e));
    return 0;
  }
  *ok = true;
  return host;
}

int run_exporter(int sock, bool expandable) {
  const char* role = "exporter";
  std::uint32_t* a = nullptr;
  std::uint32_t* b = nullptr;
  std::uint32_t* c = nullptr;
  ROLE_CHECK(cucacheMalloc(&a, k_block));
  ROLE_CHECK(cucacheMalloc(&b, k_block));
  ROLE_CHECK(cucacheMalloc(&c, k_block));
  ROLE_CHECK(cudaMemset(a, 0, k_block));
  ROLE_CHECK(cudaMemset(c, 0, k_block));
  fill<<<256, 256>>>(b, k_words);
  ROLE_CHECK(cudaDeviceSynchronize());
  cucacheIpcHandle h{};
  const cudaError_t got = cucacheIpcGetHandle(&h, b);
  if (got == cudaErrorNotSupported && expandable) {
    std::printf("SKIP: %s\n", cucacheGetLastErrorMessage());
    return k_skip;
  }
  ROLE_CHECK(got);
  if (!expandable) {
    // The middle block of one 20 MiB segment: the handle is the segment's, plus 4 MiB.
    if (reinterpret_cast<char*>(b) != reinterpret_cast<char*>(a) + k_block ||
        h.kind != cucacheIpcKindSegment || h.offset != k_block || h.span != 20 * k_mib) {
      std::fprintf(stderr, "exporter: unexpected layout: b - a = %td, kind %d, offset %llu, "
                   "span %llu\n", reinterpret_cast<char*>(b) - reinterpret_cast<char*>(a),
                   h.kind, static_cast<unsigned long long>(h.offset),
                   static_cast<unsigned long long>(h.span));
      return 1;
    }
  } else if (h.kind != cucacheIpcKindFileDescriptors || h.pieceCount < 1) {
    std::fprintf(stderr, "exporter: kind %d with %d pieces\n", h.kind, h.pieceCount);
    return 1;
  }
  ROLE_CHECK(cucacheIpcSendHandle(sock, &h));
  ROLE_CHECK(cucacheIpcReleaseFds(&h));
  char done = 0;
  if (::read(sock, &done, 1) != 1 || done != 'k') {
    std::fprintf(stderr, "exporter: the importer reported failure ('%c')\n", done);
    return 1;
  }
  bool ok = false;
  const unsigned long long bad = mismatches_in(b, k_words, 1, false, role, &ok);
  if (!ok || bad != 0) {
    std::fprintf(stderr, "exporter: %llu words not incremented by the importer\n", bad);
    return 1;
  }
  std::vector<std::uint32_t> host(k_words);
  for (std::uint32_t* n : {a, c}) {
    ROLE_CHECK(cudaMemcpy(host.data(), n, k_block, cudaMemcpyDeviceToHost));
    for (std::uint32_t w : host) {
      if (w != 0) {
        std::fprintf(stderr, "exporter: a neighbour of the shared block was written\n");
        return 1;
      }
    }
  }
  ROLE_CHECK(cucacheFree(a));
  ROLE_CHECK(cucacheFree(b));
  ROLE_CHECK(cucacheFree(c));
  std::printf("exporter: ok (kind %d, offset %llu, %d pieces)\n", h.kind,
              static_cast<unsigned long long>(h.offset), h.pieceCount);
  return 0;
}

int run_importer(int sock) {
  const char* role = "importer";
  cucacheIpcHandle h{};
  ROLE_CHECK(cucacheIpcRecvHandle(sock, &h));
  void* p = nullptr;
  ROLE_CHECK(cucacheIpcOpenHandle(&p, &h));
  ROLE_CHECK(cucacheIpcReleaseFds(&h));
  bool ok = false;
  const unsigned long long bad =
      mismatches_in(static_cast<std::uint32_t*>(p), k_words, 0, true, role, &ok);
  ROLE_CHECK(cudaDeviceSynchronize());
  ROLE_CHECK(cucacheIpcCloseHandle(p));
  const bool second_refused = cucacheIpcCloseHandle(p) == cudaErrorInvalidValue;
  const char done = ok && bad == 0 && second_refused ? 'k' : 'x';
  if (done != 'k') {
    std::fprintf(stderr, "importer: %llu mismatches, second close %s\n", bad,
                 second_refused ? "refused" : "accepted");
  }
  if (::write(sock, &done, 1) != 1) return 1;
  std::printf("importer: %s\n", done == 'k' ? "ok" : "FAILED");
  return done == 'k' ? 0 : 1;
}

// A block over many single-page physical handles (300 pages backed one by one by 2 MiB blocks,
// freed, then carved whole): the fixed handle refuses it, naming the long form, which carries
// every piece (the descriptors in two SCM_RIGHTS batches: 300 > the kernel's 253 per message).
constexpr std::size_t k_long_pages = 300;

int run_long_exporter(int sock) {
  const char* role = "long exporter";
  std::vector<void*> small(k_long_pages, nullptr);
  for (void*& p : small) ROLE_CHECK(cucacheMalloc(&p, 2 * k_mib));
  for (void* p : small) ROLE_CHECK(cucacheFree(p));
  const std::size_t bytes = k_long_pages * 2 * k_mib;
  const std::size_t words = bytes / sizeof(std::uint32_t);
  std::uint32_t* b = nullptr;
  ROLE_CHECK(cucacheMalloc(&b, bytes));
  fill<<<1024, 256>>>(b, words);
  ROLE_CHECK(cudaDeviceSynchronize());
  cucacheIpcLongHandle* h = nullptr;
  std::size_t n = 0;
  const cudaError_t got = cucacheIpcGetLongHandle(&h, &n, b);
  if (got == cudaErrorNotSupported) {
    std::printf("SKIP: %s\n", cucacheGetLastErrorMessage());
    return k_skip;
  }
  ROLE_CHECK(got);
  if (h->kind != cucacheIpcKindFileDescriptors || h->pieceCount <= CUCACHE_IPC_MAX_PIECES ||
      n != CUCACHE_IPC_LONG_HANDLE_BYTES(h->pieceCount) || h->size != bytes) {
    std::fprintf(stderr, "long exporter: kind %d, %d pieces, %zu bytes of handle\n", h->kind,
                 h->pieceCount, n);
    return 1;
  }
  cucacheIpcHandle fixed{};
  const cudaError_t refused = cucacheIpcGetHandle(&fixed, b);
  if (refused != cudaErrorNotSupported ||
      std::strstr(cucacheGetLastErrorMessage(), "cucacheIpcGetLongHandle") == nullptr) {
    std::fprintf(stderr, "long exporter: the fixed handle answered %s: %s\n",
                 cudaGetErrorName(refused), cucacheGetLastErrorMessage());
    return 1;
  }
  const int pieces = h->pieceCount;
  ROLE_CHECK(cucacheIpcSendLongHandle(sock, h, n));
  cucacheIpcFreeLongHandle(h);  // the exporter's descriptors: the importer has its own
  char done = 0;
  if (::read(sock, &done, 1) != 1 || done != 'k') {
    std::fprintf(stderr, "long exporter: the importer reported failure ('%c')\n", done);
    return 1;
  }
  bool ok = false;
  const unsigned long long bad = mismatches_in(b, words, 1, false, role, &ok);
  if (!ok || bad != 0) {
    std::fprintf(stderr, "long exporter: %llu words not incremented by the importer\n", bad);
    return 1;
  }
  ROLE_CHECK(cucacheFree(b));
  std::printf("long exporter: ok (%d pieces, %zu bytes of handle)\n", pieces, n);
  return 0;
}

int run_long_importer(int sock) {
  const char* role = "long importer";
  cucacheIpcLongHandle* h = nullptr;
  std::size_t n = 0;
  ROLE_CHECK(cucacheIpcRecvLongHandle(sock, &h, &n));
  const std::size_t words = h->size / sizeof(std::uint32_t);
  void* p = nullptr;
  ROLE_CHECK(cucacheIpcOpenLongHandle(&p, h, n));
  cucacheIpcFreeLongHandle(h);  // closes the received descriptors: the mapping keeps the memory
  bool ok = false;
  const unsigned long long bad =
      mismatches_in(static_cast<std::uint32_t*>(p), words, 0, true, role, &ok);
  ROLE_CHECK(cudaDeviceSynchronize());
  ROLE_CHECK(cucacheIpcCloseHandle(p));
  const bool second_refused = cucacheIpcCloseHandle(p) == cudaErrorInvalidValue;
  const char done = ok && bad == 0 && second_refused ? 'k' : 'x';
  if (done != 'k') {
    std::fprintf(stderr, "long importer: %llu mismatches, second close %s\n", bad,
                 second_refused ? "refused" : "accepted");
  }
  if (::write(sock, &done, 1) != 1) return 1;
  std::printf("long importer: %s\n", done == 'k' ? "ok" : "FAILED");
  return done == 'k' ? 0 : 1;
}

int run_refusal() {
  // Expandable segments without ipc_handles:True: a clear refusal, nothing exported.
  const char* role = "refusal";
  void* p = nullptr;
  ROLE_CHECK(cucacheMalloc(&p, k_block));
  cucacheIpcHandle h{};
  const cudaError_t e = cucacheIpcGetHandle(&h, p);
  const std::string why = cucacheGetLastErrorMessage();
  ROLE_CHECK(cucacheFree(p));
  if (e != cudaErrorNotSupported || why.find("ipc_handles:True") == std::string::npos ||
      h.magic != 0) {
    std::fprintf(stderr, "refusal: got %s: %s\n", cudaGetErrorName(e), why.c_str());
    return 1;
  }
  std::printf("refusal: ok (%s)\n", why.c_str());
  return 0;
}

// `other`: the socket end this role must not hold (or it would never see its peer's end close).
pid_t spawn_role(const char* role, const char* conf, int sock, int other = -1) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    if (entry.starts_with("CUCACHE_") || entry.starts_with("GTEST_")) continue;
    env.push_back(entry);
  }
  env.push_back(std::string("CUCACHE_IPC_ROLE=") + role);
  env.push_back("CUCACHE_IPC_SOCKET=" + std::to_string(sock));
  env.push_back("CUCACHE_BACKEND=cuda");
  env.push_back(std::string("CUCACHE_CONF=") + conf);
  std::vector<char*> envp;
  for (std::string& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::string exe = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<char*> argv = {exe.data(), nullptr};
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (other >= 0) posix_spawn_file_actions_addclose(&actions, other);
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, exe.c_str(), &actions, nullptr, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  return rc == 0 ? pid : -1;
}

int wait_exit(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void share_between_two_processes(const char* conf, bool expandable,
                                 const char* export_role = nullptr,
                                 const char* import_role = "import") {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);  // inherited across exec
  if (export_role == nullptr) export_role = expandable ? "export-expandable" : "export";
  const pid_t exporter = spawn_role(export_role, conf, sv[0], sv[1]);
  ASSERT_GT(exporter, 0);
  const pid_t importer = spawn_role(import_role, conf, sv[1], sv[0]);
  ::close(sv[0]);
  ::close(sv[1]);
  ASSERT_GT(importer, 0);
  const int e = wait_exit(exporter);
  const int i = wait_exit(importer);
  if (e == k_skip) GTEST_SKIP() << "the exporter cannot export POSIX file descriptors here";
  EXPECT_EQ(e, 0) << "exporter failed (its stderr says why)";
  EXPECT_EQ(i, 0) << "importer failed (its stderr says why)";
}

TEST(IpcGpu, DefaultModeBlockInTheMiddleOfASegmentIsSharedWithAnotherProcess) {
  CUCACHE_REQUIRE_GPU();
  share_between_two_processes("", false);
}

TEST(IpcGpu, ExpandableBlockIsSharedAsPosixFileDescriptors) {
  CUCACHE_REQUIRE_GPU();
  share_between_two_processes("expandable_segments:True,ipc_handles:True", true);
}

TEST(IpcGpu, AnExpandableBlockOfThreeHundredPagesIsSharedAsALongHandle) {
  CUCACHE_REQUIRE_GPU();
  share_between_two_processes("expandable_segments:True,ipc_handles:True", true, "export-long",
                              "import-long");
}

TEST(IpcGpu, ExpandableWithoutIpcHandlesIsRefusedWithAReason) {
  CUCACHE_REQUIRE_GPU();
  const pid_t p = spawn_role("refuse", "expandable_segments:True", -1);
  ASSERT_GT(p, 0);
  EXPECT_EQ(wait_exit(p), 0);
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* role = std::getenv("CUCACHE_IPC_ROLE")) {
    const int sock = std::atoi(std::getenv("CUCACHE_IPC_SOCKET"));
    const std::string r = role;
    if (r == "export") return run_exporter(sock, false);
    if (r == "export-expandable") return run_exporter(sock, true);
    if (r == "import") return run_importer(sock);
    if (r == "export-long") return run_long_exporter(sock);
    if (r == "import-long") return run_long_importer(sock);
    if (r == "refuse") return run_refusal();
    std::fprintf(stderr, "unknown CUCACHE_IPC_ROLE %s\n", role);
    return 2;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
