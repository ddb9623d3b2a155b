// Allocation traces in the CSV format of RAPIDS RMM's logging_resource_adaptor: a validating reader
// (plain or gzip files) that replay tools and tests build on, and a thread-safe recorder that
// writes the same format from a live allocator.
#pragma once

#if (defined(_MSVC_LANG) ? _MSVC_LANG : __cplusplus) < 201709L
#error \
    "cucache/trace.hpp requires C++20: compile with -std=c++20 (CMake: link cucache::cucache, which asks for cxx_std_20; a .cu file needs CUDA_STANDARD 20). C++17 and older take cucache.h, thrust.hpp and memory_resource.hpp only (docs/api.md)."
#endif

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iosfwd>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "cucache/backend.hpp"
#include "cucache/device_allocator.hpp"

namespace cucache {

/// One row of a trace.
struct trace_event {
  /// sleep and wake are cucache's extension (docs/replay.md, "Trace format"): a call of
  /// cucacheSleep / cucacheWake on the tag in `tag`.
  enum class action : std::uint8_t { allocate, free, allocate_failure, sleep, wake };

  std::uint32_t thread = 0;
  /// Wall-clock time of day in microseconds since local midnight (the format carries no date, so
  /// this wraps at midnight and is not monotonic across it).
  std::uint64_t time_us = 0;
  action act = action::allocate;
  /// 0 for a null pointer ("(nil)", "0x0" or empty in the file).
  std::uintptr_t pointer = 0;
  /// The size the application asked for; a free repeats it.
  std::size_t size = 0;
  /// 0 is the default stream.
  std::uintptr_t stream = 0;
  /// 1-based line in the file (the header is line 1); 0 for events that did not come from text.
  std::size_t line = 0;
  /// The Tag column (cucache's extension), as an id of trace_tag_name (0: none): for an
  /// allocate, the tag it was made under; for sleep and wake, the tag slept or woken. 0 in RMM's
  /// six-column rows. An id, not the text, so that an event stays 64 bytes.
  std::uint32_t tag = 0;
  /// sleep only: the keep-contents flag ("sleep keep contents" in the Action column).
  bool keep_contents = false;

  friend bool operator==(const trace_event&, const trace_event&) = default;
};

/// The name of trace tag id `id` ("" for 0). Tags are interned process-wide, for good (as the
/// library's own tags are): ids are equal exactly when names are. Thread-safe.
[[nodiscard]] std::string_view trace_tag_name(std::uint32_t id);
/// The id of tag `name`, interned; 0 for an empty name. Thread-safe.
[[nodiscard]] std::uint32_t trace_tag_id(std::string_view name);

/// The Action column's spelling: "allocate", "free", "allocate failure", "sleep" (or, with
/// keep_contents, "sleep keep contents", which to_string(const trace_event&) gives), "wake".
[[nodiscard]] std::string_view to_string(trace_event::action act) noexcept;
/// The Action column of `ev`: to_string(ev.act), or "sleep keep contents" for such a sleep.
[[nodiscard]] std::string_view action_text(const trace_event& ev) noexcept;
/// Appends `tag` as the Tag field is written: as is, or CSV-quoted ("" for a quote) when it holds
/// a comma or a quote; control bytes as '?' (the reader refuses them in a tag).
void append_trace_tag(std::string& out, std::string_view tag);

/// The header line every trace starts with.
inline constexpr std::string_view k_trace_header = "Thread,Time,Action,Pointer,Size,Stream";
/// The header of a trace whose rows may carry cucache's seventh column, Tag.
inline constexpr std::string_view k_trace_header_tagged =
    "Thread,Time,Action,Pointer,Size,Stream,Tag";

/// Reads a trace file, plain CSV or gzip (told apart by the gzip magic bytes, not the name).
///
/// Columns: Thread and Size are decimal; Time is HH:MM:SS.f (1-9 fraction digits); Action is
/// "allocate", "free" or "allocate failure". Pointer is spelled as glibc's %p prints it: hex with
/// a 0x (or 0X) prefix, or "(nil)", "0x0" or empty for null -- bare digits are refused. Stream is
/// always hex, with or without the 0x prefix, since RMM's traces and trace_recorder write bare hex
/// with the default stream as 0: "10" is stream 0x10, never ten.
///
/// cucache's extension (docs/replay.md, "Trace format"): a seventh column, Tag, and the actions
/// "sleep", "sleep keep contents" and "wake". The header may name the Tag column
/// (k_trace_header_tagged); a row under either header has six fields or seven, the seventh its
/// tag (CSV-quoted when it holds a comma or a quote); a row of six fields has no tag. A sleep or
/// wake row names its tag, a null pointer and in Size the bytes released or mapped again.
///
/// Validation: the first line must be the header; every other non-blank line must have six
/// fields (seven with a Tag) that parse; a free must name a pointer that is live (allocated and
/// not yet freed) and an allocate must not name one that is; an allocate failure must have a null pointer; the
/// requested bytes of the live allocations must not overflow size_t (no process can hold more).
/// Null pointers are exempt from the liveness rules, since an allocation of zero bytes may
/// legitimately return null. A free's size is not checked against its allocation's. A sleep must
/// name a tag that is awake, a wake one that sleeps; no allocate may be made under a sleeping tag
/// nor a free name a block of one (the API refuses each). Any
/// violation throws cucache::invalid_argument as "<name>:<line>: <reason>".
/// A file that cannot be opened or decompressed throws cucache::invalid_argument naming it.
/// The file is read in chunks and parsed as it arrives, so memory follows the events, not the
/// file: an error is reported when the reader reaches it, and a line longer than 4096 bytes (no
/// row is; binary data, /dev/zero) fails at the line it starts on.
[[nodiscard]] std::vector<trace_event> read_trace(const std::filesystem::path& path);

/// Parses trace text already in memory (plain CSV; LF or CRLF line endings). `name` stands for
/// the file in error messages.
[[nodiscard]] std::vector<trace_event> parse_trace(std::string_view text,
                                                   std::string_view name = "<trace>");
/// Parses the stream as it is read, in chunks, as read_trace does a file.
[[nodiscard]] std::vector<trace_event> parse_trace(std::istream& in,
                                                   std::string_view name = "<trace>");

/// Aggregate figures of a trace.
struct trace_summary {
  std::size_t events = 0;
  std::size_t allocations = 0;
  std::size_t frees = 0;
  std::size_t failures = 0;
  /// sleep and wake rows.
  std::size_t sleeps = 0;
  std::size_t wakes = 0;
  /// Allocate rows made under a tag.
  std::size_t tagged_allocations = 0;
  /// The highest sum of requested sizes of live allocations at any point of the trace.
  std::size_t peak_requested_bytes = 0;
  /// Allocations never freed by the end of the trace (null pointers excluded).
  std::size_t live_at_end = 0;
  /// Distinct streams and threads over all events.
  std::size_t streams = 0;
  std::size_t threads = 0;
};

/// Computes the summary. A free is matched to the latest live allocation of its pointer and
/// subtracts that allocation's size; frees that match nothing are counted but change no bytes.
/// Throws cucache::invalid_argument (naming the event's line) when the live requested bytes would
/// overflow size_t, which only events that did not come through read_trace can reach.
[[nodiscard]] trace_summary summarize(const std::vector<trace_event>& events);

/// Writes a trace file as an allocator runs. Thread-safe, with no process-wide lock on the
/// recording path: each thread formats its rows into a buffer of its own (under a lock only it and
/// flush() take), numbered from one atomic counter; flush() -- called by hand, when a thread's
/// buffer grows large, and on destruction -- merges every thread's rows in that order and writes
/// them. A free's row is numbered before its memory can be reused, so the file never shows an
/// allocation of an address before the free of its previous owner.
///
/// Thread is a small id (1, 2, ...) given to each thread on its first record on this recorder;
/// Time is the local wall clock as HH:MM:SS.ffffff, read by each thread when it records (rows of
/// different threads may therefore be a few microseconds out of time order).
///
/// The header is written with the first rows (the first flush): six columns, or seven
/// (k_trace_header_tagged) when any of those rows carries a tag. A row with a tag gets its
/// seventh field whatever the header (docs/replay.md, "Tags, sleep and wake").
class trace_recorder {
 public:
  /// Creates (truncates) the file and writes the header. Throws cucache::invalid_argument naming
  /// the path if it cannot be opened.
  explicit trace_recorder(const std::filesystem::path& path);
  /// Flushes; a write error here is swallowed (call flush() first to see it).
  ~trace_recorder();
  trace_recorder(const trace_recorder&) = delete;
  trace_recorder& operator=(const trace_recorder&) = delete;

