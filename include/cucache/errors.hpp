// The error hierarchy of cucache. Inside C++ every failure is an exception of one of these types;
// the C API (cucache.h) turns them into CUDA error codes. Destructors never throw; freeing a
// pointer that is not a live allocation throws invalid_argument.
#pragma once

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

}  // namespace cucache
