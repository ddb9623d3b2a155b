// The simulated device. Addresses come from a first-fit allocator over a fixed 64 TiB window, so
// the same sequence of calls always yields the same addresses. Each device ordinal has a window of
// its own (device 0's starts at sim_backend::k_first_address): as on real GPUs, which share one virtual address
// space, a pointer belongs to one device only, so a free can find its owner. Driver rules that the
// allocator must respect (whole-mapping unmap, no release of mapped handles, no free of unknown
// pointers) are enforced as errors, so a bug in the allocator shows up as a failed test.
#include "cucache/sim_backend.hpp"

#include <fmt/format.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "backend/thread_annotations.hpp"
#include "cucache/errors.hpp"

namespace cucache {
namespace {

constexpr std::uintptr_t k_address_base = sim_backend::k_first_address;
constexpr std::size_t k_address_window = sim_backend::k_window_bytes;
constexpr int k_max_devices = 64;  // windows up to 0x400000000000 + 64 * 64 TiB, far below 2^64
constexpr int k_sim_invalid_value = 1;  // cudaErrorInvalidValue's number
// Streams from create_stream live far from the sim's device addresses and from the small fake
// handles tests use (1, 2, 0x5000 + 0x100 * i, n << 8), 64 bytes apart like real CUstream_st.
constexpr std::uintptr_t k_stream_base = 0x5e0000000000ULL;
constexpr std::uintptr_t k_stream_stride = 0x40;
// The id of a handle the sim did not create (nullptr and the fakes tests pass).
constexpr std::uint64_t k_fake_stream_id_tag = std::uint64_t{1} << 62;

// The calling thread's capture mode: per thread, shared by every simulated device, as in CUDA.
thread_local capture_mode t_capture_mode = capture_mode::global;

// identify's per-thread keeping of cudaStreamPerThread's id, as cuda_backend keeps it: the sim it
// was asked of (by serial number: an address may be reused by a later sim) and the id.
std::atomic<std::uint64_t> g_sim_serials{0};
struct per_thread_id_entry {
  std::uint64_t serial = 0;  // 0: nothing kept
  std::uint64_t id = 0;
};
thread_local per_thread_id_entry t_per_thread_id;

const char* to_string(capture_mode mode) noexcept {
  switch (mode) {
    case capture_mode::global:
      return "global";
    case capture_mode::thread_local_mode:
      return "thread-local";
    case capture_mode::relaxed:
      return "relaxed";
  }
  return "unknown";
}

constexpr int k_sim_not_supported = 801;                        // cudaErrorNotSupported
constexpr int k_sim_peer_unsupported = 217;                     // cudaErrorPeerAccessUnsupported
constexpr std::uint64_t k_sim_ipc_magic = 0x6370692d6d6973ULL;  // "sim-ipc"

// What the sim's IPC handles name, for every sim_backend of the process (sim_backend.hpp).
struct sim_export {
  std::shared_ptr<std::byte[]> host;
  std::size_t bytes = 0;
  int device = 0;
};
detail::mutex g_exports_mu;
std::unordered_map<std::uint64_t, sim_export> g_exports GUARDED_BY(g_exports_mu);
std::uint64_t g_next_export GUARDED_BY(g_exports_mu) = 1;

std::uint64_t add_export(sim_export e) {
  detail::lock_guard lock(g_exports_mu);
  const std::uint64_t id = g_next_export++;
  g_exports.emplace(id, std::move(e));
  return id;
}
void drop_export(std::uint64_t id) {
  if (id == 0) return;
  detail::lock_guard lock(g_exports_mu);
  g_exports.erase(id);
}
std::optional<sim_export> find_export(std::uint64_t id) {
  detail::lock_guard lock(g_exports_mu);
  auto it = g_exports.find(id);
  if (it == g_exports.end()) return std::nullopt;
  return it->second;
}

// The layout of a sim segment handle's bytes and of a phys descriptor's file.
struct sim_ipc_record {
  std::uint64_t magic;
  std::uint64_t id;
  std::uint64_t bytes;
  std::int64_t device;
};
static_assert(sizeof(sim_ipc_record) <= sizeof(segment_ipc_handle::bytes));

std::size_t round_up(std::size_t n, std::size_t m) {
  return (n + m - 1) / m * m;
}

}  // namespace

const char* to_string(sim_call call) noexcept {
  switch (call) {
    case sim_call::segment_malloc:
      return "segment_malloc";
    case sim_call::segment_free:
      return "segment_free";
    case sim_call::vm_granularity:
      return "vm_granularity";
    case sim_call::va_reserve:
      return "va_reserve";
    case sim_call::va_free:
      return "va_free";
    case sim_call::phys_create:
      return "phys_create";
    case sim_call::phys_release:
      return "phys_release";
    case sim_call::map:
      return "map";
    case sim_call::unmap:
      return "unmap";
    case sim_call::set_access:
      return "set_access";
    case sim_call::event_create:
      return "event_create";
    case sim_call::event_destroy:
      return "event_destroy";
    case sim_call::event_record:
      return "event_record";
    case sim_call::event_query:
      return "event_query";
    case sim_call::event_synchronize:
      return "event_synchronize";
    case sim_call::stream_synchronize:
      return "stream_synchronize";
    case sim_call::device_synchronize:
      return "device_synchronize";
    case sim_call::mem_get_info:
      return "mem_get_info";
    case sim_call::stream_id:
      return "stream_id";
    case sim_call::capture_status:
      return "capture_status";
    case sim_call::exchange_capture_mode:
      return "exchange_capture_mode";
    case sim_call::segment_export:
      return "segment_export";
    case sim_call::segment_import:
      return "segment_import";
    case sim_call::segment_close:
      return "segment_close";
    case sim_call::phys_export_fd:
      return "phys_export_fd";
    case sim_call::phys_import_fd:
      return "phys_import_fd";
    case sim_call::host_alloc_pinned:
      return "host_alloc_pinned";
    case sim_call::host_free_pinned:
      return "host_free_pinned";
    case sim_call::copy_async:
      return "copy_async";
    case sim_call::count_:
      break;
  }
  return "unknown";
}

sim_backend::sim_backend(sim_options options)
    : options_(options),
      serial_(g_sim_serials.fetch_add(1, std::memory_order_relaxed) + 1),
      next_stream_(k_stream_base) {
  if (options_.malloc_page_bytes == 0) options_.malloc_page_bytes = 1;
  if (options_.device < 0 || options_.device >= k_max_devices) {
    throw invalid_argument(
        fmt::format("sim_backend: device {} is not in [0, {})", options_.device, k_max_devices));
  }
  free_ranges_.emplace(
      k_address_base + static_cast<std::uintptr_t>(options_.device) * k_address_window,
      k_address_window);
}

sim_backend::~sim_backend() = default;

bool sim_backend::should_fail(sim_call kind) {
  const auto k = static_cast<std::size_t>(kind);
  const std::uint64_t n = calls_[k].fetch_add(1, std::memory_order_relaxed) + 1;
  if (fail_always_[k]) return true;
  if (fail_at_[k] != 0 && fail_at_[k] == n) {
    fail_at_[k] = 0;
    return true;
  }
  return false;
}

std::uint64_t sim_backend::id_of_locked(stream_handle stream) const {
  if (is_legacy_stream(stream)) return k_sim_legacy_stream_id;
  if (auto it = live_streams_.find(stream); it != live_streams_.end()) return it->second;
  if (auto it = destroyed_streams_.find(stream); it != destroyed_streams_.end()) return it->second;
  return k_fake_stream_id_tag | reinterpret_cast<std::uintptr_t>(stream);
}

void sim_backend::capture_violation(sim_call kind, const std::string& why) {
  ++capture_violations_;
  fail(kind, why, k_sim_capture_unsupported);
}

void sim_backend::require_capture_safe(sim_call kind) {
  if (captures_.empty()) return;
  const capture_mode mode = t_capture_mode;
  if (mode == capture_mode::relaxed) return;
  const std::thread::id self = std::this_thread::get_id();
  std::uint64_t culprit = 0;
  for (auto& [stream, c] : captures_) {
    const bool own = c.thread == self && c.mode != capture_mode::relaxed;
    const bool global = mode == capture_mode::global && c.mode == capture_mode::global;
    if (own || global) {
      c.invalidated = true;
      culprit = c.id;
    }
  }
  if (culprit != 0) {
    capture_violation(kind, fmt::format("not permitted in {} capture mode while capture {} is "
                                        "underway (the capture is invalidated)",
                                        to_string(mode), culprit));
  }
}

void sim_backend::require_no_capture(sim_call kind) {
  if (captures_.empty()) return;
  for (auto& [stream, c] : captures_) c.invalidated = true;
  capture_violation(kind, fmt::format("synchronizes the device while {} stream(s) capture (the "
                                      "captures are invalidated)",
                                      captures_.size()));
}

bool sim_backend::query_fast(sim_call kind) noexcept {
  if (query_faults_.load(std::memory_order_acquire)) return false;
  // A plain load and store, not a locked increment: the sim should cost what a driver's
  // thread-local lookup costs, not a contended atomic. Exact from one thread at a time; calls
  // racing from several threads may be undercounted.
  auto& n = calls_[static_cast<std::size_t>(kind)];
  n.store(n.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  return true;
}

void sim_backend::require_live_stream(sim_call kind, stream_handle stream) {
  if (is_legacy_stream(stream) || !destroyed_streams_.contains(stream)) return;
  ++destroyed_stream_calls_;
  fail(kind, fmt::format("stream {} has been destroyed", static_cast<const void*>(stream)),
       k_sim_invalid_resource_handle);
}

void sim_backend::fail(sim_call kind, const std::string& why, int code) const {
  throw cuda_error(fmt::format("sim {}", to_string(kind)), code, why);
}

std::size_t sim_backend::page_round(std::size_t bytes) const {
  return round_up(bytes, options_.malloc_page_bytes);
}

std::uintptr_t sim_backend::take_address(std::size_t bytes, std::size_t align) {
  for (auto it = free_ranges_.begin(); it != free_ranges_.end(); ++it) {
    const std::uintptr_t start = round_up(it->first, align);
    const std::uintptr_t end = it->first + it->second;
    if (start >= end || end - start < bytes) continue;
    const std::uintptr_t range_start = it->first;
    free_ranges_.erase(it);
    if (start > range_start) free_ranges_.emplace(range_start, start - range_start);
    if (start + bytes < end) free_ranges_.emplace(start + bytes, end - (start + bytes));
    return start;
  }
  return 0;
}

void sim_backend::give_address(std::uintptr_t addr, std::size_t bytes) {
  auto [it, inserted] = free_ranges_.emplace(addr, bytes);
  (void)inserted;
  auto next = std::next(it);
  if (next != free_ranges_.end() && it->first + it->second == next->first) {
    it->second += next->second;
    free_ranges_.erase(next);
  }
  if (it != free_ranges_.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      free_ranges_.erase(it);
    }
  }
}

void* sim_backend::segment_malloc(std::size_t bytes) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::segment_malloc)) return nullptr;
  require_capture_safe(sim_call::segment_malloc);
  if (bytes == 0) return nullptr;
  if (bytes > options_.capacity_bytes) return nullptr;
  const std::size_t charged = page_round(bytes);
  if (charged > options_.capacity_bytes - std::min(used_, options_.capacity_bytes)) return nullptr;
  const std::uintptr_t addr = take_address(charged, options_.malloc_page_bytes);
  if (addr == 0) return nullptr;
  segment_rec rec{charged, nullptr};
  if (options_.host_memory) rec.host = std::make_shared<std::byte[]>(charged);
  segments_.emplace(addr, std::move(rec));
  used_ += charged;
  return reinterpret_cast<void*>(addr);
}

