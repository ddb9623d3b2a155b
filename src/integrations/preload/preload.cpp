// The routing of libcucache_preload.so (preload.hpp).
#include "preload.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string>
#include <map>
#include <string_view>
#include <thread>
#include <utility>

#include <unistd.h>

#include "api/registry.hpp"
#include "cucache/cucache.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/errors.hpp"
#include "cucache/stats.hpp"

namespace cucache::preload {

using detail::registry;
using detail::release_kind;

namespace {

void say(std::string_view message) noexcept {
  std::fprintf(stderr, "cucache preload: %.*s\n", static_cast<int>(message.size()), message.data());
}

// Inside a catch block: the driver's code for the exception in flight, its text on stderr.
cu_result fail(const char* function) noexcept {
  const int code = detail::error_code_of_current_exception(function);
  say(detail::thread_last_error());
  return driver_code(code);
}

void* as_ptr(cu_deviceptr p) noexcept {
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(p));
}
cu_deviceptr as_dptr(const void* p) noexcept {
  return static_cast<cu_deviceptr>(reinterpret_cast<std::uintptr_t>(p));
}

// The allocator whose memory holds `ptr` and what it says of it; {nullptr, {}} when none does.
struct located {
  device_allocator* owner = nullptr;
  device_allocator::address_info info;
};
located locate(const void* ptr) noexcept {
  registry* r = registry::if_built();
  if (r == nullptr) return {};
  for (int d = 0; d < r->device_count(); ++d) {
    device_allocator* a = r->find(d);
    if (a == nullptr) continue;
    try {
      const auto info = a->locate(ptr);
      if (info.in_segment) return {a, info};
    } catch (...) {
      // locate only takes locks; nothing to report
    }
  }
  return {};
}

// Whether `ptr` starts a live cucache allocation (a pointer-map lookup, no pool lock).
bool is_live_start(const registry& r, const void* ptr) noexcept {
  for (int d = 0; d < r.device_count(); ++d) {
    const device_allocator* a = r.find(d);
    try {
      if (a != nullptr && a->allocation_size(ptr) != 0) return true;
    } catch (...) {
    }
  }
  return false;
}

// A two-valued environment setting as the routing uses it, read once: `slot` holds 0 (not read
// yet), 1 (announced) or 2 (query). `read` parses the variable (environment_error for a bad
// value, which is named on stderr with `fallback`, and query is used).
template <class Mode, class Read>
Mode routing_mode(std::atomic<int>& slot, Read read, const char* fallback) noexcept {
  int m = slot.load(std::memory_order_acquire);
  if (m == 0) {
    Mode got = Mode::query;
    try {
      got = read();
    } catch (const std::exception& e) {
      say(fmt::format("{}; using query ({})", e.what(), fallback));
    }
    int expected = 0;
    slot.compare_exchange_strong(expected, got == Mode::announced ? 1 : 2,
                                 std::memory_order_acq_rel);
    m = slot.load(std::memory_order_acquire);
  }
  return m == 1 ? Mode::announced : Mode::query;
}

std::atomic<int> g_captures_mode{0};  // CUCACHE_PRELOAD_CAPTURES (routing_mode)
std::atomic<int> g_streams_mode{0};   // CUCACHE_PRELOAD_STREAMS (routing_mode)

captures_mode routing_captures_mode() noexcept {
  return routing_mode<captures_mode>(g_captures_mode, captures_mode_from_env,
                                     "every allocation asks the capture status");
}

streams_mode routing_streams_mode() noexcept {
  return routing_mode<streams_mode>(g_streams_mode, streams_mode_from_env,
                                    "every allocation on a created stream asks its id");
}

// The registry whose allocators were told the captures and streams modes (the registry is
// rebuilt by tests).
std::atomic<const registry*> g_armed_registry{nullptr};

// Tells `r` the captures and streams modes once: in the announced mode every capture of the
// process passes through this shim's begin and end (both the runtime's and a direct caller's
// reach the driver's entry points that the shim replaces), so the allocators may skip the capture
// query; every stream destruction passes through this shim's cuStreamDestroy the same way, so
// with CUCACHE_PRELOAD_STREAMS=announced they may also cache a stream's id. The id cache rests on
// the captures-announced mode (a cached id is not asked again, and the id query is that mode's
// failure rule), so it is never turned on without it.
void arm_captures(registry& r) {
  if (g_armed_registry.load(std::memory_order_acquire) == &r) return;
  const bool captures = routing_captures_mode() == captures_mode::announced;
  r.set_captures_announced(captures);
  r.set_stream_destructions_announced(captures &&
                                      routing_streams_mode() == streams_mode::announced);
  g_armed_registry.store(&r, std::memory_order_release);
}

device_allocator& current_allocator() {
  registry& r = registry::instance();
  arm_exit_report();
  arm_captures(r);
  return r.allocator(r.current_device());
}

cu_result allocate(cu_deviceptr* dptr, std::size_t bytes, cu_stream stream,
                   const char* function) noexcept {
  if (dptr == nullptr) return k_invalid_value;
  *dptr = 0;
  // The driver refuses a zero-byte allocation; cucache's 0 -> nullptr would read as success.
  if (bytes == 0) return k_invalid_value;
  try {
    void* p = current_allocator().allocate(bytes, stream);
    *dptr = as_dptr(p);
    stats().allocations.fetch_add(1, std::memory_order_relaxed);
    return k_success;
  } catch (...) {
    return fail(function);
  }
}

// In a child forked after the parent used cucache, every pointer the program frees may be the
// parent's (docs/design.md, "Fork and process exit"): none reaches the driver, which would act on
// the parent's memory, and the call fails as the C API's does. k_success in any other process.
cu_result refuse_if_forked(const char* function) noexcept {
  if (!registry::forked_child()) [[likely]]
    return k_success;
  try {
    registry::require_not_forked();
  } catch (...) {
    return fail(function);
  }
  return k_not_initialized;
}

// Refuses a call on cucache memory that would give the caller a segment's view instead of its
// allocation's (IPC handles). k_success when `ptr` is not cucache's.
cu_result refuse_if_ours(cu_deviceptr dptr, const char* function, const char* why) noexcept {
  const located l = locate(as_ptr(dptr));
  if (l.owner == nullptr) return k_success;
  stats().refused.fetch_add(1, std::memory_order_relaxed);
  try {
    say(fmt::format(
        "{}({:#x}) refused (CUDA_ERROR_NOT_SUPPORTED): the address is cucache memory (block at "
        "{:#x}, {} bytes, {}), a part of a larger segment, so {}. Run this program without "
        "LD_PRELOAD=libcucache_preload.so, or allocate this buffer outside it (docs/preload.md).",
        function, dptr, l.info.block, l.info.block_size, l.info.live ? "live" : "free", why));
    detail::set_last_error(fmt::format("{}: refused on cucache memory", function));
  } catch (...) {
  }
  return k_not_supported;
}

}  // namespace

