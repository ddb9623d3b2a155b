// The process-wide allocators (cucache::get, the C API, the front ends) on the simulated device:
// the environment the registry reads, set, and the registry rebuilt. With sim_device.hpp (sizes,
// fake streams). Apart from sim_device.hpp because it reaches into the api layer
// (api/registry.hpp), which the allocator tests do not need.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>

#include "api/registry.hpp"
#include "cucache/cucache.h"
#include "support/sim_device.hpp"

namespace cucache::test {

/// CUCACHE_BACKEND=sim, CUCACHE_CONF=`conf` (unset when null), and the registry rebuilt: the next
/// call creates its allocators from that environment.
inline void use_sim_registry(const char* conf = nullptr) {
  ::setenv("CUCACHE_BACKEND", "sim", 1);
  if (conf != nullptr) {
    ::setenv("CUCACHE_CONF", conf, 1);
  } else {
    ::unsetenv("CUCACHE_CONF");
  }
  detail::reset_for_testing();
}

/// A test on the process-wide allocators of the simulated device: each test starts and ends with
/// a rebuilt registry, no CUCACHE_CONF, no CUCACHE_SIM_DEVICES and no tag pushed.
class sim_registry_test : public ::testing::Test {
 protected:
  void SetUp() override { use_sim_registry(); }
  void TearDown() override {
    while (cucachePopTag() == cudaSuccess) {
    }
    ::unsetenv("CUCACHE_SIM_DEVICES");
    use_sim_registry();
  }
};

}  // namespace cucache::test
