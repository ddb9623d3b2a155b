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

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <limits>
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

// The checks shared by both forms: the header's fields once its magic and version are known good,
// and the pieces (`bytes` of each, pieceCount of them).
template <class Bytes>
void check_fields(int kind, std::uint64_t offset, std::uint64_t size, std::uint64_t span,
                  std::int64_t piece_count, std::int64_t max_pieces, Bytes piece_bytes,
                  const char* what) {
  if (size == 0 || offset > span || size > span - offset) {
    throw invalid_argument(
        fmt::format("cucache::{}: IPC handle with a block of {} bytes at offset {} of {} bytes",
                    what, size, offset, span));
  }
  if (kind == cucacheIpcKindSegment) {
    if (piece_count != 0) {
      throw invalid_argument(
          fmt::format("cucache::{}: segment IPC handle with {} pieces", what, piece_count));
    }
    return;
  }
  if (kind != cucacheIpcKindFileDescriptors) {
    throw invalid_argument(fmt::format("cucache::{}: IPC handle of unknown kind {}", what, kind));
  }
  if (piece_count < 1 || piece_count > max_pieces) {
    throw invalid_argument(fmt::format("cucache::{}: IPC handle with {} pieces (1..{})", what,
                                       piece_count, max_pieces));
  }
  std::uint64_t total = 0;
  for (std::int64_t i = 0; i < piece_count; ++i) {
    const std::uint64_t b = piece_bytes(i);
    if (b == 0 || b > span - total) {
      throw invalid_argument(
          fmt::format("cucache::{}: IPC handle piece {} of {} bytes does not fit its span of {}",
                      what, i, b, span));
    }
    total += b;
  }
  if (total != span) {
    throw invalid_argument(fmt::format(
        "cucache::{}: IPC handle pieces total {} bytes, its span says {}", what, total, span));
  }
}

void check_handle(const cucacheIpcHandle& h, const char* what) {
  if (h.magic != CUCACHE_IPC_MAGIC) {
    throw invalid_argument(fmt::format(
        "cucache::{}: not a cucache IPC handle (magic {:#x}, expected {:#x}){}", what, h.magic,
        CUCACHE_IPC_MAGIC,
        h.magic == CUCACHE_IPC_LONG_MAGIC ? ": a cucacheIpcLongHandle, open it as one" : ""));
  }
  if (h.version != CUCACHE_IPC_VERSION) {
    throw invalid_argument(fmt::format("cucache::{}: IPC handle version {}, this cucache reads {}",
                                       what, h.version, CUCACHE_IPC_VERSION));
  }
  check_fields(
      h.kind, h.offset, h.size, h.span, h.pieceCount, CUCACHE_IPC_MAX_PIECES,
      [&](std::int64_t i) { return h.pieceBytes[i]; }, what);
}

// The long header's own fields (magic, version), then the piece count against what follows.
void check_long_head(const cucacheIpcLongHandle& h, const char* what) {
  if (h.magic != CUCACHE_IPC_LONG_MAGIC) {
    throw invalid_argument(fmt::format(
        "cucache::{}: not a cucache long IPC handle (magic {:#x}, expected {:#x}){}", what, h.magic,
        CUCACHE_IPC_LONG_MAGIC,
        h.magic == CUCACHE_IPC_MAGIC ? ": a fixed cucacheIpcHandle, open it as one" : ""));
  }
  if (h.version != CUCACHE_IPC_LONG_VERSION) {
    throw invalid_argument(
        fmt::format("cucache::{}: long IPC handle version {}, this cucache reads {}", what,
                    h.version, CUCACHE_IPC_LONG_VERSION));
  }
  if (h.pieceCount < 0) {
    throw invalid_argument(
        fmt::format("cucache::{}: long IPC handle with {} pieces", what, h.pieceCount));
  }
}

void check_long(const ipc_long_handle& h, const char* what) {
  check_long_head(h.head, what);
  if (static_cast<std::size_t>(h.head.pieceCount) != h.pieces.size()) {
    throw invalid_argument(fmt::format("cucache::{}: long IPC handle says {} pieces and holds {}",
                                       what, h.head.pieceCount, h.pieces.size()));
  }
  check_fields(
      h.head.kind, h.head.offset, h.head.size, h.head.span, h.head.pieceCount,
      std::numeric_limits<std::int32_t>::max(),
      [&](std::int64_t i) { return h.pieces[static_cast<std::size_t>(i)].bytes; }, what);
}

