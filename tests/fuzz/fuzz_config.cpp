// libFuzzer harness: the CUCACHE_CONF parser. Any text either parses or throws
// cucache::invalid_argument (any other exception, a crash or a sanitizer report is a bug). What
// parses must round-trip through to_string (when to_string can express it) and must either build
// a device_allocator over the simulated device that serves and frees a few requests with its
// invariants intact, or be refused by the allocator: invalid_argument, or out_of_memory when a
// reserve_mb does not fit the device (docs/config.md), leaving nothing allocated.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "cucache/config.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/errors.hpp"
#include "cucache/sim_backend.hpp"
#include "fuzz/fuzz_support.hpp"

namespace {

enum count : std::size_t {
  inputs,
  rejected,
  accepted,
  roundtrip,
  unexpressible,
  built,
  refused,
  reserve_refused
};
cucache::fuzz::counters<8> g_counts({"inputs", "rejected (invalid_argument)", "accepted",
                                     "round-trip checked", "to_string unexpressible",
                                     "allocator built", "allocator refused",
                                     "reserve refused (OOM)"});

void exercise(const cucache::config& cfg) {
  cucache::sim_options o;
  o.capacity_bytes = std::size_t{4} << 30;
  auto sim = std::make_shared<cucache::sim_backend>(o);
  cucache::config c = cfg;
  c.trace_path.clear();  // the registry's key, not the allocator's
  std::unique_ptr<cucache::device_allocator> a;
  try {
    a = std::make_unique<cucache::device_allocator>(sim, c);
  } catch (const cucache::invalid_argument&) {
    g_counts.add(refused);
    return;
  } catch (const cucache::out_of_memory&) {
    // Only a reserve the device (or a limit) cannot hold may refuse creation, and cleanly.
    CUCACHE_FUZZ_CHECK(c.reserve_bytes != 0);
    CUCACHE_FUZZ_CHECK(sim->used_bytes() == 0);
    g_counts.add(reserve_refused);
    return;
  }
  g_counts.add(built);
  constexpr std::array<std::size_t, 6> sizes = {1,
                                                513,
                                                std::size_t{1} << 20,
                                                (std::size_t{1} << 21) + 1,
                                                std::size_t{30} << 20,
                                                ~std::size_t{0}};
  std::array<void*, sizes.size()> ptrs{};
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    try {
      ptrs[i] = a->allocate(sizes[i]);
      CUCACHE_FUZZ_CHECK(a->allocation_size(ptrs[i]) >= sizes[i]);
    } catch (const cucache::out_of_memory&) {
      // Only a request over the device, or one a memory limit forbids, may be refused.
      CUCACHE_FUZZ_CHECK(sizes[i] > (std::size_t{4} << 30) || c.memory_limit_bytes != 0 ||
                         c.memory_fraction != 0.0);
    }
    a->check_invariants();
  }
  for (void* p : ptrs) a->deallocate(p);
  a->empty_cache();
  a->check_invariants();
  CUCACHE_FUZZ_CHECK(sim->used_bytes() == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  g_counts.add(inputs);
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  cucache::config cfg;
  try {
    cfg = cucache::parse_config(text);
  } catch (const cucache::invalid_argument&) {
    g_counts.add(rejected);
    return 0;
  }
  g_counts.add(accepted);
  std::string again;
  try {
    again = cucache::to_string(cfg);
  } catch (const cucache::invalid_argument&) {
    g_counts.add(unexpressible);
    again.clear();
  }
  if (!again.empty() || cfg == cucache::config{}) {
    CUCACHE_FUZZ_CHECK(cucache::parse_config(again) == cfg);
    g_counts.add(roundtrip);
  }
  exercise(cfg);
  return 0;
}