void sim_backend::segment_free(void* ptr) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::segment_free)) fail(sim_call::segment_free, "injected failure");
  require_no_capture(sim_call::segment_free);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = segments_.find(addr);
  if (it == segments_.end()) {
    fail(sim_call::segment_free, fmt::format("{} is not a live segment", ptr), k_sim_invalid_value);
  }
  used_ -= it->second.bytes;
  give_address(addr, it->second.bytes);
  // Its handle names nothing from now on: a later open fails, opened ones keep their memory.
  drop_export(it->second.export_id);
  segments_.erase(it);
  // Like cudaFree, freeing a segment synchronizes the device: every event recorded so far
  // completes, except those recorded in a capture (nodes of a graph).
  complete_all_locked();
}

std::size_t sim_backend::vm_granularity() {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::vm_granularity)) fail(sim_call::vm_granularity, "injected failure");
  return options_.granularity_bytes;
}

void* sim_backend::va_reserve(std::size_t bytes) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::va_reserve)) return nullptr;  // an injected out-of-memory
  require_capture_safe(sim_call::va_reserve);
  if (options_.granularity_bytes == 0) fail(sim_call::va_reserve, "virtual memory not supported");
  if (bytes == 0 || bytes % options_.granularity_bytes != 0) {
    fail(sim_call::va_reserve,
         fmt::format("size {} is not a positive multiple of {}", bytes, options_.granularity_bytes),
         k_sim_invalid_value);
  }
  const std::uintptr_t addr = take_address(bytes, options_.granularity_bytes);
  if (addr == 0) return nullptr;  // the address space is exhausted
  reservations_.emplace(addr, bytes);
  return reinterpret_cast<void*>(addr);
}

