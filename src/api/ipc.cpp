// Inter-process sharing of cucache blocks (docs/design.md, "IPC"): the C++ functions of
// cucache.hpp, the C functions of cucache.h, and the table of what this process has opened.
//
// Export. Default mode: cudaIpcGetMemHandle covers a whole cudaMalloc allocation, so a block's
// handle is its segment's handle plus the block's offset. Expandable mode: the physical handles
// mapped under the block, exported as POSIX file descriptors; only when the allocator created
// them exportable (ipc_handles:True). Anything else is refused before anything is exported.
//
// Import. A segment is opened once per process however many of its blocks are opened
// (cudaIpcOpenMemHandle may refuse to map one allocation twice), and closed with its last
// block. File-descriptor handles are imported, mapped at a fresh reservation and made accessible
// to the devices the importer's backend grants (peer_access), one reservation per open.
#include <fmt/format.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "api/c_boundary.hpp"
#include "api/registry.hpp"
#include "cucache/cucache.h"
#include "cucache/cucache.hpp"
#include "cucache/errors.hpp"

namespace cucache::detail {

struct ipc_imports {
  struct segment_open {
    device_backend* backend;
    void* base;
    std::size_t refs;
  };
  struct vm_open {
    device_backend* backend;
    void* va;
    std::size_t reserved;
    std::vector<std::pair<phys_handle, std::size_t>> pieces;  // mapped one after the other
  };
  struct open_rec {
    std::size_t refs = 0;
    std::string segment_key;  // kind Segment: the key of `segments`
    std::unique_ptr<vm_open> vm;
  };

  detail::mutex mu;
  std::map<std::string, segment_open> segments GUARDED_BY(mu);  // by device and handle bytes
  std::map<void*, open_rec> opens GUARDED_BY(mu);               // by the address handed out

  ~ipc_imports() {
    // The registry is going: close what the program left open. Nothing can report a failure.
    for (auto& [ptr, o] : opens) {
      if (o.vm) close_vm(*o.vm);
    }
    for (auto& [key, s] : segments) {
      try {
        s.backend->segment_close(s.base);
      } catch (...) {
      }
    }
  }

  static void close_vm(vm_open& v) noexcept {
    std::size_t off = 0;
    for (auto& [h, bytes] : v.pieces) {
      try {
        v.backend->unmap(static_cast<char*>(v.va) + off, bytes);
      } catch (...) {
      }
      try {
        v.backend->phys_release(h);
      } catch (...) {
      }
      off += bytes;
    }
    try {
      v.backend->va_free(v.va, v.reserved);
    } catch (...) {
    }
  }
};

ipc_imports& registry::imports() {
  detail::lock_guard lock(create_mu_);
  if (!imports_) imports_ = std::make_shared<ipc_imports>();
  return *imports_;
}

namespace {

[[noreturn]] void not_supported(std::string why) {
  throw cuda_error("cucache::ipc_get_handle", static_cast<int>(cudaErrorNotSupported), why);
}

void check_handle(const cucacheIpcHandle& h, const char* what) {
  if (h.magic != CUCACHE_IPC_MAGIC) {
    throw invalid_argument(fmt::format(
        "cucache::{}: not a cucache IPC handle (magic {:#x}, expected {:#x})", what, h.magic,
        CUCACHE_IPC_MAGIC));
  }
  if (h.version != CUCACHE_IPC_VERSION) {
    throw invalid_argument(fmt::format("cucache::{}: IPC handle version {}, this cucache reads {}",
                                       what, h.version, CUCACHE_IPC_VERSION));
  }
  if (h.size == 0 || h.offset > h.span || h.size > h.span - h.offset) {
    throw invalid_argument(fmt::format(
        "cucache::{}: IPC handle with a block of {} bytes at offset {} of {} bytes", what, h.size,
        h.offset, h.span));
  }
  if (h.kind == cucacheIpcKindSegment) {
    if (h.pieceCount != 0) {
      throw invalid_argument(fmt::format("cucache::{}: segment IPC handle with {} pieces", what,
                                         h.pieceCount));
    }
    return;
  }
  if (h.kind != cucacheIpcKindFileDescriptors) {
    throw invalid_argument(fmt::format("cucache::{}: IPC handle of unknown kind {}", what, h.kind));
  }
  if (h.pieceCount < 1 || h.pieceCount > CUCACHE_IPC_MAX_PIECES) {
    throw invalid_argument(fmt::format("cucache::{}: IPC handle with {} pieces (1..{})", what,
                                       h.pieceCount, CUCACHE_IPC_MAX_PIECES));
  }
  std::uint64_t total = 0;
  for (int i = 0; i < h.pieceCount; ++i) {
    if (h.pieceBytes[i] == 0 || h.pieceBytes[i] > h.span - total) {
      throw invalid_argument(
          fmt::format("cucache::{}: IPC handle piece {} of {} bytes does not fit its span of {}",
                      what, i, h.pieceBytes[i], h.span));
    }
    total += h.pieceBytes[i];
  }
  if (total != h.span) {
    throw invalid_argument(fmt::format(
        "cucache::{}: IPC handle pieces total {} bytes, its span says {}", what, total, h.span));
  }
}

std::string segment_key(const cucacheIpcHandle& h, int device) {
  std::string key(reinterpret_cast<const char*>(h.segmentHandle), sizeof(h.segmentHandle));
  key += fmt::format("@{}", device);
  return key;
}

void close_fds(cucacheIpcHandle& h) noexcept {
  if (h.kind != cucacheIpcKindFileDescriptors) return;
  for (int i = 0; i < CUCACHE_IPC_MAX_PIECES; ++i) {
    if (h.fds[i] >= 0 && i < h.pieceCount) ::close(h.fds[i]);
    h.fds[i] = -1;
  }
}

}  // namespace
}  // namespace cucache::detail

