// The global per-device allocators behind cucache::malloc/free and the C API: chosen by
// CUCACHE_BACKEND, configured by CUCACHE_CONF, created lazily and never destroyed, and traced here
// (not in the core) when CUCACHE_CONF names a trace file.
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <atomic>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>

#include "cucache/config.hpp"
#include "cucache/cucache.hpp"
#include "cucache/cuda_backend.hpp"
#include "cucache/detail/global.hpp"
#include "cucache/sim_backend.hpp"
#include "cucache/trace.hpp"

namespace cucache {
namespace detail {
namespace {

enum class backend_kind : std::uint8_t { cuda, sim };

// What the trace's free row repeats of its allocation.
struct live_allocation {
  std::size_t size;
  stream_handle stream;
};

// Everything the global API owns. Built once under g_init_mu and then read without locks: only
// the allocator slots change afterwards, each from null to its final value.
struct global_state {
  backend_kind kind = backend_kind::cuda;
  int device_count = 0;
  // Why CUDA is unusable (cudaGetDeviceCount's answer); 0 when devices were found.
  int cuda_error_code = 0;
  std::string cuda_error_message;
  config cfg;
  std::unique_ptr<std::atomic<device_allocator*>[]> allocators;  // device_count slots
  std::mutex create_mu;

  // Tracing (cfg.trace_path set). The map gives a free row the size and stream of its allocation.
  std::unique_ptr<trace_recorder> trace;
  std::mutex live_mu;
  std::unordered_map<const void*, live_allocation> live;
};

// Never deleted (except by reset_for_testing): destroying allocators at static destruction time
// would call into a CUDA runtime that may already be torn down.
constinit std::atomic<global_state*> g_state{nullptr};
constinit std::mutex g_init_mu;
bool g_atexit_registered = false;  // guarded by g_init_mu

void flush_trace_at_exit() noexcept {
  global_state* s = g_state.load(std::memory_order_acquire);
  if (s == nullptr) return;
  if (s->trace != nullptr) {
    try {
      s->trace->flush();
    } catch (...) {
      // Nothing can report it at exit.
    }
  }
  // Give cached memory back while the runtime is still up (its own exit handler was registered
  // before this one, when make_state first called it, so it runs after): tools such as
  // compute-sanitizer's leak check then see only what the program itself never freed.
  try {
    cucache::empty_cache();
  } catch (...) {
  }
}

[[noreturn]] void throw_runtime(const char* call, cudaError_t code) {
  // The exception reports it; clear the runtime's slot so it does not resurface in the caller's
  // next cudaGetLastError.
  static_cast<void>(cudaGetLastError());
  throw cuda_error(call, static_cast<int>(code), cudaGetErrorString(code));
}

std::unique_ptr<global_state> make_state() {
  auto s = std::make_unique<global_state>();
  const char* env = std::getenv("CUCACHE_BACKEND");
  const std::string_view name = env != nullptr ? env : "";
  if (name.empty() || name == "cuda") {
    s->kind = backend_kind::cuda;
  } else if (name == "sim") {
    s->kind = backend_kind::sim;
  } else {
    throw environment_error(fmt::format(
        "environment variable CUCACHE_BACKEND: unknown backend '{}' (accepted: cuda, sim; unset "
        "or empty means cuda)",
        name));
  }
  try {
    s->cfg = config_from_env();
  } catch (const invalid_argument& e) {
    throw environment_error(e.what());
  }

  if (s->kind == backend_kind::sim) {
    s->device_count = 1;
  } else {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count <= 0) {
      const cudaError_t code = err != cudaSuccess ? err : cudaErrorNoDevice;
      static_cast<void>(cudaGetLastError());
      // Kept, not thrown: a machine without a GPU stays that way, and every allocation reports
      // the same cause without asking the runtime again.
      s->cuda_error_code = static_cast<int>(code);
      s->cuda_error_message = cudaGetErrorString(code);
      count = 0;
    }
    s->device_count = count;
  }
  s->allocators =
      std::make_unique<std::atomic<device_allocator*>[]>(static_cast<std::size_t>(s->device_count));

