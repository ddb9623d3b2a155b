// The process registry (registry.hpp).
#include "api/registry.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <pthread.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>

#include "cucache/cucache.hpp"
#include "cucache/errors.hpp"
#include "cucache/trace.hpp"
#include "observe/observe_hub.hpp"

namespace cucache::detail {
namespace {

/// Copies the size rules that set_size_rules changes (PyTorch's _set_allocator_settings keys).
void copy_size_rules(const config& from, config& to) {
  to.max_split_size = from.max_split_size;
  to.max_non_split_rounding = from.max_non_split_rounding;
  to.roundup_power2_divisions = from.roundup_power2_divisions;
  to.garbage_collection_threshold = from.garbage_collection_threshold;
}

// Never deleted (except by reset_for_testing): destroying allocators at static destruction time
// would call into a CUDA runtime that may already be torn down.
constinit std::atomic<registry*> g_registry{nullptr};
// A forked child's copy of the parent's registry (after_fork_in_child), never destroyed.
constinit std::atomic<registry*> g_abandoned_registry{nullptr};
constinit detail::mutex g_init_mu;
bool g_atexit_registered GUARDED_BY(g_init_mu) = false;
bool g_atfork_registered GUARDED_BY(g_init_mu) = false;

// Fork. A child forked after the registry was built shares nothing with the parent's device: CUDA
// contexts do not survive fork (the runtime answers cudaErrorInitializationError in the child),
// the sim's memory is a copy, and the allocators' pointers, events and streams name the parent's
// objects. The child handler therefore takes the registry out of the child's reach, at no cost to
// the hot path (instance() still reads one pointer): g_registry becomes nullptr, and the slow path
// then reports the fork instead of building a second registry over the parent's state. The
// parent's registry is leaked in the child, never destroyed: destroying it would free the
// parent's memory through handles that are not the child's.
constinit std::atomic<bool> g_forked_child{false};
constinit std::atomic<long> g_parent_pid{0};

// A fork copies the mutexes as they are: one held by another thread of the parent at that moment
// would stay locked forever in the child. The handlers hold the registry's own (process-wide)
// mutexes across the fork, so the child gets them unlocked and consistent.
detail::mutex g_error_mu;
std::string g_last_error GUARDED_BY(g_error_mu);

void before_fork() noexcept ACQUIRE(g_init_mu, g_error_mu) {
  g_init_mu.lock();
  g_error_mu.lock();
}
void after_fork_in_parent() noexcept RELEASE(g_init_mu, g_error_mu) {
  g_error_mu.unlock();
  g_init_mu.unlock();
}
void after_fork_in_child() noexcept RELEASE(g_init_mu, g_error_mu) {
  if (g_registry.load(std::memory_order_relaxed) != nullptr) {
    g_parent_pid.store(static_cast<long>(getppid()), std::memory_order_relaxed);
    g_forked_child.store(true, std::memory_order_relaxed);
    // The parent's registry is abandoned, never destroyed (its destructor would free the parent's
    // memory through the child's copy of the device state). Kept reachable from a global so that
    // leak checkers see it as the deliberate copy it is, not as a leak.
    g_abandoned_registry.store(g_registry.load(std::memory_order_relaxed),
                               std::memory_order_release);
    g_registry.store(nullptr, std::memory_order_release);
  }
  g_error_mu.unlock();
  g_init_mu.unlock();
}

// At normal exit (std::exit or return from main): write the trace, and give cached memory back
// while the runtime is still up -- its own exit handler was registered before this one (the
// census called it first), so it runs after (docs/design.md, "Fork and process exit"). Tools such
// as compute-sanitizer's leak check then see only what the program itself never freed. In a
// forked child g_registry is nullptr: the child writes none of the parent's trace rows and frees
// none of its memory.
void flush_trace_and_empty_cache_at_exit() noexcept {
  registry* r = g_registry.load(std::memory_order_acquire);
  if (r == nullptr) return;
  try {
    r->flush_trace();
  } catch (...) {
    // Nothing can report it at exit.
  }
  try {
    r->empty_cache();
  } catch (...) {
  }
}

[[noreturn]] void throw_unusable(const device_census& c) {
  throw cuda_error("cudaGetDeviceCount", c.error_code, c.error_message);
}

int sim_devices_from_env() {
  const char* env = std::getenv("CUCACHE_SIM_DEVICES");
  if (env == nullptr || *env == '\0') return 1;
  char* end = nullptr;
  const long n = std::strtol(env, &end, 10);
  if (*end != '\0' || n < 1 || n > 64) {
    throw environment_error(fmt::format(
        "environment variable CUCACHE_SIM_DEVICES: '{}' is not a device count in [1, 64]", env));
  }
  return static_cast<int>(n);
}

thread_local std::string t_last_error;

}  // namespace

// --- building ----------------------------------------------------------------------------------

registry::registry() {
  try {
    kind_ = backend_kind_from_env();
  } catch (const invalid_argument& e) {
    throw environment_error(e.what());
  }
  try {
    cfg_ = config_from_env();
  } catch (const invalid_argument& e) {
    throw environment_error(e.what());
  }
  note_pytorch_settings();
  if (kind_ == backend_kind::sim) {
    census_.count = sim_devices_from_env();
  } else {
    // Kept, not thrown: a machine without a GPU stays that way, and every allocation reports the
    // same cause without asking the runtime again.
    census_ = count_devices(kind_);
  }
  const auto n = static_cast<std::size_t>(census_.count);
  slots_ = std::make_unique<std::atomic<device_allocator*>[]>(n);
  fractions_.assign(n, -1.0);
  if (!cfg_.trace_path.empty()) {
    try {
      trace_ = std::make_shared<trace_recorder>(cfg_.trace_path);
    } catch (const invalid_argument& e) {
      throw environment_error(
          fmt::format("environment variable CUCACHE_CONF: trace: {}", e.what()));
    }
  }
  if (cfg_.record_backtraces && !backtraces_available()) {
    throw environment_error(fmt::format(
        "environment variable CUCACHE_CONF: key 'record_backtraces': call stacks cannot be "
        "captured: {}",
        backtraces_unavailable_reason()));
  }
  hub_ = std::make_shared<observe_hub>(
      cfg_, trace_ != nullptr ? make_trace_observer(trace_) : nullptr, census_.count);
  observing_.store(
      trace_ != nullptr || hub_->history_on() || hub_->leak_on() || hub_->always_record(),
      std::memory_order_release);
}

void registry::activate_observers() {
  if (observing_.load(std::memory_order_acquire)) return;
  detail::lock_guard lock(create_mu_);
  if (observing_.load(std::memory_order_relaxed)) return;
  for (int d = 0; d < census_.count; ++d) {
    if (device_allocator* a = slots_[static_cast<std::size_t>(d)].load(std::memory_order_acquire)) {
      a->attach_observer(hub_->observer_for(d));
    }
  }
  observing_.store(true, std::memory_order_release);
}

registry::~registry() {
  imports_.reset();  // closes what is still open, while the backends live
  for (int d = 0; d < census_.count; ++d) delete slots_[static_cast<std::size_t>(d)].load();
  // The recorder's destructor flushes the trace.
}

registry& registry::instance() {
  if (registry* r = g_registry.load(std::memory_order_acquire)) [[likely]]
    return *r;
  detail::lock_guard lock(g_init_mu);
  if (registry* r = g_registry.load(std::memory_order_acquire)) return *r;
  require_not_forked();
  auto* r = new registry();  // throws, storing nothing, on a bad environment
  if (!g_atexit_registered) {
    // Only normal exit gets here; std::atexit fails only when its table is full.
    g_atexit_registered = std::atexit([] { flush_trace_and_empty_cache_at_exit(); }) == 0;
  }
  if (!g_atfork_registered) {
    // Registered with the first registry: a child forked before cucache was used has no parent
    // state to inherit and may use cucache as any process does.
    g_atfork_registered =
        pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child) == 0;
  }
  g_registry.store(r, std::memory_order_release);
  return *r;
}

