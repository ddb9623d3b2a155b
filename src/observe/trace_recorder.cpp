// Records allocations as RMM-format CSV rows into per-thread buffers, merged in row order and
// written in large batches (trace.hpp).
#include <sys/time.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <algorithm>
#include <iterator>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "cucache/errors.hpp"
#include "cucache/trace.hpp"

namespace cucache {

namespace {

// A thread's buffer that reaches this size triggers a flush of every thread's rows: large enough
// that writes are rare, small enough that a crash loses little and memory stays flat.
constexpr std::size_t k_flush_threshold = std::size_t{256} << 10;

std::atomic<std::uint64_t> g_next_serial{1};

// The last recorder this thread recorded on and its buffer there: saves the map lookup (and the
// recorder's lock) on nearly every record.
struct buffer_cache {
  std::uint64_t serial = 0;
  trace_recorder::thread_buffer* buffer = nullptr;
};
thread_local buffer_cache t_buffer_cache;

}  // namespace

struct trace_recorder::thread_buffer {
  std::mutex mu;  // taken by its thread to record and by flush() to collect
  std::uint32_t id = 0;
  std::string text;
  std::vector<std::pair<std::uint64_t, std::uint32_t>> rows;  // (row number, end offset in text)
  std::int64_t cached_second = -1;
  // The H:M:S text changes once a second; converting to local time every row would take glibc's
  // time zone lock each time.
  char cached_hms[8] = {};
};

trace_recorder::trace_recorder(const std::filesystem::path& path)
    : path_(path), serial_(g_next_serial.fetch_add(1, std::memory_order_relaxed)) {
  file_ = std::fopen(path.c_str(), "wb");
  if (file_ == nullptr) {
    throw invalid_argument(fmt::format("cannot open trace file '{}' for writing: {}", path.string(),
                                       std::strerror(errno)));
  }
  // Rows are batched by flush(); a second stdio buffer would only copy them again. The header
  // goes out with the first batch (write_all_locked), when it is known whether rows carry tags.
  std::setvbuf(file_, nullptr, _IONBF, 0);
}

trace_recorder::~trace_recorder() {
  try {
    flush();
  } catch (...) {
    // A destructor cannot report it; flush() before destruction to see write errors.
  }
  std::fclose(file_);
}

void trace_recorder::record_allocate(const void* ptr, std::size_t size, stream_handle stream,
                                     std::string_view tag) {
  record(to_string(trace_event::action::allocate), ptr, size, stream, tag);
}

void trace_recorder::record_free(const void* ptr, std::size_t size, stream_handle stream) {
  record(to_string(trace_event::action::free), ptr, size, stream);
}

void trace_recorder::record_failure(std::size_t size, stream_handle stream) {
  record(to_string(trace_event::action::allocate_failure), nullptr, size, stream);
}

void trace_recorder::record_sleep(std::string_view tag, bool keep_contents, std::size_t bytes) {
  trace_event ev;
  ev.act = trace_event::action::sleep;
  ev.keep_contents = keep_contents;
  record(action_text(ev), nullptr, bytes, nullptr, tag);
}

void trace_recorder::record_wake(std::string_view tag, std::size_t bytes) {
  record(to_string(trace_event::action::wake), nullptr, bytes, nullptr, tag);
}

void trace_recorder::note_lost_row() noexcept {
  lost_rows_.store(true, std::memory_order_relaxed);
}

void trace_recorder::flush() {
  std::lock_guard lock(mutex_);
  write_all_locked();
  if (std::fflush(file_) != 0) write_failed_ = true;
  const bool lost = lost_rows_.exchange(false, std::memory_order_relaxed);
  if (write_failed_ || lost) {
    write_failed_ = false;
    throw error(fmt::format("writing trace file '{}' failed{}", path_.string(),
                            lost ? ": rows were lost (host out of memory)" : ""));
  }
}

trace_recorder::thread_buffer& trace_recorder::buffer_of_this_thread() {
  buffer_cache& c = t_buffer_cache;
  if (c.serial == serial_) [[likely]]
    return *c.buffer;
  std::lock_guard lock(mutex_);
  const auto [it, inserted] = thread_ids_.try_emplace(std::this_thread::get_id(), buffers_.size());
  if (inserted) {
    try {
      auto b = std::make_shared<thread_buffer>();
      b->id = static_cast<std::uint32_t>(buffers_.size() + 1);
      buffers_.push_back(std::move(b));
    } catch (...) {
      thread_ids_.erase(it);
      throw;
    }
  }
  c = {serial_, buffers_[it->second].get()};
  return *c.buffer;
}

void append_trace_tag(std::string& out, std::string_view tag) {
  // As is, or CSV-quoted ("" for a quote) when it holds a comma or a quote. The reader reads a
  // line at a time, so line breaks and other control bytes are written as '?'.
  const bool quote = tag.find_first_of(",\"") != std::string_view::npos;
  if (quote) out.push_back('"');
  for (const char c : tag) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      out.push_back('?');
    } else {
      if (c == '"') out.push_back('"');
      out.push_back(c);
    }
  }
  if (quote) out.push_back('"');
}