  if (!s->cfg.trace_path.empty()) {
    try {
      s->trace = std::make_unique<trace_recorder>(s->cfg.trace_path);
    } catch (const invalid_argument& e) {
      throw environment_error(
          fmt::format("environment variable CUCACHE_CONF: trace: {}", e.what()));
    }
  }
  return s;
}

global_state* init_state() {
  std::lock_guard lock(g_init_mu);
  if (global_state* s = g_state.load(std::memory_order_acquire)) return s;
  auto s = make_state();
  if (!g_atexit_registered) {
    // Only normal exit gets here; std::atexit fails only when its table is full.
    g_atexit_registered = std::atexit([] { flush_trace_at_exit(); }) == 0;
  }
  global_state* raw = s.release();
  g_state.store(raw, std::memory_order_release);
  return raw;
}

global_state& state() {
  global_state* s = g_state.load(std::memory_order_acquire);
  if (s == nullptr) [[unlikely]]
    s = init_state();
  return *s;
}

[[noreturn]] void throw_cuda_unusable(const global_state& s) {
  throw cuda_error("cudaGetDeviceCount", s.cuda_error_code, s.cuda_error_message);
}

int current_device(const global_state& s) {
  // With one device (the simulated backend always has one) it is current: only a machine with
  // several needs the runtime's answer, which costs a call on every malloc and free.
  if (s.device_count == 1) return 0;
  if (s.device_count == 0) throw_cuda_unusable(s);
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    throw_runtime("cudaGetDevice", err);
  }
  return device;
}

// The current device's created allocator, or nullptr; never throws, never creates.
device_allocator* current_if_created(const global_state& s, int& device) noexcept {
  device = -1;
  if (s.device_count == 1) {
    device = 0;
  } else if (s.device_count > 1) {
    if (cudaGetDevice(&device) != cudaSuccess) {
      static_cast<void>(cudaGetLastError());
      device = -1;
    }
  }
  if (device < 0 || device >= s.device_count) return nullptr;
  return s.allocators[static_cast<std::size_t>(device)].load(std::memory_order_acquire);
}

device_allocator& create_allocator(global_state& s, int device) {
  if (s.kind == backend_kind::cuda && s.device_count == 0) throw_cuda_unusable(s);
  if (device < 0 || device >= s.device_count) {
    throw cuda_error(
        "cucache::get", static_cast<int>(cudaErrorInvalidDevice),
        fmt::format("invalid device ordinal {} ({} {} device{})", device, s.device_count,
                    s.kind == backend_kind::sim ? "sim" : "cuda", s.device_count == 1 ? "" : "s"));
  }
  auto& slot = s.allocators[static_cast<std::size_t>(device)];
  std::lock_guard lock(s.create_mu);
  if (device_allocator* a = slot.load(std::memory_order_acquire)) return *a;
  std::shared_ptr<device_backend> backend;
  if (s.kind == backend_kind::sim) {
    backend = std::make_shared<sim_backend>();
  } else {
    backend = std::make_shared<cuda_backend>(device);
  }
  device_allocator* a = nullptr;
  try {
    a = new device_allocator(std::move(backend), s.cfg);
  } catch (const invalid_argument& e) {
    // The only caller-supplied input here is the config, so the fault is CUCACHE_CONF's.
    throw environment_error(fmt::format("environment variable CUCACHE_CONF: {}", e.what()));
  }
  slot.store(a, std::memory_order_release);
  return *a;
}

device_allocator& allocator_of(global_state& s, int device) {
  if (device >= 0 && device < s.device_count) [[likely]] {
    if (device_allocator* a =
            s.allocators[static_cast<std::size_t>(device)].load(std::memory_order_acquire)) {
      return *a;
    }
  }
  return create_allocator(s, device);
}

// --- freeing on whichever device owns the pointer ------------------------------------------------

enum class free_kind : std::uint8_t { plain, ordered, record };

void apply(device_allocator& a, void* ptr, stream_handle stream, free_kind kind) {
  switch (kind) {
    case free_kind::plain:
      a.deallocate(ptr);
      return;
    case free_kind::ordered:
      a.deallocate(ptr, stream);
      return;
    case free_kind::record:
      a.record_stream(ptr, stream);
      return;
  }
}

// Tries every created allocator but `skip`; true when one owned ptr.
bool apply_elsewhere(const global_state& s, int skip, void* ptr, stream_handle stream,
                     free_kind kind) {
  for (int d = 0; d < s.device_count; ++d) {
    if (d == skip) continue;
    device_allocator* a = s.allocators[static_cast<std::size_t>(d)].load(std::memory_order_acquire);
    if (a != nullptr && a->allocation_size(ptr) != 0) {
      apply(*a, ptr, stream, kind);
      return true;
    }
  }
  return false;
}

[[noreturn]] void throw_not_ours(const void* ptr, free_kind kind) {
  throw invalid_argument(fmt::format(
      "cucache::{}: {} is not the start of a live cucache allocation (unknown pointer, interior "
      "pointer or already freed)",
      kind == free_kind::record ? "record_stream" : "free", ptr));
}

void apply_anywhere(const global_state& s, void* ptr, stream_handle stream, free_kind kind) {
  int device = -1;
  if (device_allocator* a = current_if_created(s, device)) [[likely]] {
    try {
      apply(*a, ptr, stream, kind);
      return;
    } catch (const invalid_argument&) {
      // Not the current device's: a multi-GPU program may free after switching devices. The
      // exception is the slow path by design; the common case pays nothing for it.
      if (!apply_elsewhere(s, device, ptr, stream, kind)) throw;
      return;
    }
  }
  if (!apply_elsewhere(s, device, ptr, stream, kind)) throw_not_ours(ptr, kind);
}

// --- tracing -------------------------------------------------------------------------------------

void* traced_allocate(global_state& s, device_allocator& a, std::size_t bytes,
                      stream_handle stream) {
  void* ptr = nullptr;
  try {
    ptr = a.allocate(bytes, stream);
  } catch (...) {
    s.trace->record_failure(bytes, stream);
    throw;
  }
  if (ptr == nullptr) return ptr;  // zero bytes: nothing to replay
  try {
    std::lock_guard lock(s.live_mu);
    const auto it = s.live.insert_or_assign(ptr, live_allocation{bytes, stream}).first;
    try {
      s.trace->record_allocate(ptr, bytes, stream);
    } catch (...) {
      s.live.erase(it);
      throw;
    }
  } catch (...) {
    a.deallocate(ptr);
    throw;
  }
  return ptr;
}

void traced_release(global_state& s, void* ptr, stream_handle stream, free_kind kind) {
  {
    // The row is written before the memory is released: once released, another thread may get
    // the same address and record its allocation, which must come after this free in the file.
    std::lock_guard lock(s.live_mu);
    auto it = s.live.find(ptr);
    if (it != s.live.end()) {
      s.trace->record_free(ptr, it->second.size,
                           kind == free_kind::ordered ? stream : it->second.stream);
      s.live.erase(it);
    }
  }
  apply_anywhere(s, ptr, stream, kind);
}

}  // namespace