counters& stats() noexcept {
  static counters c;
  return c;
}

captures_mode captures_mode_from_env() {
  const char* env = std::getenv("CUCACHE_PRELOAD_CAPTURES");
  if (env == nullptr || *env == '\0' || std::string_view(env) == "announced") {
    return captures_mode::announced;
  }
  if (std::string_view(env) == "query") return captures_mode::query;
  throw environment_error(fmt::format(
      "environment variable CUCACHE_PRELOAD_CAPTURES: '{}' is neither announced nor query", env));
}

void set_captures_mode(captures_mode mode) noexcept {
  g_captures_mode.store(mode == captures_mode::announced ? 1 : 2, std::memory_order_release);
  g_armed_registry.store(nullptr, std::memory_order_release);
}

streams_mode streams_mode_from_env() {
  const char* env = std::getenv("CUCACHE_PRELOAD_STREAMS");
  if (env == nullptr || *env == '\0' || std::string_view(env) == "query") {
    return streams_mode::query;
  }
  if (std::string_view(env) == "announced") return streams_mode::announced;
  throw environment_error(fmt::format(
      "environment variable CUCACHE_PRELOAD_STREAMS: '{}' is neither announced nor query", env));
}

void set_streams_mode(streams_mode mode) noexcept {
  g_streams_mode.store(mode == streams_mode::announced ? 1 : 2, std::memory_order_release);
  g_armed_registry.store(nullptr, std::memory_order_release);
}

