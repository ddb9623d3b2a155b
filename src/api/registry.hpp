// The process registry: the one place that turns the environment (CUCACHE_BACKEND, CUCACHE_CONF,
// CUCACHE_SIM_DEVICES) into one caching allocator per device, finds the owner of a pointer, and
// turns exceptions into the CUDA runtime's error codes and a last-error text. Every front end --
// the C++ global API (cucache.hpp), the C API (cucache.h), the PyTorch plug-in and the replay's
// global mode -- is a thin layer over it, so a behaviour of one holds for all.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "backend/thread_annotations.hpp"
#include "cucache/backend_factory.hpp"
#include "cucache/config.hpp"
#include "cucache/device_allocator.hpp"

namespace cucache {
class trace_recorder;
}

namespace cucache::detail {

class observe_hub;
struct ipc_imports;  // src/api/ipc.cpp

/// What a release does to a live allocation.
enum class release_kind : std::uint8_t {
  plain,    ///< free (cudaFree): reusable on its own stream at once
  ordered,  ///< free in the order of a stream (cudaFreeAsync)
  record,   ///< record_stream: mark it used on another stream too
};

class registry {
 public:
  /// The process's registry, built on first use from the environment. Throws environment_error
  /// (storing nothing: the next call reads the environment again) when CUCACHE_BACKEND,
  /// CUCACHE_SIM_DEVICES or CUCACHE_CONF is unusable or the trace file cannot be created.
  [[nodiscard]] static registry& instance();
  /// The registry if it was built, else nullptr. Never builds, never throws. In a child forked
  /// after the registry was built, nullptr: the parent's allocators are out of the child's reach.
  [[nodiscard]] static registry* if_built() noexcept;
  /// True in a process forked (fork(), without exec) after the registry was built: the parent's
  /// device state -- its CUDA contexts, allocations, events and streams -- is not the child's, so
  /// every call that would use it fails (docs/design.md, "Fork and process exit").
  [[nodiscard]] static bool forked_child() noexcept;
  /// Throws cuda_error (cudaErrorInitializationError, the runtime's answer in such a child)
  /// naming the fork, when forked_child().
  static void require_not_forked();

  [[nodiscard]] backend_kind kind() const noexcept { return kind_; }
  [[nodiscard]] int device_count() const noexcept { return census_.count; }
  /// The configuration every allocator of this registry is created with (CUCACHE_CONF).
  [[nodiscard]] const config& settings() const noexcept { return cfg_; }

  /// The calling thread's current device: 0 where there is one device, cudaGetDevice otherwise.
  /// Throws cuda_error when CUDA is unusable (the census's reason).
  [[nodiscard]] int current_device() const;
  /// As current_device, without throwing: -1 when unknown.
  [[nodiscard]] int try_current_device() const noexcept;

  /// The allocator of `device` if it was created, else nullptr. Never creates, never throws.
  [[nodiscard]] device_allocator* find(int device) const noexcept {
    if (device < 0 || device >= census_.count) return nullptr;
    return slots_[static_cast<std::size_t>(device)].load(std::memory_order_acquire);
  }
  /// Calls f(allocator) for every device's allocator created so far.
  template <class F>
  void for_each_created(F&& f) const {
    for (int d = 0; d < census_.count; ++d) {
      if (device_allocator* a = find(d)) f(*a);
    }
  }
  /// The allocator of `device`, created on first use. Throws cuda_error (cudaErrorInvalidDevice)
  /// for a device that does not exist or CUDA's reason when it is unusable.
  [[nodiscard]] device_allocator& allocator(int device) {
    if (device_allocator* a = find(device)) [[likely]]
      return *a;
    return create(device);
  }