void reset_for_testing() {
  std::lock_guard lock(g_init_mu);
  global_state* s = g_state.load(std::memory_order_acquire);
  if (s == nullptr) return;
  if (s->kind == backend_kind::cuda) {
    for (int d = 0; d < s->device_count; ++d) {
      if (s->allocators[static_cast<std::size_t>(d)].load() != nullptr) {
        throw std::logic_error(
            "cucache::detail::reset_for_testing: refused with CUCACHE_BACKEND=cuda once an "
            "allocator exists (it would free device memory the program may still use)");
      }
    }
  }
  g_state.store(nullptr, std::memory_order_release);
  for (int d = 0; d < s->device_count; ++d) {
    delete s->allocators[static_cast<std::size_t>(d)].load();
  }
  delete s;  // the recorder's destructor flushes the trace
}

}  // namespace detail

using detail::free_kind;

void* malloc(std::size_t bytes, stream_handle stream) {
  detail::global_state& s = detail::state();
  device_allocator& a = detail::allocator_of(s, detail::current_device(s));
  if (s.trace == nullptr) [[likely]]
    return a.allocate(bytes, stream);
  return detail::traced_allocate(s, a, bytes, stream);
}

namespace {

// free, free_async and record_stream: no state means nothing was ever allocated, so the pointer
// cannot be ours; and none of them should fail on a bad environment that malloc already reported.
void release(void* ptr, stream_handle stream, free_kind kind) {
  detail::global_state* s = detail::g_state.load(std::memory_order_acquire);
  if (s == nullptr) detail::throw_not_ours(ptr, kind);
  if (s->trace == nullptr || kind == free_kind::record) [[likely]] {
    detail::apply_anywhere(*s, ptr, stream, kind);
  } else {
    detail::traced_release(*s, ptr, stream, kind);
  }
}

}  // namespace

void free(void* ptr) {
  if (ptr == nullptr) return;
  release(ptr, nullptr, free_kind::plain);
}

void free_async(void* ptr, stream_handle stream) {
  if (ptr == nullptr) return;
  release(ptr, stream, free_kind::ordered);
}

void record_stream(void* ptr, stream_handle stream) {
  if (ptr == nullptr) detail::throw_not_ours(ptr, free_kind::record);
  release(ptr, stream, free_kind::record);
}

device_allocator& get(int device) {
  return detail::allocator_of(detail::state(), device);
}

device_allocator& get() {
  detail::global_state& s = detail::state();
  return detail::allocator_of(s, detail::current_device(s));
}

void empty_cache() {
  detail::global_state* s = detail::g_state.load(std::memory_order_acquire);
  if (s == nullptr) return;
  // Every device gets its turn even if one fails; the first failure is reported.
  std::exception_ptr first;
  for (int d = 0; d < s->device_count; ++d) {
    device_allocator* a =
        s->allocators[static_cast<std::size_t>(d)].load(std::memory_order_acquire);
    if (a == nullptr) continue;
    try {
      a->empty_cache();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

std::string memory_summary(int device) {
  return get(device).memory_summary();
}

void flush_trace() {
  detail::global_state* s = detail::g_state.load(std::memory_order_acquire);
  if (s != nullptr && s->trace != nullptr) s->trace->flush();
}

}  // namespace cucache
