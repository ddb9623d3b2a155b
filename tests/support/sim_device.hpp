// Shared fixtures for the tests: a simulated device and an allocator over it, with helpers that
// read addresses and stats in the units the rules are written in, fake stream handles and sizes.
// The process-wide allocators on the simulated device (the api layer's registry) are in
// support/sim_registry.hpp.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <map>
#include <memory>

#include "cucache/config.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/sim_backend.hpp"

namespace cucache::test {

inline constexpr std::size_t KiB = std::size_t{1} << 10;
inline constexpr std::size_t MiB = std::size_t{1} << 20;
inline constexpr std::size_t GiB = std::size_t{1} << 30;
/// The sim backend's first address: every scenario starts here.
inline constexpr std::uintptr_t k_base = sim_backend::k_first_address;

/// A stream handle the sim did not create. stream(1) and stream(2) are the runtime's special
/// handles -- cudaStreamLegacy (the legacy stream, as nullptr: never captured, one pool with
/// nullptr) and cudaStreamPerThread -- and the allocator and the sim treat them so; a test that
/// needs a third ordinary stream takes another id.
inline stream_handle stream(std::uintptr_t id) {
  return reinterpret_cast<stream_handle>(id);
}
/// A stream handle the sim did not create, clear of the runtime's special handles: n << 8. As a
/// cudaStream_t for the C API: fake_stream<cudaStream_t>(n).
template <class S = stream_handle>
inline S fake_stream(std::uintptr_t n) {
  return reinterpret_cast<S>(n << 8);
}
inline std::uintptr_t addr(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p);
}

/// A simulated device of `capacity` bytes, every other option at its default.
inline sim_options sized(std::size_t capacity) {
  sim_options o;
  o.capacity_bytes = capacity;
  return o;
}

/// A simulated device of `capacity` bytes whose memory holds contents (host-backed, so copies
/// and sleep's kept bytes can be checked) and whose events complete only when synchronized.
inline sim_options host_backed(std::size_t capacity) {
  sim_options o;
  o.capacity_bytes = capacity;
  o.host_memory = true;
  o.events_complete_immediately = false;
  return o;
}

struct sim_allocator {
  explicit sim_allocator(config cfg = {}, sim_options opts = {})
      : sim(std::make_shared<sim_backend>(opts)), alloc(sim, std::move(cfg)) {}
  std::shared_ptr<sim_backend> sim;
  device_allocator alloc;

  [[nodiscard]] device_stats stats() const { return alloc.stats(); }
  [[nodiscard]] std::int64_t reserved() const { return stats().reserved_bytes[0].current; }
  [[nodiscard]] std::int64_t allocated() const { return stats().allocated_bytes[0].current; }
  [[nodiscard]] std::uint64_t mallocs() const { return sim->calls(sim_call::segment_malloc); }
  [[nodiscard]] std::uint64_t frees() const { return sim->calls(sim_call::segment_free); }
};

/// Every byte the simulated device holds is one the allocator accounts for as reserved; in
/// expandable mode reserved is exactly the mapped pages plus the unmapped handles kept.
inline void expect_no_leak(const sim_allocator& a) {
  const device_stats s = a.stats();
  const auto reserved = static_cast<std::size_t>(s.reserved_bytes[0].current);
  EXPECT_EQ(a.sim->used_bytes(), reserved);
  if (a.alloc.get_config().expandable_segments) {
    EXPECT_EQ(s.mapped_bytes + s.unmapped_handle_bytes, reserved);
  }
}

/// The randomized tests' shadow model of the live blocks: address -> requested size. add() is an
/// assertion that a newly served block overlaps no live one.
class shadow_blocks {
 public:
  [[nodiscard]] ::testing::AssertionResult add(std::uintptr_t addr, std::size_t size) {
    const auto next = live_.lower_bound(addr);
    if (next != live_.end() && addr + size > next->first) {
      return ::testing::AssertionFailure()
             << "block at " << addr << " (" << size << " bytes) overlaps the next live one at "
             << next->first;
    }
    if (next != live_.begin()) {
      const auto prev = std::prev(next);
      if (prev->first + prev->second > addr) {
        return ::testing::AssertionFailure()
               << "block at " << addr << " overlaps the previous live one at " << prev->first
               << " (" << prev->second << " bytes)";
      }
    }
    live_.emplace(addr, size);
    return ::testing::AssertionSuccess();
  }
  void remove(std::uintptr_t addr) { live_.erase(addr); }

 private:
  std::map<std::uintptr_t, std::size_t> live_;
};

/// The factor CUCACHE_STRESS_SCALE gives the long randomized and stress runs (1 when unset or not
/// a positive number): tools/run_sanitizers.sh runs them smaller under the sanitizers.
inline double stress_scale() {
  if (const char* s = std::getenv("CUCACHE_STRESS_SCALE")) {
    const double v = std::strtod(s, nullptr);
    if (v > 0) return v;
  }
  return 1.0;
}

/// `ops` operations scaled by stress_scale(), never fewer than `at_least`.
inline std::size_t scaled_ops(std::size_t ops, std::size_t at_least) {
  return std::max(at_least, static_cast<std::size_t>(static_cast<double>(ops) * stress_scale()));
}

}  // namespace cucache::test
