// A device_backend that records the name of every call made to it, generated from the table of
// device_backend's virtuals (CUCACHE_DEVICE_BACKEND_CALLS), and a walk that makes each call of the
// table once through a backend: the tests of every wrapper (forwarding_backend, the allocator's
// capture_safe_backend, the replay's counting_backend) check that each call reaches the wrapped
// backend.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cucache/forwarding_backend.hpp"

namespace cucache::test {

/// Answers every call with a value-initialized result and records its name, in order.
class call_probe final : public device_backend {
 public:
#define CUCACHE_PROBE_CALL(ret, fn, params, args, quals) \
  ret fn params quals override {                         \
    static_cast<void>(std::forward_as_tuple args);       \
    calls_.emplace_back(#fn);                            \
    return std::type_identity_t<ret>();                  \
  }
  CUCACHE_DEVICE_BACKEND_CALLS(CUCACHE_PROBE_CALL)
#undef CUCACHE_PROBE_CALL

  [[nodiscard]] bool saw(const std::string& call) const {
    return std::ranges::find(calls_, call) != calls_.end();
  }
  [[nodiscard]] const std::vector<std::string>& calls() const {
    return calls_;
  }
  void clear() {
    calls_.clear();
  }

 private:
  mutable std::vector<std::string> calls_;  // const calls (device, name) record too
};

// Calls `pm` on `b` with value-initialized arguments: a virtual call through device_backend.
template <class R, class... A>
void call_with_defaults(device_backend& b, R (device_backend::*pm)(A...)) {
  (void)(b.*pm)(std::remove_cvref_t<A>{}...);
}
template <class R>
void call_with_defaults(device_backend& b, R (device_backend::*pm)() const noexcept) {
  (void)(b.*pm)();
}

/// Makes every call of the table once through `wrapper` and expects `probe` (what it wraps) to
/// have seen each one. Returns the calls that did not reach it.
inline std::vector<std::string> calls_not_forwarded(device_backend& wrapper, call_probe& probe) {
  std::vector<std::string> missing;
#define CUCACHE_WALK_CALL(ret, fn, params, args, quals) \
  probe.clear();                                        \
  call_with_defaults(wrapper, &device_backend::fn);     \
  if (!probe.saw(#fn)) missing.emplace_back(#fn);
  CUCACHE_DEVICE_BACKEND_CALLS(CUCACHE_WALK_CALL)
#undef CUCACHE_WALK_CALL
  return missing;
}

}  // namespace cucache::test