free_mode free_mode_from_env() {
  const char* env = std::getenv("CUCACHE_PRELOAD_FREE");
  if (env == nullptr || *env == '\0' || std::string_view(env) == "sync") return free_mode::sync;
  if (std::string_view(env) == "stream") return free_mode::stream;
  throw environment_error(fmt::format(
      "environment variable CUCACHE_PRELOAD_FREE: '{}' is neither sync nor stream", env));
}

std::size_t pitch_for(std::size_t width) noexcept {
  constexpr std::size_t align = 512;
  return (width + align - 1) / align * align;
}

cu_result driver_code(int runtime_code) noexcept {
  // The runtime's codes that cucache produces and the driver's of the same meaning share values.
  switch (runtime_code) {
    case 0:
    case k_invalid_value:
    case k_out_of_memory:
    case k_not_initialized:
    case k_no_device:
    case k_invalid_device:
      return runtime_code;
    default:
      return k_unknown;
  }
}

cu_result mem_alloc(const real_driver& /*real*/, cu_deviceptr* dptr, std::size_t bytes,
                    cu_stream stream) noexcept {
  return allocate(dptr, bytes, stream, "cuMemAlloc");
}

namespace {
// Whether `pool` is the default memory pool of the device of the calling thread's context. False
// when the driver cannot say (no context, no entry point): the caller then forwards.
bool is_current_default_pool(const real_driver& real, cu_mem_pool pool) noexcept {
  if (pool == nullptr || real.ctx_get_device == nullptr ||
      real.device_get_default_mem_pool == nullptr) {
    return false;
  }
  cu_device device = 0;
  if (real.ctx_get_device(&device) != k_success) return false;
  cu_mem_pool default_pool = nullptr;
  if (real.device_get_default_mem_pool(&default_pool, device) != k_success) return false;
  return pool == default_pool;
}
}  // namespace

cu_result mem_alloc_from_pool_async(const real_driver& real, cu_deviceptr* dptr, std::size_t bytes,
                                    cu_mem_pool pool, cu_stream stream, bool ptsz) noexcept {
  if (is_current_default_pool(real, pool)) {
    const cu_result rc = allocate(dptr, bytes, ptsz && stream == nullptr ? k_stream_per_thread : stream,
                                  "cuMemAllocFromPoolAsync");
    if (rc == k_success) stats().pool_allocations.fetch_add(1, std::memory_order_relaxed);
    return rc;
  }
  stats().forwarded_pool_allocations.fetch_add(1, std::memory_order_relaxed);
  auto fn = ptsz ? real.mem_alloc_from_pool_async_ptsz : real.mem_alloc_from_pool_async;
  return fn != nullptr ? fn(dptr, bytes, pool, stream) : k_not_found;
}

cu_result mem_alloc_pitch(const real_driver& /*real*/, cu_deviceptr* dptr, std::size_t* pitch,
                          std::size_t width, std::size_t height, unsigned int element) noexcept {
  if (dptr == nullptr || pitch == nullptr) return k_invalid_value;
  // The driver's rule: elements of 4, 8 or 16 bytes; no empty or overflowing extent.
  if (element != 4 && element != 8 && element != 16) return k_invalid_value;
  if (width == 0 || height == 0) return k_invalid_value;
  const std::size_t p = pitch_for(width);
  if (p < width || height > static_cast<std::size_t>(-1) / p) return k_invalid_value;
  const cu_result rc = allocate(dptr, p * height, nullptr, "cuMemAllocPitch");
  if (rc == k_success) *pitch = p;
  return rc;
}

