// The allocators cucache-replay compares against on a real GPU: cudaMalloc/cudaFree, the
// stream-ordered allocator (cudaMallocAsync on a dedicated pool) and PyTorch's caching allocator
// through the dlopen'd shim of tools/common/c10_peer.h (the device calls and the loader are
// tools/common's, shared with cucache-bench). Also the table of CUDA streams a replay uses.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "replay_engine.hpp"

namespace cucache::replay {

/// One cold run of a peer (and with `warm`, its second pass through the same, filled cache).
struct peer_run {
  double ns_per_op = 0.0;
  std::uint64_t oom_count = 0;
  std::size_t peak_reserved_bytes = 0;
  double warm_ns_per_op = 0.0;  // warm runs only
  /// Device allocation and free calls of the (cold) run, where the peer counts them (c10).
  std::uint64_t device_calls = 0;
};

/// A peer allocator. Each run starts from an empty cache and ends with everything freed. A warm
/// run replays the trace twice through the same instance, freeing what the first pass left live
/// (untimed) before the second, and times both passes.
class peer {
 public:
  virtual ~peer() = default;
  [[nodiscard]] virtual std::string name() const = 0;
  /// How peak_reserved_bytes is measured, for the JSON output.
  [[nodiscard]] virtual std::string peak_source() const = 0;
  /// Called before the runs of each trace (a peer may measure memory once per trace).
  virtual void begin_trace() {}
  [[nodiscard]] virtual peer_run run(const prepared_trace& trace,
                                     std::span<const stream_handle> streams,
                                     std::span<void*> slots, bool warm) = 0;
  /// Whether the peer can be held to a memory limit (--capacity-gib, --fit).
  [[nodiscard]] virtual bool limitable() const { return true; }
  /// --fit: one untimed, cold run under a limit of `limit_bytes` that stops at the first
  /// out-of-memory; true when there was none. Frees what it left live. Only when limitable().
  [[nodiscard]] virtual bool fits(const prepared_trace& trace,
                                  std::span<const stream_handle> streams, std::span<void*> slots,
                                  std::size_t limit_bytes) = 0;
};

/// Creates the named peers on device 0. `requested` false means "every available one": a peer
/// that cannot be created is then skipped with a note on `err` instead of failing. Throws
/// cucache::invalid_argument for an unknown name, cucache::error for a requested peer that is
/// unavailable.
[[nodiscard]] std::vector<std::unique_ptr<peer>> make_peers(std::span<const std::string> names,
                                                            bool requested, const options& opts,
                                                            std::ostream& err);

/// One CUDA stream per distinct trace stream id (0 maps to the legacy default stream), destroyed
/// with the table.
class cuda_stream_table {
 public:
  explicit cuda_stream_table(std::span<const std::uintptr_t> ids);
  ~cuda_stream_table();
  cuda_stream_table(const cuda_stream_table&) = delete;
  cuda_stream_table& operator=(const cuda_stream_table&) = delete;
  [[nodiscard]] std::span<const stream_handle> handles() const noexcept { return handles_; }

 private:
  std::vector<stream_handle> handles_;
};

/// The PYTORCH_CUDA_ALLOC_CONF string with the same meaning as `cfg` for the keys both share:
/// max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions,
/// garbage_collection_threshold and expandable_segments. cucache-only keys, the memory limit and
/// the memory fraction (which c10 takes through a call) are left out.
[[nodiscard]] std::string c10_settings(const config& cfg);
/// Whether c10_settings(cfg) drops nothing but the memory limit and fraction: PyTorch's allocator
/// has every other key that cfg sets.
[[nodiscard]] bool c10_has_every_key(const config& cfg);

}  // namespace cucache::replay
