// Loading libcucache_c10_peer.so, the shim over PyTorch's CUDA caching allocator
// (bench/peers/c10_peer.h), for the replay and the benchmark: where it is looked for, the
// interface version it must have, and how PyTorch's settings reach it. The tools never link
// PyTorch; the shim is built against it on a machine with torch.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>

#include "c10_peer.h"

namespace cucache::tools {

/// Where the shim is looked for, in order: $CUCACHE_C10_PEER (when set and not empty), then
/// libcucache_c10_peer.so beside the running executable, then in ../lib from it (where the build
/// puts shared libraries). Returns the first that exists, else the one beside the executable.
[[nodiscard]] std::filesystem::path c10_peer_path();

/// The loaded shim, initialized. c10's state is process-wide and the library is never unloaded,
/// so there is at most one per process (load_c10_peer). Every call acts on device 0; a failure
/// throws cucache::error with the shim's own message (cucache_peer_c10_last_error).
class c10_peer_library {
 public:
  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }
  /// The PYTORCH_CUDA_ALLOC_CONF string the allocator was initialized with ("" = c10's defaults).
  [[nodiscard]] const std::string& conf() const noexcept { return conf_; }

  /// raw_alloc_with_stream; nullptr on failure (out of memory, counted in stats().num_ooms, or
  /// another error: last_error() says which).
  [[nodiscard]] void* allocate(std::size_t bytes, void* stream) const noexcept {
    return alloc_(bytes, stream);
  }
  /// raw_delete; a failure is kept for last_error().
  void deallocate(void* ptr) const noexcept { free_(ptr); }
  /// setMemoryFraction on device 0: c10 then reserves at most `fraction` of the device.
  void set_memory_fraction(double fraction) const;
  [[nodiscard]] cucache_c10_stats stats() const;
  /// emptyCache and a reset of the peak and accumulated statistics: the next run starts cold.
  void reset() const;
  /// The shim's message for the last failure on this thread; "" when none.
  [[nodiscard]] std::string last_error() const;

 private:
  friend const c10_peer_library& load_c10_peer(const std::string& conf);
  c10_peer_library() = default;
  [[noreturn]] void fail(const char* what) const;

  std::filesystem::path path_;
  std::string conf_;
  cucache_peer_c10_init_fn init_ = nullptr;
  cucache_peer_c10_alloc_fn alloc_ = nullptr;
  cucache_peer_c10_free_fn free_ = nullptr;
  cucache_peer_c10_set_memory_fraction_fn set_memory_fraction_ = nullptr;
  cucache_peer_c10_stats_fn stats_ = nullptr;
  cucache_peer_c10_reset_fn reset_ = nullptr;
  cucache_peer_c10_last_error_fn last_error_ = nullptr;
};

/// Loads the shim at c10_peer_path() and initializes it with `conf` (PYTORCH_CUDA_ALLOC_CONF
/// syntax). c10 reads PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF when it loads, so both are
/// set to `conf` before the dlopen, or unset when `conf` is empty: the peer runs with the settings
/// asked for, whatever the caller's environment says. The shim must export every function of
/// c10_peer.h and report CUCACHE_C10_PEER_ABI. Throws cucache::error saying why not (not found,
/// dlopen failed, a missing symbol, another interface version, init failed, or already loaded in
/// this process).
[[nodiscard]] const c10_peer_library& load_c10_peer(const std::string& conf);

}  // namespace cucache::tools
