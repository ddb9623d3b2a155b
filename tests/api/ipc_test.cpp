// Inter-process sharing (cucacheIpc* in cucache.h, src/api/ipc.cpp) and peer access of
// expandable mappings, on the simulated device. The sim has no second process: it opens a handle
// as another process would, at an address of its own with the same (host) memory behind it
// (sim_backend.hpp), so offsets, contents, refusals and the close rules are checked exactly here;
// tests/gpu/ipc_gpu_test.cu does the same across two real processes.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "api/registry.hpp"
#include "cucache/cucache.h"
#include "cucache/cucache.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/sim_backend.hpp"
#include "support/sim_registry.hpp"

namespace cucache {
namespace {

using test::MiB;

void fresh(const char* conf, const char* devices = "1") {
  ::setenv("CUCACHE_SIM_HOST_MEMORY", "1", 1);
  ::setenv("CUCACHE_SIM_DEVICES", devices, 1);
  test::use_sim_registry(conf);
}

class Ipc : public ::testing::Test {
 protected:
  void SetUp() override { fresh(nullptr); }
  void TearDown() override {
    fresh(nullptr);
    ::unsetenv("CUCACHE_SIM_HOST_MEMORY");
    ::unsetenv("CUCACHE_SIM_DEVICES");
  }
  static sim_backend& sim(int d = 0) { return dynamic_cast<sim_backend&>(get(d).backend()); }
  static std::string last() { return cucacheGetLastErrorMessage(); }
};

// Open file descriptors of this process (the exported and imported pieces are real ones).
std::size_t open_fds() {
  std::size_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) ++n;
  return n;
}

void* alloc(std::size_t n) {
  void* p = nullptr;
  EXPECT_EQ(cucacheMalloc(&p, n), cudaSuccess) << cucacheGetLastErrorMessage();
  return p;
}

TEST_F(Ipc, ADefaultModeHandleIsTheSegmentHandlePlusTheBlocksOffset) {
  // Three 4 MiB blocks carve one 20 MiB segment: b lies in its middle, 4 MiB from the base.
  char* a = static_cast<char*>(alloc(4 * MiB));
  char* b = static_cast<char*>(alloc(4 * MiB));
  char* c = static_cast<char*>(alloc(4 * MiB));
  ASSERT_EQ(b, a + 4 * MiB);
  ASSERT_EQ(c, b + 4 * MiB);
  cucacheIpcHandle h{};
  ASSERT_EQ(cucacheIpcGetHandle(&h, b), cudaSuccess) << last();
  EXPECT_EQ(h.magic, CUCACHE_IPC_MAGIC);
  EXPECT_EQ(h.version, CUCACHE_IPC_VERSION);
  EXPECT_EQ(h.kind, cucacheIpcKindSegment);
  EXPECT_EQ(h.device, 0);
  EXPECT_EQ(h.pid, static_cast<std::int64_t>(::getpid()));
  EXPECT_EQ(h.offset, 4 * MiB);
  EXPECT_EQ(h.size, 4 * MiB);
  EXPECT_EQ(h.span, 20 * MiB);
  EXPECT_EQ(h.pieceCount, 0);
  for (int fd : h.fds) EXPECT_EQ(fd, -1);

  std::memset(sim().host_view(b, 4 * MiB), 0x5a, 4 * MiB);
  void* q = nullptr;
  ASSERT_EQ(cucacheIpcOpenHandle(&q, &h), cudaSuccess) << last();
  ASSERT_NE(q, nullptr);
  EXPECT_NE(q, static_cast<void*>(b)) << "opened as another process would: a mapping of its own";
  EXPECT_EQ(sim().live_imports(), 1u);
  std::byte* seen = sim().host_view(q, 4 * MiB);
  ASSERT_NE(seen, nullptr);
  EXPECT_EQ(seen[0], std::byte{0x5a});
  EXPECT_EQ(seen[4 * MiB - 1], std::byte{0x5a});
  seen[7] = std::byte{0x11};  // the importer writes; the exporter sees it
  EXPECT_EQ(sim().host_view(b, 8)[7], std::byte{0x11});

  // Another block of the same segment shares the one mapping, at its own offset.
  cucacheIpcHandle ha{};
  ASSERT_EQ(cucacheIpcGetHandle(&ha, a), cudaSuccess) << last();
  EXPECT_EQ(ha.offset, 0u);
  EXPECT_EQ(std::memcmp(ha.segmentHandle, h.segmentHandle, sizeof(h.segmentHandle)), 0);
  void* qa = nullptr;
  ASSERT_EQ(cucacheIpcOpenHandle(&qa, &ha), cudaSuccess) << last();
  EXPECT_EQ(static_cast<char*>(qa) + 4 * MiB, q);
  EXPECT_EQ(sim().live_imports(), 1u);

  EXPECT_EQ(cucacheIpcCloseHandle(qa), cudaSuccess) << last();
  EXPECT_EQ(sim().live_imports(), 1u) << "b is still open";
  EXPECT_EQ(cucacheIpcCloseHandle(q), cudaSuccess) << last();
  EXPECT_EQ(sim().live_imports(), 0u);
  EXPECT_EQ(cucacheIpcCloseHandle(q), cudaErrorInvalidValue);
  EXPECT_NE(last().find("not an address ipc_open_handle returned and still open"),
            std::string::npos)
      << last();
  for (void* p : {static_cast<void*>(a), static_cast<void*>(b), static_cast<void*>(c)}) {
    EXPECT_EQ(cucacheFree(p), cudaSuccess);
  }
  get().check_invariants();
}

TEST_F(Ipc, OpeningOneBlockTwiceNeedsTwoCloses) {
  void* p = alloc(1000);
  cucacheIpcHandle h{};
  ASSERT_EQ(cucacheIpcGetHandle(&h, p), cudaSuccess) << last();
  EXPECT_EQ(h.offset, 0u);
  EXPECT_EQ(h.size, 1024u);
  EXPECT_EQ(h.span, 2 * MiB);
  void* q1 = nullptr;
  void* q2 = nullptr;
  ASSERT_EQ(cucacheIpcOpenHandle(&q1, &h), cudaSuccess) << last();
  ASSERT_EQ(cucacheIpcOpenHandle(&q2, &h), cudaSuccess) << last();
  EXPECT_EQ(q1, q2);
  EXPECT_EQ(cucacheIpcCloseHandle(q1), cudaSuccess) << last();
  EXPECT_EQ(sim().live_imports(), 1u);
  EXPECT_EQ(cucacheIpcCloseHandle(q2), cudaSuccess) << last();
  EXPECT_EQ(sim().live_imports(), 0u);
  EXPECT_EQ(cucacheIpcCloseHandle(q2), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
}

TEST_F(Ipc, APointerCucacheDoesNotHandOutIsRefusedByName) {
  cucacheIpcHandle h{};
  int local = 0;
  // Nothing allocated yet: no registry, nothing can be ours.
  EXPECT_EQ(cucacheIpcGetHandle(&h, &local), cudaErrorInvalidValue);
  EXPECT_NE(last().find("not the start of a live cucache allocation"), std::string::npos) << last();
  char* p = static_cast<char*>(alloc(4 * MiB));
  EXPECT_EQ(cucacheIpcGetHandle(&h, &local), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheIpcGetHandle(&h, p + 16), cudaErrorInvalidValue);
  EXPECT_NE(last().find("points 16 bytes into the live allocation"), std::string::npos) << last();
  EXPECT_EQ(cucacheIpcGetHandle(nullptr, p), cudaErrorInvalidValue);
  EXPECT_NE(last().find("handle is NULL"), std::string::npos) << last();
  EXPECT_EQ(cucacheIpcGetHandle(&h, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(h.magic, 0u) << "nothing is written on failure";
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
  EXPECT_EQ(cucacheIpcGetHandle(&h, p), cudaErrorInvalidValue);
  EXPECT_NE(last().find("already freed"), std::string::npos) << last();
  EXPECT_EQ(cucacheIpcCloseHandle(&local), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheIpcCloseHandle(nullptr), cudaErrorInvalidValue);
}

TEST_F(Ipc, AMalformedHandleIsRefusedBeforeAnythingIsOpened) {
  void* p = alloc(4 * MiB);
  cucacheIpcHandle h{};
  ASSERT_EQ(cucacheIpcGetHandle(&h, p), cudaSuccess) << last();
  void* q = reinterpret_cast<void*>(1);
  cucacheIpcHandle bad = h;
  bad.magic = 0x1234;
  EXPECT_EQ(cucacheIpcOpenHandle(&q, &bad), cudaErrorInvalidValue);
  EXPECT_EQ(q, nullptr);
  EXPECT_NE(last().find("not a cucache IPC handle"), std::string::npos) << last();
  bad = h;
  bad.offset = h.span;  // the block would lie past its segment
  EXPECT_EQ(cucacheIpcOpenHandle(&q, &bad), cudaErrorInvalidValue);
  bad = h;
  bad.kind = 7;
  EXPECT_EQ(cucacheIpcOpenHandle(&q, &bad), cudaErrorInvalidValue);
  EXPECT_NE(last().find("unknown kind 7"), std::string::npos) << last();
  bad = h;
  bad.segmentHandle[0] ^= 0xff;  // names no segment of the sim
  EXPECT_EQ(cucacheIpcOpenHandle(&q, &bad), 400);
  EXPECT_EQ(cucacheIpcOpenHandle(&q, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(sim().live_imports(), 0u);
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
}

TEST_F(Ipc, TheExporterMayFreeAndAReleasedSegmentsHandleNamesNothing) {
  void* p = alloc(4 * MiB);
  cucacheIpcHandle h{};
  ASSERT_EQ(cucacheIpcGetHandle(&h, p), cudaSuccess) << last();
  void* q = nullptr;
  ASSERT_EQ(cucacheIpcOpenHandle(&q, &h), cudaSuccess) << last();
  // Legal: the exporter frees (the importer should have closed first: the memory is the cache's
  // again). The segment is wholly free, so empty_cache gives it back to the device.
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
  EXPECT_EQ(cucacheEmptyCache(), cudaSuccess);
  EXPECT_EQ(sim().live_segments(), 0u);
  EXPECT_EQ(cucacheIpcCloseHandle(q), cudaSuccess) << last();
  // The handle now names nothing: opening it fails instead of mapping other memory.
  EXPECT_EQ(cucacheIpcOpenHandle(&q, &h), 400);
  EXPECT_NE(last().find("freed by its exporter"), std::string::npos) << last();
  EXPECT_EQ(q, nullptr);
}

TEST_F(Ipc, ALiveExportedBlockKeepsItsSegmentThroughEmptyCache) {
  void* p = alloc(4 * MiB);
  void* other = alloc(30 * MiB);  // a segment of its own
  cucacheIpcHandle h{};
  ASSERT_EQ(cucacheIpcGetHandle(&h, p), cudaSuccess) << last();
  EXPECT_EQ(cucacheFree(other), cudaSuccess);
  EXPECT_EQ(cucacheEmptyCache(), cudaSuccess);
  EXPECT_EQ(sim().live_segments(), 1u);
  void* q = nullptr;
  EXPECT_EQ(cucacheIpcOpenHandle(&q, &h), cudaSuccess) << last();
  EXPECT_EQ(cucacheIpcCloseHandle(q), cudaSuccess) << last();
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
}

TEST_F(Ipc, ExpandableSegmentsAreRefusedWithoutIpcHandles) {
  fresh("expandable_segments:True");
  void* p = alloc(4 * MiB);
  cucacheIpcHandle h{};
  h.magic = 0xdeadbeef;
  EXPECT_EQ(cucacheIpcGetHandle(&h, p), cudaErrorNotSupported);
  EXPECT_NE(last().find("expandable segment"), std::string::npos) << last();
  EXPECT_NE(last().find("ipc_handles:True"), std::string::npos) << last();
  EXPECT_EQ(h.magic, 0xdeadbeefu) << "nothing is written on failure";
  EXPECT_EQ(sim().calls(sim_call::phys_export_fd), 0u);
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
}

TEST_F(Ipc, ExpandableBlocksTravelAsFileDescriptorsOverAUnixSocket) {
  // One handle per page (coarse_handles:0), so that b travels as two pieces; chunks below.
  fresh("expandable_segments:True,ipc_handles:True,coarse_handles:0");
  char* a = static_cast<char*>(alloc(4 * MiB));
  char* b = static_cast<char*>(alloc(4 * MiB));
  cucacheIpcHandle h{};
  ASSERT_EQ(cucacheIpcGetHandle(&h, b), cudaSuccess) << last();
  EXPECT_EQ(h.kind, cucacheIpcKindFileDescriptors);
  EXPECT_EQ(h.size, 4 * MiB);
  // b follows a in the range; its two 2 MiB pages were backed by a handle each.
  EXPECT_EQ(b, a + 4 * MiB);
  ASSERT_EQ(h.pieceCount, 2);
  EXPECT_EQ(h.offset, 0u);
  EXPECT_EQ(h.span, 4 * MiB);
  std::uint64_t total = 0;
  for (int i = 0; i < h.pieceCount; ++i) {
    EXPECT_GE(h.fds[i], 0);
    EXPECT_EQ(h.pieceBytes[i] % (2 * MiB), 0u);
    total += h.pieceBytes[i];
  }
  EXPECT_EQ(total, h.span);
  EXPECT_LE(h.offset + h.size, h.span);
  EXPECT_EQ(sim().calls(sim_call::phys_export_fd), static_cast<std::uint64_t>(h.pieceCount));
  // The simulated device's host view is per physical handle: fill each page through its own.
  for (std::size_t off = 0; off < 4 * MiB; off += 2 * MiB) {
    std::memset(sim().host_view(b + off, 2 * MiB), 0x3c, 2 * MiB);
  }

  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  ASSERT_EQ(cucacheIpcSendHandle(sv[0], &h), cudaSuccess) << last();
  ASSERT_EQ(cucacheIpcReleaseFds(&h), cudaSuccess);  // the exporter's copies
  for (int i = 0; i < h.pieceCount; ++i) EXPECT_EQ(h.fds[i], -1);
  cucacheIpcHandle r{};
  ASSERT_EQ(cucacheIpcRecvHandle(sv[1], &r), cudaSuccess) << last();
  EXPECT_EQ(r.pieceCount, h.pieceCount);
  EXPECT_EQ(r.offset, h.offset);
  for (int i = 0; i < r.pieceCount; ++i) EXPECT_GE(r.fds[i], 0);

  const std::size_t mappings = sim().live_mappings();
  void* q = nullptr;
  ASSERT_EQ(cucacheIpcOpenHandle(&q, &r), cudaSuccess) << last();
  EXPECT_EQ(cucacheIpcReleaseFds(&r), cudaSuccess);  // the mapping keeps the memory
  EXPECT_NE(q, static_cast<void*>(b));
  EXPECT_EQ(sim().live_mappings(), mappings + static_cast<std::size_t>(r.pieceCount));
  std::byte* seen = sim().host_view(q, 2 * MiB);
  std::byte* seen_last = sim().host_view(static_cast<char*>(q) + 2 * MiB, 2 * MiB);
  ASSERT_NE(seen, nullptr);
  ASSERT_NE(seen_last, nullptr);
  EXPECT_EQ(seen[0], std::byte{0x3c});
  EXPECT_EQ(seen_last[2 * MiB - 1], std::byte{0x3c});
  seen[9] = std::byte{0x77};
  EXPECT_EQ(sim().host_view(b, 16)[9], std::byte{0x77});
  EXPECT_TRUE(sim().device_can_access(0, q, 4 * MiB));
  EXPECT_EQ(cucacheIpcCloseHandle(q), cudaSuccess) << last();
  EXPECT_EQ(sim().live_mappings(), mappings);
  EXPECT_EQ(cucacheIpcCloseHandle(q), cudaErrorInvalidValue);
  ::close(sv[0]);
  ::close(sv[1]);
  EXPECT_EQ(cucacheFree(a), cudaSuccess);
  EXPECT_EQ(cucacheFree(b), cudaSuccess);
  get().check_invariants();
}

TEST_F(Ipc, AChunkedExpandableBlockTravelsAsOnePiecePerChunk) {
  // 300 MiB at the front of the large range: 150 whole pages, backed by chunks of 32, 32, 32, 32
  // and 22 pages (pager::k_max_chunk_pages, k_min_chunked_pages): five pieces, where one handle
  // per page would have made 150, past the 16 a handle carries.
  fresh("expandable_segments:True,ipc_handles:True");
  char* b = static_cast<char*>(alloc(300 * MiB));
  cucacheIpcHandle h{};
  ASSERT_EQ(cucacheIpcGetHandle(&h, b), cudaSuccess) << last();
  ASSERT_EQ(h.pieceCount, 5);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(h.pieceBytes[i], 64 * MiB);
  EXPECT_EQ(h.pieceBytes[4], 44 * MiB);
  EXPECT_EQ(h.offset, 0u);
  EXPECT_EQ(h.span, 300 * MiB);
  void* q = nullptr;
  const std::size_t mappings = sim().live_mappings();
  ASSERT_EQ(cucacheIpcOpenHandle(&q, &h), cudaSuccess) << last();
  EXPECT_EQ(sim().live_mappings(), mappings + 5);
  // The same memory: a byte written through the import, 100 MiB in (the second chunk), is read
  // through the export.
  sim().host_view(static_cast<char*>(q) + 100 * MiB, 16)[3] = std::byte{0x5a};
  EXPECT_EQ(sim().host_view(b + 100 * MiB, 16)[3], std::byte{0x5a});
  EXPECT_EQ(cucacheIpcCloseHandle(q), cudaSuccess) << last();
  EXPECT_EQ(cucacheIpcReleaseFds(&h), cudaSuccess);
  EXPECT_EQ(cucacheFree(b), cudaSuccess);
  get().check_invariants();
}

// A block over `pages` pages, each its own physical handle: the pages are first backed one by
// one (2 MiB blocks, below the chunked size) and cached, then the block is carved from them.
char* block_of_single_pages(std::size_t pages) {
  std::vector<void*> small;
  for (std::size_t i = 0; i < pages; ++i) small.push_back(alloc(2 * MiB));
  for (void* p : small) EXPECT_EQ(cucacheFree(p), cudaSuccess);
  char* b = static_cast<char*>(alloc(pages * 2 * MiB));
  EXPECT_EQ(b, small.front());
  return b;
}

TEST_F(Ipc, ABlockOfThreeHundredPagesTravelsAsALongHandle) {
  fresh("expandable_segments:True,ipc_handles:True");
  constexpr std::size_t pages = 300;
  char* b = block_of_single_pages(pages);
  const std::size_t fds0 = open_fds();
  const std::uint64_t exports0 = sim().calls(sim_call::phys_export_fd);

  // The fixed struct cannot carry 300 descriptors: refused, exporting nothing, naming the form
  // that can.
  cucacheIpcHandle fixed{};
  EXPECT_EQ(cucacheIpcGetHandle(&fixed, b), cudaErrorNotSupported);
  EXPECT_NE(last().find("spans 300 physical handles"), std::string::npos) << last();
  EXPECT_NE(last().find("cucacheIpcGetLongHandle"), std::string::npos) << last();
  EXPECT_EQ(fixed.magic, 0u);
  EXPECT_EQ(sim().calls(sim_call::phys_export_fd), exports0);
  EXPECT_EQ(open_fds(), fds0);

  cucacheIpcLongHandle* h = nullptr;
  std::size_t bytes = 0;
  ASSERT_EQ(cucacheIpcGetLongHandle(&h, &bytes, b), cudaSuccess) << last();
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(bytes, sizeof(cucacheIpcLongHandle) + pages * 16);
  EXPECT_EQ(bytes, CUCACHE_IPC_LONG_HANDLE_BYTES(pages));
  EXPECT_EQ(h->magic, CUCACHE_IPC_LONG_MAGIC);
  EXPECT_EQ(h->version, CUCACHE_IPC_LONG_VERSION);
  EXPECT_EQ(h->kind, cucacheIpcKindFileDescriptors);
  EXPECT_EQ(h->pid, static_cast<std::int64_t>(::getpid()));
  EXPECT_EQ(h->offset, 0u);
  EXPECT_EQ(h->size, pages * 2 * MiB);
  EXPECT_EQ(h->span, pages * 2 * MiB);
  ASSERT_EQ(h->pieceCount, 300);
  const cucacheIpcPiece* pc = cucacheIpcLongHandlePieces(h);
  for (std::size_t i = 0; i < pages; ++i) {
    EXPECT_EQ(pc[i].bytes, 2 * MiB) << i;
    EXPECT_GE(pc[i].fd, 0) << i;
  }
  EXPECT_EQ(sim().calls(sim_call::phys_export_fd), exports0 + pages);
  EXPECT_EQ(open_fds(), fds0 + pages);
  // Page i holds the byte i (through each page's own handle, the sim's host view).
  for (std::size_t i = 0; i < pages; ++i) {
    std::memset(sim().host_view(b + i * 2 * MiB, 2 * MiB), static_cast<int>(i & 0xff), 2 * MiB);
  }

  // Over a unix socket: 300 descriptors, more than one message may carry (253).
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  ASSERT_EQ(cucacheIpcSendLongHandle(sv[0], h, bytes), cudaSuccess) << last();
  ASSERT_EQ(cucacheIpcReleaseLongHandleFds(h), cudaSuccess);
  for (std::size_t i = 0; i < pages; ++i) EXPECT_EQ(pc[i].fd, -1);
  EXPECT_EQ(open_fds(), fds0 + 2);  // the socket pair
  cucacheIpcLongHandle* r = nullptr;
  std::size_t rbytes = 0;
  ASSERT_EQ(cucacheIpcRecvLongHandle(sv[1], &r, &rbytes), cudaSuccess) << last();
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(rbytes, bytes);
  EXPECT_EQ(open_fds(), fds0 + 2 + pages);
  EXPECT_EQ(std::memcmp(r, h, sizeof(cucacheIpcLongHandle)), 0);
  const cucacheIpcPiece* rp = cucacheIpcLongHandlePieces(r);
  for (std::size_t i = 0; i < pages; ++i) {
    EXPECT_GE(rp[i].fd, 0);
    EXPECT_EQ(rp[i].bytes, 2 * MiB);
  }

  const std::size_t mappings = sim().live_mappings();
  const std::size_t handles = sim().live_handles();
  void* q = nullptr;
  ASSERT_EQ(cucacheIpcOpenLongHandle(&q, r, rbytes), cudaSuccess) << last();
  cucacheIpcFreeLongHandle(r);  // closes the received descriptors: the mapping keeps the memory
  EXPECT_EQ(open_fds(), fds0 + 2);
  EXPECT_NE(q, static_cast<void*>(b));
  EXPECT_EQ(sim().live_mappings(), mappings + pages);
  EXPECT_TRUE(sim().device_can_access(0, q, pages * 2 * MiB));
  for (std::size_t i = 0; i < pages; ++i) {
    std::byte* page = sim().host_view(static_cast<char*>(q) + i * 2 * MiB, 2 * MiB);
    ASSERT_NE(page, nullptr) << i;
    EXPECT_EQ(page[0], static_cast<std::byte>(i & 0xff)) << i;
    EXPECT_EQ(page[2 * MiB - 1], static_cast<std::byte>(i & 0xff)) << i;
  }
  // Written through the import, read through the export: the last page.
  sim().host_view(static_cast<char*>(q) + 299 * 2 * MiB, 16)[5] = std::byte{0xa5};
  EXPECT_EQ(sim().host_view(b + 299 * 2 * MiB, 16)[5], std::byte{0xa5});

  EXPECT_EQ(cucacheIpcCloseHandle(q), cudaSuccess) << last();
  EXPECT_EQ(sim().live_mappings(), mappings);
  EXPECT_EQ(sim().live_handles(), handles);
  EXPECT_EQ(cucacheIpcCloseHandle(q), cudaErrorInvalidValue);
  ::close(sv[0]);
  ::close(sv[1]);
  cucacheIpcFreeLongHandle(h);
  EXPECT_EQ(open_fds(), fds0);
  EXPECT_EQ(cucacheFree(b), cudaSuccess);
  get().check_invariants();
}

TEST_F(Ipc, TheCppLongHandleOpensInPlaceAndRoundTripsItsBytes) {
  fresh("expandable_segments:True,ipc_handles:True");
  char* b = block_of_single_pages(40);
  const std::size_t fds0 = open_fds();
  ipc_long_handle h = ipc_get_long_handle(b);
  ASSERT_EQ(h.pieces.size(), 40u);
  EXPECT_EQ(h.head.pieceCount, 40);
  const std::vector<std::byte> wire = h.bytes();
  EXPECT_EQ(wire.size(), CUCACHE_IPC_LONG_HANDLE_BYTES(40));
  const ipc_long_handle back = ipc_long_handle::from_bytes(wire.data(), wire.size());
  EXPECT_EQ(back.bytes(), wire);
  std::memset(sim().host_view(b + 39 * 2 * MiB, 2 * MiB), 0x42, 2 * MiB);
  void* q = ipc_open_handle(back);
  EXPECT_EQ(sim().host_view(static_cast<char*>(q) + 39 * 2 * MiB, 16)[0], std::byte{0x42});
  ipc_close_handle(q);
  EXPECT_THROW(ipc_close_handle(q), invalid_argument);
  ipc_release_fds(h);
  for (const auto& p : h.pieces) EXPECT_EQ(p.fd, -1);
  EXPECT_EQ(open_fds(), fds0);
  EXPECT_EQ(cucacheFree(b), cudaSuccess);
  get().check_invariants();
}

TEST_F(Ipc, AMalformedLongHandleIsRefusedAndChangesNothing) {
  fresh("expandable_segments:True,ipc_handles:True");
  char* b = block_of_single_pages(20);
  cucacheIpcLongHandle* h = nullptr;
  std::size_t bytes = 0;
  ASSERT_EQ(cucacheIpcGetLongHandle(&h, &bytes, b), cudaSuccess) << last();
  ASSERT_EQ(h->pieceCount, 20);
  const std::size_t fds0 = open_fds();
  const std::size_t mappings = sim().live_mappings();
  const std::size_t reservations = sim().live_reservations();
  const std::uint64_t imports0 = sim().calls(sim_call::phys_import_fd);
  std::vector<std::byte> copy(bytes);
  auto* bad = reinterpret_cast<cucacheIpcLongHandle*>(copy.data());
  const auto reset = [&] { std::memcpy(copy.data(), h, bytes); };
  const auto refused = [&](std::size_t n, const char* says) {
    void* q = reinterpret_cast<void*>(1);
    EXPECT_EQ(cucacheIpcOpenLongHandle(&q, bad, n), cudaErrorInvalidValue) << says;
    EXPECT_EQ(q, nullptr) << says;
    EXPECT_NE(last().find(says), std::string::npos) << last();
  };
  reset();
  refused(bytes - 1, "truncated");
  refused(sizeof(cucacheIpcLongHandle) - 1, "its header alone is 120");
  refused(sizeof(cucacheIpcLongHandle), "its 20 pieces make 440");
  bad->pieceCount = 21;  // one more than the bytes hold
  refused(bytes, "its 21 pieces make 456 (truncated)");
  bad->pieceCount = 19;  // one fewer: the span is not covered, and bytes trail
  refused(bytes, "(trailing bytes)");
  refused(bytes - 16, "pieces total 39845888 bytes, its span says 41943040");
  reset();
  bad->pieceCount = -3;
  refused(bytes, "with -3 pieces");
  reset();
  cucacheIpcLongHandlePieces(bad)[7].bytes = 0;
  refused(bytes, "piece 7 of 0 bytes");
  reset();
  bad->magic = CUCACHE_IPC_MAGIC;
  refused(bytes, "a fixed cucacheIpcHandle");
  reset();
  bad->version = 9;
  refused(bytes, "version 9");
  reset();
  bad->offset = bad->span;
  refused(bytes, "at offset");
  void* q = nullptr;
  EXPECT_EQ(cucacheIpcOpenLongHandle(&q, nullptr, bytes), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheIpcOpenLongHandle(nullptr, h, bytes), cudaErrorInvalidValue);
  // A long handle given to the fixed open, and the other way round, names the right call.
  cucacheIpcHandle as_fixed{};
  std::memcpy(&as_fixed, h, sizeof(cucacheIpcLongHandle));
  EXPECT_EQ(cucacheIpcOpenHandle(&q, &as_fixed), cudaErrorInvalidValue);
  EXPECT_NE(last().find("a cucacheIpcLongHandle, open it as one"), std::string::npos) << last();
  // Nothing was imported, mapped or reserved; no descriptor leaked.
  EXPECT_EQ(sim().calls(sim_call::phys_import_fd), imports0);
  EXPECT_EQ(sim().live_mappings(), mappings);
  EXPECT_EQ(sim().live_reservations(), reservations);
  EXPECT_EQ(open_fds(), fds0);
  // The handle still opens.
  ASSERT_EQ(cucacheIpcOpenLongHandle(&q, h, bytes), cudaSuccess) << last();
  EXPECT_EQ(cucacheIpcCloseHandle(q), cudaSuccess);
  cucacheIpcFreeLongHandle(h);
  EXPECT_EQ(cucacheFree(b), cudaSuccess);
  get().check_invariants();
}

TEST_F(Ipc, ARecvOfATruncatedLongHandleClosesWhatArrived) {
  fresh("expandable_segments:True,ipc_handles:True");
  char* b = block_of_single_pages(300);
  ipc_long_handle h = ipc_get_long_handle(b);
  ASSERT_EQ(h.pieces.size(), 300u);
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  // A header that promises 300 pieces, then only a 250-piece handle (its header and 250
  // descriptors), then the end of the stream: 4120 of the 4800 bytes of pieces arrive.
  ASSERT_EQ(::write(sv[0], &h.head, sizeof(h.head)), static_cast<ssize_t>(sizeof(h.head)));
  ipc_long_handle part = h;
  part.head.pieceCount = 250;
  part.head.span = 500 * MiB;
  part.head.size = 500 * MiB;
  part.pieces.resize(250);
  ipc_send_handle(sv[0], part);
  ::close(sv[0]);
  const std::size_t fds0 = open_fds();
  cucacheIpcLongHandle* r = reinterpret_cast<cucacheIpcLongHandle*>(1);
  std::size_t rbytes = 7;
  EXPECT_EQ(cucacheIpcRecvLongHandle(sv[1], &r, &rbytes), cudaErrorUnknown);
  EXPECT_NE(last().find("recvmsg"), std::string::npos) << last();
  EXPECT_EQ(r, nullptr);
  EXPECT_EQ(rbytes, 0u);
  EXPECT_EQ(open_fds(), fds0);
  ::close(sv[1]);
  ipc_release_fds(h);
  EXPECT_EQ(cucacheFree(b), cudaSuccess);
}

TEST_F(Ipc, ADefaultModeBlockTravelsAsALongHandleOfNoPieces) {
  char* a = static_cast<char*>(alloc(4 * MiB));
  char* b = static_cast<char*>(alloc(4 * MiB));
  ASSERT_EQ(b, a + 4 * MiB);
  cucacheIpcLongHandle* h = nullptr;
  std::size_t bytes = 0;
  ASSERT_EQ(cucacheIpcGetLongHandle(&h, &bytes, b), cudaSuccess) << last();
  EXPECT_EQ(bytes, sizeof(cucacheIpcLongHandle));
  EXPECT_EQ(h->kind, cucacheIpcKindSegment);
  EXPECT_EQ(h->pieceCount, 0);
  EXPECT_EQ(h->offset, 4 * MiB);
  cucacheIpcHandle fixed{};
  ASSERT_EQ(cucacheIpcGetHandle(&fixed, b), cudaSuccess) << last();
  EXPECT_EQ(std::memcmp(h->segmentHandle, fixed.segmentHandle, sizeof(fixed.segmentHandle)), 0);
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  ASSERT_EQ(cucacheIpcSendLongHandle(sv[0], h, bytes), cudaSuccess) << last();
  cucacheIpcLongHandle* r = nullptr;
  std::size_t rbytes = 0;
  ASSERT_EQ(cucacheIpcRecvLongHandle(sv[1], &r, &rbytes), cudaSuccess) << last();
  EXPECT_EQ(rbytes, bytes);
  void* q = nullptr;
  ASSERT_EQ(cucacheIpcOpenLongHandle(&q, r, rbytes), cudaSuccess) << last();
  void* q2 = nullptr;
  ASSERT_EQ(cucacheIpcOpenHandle(&q2, &fixed), cudaSuccess) << last();
  EXPECT_EQ(q, q2) << "one segment, opened once, whichever form names it";
  EXPECT_EQ(sim().live_imports(), 1u);
  EXPECT_EQ(cucacheIpcCloseHandle(q), cudaSuccess);
  EXPECT_EQ(cucacheIpcCloseHandle(q2), cudaSuccess);
  EXPECT_EQ(sim().live_imports(), 0u);
  cucacheIpcFreeLongHandle(h);
  cucacheIpcFreeLongHandle(r);
  cucacheIpcFreeLongHandle(nullptr);
  ::close(sv[0]);
  ::close(sv[1]);
  EXPECT_EQ(cucacheFree(a), cudaSuccess);
  EXPECT_EQ(cucacheFree(b), cudaSuccess);
}

TEST_F(Ipc, ARecvOfSomethingElseIsRefusedAndLeaksNoDescriptor) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  const char junk[sizeof(cucacheIpcHandle)] = {1, 2, 3};
  ASSERT_EQ(::write(sv[0], junk, sizeof(junk)), static_cast<ssize_t>(sizeof(junk)));
  cucacheIpcHandle r{};
  EXPECT_EQ(cucacheIpcRecvHandle(sv[1], &r), cudaErrorInvalidValue);
  EXPECT_NE(last().find("not a cucache IPC handle"), std::string::npos) << last();
  ::close(sv[0]);
  EXPECT_EQ(cucacheIpcRecvHandle(sv[1], &r), cudaErrorUnknown);  // end of stream
  EXPECT_NE(last().find("recvmsg"), std::string::npos) << last();
  ::close(sv[1]);
}

// --- peer access of expandable mappings (config key peer_access) --------------------------------

TEST_F(Ipc, ExpandableMappingsAreAccessibleToEveryPeerByDefault) {
  fresh("expandable_segments:True", "2");
  void* p = get(0).allocate(4 * MiB);
  void* q = get(1).allocate(4 * MiB);
  EXPECT_EQ(sim(0).access_devices(), (std::vector<int>{0, 1}));
  EXPECT_EQ(sim(1).access_devices(), (std::vector<int>{1, 0}));
  EXPECT_TRUE(sim(0).device_can_access(0, p, 4 * MiB));
  EXPECT_TRUE(sim(0).device_can_access(1, p, 4 * MiB));
  EXPECT_TRUE(sim(1).device_can_access(0, q, 4 * MiB));
  EXPECT_TRUE(sim(1).device_can_access(1, q, 4 * MiB));
  EXPECT_FALSE(sim(0).device_can_access(2, p, 4 * MiB));
  get(0).deallocate(p);
  get(1).deallocate(q);
}

TEST_F(Ipc, PeerAccessNoneKeepsMappingsToTheirDevice) {
  fresh("expandable_segments:True,peer_access:none", "2");
  void* p = get(0).allocate(4 * MiB);
  EXPECT_EQ(sim(0).access_devices(), (std::vector<int>{0}));
  EXPECT_TRUE(sim(0).device_can_access(0, p, 4 * MiB));
  EXPECT_FALSE(sim(0).device_can_access(1, p, 4 * MiB));
  get(0).deallocate(p);
}

TEST_F(Ipc, DefaultModeSegmentsAreNotMappingsAndStayTheirDevices) {
  fresh(nullptr, "2");
  void* p = get(0).allocate(4 * MiB);
  EXPECT_TRUE(sim(0).device_can_access(0, p, 4 * MiB));
  EXPECT_FALSE(sim(0).device_can_access(1, p, 4 * MiB))
      << "cudaMalloc memory follows cudaDeviceEnablePeerAccess, which the sim does not model";
  EXPECT_EQ(sim(0).calls(sim_call::set_access), 0u);
  get(0).deallocate(p);
}

TEST(PeerAccess, AutoSkipsADeviceThatCannotAccessAndAllRefusesIt) {
  sim_options o;
  o.device = 0;
  o.device_count = 3;
  o.peer_mask = ~std::uint64_t{0} & ~(std::uint64_t{1} << 1);  // device 1 cannot reach device 0
  config cfg;
  cfg.expandable_segments = true;
  {
    auto b = std::make_shared<sim_backend>(o);
    device_allocator a(b, cfg);
    EXPECT_EQ(b->access_devices(), (std::vector<int>{0, 2}));
    void* p = a.allocate(4 * MiB);
    EXPECT_TRUE(b->device_can_access(0, p, 4 * MiB));
    EXPECT_FALSE(b->device_can_access(1, p, 4 * MiB));
    EXPECT_TRUE(b->device_can_access(2, p, 4 * MiB));
    // Not a byte more than is mapped.
    EXPECT_FALSE(b->device_can_access(0, static_cast<char*>(p) - 1, 4 * MiB));
    a.deallocate(p);
  }
  cfg.peer_access = peer_access_mode::all;
  auto b = std::make_shared<sim_backend>(o);
  try {
    device_allocator a(b, cfg);
    ADD_FAILURE() << "peer_access:all accepted a device that cannot access device 0";
  } catch (const cuda_error& e) {
    EXPECT_EQ(e.code(), 217);
    EXPECT_NE(std::string(e.what()).find("device 1 cannot access device 0"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(b->live_reservations(), 0u);
}

TEST(PeerAccess, ConfigKeysParseAndRenderBack) {
  EXPECT_EQ(parse_config("peer_access:none").peer_access, peer_access_mode::none);
  EXPECT_EQ(parse_config("peer_access:all").peer_access, peer_access_mode::all);
  EXPECT_EQ(parse_config("peer_access:auto").peer_access, peer_access_mode::automatic);
  EXPECT_TRUE(parse_config("ipc_handles:True").ipc_handles);
  EXPECT_THROW((void)parse_config("peer_access:some"), invalid_argument);
  EXPECT_THROW((void)parse_config("ipc_handles:maybe"), invalid_argument);
  config c;
  c.peer_access = peer_access_mode::none;
  c.ipc_handles = true;
  EXPECT_EQ(to_string(c), "peer_access:none,ipc_handles:True");
  EXPECT_EQ(parse_config(to_string(c)), c);
}

}  // namespace
}  // namespace cucache
