// Tests of capture_safe_backend (src/allocator/capture_safe_backend.hpp): every call of
// device_backend reaches the wrapped backend, and exactly the calls that are not stream-ordered
// run with the thread in relaxed capture mode, its own mode restored afterwards.
#include "allocator/capture_safe_backend.hpp"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "backend/call_probe.hpp"

namespace cucache::detail {
namespace {

TEST(CaptureSafeBackend, ForwardsEveryCall) {
  auto probe = std::make_shared<test::call_probe>();
  capture_safe_backend b(probe);
  EXPECT_EQ(test::calls_not_forwarded(b, *probe), std::vector<std::string>{});
}

// A call made relaxed reaches the probe between two mode exchanges (to relaxed, then back).
TEST(CaptureSafeBackend, RelaxesExactlyTheCallsThatAreNotStreamOrdered) {
  auto probe = std::make_shared<test::call_probe>();
  capture_safe_backend b(probe);
  std::vector<std::string> relaxed;
#define CUCACHE_RELAXED_OR_NOT(ret, fn, params, args, quals)                             \
  probe->clear();                                                                        \
  test::call_with_defaults(b, &device_backend::fn);                                      \
  if (probe->calls() ==                                                                  \
      std::vector<std::string>{"exchange_capture_mode", #fn, "exchange_capture_mode"}) { \
    relaxed.emplace_back(#fn);                                                           \
  } else {                                                                               \
    EXPECT_EQ(probe->calls(), std::vector<std::string>{#fn});                            \
  }
  CUCACHE_DEVICE_BACKEND_CALLS(CUCACHE_RELAXED_OR_NOT)
#undef CUCACHE_RELAXED_OR_NOT
  EXPECT_EQ(relaxed, (std::vector<std::string>{
                         "segment_malloc", "segment_free", "va_reserve", "va_free", "phys_create",
                         "phys_release", "map", "unmap", "set_access", "segment_import",
                         "segment_close", "event_query", "event_synchronize", "stream_synchronize",
                         "device_synchronize", "mem_get_info"}));
}

}  // namespace
}  // namespace cucache::detail