void sim_backend::va_free(void* base, std::size_t bytes) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::va_free)) fail(sim_call::va_free, "injected failure");
  require_capture_safe(sim_call::va_free);
  const auto addr = reinterpret_cast<std::uintptr_t>(base);
  auto it = reservations_.find(addr);
  if (it == reservations_.end() || it->second != bytes) {
    fail(sim_call::va_free, fmt::format("{} (+{}) is not a reservation", base, bytes),
         k_sim_invalid_value);
  }
  auto m = mappings_.lower_bound(addr);
  if (m != mappings_.end() && m->first < addr + bytes) {
    fail(sim_call::va_free, "reservation still has mappings", k_sim_invalid_value);
  }
  give_address(addr, bytes);
  reservations_.erase(it);
}

std::optional<phys_handle> sim_backend::phys_create(std::size_t bytes) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::phys_create)) return std::nullopt;
  require_capture_safe(sim_call::phys_create);
  if (options_.granularity_bytes == 0) fail(sim_call::phys_create, "virtual memory not supported");
  if (bytes == 0 || bytes % options_.granularity_bytes != 0) {
    fail(sim_call::phys_create,
         fmt::format("size {} is not a positive multiple of {}", bytes, options_.granularity_bytes),
         k_sim_invalid_value);
  }
  if (bytes > options_.capacity_bytes - std::min(used_, options_.capacity_bytes)) {
    return std::nullopt;
  }
  handle_rec rec{bytes, 0, nullptr};
  if (options_.host_memory) rec.host = std::make_shared<std::byte[]>(bytes);
  const phys_handle h = next_handle_++;
  handles_.emplace(h, std::move(rec));
  used_ += bytes;
  return h;
}

void sim_backend::phys_release(phys_handle handle) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::phys_release)) fail(sim_call::phys_release, "injected failure");
  require_capture_safe(sim_call::phys_release);
  auto it = handles_.find(handle);
  if (it == handles_.end()) {
    fail(sim_call::phys_release, fmt::format("handle {} is not live", handle), k_sim_invalid_value);
  }
  if (it->second.map_count != 0) {
    fail(sim_call::phys_release, fmt::format("handle {} is still mapped", handle),
         k_sim_invalid_value);
  }
  if (!it->second.imported) used_ -= it->second.bytes;
  drop_export(it->second.export_id);
  handles_.erase(it);
}

void sim_backend::map(void* va, std::size_t bytes, phys_handle handle) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::map)) fail(sim_call::map, "injected failure", 2);
  require_capture_safe(sim_call::map);
  const auto addr = reinterpret_cast<std::uintptr_t>(va);
  auto h = handles_.find(handle);
  if (h == handles_.end()) {
    fail(sim_call::map, fmt::format("handle {} is not live", handle), k_sim_invalid_value);
  }
  if (h->second.bytes != bytes) {
    fail(sim_call::map, fmt::format("size {} differs from handle size {}", bytes, h->second.bytes),
         k_sim_invalid_value);
  }
  // The range must lie inside one reservation and overlap no mapping.
  auto r = reservations_.upper_bound(addr);
  if (r == reservations_.begin() || (--r, addr + bytes > r->first + r->second)) {
    fail(sim_call::map, fmt::format("{} (+{}) is outside any reservation", va, bytes),
         k_sim_invalid_value);
  }
  auto m = mappings_.upper_bound(addr);
  if (m != mappings_.end() && m->first < addr + bytes) {
    fail(sim_call::map, fmt::format("{} (+{}) overlaps a mapping", va, bytes), k_sim_invalid_value);
  }
  if (m != mappings_.begin()) {
    auto p = std::prev(m);
    if (p->first + p->second.bytes > addr) {
      fail(sim_call::map, fmt::format("{} (+{}) overlaps a mapping", va, bytes),
           k_sim_invalid_value);
    }
  }
  mappings_.emplace(addr, mapping_rec{bytes, handle, 0});
  ++h->second.map_count;
}

void sim_backend::unmap(void* va, std::size_t bytes) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::unmap)) fail(sim_call::unmap, "injected failure");
  require_capture_safe(sim_call::unmap);
  const auto addr = reinterpret_cast<std::uintptr_t>(va);
  auto m = mappings_.find(addr);
  if (m == mappings_.end() || m->second.bytes != bytes) {
    fail(sim_call::unmap, fmt::format("{} (+{}) is not exactly one mapping", va, bytes),
         k_sim_invalid_value);
  }
  --handles_.at(m->second.handle).map_count;
  mappings_.erase(m);
}