cu_result mem_free(const real_driver& real, cu_deviceptr dptr, free_mode mode) noexcept {
  if (dptr == 0) return k_success;
  if (const cu_result rc = refuse_if_forked("cuMemFree"); rc != k_success) return rc;
  void* ptr = as_ptr(dptr);
  registry* r = registry::if_built();
  if (r != nullptr) {
    if (mode == free_mode::sync && real.ctx_synchronize != nullptr && is_live_start(*r, ptr)) {
      // cudaFree waits for the device; so does this, before the block can be reused.
      if (const cu_result rc = real.ctx_synchronize(); rc != k_success) return rc;
    }
    try {
      if (r->release(ptr, nullptr, release_kind::plain, r->try_current_device())) {
        stats().frees.fetch_add(1, std::memory_order_relaxed);
        return k_success;
      }
    } catch (...) {
      return fail("cuMemFree");
    }
    const located l = locate(ptr);
    if (l.owner != nullptr) {
      // Inside cucache memory but not a live allocation's start (double or interior free):
      // forwarding it could free a whole cucache segment under other allocations.
      stats().bad_frees.fetch_add(1, std::memory_order_relaxed);
      const std::string why = l.owner->explain_bad_pointer(ptr, "cuMemFree");
      say(why);
      detail::set_last_error(why);
      return k_invalid_value;
    }
  }
  stats().forwarded_frees.fetch_add(1, std::memory_order_relaxed);
  return real.mem_free != nullptr ? real.mem_free(dptr) : k_not_found;
}

cu_result mem_free_async(const real_driver& real, cu_deviceptr dptr, cu_stream stream,
                         bool ptsz) noexcept {
  if (dptr == 0) return k_success;
  if (const cu_result rc = refuse_if_forked("cuMemFreeAsync"); rc != k_success) return rc;
  void* ptr = as_ptr(dptr);
  const cu_stream s = ptsz && stream == nullptr ? k_stream_per_thread : stream;
  if (registry* r = registry::if_built()) {
    try {
      if (r->release(ptr, s, release_kind::ordered, r->try_current_device())) {
        stats().frees.fetch_add(1, std::memory_order_relaxed);
        return k_success;
      }
    } catch (...) {
      return fail("cuMemFreeAsync");
    }
    const located l = locate(ptr);
    if (l.owner != nullptr) {
      stats().bad_frees.fetch_add(1, std::memory_order_relaxed);
      const std::string why = l.owner->explain_bad_pointer(ptr, "cuMemFreeAsync");
      say(why);
      detail::set_last_error(why);
      return k_invalid_value;
    }
  }
  stats().forwarded_frees.fetch_add(1, std::memory_order_relaxed);
  auto fn = ptsz ? real.mem_free_async_ptsz : real.mem_free_async;
  return fn != nullptr ? fn(dptr, stream) : k_not_found;
}

cu_result mem_get_info(const real_driver& /*real*/, std::size_t* free,
                       std::size_t* total) noexcept {
  if (free == nullptr || total == nullptr) return k_invalid_value;
  try {
    // cucacheMemGetInfo's view: the device's free memory plus what cucache caches, bounded by a
    // memory limit when one is set.
    device_allocator& a = current_allocator();
    const memory_info device = a.backend().mem_get_info();
    const device_stats s = a.stats();
    std::size_t t = device.total_bytes;
    std::size_t f = device.free_bytes + s.free_bytes;
    if (s.memory_limit != 0) {
      t = std::min(t, s.memory_limit);
      const auto active =
          static_cast<std::size_t>(std::max<std::int64_t>(s.active_bytes[0].current, 0));
      f = std::min(f, t > active ? t - active : 0);
    }
    *free = std::min(f, t);
    *total = t;
    return k_success;
  } catch (...) {
    return fail("cuMemGetInfo");
  }
}