  // Record calls never throw for I/O errors (they run inside allocate/free); a failed write is
  // remembered and reported by the next flush(). They may throw std::bad_alloc.
  /// `tag`: the tag the allocation was made under (empty: none), written in the Tag column.
  void record_allocate(const void* ptr, std::size_t size, stream_handle stream,
                       std::string_view tag = {});
  void record_free(const void* ptr, std::size_t size, stream_handle stream);
  /// An allocation of `size` bytes that failed; the row's pointer is null.
  void record_failure(std::size_t size, stream_handle stream);
  /// A sleep of `tag` (cucache::sleep) that released `bytes` device bytes; a wake that mapped
  /// `bytes` again. Rows "sleep" / "sleep keep contents" / "wake" with the tag in the Tag column.
  void record_sleep(std::string_view tag, bool keep_contents, std::size_t bytes);
  void record_wake(std::string_view tag, std::size_t bytes);
  /// A row that could not be buffered (host out of memory): the next flush() reports the trace as
  /// incomplete.
  void note_lost_row() noexcept;

  /// Writes buffered rows to the file and flushes it. Throws cucache::error if any write since
  /// the last flush() failed or a row was lost.
  void flush();

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

  struct thread_buffer;  // one per recording thread (trace_recorder.cpp)

 private:
  void record(std::string_view act, const void* ptr, std::size_t size, stream_handle stream,
              std::string_view tag = {});
  thread_buffer& buffer_of_this_thread();
  void write_all_locked();  // REQUIRES mutex_

  std::filesystem::path path_;
  /// Tells recorders apart in the per-thread buffer cache, even one built where another was freed.
  std::uint64_t serial_;
  std::atomic<std::uint64_t> next_row_{0};
  std::atomic<bool> lost_rows_{false};
  std::mutex mutex_;  // the file, the buffer list and the thread ids
  std::FILE* file_ = nullptr;
  bool write_failed_ = false;
  /// The header goes out with the first rows: it names the Tag column when any of them has one.
  bool header_written_ = false;
  std::atomic<bool> tagged_rows_{false};
  std::vector<std::shared_ptr<thread_buffer>> buffers_;
  std::unordered_map<std::thread::id, std::size_t> thread_ids_;  // -> index in buffers_
};

/// An allocation_observer that writes every allocation, free and failure of the allocators it is
/// given to (device_allocator's constructor) to `recorder`, from the block's own requested size
/// and stream: the tracing of every front end. A free's row names the stream the free is ordered
/// on (the allocation's own for a plain free).
[[nodiscard]] std::shared_ptr<allocation_observer> make_trace_observer(
    std::shared_ptr<trace_recorder> recorder);

}  // namespace cucache