void trace_recorder::record(std::string_view act, const void* ptr, std::size_t size,
                            stream_handle stream, std::string_view tag) {
  if (!tag.empty() && !tagged_rows_.load(std::memory_order_relaxed)) {
    tagged_rows_.store(true, std::memory_order_relaxed);
  }
  thread_buffer& b = buffer_of_this_thread();
  bool full = false;
  {
    std::lock_guard lock(b.mu);
    // Numbered under the buffer's lock: flush() holds every buffer's lock while it collects, so
    // the rows it writes are always a prefix of the numbering.
    const std::uint64_t row = next_row_.fetch_add(1, std::memory_order_relaxed);
    timeval now{};
    gettimeofday(&now, nullptr);
    if (now.tv_sec != b.cached_second) {
      const std::time_t secs = now.tv_sec;
      std::tm local{};
      localtime_r(&secs, &local);
      fmt::format_to(b.cached_hms, "{:02}:{:02}:{:02}", local.tm_hour, local.tm_min,
                     local.tm_sec);
      b.cached_second = now.tv_sec;
    }
    const std::size_t start = b.text.size();
    try {
      auto out = std::back_inserter(b.text);
      out = fmt::format_to(out, "{},", b.id);
      b.text.append(b.cached_hms, sizeof b.cached_hms);
      out = fmt::format_to(out, ".{:06},{},", now.tv_usec, act);
      // Pointers as glibc's %p prints them; streams in bare hex, the default stream as 0.
      if (ptr == nullptr) {
        b.text.append("(nil)");
      } else {
        out = fmt::format_to(out, "{:#x}", reinterpret_cast<std::uintptr_t>(ptr));
      }
      fmt::format_to(out, ",{},{:x}", size, reinterpret_cast<std::uintptr_t>(stream));
      if (!tag.empty()) {
        b.text.push_back(',');
        append_trace_tag(b.text, tag);
      }
      b.text.push_back('\n');
      b.rows.emplace_back(row, static_cast<std::uint32_t>(b.text.size()));
    } catch (...) {
      b.text.resize(start);
      throw;
    }
    full = b.text.size() >= k_flush_threshold;
  }
  if (full) {
    std::lock_guard lock(mutex_);
    write_all_locked();
  }
}

void trace_recorder::write_all_locked() {
  // Every buffer's lock at once, in list order (threads only ever hold their own): a consistent
  // cut of the numbering.
  std::vector<std::unique_lock<std::mutex>> locks;
  locks.reserve(buffers_.size());
  for (auto& b : buffers_) locks.emplace_back(b->mu);
  struct piece {
    std::uint64_t row;
    const char* begin;
    std::uint32_t size;
  };
  std::vector<piece> pieces;
  if (!header_written_) {
    // The first batch (or an empty trace's flush): the header names the Tag column when any row
    // so far has one. A tag first used after this batch still gets its seventh field; the reader
    // takes rows of six or seven fields under either header (docs/replay.md).
    std::string header(tagged_rows_.load(std::memory_order_relaxed) ? k_trace_header_tagged
                                                                       : k_trace_header);
    header.push_back('\n');
    if (std::fwrite(header.data(), 1, header.size(), file_) != header.size()) write_failed_ = true;
    header_written_ = true;
  }
  for (auto& b : buffers_) {
    std::uint32_t begin = 0;
    for (const auto& [row, end] : b->rows) {
      pieces.push_back({row, b->text.data() + begin, end - begin});
      begin = end;
    }
  }
  if (pieces.empty()) return;
  std::sort(pieces.begin(), pieces.end(),
            [](const piece& x, const piece& y) { return x.row < y.row; });
  std::string out;
  out.reserve(pieces.size() * 64);
  for (const piece& p : pieces) out.append(p.begin, p.size);
  if (std::fwrite(out.data(), 1, out.size(), file_) != out.size()) write_failed_ = true;
  for (auto& b : buffers_) {
    b->text.clear();
    b->rows.clear();
  }
}

}  // namespace cucache
