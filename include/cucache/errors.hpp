// The error hierarchy of cucache. Inside C++ every failure is an exception of one of these types;
// the C API (cucache.h) turns them into CUDA error codes. Destructors never throw; freeing a
// pointer that is not a live allocation throws invalid_argument.
#pragma once

#include <cstddef>
#include <new>
#include <stdexcept>
#include <string>

namespace cucache {

/// Base of every cucache error.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A caller passed something the allocator cannot act on: an unknown or interior pointer, a double
/// free, a malformed config string. The allocator's state is unchanged when this is thrown.
class invalid_argument : public error {
 public:
  using error::error;
};

/// The device (real or simulated) failed a call with an error other than out-of-memory.
/// `code()` is the CUDA runtime/driver error number (or a simulated one), `call()` names the call.
class cuda_error : public error {
 public:
  cuda_error(std::string call, int code, const std::string& message)
      : error(call + " failed: " + message + " (code " + std::to_string(code) + ")"),
        call_(std::move(call)),
        code_(code) {}
  [[nodiscard]] const std::string& call() const noexcept { return call_; }
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  std::string call_;
  int code_;
};

/// The device truly refused memory after the whole out-of-memory ladder ran (reuse, release of
/// oversize blocks, synchronize and release of every free segment, retry). what() holds the
/// diagnostic report: request, capacity, free, allocated, reserved-but-free, largest free block
/// and the fragmentation rate. Derives from std::bad_alloc so generic handlers catch it.
class out_of_memory : public std::bad_alloc {
 public:
  explicit out_of_memory(std::string report) : report_(std::move(report)) {}
  [[nodiscard]] const char* what() const noexcept override { return report_.c_str(); }

 private:
  std::string report_;
};

/// An allocation under a tag was refused because it would take the tag past its limit
/// (set_tag_limit, cucacheSetTagLimit): an out_of_memory, so that every handler of one catches it,
/// whose what() names the tag, its limit, its use and the request. Nothing was allocated and
/// nothing else changed. used() is what counts against the limit: the bytes callers asked for,
/// of the tag's live allocations on the device, and of those being made on other threads.
class tag_limit_error : public out_of_memory {
 public:
  tag_limit_error(std::string report, std::string tag, int device, std::size_t limit,
                  std::size_t used, std::size_t requested)
      : out_of_memory(std::move(report)),
        tag_(std::move(tag)),
        device_(device),
        limit_(limit),
        used_(used),
        requested_(requested) {}
  [[nodiscard]] const std::string& tag() const noexcept { return tag_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] std::size_t limit() const noexcept { return limit_; }
  [[nodiscard]] std::size_t used() const noexcept { return used_; }
  [[nodiscard]] std::size_t requested() const noexcept { return requested_; }

 private:
  std::string tag_;
  int device_;
  std::size_t limit_;
  std::size_t used_;
  std::size_t requested_;
};

}  // namespace cucache