registry* registry::if_built() noexcept {
  return g_registry.load(std::memory_order_acquire);
}

bool registry::forked_child() noexcept {
  return g_forked_child.load(std::memory_order_relaxed);
}

void registry::require_not_forked() {
  if (!forked_child()) [[likely]]
    return;
  throw cuda_error(
      "cucache", static_cast<int>(cudaErrorInitializationError),
      fmt::format("this process (pid {}) was forked from process {} after that process used "
                  "cucache; a forked child cannot use its parent's device state (CUDA contexts, "
                  "allocations, streams and events do not survive fork). Use cucache in the "
                  "parent only, or start the child with exec (e.g. multiprocessing's 'spawn')",
                  static_cast<long>(getpid()), g_parent_pid.load(std::memory_order_relaxed)));
}

void registry::reset_for_testing() {
  detail::lock_guard lock(g_init_mu);
  registry* r = g_registry.load(std::memory_order_acquire);
  if (r == nullptr) return;
  if (r->kind_ == backend_kind::cuda) {
    for (int d = 0; d < r->census_.count; ++d) {
      if (r->find(d) != nullptr) {
        throw std::logic_error(
            "cucache::detail::reset_for_testing: refused with CUCACHE_BACKEND=cuda once an "
            "allocator exists (it would free device memory the program may still use)");
      }
    }
  }
  g_registry.store(nullptr, std::memory_order_release);
  delete r;
}

