// libcucache_torch.so: cucache behind PyTorch's CUDAPluggableAllocator. One device_allocator per
// device, created on first use and never destroyed (torch frees tensors during interpreter
// shutdown, after static destructors could have run). Every entry point catches everything: C
// callers, torch among them, cannot handle C++ exceptions.
#include <array>
#include <atomic>
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

#include "cucache/config.hpp"
#include "cucache/cuda_backend.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/errors.hpp"
#include "cucache/sim_backend.hpp"
#include "cucache_torch.h"

namespace cucache::detail {
namespace {

// More ordinals than any host has; a fixed table keeps the lookup on the allocation path lock-free.
constexpr int k_max_devices = 64;

struct torch_plugin {
  torch_plugin() {
    const char* backend = std::getenv("CUCACHE_TORCH_BACKEND");
    sim = backend != nullptr && std::string_view(backend) == "sim";
    const char* oom = std::getenv("CUCACHE_TORCH_OOM");
    throw_on_oom = oom != nullptr && std::string_view(oom) == "throw";
  }

  bool sim = false;
  bool throw_on_oom = false;
  std::mutex create_mu;  // creation of allocators and the one-time config parse
  bool config_parsed = false;
  config cfg;
  std::string config_error;
  std::array<std::atomic<device_allocator*>, k_max_devices> allocators{};
  std::array<std::shared_ptr<sim_backend>, k_max_devices> sims;  // under create_mu
  std::array<double, k_max_devices> fractions{};                 // under create_mu; 0 = config's
  std::atomic<std::uint64_t> bad_frees{0};
  std::mutex error_mu;
  std::string last_error;
};

torch_plugin& plugin() {
  static torch_plugin* p = new torch_plugin();  // leaked on purpose, see the file comment
  return *p;
}

void set_error(std::string message, bool print) {
  if (print) std::fprintf(stderr, "%s\n", message.c_str());
  auto& p = plugin();
  std::lock_guard lk(p.error_mu);
  p.last_error = std::move(message);
}

// The allocator of `device` if it was created; never creates one.
device_allocator* existing(int device) {
  if (device < 0 || device >= k_max_devices) return nullptr;
  return plugin().allocators[static_cast<std::size_t>(device)].load(std::memory_order_acquire);
}

// The allocator of `device`, created on first use. Throws what the config or backend throws.
device_allocator& get_or_create(int device) {
  if (device < 0 || device >= k_max_devices) {
    throw invalid_argument("cucache_torch: device " + std::to_string(device) +
                           " is out of range [0, " + std::to_string(k_max_devices) + ")");
  }
  if (device_allocator* a = existing(device)) return *a;
  auto& p = plugin();
  std::lock_guard lk(p.create_mu);
  auto& slot = p.allocators[static_cast<std::size_t>(device)];
  if (device_allocator* a = slot.load(std::memory_order_relaxed)) return *a;
  if (!p.config_parsed) {
    try {
      p.cfg = config_from_env();
    } catch (const std::exception& e) {
      p.config_error = e.what();
    }
    p.config_parsed = true;
  }
  if (!p.config_error.empty()) throw invalid_argument(p.config_error);
  std::shared_ptr<device_backend> backend;
  if (p.sim) {
    sim_options opts;
    opts.device = device;
    auto sim = std::make_shared<sim_backend>(opts);
    p.sims[static_cast<std::size_t>(device)] = sim;
    backend = std::move(sim);
  } else {
    backend = std::make_shared<cuda_backend>(device);
  }
  config cfg = p.cfg;
  if (const double f = p.fractions[static_cast<std::size_t>(device)]; f > 0)
    cfg.memory_fraction = f;
  auto* a = new device_allocator(std::move(backend), std::move(cfg));
  slot.store(a, std::memory_order_release);
  return *a;
}

// The created allocator that holds `ptr` as a live allocation, trying `hint` first.
device_allocator* owner_of(const void* ptr, int hint) {
  if (device_allocator* a = existing(hint); a != nullptr && a->allocation_size(ptr) != 0) return a;
  for (int d = 0; d < k_max_devices; ++d) {
    device_allocator* a = existing(d);
    if (d != hint && a != nullptr && a->allocation_size(ptr) != 0) return a;
  }
  return nullptr;
}

void copy_stat_array(const stat_array& from, cucache_torch_stat* to) {
  for (std::size_t i = 0; i < k_stat_pools; ++i) {
    to[i] = {from[i].current, from[i].peak, from[i].allocated, from[i].freed};
  }
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

template <typename Fn>
int guarded(const char* what, Fn&& fn) noexcept {
  try {
    fn();
    return 0;
  } catch (const std::exception& e) {
    set_error(std::string("cucache_torch: ") + what + ": " + e.what(), false);
  } catch (...) {
    set_error(std::string("cucache_torch: ") + what + ": unknown error", false);
  }
  return -1;
}

}  // namespace
}  // namespace cucache::detail

using namespace cucache;
using namespace cucache::detail;

extern "C" {

void* cucache_torch_alloc(size_t size, int device, cucache_torch_stream stream) {
  if (size == 0) return nullptr;
  try {
    return get_or_create(device).allocate(size, stream);
  } catch (const out_of_memory& e) {
    set_error(std::string("cucache_torch: out of memory: ") + e.what(), true);
    if (plugin().throw_on_oom) throw;  // opt-in: torch turns it into a RuntimeError
  } catch (const std::exception& e) {
    set_error(std::string("cucache_torch: alloc(") + std::to_string(size) + " bytes, device " +
                  std::to_string(device) + ") failed: " + e.what(),
              true);
    if (plugin().throw_on_oom) throw;
  } catch (...) {
    set_error("cucache_torch: alloc failed: unknown error", true);
  }
  return nullptr;
}

void cucache_torch_free(void* ptr, size_t /*size*/, int device, cucache_torch_stream stream) {
  if (ptr == nullptr) return;
  try {
    device_allocator* a = existing(device);
    if (a != nullptr) {
      try {
        // Stream-ordered: a free on another stream than the allocation's defers reuse until the
        // work queued on `stream` now has completed (docs/torch.md).
        a->deallocate(ptr, stream);
        return;
      } catch (const invalid_argument&) {
        // torch passes the allocation's device; a caller that does not still gets its memory
        // back. Only this (rare) path pays for the search.
        device_allocator* other = owner_of(ptr, -1);
        if (other == nullptr) throw;
        other->deallocate(ptr, stream);
        return;
      }
    }
    a = owner_of(ptr, -1);
    if (a == nullptr) {
      plugin().bad_frees.fetch_add(1, std::memory_order_relaxed);
      char text[160];
      std::snprintf(text, sizeof text,
                    "cucache_torch: free(%p) on device %d: no cucache allocator holds it (it was "
                    "not allocated by cucache)",
                    ptr, device);
      set_error(text, true);
      return;
    }
    a->deallocate(ptr, stream);
  } catch (const invalid_argument& e) {
    plugin().bad_frees.fetch_add(1, std::memory_order_relaxed);
    set_error(e.what(), true);
  } catch (const std::exception& e) {
    set_error(std::string("cucache_torch: free failed: ") + e.what(), true);
  } catch (...) {
    set_error("cucache_torch: free failed: unknown error", true);
  }
}

int cucache_torch_record_stream(void* ptr, cucache_torch_stream stream) {
  return guarded("record_stream", [&] {
    device_allocator* a = owner_of(ptr, 0);
    if (a == nullptr) {
      char text[128];
      std::snprintf(text, sizeof text, "%p is not a live cucache allocation", ptr);
      throw invalid_argument(text);
    }
    a->record_stream(ptr, stream);
  });
}

int cucache_torch_empty_cache(void) {
  return guarded("empty_cache", [] {
    for (int d = 0; d < k_max_devices; ++d) {
      if (device_allocator* a = existing(d)) a->empty_cache();
    }
  });
}

int cucache_torch_reset_peak_stats(int device) {
  return guarded("reset_peak_stats", [&] {
    for (int d = 0; d < k_max_devices; ++d) {
      device_allocator* a = existing(d);
      if (a != nullptr && (device < 0 || d == device)) a->reset_peak_stats();
    }
  });
}

int cucache_torch_reset_accumulated_stats(int device) {
  return guarded("reset_accumulated_stats", [&] {
    for (int d = 0; d < k_max_devices; ++d) {
      device_allocator* a = existing(d);
      if (a != nullptr && (device < 0 || d == device)) a->reset_accumulated_stats();
    }
  });
}

int cucache_torch_set_memory_fraction(int device, double fraction) {
  return guarded("set_memory_fraction", [&] {
    if (device < 0 || device >= k_max_devices) {
      throw invalid_argument("device " + std::to_string(device) + " is out of range");
    }
    if (!(fraction > 0.0 && fraction <= 1.0)) {
      throw invalid_argument("fraction " + std::to_string(fraction) + " is not in (0, 1]");
    }
    auto& p = plugin();
    std::lock_guard lk(p.create_mu);
    if (existing(device) != nullptr) {
      throw invalid_argument("device " + std::to_string(device) +
                             " has allocated already; the cap can only be set before its first "
                             "allocation (or with CUCACHE_CONF=memory_fraction:F)");
    }
    p.fractions[static_cast<std::size_t>(device)] = fraction;
  });
}

int cucache_torch_get_stats(int device, cucache_torch_stats* out) {
  return guarded("get_stats", [&] {
    if (out == nullptr) throw invalid_argument("out is NULL");
    *out = cucache_torch_stats{};
    device_allocator* a = existing(device);
    if (a == nullptr) return;  // an unused device: nothing reserved, nothing allocated
    const device_stats s = a->stats();
    copy_stat_array(s.allocated_bytes, out->allocated_bytes);
    copy_stat_array(s.reserved_bytes, out->reserved_bytes);
    copy_stat_array(s.active_bytes, out->active_bytes);
    copy_stat_array(s.requested_bytes, out->requested_bytes);
    copy_stat_array(s.inactive_split_bytes, out->inactive_split_bytes);
    copy_stat_array(s.allocation_count, out->allocation);
    copy_stat_array(s.segment_count, out->segment);
    copy_stat_array(s.active_count, out->active);
    copy_stat_array(s.inactive_split_count, out->inactive_split);
    out->num_device_alloc = s.device_alloc_count;
    out->num_device_free = s.device_free_count;
    out->num_ooms = s.oom_count;
    out->num_alloc_retries = s.alloc_retry_count;
    out->oversize_allocations = s.oversize_allocations;
    out->oversize_segments = s.oversize_segments;
    out->events_pending = s.events_pending;
    out->vm_create_count = s.vm_create_count;
    out->vm_release_count = s.vm_release_count;
    out->vm_map_count = s.vm_map_count;
    out->vm_unmap_count = s.vm_unmap_count;
    out->stitched_pages = s.stitched_pages;
    out->mapped_bytes = s.mapped_bytes;
    out->unmapped_handle_bytes = s.unmapped_handle_bytes;
    out->free_bytes = s.free_bytes;
    out->free_block_count = s.free_block_count;
    out->largest_free_block = s.largest_free_block;
    out->memory_limit = s.memory_limit;
    out->device_total_bytes = s.device_total_bytes;
    out->fragmentation_external = s.external_fragmentation();
    out->fragmentation_overhead = s.overhead_fragmentation();
  });
}

size_t cucache_torch_stats_size(void) {
  return sizeof(cucache_torch_stats);
}

int64_t cucache_torch_memory_summary(int device, char* buf, size_t len) {
  std::int64_t n = -1;
  guarded("memory_summary", [&] {
    device_allocator* a = existing(device);
    const std::string text =
        a != nullptr ? a->memory_summary()
                     : "cucache: device " + std::to_string(device) + " has allocated nothing yet\n";
    n = copy_out(text, buf, len);
  });
  return n;
}

int64_t cucache_torch_snapshot_json(int device, char* buf, size_t len) {
  std::int64_t n = -1;
  guarded("snapshot_json", [&] {
    device_allocator* a = existing(device);
    n = copy_out(a != nullptr ? a->snapshot_json() : std::string("{\"segments\":[]}"), buf, len);
  });
  return n;
}

const char* cucache_torch_last_error(void) {
  thread_local std::string copy;
  try {
    auto& p = plugin();
    std::lock_guard lk(p.error_mu);
    copy = p.last_error;
  } catch (...) {
    return "cucache_torch: out of host memory";
  }
  return copy.c_str();
}

void cucache_torch_set_error(const char* message) {
  try {
    set_error(message != nullptr ? message : "", false);
  } catch (...) {
  }
}

uint64_t cucache_torch_bad_free_count(void) {
  return plugin().bad_frees.load(std::memory_order_relaxed);
}

const char* cucache_torch_backend_name(void) {
  return plugin().sim ? "sim" : "cuda";
}

int cucache_torch_sim_complete_all(void) {
  return guarded("sim_complete_all", [] {
    auto& p = plugin();
    if (!p.sim) throw invalid_argument("the backend is not the simulated one");
    std::lock_guard lk(p.create_mu);
    for (auto& s : p.sims) {
      if (s) s->complete_all();
    }
  });
}

}  // extern "C"
