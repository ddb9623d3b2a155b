// libcucache_torch.so: cucache behind PyTorch's CUDAPluggableAllocator, a thin front end over the
// process registry (src/api/registry.hpp): the same devices, CUCACHE_BACKEND, CUCACHE_CONF (trace
// included), owner search and errors as the C and C++ APIs. Allocators are never destroyed (torch
// frees tensors during interpreter shutdown). Every entry point catches everything: C callers,
// torch among them, cannot handle C++ exceptions.
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>

#include "api/registry.hpp"
#include "cucache/cucache.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/errors.hpp"
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
#define CUCACHE_TORCH_COUNTER_TYPE_(member, torch, unit) \
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
#define CUCACHE_TORCH_COUNTER_(member, torch, unit) \
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
#define CUCACHE_TORCH_FILL_COUNTER_(member, torch, unit) \
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

extern "C" {

void* cucache_torch_alloc(size_t size, int device, cucache_torch_stream stream) {
  if (size == 0) return nullptr;
  try {
    return registry::instance().allocator(device).allocate(size, stream);
  } catch (const out_of_memory& e) {
    report(std::string("cucache_torch: out of memory: ") + e.what());
    if (plugin().throw_on_oom) throw;  // opt-in: torch turns it into a RuntimeError
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