void sim_backend::set_access(void* va, std::size_t bytes) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::set_access)) fail(sim_call::set_access, "injected failure");
  require_capture_safe(sim_call::set_access);
  const auto addr = reinterpret_cast<std::uintptr_t>(va);
  // The driver's rule (cuMemSetAccess): the range must be fully mapped and made of whole
  // mappings -- it may span several adjacent ones, but neither begin nor end inside one. Nothing
  // changes when the range is refused. Granted to this device and its access devices (peer_access).
  std::uint64_t access = std::uint64_t{1} << options_.device;
  for (const int d : access_devices_) access |= std::uint64_t{1} << d;
  auto m = mappings_.find(addr);
  std::uintptr_t cursor = addr;
  for (auto it = m; it != mappings_.end() && it->first == cursor && cursor < addr + bytes; ++it) {
    cursor = it->first + it->second.bytes;
  }
  if (bytes == 0 || m == mappings_.end() || cursor != addr + bytes) {
    fail(sim_call::set_access,
         fmt::format("{} (+{}) is not a fully mapped range of whole mappings", va, bytes),
         k_sim_invalid_value);
  }
  for (; m != mappings_.end() && m->first < addr + bytes; ++m) m->second.access = access;
}

void sim_backend::configure_peer_access(peer_access_mode mode) {
  std::lock_guard lock(mu_);
  std::vector<int> devices{options_.device};
  if (mode != peer_access_mode::none) {
    for (int d = 0; d < options_.device_count && d < k_max_devices; ++d) {
      if (d == options_.device) continue;
      const bool can = ((options_.peer_mask >> d) & 1U) != 0;
      if (can) {
        devices.push_back(d);
      } else if (mode == peer_access_mode::all) {
        throw cuda_error("sim configure_peer_access", k_sim_peer_unsupported,
                         fmt::format("peer_access:all: device {} cannot access device {} "
                                     "(cudaDeviceCanAccessPeer is 0); use peer_access:auto",
                                     d, options_.device));
      }
    }
  }
  access_devices_ = std::move(devices);
}

std::vector<int> sim_backend::access_devices() {
  std::lock_guard lock(mu_);
  if (access_devices_.empty()) return {options_.device};
  return access_devices_;
}

void sim_backend::enable_phys_export() {
  std::lock_guard lock(mu_);
  if (options_.granularity_bytes == 0) {
    throw cuda_error("sim enable_phys_export", k_sim_not_supported,
                     fmt::format("device {} has no virtual memory management, so no physical "
                                 "handle to export",
                                 options_.device));
  }
  phys_export_ = true;
}

segment_ipc_handle sim_backend::segment_export(void* base) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::segment_export)) fail(sim_call::segment_export, "injected failure");
  auto it = segments_.find(reinterpret_cast<std::uintptr_t>(base));
  if (it == segments_.end()) {
    fail(sim_call::segment_export, fmt::format("{} is not the base of a live segment", base),
         k_sim_invalid_value);
  }
  // As the driver, the same handle every time for one allocation.
  if (it->second.export_id == 0) {
    it->second.export_id = add_export({it->second.host, it->second.bytes, options_.device});
  }
  const sim_ipc_record rec{k_sim_ipc_magic, it->second.export_id, it->second.bytes,
                           options_.device};
  segment_ipc_handle h;
  std::memcpy(h.bytes, &rec, sizeof(rec));
  return h;
}

void* sim_backend::segment_import(const segment_ipc_handle& handle) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::segment_import)) fail(sim_call::segment_import, "injected failure");
  sim_ipc_record rec{};
  std::memcpy(&rec, handle.bytes, sizeof(rec));
  if (rec.magic != k_sim_ipc_magic) {
    fail(sim_call::segment_import, "not a segment handle of the simulated device",
         k_sim_invalid_resource_handle);
  }
  const std::optional<sim_export> e = find_export(rec.id);
  if (!e) {
    fail(sim_call::segment_import,
         "the handle's segment was freed by its exporter (the handle names no memory)",
         k_sim_invalid_resource_handle);
  }
  const std::uintptr_t addr = take_address(e->bytes, options_.malloc_page_bytes);
  if (addr == 0) fail(sim_call::segment_import, "address space exhausted", 2);
  imports_.emplace(addr, import_rec{e->bytes, e->host});
  return reinterpret_cast<void*>(addr);
}

void sim_backend::segment_close(void* base) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::segment_close)) fail(sim_call::segment_close, "injected failure");
  auto it = imports_.find(reinterpret_cast<std::uintptr_t>(base));
  if (it == imports_.end()) {
    fail(sim_call::segment_close, fmt::format("{} is not an open imported segment", base),
         k_sim_invalid_value);
  }
  give_address(it->first, it->second.bytes);
  imports_.erase(it);
}

int sim_backend::phys_export_fd(phys_handle handle) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::phys_export_fd)) fail(sim_call::phys_export_fd, "injected failure");
  auto it = handles_.find(handle);
  if (it == handles_.end()) {
    fail(sim_call::phys_export_fd, fmt::format("handle {} is not live", handle),
         k_sim_invalid_value);
  }
  if (!phys_export_) {
    fail(sim_call::phys_export_fd,
         fmt::format("handle {} was not created exportable (enable_phys_export)", handle),
         k_sim_not_supported);
  }
  if (it->second.export_id == 0) {
    it->second.export_id = add_export({it->second.host, it->second.bytes, options_.device});
  }
  const int fd = ::memfd_create("cucache-sim-phys", MFD_CLOEXEC);
  if (fd < 0) fail(sim_call::phys_export_fd, fmt::format("memfd_create: {}", std::strerror(errno)));
  const sim_ipc_record rec{k_sim_ipc_magic, it->second.export_id, it->second.bytes,
                           options_.device};
  if (::pwrite(fd, &rec, sizeof(rec), 0) != static_cast<ssize_t>(sizeof(rec))) {
    ::close(fd);
    fail(sim_call::phys_export_fd, "cannot write the descriptor's record");
  }
  return fd;
}