// --- devices -----------------------------------------------------------------------------------

int registry::current_device() const {
  // With one device (the simulated backend's default) it is current: only a machine with several
  // needs the runtime's answer, which costs a call on every malloc and free.
  if (census_.count == 1) return 0;
  if (census_.count == 0) throw_unusable(census_);
  if (kind_ == backend_kind::sim) return 0;  // the simulated devices have no "current" one
  return current_cuda_device();
}

int registry::try_current_device() const noexcept {
  if (census_.count == 1 || kind_ == backend_kind::sim) return census_.count > 0 ? 0 : -1;
  if (census_.count == 0) return -1;
  return try_current_cuda_device();
}

void registry::note_pytorch_settings() {
  // PyTorch's variables configure PyTorch's allocator, not cucache's: said once, so that a
  // program moved to cucache with them set does not silently run with the defaults.
  // (cucache.torch.install() applies them to CUCACHE_CONF itself, docs/torch.md.)
  const char* own = std::getenv("CUCACHE_CONF");
  if (own != nullptr && *own != '\0') return;
  for (const char* name : {"PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"}) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') continue;
    std::fprintf(stderr,
                 "cucache: %s is set, but it configures PyTorch's allocator, not cucache, which "
                 "runs with its defaults: give the keys to CUCACHE_CONF (same syntax; "
                 "docs/config.md)\n",
                 name);
    return;
  }
}

device_allocator& registry::create(int device) {
  if (kind_ == backend_kind::cuda && census_.count == 0) throw_unusable(census_);
  if (device < 0 || device >= census_.count) {
    throw cuda_error("cucache::get", static_cast<int>(cudaErrorInvalidDevice),
                     fmt::format("invalid device ordinal {} ({} {} device{})", device,
                                 census_.count, to_string(kind_), census_.count == 1 ? "" : "s"));
  }
  detail::lock_guard lock(create_mu_);
  auto& slot = slots_[static_cast<std::size_t>(device)];
  if (device_allocator* a = slot.load(std::memory_order_acquire)) return *a;
  config cfg = cfg_;
  if (size_rules_) copy_size_rules(*size_rules_, cfg);
  const double fraction = fractions_[static_cast<std::size_t>(device)];
  if (fraction > 0) cfg.memory_fraction = fraction;
  // The simulated devices know how many there are (their peers), and may keep host memory behind
  // every byte (CUCACHE_SIM_HOST_MEMORY=1) so that tests through the global API check contents.
  sim_options sim;
  sim.device_count = census_.count;
  if (const char* h = std::getenv("CUCACHE_SIM_HOST_MEMORY"); h != nullptr && *h == '1') {
    sim.host_memory = true;
  }
  auto backend = make_backend(kind_, device, sim);
  device_allocator* a = nullptr;
  try {
    a = new device_allocator(
        std::move(backend), std::move(cfg),
        observing_.load(std::memory_order_acquire) ? hub_->observer_for(device) : nullptr);
  } catch (const invalid_argument& e) {
    // The only caller-supplied input here is the config, so the fault is CUCACHE_CONF's.
    throw environment_error(fmt::format("environment variable CUCACHE_CONF: {}", e.what()));
  }
  // A fraction of 0 is no config value (0 there means none): the allocator takes it as a cap.
  if (fraction == 0.0) a->set_memory_fraction(0.0);
  a->set_captures_announced(captures_announced_);
  a->set_stream_destructions_announced(stream_destructions_announced_);
  for (std::uint64_t i = 0; i < announced_captures_; ++i) a->announce_capture_begin();
  slot.store(a, std::memory_order_release);
  return *a;
}

