// libcucache_torch.so: cucache behind PyTorch's CUDAPluggableAllocator, a thin front end over the
// process registry (src/api/registry.hpp): the same devices, CUCACHE_BACKEND, CUCACHE_CONF (trace
// included), owner search and errors as the C and C++ APIs. Allocators are never destroyed (torch
// frees tensors during interpreter shutdown). Every entry point catches everything: C callers,
// torch among them, cannot handle C++ exceptions.
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <algorithm>
#include <atomic>
#include <cerrno>
#include <deque>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <concepts>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <stdexcept>
#include <utility>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "api/registry.hpp"
#include "cucache/cucache.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/errors.hpp"
#include "cucache/ipc.h"
#include "cucache/sim_backend.hpp"
#include "cucache/stats.hpp"
#include "cucache_torch.h"
#include "observe/observe_hub.hpp"

namespace cucache::detail {
namespace {

// Plug-in specific behaviour only; devices, configuration, owners and errors are the registry's.
struct torch_plugin {
  torch_plugin() {
    const char* oom = std::getenv("CUCACHE_TORCH_OOM");
    throw_on_oom = oom != nullptr && std::string_view(oom) == "throw";
  }
  bool throw_on_oom = false;
  std::atomic<std::uint64_t> bad_frees{0};
};

torch_plugin& plugin() {
  static torch_plugin* p = new torch_plugin();  // leaked on purpose, see the file comment
  return *p;
}

/// What the calling thread's last cucache_torch_alloc met (cucache_torch_last_alloc_error).
thread_local int t_alloc_error = CUCACHE_TORCH_ALLOC_OK;

void report(std::string message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  set_last_error(message);
}

// The allocator of `device` if it was created; never creates one, never throws.
device_allocator* existing(int device) noexcept {
  registry* r = registry::if_built();
  return r != nullptr ? r->find(device) : nullptr;
}

void copy_stat_array(const stat_array& from, cucache_torch_stat* to) {
  for (std::size_t i = 0; i < k_stat_pools; ++i) {
    to[i] = {from[i].current, from[i].peak, from[i].allocated, from[i].freed};
  }
}

// cucache_torch_stats is the field table (cucache/stats.hpp) flattened: every field, in table
// order, under its torch name, each starting where the one before ends, the last ending the struct.
static_assert(CUCACHE_TORCH_POOLS == k_stat_pools);
#define CUCACHE_TORCH_ARRAY_TYPE_(member, torch, unit)                   \
  static_assert(std::is_same_v<decltype(cucache_torch_stats::torch),     \
                               cucache_torch_stat[CUCACHE_TORCH_POOLS]>, \
                #torch);
#define CUCACHE_TORCH_COUNTER_TYPE_(member, torch, unit, kind) \
  static_assert(std::is_same_v<decltype(cucache_torch_stats::torch), std::uint64_t>, #torch);
#define CUCACHE_TORCH_RATE_TYPE_(fn, torch) \
  static_assert(std::is_same_v<decltype(cucache_torch_stats::torch), double>, #torch);
CUCACHE_STAT_ARRAY_FIELDS(CUCACHE_TORCH_ARRAY_TYPE_)
CUCACHE_STAT_COUNTER_FIELDS(CUCACHE_TORCH_COUNTER_TYPE_)
CUCACHE_STAT_RATE_FIELDS(CUCACHE_TORCH_RATE_TYPE_)
#undef CUCACHE_TORCH_ARRAY_TYPE_
#undef CUCACHE_TORCH_COUNTER_TYPE_
#undef CUCACHE_TORCH_RATE_TYPE_

struct torch_field {
  const char* name;
  std::size_t offset;
  std::size_t size;
  const char* type;
};
constexpr torch_field k_torch_fields[] = {
#define CUCACHE_TORCH_ARRAY_(member, torch, unit) \
  {#torch, offsetof(cucache_torch_stats, torch), sizeof(cucache_torch_stats::torch), "stat[3]"},
#define CUCACHE_TORCH_COUNTER_(member, torch, unit, kind) \
  {#torch, offsetof(cucache_torch_stats, torch), sizeof(std::uint64_t), "u64"},
#define CUCACHE_TORCH_RATE_(fn, torch) \
  {#torch, offsetof(cucache_torch_stats, torch), sizeof(double), "f64"},
    CUCACHE_STAT_ARRAY_FIELDS(CUCACHE_TORCH_ARRAY_)
        CUCACHE_STAT_COUNTER_FIELDS(CUCACHE_TORCH_COUNTER_)
            CUCACHE_STAT_RATE_FIELDS(CUCACHE_TORCH_RATE_)
#undef CUCACHE_TORCH_ARRAY_
#undef CUCACHE_TORCH_COUNTER_
#undef CUCACHE_TORCH_RATE_
};
static_assert(std::size(k_torch_fields) == k_stat_field_count);
constexpr bool torch_layout_matches() {
  std::size_t end = 0;
  for (const torch_field& f : k_torch_fields) {
    if (f.offset != end) return false;  // every member is 8-byte aligned: no padding
    end += f.size;
  }
  return end == sizeof(cucache_torch_stats);
}
static_assert(torch_layout_matches(),
              "cucache_torch_stats (cucache_torch.h) and the field table have drifted apart");

cucache_torch_stats to_torch(const device_stats& s) {
  cucache_torch_stats out{};
#define CUCACHE_TORCH_FILL_ARRAY_(member, torch, unit) copy_stat_array(s.member, out.torch);
#define CUCACHE_TORCH_FILL_COUNTER_(member, torch, unit, kind) \
  out.torch = static_cast<std::uint64_t>(s.member);
#define CUCACHE_TORCH_FILL_RATE_(fn, torch) out.torch = s.fn();
  CUCACHE_STAT_ARRAY_FIELDS(CUCACHE_TORCH_FILL_ARRAY_)
  CUCACHE_STAT_COUNTER_FIELDS(CUCACHE_TORCH_FILL_COUNTER_)
  CUCACHE_STAT_RATE_FIELDS(CUCACHE_TORCH_FILL_RATE_)
#undef CUCACHE_TORCH_FILL_ARRAY_
#undef CUCACHE_TORCH_FILL_COUNTER_
#undef CUCACHE_TORCH_FILL_RATE_
  return out;
}

// snprintf's contract for a std::string.
std::int64_t copy_out(const std::string& text, char* buf, std::size_t len) {
  if (buf != nullptr && len > 0) {
    const std::size_t n = text.size() < len - 1 ? text.size() : len - 1;
    std::memcpy(buf, text.data(), n);
    buf[n] = '\0';
  }
  return static_cast<std::int64_t>(text.size());
}

constexpr int k_invalid_device = 101;  // cudaErrorInvalidDevice

// Throws cuda_error when `device` is not one of the registry's devices: cudaErrorInvalidDevice,
// or CUDA's own reason when it has no usable device at all (no driver). Builds the registry.
void require_device(int device) {
  registry& r = registry::instance();
  if (device >= 0 && device < r.device_count()) [[likely]]
    return;
  static_cast<void>(r.allocator(device));  // throws for a device outside the census
  throw cuda_error("cucache_torch", k_invalid_device,
                   "invalid device ordinal " + std::to_string(device));
}

template <typename Fn>
int guarded(const char* what, Fn&& fn) noexcept {
  try {
    fn();
    return 0;
  } catch (...) {
    static_cast<void>(
        error_code_of_current_exception((std::string("cucache_torch: ") + what).c_str()));
  }
  return -1;
}


// --- the allocator core's graph-pool calls ------------------------------------------------------

std::string pool_name(graph_pool_id p, int device) {
  return "graph pool (" + std::to_string(p.first) + ", " + std::to_string(p.second) +
         ") on device " + std::to_string(device);
}

// A checkpoint handed to C callers: the core's, and the device it belongs to.
struct checkpoint_box {
  int device = 0;
  std::shared_ptr<device_allocator::graph_pool_checkpoint> state;
  std::size_t live = 0;
};

checkpoint_box take_checkpoint(const device_allocator& a, int device, graph_pool_id p) {
  auto cp = std::make_shared<device_allocator::graph_pool_checkpoint>(a.checkpoint_graph_pool(p));
  const std::size_t live = cp->live.size();
  return checkpoint_box{device, std::move(cp), live};
}

template <class Freed, class Allocd>
void restore_checkpoint(device_allocator& a, const checkpoint_box& box, Freed&& freed,
                        Allocd&& allocated) {
  const auto restored = a.restore_graph_pool(*box.state);
  for (void* ptr : restored.freed) freed(ptr);
  for (const auto& b : restored.allocated) {
    allocated(reinterpret_cast<void*>(b.address), b.size, b.requested, b.stream);
  }
}

// The segment (an expandable range: its mapped run) holding ptr, from segments().
std::optional<std::pair<std::uintptr_t, std::size_t>> segment_from_views(
    const std::vector<segment_view>& segs, std::uintptr_t p) {
  for (const segment_view& s : segs) {
    if (p < s.address || p - s.address >= s.size) continue;
    if (!s.expandable) return std::pair{s.address, s.size};
    // Mapped runs: adjacent mappings merged.
    std::uintptr_t run = 0;
    std::size_t run_size = 0;
    for (const mapping_view& m : s.mappings) {
      if (run_size != 0 && m.address == run + run_size) {
        run_size += m.size;
      } else {
        if (run_size != 0 && p >= run && p - run < run_size) return std::pair{run, run_size};
        run = m.address;
        run_size = m.size;
      }
    }
    if (run_size != 0 && p >= run && p - run < run_size) return std::pair{run, run_size};
    return std::nullopt;  // in the range's unmapped part
  }
  return std::nullopt;
}

std::optional<std::pair<std::uintptr_t, std::size_t>> segment_holding(const device_allocator& a,
                                                                     const void* ptr) {
  return segment_from_views(a.segments(), reinterpret_cast<std::uintptr_t>(ptr));
}

// File descriptors of exported expandable blocks, kept open so that importers can duplicate them
// (pidfd_getfd); the oldest exports' are closed past k_kept_exports.
constexpr std::size_t k_kept_exports = 256;
struct exported_fds {
  std::mutex mu;
  std::deque<std::vector<int>> sets;
};
exported_fds& kept_fds() {
  static auto* k = new exported_fds();  // leaked: exports may outlive static destruction
  return *k;
}

// The C segment listener behind observe_hub's.
std::atomic<cucache_torch_segment_listener> g_c_listener{nullptr};
std::atomic<void*> g_c_listener_ctx{nullptr};
void segment_trampoline(void* /*ctx*/, int device, segment_event event, std::uintptr_t base,
                        std::size_t bytes, stream_handle stream) {
  static_assert(static_cast<int>(segment_event::alloc) == CUCACHE_TORCH_SEGMENT_ALLOC &&
                static_cast<int>(segment_event::free) == CUCACHE_TORCH_SEGMENT_FREE &&
                static_cast<int>(segment_event::map) == CUCACHE_TORCH_SEGMENT_MAP &&
                static_cast<int>(segment_event::unmap) == CUCACHE_TORCH_SEGMENT_UNMAP);
  if (cucache_torch_segment_listener fn = g_c_listener.load(std::memory_order_acquire)) {
    fn(g_c_listener_ctx.load(std::memory_order_acquire), device, static_cast<int>(event), base,
       bytes, static_cast<cucache_torch_stream>(stream));
  }
}

}  // namespace
}  // namespace cucache::detail

struct cucache_torch_checkpoint {
  cucache::detail::checkpoint_box box;
};

namespace cucache::detail {
namespace {
// cucache_torch_free and cucache_torch_free_checked: true when `ptr` was freed (or is NULL);
// false, with the message stored (and printed to stderr when `print`), when it was not.
bool free_block(void* ptr, int device, cucache_torch_stream stream, bool print) noexcept {
  const auto report = [print](const std::string& message) {
    if (print) {
      detail::report(message);
    } else {
      set_last_error(message);
    }
  };
  if (ptr == nullptr) return true;
  try {
    // In a child forked after cucache was used, the pointer is the parent's: say so.
    registry::require_not_forked();
    // Stream-ordered: a free on another stream than the allocation's defers reuse until the work
    // queued on `stream` now has completed (docs/torch.md). torch passes the allocation's device;
    // a caller that does not still gets its memory back.
    registry* r = registry::if_built();
    if (r != nullptr && r->release(ptr, stream, release_kind::ordered, device)) return true;
    plugin().bad_frees.fetch_add(1, std::memory_order_relaxed);
    if (r != nullptr && r->find(device) != nullptr) {
      report("cucache_torch: " + r->explain_bad_pointer(ptr, "free", device));
      return false;
    }
    char text[160];
    std::snprintf(text, sizeof text,
                  "cucache_torch: free(%p) on device %d: no cucache allocator holds it (it was "
                  "not allocated by cucache)",
                  ptr, device);
    report(text);
  } catch (const invalid_argument& e) {
    // A free the allocator refused, changing nothing: a block of a sleeping tag.
    plugin().bad_frees.fetch_add(1, std::memory_order_relaxed);
    report(std::string("cucache_torch: free refused: ") + e.what());
  } catch (const std::exception& e) {
    report(std::string("cucache_torch: free failed: ") + e.what());
  } catch (...) {
    report("cucache_torch: free failed: unknown error");
  }
  return false;
}


}  // namespace
}  // namespace cucache::detail

using namespace cucache;
using namespace cucache::detail;

namespace {
// Replaces each *slot, a file descriptor number of process `pid`, by a duplicate in this process
// (pidfd_open + pidfd_getfd). The duplicates made are in `mine` (also on failure, to close).
void duplicate_fds(std::int64_t pid, const std::vector<std::int32_t*>& slots,
                   std::vector<int>& mine) {
  if (slots.empty()) return;
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
  if (pidfd < 0) {
    throw std::runtime_error("pidfd_open(" + std::to_string(pid) +
                             ") of the exporting process failed: " + std::strerror(errno) +
                             " (it must still run, and this kernel must be Linux >= 5.6)");
  }
  for (std::int32_t* slot : slots) {
    const int fd = static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd, *slot, 0));
    if (fd < 0) {
      const int err = errno;
      ::close(pidfd);
      throw std::runtime_error(
          "pidfd_getfd of file descriptor " + std::to_string(*slot) + " of process " +
          std::to_string(pid) + " failed: " + std::strerror(err) +
          (err == EPERM ? " (this process may not ptrace the exporter: Yama's "
                          "kernel.yama.ptrace_scope=1 lets only ancestors do so; the exporter "
                          "can allow it with prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY))"
                        : ""));
    }
    mine.push_back(fd);
    *slot = fd;
  }
  ::close(pidfd);
}
}  // namespace

extern "C" {

void* cucache_torch_alloc(size_t size, int device, cucache_torch_stream stream) {
  if (size == 0) return nullptr;
  t_alloc_error = CUCACHE_TORCH_ALLOC_OTHER_ERROR;
  try {
    void* p = registry::instance().allocator(device).allocate(size, stream);
    t_alloc_error = CUCACHE_TORCH_ALLOC_OK;
    return p;
  } catch (const out_of_memory& e) {
    t_alloc_error = CUCACHE_TORCH_ALLOC_OUT_OF_MEMORY;
    report(std::string("cucache_torch: out of memory: ") + e.what());
    if (plugin().throw_on_oom) throw;  // opt-in: torch turns it into a RuntimeError
  } catch (const invalid_argument& e) {
    // A misuse, not a shortage: e.g. an allocation under a sleeping tag.
    t_alloc_error = CUCACHE_TORCH_ALLOC_INVALID_ARGUMENT;
    report(std::string("cucache_torch: alloc(") + std::to_string(size) + " bytes, device " +
           std::to_string(device) + ") failed: " + e.what());
    if (plugin().throw_on_oom) throw;
  } catch (const std::exception& e) {
    report(std::string("cucache_torch: alloc(") + std::to_string(size) + " bytes, device " +
           std::to_string(device) + ") failed: " + e.what());
    if (plugin().throw_on_oom) throw;
  } catch (...) {
    report("cucache_torch: alloc failed: unknown error");
  }
  return nullptr;
}

void cucache_torch_free(void* ptr, size_t /*size*/, int device, cucache_torch_stream stream) {
  static_cast<void>(free_block(ptr, device, stream, true));
}

int cucache_torch_free_checked(void* ptr, size_t /*size*/, int device,
                               cucache_torch_stream stream) {
  return free_block(ptr, device, stream, false) ? 0 : -1;
}

int cucache_torch_record_stream(void* ptr, cucache_torch_stream stream) {
  return guarded("record_stream", [&] {
    registry* r = registry::if_built();
    if (r == nullptr) throw_not_ours(ptr, release_kind::record);
    const int device = r->try_current_device();
    if (!r->release(ptr, stream, release_kind::record, device)) {
      throw_not_ours(ptr, release_kind::record, device);
    }
  });
}

int cucache_torch_empty_cache(void) {
  return guarded("empty_cache", [] {
    if (registry* r = registry::if_built()) r->empty_cache();
  });
}

int cucache_torch_max_allocatable(int device, size_t* out) {
  return guarded("max_allocatable", [&] {
    if (out == nullptr) throw cucache::invalid_argument("max_allocatable: out is NULL");
    *out = registry::instance().allocator(device).max_allocatable(nullptr);
  });
}

int cucache_torch_reserve(int device, size_t bytes) {
  return guarded("reserve",
                 [&] { registry::instance().allocator(device).reserve(bytes, nullptr); });
}

int cucache_torch_reset_peak_stats(int device) {
  return guarded("reset_peak_stats", [&] {
    if (device >= 0) require_device(device);
    registry* r = registry::if_built();
    for (int d = 0; r != nullptr && d < r->device_count(); ++d) {
      device_allocator* a = r->find(d);
      if (a != nullptr && (device < 0 || d == device)) a->reset_peak_stats();
    }
  });
}

int cucache_torch_reset_accumulated_stats(int device) {
  return guarded("reset_accumulated_stats", [&] {
    if (device >= 0) require_device(device);
    registry* r = registry::if_built();
    for (int d = 0; r != nullptr && d < r->device_count(); ++d) {
      device_allocator* a = r->find(d);
      if (a != nullptr && (device < 0 || d == device)) a->reset_accumulated_stats();
    }
  });
}

int cucache_torch_set_memory_fraction(int device, double fraction) {
  return guarded("set_memory_fraction",
                 [&] { registry::instance().set_memory_fraction(device, fraction); });
}

int cucache_torch_set_size_rules(const char* conf) {
  return guarded("set_size_rules", [&] {
    if (conf == nullptr) throw invalid_argument("set_size_rules: conf is NULL");
    registry::instance().set_size_rules(conf);
  });
}

int cucache_torch_set_captures_announced(int on) {
  return guarded("set_captures_announced",
                 [&] { registry::instance().set_captures_announced(on != 0); });
}

int cucache_torch_begin_allocate_to_pool(int device, uint64_t first, uint64_t second,
                                         cucache_torch_stream_filter filter, void* ctx,
                                         void (*ctx_free)(void*)) {
  // ctx belongs to the route from here on, whatever happens: freed when the filter is dropped.
  std::shared_ptr<void> owned(ctx, [ctx_free](void* c) {
    if (ctx_free != nullptr) ctx_free(c);
  });
  return guarded("begin_allocate_to_pool", [&] {
    if (filter == nullptr) throw invalid_argument("filter is NULL");
    registry& r = registry::instance();
    r.allocator(device).begin_allocate_to_pool(
        graph_pool_id{first, second}, [filter, owned](stream_handle stream) {
          return filter(owned.get(), static_cast<cucache_torch_stream>(stream)) != 0;
        });
  });
}

int cucache_torch_end_allocate_to_pool(int device, uint64_t first, uint64_t second) {
  return guarded("end_allocate_to_pool", [&] {
    registry::instance().allocator(device).end_allocate_to_pool(graph_pool_id{first, second});
  });
}

int cucache_torch_release_pool(int device, uint64_t first, uint64_t second) {
  return guarded("release_pool", [&] {
    // torch releases MemPools that never allocated (their creation is not forwarded to a
    // pluggable allocator): nothing to do for a pool cucache never saw.
    device_allocator& a = registry::instance().allocator(device);
    const graph_pool_id pool{first, second};
    if (a.graph_pool_state(pool).exists) a.release_graph_pool(pool);
  });
}

int cucache_torch_try_alloc(size_t size, int device, cucache_torch_stream stream, void** out) {
  if (out == nullptr) {
    set_last_error("cucache_torch_try_alloc: out is NULL");
    return CUCACHE_TORCH_ALLOC_INVALID_ARGUMENT;
  }
  *out = nullptr;
  if (size == 0) return CUCACHE_TORCH_ALLOC_OK;
  try {
    *out = registry::instance().allocator(device).allocate(size, stream);
    return CUCACHE_TORCH_ALLOC_OK;
  } catch (const out_of_memory& e) {
    set_last_error(e.what());
    return CUCACHE_TORCH_ALLOC_OUT_OF_MEMORY;
  } catch (const invalid_argument&) {
    static_cast<void>(error_code_of_current_exception(
        ("cucache: allocate(" + std::to_string(size) + " bytes, device " +
         std::to_string(device) + ")")
            .c_str()));
    return CUCACHE_TORCH_ALLOC_INVALID_ARGUMENT;
  } catch (...) {
    static_cast<void>(error_code_of_current_exception(
        ("cucache: allocate(" + std::to_string(size) + " bytes, device " +
         std::to_string(device) + ")")
            .c_str()));
  }
  return CUCACHE_TORCH_ALLOC_OTHER_ERROR;
}

int cucache_torch_delete(void* ptr) {
  if (ptr == nullptr) return 0;
  return guarded("free", [&] {
    registry::require_not_forked();
    registry* r = registry::if_built();
    if (r == nullptr || !r->release(ptr, nullptr, release_kind::plain, r->try_current_device())) {
      throw_not_ours(ptr, release_kind::plain);
    }
  });
}

int cucache_torch_create_or_incref_pool(int device, uint64_t first, uint64_t second) {
  return guarded("create_or_incref_pool", [&] {
    registry::instance().allocator(device).create_or_incref_graph_pool(graph_pool_id{first, second});
  });
}

int cucache_torch_pool_use_count(int device, uint64_t first, uint64_t second, uint64_t* out) {
  return guarded("pool_use_count", [&] {
    if (out == nullptr) throw invalid_argument("out is NULL");
    *out = 0;
    require_device(device);
    if (device_allocator* a = existing(device)) {
      const graph_pool_info info = a->graph_pool_state(graph_pool_id{first, second});
      if (info.exists) *out = info.uses;
    }
  });
}

int cucache_torch_pool_live_allocations(int device, uint64_t first, uint64_t second,
                                        void (*fn)(void* ctx, void* ptr), void* ctx) {
  return guarded("pool_live_allocations", [&] {
    if (fn == nullptr) throw invalid_argument("fn is NULL");
    require_device(device);
    const graph_pool_id pool{first, second};
    device_allocator* a = existing(device);
    if (a == nullptr || !a->graph_pool_state(pool).exists) {
      throw invalid_argument("no " + pool_name(pool, device));
    }
    for (void* p : a->graph_pool_live_allocations(pool)) fn(ctx, p);
  });
}

int cucache_torch_empty_pool_cache(int device, uint64_t first, uint64_t second) {
  return guarded("empty_pool_cache", [&] {
    require_device(device);
    const graph_pool_id pool{first, second};
    device_allocator* a = existing(device);
    if (a == nullptr || !a->graph_pool_state(pool).exists) return;  // nothing cached for it
    a->empty_graph_pool_cache(pool);
  });
}

int cucache_torch_set_pool_no_split(int device, uint64_t first, uint64_t second) {
  return guarded("set_pool_no_split", [&] {
    registry::instance().allocator(device).set_graph_pool_no_split(graph_pool_id{first, second});
  });
}

cucache_torch_checkpoint* cucache_torch_checkpoint_pool(int device, uint64_t first,
                                                        uint64_t second) {
  cucache_torch_checkpoint* out = nullptr;
  guarded("checkpoint_pool", [&] {
    require_device(device);
    const graph_pool_id pool{first, second};
    device_allocator* a = existing(device);
    if (a == nullptr || !a->graph_pool_state(pool).exists) {
      throw invalid_argument("no " + pool_name(pool, device));
    }
    out = new cucache_torch_checkpoint{take_checkpoint(*a, device, pool)};
  });
  return out;
}

void cucache_torch_checkpoint_free(cucache_torch_checkpoint* cp) {
  delete cp;
}

size_t cucache_torch_checkpoint_live_count(const cucache_torch_checkpoint* cp) {
  return cp != nullptr ? cp->box.live : 0;
}

int cucache_torch_restore_pool(int device, const cucache_torch_checkpoint* cp,
                               void (*freed)(void* ctx, void* ptr),
                               void (*allocated)(void* ctx, void* ptr, size_t size,
                                                 size_t requested, cucache_torch_stream stream),
                               void* ctx) {
  return guarded("restore_pool", [&] {
    if (cp == nullptr) throw invalid_argument("checkpoint is NULL");
    if (cp->box.device != device) {
      throw invalid_argument("the checkpoint is of device " + std::to_string(cp->box.device) +
                             ", not " + std::to_string(device));
    }
    restore_checkpoint(
        registry::instance().allocator(device), cp->box,
        [&](void* p) {
          if (freed != nullptr) freed(ctx, p);
        },
        [&](void* p, std::size_t size, std::size_t requested, stream_handle stream) {
          if (allocated != nullptr) {
            allocated(ctx, p, size, requested, static_cast<cucache_torch_stream>(stream));
          }
        });
  });
}

int cucache_torch_segments(int device,
                           int (*fn)(void* ctx, const cucache_torch_segment_info* segment),
                           void* ctx) {
  return guarded("segments", [&] {
    if (fn == nullptr) throw invalid_argument("fn is NULL");
    require_device(device);
    device_allocator* a = existing(device);
    if (a == nullptr) return;
    const std::vector<segment_view> segs = a->segments();
    std::vector<cucache_torch_block_info> blocks;
    std::vector<cucache_torch_mapping_info> maps;
    for (const segment_view& s : segs) {
      blocks.clear();
      maps.clear();
      for (const block_view& b : s.blocks) {
        const int32_t st = b.st == block_view::state::allocated ? CUCACHE_TORCH_BLOCK_ALLOCATED
                           : b.st == block_view::state::pending ? CUCACHE_TORCH_BLOCK_PENDING
                                                                : CUCACHE_TORCH_BLOCK_FREE;
        blocks.push_back({b.address, b.size, b.requested, st, 0});
      }
      for (const mapping_view& m : s.mappings) maps.push_back({m.address, m.size});
      const cucache_torch_segment_info info{
          s.address,     s.size,        static_cast<cucache_torch_stream>(s.stream),
          s.small ? 1 : 0, s.expandable ? 1 : 0, s.pool.first,
          s.pool.second, blocks.data(), blocks.size(),
          maps.data(),   maps.size()};
      if (fn(ctx, &info) != 0) return;
    }
  });
}

int cucache_torch_base_allocation(const void* ptr, void** base, size_t* size) {
  return guarded("base_allocation", [&] {
    if (base == nullptr || size == nullptr) throw invalid_argument("base or size is NULL");
    registry* r = registry::if_built();
    for (int d = 0; r != nullptr && d < r->device_count(); ++d) {
      device_allocator* a = r->find(d);
      if (a == nullptr) continue;
      if (auto seg = segment_holding(*a, ptr)) {
        *base = reinterpret_cast<void*>(seg->first);
        *size = seg->second;
        return;
      }
    }
    char text[160];
    std::snprintf(text, sizeof text, "%p is not in memory a cucache allocator holds", ptr);
    throw invalid_argument(text);
  });
}

int cucache_torch_ipc_export(void* ptr, void* handle, size_t handle_size) {
  return guarded("ipc_export", [&] {
    if (handle == nullptr || handle_size != sizeof(cucacheIpcHandle)) {
      throw invalid_argument("handle is NULL or not " + std::to_string(sizeof(cucacheIpcHandle)) +
                             " bytes (a cucacheIpcHandle)");
    }
    cucacheIpcHandle h = cucache::ipc_get_handle(ptr);
    if (h.kind == cucacheIpcKindFileDescriptors) {
      exported_fds& k = kept_fds();
      std::lock_guard lock(k.mu);
      k.sets.emplace_back(h.fds, h.fds + h.pieceCount);
      while (k.sets.size() > k_kept_exports) {
        for (int fd : k.sets.front()) ::close(fd);
        k.sets.pop_front();
      }
    }
    std::memcpy(handle, &h, sizeof h);
  });
}

int cucache_torch_ipc_export_long(void* ptr, void** handle, size_t* handle_size) {
  return guarded("ipc_export_long", [&] {
    if (handle == nullptr || handle_size == nullptr) {
      throw invalid_argument("handle or handle_size is NULL");
    }
    *handle = nullptr;
    *handle_size = 0;
    cucache::ipc_long_handle l = cucache::ipc_get_long_handle(ptr);
    const std::vector<std::byte> bytes = l.bytes();
    void* m = std::malloc(bytes.size());
    if (m == nullptr) {
      cucache::ipc_release_fds(l);
      throw std::runtime_error("no host memory for an IPC handle of " +
                               std::to_string(bytes.size()) + " bytes");
    }
    std::memcpy(m, bytes.data(), bytes.size());
    if (!l.pieces.empty()) {
      std::vector<int> fds;
      fds.reserve(l.pieces.size());
      for (const cucacheIpcPiece& p : l.pieces) fds.push_back(p.fd);
      exported_fds& k = kept_fds();
      std::lock_guard lock(k.mu);
      k.sets.push_back(std::move(fds));
      while (k.sets.size() > k_kept_exports) {
        for (int fd : k.sets.front()) ::close(fd);
        k.sets.pop_front();
      }
    }
    *handle = m;
    *handle_size = bytes.size();
  });
}

void cucache_torch_ipc_free(void* handle) {
  std::free(handle);
}

int cucache_torch_ipc_open(const void* handle, size_t handle_size, int fds_of_exporter,
                           void** out) {
  return guarded("ipc_open", [&] {
    if (out == nullptr) throw invalid_argument("out is NULL");
    *out = nullptr;
    std::uint32_t magic = 0;
    if (handle != nullptr && handle_size >= sizeof magic) std::memcpy(&magic, handle, sizeof magic);
    std::vector<int> mine;
    const auto close_mine = [&] {
      for (int fd : mine) ::close(fd);
    };
    if (handle != nullptr && magic == CUCACHE_IPC_LONG_MAGIC) {
      // The variable-length form (cucache_torch_ipc_export_long): validated whole before any
      // descriptor is duplicated.
      cucache::ipc_long_handle l = cucache::ipc_long_handle::from_bytes(handle, handle_size);
      try {
        if (fds_of_exporter != 0 && l.head.kind == cucacheIpcKindFileDescriptors) {
          std::vector<std::int32_t*> slots;
          slots.reserve(l.pieces.size());
          for (cucacheIpcPiece& p : l.pieces) slots.push_back(&p.fd);
          duplicate_fds(l.head.pid, slots, mine);
        }
        *out = cucache::ipc_open_handle(l);
      } catch (...) {
        close_mine();
        throw;
      }
      close_mine();  // imported: the mapping holds the memory now
      return;
    }
    if (handle == nullptr || handle_size != sizeof(cucacheIpcHandle)) {
      throw invalid_argument("handle is NULL or not " + std::to_string(sizeof(cucacheIpcHandle)) +
                             " bytes (a cucacheIpcHandle) nor a long handle (magic " +
                             std::to_string(CUCACHE_IPC_LONG_MAGIC) +
                             ", from cucache_torch_ipc_export_long)");
    }
    cucacheIpcHandle h;
    std::memcpy(&h, handle, sizeof h);
    const bool dup = fds_of_exporter != 0 && h.kind == cucacheIpcKindFileDescriptors &&
                     h.pieceCount > 0 && h.pieceCount <= CUCACHE_IPC_MAX_PIECES;
    try {
      if (dup) {
        std::vector<std::int32_t*> slots;
        for (int i = 0; i < h.pieceCount; ++i) slots.push_back(&h.fds[i]);
        duplicate_fds(h.pid, slots, mine);
      }
      *out = cucache::ipc_open_handle(h);
    } catch (...) {
      close_mine();
      throw;
    }
    close_mine();  // imported: the mapping holds the memory now
  });
}

int cucache_torch_ipc_close(void* ptr) {
  return guarded("ipc_close", [&] { cucache::ipc_close_handle(ptr); });
}

size_t cucache_torch_ipc_handle_size(void) {
  return sizeof(cucacheIpcHandle);
}

int cucache_torch_get_memory_fraction(int device, double* out) {
  return guarded("get_memory_fraction", [&] {
    if (out == nullptr) throw invalid_argument("out is NULL");
    require_device(device);
    *out = registry::instance().memory_fraction(device);
  });
}

int cucache_torch_set_segment_listener(cucache_torch_segment_listener fn, void* ctx) {
  return guarded("set_segment_listener", [&] {
    g_c_listener_ctx.store(ctx, std::memory_order_release);
    g_c_listener.store(fn, std::memory_order_release);
    if (fn == nullptr) {
      set_segment_listener(nullptr, nullptr);
      return;
    }
    set_segment_listener(&segment_trampoline, nullptr);
    registry::instance().activate_observers();
  });
}

int cucache_torch_get_stats(int device, cucache_torch_stats* out) {
  return guarded("get_stats", [&] {
    if (out == nullptr) throw invalid_argument("out is NULL");
    *out = cucache_torch_stats{};
    require_device(device);
    device_allocator* a = existing(device);
    if (a == nullptr) return;  // an unused device: nothing reserved, nothing allocated
    *out = to_torch(a->stats());
  });
}

size_t cucache_torch_stats_size(void) {
  return sizeof(cucache_torch_stats);
}

const char* cucache_torch_stats_layout(void) {
  static const std::string text = [] {
    std::string t;
    for (const torch_field& f : k_torch_fields) {
      t += std::string(f.name) + ' ' + std::to_string(f.offset) + ' ' + std::to_string(f.size) +
           ' ' + f.type + '\n';
    }
    return t;
  }();
  return text.c_str();
}

int64_t cucache_torch_memory_summary(int device, char* buf, size_t len) {
  std::int64_t n = -1;
  guarded("memory_summary", [&] {
    require_device(device);
    device_allocator* a = existing(device);
    const std::string text =
        a != nullptr ? cucache::memory_summary(device)
                     : "cucache: device " + std::to_string(device) + " has allocated nothing yet\n";
    n = copy_out(text, buf, len);
  });
  return n;
}

int64_t cucache_torch_snapshot_json(int device, char* buf, size_t len) {
  std::int64_t n = -1;
  guarded("snapshot_json", [&] {
    require_device(device);
    device_allocator* a = existing(device);
    n = copy_out(a != nullptr ? a->snapshot_json() : std::string("{\"segments\":[]}"), buf, len);
  });
  return n;
}

int cucache_torch_write_snapshot(const char* path) {
  return guarded("write_snapshot", [&] {
    if (path == nullptr) throw invalid_argument("path is NULL");
    cucache::write_snapshot(path);
  });
}

int cucache_torch_mark_step(void) {
  return guarded("mark_step", [] { cucache::mark_step(); });
}

int64_t cucache_torch_leak_report(uint64_t steps, char* buf, size_t len) {
  std::int64_t n = -1;
  guarded("leak_report", [&] { n = copy_out(cucache::leak_report_json(steps), buf, len); });
  return n;
}

int cucache_torch_push_tag(const char* tag) {
  return guarded("push_tag", [&] {
    if (tag == nullptr) throw invalid_argument("tag is NULL");
    cucache::push_tag(tag);
  });
}

int cucache_torch_pop_tag(void) {
  return guarded("pop_tag", [] { cucache::pop_tag(); });
}

int64_t cucache_torch_tag_stats(int device, char* buf, size_t len) {
  std::int64_t n = -1;
  guarded("tag_stats", [&] {
    require_device(device);
    n = copy_out(tag_stats_json(cucache::tag_stats(device)), buf, len);
  });
  return n;
}

int cucache_torch_set_tag_limit(int device, const char* tag, uint64_t bytes) {
  return guarded("set_tag_limit", [&] {
    if (tag == nullptr) throw invalid_argument("tag is NULL");
    cucache::set_tag_limit(device, tag, static_cast<std::size_t>(bytes));
  });
}

int cucache_torch_tag_limit(int device, const char* tag, uint64_t* bytes) {
  return guarded("tag_limit", [&] {
    if (tag == nullptr) throw invalid_argument("tag is NULL");
    if (bytes == nullptr) throw invalid_argument("bytes is NULL");
    *bytes = cucache::tag_limit(device, tag);
  });
}

int64_t cucache_torch_metrics(char* buf, size_t len) {
  int64_t n = -1;
  guarded("metrics", [&] { n = copy_out(cucache::metrics(), buf, len); });
  return n;
}

int cucache_torch_make_sleepable(const char* tag) {
  return guarded("make_sleepable", [&] {
    if (tag == nullptr) throw invalid_argument("tag is NULL");
    cucache::make_sleepable(tag);
  });
}

int cucache_torch_sleep(int device, const char* tag, int keep_contents) {
  return guarded("sleep", [&] {
    if (tag == nullptr) throw invalid_argument("tag is NULL");
    require_device(device);
    cucache::sleep(device, tag, keep_contents != 0);
  });
}

int cucache_torch_sleep_tags(int device, const char* const* tags, const int* keep_contents,
                             size_t count) {
  return guarded("sleep", [&] {
    if (tags == nullptr || keep_contents == nullptr) {
      throw invalid_argument("tags or keep_contents is NULL");
    }
    require_device(device);
    std::vector<cucache::tag_sleep_request> requests;
    for (std::size_t i = 0; i < count; ++i) {
      if (tags[i] == nullptr) throw invalid_argument("tags[" + std::to_string(i) + "] is NULL");
      requests.push_back({tags[i], keep_contents[i] != 0});
    }
    cucache::sleep(device, requests);
  });
}

int cucache_torch_wake_tags(int device, const char* const* tags, size_t count,
                            double* copy_seconds) {
  return guarded("wake", [&] {
    if (tags == nullptr) throw invalid_argument("tags is NULL");
    require_device(device);
    std::vector<std::string_view> names;
    for (std::size_t i = 0; i < count; ++i) {
      if (tags[i] == nullptr) throw invalid_argument("tags[" + std::to_string(i) + "] is NULL");
      names.emplace_back(tags[i]);
    }
    cucache::wake(device, names);
    if (copy_seconds != nullptr) {
      // The copies of all the tags share one synchronization: each tag reports the call's time.
      double secs = 0;
      for (const std::string_view n : names) {
        secs = std::max(secs, cucache::last_wake_copy_seconds(device, n));
      }
      *copy_seconds = secs;
    }
  });
}

int cucache_torch_prepare_sleep(int device, const char* tag, uint64_t bytes, uint64_t* pinned) {
  return guarded("prepare_sleep", [&] {
    if (tag == nullptr) throw invalid_argument("tag is NULL");
    require_device(device);
    const std::size_t n = cucache::prepare_sleep(device, tag, static_cast<std::size_t>(bytes));
    if (pinned != nullptr) *pinned = n;
  });
}

int cucache_torch_wake(int device, const char* tag, double* copy_seconds) {
  return guarded("wake", [&] {
    if (tag == nullptr) throw invalid_argument("tag is NULL");
    require_device(device);
    cucache::wake(device, tag);
    if (copy_seconds != nullptr) *copy_seconds = cucache::last_wake_copy_seconds(device, tag);
  });
}

int64_t cucache_torch_sleeping(int device, char* buf, size_t len) {
  std::int64_t n = -1;
  guarded("sleeping", [&] {
    require_device(device);
    n = copy_out(sleeping_json(cucache::sleeping(device)), buf, len);
  });
  return n;
}

int cucache_torch_check_device(int device) {
  try {
    registry& r = registry::instance();
    if (r.device_count() == 0) static_cast<void>(r.allocator(0));  // throws CUDA's reason
    if (device >= 0) require_device(device);
    return CUCACHE_TORCH_READY;
  } catch (const environment_error&) {
    static_cast<void>(error_code_of_current_exception("cucache"));
    return CUCACHE_TORCH_CONFIG_ERROR;
  } catch (const cuda_error& e) {
    static_cast<void>(error_code_of_current_exception("cucache"));
    if (e.code() == k_invalid_device) return CUCACHE_TORCH_INVALID_DEVICE;
    if (registry::forked_child()) return CUCACHE_TORCH_OTHER_ERROR;
    return CUCACHE_TORCH_NO_CUDA;
  } catch (...) {
    static_cast<void>(error_code_of_current_exception("cucache"));
    return CUCACHE_TORCH_OTHER_ERROR;
  }
}

int cucache_torch_device_count(void) {
  try {
    return registry::instance().device_count();
  } catch (...) {
    static_cast<void>(error_code_of_current_exception("cucache_torch: device_count"));
    return -1;
  }
}

int64_t cucache_torch_canonical_conf(const char* conf, char* buf, size_t len) {
  std::int64_t n = -1;
  guarded("configuration", [&] {
    if (conf == nullptr) {
      n = copy_out(to_string(registry::instance().settings()), buf, len);
      return;
    }
    try {
      n = copy_out(to_string(parse_config(conf)), buf, len);
    } catch (const invalid_argument& e) {
      // The caller's text: a configuration error as the registry reports one.
      throw environment_error(e.what());
    }
  });
  return n;
}

int cucache_torch_last_alloc_error(void) {
  return t_alloc_error;
}

const char* cucache_torch_last_error(void) {
  // The process's latest error, not only this thread's: torch allocates on its autograd threads
  // too, and Python reads the error from its own.
  thread_local std::string copy;
  try {
    copy = process_last_error();
  } catch (...) {
    return "cucache_torch: out of host memory";
  }
  return copy.c_str();
}

void cucache_torch_set_error(const char* message) {
  set_last_error(message != nullptr ? message : "");
}

uint64_t cucache_torch_bad_free_count(void) {
  return plugin().bad_frees.load(std::memory_order_relaxed);
}

const char* cucache_torch_backend_name(void) {
  try {
    return to_string(registry::instance().kind());
  } catch (...) {
    return "unusable";
  }
}

int cucache_torch_sim_complete_all(void) {
  return guarded("sim_complete_all", [] {
    registry& r = registry::instance();
    if (r.kind() != backend_kind::sim)
      throw invalid_argument("the backend is not the simulated one");
    for (int d = 0; d < r.device_count(); ++d) {
      if (auto* sim = dynamic_cast<sim_backend*>(r.backend_of(d))) sim->complete_all();
    }
  });
}

}  // extern "C"