phys_handle sim_backend::phys_import_fd(int fd) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::phys_import_fd)) fail(sim_call::phys_import_fd, "injected failure");
  sim_ipc_record rec{};
  if (::pread(fd, &rec, sizeof(rec), 0) != static_cast<ssize_t>(sizeof(rec)) ||
      rec.magic != k_sim_ipc_magic) {
    fail(
        sim_call::phys_import_fd,
        fmt::format("file descriptor {} is not one of the simulated device's exported handles", fd),
        k_sim_invalid_value);
  }
  const std::optional<sim_export> e = find_export(rec.id);
  if (!e) {
    fail(sim_call::phys_import_fd, "the exporter released the handle the descriptor names",
         k_sim_invalid_resource_handle);
  }
  handle_rec h{e->bytes, 0, e->host};
  h.imported = true;
  const phys_handle id = next_handle_++;
  handles_.emplace(id, std::move(h));
  return id;
}

event_handle sim_backend::event_create() {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::event_create)) fail(sim_call::event_create, "injected failure", 2);
  const std::uintptr_t id = next_event_;
  next_event_ += 0x10;
  events_.emplace(id, event_rec{});
  return reinterpret_cast<event_handle>(id);
}

void sim_backend::event_destroy(event_handle event) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::event_destroy)) fail(sim_call::event_destroy, "injected failure");
  const auto id = reinterpret_cast<std::uintptr_t>(event);
  auto it = events_.find(id);
  if (it == events_.end()) fail(sim_call::event_destroy, "unknown event", k_sim_invalid_value);
  forget_pending(id, it->second);
  events_.erase(it);
}

void sim_backend::event_record(event_handle event, stream_handle stream) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::event_record)) fail(sim_call::event_record, "injected failure");
  auto it = events_.find(reinterpret_cast<std::uintptr_t>(event));
  if (it == events_.end()) fail(sim_call::event_record, "unknown event", k_sim_invalid_value);
  require_live_stream(sim_call::event_record, stream);
  // Recorded on a capturing stream, the event becomes a node of the graph: it never completes by
  // itself, and querying it is illegal.
  const bool captured = stream != nullptr && captures_.contains(stream);
  const event_rec rec{true, options_.events_complete_immediately && !captured, captured,
                      id_of_locked(stream)};
  // Indexed first (may throw bad_alloc, changing nothing the sim answers: at worst an empty set),
  // then the old record forgotten unless it is this very entry.
  if (is_pending(rec)) pending_by_stream_[rec.stream].insert(it->first);
  if (!is_pending(rec) || it->second.stream != rec.stream) forget_pending(it->first, it->second);
  it->second = rec;
}

bool sim_backend::event_query(event_handle event) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::event_query)) fail(sim_call::event_query, "injected failure");
  auto it = events_.find(reinterpret_cast<std::uintptr_t>(event));
  if (it == events_.end()) fail(sim_call::event_query, "unknown event", k_sim_invalid_value);
  if (it->second.captured) {
    capture_violation(sim_call::event_query, "the event was recorded in a capture");
  }
  require_capture_safe(sim_call::event_query);
  return it->second.complete;
}

void sim_backend::event_synchronize(event_handle event) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::event_synchronize)) {
    fail(sim_call::event_synchronize, "injected failure");
  }
  auto it = events_.find(reinterpret_cast<std::uintptr_t>(event));
  if (it == events_.end()) fail(sim_call::event_synchronize, "unknown event", k_sim_invalid_value);
  if (it->second.captured) {
    capture_violation(sim_call::event_synchronize, "the event was recorded in a capture");
  }
  require_capture_safe(sim_call::event_synchronize);
  forget_pending(it->first, it->second);
  it->second.complete = true;
}

void sim_backend::stream_synchronize(stream_handle stream) {
  {
    std::lock_guard lock(mu_);
    if (should_fail(sim_call::stream_synchronize)) {
      fail(sim_call::stream_synchronize, "injected failure");
    }
    require_live_stream(sim_call::stream_synchronize, stream);
    if (auto c = captures_.find(stream); c != captures_.end()) {
      c->second.invalidated = true;
      capture_violation(
          sim_call::stream_synchronize,
          fmt::format("the stream captures (capture {} is invalidated)", c->second.id));
    }
    require_capture_safe(sim_call::stream_synchronize);
  }
  complete_stream(stream);
}

void sim_backend::device_synchronize() {
  {
    std::lock_guard lock(mu_);
    if (should_fail(sim_call::device_synchronize)) {
      fail(sim_call::device_synchronize, "injected failure");
    }
    require_no_capture(sim_call::device_synchronize);
  }
  complete_all();
}

memory_info sim_backend::mem_get_info() {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::mem_get_info)) fail(sim_call::mem_get_info, "injected failure");
  require_capture_safe(sim_call::mem_get_info);
  const std::size_t used = std::min(used_, options_.capacity_bytes);
  return memory_info{options_.capacity_bytes - used, options_.capacity_bytes};
}

stream_handle sim_backend::create_stream() {
  std::lock_guard lock(mu_);
  stream_handle s = nullptr;
  if (options_.reuse_stream_handles && !reusable_handles_.empty()) {
    s = reusable_handles_.back();
    reusable_handles_.pop_back();
    destroyed_streams_.erase(s);
  } else {
    const std::uintptr_t v = next_stream_.load(std::memory_order_relaxed);
    s = reinterpret_cast<stream_handle>(v);
    next_stream_.store(v + k_stream_stride, std::memory_order_release);
  }
  live_streams_.emplace(s, next_stream_id_++);
  return s;
}

void sim_backend::destroy_stream(stream_handle stream) {
  std::lock_guard lock(mu_);
  auto it = live_streams_.find(stream);
  if (it == live_streams_.end()) {
    throw cuda_error(
        "sim destroy_stream", k_sim_invalid_resource_handle,
        fmt::format("stream {} {}", static_cast<const void*>(stream),
                    destroyed_streams_.contains(stream) ? "has been destroyed already"
                                                        : "was not created by this device"));
  }
  if (captures_.contains(stream)) {
    throw cuda_error("sim destroy_stream", k_sim_capture_unsupported,
                     fmt::format("stream {} captures", static_cast<const void*>(stream)));
  }
  destroyed_streams_.emplace(stream, it->second);
  live_streams_.erase(it);
  reusable_handles_.push_back(stream);
}

