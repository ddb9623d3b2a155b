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
  // Rows are batched by flush(); a second stdio buffer would only copy them again.
  std::setvbuf(file_, nullptr, _IONBF, 0);
  std::string header(k_trace_header);
  header.push_back('\n');
  if (std::fwrite(header.data(), 1, header.size(), file_) != header.size()) write_failed_ = true;
}

trace_recorder::~trace_recorder() {
  try {
    flush();
  } catch (...) {
    // A destructor cannot report it; flush() before destruction to see write errors.
  }
  std::fclose(file_);
}

void trace_recorder::record_allocate(const void* ptr, std::size_t size, stream_handle stream) {
  record(trace_event::action::allocate, ptr, size, stream);
}

void trace_recorder::record_free(const void* ptr, std::size_t size, stream_handle stream) {
  record(trace_event::action::free, ptr, size, stream);
}

void trace_recorder::record_failure(std::size_t size, stream_handle stream) {
  record(trace_event::action::allocate_failure, nullptr, size, stream);
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

void trace_recorder::record(trace_event::action act, const void* ptr, std::size_t size,
                            stream_handle stream) {
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
      out = fmt::format_to(out, ".{:06},{},", now.tv_usec, to_string(act));
      // Pointers as glibc's %p prints them; streams in bare hex, the default stream as 0.
      if (ptr == nullptr) {
        b.text.append("(nil)");
      } else {
        out = fmt::format_to(out, "{:#x}", reinterpret_cast<std::uintptr_t>(ptr));
      }
      fmt::format_to(out, ",{},{:x}\n", size, reinterpret_cast<std::uintptr_t>(stream));
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
