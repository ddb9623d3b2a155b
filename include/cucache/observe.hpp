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

/// Bytes of one tag on one device: the sizes callers asked for, of live allocations.
struct tag_stat {
  std::string tag;
  std::size_t current_bytes = 0;
  std::size_t peak_bytes = 0;         ///< since the process started
  std::uint64_t allocations = 0;      ///< live allocations
  std::uint64_t total_allocations = 0;  ///< ever made under the tag
};
/// Every tag that allocated on `device`, by name. Empty when no allocator of `device` exists.
[[nodiscard]] std::vector<tag_stat> tag_stats(int device);
/// One tag on `device` (all zero when it never allocated there).
[[nodiscard]] tag_stat tag_stats(int device, std::string_view tag);

}  // namespace cucache