  /// Applies `kind` to `ptr` on whichever created allocator owns it, trying device `hint` first
  /// (any value; -1 for none). False, with nothing changed, when no allocator owns it. Throws
  /// what the allocator throws (a device error while recording an event).
  bool release(void* ptr, stream_handle stream, release_kind kind, int hint);
  /// Why `what` (free, record_stream) cannot act on `ptr`, in the words of the allocator whose
  /// memory holds it -- whichever device the caller named (`hint`, -1 for none) -- or, when none
  /// does, of the hinted device's allocator. `hint_named`: the caller named device `hint` (torch's
  /// free passes the allocation's device); false when `hint` is only the current device of a call
  /// that takes none (cucacheFree, cucache::free, record_stream), which the text then does not
  /// claim the call was for. Never throws for a caller's mistake.
  [[nodiscard]] std::string explain_bad_pointer(const void* ptr, const char* what, int hint,
                                                bool hint_named = true) const;

  /// Caps `device`'s reserved memory at `fraction` (0 <= fraction <= 1) of its capacity: before
  /// its first allocation in its allocator's config, after it at once
  /// (device_allocator::set_memory_fraction). invalid_argument for a fraction outside [0, 1].
  void set_memory_fraction(int device, double fraction);
  /// The cap on `device`'s reserved memory as a fraction of its capacity: set_memory_fraction's,
  /// else the configuration's (CUCACHE_CONF's memory_fraction); 1.0 when there is none, as
  /// PyTorch answers. Throws invalid_argument for a device that does not exist.
  [[nodiscard]] double memory_fraction(int device);
  /// Sets the size rules of every device from now on, as PyTorch's _set_allocator_settings does:
  /// max_split_size_mb, roundup_power2_divisions and garbage_collection_threshold go back to
  /// their defaults (max_non_split_rounding_mb keeps its value), then take the values `text` gives
  /// (CUCACHE_CONF syntax, which is PyTorch's for these keys). Created allocators change at once
  /// (device_allocator::set_size_rules); those created later start with these rules.
  /// invalid_argument, with nothing changed, for a key of `text` that is not one of the four or a
  /// value parse_config refuses.
  void set_size_rules(std::string_view text);
  /// The captures-announced mode (device_allocator::set_captures_announced) for every device's
  /// allocator, those created later included: a front end that sees every capture turns it on.
  void set_captures_announced(bool on);
  /// A capture begins / has ended, announced to every device's allocator (a front end that
  /// cannot tell a capture's device announces it to all: only their capture queries come back
  /// while it lasts). announce_capture_end throws invalid_argument, changing nothing, when no
  /// announced capture is active.
  void announce_capture_begin();
  void announce_capture_end();
  /// The stream-destructions-announced mode (device_allocator::set_stream_destructions_announced)
  /// for every device's allocator, those created later included: a front end that sees every
  /// capture and every stream destruction turns it on, and announces each destruction with
  /// device_allocator::announce_stream_destruction (process-wide) before the driver performs it.
  void set_stream_destructions_announced(bool on);
  /// Prints one line when CUCACHE_CONF is unset and PyTorch's PYTORCH_ALLOC_CONF or
  /// PYTORCH_CUDA_ALLOC_CONF is set: those do not configure cucache (the registry's constructor).
  static void note_pytorch_settings();

  /// Empties the cache of every created allocator; every one gets its turn, the first failure is
  /// rethrown afterwards.
  void empty_cache();
  /// Writes buffered trace rows (CUCACHE_CONF=trace:PATH); no-op when tracing is off.
  void flush_trace();
  /// The observer every allocator of this registry reports to: device traces, live records, tags
  /// and step markers (observe/observe_hub.hpp).
  [[nodiscard]] observe_hub& hub() const noexcept { return *hub_; }
  /// The trace recorder (CUCACHE_CONF=trace:PATH), or nullptr when tracing is off: sleep and wake
  /// write their rows to it.
  [[nodiscard]] trace_recorder* recorder() const noexcept { return trace_.get(); }
  /// Gives every device allocator the observe hub's observer, now and at creation, once the
  /// program uses a feature that needs it while none configured one (a tag): until then the
  /// allocators have no observer and pay nothing for it. Idempotent, thread-safe.
  void activate_observers();
  /// PyTorch's snapshot of every created allocator (cucache::snapshot).
  [[nodiscard]] std::string torch_snapshot() const;
  /// The backend of a created allocator, else nullptr.
  [[nodiscard]] device_backend* backend_of(int device) const noexcept;

