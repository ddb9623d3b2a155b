// Requests that cannot fit: sizes over the whole top of the size_t range, under every rounding
// configuration and every other config key, in both modes. Each must throw out_of_memory with the
// allocator unchanged (stats, device memory, invariants), and the next small allocation must not
// overlap anything live -- an overflowing rounding once turned 0xf000000000000000 into a 0-byte
// block at the address the next 512 B allocation then got too.
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/size_policy.hpp"
#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

constexpr std::size_t k_size_max = std::numeric_limits<std::size_t>::max();
constexpr std::size_t k_two63 = std::size_t{1} << 63;

/// Every size here is far beyond the simulated device (80 GiB).
std::vector<std::size_t> huge_sizes() {
  std::vector<std::size_t> sizes = {
      k_size_max,
      k_size_max - 1,
      k_size_max - 511,
      k_size_max - 512,
      k_size_max - 2 * MiB,
      k_two63,
      k_two63 + 1,
      k_two63 - 1,
      k_two63 + 512,
      (std::size_t{1} << 62) + 1,
      0xf000000000000000ULL,  // the four
      0xe000000000000001ULL,
      0xc000000000000001ULL,
      0xfffffffffd7fffffULL,
      detail::k_max_request_bytes,
      detail::k_max_request_bytes - 1,
      detail::k_max_request_bytes - 511,
      detail::k_max_request_bytes + 1,
      detail::k_max_request_bytes + 512,
      detail::k_max_request_bytes - 20 * MiB,
      std::size_t{1} << 44,
      (std::size_t{80} << 30) + 1,  // one byte over the device
      std::size_t{160} << 30,       // the size of the expandable large range
      (std::size_t{160} << 30) + 1,
  };
  for (std::size_t k = 1; k <= (std::size_t{1} << 40); k <<= 3) sizes.push_back(k_size_max - k);
  return sizes;
}

/// Every config key (trace is the registry's, not the allocator's: see the C API test).
std::vector<std::string> configs() {
  return {"",
          "roundup_power2_divisions:4",
          "roundup_power2_divisions:2",
          "roundup_power2_divisions:2147483648",
          "roundup_power2_divisions:[1:4,64:2,>:1]",
          "roundup_power2_divisions:[1:0,>:2147483648]",
          "roundup_power2_divisions:[256:8,8796093022208:16]",
          "max_split_size_mb:20",
          "max_split_size_mb:512,max_non_split_rounding_mb:1024",
          "garbage_collection_threshold:0.5",
          "memory_fraction:0.5",
          "per_process_memory_fraction:1",
          "memory_limit:1GiB",
          "roundup_power2_divisions:4,memory_limit:1GiB,garbage_collection_threshold:0.9"};
}

/// Everything but oom_count, which a failed allocation raises by one.
void expect_same(const device_stats& a, const device_stats& b) {
  const auto same_array = [](const stat_array& x, const stat_array& y, const char* name) {
    for (std::size_t i = 0; i < k_stat_pools; ++i) {
      EXPECT_EQ(x[i].current, y[i].current) << name << "[" << i << "]";
      EXPECT_EQ(x[i].peak, y[i].peak) << name << "[" << i << "]";
      EXPECT_EQ(x[i].allocated, y[i].allocated) << name << "[" << i << "]";
      EXPECT_EQ(x[i].freed, y[i].freed) << name << "[" << i << "]";
    }
  };
  same_array(a.allocated_bytes, b.allocated_bytes, "allocated_bytes");
  same_array(a.reserved_bytes, b.reserved_bytes, "reserved_bytes");
  same_array(a.active_bytes, b.active_bytes, "active_bytes");
  same_array(a.requested_bytes, b.requested_bytes, "requested_bytes");
  same_array(a.allocation_count, b.allocation_count, "allocation_count");
  same_array(a.segment_count, b.segment_count, "segment_count");
  same_array(a.active_count, b.active_count, "active_count");
  EXPECT_EQ(a.device_alloc_count, b.device_alloc_count);
  EXPECT_EQ(a.device_free_count, b.device_free_count);
  EXPECT_EQ(a.alloc_retry_count, b.alloc_retry_count);
  EXPECT_EQ(a.device_alloc_count, b.device_alloc_count);
  EXPECT_EQ(a.vm_map_count, b.vm_map_count);
  EXPECT_EQ(a.vm_unmap_count, b.vm_unmap_count);
  EXPECT_EQ(a.mapped_bytes, b.mapped_bytes);
  EXPECT_EQ(a.unmapped_handle_bytes, b.unmapped_handle_bytes);
  EXPECT_EQ(a.free_bytes, b.free_bytes);
  EXPECT_EQ(a.largest_free_block, b.largest_free_block);
  EXPECT_EQ(a.oom_count + 1, b.oom_count);
}

struct live_set {
  std::vector<std::pair<std::uintptr_t, std::size_t>> ranges;

  void expect_disjoint(const void* p, std::size_t bytes) const {
    const std::uintptr_t a = addr(p);
    for (const auto& [start, size] : ranges) {
      EXPECT_TRUE(a + bytes <= start || start + size <= a)
          << "new block " << p << " (+" << bytes << ") overlaps a live block at 0x" << std::hex
          << start << " (+" << std::dec << size << ")";
    }
  }
};

class HugeSizes : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(HugeSizes, AreOutOfMemoryWithNothingChanged) {
  const auto& [extra, expandable] = GetParam();
  std::string text = expandable ? "expandable_segments:True" : "";
  if (!extra.empty()) text += (text.empty() ? "" : ",") + extra;
  SCOPED_TRACE(text);
  sim_allocator a(parse_config(text));
  live_set live;
  const stream_handle streams[] = {nullptr, stream(1)};
  // Some live memory and some cached memory in both pools, on two streams.
  for (stream_handle s : streams) {
    for (std::size_t bytes : {std::size_t{512}, 3 * MiB, 700 * KiB}) {
      void* p = a.alloc.allocate(bytes, s);
      live.expect_disjoint(p, a.alloc.allocation_size(p));
      live.ranges.emplace_back(addr(p), a.alloc.allocation_size(p));
    }
    a.alloc.deallocate(a.alloc.allocate(30 * MiB, s));
    a.alloc.deallocate(a.alloc.allocate(4 * KiB, s));
  }
  a.alloc.check_invariants();
  for (std::size_t bytes : huge_sizes()) {
    for (stream_handle s : streams) {
      SCOPED_TRACE(::testing::Message() << "bytes 0x" << std::hex << bytes << " stream " << s);
      const device_stats before = a.stats();
      const std::size_t used = a.sim->used_bytes();
      EXPECT_THROW((void)a.alloc.allocate(bytes, s), out_of_memory);
      expect_same(before, a.stats());
      EXPECT_EQ(a.sim->used_bytes(), used);
      a.alloc.check_invariants();
      void* q = a.alloc.allocate(512, s);
      ASSERT_NE(q, nullptr);
      EXPECT_EQ(a.alloc.allocation_size(q), 512u);
      live.expect_disjoint(q, 512);
      live.ranges.emplace_back(addr(q), 512);
      a.alloc.check_invariants();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryConfigBothModes, HugeSizes,
                         ::testing::Combine(::testing::ValuesIn(configs()), ::testing::Bool()),
                         [](const auto& param) {
                           return (std::get<1>(param.param) ? std::string("Expandable")
                                                            : std::string("Default")) +
                                  std::to_string(param.index / 2);
                         });

}  // namespace
}  // namespace cucache::test