std::uint64_t sim_backend::stream_id(stream_handle stream) {
  const auto v = reinterpret_cast<std::uintptr_t>(stream);
  // Handles the sim never created need no lookup (the benchmarks' and most tests' streams), and
  // have the id (1 << 62) | value -- unless a capture might be asked about.
  const bool created = v >= k_stream_base && v < next_stream_.load(std::memory_order_acquire);
  const std::uint64_t fake = is_legacy_stream(stream) ? k_sim_legacy_stream_id : k_fake_stream_id_tag | v;
  if (!created && capturing_.load(std::memory_order_acquire) == 0 &&
      query_fast(sim_call::stream_id)) {
    return fake;
  }
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::stream_id)) fail(sim_call::stream_id, "injected failure");
  // As on the H200 (driver 580): cudaStreamGetId of a stream being captured is refused in every
  // capture mode, relaxed included, from any thread, and the refusal invalidates the capture.
  if (auto it = captures_.find(stream); it != captures_.end()) {
    it->second.invalidated = true;
    capture_violation(sim_call::stream_id,
                      fmt::format("cudaStreamGetId of stream {} while it is being captured "
                                  "(capture {} is invalidated)",
                                  fmt::ptr(stream), it->second.id));
  }
  if (!created) return fake;
  require_live_stream(sim_call::stream_id, stream);
  return id_of_locked(stream);
}

capture_info sim_backend::capture_status(stream_handle stream) {
  const auto v = reinterpret_cast<std::uintptr_t>(stream);
  const bool created = v >= k_stream_base && v < next_stream_.load(std::memory_order_acquire);
  if (!created && capturing_.load(std::memory_order_acquire) == 0 &&
      query_fast(sim_call::capture_status)) {
    return {};
  }
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::capture_status)) fail(sim_call::capture_status, "injected failure");
  require_live_stream(sim_call::capture_status, stream);
  auto it = !is_legacy_stream(stream) ? captures_.find(stream) : captures_.end();
  if (it == captures_.end()) return {};
  return {it->second.invalidated ? capture_state::invalidated : capture_state::active,
          it->second.id};
}

stream_identity sim_backend::identify(stream_handle stream) {
  // cuda_backend's rule (backend.hpp, identify), with the same queries counted: the legacy
  // stream none (it cannot be captured -- begin_capture refuses it as the runtime does -- nor
  // destroyed: its id is constant), cudaStreamPerThread the capture query and, once per thread,
  // the id; any other stream both.
  const auto v = reinterpret_cast<std::uintptr_t>(stream);
  const bool created = v >= k_stream_base && v < next_stream_.load(std::memory_order_acquire);
  if (!created && !is_special_stream(stream) && capturing_.load(std::memory_order_acquire) == 0 &&
      query_fast(sim_call::capture_status) && query_fast(sim_call::stream_id)) {
    return {{}, k_fake_stream_id_tag | v};
  }
  if (is_special_stream(stream)) [[unlikely]]
    return identify_special(stream);
  return device_backend::identify(stream);
}

stream_identity sim_backend::identify_special(stream_handle stream) {
  if (is_legacy_stream(stream)) return {{}, k_sim_legacy_stream_id};
  const capture_info capture = capture_status(stream);
  if (capture.state != capture_state::none) return {capture, 0};
  per_thread_id_entry& kept = t_per_thread_id;
  if (kept.serial != serial_) [[unlikely]]
    kept = {serial_, stream_id(stream)};
  return {capture, kept.id};
}

capture_mode sim_backend::exchange_capture_mode(capture_mode mode) {
  if (!query_fast(sim_call::exchange_capture_mode)) {
    std::lock_guard lock(mu_);
    if (should_fail(sim_call::exchange_capture_mode)) {
      fail(sim_call::exchange_capture_mode, "injected failure");
    }
  }
  return std::exchange(t_capture_mode, mode);
}

std::uint64_t sim_backend::begin_capture(stream_handle stream, capture_mode mode) {
  std::lock_guard lock(mu_);
  // "Capture may not be initiated if stream is cudaStreamLegacy" (CUDA Runtime API reference,
  // cudaStreamBeginCapture), whichever handle names it: nullptr or cudaStreamLegacy (0x1). The
  // reference lists cudaErrorInvalidValue among the call's errors and names no code for this
  // case; the sim answers that one.
  if (is_legacy_stream(stream)) {
    throw cuda_error("sim begin_capture", k_sim_invalid_value,
                     "the legacy default stream cannot be captured");
  }
  if (destroyed_streams_.contains(stream)) {
    throw cuda_error("sim begin_capture", k_sim_invalid_resource_handle,
                     fmt::format("stream {} has been destroyed", static_cast<void*>(stream)));
  }
  if (captures_.contains(stream)) {
    throw cuda_error("sim begin_capture", k_sim_capture_unsupported,
                     fmt::format("stream {} captures already", static_cast<void*>(stream)));
  }
  const std::uint64_t id = next_capture_id_++;
  captures_.emplace(stream, capture_rec{id, mode, std::this_thread::get_id(), false});
  capturing_.store(captures_.size(), std::memory_order_release);
  return id;
}

std::uint64_t sim_backend::end_capture(stream_handle stream) {
  std::lock_guard lock(mu_);
  auto it = captures_.find(stream);
  if (it == captures_.end()) {
    throw cuda_error("sim end_capture", k_sim_invalid_value,
                     fmt::format("stream {} does not capture", static_cast<void*>(stream)));
  }
  const capture_rec c = it->second;
  if (c.mode != capture_mode::relaxed && c.thread != std::this_thread::get_id()) {
    throw cuda_error("sim end_capture", k_sim_capture_wrong_thread,
                     fmt::format("capture {} was begun on another thread", c.id));
  }
  captures_.erase(it);
  capturing_.store(captures_.size(), std::memory_order_release);
  if (c.invalidated) {
    throw cuda_error("sim end_capture", k_sim_capture_invalidated,
                     fmt::format("capture {} was invalidated by an illegal call", c.id));
  }
  return c.id;
}

