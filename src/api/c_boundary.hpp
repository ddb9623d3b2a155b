// The C API's boundary, shared by every translation unit that defines cucache.h functions
// (c_api.cpp, ipc.cpp): no exception crosses it, and every failure leaves its message as the
// thread's last error (registry.hpp).
#pragma once

#include <string>

#include "api/registry.hpp"
#include "cucache/cucache.h"

namespace cucache::detail {

/// Runs f, translating every exception into the runtime's vocabulary.
template <class F>
cudaError_t guarded(const char* function, F&& f) noexcept {
  try {
    f();
    return cudaSuccess;
  } catch (...) {
    return static_cast<cudaError_t>(error_code_of_current_exception(function));
  }
}

/// cudaErrorInvalidValue for a NULL argument `name` of `function`, with that message.
inline cudaError_t null_argument(const char* function, const char* name) noexcept {
  try {
    set_last_error(std::string(function) + ": " + name + " is NULL");
  } catch (...) {
    set_last_error("");
  }
  return cudaErrorInvalidValue;
}

}  // namespace cucache::detail