cu_result ipc_get_mem_handle(const real_driver& real, void* handle, cu_deviceptr dptr) noexcept {
  if (const cu_result rc = refuse_if_ours(dptr, "cuIpcGetMemHandle",
                                          "another process opening the handle would map the whole "
                                          "segment at its base, not this allocation");
      rc != k_success) {
    return rc;
  }
  return real.ipc_get_mem_handle != nullptr ? real.ipc_get_mem_handle(handle, dptr) : k_not_found;
}

cu_result mem_get_address_range(const real_driver& real, cu_deviceptr* base, std::size_t* size,
                                cu_deviceptr dptr) noexcept {
  const located l = locate(as_ptr(dptr));
  if (l.owner == nullptr) {
    return real.mem_get_address_range != nullptr ? real.mem_get_address_range(base, size, dptr)
                                                 : k_not_found;
  }
  // What the driver answers for its own allocations: the one holding dptr, from its start, never
  // the cucache segment around it; an address in no live allocation is not found. Either output
  // may be NULL, as with the driver.
  if (!l.info.live) return k_not_found;
  if (base != nullptr) *base = static_cast<cu_deviceptr>(l.info.block);
  if (size != nullptr) *size = l.info.block_size;
  stats().address_ranges.fetch_add(1, std::memory_order_relaxed);
  return k_success;
}

cu_result mem_retain_allocation_handle(const real_driver& real, cu_mem_handle* handle,
                                       void* addr) noexcept {
  if (locate(addr).owner != nullptr) return k_invalid_value;
  return real.mem_retain_allocation_handle != nullptr
             ? real.mem_retain_allocation_handle(handle, addr)
             : k_not_found;
}

std::string report_path(std::string_view setting, long pid) {
  std::string out;
  for (std::size_t i = 0; i < setting.size(); ++i) {
    if (setting[i] == '%' && i + 1 < setting.size() && setting[i + 1] == 'p') {
      out += std::to_string(pid);
      ++i;
    } else {
      out += setting[i];
    }
  }
  return out;
}

std::string report_text() {
  const counters& c = stats();
  std::string out = fmt::format(
      "cucache preload report: {} allocations and {} frees by cucache, {} foreign frees forwarded "
      "to the driver, {} bad frees refused, {} IPC handles refused, {} address ranges "
      "answered; {} of the allocations from a default memory pool, {} from other pools forwarded "
      "to the driver\n",
      c.allocations.load(), c.frees.load(), c.forwarded_frees.load(), c.bad_frees.load(),
      c.refused.load(), c.address_ranges.load(), c.pool_allocations.load(),
      c.forwarded_pool_allocations.load());
  registry* r = registry::if_built();
  if (r == nullptr) return out + "cucache: no device was used\n";
  out += fmt::format("backend {}, CUCACHE_CONF='{}'\n", to_string(r->kind()),
                     std::getenv("CUCACHE_CONF") != nullptr ? std::getenv("CUCACHE_CONF") : "");
  std::uint64_t unannounced = 0;
  for (int d = 0; d < r->device_count(); ++d) {
    if (const device_allocator* a = r->find(d)) unannounced += a->unannounced_captures();
  }
  out += fmt::format(
      "captures: {} (CUCACHE_PRELOAD_CAPTURES), {} announced by the shim, {} allocations refused "
      "in captures nobody announced\n",
      routing_captures_mode() == captures_mode::announced ? "announced" : "query",
      c.captures.load(), unannounced);
  const bool streams_announced = routing_streams_mode() == streams_mode::announced;
  out += fmt::format("streams: {} (CUCACHE_PRELOAD_STREAMS){}, {} destructions announced\n",
                     streams_announced ? "announced" : "query",
                     streams_announced && routing_captures_mode() != captures_mode::announced
                         ? ", without effect: CUCACHE_PRELOAD_CAPTURES=query"
                         : "",
                     c.stream_destructions.load());
  for (int d = 0; d < r->device_count(); ++d) {
    if (device_allocator* a = r->find(d)) {
      out += fmt::format("--- device {} ---\n", d);
      out += a->memory_summary();
    }
  }
  return out;
}