namespace cucache {

using detail::ipc_imports;
using detail::registry;

cucacheIpcHandle ipc_get_handle(void* ptr) {
  registry* r = registry::if_built();
  if (ptr == nullptr || r == nullptr) {
    registry::require_not_forked();
    throw invalid_argument(fmt::format(
        "cucache::ipc_get_handle: {} is not the start of a live cucache allocation", ptr));
  }
  const int hint = r->try_current_device();
  device_allocator* owner = nullptr;
  std::optional<device_allocator::ipc_block> where;
  for (int i = -1; i < r->device_count() && !where; ++i) {
    const int d = i < 0 ? hint : i;
    if (i >= 0 && d == hint) continue;
    device_allocator* a = r->find(d);
    if (a == nullptr) continue;
    where = a->ipc_describe(ptr);
    if (where) owner = a;
  }
  if (!where) {
    if (device_allocator* a = r->find(hint)) {
      throw invalid_argument(a->explain_bad_pointer(ptr, "ipc_get_handle"));
    }
    throw invalid_argument(fmt::format(
        "cucache::ipc_get_handle: {} is not the start of a live cucache allocation (unknown "
        "pointer, interior pointer or already freed)",
        ptr));
  }
  cucacheIpcHandle h{};
  h.magic = CUCACHE_IPC_MAGIC;
  h.version = CUCACHE_IPC_VERSION;
  h.device = owner->device();
  h.pid = static_cast<std::int64_t>(::getpid());
  h.offset = where->offset;
  h.size = where->size;
  h.span = where->span;
  for (int& fd : h.fds) fd = -1;
  device_backend& b = owner->backend();
  if (!where->expandable) {
    h.kind = cucacheIpcKindSegment;
    const segment_ipc_handle s = b.segment_export(reinterpret_cast<void*>(where->base));
    static_assert(sizeof(s.bytes) == sizeof(h.segmentHandle));
    std::memcpy(h.segmentHandle, s.bytes, sizeof(s.bytes));
    return h;
  }
  if (!owner->get_config().ipc_handles) {
    detail::not_supported(fmt::format(
        "{} lives in an expandable segment of device {} (CUDA virtual memory), which "
        "cudaIpcGetMemHandle cannot export, and its physical memory was not created exportable: "
        "set CUCACHE_CONF=expandable_segments:True,ipc_handles:True to export it as POSIX file "
        "descriptors",
        ptr, owner->device()));
  }
  if (where->pieces.size() > CUCACHE_IPC_MAX_PIECES) {
    detail::not_supported(fmt::format(
        "{} ({} bytes, device {}) spans {} physical handles, more than a handle holds ({})", ptr,
        where->size, owner->device(), where->pieces.size(), CUCACHE_IPC_MAX_PIECES));
  }
  h.kind = cucacheIpcKindFileDescriptors;
  h.pieceCount = static_cast<std::int32_t>(where->pieces.size());
  try {
    for (std::size_t i = 0; i < where->pieces.size(); ++i) {
      h.pieceBytes[i] = where->pieces[i].bytes;
      h.fds[i] = b.phys_export_fd(where->pieces[i].handle);
    }
    // Exported: the block's tag may not sleep while it lives (its importers map this memory).
    owner->note_ipc_export(ptr);
  } catch (...) {
    detail::close_fds(h);
    throw;
  }
  return h;
}

void* ipc_open_handle(const cucacheIpcHandle& h) {
  detail::check_handle(h, "ipc_open_handle");
  registry& r = registry::instance();
  const int device = r.current_device();
  device_allocator& a = r.allocator(device);
  device_backend& b = a.backend();
  if (h.kind == cucacheIpcKindSegment && h.pid == static_cast<std::int64_t>(::getpid()) &&
      r.kind() == backend_kind::cuda) {
    throw invalid_argument(fmt::format(
        "cucache::ipc_open_handle: the handle was exported by this process (pid {}); CUDA "
        "cannot open its own IPC handles: use the allocation's pointer itself",
        h.pid));
  }
  ipc_imports& t = r.imports();
  detail::lock_guard lock(t.mu);
  if (h.kind == cucacheIpcKindSegment) {
    const std::string key = detail::segment_key(h, device);
    auto s = t.segments.find(key);
    if (s == t.segments.end()) {
      segment_ipc_handle sh;
      std::memcpy(sh.bytes, h.segmentHandle, sizeof(sh.bytes));
      void* base = b.segment_import(sh);
      s = t.segments.emplace(key, ipc_imports::segment_open{&b, base, 0}).first;
    }
    void* ptr = static_cast<char*>(s->second.base) + h.offset;
    auto& o = t.opens[ptr];
    ++o.refs;
    o.segment_key = key;
    ++s->second.refs;
    return ptr;
  }
  // POSIX file descriptors: import every piece, map them one after the other.
  const std::size_t g = b.vm_granularity();
  if (g == 0) {
    throw cuda_error("cucache::ipc_open_handle", static_cast<int>(cudaErrorNotSupported),
                     fmt::format("device {} has no virtual memory management, which a "
                                 "file-descriptor handle needs",
                                 device));
  }
  auto v = std::make_unique<ipc_imports::vm_open>();
  v->backend = &b;
  v->reserved = (h.span + g - 1) / g * g;
  v->va = b.va_reserve(v->reserved);
  if (v->va == nullptr) {
    throw out_of_memory(fmt::format(
        "cucache::ipc_open_handle: no virtual address space left for the {} bytes of the "
        "handle's memory on device {}",
        v->reserved, device));
  }
  try {
    std::size_t off = 0;
    for (int i = 0; i < h.pieceCount; ++i) {
      const phys_handle ph = b.phys_import_fd(h.fds[i]);
      try {
        b.map(static_cast<char*>(v->va) + off, h.pieceBytes[i], ph);
      } catch (...) {
        b.phys_release(ph);
        throw;
      }
      v->pieces.emplace_back(ph, h.pieceBytes[i]);
      off += h.pieceBytes[i];
    }
    b.set_access(v->va, h.span);
  } catch (...) {
    ipc_imports::close_vm(*v);
    throw;
  }
  void* ptr = static_cast<char*>(v->va) + h.offset;
  auto& o = t.opens[ptr];
  o.refs = 1;
  o.vm = std::move(v);
  return ptr;
}

void ipc_close_handle(void* ptr) {
  registry* r = registry::if_built();
  auto not_open = [&] {
    return invalid_argument(fmt::format(
        "cucache::ipc_close_handle: {} is not an address ipc_open_handle returned and still open "
        "(closed already, or never opened)",
        ptr));
  };
  if (r == nullptr) throw not_open();
  ipc_imports& t = r->imports();
  detail::lock_guard lock(t.mu);
  auto it = t.opens.find(ptr);
  if (it == t.opens.end()) throw not_open();
  if (it->second.vm) {
    ipc_imports::close_vm(*it->second.vm);
    t.opens.erase(it);
    return;
  }
  auto s = t.segments.find(it->second.segment_key);
  if (s != t.segments.end() && s->second.refs == 1) {
    s->second.backend->segment_close(s->second.base);  // throws: nothing changed
    t.segments.erase(s);
  } else if (s != t.segments.end()) {
    --s->second.refs;
  }
  if (--it->second.refs == 0) t.opens.erase(it);
}

void ipc_send_handle(int socket, const cucacheIpcHandle& h) {
  detail::check_handle(h, "ipc_send_handle");
  cucacheIpcHandle copy = h;
  iovec io{&copy, sizeof(copy)};
  msghdr msg{};
  msg.msg_iov = &io;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * CUCACHE_IPC_MAX_PIECES)] = {};
  const int n = h.kind == cucacheIpcKindFileDescriptors ? h.pieceCount : 0;
  if (n > 0) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * static_cast<std::size_t>(n));
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * static_cast<std::size_t>(n));
    std::memcpy(CMSG_DATA(c), h.fds, sizeof(int) * static_cast<std::size_t>(n));
  }
  ssize_t sent = 0;
  do {
    sent = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
  } while (sent < 0 && errno == EINTR);
  if (sent != static_cast<ssize_t>(sizeof(copy))) {
    throw cuda_error("cucache::ipc_send_handle", static_cast<int>(cudaErrorUnknown),
                     fmt::format("sendmsg on socket {}: {}", socket,
                                 sent < 0 ? std::strerror(errno) : "short write"));
  }
}

