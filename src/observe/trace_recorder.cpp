// Records allocations as RMM-format CSV rows. Recording sits on the allocation path, so a row is
// formatted into a memory buffer under a mutex and the file is only written in large batches.
#include <sys/time.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <iterator>

#include <fmt/format.h>

#include "cucache/errors.hpp"
#include "cucache/trace.hpp"

namespace cucache {

namespace {

// Large enough that writes are rare, small enough that a crash loses little and memory stays flat.
constexpr std::size_t k_flush_threshold = std::size_t{1} << 20;

std::atomic<std::uint64_t> g_next_serial{1};

// The last recorder this thread recorded on and the id it got there: saves the map lookup on
// nearly every record.
struct thread_id_cache {
  std::uint64_t serial = 0;
  std::uint32_t id = 0;
};
thread_local thread_id_cache t_id_cache;

}  // namespace

trace_recorder::trace_recorder(const std::filesystem::path& path)
    : path_(path), serial_(g_next_serial.fetch_add(1, std::memory_order_relaxed)) {
  file_ = std::fopen(path.c_str(), "wb");
  if (file_ == nullptr) {
    throw invalid_argument(fmt::format("cannot open trace file '{}' for writing: {}", path.string(),
                                       std::strerror(errno)));
  }
  // Rows are already batched in buffer_; a second stdio buffer would only copy them again.
  std::setvbuf(file_, nullptr, _IONBF, 0);
  buffer_.reserve(k_flush_threshold + 256);
  buffer_.append(k_trace_header);
  buffer_.push_back('\n');
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

void trace_recorder::flush() {
  std::lock_guard lock(mutex_);
  write_locked();
  if (std::fflush(file_) != 0) write_failed_ = true;
  if (write_failed_) {
    write_failed_ = false;
    throw error(fmt::format("writing trace file '{}' failed", path_.string()));
  }
}

void trace_recorder::record(trace_event::action act, const void* ptr, std::size_t size,
                            stream_handle stream) {
  std::lock_guard lock(mutex_);
  // The clock is read under the lock so that times never go backwards from row to row.
  timeval now{};
  gettimeofday(&now, nullptr);
  if (now.tv_sec != cached_second_) {
    const std::time_t secs = now.tv_sec;
    std::tm local{};
    localtime_r(&secs, &local);
    fmt::format_to(cached_hms_, "{:02}:{:02}:{:02}", local.tm_hour, local.tm_min, local.tm_sec);
    cached_second_ = now.tv_sec;
  }

  auto out = std::back_inserter(buffer_);
  out = fmt::format_to(out, "{},", thread_id_locked());
  buffer_.append(cached_hms_, sizeof cached_hms_);
  out = fmt::format_to(out, ".{:06},{},", now.tv_usec, to_string(act));
  // Pointers as glibc's %p prints them; streams in bare hex, the default stream as 0.
  if (ptr == nullptr) {
    buffer_.append("(nil)");
  } else {
    out = fmt::format_to(out, "{:#x}", reinterpret_cast<std::uintptr_t>(ptr));
  }
  fmt::format_to(out, ",{},{:x}\n", size, reinterpret_cast<std::uintptr_t>(stream));

  if (buffer_.size() >= k_flush_threshold) write_locked();
}

std::uint32_t trace_recorder::thread_id_locked() {
  if (t_id_cache.serial == serial_) return t_id_cache.id;
  const auto next = static_cast<std::uint32_t>(thread_ids_.size() + 1);
  const std::uint32_t id = thread_ids_.try_emplace(std::this_thread::get_id(), next).first->second;
  t_id_cache = {serial_, id};
  return id;
}

void trace_recorder::write_locked() {
  if (buffer_.empty()) return;
  if (std::fwrite(buffer_.data(), 1, buffer_.size(), file_) != buffer_.size()) {
    write_failed_ = true;
  }
  buffer_.clear();
}

}  // namespace cucache