namespace {
void write_report_at_exit() noexcept {
  try {
    // A child forked after the parent used cucache inherits this handler and the parent's
    // counters, but used nothing of cucache's: it writes no report, so the parent's survives.
    if (registry::forked_child()) return;
    const char* env = std::getenv("CUCACHE_REPORT");
    if (env != nullptr && *env != '\0') {
      const std::string text = report_text();
      const std::string where = report_path(env, static_cast<long>(getpid()));
      if (where == "stderr") {
        std::fputs(text.c_str(), stderr);
      } else if (std::FILE* f = std::fopen(where.c_str(), "w")) {
        std::fputs(text.c_str(), f);
        std::fclose(f);
      } else {
        say(fmt::format("CUCACHE_REPORT: cannot write '{}'", where));
      }
    }
    if (registry* r = registry::if_built()) r->flush_trace();
  } catch (...) {
    // Nothing can report it at exit.
  }
}
}  // namespace

namespace {
std::atomic<bool> g_used{false};
}  // namespace

bool used_cucache() noexcept { return g_used.load(std::memory_order_relaxed); }

std::string nothing_reached_text(bool driver_loaded, bool sim) {
  std::string out = fmt::format(
      "cucache preload: nothing reached cucache in {} (pid {}), so there is no report: ",
      program_invocation_name, static_cast<long>(getpid()));
  if (!driver_loaded) {
    out += fmt::format(
        "no CUDA driver (libcuda.so.1) is loaded, and without one a CUDA runtime fails "
        "(cudaErrorInsufficientDriver) before any allocation reaches the shim, which works at the "
        "driver level. {}See docs/preload.md, \"Without a GPU\".\n",
        sim ? "CUCACHE_BACKEND=sim answers the allocation calls (cudaMalloc, cudaFree, ...) of a "
              "program linked with the shared CUDA runtime (libcudart.so, nvcc -cudart shared) "
              "only; a program with the static runtime (nvcc's default) needs a driver. "
            : "Without a GPU, run with CUCACHE_BACKEND=sim a program linked with the shared CUDA "
              "runtime (libcudart.so, nvcc -cudart shared). ");
  } else {
    out +=
        "the program allocated no device memory, or allocated it around the shim; "
        "CUCACHE_PRELOAD_TRACE=1 lists the lookups that reached the shim (docs/preload.md).\n";
  }
  return out;
}

namespace {

// The captures this shim announced and that have not ended, by stream; the per-thread default
// stream is a different stream on each thread, so its key carries the thread.
struct capture_key {
  std::uintptr_t stream;
  std::thread::id thread;
  bool operator<(const capture_key& o) const noexcept {
    return stream != o.stream ? stream < o.stream : thread < o.thread;
  }
};
std::mutex g_captures_mu;
std::map<capture_key, std::uint64_t> g_captures;  // guarded by g_captures_mu

capture_key key_of(cu_stream stream, bool ptsz) noexcept {
  const bool per_thread = stream == k_stream_per_thread || (ptsz && stream == nullptr);
  return {per_thread ? reinterpret_cast<std::uintptr_t>(k_stream_per_thread)
                     : reinterpret_cast<std::uintptr_t>(stream),
          per_thread ? std::this_thread::get_id() : std::thread::id{}};
}

// Begins a capture through `begin` (the driver's call), announced first in the announced mode.
template <typename Begin>
cu_result announced_begin(cu_stream stream, bool ptsz, Begin&& begin) noexcept {
  if (routing_captures_mode() != captures_mode::announced) return begin();
  try {
    registry& r = registry::instance();
    arm_captures(r);
    r.announce_capture_begin();
  } catch (...) {
    return fail("cuStreamBeginCapture");
  }
  const cu_result rc = begin();
  try {
    if (rc != k_success) {
      registry::instance().announce_capture_end();
    } else {
      const std::lock_guard<std::mutex> lock(g_captures_mu);
      ++g_captures[key_of(stream, ptsz)];
      stats().captures.fetch_add(1, std::memory_order_relaxed);
    }
  } catch (...) {
    // an announcement that cannot be withdrawn only keeps the capture query on (never unsafe)
  }
  return rc;
}

}  // namespace