  /// The blocks of other processes this process has open (cucacheIpcOpenHandle), created on
  /// first use (src/api/ipc.cpp). Closed, whatever is still open, before the allocators go.
  [[nodiscard]] ipc_imports& imports();

  /// Drops the registry and every allocator it created (flushing the trace), so that the next
  /// call reads the environment again. Only for the simulated backend: with CUDA it throws
  /// std::logic_error once an allocator exists. No other thread may be inside a cucache call.
  static void reset_for_testing();

  registry(const registry&) = delete;
  registry& operator=(const registry&) = delete;
  ~registry();

 private:
  registry();
  device_allocator& create(int device);

  backend_kind kind_ = backend_kind::cuda;
  device_census census_;
  config cfg_;
  std::shared_ptr<trace_recorder> trace_;
  std::shared_ptr<observe_hub> hub_;  // outlives the allocators (deleted in ~registry first)
  /// Allocators get hub_'s observer (at creation, under create_mu_): from the start when the
  /// config asks for tracing, history, leak hunting or call stacks; else from the first tag.
  std::atomic<bool> observing_{false};
  std::unique_ptr<std::atomic<device_allocator*>[]> slots_;  // census_.count slots
  detail::mutex create_mu_;
  std::vector<double> fractions_ GUARDED_BY(create_mu_);  // per device; < 0: the config's
  /// The size rules set by set_size_rules (nullopt: CUCACHE_CONF's), for allocators created later.
  std::optional<config> size_rules_ GUARDED_BY(create_mu_);
  bool captures_announced_ GUARDED_BY(create_mu_) = false;
  bool stream_destructions_announced_ GUARDED_BY(create_mu_) = false;
  std::uint64_t announced_captures_ GUARDED_BY(create_mu_) = 0;  // begun and not ended
  std::shared_ptr<ipc_imports> imports_;  // under create_mu_ until set
};

/// Kept for tests written against the old name.
inline void reset_for_testing() {
  registry::reset_for_testing();
}

// --- errors in the runtime's vocabulary --------------------------------------------------------

/// Call inside a catch block: stores "function: what" as the last error (of this thread, and of
/// the process) and returns the CUDA runtime's code for the exception in flight:
/// out_of_memory / std::bad_alloc -> cudaErrorMemoryAllocation, environment_error ->
/// cudaErrorInitializationError, invalid_argument -> cudaErrorInvalidValue, cuda_error -> its
/// code, anything else -> cudaErrorUnknown.
[[nodiscard]] int error_code_of_current_exception(const char* function) noexcept;
/// Stores `message` as the last error of this thread and of the process.
void set_last_error(std::string_view message) noexcept;
/// The last error stored by this thread ("" if none).
[[nodiscard]] const char* thread_last_error() noexcept;
/// The last error stored by any thread ("" if none): what a caller on another thread than the
/// one that failed (torch's autograd thread) can read.
[[nodiscard]] std::string process_last_error();

/// Writes `text` to `path` through a temporary file in the same folder renamed over it, so that
/// nothing partial is ever left under `path`. Throws invalid_argument "cucache: <function>:
/// cannot write '<path>': <reason>".
void write_file_replacing(const std::filesystem::path& path, std::string_view text,
                          const char* function);

/// Throws invalid_argument: `ptr` is not the start of a live cucache allocation. With a built
/// registry, registry::explain_bad_pointer says why (interior pointer, already freed, another
/// device's memory...). For the calls that take no device: `current` is the calling thread's
/// current device (-1 when unknown), which the text names as such.
[[noreturn]] void throw_not_ours(const void* ptr, release_kind kind, int current = -1);

}  // namespace cucache::detail
