// NVTX ranges around the allocator's slow paths (device calls, the out-of-memory ladder, page
// moves), for Nsight Systems. Off unless the config says nvtx:True: a range that is off costs one
// predictable branch on a bool the allocator already holds. With the ranges on and no tool
// attached, NVTX's own calls return at once (the toolkit's header-only nvtx3: nothing is linked).
#pragma once

#include <nvtx3/nvToolsExt.h>

namespace cucache::detail {

/// Pushes an NVTX range named `name` (a string literal) when `on`, popped at scope exit.
class nvtx_range {
 public:
  nvtx_range(bool on, const char* name) noexcept : on_(on) {
    if (on_) [[unlikely]]
      nvtxRangePushA(name);
  }
  ~nvtx_range() {
    if (on_) [[unlikely]]
      nvtxRangePop();
  }
  nvtx_range(const nvtx_range&) = delete;
  nvtx_range& operator=(const nvtx_range&) = delete;

 private:
  bool on_;
};

}  // namespace cucache::detail