void registry::set_memory_fraction(int device, double fraction) {
  if (device < 0 || device >= census_.count) {
    throw invalid_argument(fmt::format("set_memory_fraction: device {} does not exist ({} {})",
                                       device, census_.count, to_string(kind_)));
  }
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    throw invalid_argument(
        fmt::format("set_memory_fraction: fraction {} is not in [0, 1]", fraction));
  }
  detail::lock_guard lock(create_mu_);
  // Before the device's first allocation the cap goes into its allocator's config; after, the
  // allocator changes its cap at once (device_allocator::set_memory_fraction).
  if (device_allocator* a = find(device)) {
    a->set_memory_fraction(fraction);
    return;
  }
  fractions_[static_cast<std::size_t>(device)] = fraction;
}

void registry::set_captures_announced(bool on) {
  detail::lock_guard lock(create_mu_);
  captures_announced_ = on;
  for_each_created([&](device_allocator& a) { a.set_captures_announced(on); });
}

void registry::set_stream_destructions_announced(bool on) {
  detail::lock_guard lock(create_mu_);
  stream_destructions_announced_ = on;
  for_each_created([&](device_allocator& a) { a.set_stream_destructions_announced(on); });
}

void registry::announce_capture_begin() {
  detail::lock_guard lock(create_mu_);
  ++announced_captures_;
  for_each_created([&](device_allocator& a) { a.announce_capture_begin(); });
}

void registry::announce_capture_end() {
  detail::lock_guard lock(create_mu_);
  if (announced_captures_ == 0) {
    throw invalid_argument(
        "cucache::announce_capture_end: no announced capture is active (every end must follow "
        "its own announce_capture_begin)");
  }
  --announced_captures_;
  // Every created allocator saw each begin counted here (create copies the count): none refuses.
  for_each_created([&](device_allocator& a) { a.announce_capture_end(); });
}