cucacheIpcHandle ipc_recv_handle(int socket) {
  cucacheIpcHandle h{};
  iovec io{&h, sizeof(h)};
  msghdr msg{};
  msg.msg_iov = &io;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * CUCACHE_IPC_MAX_PIECES)] = {};
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t got = 0;
  do {
    got = ::recvmsg(socket, &msg, MSG_WAITALL | MSG_CMSG_CLOEXEC);
  } while (got < 0 && errno == EINTR);
  std::vector<int> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < n; ++i) {
      int fd = -1;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds.push_back(fd);
    }
  }
  const auto drop = [&] {
    for (int fd : fds) ::close(fd);
  };
  if (got != static_cast<ssize_t>(sizeof(h))) {
    drop();
    throw cuda_error("cucache::ipc_recv_handle", static_cast<int>(cudaErrorUnknown),
                     fmt::format("recvmsg on socket {}: {}", socket,
                                 got < 0 ? std::strerror(errno) : "short read"));
  }
  try {
    detail::check_handle(h, "ipc_recv_handle");
  } catch (...) {
    drop();
    throw;
  }
  const std::size_t want = h.kind == cucacheIpcKindFileDescriptors ? h.pieceCount : 0;
  if (fds.size() != want || (msg.msg_flags & MSG_CTRUNC) != 0) {
    drop();
    throw invalid_argument(fmt::format(
        "cucache::ipc_recv_handle: the handle names {} file descriptors, {} arrived", want,
        fds.size()));
  }
  for (int& fd : h.fds) fd = -1;
  for (std::size_t i = 0; i < want; ++i) h.fds[i] = fds[i];
  return h;
}