std::uint64_t sim_backend::capture_violations() const {
  std::lock_guard lock(mu_);
  return capture_violations_;
}

std::size_t sim_backend::active_captures() const {
  std::lock_guard lock(mu_);
  return captures_.size();
}

bool sim_backend::stream_destroyed(stream_handle stream) const {
  std::lock_guard lock(mu_);
  return destroyed_streams_.contains(stream);
}

std::uint64_t sim_backend::destroyed_stream_calls() const {
  std::lock_guard lock(mu_);
  return destroyed_stream_calls_;
}

void sim_backend::complete_stream(stream_handle stream) {
  std::uint64_t id = 0;
  {
    std::lock_guard lock(mu_);
    id = id_of_locked(stream);
  }
  complete_stream_id(id);
}

void sim_backend::complete_stream_id(std::uint64_t id) {
  std::lock_guard lock(mu_);
  auto it = pending_by_stream_.find(id);
  if (it == pending_by_stream_.end()) return;
  complete_pending(it->second);
  pending_by_stream_.erase(it);
}

void sim_backend::complete_all() {
  std::lock_guard lock(mu_);
  complete_all_locked();
}

void sim_backend::forget_pending(std::uintptr_t id, const event_rec& ev) noexcept {
  if (!is_pending(ev)) return;
  auto it = pending_by_stream_.find(ev.stream);
  if (it == pending_by_stream_.end()) return;
  it->second.erase(id);
  if (it->second.empty()) pending_by_stream_.erase(it);
}

void sim_backend::complete_pending(std::unordered_set<std::uintptr_t>& ids) noexcept {
  for (const std::uintptr_t id : ids) {
    ++event_visits_;
    events_.find(id)->second.complete = true;  // indexed events exist: destroy forgets them
  }
  ids.clear();
}

void sim_backend::complete_all_locked() noexcept {
  for (auto& [stream, ids] : pending_by_stream_) complete_pending(ids);
  pending_by_stream_.clear();
}

std::uint64_t sim_backend::event_visits() const {
  std::lock_guard lock(mu_);
  return event_visits_;
}

std::size_t sim_backend::pending_events() const {
  std::lock_guard lock(mu_);
  return static_cast<std::size_t>(std::count_if(events_.begin(), events_.end(),
                                                [](const auto& e) { return !e.second.complete; }));
}

void sim_backend::fail_nth(sim_call kind, std::uint64_t n) {
  std::lock_guard lock(mu_);
  if (n != 0 && (kind == sim_call::stream_id || kind == sim_call::capture_status ||
                 kind == sim_call::exchange_capture_mode)) {
    query_faults_.store(true, std::memory_order_release);
  }
  const auto k = static_cast<std::size_t>(kind);
  fail_at_[k] = n == 0 ? 0 : calls_[k].load(std::memory_order_relaxed) + n;
}

void sim_backend::fail_always(sim_call kind, bool enabled) {
  std::lock_guard lock(mu_);
  if (enabled && (kind == sim_call::stream_id || kind == sim_call::capture_status ||
                  kind == sim_call::exchange_capture_mode)) {
    query_faults_.store(true, std::memory_order_release);
  }
  fail_always_[static_cast<std::size_t>(kind)] = enabled;
}

void sim_backend::set_capacity(std::size_t bytes) {
  std::lock_guard lock(mu_);
  options_.capacity_bytes = bytes;
}

std::uint64_t sim_backend::calls(sim_call kind) const {
  return calls_[static_cast<std::size_t>(kind)].load(std::memory_order_relaxed);
}

std::size_t sim_backend::used_bytes() const {
  std::lock_guard lock(mu_);
  return used_;
}
std::size_t sim_backend::live_segments() const {
  std::lock_guard lock(mu_);
  return segments_.size();
}
std::size_t sim_backend::live_handles() const {
  std::lock_guard lock(mu_);
  return handles_.size();
}
std::size_t sim_backend::live_reservations() const {
  std::lock_guard lock(mu_);
  return reservations_.size();
}
std::size_t sim_backend::live_mappings() const {
  std::lock_guard lock(mu_);
  return mappings_.size();
}
std::size_t sim_backend::inaccessible_mappings() const {
  std::lock_guard lock(mu_);
  return static_cast<std::size_t>(std::count_if(
      mappings_.begin(), mappings_.end(), [](const auto& m) { return m.second.access == 0; }));
}
bool sim_backend::accessible(const void* va, std::size_t bytes) const {
  std::lock_guard lock(mu_);
  const auto addr = reinterpret_cast<std::uintptr_t>(va);
  auto m = mappings_.upper_bound(addr);
  if (m == mappings_.begin()) return false;
  --m;
  std::uintptr_t cursor = addr;
  for (; m != mappings_.end() && cursor < addr + bytes; ++m) {
    if (m->first > cursor || m->first + m->second.bytes <= cursor || m->second.access == 0) {
      return false;
    }
    cursor = m->first + m->second.bytes;
  }
  return cursor >= addr + bytes;
}

std::size_t sim_backend::live_imports() const {
  std::lock_guard lock(mu_);
  return imports_.size();
}

bool sim_backend::device_can_access(int device, const void* ptr, std::size_t bytes) const {
  std::lock_guard lock(mu_);
  if (device < 0 || device >= k_max_devices || bytes == 0) return false;
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  const auto within = [&](const auto& map) {
    auto it = map.upper_bound(addr);
    if (it == map.begin()) return false;
    --it;
    return addr + bytes <= it->first + it->second.bytes;
  };
  if (within(segments_) || within(imports_)) return device == options_.device;
  // Mappings: every byte covered, each by a mapping granted to `device`.
  std::uintptr_t cursor = addr;
  auto m = mappings_.upper_bound(addr);
  if (m != mappings_.begin()) --m;
  for (; m != mappings_.end() && m->first < addr + bytes; ++m) {
    if (m->first + m->second.bytes <= cursor) continue;
    if (m->first > cursor) break;
    if (((m->second.access >> device) & 1U) == 0) return false;
    cursor = m->first + m->second.bytes;
  }
  return cursor >= addr + bytes;
}