ipc_long_handle to_long(const cucacheIpcHandle& h) {
  ipc_long_handle l;
  static_assert(offsetof(cucacheIpcHandle, fds) == sizeof(cucacheIpcLongHandle),
                "the long header is the fixed handle's first bytes");
  std::memcpy(&l.head, &h, sizeof(l.head));
  l.head.magic = CUCACHE_IPC_LONG_MAGIC;
  l.head.version = CUCACHE_IPC_LONG_VERSION;
  const int n = h.kind == cucacheIpcKindFileDescriptors ? h.pieceCount : 0;
  for (int i = 0; i < n; ++i) l.pieces.push_back(cucacheIpcPiece{h.fds[i], 0, h.pieceBytes[i]});
  l.head.pieceCount = n;
  return l;
}

std::string segment_key(const std::uint8_t (&bytes)[64], int device) {
  std::string key(reinterpret_cast<const char*>(bytes), sizeof(bytes));
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

void close_fds(std::vector<cucacheIpcPiece>& pieces) noexcept {
  for (auto& p : pieces) {
    if (p.fd >= 0) ::close(p.fd);
    p.fd = -1;
  }
}

// Exports the block `ptr` starts: the header and (expandable) one new fd per physical handle.
// Refused, exporting nothing, past `max_pieces` (the fixed struct's limit); `fixed` names it.
ipc_long_handle export_block(void* ptr, std::size_t max_pieces, bool fixed) {
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
  ipc_long_handle l;
  cucacheIpcLongHandle& h = l.head;
  h.magic = CUCACHE_IPC_LONG_MAGIC;
  h.version = CUCACHE_IPC_LONG_VERSION;
  h.device = owner->device();
  h.pid = static_cast<std::int64_t>(::getpid());
  h.offset = where->offset;
  h.size = where->size;
  h.span = where->span;
  device_backend& b = owner->backend();
  if (!where->expandable) {
    h.kind = cucacheIpcKindSegment;
    const segment_ipc_handle s = b.segment_export(reinterpret_cast<void*>(where->base));
    static_assert(sizeof(s.bytes) == sizeof(h.segmentHandle));
    std::memcpy(h.segmentHandle, s.bytes, sizeof(s.bytes));
    return l;
  }
  if (!owner->get_config().ipc_handles) {
    not_supported(fmt::format(
        "{} lives in an expandable segment of device {} (CUDA virtual memory), which "
        "cudaIpcGetMemHandle cannot export, and its physical memory was not created exportable: "
        "set CUCACHE_CONF=expandable_segments:True,ipc_handles:True to export it as POSIX file "
        "descriptors",
        ptr, owner->device()));
  }
  if (where->pieces.size() > max_pieces) {
    not_supported(fmt::format(
        "{} ({} bytes, device {}) spans {} physical handles, more than the fixed {} holds ({}): "
        "export it as a long handle (cucacheIpcGetLongHandle, cucache::ipc_get_long_handle), "
        "which carries any number",
        ptr, where->size, owner->device(), where->pieces.size(),
        fixed ? "cucacheIpcHandle" : "handle", max_pieces));
  }
  if (where->pieces.size() > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
    not_supported(fmt::format("{} spans {} physical handles, past the format's int32 count", ptr,
                              where->pieces.size()));
  }
  h.kind = cucacheIpcKindFileDescriptors;
  h.pieceCount = static_cast<std::int32_t>(where->pieces.size());
  l.pieces.reserve(where->pieces.size());
  try {
    for (const auto& piece : where->pieces) {
      l.pieces.push_back(cucacheIpcPiece{-1, 0, piece.bytes});
      l.pieces.back().fd = b.phys_export_fd(piece.handle);
    }
    // Exported: the block's tag may not sleep while it lives (its importers map this memory).
    owner->note_ipc_export(ptr);
  } catch (...) {
    close_fds(l.pieces);
    throw;
  }
  return l;
}

// --- sockets --------------------------------------------------------------------------------

constexpr std::size_t k_fds_per_message = 250;  // Linux passes at most SCM_MAX_FD (253)

// Sends `n` bytes, with `fds` as SCM_RIGHTS on the first of them.
void send_with_fds(int socket, const void* data, std::size_t n, const int* fds, std::size_t nfds,
                   const char* what) {
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * k_fds_per_message)] = {};
  const char* p = static_cast<const char*>(data);
  bool first = true;
  while (n > 0) {
    iovec io{const_cast<char*>(p), n};
    msghdr msg{};
    msg.msg_iov = &io;
    msg.msg_iovlen = 1;
    if (first && nfds > 0) {
      msg.msg_control = control;
      msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
      cmsghdr* c = CMSG_FIRSTHDR(&msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
      std::memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
    }
    ssize_t sent = 0;
    do {
      sent = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    if (sent <= 0) {
      throw cuda_error(fmt::format("cucache::{}", what), static_cast<int>(cudaErrorUnknown),
                       fmt::format("sendmsg on socket {}: {}", socket,
                                   sent < 0 ? std::strerror(errno) : "nothing written"));
    }
    first = false;
    p += sent;
    n -= static_cast<std::size_t>(sent);
  }
}

// Receives exactly `n` bytes into `data`, appending the descriptors that come with them to `fds`
// (in order). Throws on end of stream, an error, or truncated control data (the fds received
// so far stay in `fds` for the caller to close).
void recv_exact(int socket, void* data, std::size_t n, std::vector<int>& fds, const char* what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 253)] = {};
    iovec io{p, n};
    msghdr msg{};
    msg.msg_iov = &io;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    ssize_t got = 0;
    do {
      got = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
    } while (got < 0 && errno == EINTR);
    if (got >= 0) {
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const std::size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < k; ++i) {
          int fd = -1;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          fds.push_back(fd);
        }
      }
    }
    if (got <= 0) {
      throw cuda_error(fmt::format("cucache::{}", what), static_cast<int>(cudaErrorUnknown),
                       fmt::format("recvmsg on socket {}: {}", socket,
                                   got < 0 ? std::strerror(errno) : "short read"));
    }
    if ((msg.msg_flags & MSG_CTRUNC) != 0) {
      throw invalid_argument(
          fmt::format("cucache::{}: more file descriptors arrived than a message may carry", what));
    }
    p += got;
    n -= static_cast<std::size_t>(got);
  }
}

}  // namespace
}  // namespace cucache::detail