cu_result stream_begin_capture(const real_driver& real, cu_stream stream, int mode,
                               bool ptsz) noexcept {
  auto fn = ptsz ? real.stream_begin_capture_ptsz : real.stream_begin_capture;
  if (fn == nullptr) return k_not_found;
  return announced_begin(stream, ptsz, [&] { return fn(stream, mode); });
}

cu_result stream_begin_capture_to_graph(const real_driver& real, cu_stream stream, cu_graph graph,
                                        const cu_graph_node* dependencies, const void* edge_data,
                                        std::size_t count, int mode, bool ptsz) noexcept {
  auto fn = ptsz ? real.stream_begin_capture_to_graph_ptsz : real.stream_begin_capture_to_graph;
  if (fn == nullptr) return k_not_found;
  return announced_begin(stream, ptsz,
                         [&] { return fn(stream, graph, dependencies, edge_data, count, mode); });
}

cu_result stream_end_capture(const real_driver& real, cu_stream stream, cu_graph* graph,
                             bool ptsz) noexcept {
  auto fn = ptsz ? real.stream_end_capture_ptsz : real.stream_end_capture;
  if (fn == nullptr) return k_not_found;
  const cu_result rc = fn(stream, graph);
  try {
    const capture_key key = key_of(stream, ptsz);
    {
      const std::lock_guard<std::mutex> lock(g_captures_mu);
      if (g_captures.find(key) == g_captures.end()) return rc;  // not a capture this shim began
    }
    // Ended unless the stream still captures: cuStreamIsCapturing's NONE (0), or, where it cannot
    // answer, the driver's own answer to the end (success, or the invalidated capture's 901).
    auto is = ptsz ? real.stream_is_capturing_ptsz : real.stream_is_capturing;
    int status = 0;
    const bool ended = is != nullptr && is(stream, &status) == k_success
                           ? status == 0
                           : rc == k_success || rc == 901;
    if (!ended) return rc;
    {
      const std::lock_guard<std::mutex> lock(g_captures_mu);
      auto it = g_captures.find(key);
      if (it == g_captures.end()) return rc;
      if (--it->second == 0) g_captures.erase(it);
    }
    registry::instance().announce_capture_end();
  } catch (...) {
    // as above: an announcement left in place only keeps the capture query on
  }
  return rc;
}

cu_result stream_destroy(const real_driver& real, cu_stream stream, bool v2) noexcept {
  auto fn = v2 ? real.stream_destroy_v2 : real.stream_destroy;
  if (fn == nullptr) return k_not_found;
  // Before the driver destroys it: the runtime may hand this handle to the next stream it creates
  // the moment the driver returns, and that stream's first allocation must ask its id. Announced
  // in either mode (an atomic increment; only the allocators' mode makes anyone rely on it), and
  // also for a call the driver refuses (a missed cache hit costs one id query, nothing else).
  device_allocator::announce_stream_destruction();
  stats().stream_destructions.fetch_add(1, std::memory_order_relaxed);
  return fn(stream);
}

std::uint64_t announced_capture_count() noexcept {
  const std::lock_guard<std::mutex> lock(g_captures_mu);
  std::uint64_t n = 0;
  for (const auto& [key, count] : g_captures) n += count;
  return n;
}

void arm_exit_report() noexcept {
  g_used.store(true, std::memory_order_relaxed);
  static std::once_flag once;
  try {
    std::call_once(once, [] { static_cast<void>(std::atexit(write_report_at_exit)); });
  } catch (...) {
  }
}

}  // namespace cucache::preload