void registry::set_size_rules(std::string_view text) {
  // PyTorch's reset: max_split_size, roundup_power2_divisions and garbage_collection_threshold
  // go back to their defaults; max_non_split_rounding keeps its value unless given.
  // Only size-rule keys, whatever their values (expandable_segments:False is no size rule either).
  for (const auto& [key, value] : config_entries(text)) {
    if (key != "max_split_size_mb" && key != "max_non_split_rounding_mb" &&
        key != "roundup_power2_divisions" && key != "garbage_collection_threshold") {
      throw invalid_argument(fmt::format(
          "set_size_rules: '{}' is not a size rule that can change at run time (those are "
          "max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions and "
          "garbage_collection_threshold)",
          key));
    }
  }
  detail::lock_guard lock(create_mu_);
  config base;
  base.max_non_split_rounding = (size_rules_ ? *size_rules_ : cfg_).max_non_split_rounding;
  const config parsed = parse_config(text, base);
  std::exception_ptr first_error;
  for_each_created([&](device_allocator& a) {
    config next = a.get_config();
    copy_size_rules(parsed, next);
    try {
      a.set_size_rules(next);
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  });
  size_rules_ = parsed;
  if (first_error) std::rethrow_exception(first_error);
}

double registry::memory_fraction(int device) {
  if (device < 0 || device >= census_.count) {
    throw invalid_argument(fmt::format("memory_fraction: device {} does not exist ({} {})", device,
                                       census_.count, to_string(kind_)));
  }
  detail::lock_guard lock(create_mu_);
  if (const device_allocator* a = find(device)) return a->memory_fraction();
  if (const double f = fractions_[static_cast<std::size_t>(device)]; f >= 0) return f;
  return cfg_.memory_fraction > 0 ? cfg_.memory_fraction : 1.0;
}

device_backend* registry::backend_of(int device) const noexcept {
  device_allocator* a = find(device);
  return a != nullptr ? &a->backend() : nullptr;
}

// --- the owner of a pointer --------------------------------------------------------------------

namespace {
bool apply(device_allocator& a, void* ptr, stream_handle stream, release_kind kind) {
  switch (kind) {
    case release_kind::plain:
      return a.try_deallocate(ptr, nullptr, false);
    case release_kind::ordered:
      return a.try_deallocate(ptr, stream, true);
    case release_kind::record:
      return a.try_record_stream(ptr, stream);
  }
  return false;
}
}  // namespace

bool registry::release(void* ptr, stream_handle stream, release_kind kind, int hint) {
  if (device_allocator* a = find(hint)) [[likely]] {
    if (apply(*a, ptr, stream, kind)) return true;
  }
  // Not the hinted device's: a multi-GPU program may free after switching devices.
  for (int d = 0; d < census_.count; ++d) {
    if (d == hint) continue;
    if (device_allocator* a = find(d); a != nullptr && apply(*a, ptr, stream, kind)) return true;
  }
  return false;
}

void registry::empty_cache() {
  std::exception_ptr first;
  for (int d = 0; d < census_.count; ++d) {
    device_allocator* a = find(d);
    if (a == nullptr) continue;
    try {
      a->empty_cache();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

std::string registry::torch_snapshot() const {
  std::vector<const device_allocator*> by_device;
  for (int d = 0; d < census_.count; ++d) by_device.push_back(find(d));
  std::string out = torch_snapshot_json(by_device, *hub_);
  hub_->note_snapshot();
  return out;
}

void registry::flush_trace() {
  if (trace_ != nullptr) trace_->flush();
}

namespace {
/// The explanation when no allocator can say more about ptr.
std::string unknown_pointer_text(const void* ptr, const char* what) {
  return fmt::format(
      "cucache::{}: {} is not the start of a live cucache allocation (unknown pointer, interior "
      "pointer or already freed)",
      what, ptr);
}
}  // namespace

std::string registry::explain_bad_pointer(const void* ptr, const char* what, int hint,
                                          bool hint_named) const {
  // A pointer of another device (a double free after switching devices) is explained by the
  // allocator whose segment holds it, which names its own device.
  for (int d = 0; d < census_.count; ++d) {
    const device_allocator* a = find(d);
    if (a == nullptr || !a->locate(ptr).in_segment) continue;
    std::string text = a->explain_bad_pointer(ptr, what);
    if (hint >= 0 && hint != d) {
      // A call without a device was for no device: only the current one can be named.
      text += fmt::format(" (the address is device {}'s memory; {} {})", d,
                          hint_named ? "the call was for device" : "the current device is", hint);
    }
    return text;
  }
  if (!hint_named) {
    // The release tried every device: the pointer is no live allocation of any.
    return fmt::format(
        "cucache: {}({}): it is not a live allocation of any device (not allocated by cucache, "
        "or freed already and its memory returned to the driver)",
        what, ptr);
  }
  if (const device_allocator* a = find(hint)) {
    return a->explain_bad_pointer(ptr, what) + " nor on any other device";
  }
  return unknown_pointer_text(ptr, what);
}

void throw_not_ours(const void* ptr, release_kind kind, int current) {
  // In a forked child the pointer may well be the parent's: say why nothing can release it.
  registry::require_not_forked();
  const char* what = kind == release_kind::record ? "record_stream" : "free";
  if (registry* r = registry::if_built())
    throw invalid_argument(r->explain_bad_pointer(ptr, what, current, false));
  throw invalid_argument(unknown_pointer_text(ptr, what));
}

// --- errors ------------------------------------------------------------------------------------

void set_last_error(std::string_view message) noexcept {
  try {
    t_last_error.assign(message);
    detail::lock_guard lock(g_error_mu);
    g_last_error.assign(message);
  } catch (...) {
    // Out of host memory while reporting: the text is lost, the code still says what failed.
    t_last_error.clear();
  }
}

const char* thread_last_error() noexcept {
  return t_last_error.c_str();
}

std::string process_last_error() {
  detail::lock_guard lock(g_error_mu);
  return g_last_error;
}

int error_code_of_current_exception(const char* function) noexcept {
  auto fail = [&](cudaError_t code, std::string_view what) {
    try {
      set_last_error(std::string(function) + ": " + std::string(what));
    } catch (...) {
      set_last_error("");
    }
    return static_cast<int>(code);
  };
  // The order matters: environment_error is an invalid_argument, out_of_memory a bad_alloc.
  try {
    throw;
  } catch (const out_of_memory& e) {
    return fail(cudaErrorMemoryAllocation, e.what());
  } catch (const environment_error& e) {
    return fail(cudaErrorInitializationError, e.what());
  } catch (const invalid_argument& e) {
    return fail(cudaErrorInvalidValue, e.what());
  } catch (const cuda_error& e) {
    return fail(e.code() != 0 ? static_cast<cudaError_t>(e.code()) : cudaErrorUnknown, e.what());
  } catch (const std::bad_alloc&) {
    return fail(cudaErrorMemoryAllocation, "host out of memory");
  } catch (const std::exception& e) {
    return fail(cudaErrorUnknown, e.what());
  } catch (...) {
    return fail(cudaErrorUnknown, "unknown exception");
  }
}

}  // namespace cucache::detail
