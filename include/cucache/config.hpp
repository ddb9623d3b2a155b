// Allocator configuration: a plain struct, and a parser for the CUCACHE_CONF string, which accepts
// the syntax of PyTorch's PYTORCH_ALLOC_CONF (and of its older name, PYTORCH_CUDA_ALLOC_CONF, which
// PyTorch still reads), "key:value,key:value", for the keys the two share. Defined in the core
// layer (src/core/config.cpp), below every layer that uses it.
#pragma once

#if (defined(_MSVC_LANG) ? _MSVC_LANG : __cplusplus) < 201709L
#error \
    "cucache/config.hpp requires C++20: compile with -std=c++20 (CMake: link cucache::cucache, which asks for cxx_std_20; a .cu file needs CUDA_STANDARD 20). C++17 and older take cucache.h, thrust.hpp and memory_resource.hpp only (docs/api.md)."
#endif

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "cucache/backend.hpp"  // peer_access_mode

namespace cucache {

/// Tuning of one device allocator. Every field has the documented default (docs/config.md).
struct config {
  /// Blocks at or above this size are never split (PyTorch's max_split_size_mb). SIZE_MAX = off.
  std::size_t max_split_size = std::numeric_limits<std::size_t>::max();
  /// A request at or above max_split_size may take a cached oversize block only if the block is
  /// less than this much larger (PyTorch's max_non_split_rounding_mb, default 20 MiB).
  std::size_t max_non_split_rounding = std::size_t{20} << 20;
  /// roundup_power2_divisions: entry i gives the number of divisions for request sizes in the
  /// power-of-two interval [2^(i+20), 2^(i+21)) -- entry 0 covers sizes below 2 MiB down to 1 MiB
  /// and also everything smaller. 0 or 1 means plain 512 B rounding for that interval.
  /// Empty means off; parse_config always fills k_roundup_power2_intervals entries. See
  /// docs/config.md for the list form "[256:4,>:1]" (a key of K MiB sets entry log2(K)).
  std::vector<std::uint32_t> roundup_power2_divisions;
  /// Fraction of the memory limit (or of device capacity when no limit is set) above which the
  /// allocator releases cached free segments, oldest first, before growing. 0 = off.
  double garbage_collection_threshold = 0.0;
  /// Use CUDA virtual memory (expandable segments) instead of cudaMalloc segments.
  bool expandable_segments = false;
  /// Per-device cap on reserved memory as a fraction of total device memory. 0 = off.
  double memory_fraction = 0.0;
  /// Per-device cap on reserved memory in bytes. 0 = off. When both are set the lower wins.
  std::size_t memory_limit_bytes = 0;
  /// Expandable segments: the devices each mapping is made accessible to (peer_access).
  peer_access_mode peer_access = peer_access_mode::automatic;
  /// Expandable segments: create physical memory exportable as a POSIX file descriptor, so that
  /// blocks can be shared with other processes (ipc_handles). Default-mode segments can always be
  /// exported (cudaIpcGetMemHandle).
  bool ipc_handles = false;
  /// Expandable segments: coarse handles (coarse_handles:N, default 8): while memory is plentiful
  /// with half the capacity to spare, physical handles of up to N pages for every block, kept when
  /// a later carve cuts them. 0 = off (one handle per page, chunks for blocks of 256 MiB or more).
  std::size_t coarse_handle_pages = 8;
  /// defer_coalescing:True (default off): each stream pool keeps its last freed block unmerged
  /// until its next step, and an allocation that best fit would give exactly that block takes it
  /// back without the merge and the split (in expandable mode also without the page steps:
  /// the block's pages stay touched while it is held) -- placement, statistics and device calls
  /// as without it. Pays where one stream frees and allocates the same size in turn; costs a
  /// little elsewhere (docs/config.md; the advisor measures which).
  bool defer_coalescing = false;
  /// Path of an RMM-format CSV trace to record every allocation to. Empty = off.
  std::string trace_path;
  /// reserve_mb: bytes the allocator caches when it is created (device_allocator::reserve on the
  /// legacy stream): a segment, or mapped idle pages in expandable mode. 0 = off.
  std::size_t reserve_bytes = 0;
  /// nvtx: NVTX ranges around device calls, the out-of-memory ladder and page moves. Off = one
  /// branch per slow path.
  bool nvtx = false;
  /// Events of the device trace snapshots carry (history:N): the last N allocation, free and
  /// segment events per device, in a ring. 0 = off (no event is kept).
  std::size_t history_entries = 0;
  /// Leak hunting (leak_steps:K): allocations alive for more than K steps (cucache::mark_step)
  /// while the live total grows are leak candidates. 0 = not configured (leak_report then needs
  /// its own K).
  std::uint64_t leak_steps = 0;
  /// Record the call stack of every allocation (record_backtraces:True), shown in snapshots and
  /// leak reports. Needs a build with libunwind.
  bool record_backtraces = false;

  friend bool operator==(const config&, const config&) = default;
};

/// Number of power-of-two intervals roundup_power2_divisions distinguishes (1 MiB .. 2^63).
inline constexpr std::size_t k_roundup_power2_intervals = 64;

/// Parses a CUCACHE_CONF string on top of `base`: a key that appears replaces its field, the
/// others keep base's values. Keys (docs/config.md): max_split_size_mb,
/// max_non_split_rounding_mb, roundup_power2_divisions, garbage_collection_threshold,
/// expandable_segments, memory_fraction (alias per_process_memory_fraction), memory_limit, trace,
/// reserve_mb, nvtx, history, leak_steps, record_backtraces, peer_access, ipc_handles,
/// coarse_handles, defer_coalescing.
/// Throws cucache::invalid_argument naming the key and its accepted forms on an unknown key (with
/// the nearest accepted key when it looks like a typo: "did you mean 'expandable_segments'?"), a
/// PyTorch key cucache does not support, a duplicate key, an empty entry or a malformed value;
/// never ignores anything silently. Empty or blank text returns base.
[[nodiscard]] config parse_config(std::string_view text, config base = {});

/// The entries of a CUCACHE_CONF string as parse_config splits them (at commas outside
/// brackets), each as its trimmed key and value ("" when there is no ':'); empty entries are
/// skipped. Checks nothing else (parse_config does): throws cucache::invalid_argument only for
/// unbalanced brackets. For code that must know which keys a string names, e.g. to allow a subset.
[[nodiscard]] std::vector<std::pair<std::string, std::string>> config_entries(std::string_view text);

/// Reads CUCACHE_CONF from the environment (empty or unset: defaults) and parses it.
[[nodiscard]] config config_from_env();

/// Renders a config back as a CUCACHE_CONF string that parse_config accepts: only the fields that
/// differ from config{} are written, so parse_config(to_string(c)) == c. Throws
/// cucache::invalid_argument for a value the syntax cannot express (e.g. a max_split_size that is
/// not a whole number of MiB, or a trace path containing ',').
[[nodiscard]] std::string to_string(const config& cfg);

}  // namespace cucache