// --- host copies ---------------------------------------------------------------------------------

void* sim_backend::host_alloc_pinned(std::size_t bytes) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::host_alloc_pinned)) return nullptr;  // out of pinnable host memory
  require_capture_safe(sim_call::host_alloc_pinned);
  if (bytes > options_.pinned_capacity_bytes - pinned_bytes_) return nullptr;  // as the driver
  void* p = std::malloc(std::max<std::size_t>(bytes, 1));
  if (p == nullptr) return nullptr;
  pinned_.emplace(reinterpret_cast<std::uintptr_t>(p), bytes);
  pinned_bytes_ += bytes;
  return p;
}

std::size_t sim_backend::pinned_bytes() const {
  std::lock_guard lock(mu_);
  return pinned_bytes_;
}

std::size_t sim_backend::live_pinned() const {
  std::lock_guard lock(mu_);
  return pinned_.size();
}

void sim_backend::host_free_pinned(void* ptr) {
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::host_free_pinned)) fail(sim_call::host_free_pinned, "injected failure");
  require_capture_safe(sim_call::host_free_pinned);
  auto it = pinned_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == pinned_.end()) {
    fail(sim_call::host_free_pinned, fmt::format("{} is not pinned host memory", ptr),
         k_sim_invalid_value);
  }
  pinned_bytes_ -= it->second;
  pinned_.erase(it);
  std::free(ptr);
}

void sim_backend::copy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream) {
  // The runtime's rules as far as the sim sees them: the stream alive and not capturing a copy it
  // cannot capture (the sim refuses copies on capturing streams outright); one side pinned host
  // memory of host_alloc_pinned, the other device memory of this device that is mapped with
  // access (or one segment) over the whole span. Nothing is copied when anything is refused.
  // Copies complete at once (the sim's device is never busy with them).
  std::lock_guard lock(mu_);
  if (should_fail(sim_call::copy_async)) fail(sim_call::copy_async, "injected failure");
  if (stream != nullptr) require_live_stream(sim_call::copy_async, stream);
  if (stream != nullptr && captures_.contains(stream)) {
    capture_violation(sim_call::copy_async, "the stream captures");
  }
  const auto in_pinned = [&](std::uintptr_t a) {
    auto it = pinned_.upper_bound(a);
    if (it == pinned_.begin()) return false;
    --it;
    return a >= it->first && bytes <= it->second && a - it->first <= it->second - bytes;
  };
  const auto d = reinterpret_cast<std::uintptr_t>(dst);
  const auto s = reinterpret_cast<std::uintptr_t>(src);
  const bool to_host = in_pinned(d);
  const bool from_host = in_pinned(s);
  if (to_host == from_host) {
    fail(sim_call::copy_async,
         fmt::format("{} -> {} (+{}): exactly one side must be pinned host memory", src, dst,
                     bytes),
         k_sim_invalid_value);
  }
  const std::uintptr_t dev = to_host ? s : d;
  // The device span, piece by piece: host memory behind each (null without host_memory).
  std::vector<std::pair<std::byte*, std::size_t>> pieces;
  const std::uint64_t me = std::uint64_t{1} << options_.device;
  for (std::uintptr_t cursor = dev; cursor < dev + bytes;) {
    const std::size_t left = dev + bytes - cursor;
    auto sg = segments_.upper_bound(cursor);
    if (sg != segments_.begin() && (--sg, cursor < sg->first + sg->second.bytes)) {
      const std::size_t n = std::min(left, sg->first + sg->second.bytes - cursor);
      pieces.emplace_back(sg->second.host ? sg->second.host.get() + (cursor - sg->first) : nullptr,
                          n);
      cursor += n;
      continue;
    }
    auto m = mappings_.upper_bound(cursor);
    if (m != mappings_.begin() && (--m, cursor < m->first + m->second.bytes) &&
        (m->second.access & me) != 0) {
      const std::size_t n = std::min(left, m->first + m->second.bytes - cursor);
      const handle_rec& h = handles_.at(m->second.handle);
      pieces.emplace_back(h.host ? h.host.get() + (cursor - m->first) : nullptr, n);
      cursor += n;
      continue;
    }
    fail(sim_call::copy_async,
         fmt::format("{:#x} (+{}) of the copy is not device memory this device may access",
                     cursor, left),
         700);  // cudaErrorIllegalAddress
  }
  if (!options_.host_memory) return;
  auto* host = reinterpret_cast<std::byte*>(to_host ? d : s);
  for (const auto& [view, n] : pieces) {
    if (view != nullptr) {
      if (to_host) {
        std::memcpy(host, view, n);
      } else {
        std::memcpy(view, host, n);
      }
    }
    host += n;
  }
}

std::byte* sim_backend::host_view(const void* dev_ptr, std::size_t bytes) {
  std::lock_guard lock(mu_);
  if (!options_.host_memory) return nullptr;
  const auto addr = reinterpret_cast<std::uintptr_t>(dev_ptr);
  auto s = segments_.upper_bound(addr);
  if (s != segments_.begin()) {
    --s;
    if (addr + bytes <= s->first + s->second.bytes) return s->second.host.get() + (addr - s->first);
  }
  auto m = mappings_.upper_bound(addr);
  if (m != mappings_.begin()) {
    --m;
    if (addr + bytes <= m->first + m->second.bytes) {
      return handles_.at(m->second.handle).host.get() + (addr - m->first);
    }
  }
  auto i = imports_.upper_bound(addr);
  if (i != imports_.begin()) {
    --i;
    if (addr + bytes <= i->first + i->second.bytes && i->second.host) {
      return i->second.host.get() + (addr - i->first);
    }
  }
  return nullptr;
}

}  // namespace cucache