void ipc_release_fds(cucacheIpcHandle& handle) noexcept {
  detail::close_fds(handle);
}

}  // namespace cucache

using cucache::detail::guarded;
using cucache::detail::null_argument;

extern "C" {

cudaError_t cucacheIpcGetHandle(cucacheIpcHandle* handle, void* devPtr) noexcept {
  if (handle == nullptr) return null_argument("cucacheIpcGetHandle", "handle");
  if (devPtr == nullptr) return null_argument("cucacheIpcGetHandle", "devPtr");
  return guarded("cucacheIpcGetHandle", [&] { *handle = cucache::ipc_get_handle(devPtr); });
}

cudaError_t cucacheIpcOpenHandle(void** devPtr, const cucacheIpcHandle* handle) noexcept {
  if (devPtr == nullptr) return null_argument("cucacheIpcOpenHandle", "devPtr");
  *devPtr = nullptr;
  if (handle == nullptr) return null_argument("cucacheIpcOpenHandle", "handle");
  return guarded("cucacheIpcOpenHandle", [&] { *devPtr = cucache::ipc_open_handle(*handle); });
}

cudaError_t cucacheIpcCloseHandle(void* devPtr) noexcept {
  if (devPtr == nullptr) return null_argument("cucacheIpcCloseHandle", "devPtr");
  return guarded("cucacheIpcCloseHandle", [&] { cucache::ipc_close_handle(devPtr); });
}

cudaError_t cucacheIpcSendHandle(int socket, const cucacheIpcHandle* handle) noexcept {
  if (handle == nullptr) return null_argument("cucacheIpcSendHandle", "handle");
  return guarded("cucacheIpcSendHandle", [&] { cucache::ipc_send_handle(socket, *handle); });
}

cudaError_t cucacheIpcRecvHandle(int socket, cucacheIpcHandle* handle) noexcept {
  if (handle == nullptr) return null_argument("cucacheIpcRecvHandle", "handle");
  return guarded("cucacheIpcRecvHandle", [&] { *handle = cucache::ipc_recv_handle(socket); });
}

cudaError_t cucacheIpcReleaseFds(cucacheIpcHandle* handle) noexcept {
  if (handle == nullptr) return null_argument("cucacheIpcReleaseFds", "handle");
  cucache::ipc_release_fds(*handle);
  return cudaSuccess;
}

}  // extern "C"
