// Runtime error reporting and the device guard shared by cuda_backend's calls: the guard makes the
// backend's device current for one call and gives the caller back the device it had.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "cucache/errors.hpp"

namespace cucache::detail {

/// Throws cuda_error for a failed runtime call. The failure is reported by the exception, so the
/// thread's last-error slot (which the failed call just set) is cleared; otherwise a non-sticky
/// error would resurface at the caller's next, unrelated cudaGetLastError.
[[noreturn]] inline void throw_runtime_error(const std::string& call, cudaError_t code) {
  static_cast<void>(cudaGetLastError());
  throw cuda_error(call, static_cast<int>(code), cudaGetErrorString(code));
}

inline void check_runtime(cudaError_t code, const char* call) {
  if (code != cudaSuccess) throw_runtime_error(call, code);
}

/// Clears the last-error slot only if it holds `expected`, the code an expected failure (out of
/// memory, not ready) just left there; an older error that the caller still has to see stays.
inline void clear_expected_error(cudaError_t expected) noexcept {
  if (cudaPeekAtLastError() == expected) static_cast<void>(cudaGetLastError());
}

/// Makes `device` current for the guard's scope. Switches only when needed: cudaGetDevice is a
/// thread-local read, while cudaSetDevice may take locks or initialize a context.
class device_guard {
 public:
  explicit device_guard(int device) {
    int current = 0;
    check_runtime(cudaGetDevice(&current), "cudaGetDevice");
    if (current != device) {
      check_runtime(cudaSetDevice(device), "cudaSetDevice");
      previous_ = current;
    }
  }
  ~device_guard() {
    // Switching back to a device that was current a moment ago cannot reasonably fail, and a
    // destructor has no way to report it.
    if (previous_ >= 0) static_cast<void>(cudaSetDevice(previous_));
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;

 private:
  int previous_ = -1;  // -1: no switch happened.
};

}  // namespace cucache::detail
