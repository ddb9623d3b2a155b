// Statistics against a shadow model: every field (current, peak, allocated, freed) of the
// allocated, active and requested figures, per slot (all, small, large), after every operation of
// a random single-stream run with pending frees (record_stream), event completion and resets of
// peaks and totals. Active figures are derived from allocated and pending ones (pool_stats.hpp);
// this pins them to their definition.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <vector>

#include "cucache/config.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

struct model_stat {
  std::int64_t current = 0, peak = 0, allocated = 0, freed = 0;
  void add(std::int64_t d) {
    current += d;
    if (d > 0) {
      allocated += d;
      peak = std::max(peak, current);
    } else {
      freed -= d;
    }
  }
};
using model_array = std::array<model_stat, k_stat_pools>;

void add(model_array& a, std::size_t slot, std::int64_t d) {
  a[0].add(d);
  a[slot].add(d);
}

void expect_same(const stat_array& got, const model_array& want, const char* name, int op) {
  for (std::size_t i = 0; i < k_stat_pools; ++i) {
    ASSERT_EQ(got[i].current, want[i].current) << name << "[" << i << "] op " << op;
    ASSERT_EQ(got[i].peak, want[i].peak) << name << "[" << i << "] op " << op;
    ASSERT_EQ(got[i].allocated, want[i].allocated) << name << "[" << i << "] op " << op;
    ASSERT_EQ(got[i].freed, want[i].freed) << name << "[" << i << "] op " << op;
  }
}

TEST(Stats, MatchAShadowModelWithPendingFreesAndResets) {
  sim_allocator a;
  const stream_handle own = stream(1), other = stream(2);
  struct live_block {
    std::size_t size, requested, slot;
    bool recorded;
  };
  std::map<void*, live_block> live;
  std::vector<live_block> waiting, completed;  // pending frees: event not done / done, not polled
  model_array alloc_bytes{}, alloc_count{}, active_bytes{}, active_count{}, requested{};
  std::mt19937_64 rng(7);
  for (int op = 0; op < 20000; ++op) {
    const auto r = rng() % 100;
    if (r < 45 || live.empty()) {
      const std::size_t bytes = rng() % 2 == 0 ? 1 + rng() % (512 * KiB) : 1 + rng() % (24 * MiB);
      // allocate polls the pool's pending events first: completed frees become free then.
      for (const auto& b : completed) {
        add(active_bytes, b.slot, -static_cast<std::int64_t>(b.size));
        add(active_count, b.slot, -1);
      }
      completed.clear();
      void* p = a.alloc.allocate(bytes, own);
      const std::size_t size = a.alloc.allocation_size(p);
      const std::size_t slot = size <= MiB ? 1 : 2;
      live[p] = {size, bytes, slot, false};
      add(alloc_bytes, slot, static_cast<std::int64_t>(size));
      add(alloc_count, slot, 1);
      add(active_bytes, slot, static_cast<std::int64_t>(size));
      add(active_count, slot, 1);
      add(requested, slot, static_cast<std::int64_t>(bytes));
    } else if (r < 85) {
      auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
      const live_block b = it->second;
      a.alloc.deallocate(it->first);
      live.erase(it);
      add(alloc_bytes, b.slot, -static_cast<std::int64_t>(b.size));
      add(alloc_count, b.slot, -1);
      add(requested, b.slot, -static_cast<std::int64_t>(b.requested));
      if (b.recorded) {
        waiting.push_back(b);
      } else {
        add(active_bytes, b.slot, -static_cast<std::int64_t>(b.size));
        add(active_count, b.slot, -1);
      }
    } else if (r < 93) {
      auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
      a.alloc.record_stream(it->first, other);
      it->second.recorded = true;
    } else if (r < 97) {
      a.sim->complete_stream(other);
      completed.insert(completed.end(), waiting.begin(), waiting.end());
      waiting.clear();
    } else if (r < 99) {
      a.alloc.reset_peak_stats();
      for (auto* m : {&alloc_bytes, &alloc_count, &active_bytes, &active_count, &requested}) {
        for (auto& s : *m) s.peak = s.current;
      }
    } else {
      a.alloc.reset_accumulated_stats();
      for (auto* m : {&alloc_bytes, &alloc_count, &active_bytes, &active_count, &requested}) {
        for (auto& s : *m) s.allocated = s.freed = 0;
      }
    }
    const device_stats s = a.stats();
    expect_same(s.allocated_bytes, alloc_bytes, "allocated_bytes", op);
    expect_same(s.allocation_count, alloc_count, "allocation_count", op);
    expect_same(s.active_bytes, active_bytes, "active_bytes", op);
    expect_same(s.active_count, active_count, "active_count", op);
    expect_same(s.requested_bytes, requested, "requested_bytes", op);
    if (op % 512 == 0) a.alloc.check_invariants();
  }
  for (auto& [p, b] : live) a.alloc.deallocate(p);
  a.sim->complete_all();
  a.alloc.empty_cache();
  a.alloc.check_invariants();
}

// Expandable segments: a segment is a virtual range holding memory (one per stream and pool kind),
// however many mappings back it; device allocations and frees are the physical handles.
TEST(Stats, ExpandableSegmentsCountRangesAndHandles) {
  // Coarse handles (the default): a block's run of missing pages that it covers whole gets one
  // handle, its partial edge pages one each.
  sim_allocator a(parse_config("expandable_segments:True"));
  void* x = a.alloc.allocate(3 * MiB);  // pages 0-1: two handles (page 1 is not covered whole)
  void* y = a.alloc.allocate(9 * MiB);  // pages 1-5: one more, a chunk of pages 2-5
  void* z = a.alloc.allocate(4 * KiB);  // the small range: one
  device_stats s = a.stats();
  EXPECT_EQ(s.segment_count[0].current, 2);
  EXPECT_EQ(s.segment_count[1].current, 1);
  EXPECT_EQ(s.segment_count[2].current, 1);
  EXPECT_EQ(s.device_alloc_count, a.sim->calls(sim_call::phys_create));
  EXPECT_EQ(s.device_alloc_count, 4u);
  EXPECT_EQ(s.vm_map_count, 4u);
  EXPECT_EQ(a.sim->calls(sim_call::segment_malloc), 0u);
  a.alloc.deallocate(z);
  a.alloc.deallocate(y);
  a.alloc.empty_cache();  // releases the small range's handle and y's idle chunk
  s = a.stats();
  EXPECT_EQ(s.segment_count[0].current, 1);
  EXPECT_EQ(s.segment_count[1].current, 0);
  EXPECT_EQ(s.segment_count[0].allocated, 2);
  EXPECT_EQ(s.device_free_count, a.sim->calls(sim_call::phys_release));
  a.alloc.deallocate(x);
  a.alloc.empty_cache();
  s = a.stats();
  EXPECT_EQ(s.segment_count[0].current, 0);
  EXPECT_EQ(s.reserved_bytes[0].current, 0);
  EXPECT_EQ(s.device_free_count, 4u);
  a.alloc.check_invariants();
}

}  // namespace
}  // namespace cucache::test
