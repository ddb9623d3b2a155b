// PyTorch memory snapshots as allocation traces: the pickle torch.cuda.memory._dump_snapshot()
// writes (plain or gzip) -- {"segments": [...], "device_traces": [[entry, ...] per device], ...} --
// read into the trace_event rows read_trace gives for a CSV trace, so that cucache-replay (plain,
// --fit, --advise, --timeline) answers "does this job fit" from a snapshot. docs/replay.md,
// "PyTorch memory snapshots", states every rule; the pickle is decoded by a strict reader of
// plain data that executes nothing (docs/decisions/0017-pickle-reader.md).
#pragma once

#if (defined(_MSVC_LANG) ? _MSVC_LANG : __cplusplus) < 201709L
#error \
    "cucache/snapshot_reader.hpp requires C++20: compile with -std=c++20 (CMake: link cucache::cucache)."
#endif

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cucache/trace.hpp"

namespace cucache {

/// One frame of a snapshot's call stack, innermost first, as PyTorch records it.
struct snapshot_frame {
  std::string filename;
  std::int64_t line = 0;
  std::string name;
};

/// A block of a segment at the moment of the dump.
struct snapshot_block {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  std::size_t requested_size = 0;
  /// "active_allocated", "active_pending_free" or "inactive".
  std::string state;
  /// Index into torch_snapshot_trace::stacks (0: no frames).
  std::uint32_t stack = 0;
};

/// A segment of the chosen device at the moment of the dump.
struct snapshot_segment {
  std::uintptr_t address = 0;
  std::size_t total_size = 0;
  std::uintptr_t stream = 0;
  /// "small" or "large".
  std::string segment_type;
  bool is_expandable = false;
  std::vector<snapshot_block> blocks;
};

struct torch_snapshot_options {
  /// The device whose history is read. Unset: the one device that has a history (several are an
  /// error that names them).
  std::optional<int> device;
};

/// A device's allocation history as trace events, and what the conversion did.
struct torch_snapshot_trace {
  /// allocate, free and allocate failure rows, replayable as a CSV trace's: first the
  /// allocations made before the history began (line 0, by address), then one row per "alloc",
  /// "free_requested" and "oom" entry, with line = the entry's 1-based index in the device's
  /// trace, thread 0 and time_us as PyTorch recorded it (microseconds since the epoch).
  std::vector<trace_event> events;
  /// Per event: its call stack (index into stacks; 0: none). Allocations carry their entry's
  /// frames (a block live before the history its block's frames); other rows none.
  std::vector<std::uint32_t> event_stacks;
  /// Distinct call stacks; stacks[0] is empty.
  std::vector<std::vector<snapshot_frame>> stacks;
  /// The chosen device's segments at the dump.
  std::vector<snapshot_segment> segments;

  int device = 0;
  /// Entries of device_traces (one per device PyTorch knew).
  std::size_t devices = 0;
  /// Entries in the chosen device's trace, and what they were.
  std::size_t entries = 0;
  std::size_t allocs = 0;
  std::size_t frees = 0;  // free_requested
  std::size_t ooms = 0;
  /// free_completed entries: the allocator's own (not replayed; see docs/replay.md).
  std::size_t completions = 0;
  /// Of those, completions that came after another allocation than their request (a block used
  /// on another stream through record_stream, reusable only once that work was done): the
  /// replay frees such a block at its request, earlier than PyTorch could reuse it.
  std::size_t late_completions = 0;
  /// free_requested entries with no free_completed after them by the dump (a block waiting for
  /// another stream's work, record_stream: active_pending_free in the segments).
  std::size_t pending_at_dump = 0;
  /// free_completed of a block the history never allocated nor requested to free (its free was
  /// requested before the history began): nothing to replay.
  std::size_t completions_before_history = 0;
  /// free_completed of a live block with no free_requested before it: replayed as its free.
  std::size_t completions_without_request = 0;
  /// segment_alloc / segment_free / segment_map / segment_unmap and snapshot entries: the
  /// allocator's own doing, which the replayed allocator does for itself.
  std::size_t segment_entries = 0;
  std::size_t snapshot_entries = 0;
  /// Allocations made before the history began, replayed as live at its start: blocks whose
  /// free_requested is in the history but not their alloc, and blocks active_allocated at the
  /// dump that the history never allocated.
  std::size_t before_history_freed = 0;
  std::size_t before_history_alive = 0;
  /// Blocks active_allocated at the dump that the history freed and never allocated again, or a
  /// second block at one address (a snapshot whose segments disagree with its history): left
  /// out.
  std::size_t disagreeing_blocks = 0;

  /// One line saying what was read and every rule that applied (prints nothing it did not do).
  [[nodiscard]] std::string note() const;
};

/// Whether the file holds a pickle (protocol 2 or later, plain or gzip): its first byte, after
/// decompression, is the PROTO opcode. Throws cucache::invalid_argument when it cannot be read.
[[nodiscard]] bool is_torch_snapshot(const std::filesystem::path& path);

/// Reads a snapshot file (plain or gzip). Throws cucache::invalid_argument naming the file:
/// "<file>: pickle: ... at byte N" for a pickle the strict reader refuses (an object, a
/// truncation), "<file>: device_traces[D][I]: ..." for an entry that is not what PyTorch writes,
/// a message saying how to record a history when the snapshot has none, and one naming the
/// devices when several have a history and `opts.device` is unset.
[[nodiscard]] torch_snapshot_trace read_torch_snapshot(const std::filesystem::path& path,
                                                       const torch_snapshot_options& opts = {});
/// The same, from the (decompressed) bytes; `name` stands for the file in messages.
[[nodiscard]] torch_snapshot_trace parse_torch_snapshot(std::string_view bytes,
                                                        std::string_view name,
                                                        const torch_snapshot_options& opts = {});

}  // namespace cucache