namespace cucache {

using detail::ipc_imports;
using detail::registry;

std::vector<std::byte> ipc_long_handle::bytes() const {
  std::vector<std::byte> out(sizeof(head) + pieces.size() * sizeof(cucacheIpcPiece));
  std::memcpy(out.data(), &head, sizeof(head));
  if (!pieces.empty()) {
    std::memcpy(out.data() + sizeof(head), pieces.data(), pieces.size() * sizeof(cucacheIpcPiece));
  }
  return out;
}

ipc_long_handle ipc_long_handle::from_bytes(const void* data, std::size_t size) {
  constexpr const char* what = "ipc_open_handle";
  if (data == nullptr) throw invalid_argument("cucache::ipc_open_handle: long IPC handle is NULL");
  if (size < sizeof(cucacheIpcLongHandle)) {
    throw invalid_argument(fmt::format(
        "cucache::{}: a long IPC handle of {} bytes is truncated: its header alone is {}", what,
        size, sizeof(cucacheIpcLongHandle)));
  }
  ipc_long_handle l;
  std::memcpy(&l.head, data, sizeof(l.head));
  detail::check_long_head(l.head, what);
  const std::size_t want = CUCACHE_IPC_LONG_HANDLE_BYTES(l.head.pieceCount);
  if (size != want) {
    throw invalid_argument(fmt::format(
        "cucache::{}: a long IPC handle of {} bytes, where its {} pieces make {} ({})", what, size,
        l.head.pieceCount, want, size < want ? "truncated" : "trailing bytes"));
  }
  l.pieces.resize(static_cast<std::size_t>(l.head.pieceCount));
  if (!l.pieces.empty()) {
    std::memcpy(l.pieces.data(), static_cast<const char*>(data) + sizeof(l.head),
                l.pieces.size() * sizeof(cucacheIpcPiece));
  }
  detail::check_long(l, what);
  return l;
}

cucacheIpcHandle ipc_get_handle(void* ptr) {
  ipc_long_handle l = detail::export_block(ptr, CUCACHE_IPC_MAX_PIECES, true);
  cucacheIpcHandle h{};
  std::memcpy(&h, &l.head, sizeof(l.head));
  h.magic = CUCACHE_IPC_MAGIC;
  h.version = CUCACHE_IPC_VERSION;
  for (int& fd : h.fds) fd = -1;
  for (std::size_t i = 0; i < l.pieces.size(); ++i) {
    h.fds[i] = l.pieces[i].fd;
    h.pieceBytes[i] = l.pieces[i].bytes;
  }
  return h;
}

ipc_long_handle ipc_get_long_handle(void* ptr) {
  return detail::export_block(ptr, std::numeric_limits<std::size_t>::max(), false);
}

namespace {

void* open_checked(const ipc_long_handle& l) {
  const cucacheIpcLongHandle& h = l.head;
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
    const std::string key = detail::segment_key(h.segmentHandle, device);
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
    v->pieces.reserve(l.pieces.size());
    for (const cucacheIpcPiece& piece : l.pieces) {
      const phys_handle ph = b.phys_import_fd(piece.fd);
      try {
        b.map(static_cast<char*>(v->va) + off, piece.bytes, ph);
      } catch (...) {
        b.phys_release(ph);
        throw;
      }
      v->pieces.emplace_back(ph, piece.bytes);
      off += piece.bytes;
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

}  // namespace

void* ipc_open_handle(const cucacheIpcHandle& h) {
  detail::check_handle(h, "ipc_open_handle");
  return open_checked(detail::to_long(h));
}

void* ipc_open_handle(const ipc_long_handle& h) {
  detail::check_long(h, "ipc_open_handle");
  return open_checked(h);
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
  const int n = h.kind == cucacheIpcKindFileDescriptors ? h.pieceCount : 0;
  detail::send_with_fds(socket, &h, sizeof(h), h.fds, static_cast<std::size_t>(n),
                        "ipc_send_handle");
}

cucacheIpcHandle ipc_recv_handle(int socket) {
  cucacheIpcHandle h{};
  std::vector<int> fds;
  const auto drop = [&] {
    for (int fd : fds) ::close(fd);
  };
  try {
    detail::recv_exact(socket, &h, sizeof(h), fds, "ipc_recv_handle");
    detail::check_handle(h, "ipc_recv_handle");
  } catch (...) {
    drop();
    throw;
  }
  const std::size_t want = h.kind == cucacheIpcKindFileDescriptors ? h.pieceCount : 0;
  if (fds.size() != want) {
    drop();
    throw invalid_argument(
        fmt::format("cucache::ipc_recv_handle: the handle names {} file descriptors, {} arrived",
                    want, fds.size()));
  }
  for (int& fd : h.fds) fd = -1;
  for (std::size_t i = 0; i < want; ++i) h.fds[i] = fds[i];
  return h;
}

void ipc_send_handle(int socket, const ipc_long_handle& h) {
  detail::check_long(h, "ipc_send_handle");
  // The header alone, then the pieces in batches, each batch's fds on its bytes.
  detail::send_with_fds(socket, &h.head, sizeof(h.head), nullptr, 0, "ipc_send_handle");
  std::vector<int> fds;
  for (std::size_t i = 0; i < h.pieces.size(); i += detail::k_fds_per_message) {
    const std::size_t k = std::min(detail::k_fds_per_message, h.pieces.size() - i);
    fds.clear();
    for (std::size_t j = 0; j < k; ++j) fds.push_back(h.pieces[i + j].fd);
    detail::send_with_fds(socket, &h.pieces[i], k * sizeof(cucacheIpcPiece), fds.data(), k,
                          "ipc_send_handle");
  }
}

ipc_long_handle ipc_recv_long_handle(int socket) {
  constexpr const char* what = "ipc_recv_handle";
  ipc_long_handle l;
  std::vector<int> fds;
  try {
    detail::recv_exact(socket, &l.head, sizeof(l.head), fds, what);
    detail::check_long_head(l.head, what);
    // Batch by batch: memory grows only with what actually arrives.
    const std::size_t n = static_cast<std::size_t>(l.head.pieceCount);
    while (l.pieces.size() < n) {
      const std::size_t k = std::min(detail::k_fds_per_message, n - l.pieces.size());
      const std::size_t at = l.pieces.size();
      l.pieces.resize(at + k);
      detail::recv_exact(socket, &l.pieces[at], k * sizeof(cucacheIpcPiece), fds, what);
    }
    detail::check_long(l, what);
    const std::size_t want = l.head.kind == cucacheIpcKindFileDescriptors ? n : 0;
    if (fds.size() != want) {
      throw invalid_argument(fmt::format(
          "cucache::{}: the handle names {} file descriptors, {} arrived", what, want, fds.size()));
    }
  } catch (...) {
    for (int fd : fds) ::close(fd);
    throw;
  }
  for (std::size_t i = 0; i < l.pieces.size(); ++i) l.pieces[i].fd = fds[i];
  return l;
}

void ipc_release_fds(cucacheIpcHandle& handle) noexcept {
  detail::close_fds(handle);
}

void ipc_release_fds(ipc_long_handle& handle) noexcept {
  detail::close_fds(handle.pieces);
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

namespace {

// A malloc'd copy of `l` in its wire form (freed by cucacheIpcFreeLongHandle).
cucacheIpcLongHandle* to_c(const cucache::ipc_long_handle& l, std::size_t* bytes) {
  const std::vector<std::byte> b = l.bytes();
  void* m = std::malloc(b.size());
  if (m == nullptr) {
    throw cucache::out_of_memory(
        fmt::format("cucache: no host memory for a long IPC handle of {} bytes", b.size()));
  }
  std::memcpy(m, b.data(), b.size());
  *bytes = b.size();
  return static_cast<cucacheIpcLongHandle*>(m);
}

}  // namespace

cudaError_t cucacheIpcGetLongHandle(cucacheIpcLongHandle** handle, size_t* bytes,
                                    void* devPtr) noexcept {
  if (handle == nullptr) return null_argument("cucacheIpcGetLongHandle", "handle");
  *handle = nullptr;
  if (bytes == nullptr) return null_argument("cucacheIpcGetLongHandle", "bytes");
  *bytes = 0;
  if (devPtr == nullptr) return null_argument("cucacheIpcGetLongHandle", "devPtr");
  return guarded("cucacheIpcGetLongHandle", [&] {
    cucache::ipc_long_handle l = cucache::ipc_get_long_handle(devPtr);
    try {
      *handle = to_c(l, bytes);
    } catch (...) {
      cucache::ipc_release_fds(l);
      throw;
    }
  });
}

cudaError_t cucacheIpcOpenLongHandle(void** devPtr, const cucacheIpcLongHandle* handle,
                                     size_t bytes) noexcept {
  if (devPtr == nullptr) return null_argument("cucacheIpcOpenLongHandle", "devPtr");
  *devPtr = nullptr;
  if (handle == nullptr) return null_argument("cucacheIpcOpenLongHandle", "handle");
  return guarded("cucacheIpcOpenLongHandle", [&] {
    *devPtr = cucache::ipc_open_handle(cucache::ipc_long_handle::from_bytes(handle, bytes));
  });
}

cudaError_t cucacheIpcSendLongHandle(int socket, const cucacheIpcLongHandle* handle,
                                     size_t bytes) noexcept {
  if (handle == nullptr) return null_argument("cucacheIpcSendLongHandle", "handle");
  return guarded("cucacheIpcSendLongHandle", [&] {
    cucache::ipc_send_handle(socket, cucache::ipc_long_handle::from_bytes(handle, bytes));
  });
}

cudaError_t cucacheIpcRecvLongHandle(int socket, cucacheIpcLongHandle** handle,
                                     size_t* bytes) noexcept {
  if (handle == nullptr) return null_argument("cucacheIpcRecvLongHandle", "handle");
  *handle = nullptr;
  if (bytes == nullptr) return null_argument("cucacheIpcRecvLongHandle", "bytes");
  *bytes = 0;
  return guarded("cucacheIpcRecvLongHandle", [&] {
    cucache::ipc_long_handle l = cucache::ipc_recv_long_handle(socket);
    try {
      *handle = to_c(l, bytes);
    } catch (...) {
      cucache::ipc_release_fds(l);
      throw;
    }
  });
}

cudaError_t cucacheIpcReleaseLongHandleFds(cucacheIpcLongHandle* handle) noexcept {
  if (handle == nullptr) return null_argument("cucacheIpcReleaseLongHandleFds", "handle");
  if (handle->magic != CUCACHE_IPC_LONG_MAGIC || handle->pieceCount < 0) {
    return guarded("cucacheIpcReleaseLongHandleFds", [&] {
      throw cucache::invalid_argument(
          "cucacheIpcReleaseLongHandleFds: not a cucache long IPC handle");
    });
  }
  cucacheIpcPiece* p = cucacheIpcLongHandlePieces(handle);
  for (int32_t i = 0; i < handle->pieceCount; ++i) {
    if (p[i].fd >= 0) ::close(p[i].fd);
    p[i].fd = -1;
  }
  return cudaSuccess;
}

void cucacheIpcFreeLongHandle(cucacheIpcLongHandle* handle) noexcept {
  if (handle == nullptr) return;
  if (handle->magic == CUCACHE_IPC_LONG_MAGIC) (void)cucacheIpcReleaseLongHandleFds(handle);
  std::free(handle);
}

}  // extern "C"
