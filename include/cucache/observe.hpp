// Seeing where the memory goes: snapshots in PyTorch's memory-viewer schema, leak hunting across
// steps, and tags that attribute allocations to a label. All of it works on the process-wide
// allocators (cucache.hpp, the C API, the PyTorch plug-in) and is fed by one observer the
// registry gives every device (docs/design.md, "Observers"); docs/api.md describes each call.
#pragma once

#if (defined(_MSVC_LANG) ? _MSVC_LANG : __cplusplus) < 201709L
#error \
    "cucache/observe.hpp requires C++20: compile with -std=c++20 (CMake: link cucache::cucache, which asks for cxx_std_20; a .cu file needs CUDA_STANDARD 20). C++17 and older take cucache.h, thrust.hpp and memory_resource.hpp only (docs/api.md)."
#endif

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "cucache/backend.hpp"

namespace cucache {

// --- snapshots ------------------------------------------------------------------------------

/// Every segment and block of every device allocator created so far, and (CUCACHE_CONF
/// history:N) the last N events of each device, as the JSON of PyTorch's
/// torch.cuda.memory._snapshot(): {"segments": [...], "device_traces": [[...], ...]}. Blocks of
/// a tagged allocation carry a "tag" key. Creates no allocator.
[[nodiscard]] std::string snapshot();
/// Writes snapshot() to `path`, through a temporary file in the same folder renamed over it:
/// nothing partial is ever left under `path`. Throws invalid_argument naming the file when it
/// cannot be written.
void write_snapshot(const std::filesystem::path& path);

// --- leak hunting -----------------------------------------------------------------------------

/// One frame of an allocation's call stack (record_backtraces:True), innermost first.
struct frame {
  std::string filename;  ///< the executable or shared library holding the code
  int line = 0;          ///< 0: unknown (no line tables are read)
  std::string name;      ///< the demangled function, or "0x<offset>" inside `filename`
};

/// A live allocation that survived more than K steps while its device's live total grew.
struct leak_candidate {
  int device = 0;
  std::uintptr_t address = 0;
  std::size_t size = 0;  ///< the size the caller asked for
  stream_handle stream = nullptr;
  std::string tag;                ///< "" when allocated outside any tag
  std::uint64_t step = 0;         ///< the step it was allocated in (0: before the first marker)
  std::uint64_t steps_alive = 0;  ///< markers it survived
  std::vector<frame> frames;      ///< where it was allocated (record_backtraces:True), else empty
};

/// Ends a step (an iteration of the program's loop). Needs leak hunting on (CUCACHE_CONF
/// leak_steps:K); throws invalid_argument naming the key otherwise.
void mark_step();
/// The leak candidates now: allocations that survived more than K steps (K = `steps`, or the
/// config's leak_steps when `steps` is 0) on a device whose live total (bytes requested by live
/// allocations) is higher now than K markers ago. Largest first. Throws invalid_argument when leak
/// hunting is off, when no step was marked yet, or when `steps` is 0 and leak_steps is unset.
[[nodiscard]] std::vector<leak_candidate> leak_report(std::uint64_t steps = 0);
/// leak_report as JSON: {"step": S, "steps": K, "candidates": [{device, address, size, stream,
/// tag, step, steps_alive, frames}]}.
[[nodiscard]] std::string leak_report_json(std::uint64_t steps = 0);

// --- tags -------------------------------------------------------------------------------------

/// Makes `tag` the calling thread's current tag (a stack: tags nest). Allocations made on this
/// thread while it is current are attributed to it, and so are their frees, whichever thread and
/// tag scope they happen in. Throws invalid_argument for an empty tag.
void push_tag(std::string_view tag);
/// Ends the calling thread's current tag. Throws invalid_argument when it has none.
void pop_tag();
/// The calling thread's current tag, "" when none.
[[nodiscard]] std::string current_tag();

/// push_tag for the life of the object (RAII), on the constructing thread.
class scoped_tag {
 public:
  explicit scoped_tag(std::string_view tag) { push_tag(tag); }
  ~scoped_tag() {
    try {
      pop_tag();
    } catch (...) {
      // Only an unbalanced pop_tag inside the scope gets here; a destructor must not throw.
    }
  }
  scoped_tag(const scoped_tag&) = delete;
  scoped_tag& operator=(const scoped_tag&) = delete;
};

/// No limit on a tag (set_tag_limit): no tag can hold more than SIZE_MAX bytes anyway.
inline constexpr std::size_t k_no_tag_limit = static_cast<std::size_t>(-1);

/// Bytes of one tag on one device: the sizes callers asked for, of live allocations.
struct tag_stat {
  std::string tag;
  std::size_t current_bytes = 0;
  std::size_t peak_bytes = 0;         ///< since the process started
  std::uint64_t allocations = 0;      ///< live allocations
  std::uint64_t total_allocations = 0;  ///< ever made under the tag
  std::size_t limit_bytes = k_no_tag_limit;  ///< set_tag_limit's; k_no_tag_limit when none
  std::uint64_t limit_refusals = 0;   ///< allocations the limit refused (tag_limit_error)
};

/// The field table of tag_stat (after its name), as CUCACHE_STAT_*_FIELDS is device_stats': the
/// JSON of tag statistics (Python's cucache.tag_stats) and the metrics (cucache::metrics) are
/// produced from it, and a member missing from it fails the static_assert below.
/// X(member, metric name, kind: gauge|counter, unit: bytes|count, help).
#define CUCACHE_TAG_STAT_FIELDS(X)                                                               \
  X(current_bytes, cucache_tag_bytes, gauge, bytes,                                              \
    "Bytes callers asked for, of the live allocations made under the tag")                      \
  X(peak_bytes, cucache_tag_peak_bytes, gauge, bytes,                                            \
    "Highest cucache_tag_bytes since the process started")                                      \
  X(allocations, cucache_tag_live_allocations, gauge, count,                                     \
    "Live allocations made under the tag")                                                      \
  X(total_allocations, cucache_tag_allocations_total, counter, count,                            \
    "Allocations ever made under the tag")                                                      \
  X(limit_bytes, cucache_tag_limit_bytes, gauge, bytes,                                          \
    "The tag's limit (set_tag_limit); no sample for a tag without one")                         \
  X(limit_refusals, cucache_tag_limit_refusals_total, counter, count,                            \
    "Allocations refused because they would take the tag past its limit")

#define CUCACHE_TAG_STAT_SIZE_(member, ...) +sizeof(tag_stat::member)
static_assert(sizeof(tag_stat) == sizeof(std::string) CUCACHE_TAG_STAT_FIELDS(CUCACHE_TAG_STAT_SIZE_),
              "a member of tag_stat is missing from CUCACHE_TAG_STAT_FIELDS");
#undef CUCACHE_TAG_STAT_SIZE_

/// Every tag that allocated on `device`, or has a limit there, by name. Empty for a device that
/// does not exist.
[[nodiscard]] std::vector<tag_stat> tag_stats(int device);
/// One tag on `device` (all zero, no limit, when it never allocated there).
[[nodiscard]] tag_stat tag_stats(int device, std::string_view tag);

/// Limits the bytes `tag` may hold on `device`: from now on, an allocation made under the tag
/// there that would take its use -- the bytes callers asked for, of its live allocations, as
/// tag_stats counts them -- past `bytes` throws tag_limit_error (an out_of_memory) naming the
/// tag, the limit, the use and the request, with nothing allocated and nothing else changed.
/// Per device, as tag statistics are: a tenant's share of one GPU's memory. `bytes` may be below
/// the tag's use: what it holds stays, and its allocations are refused until frees bring it
/// under. k_no_tag_limit removes the limit; 0 lets nothing be allocated under the tag. Allocations
/// already being made on other threads when a limit is set are not checked against it; once it
/// is set, the check is exact under any number of threads. Throws invalid_argument for an empty
/// tag, cuda_error (cudaErrorInvalidDevice) for a device that does not exist. docs/api.md, "Tag
/// limits".
void set_tag_limit(int device, std::string_view tag, std::size_t bytes);
/// The limit of `tag` on `device`; k_no_tag_limit when none. Errors as set_tag_limit.
[[nodiscard]] std::size_t tag_limit(int device, std::string_view tag);

// --- metrics ----------------------------------------------------------------------------------

/// Every statistics field of every device allocator created so far (device_stats: per pool,
/// counters, rates) and of every tag of each (tag_stat), in Prometheus' text exposition format
/// (version 0.0.4): a # HELP and a # TYPE line per metric, then one sample per device (label
/// device), pool (label pool: all, small_pool, large_pool) and tag (label tag). Names and kinds
/// come from the field tables (stats.hpp, CUCACHE_TAG_STAT_FIELDS); docs/api.md, "Metrics",
/// lists them. Creates no allocator.
[[nodiscard]] std::string metrics();

// --- sleep and wake (docs/api.md, "Sleep and wake") ----------------------------------------------

/// Makes `tag` sleepable, process-wide and for good: in expandable mode, the allocations made
/// under it from now on are placed in pages of their own (one pool per stream and tag), which no
/// other tag's or untagged block shares, so that sleep can release them. Allocations made under it
/// before are not the tag's to put to sleep (sleep refuses while any is live). Throws
/// invalid_argument for an empty tag or when 16383 tags are sleepable already.
void make_sleepable(std::string_view tag);
/// Whether make_sleepable(tag) was called.
[[nodiscard]] bool is_sleepable(std::string_view tag);
/// Releases the physical memory of every live block of `tag` on `device` and of its cached pages,
/// keeping their addresses; with keep_contents their bytes wait in pinned host memory. Waits for
/// the work queued on the device first. Throws, changing nothing: invalid_argument (unknown or not
/// sleepable tag, asleep already, live blocks of the tag outside its pages), cuda_error 801 (not
/// expandable mode), cuda_error 900 (a graph capture is underway), out_of_memory (host memory).
void sleep(int device, std::string_view tag, bool keep_contents = true);
/// One tag of a sleep call over several.
struct tag_sleep_request {
  std::string_view tag;
  bool keep_contents = true;
};
/// Puts several tags to sleep in one call (vLLM's sleep: weights kept, KV cache dropped): one
/// take of the allocator's locks, the device synchronized once (twice when contents are kept:
/// before and after the copies of all of them). Every tag is checked first -- the refusals of
/// sleep(device, tag) plus a tag named twice -- and any refusal throws with nothing changed for
/// any tag. A device failure while releasing one tag's pages rolls that tag back as sleep does;
/// the tags before it in the list stay asleep, those after it are untouched, and the message
/// names them (docs/api.md, "Sleep and wake"). invalid_argument for an empty list.
void sleep(int device, std::span<const tag_sleep_request> tags);
/// Pins, ahead of the tag's next sleep with keep_contents, the host buffer that sleep copies into:
/// at least `bytes` and at least the tag's allocated bytes on `device` now. Without it, the first
/// kept sleep pins the buffer itself (cudaHostAlloc: about 3 s for 9 GiB on the H200). Runs with
/// no allocator lock held while pinning. Returns the buffer's bytes; nothing is pinned when the
/// tag's buffer is large enough already. The buffer stays the tag's until a sleep without
/// keep_contents (which frees it) or a kept sleep that needs more. Throws, changing nothing:
/// invalid_argument (unknown or not sleepable tag, asleep), cuda_error 801 (not expandable
/// mode), out_of_memory (the host cannot pin that much).
std::size_t prepare_sleep(int device, std::string_view tag, std::size_t bytes = 0);
/// The bytes of the pinned buffer `tag` keeps on `device` for its next kept sleep (0: none).
[[nodiscard]] std::size_t sleep_buffer_bytes(int device, std::string_view tag);
/// Maps new memory under the tag's live blocks at the same addresses and restores the kept
/// contents. Throws invalid_argument (unknown tag, not asleep), out_of_memory (no room: the tag
/// stays asleep, nothing of it mapped, the message says how much was missing).
void wake(int device, std::string_view tag);
/// Wakes several tags in one call, all or none: each must be asleep and named once; the room
/// needed is that of all of them (out_of_memory: all stay asleep, nothing of them mapped); their
/// kept contents are copied back under one device synchronization.
void wake(int device, std::span<const std::string_view> tags);
/// A sleeping tag on one device.
struct sleep_stat {
  std::string tag;
  std::uint64_t bytes = 0;       ///< device bytes released that wake maps again
  std::uint64_t host_bytes = 0;  ///< pinned host bytes holding the contents (keep_contents)
  double copy_seconds = 0;       ///< sleep's device-to-host copies, synchronization included
};
/// Seconds the last wake of `tag` on `device` spent copying its contents back (0 when none).
[[nodiscard]] double last_wake_copy_seconds(int device, std::string_view tag);
/// Every sleeping tag on `device`, by name. Empty when no allocator of `device` exists yet;
/// cuda_error (cudaErrorInvalidDevice) for a device that does not exist.
[[nodiscard]] std::vector<sleep_stat> sleeping(int device);

}  // namespace cucache
