// event_cache: the CUDA events of one allocator that no pending free uses, kept for reuse so that
// a cross-stream free does not create and destroy an event each time.
//
// Locking: `mu_` guards the list; it is a leaf (the backend is called outside it, except to
// destroy an event that could not be kept).
#pragma once

#include <mutex>
#include <vector>

#include "backend/thread_annotations.hpp"
#include "cucache/backend.hpp"

namespace cucache::detail {

class event_cache {
 public:
  explicit event_cache(device_backend& backend) : backend_(backend) {}
  event_cache(const event_cache&) = delete;
  event_cache& operator=(const event_cache&) = delete;
  ~event_cache() {
    for (event_handle e : free_) {
      try {
        backend_.event_destroy(e);
      } catch (...) {
      }
    }
  }

  /// A kept event, else a new one (which may throw).
  event_handle take() {
    {
      detail::lock_guard lock(mu_);
      if (!free_.empty()) {
        event_handle e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    return backend_.event_create();
  }
  /// Keeps e for reuse (destroys it when it cannot be kept).
  void give_back(event_handle e) noexcept {
    detail::lock_guard lock(mu_);
    try {
      free_.push_back(e);
    } catch (...) {
      try {
        backend_.event_destroy(e);
      } catch (...) {
      }
    }
  }

 private:
  device_backend& backend_;
  mutex mu_;
  std::vector<event_handle> free_ GUARDED_BY(mu_);
};

}  // namespace cucache::detail
