// libFuzzer harness: the C API (cucache.h) on the simulated device. The first byte picks a
// CUCACHE_CONF (every config key appears in the table); the rest is a program of C API calls --
// cucacheMalloc, cucacheMallocAsync, cucacheFree, cucacheFreeAsync, cucacheRecordStream,
// cucacheEmptyCache, cucacheGetStats, cucacheMemGetInfo, cucacheMemorySummary -- on a few fake
// streams and streams the simulated device creates and destroys, with bad input (huge sizes,
// interior, foreign and freed pointers, null out-pointers), event completions and injected device
// failures mixed in. After every call: cucache::get().check_invariants(), a shadow model of the
// live allocations (no overlap, sizes, counts) and the C API's error contract. Each input starts
// from a fresh registry and ends by freeing everything: the device must then hold nothing.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <map>
#include <vector>

#include "api/registry.hpp"
#include "core/size_policy.hpp"
#include "cucache/cucache.h"
#include "cucache/cucache.hpp"
#include "cucache/sim_backend.hpp"
#include "fuzz/fuzz_support.hpp"

namespace {

using cucache::fuzz::byte_reader;

// Every config key, alone and combined, in both modes.
constexpr std::array<const char*, 12> k_configs = {
    "",
    "expandable_segments:True",
    "roundup_power2_divisions:4",
    "roundup_power2_divisions:[1:4,64:2,>:1]",
    "max_split_size_mb:64",
    "max_split_size_mb:20,max_non_split_rounding_mb:40",
    "garbage_collection_threshold:0.6,memory_limit:2GiB",
    "memory_fraction:0.05",
    "per_process_memory_fraction:0.02,roundup_power2_divisions:2",
    "expandable_segments:True,memory_limit:1GiB,garbage_collection_threshold:0.5",
    "expandable_segments:True,roundup_power2_divisions:8,max_split_size_mb:100",
    "expandable_segments:True,memory_fraction:0.01"};

enum count : std::size_t {
  inputs,
  op_malloc,
  op_malloc_async,
  op_free,
  op_free_async,
  op_record_stream,
  op_empty_cache,
  op_get_stats,
  op_mem_get_info,
  op_memory_summary,
  op_complete_events,
  op_inject_failure,
  op_stream_create,
  op_stream_destroy,
  size_zero,
  size_huge,
  size_boundary,
  size_random_u64,
  bad_interior,
  bad_freed,
  bad_foreign,
  bad_null_out,
  bad_null_record,
  bad_stats_device,
  dead_stream_use,
  call_failed,
  n_counts
};
cucache::fuzz::counters<n_counts> g_counts({"inputs",
                                            "cucacheMalloc",
                                            "cucacheMallocAsync",
                                            "cucacheFree",
                                            "cucacheFreeAsync",
                                            "cucacheRecordStream",
                                            "cucacheEmptyCache",
                                            "cucacheGetStats",
                                            "cucacheMemGetInfo",
                                            "cucacheMemorySummary",
                                            "event completions",
                                            "injected device failures",
                                            "stream create",
                                            "stream destroy",
                                            "size 0",
                                            "size huge (> device)",
                                            "size at a boundary +-1",
                                            "size random 64-bit",
                                            "bad: interior pointer",
                                            "bad: freed pointer",
                                            "bad: foreign pointer",
                                            "bad: null out-pointer",
                                            "bad: record_stream(NULL)",
                                            "bad: stats of bad device",
                                            "call on destroyed stream",
                                            "calls that failed"});

constexpr std::size_t k_size_max = std::numeric_limits<std::size_t>::max();
constexpr std::size_t k_mib = std::size_t{1} << 20;
constexpr std::size_t k_capacity = std::size_t{80} << 30;  // the global sim device's

std::size_t pick_size(byte_reader& in) {
  const std::uint8_t kind = in.u8();
  switch (kind % 8) {
    case 0:
      g_counts.add(size_zero);
      return 0;
    case 1: {  // boundaries of the size rules, +-1
      constexpr std::array<std::size_t, 14> b = {512,
                                                 k_mib,
                                                 2 * k_mib,
                                                 10 * k_mib,
                                                 20 * k_mib,
                                                 64 * k_mib,
                                                 100 * k_mib,
                                                 std::size_t{1} << 30,
                                                 k_capacity,
                                                 std::size_t{1} << 63,
                                                 cucache::detail::k_max_request_bytes,
                                                 k_size_max,
                                                 0xf000000000000000ULL,
                                                 0xfffffffffd7fffffULL};
      g_counts.add(size_boundary);
      const std::size_t base = b[(kind >> 3) % b.size()];
      const int delta = static_cast<int>(in.u8() % 3) - 1;
      return base + static_cast<std::size_t>(delta);  // wraps only at SIZE_MAX + 1 = 0
    }
    case 2:
      g_counts.add(size_random_u64);
      return in.u64();
    default: {  // log-uniform over [1, 2^40)
      const unsigned bits = in.u8() % 40;
      const std::uint64_t mant = in.u64();
      return (std::size_t{1} << bits) | (mant & ((std::size_t{1} << bits) - 1));
    }
  }
}

struct live_alloc {
  void* ptr;
  std::size_t size;
};

struct state {
  std::vector<live_alloc> live;
  std::map<std::uintptr_t, std::size_t> ranges;  // addr -> rounded size, of live blocks
  std::vector<void*> freed;                      // pointers freed and not handed out again
  std::vector<cudaStream_t> created;             // sim streams alive
  std::vector<cudaStream_t> destroyed;           // sim streams destroyed
  std::size_t requested = 0;
};

cucache::sim_backend& sim() {
  return dynamic_cast<cucache::sim_backend&>(cucache::get().backend());
}

cudaStream_t pick_stream(byte_reader& in, state& st) {
  const std::uint8_t b = in.u8();
  switch (b % 8) {
    case 0:
    case 1:
      return nullptr;
    case 2:
      return reinterpret_cast<cudaStream_t>(0x10);
    case 3:
      return reinterpret_cast<cudaStream_t>(0x20);
    case 4:
      return cudaStreamPerThread;
    case 5:
      if (!st.created.empty()) return st.created[(b >> 3) % st.created.size()];
      return reinterpret_cast<cudaStream_t>(0x30);
    case 6:
      if (!st.destroyed.empty()) {
        g_counts.add(dead_stream_use);
        return st.destroyed[(b >> 3) % st.destroyed.size()];
      }
      return reinterpret_cast<cudaStream_t>(0x30);
    default:
      return reinterpret_cast<cudaStream_t>(0x30);
  }
}

void check_all(const state& st) {
  cucache::get().check_invariants();
  cucacheStats s{};
  CUCACHE_FUZZ_CHECK(cucacheGetStats(0, &s) == cudaSuccess);
  CUCACHE_FUZZ_CHECK(s.allocationCount == st.live.size());
  CUCACHE_FUZZ_CHECK(s.requestedBytes == st.requested);
  CUCACHE_FUZZ_CHECK(s.allocatedBytes >= s.requestedBytes);
  CUCACHE_FUZZ_CHECK(s.reservedBytes >= s.allocatedBytes);
  CUCACHE_FUZZ_CHECK(s.memoryLimit == 0 || s.reservedBytes <= s.memoryLimit);
  CUCACHE_FUZZ_CHECK(sim().used_bytes() == s.reservedBytes);
}

void add_live(state& st, void* p, std::size_t size) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  CUCACHE_FUZZ_CHECK(a % 512 == 0);
  const std::size_t got = cucache::get().allocation_size(p);
  CUCACHE_FUZZ_CHECK(got >= size);
  auto next = st.ranges.lower_bound(a);
  CUCACHE_FUZZ_CHECK(next == st.ranges.end() || a + got <= next->first);
  if (next != st.ranges.begin()) {
    auto prev = std::prev(next);
    CUCACHE_FUZZ_CHECK(prev->first + prev->second <= a);
  }
  st.ranges.emplace(a, got);
  st.live.push_back({p, size});
  st.requested += size;
  std::erase(st.freed, p);
}

void drop_live(state& st, std::size_t i) {
  st.ranges.erase(reinterpret_cast<std::uintptr_t>(st.live[i].ptr));
  st.requested -= st.live[i].size;
  st.freed.push_back(st.live[i].ptr);
  if (st.freed.size() > 16) st.freed.erase(st.freed.begin());
  st.live[i] = st.live.back();
  st.live.pop_back();
}

void do_malloc(byte_reader& in, state& st, bool async) {
  const std::size_t size = pick_size(in);
  const cudaStream_t s = async ? pick_stream(in, st) : nullptr;
  if (size > k_capacity) g_counts.add(size_huge);
  g_counts.add(async ? op_malloc_async : op_malloc);
  void* p = reinterpret_cast<void*>(0x1);
  const cudaError_t rc = async ? cucacheMallocAsync(&p, size, s) : cucacheMalloc(&p, size);
  if (rc != cudaSuccess) {
    g_counts.add(call_failed);
    CUCACHE_FUZZ_CHECK(p == nullptr);
    CUCACHE_FUZZ_CHECK(*cucacheGetLastErrorMessage() != '\0');
    // Nothing the device cannot hold is ever served; everything else may fail only through the
    // memory limit, an injected device failure or a destroyed stream.
    return;
  }
  CUCACHE_FUZZ_CHECK(size <= k_capacity);
  if (size == 0) {
    CUCACHE_FUZZ_CHECK(p == nullptr);
    return;
  }
  CUCACHE_FUZZ_CHECK(p != nullptr);
  add_live(st, p, size);
}

// A free, free_async or record_stream that failed (an injected device failure) may or may not
// have released the block: the allocator is the judge, the shadow follows it.
void reconcile(state& st, std::size_t i) {
  if (cucache::get().allocation_size(st.live[i].ptr) == 0) drop_live(st, i);
}

void do_release(byte_reader& in, state& st, int kind) {
  if (st.live.empty()) return;
  const std::size_t i = in.u16() % st.live.size();
  void* p = st.live[i].ptr;
  cudaError_t rc;
  if (kind == 0) {
    g_counts.add(op_free);
    rc = cucacheFree(p);
  } else if (kind == 1) {
    g_counts.add(op_free_async);
    rc = cucacheFreeAsync(p, pick_stream(in, st));
  } else {
    g_counts.add(op_record_stream);
    rc = cucacheRecordStream(p, pick_stream(in, st));
    if (rc != cudaSuccess) g_counts.add(call_failed);
    return;
  }
  if (rc == cudaSuccess) {
    drop_live(st, i);
  } else {
    g_counts.add(call_failed);
    CUCACHE_FUZZ_CHECK(rc != cudaErrorInvalidValue);  // it was a live allocation
    reconcile(st, i);
  }
}

void do_bad_input(byte_reader& in, state& st) {
  const std::uint8_t b = in.u8();
  switch (b % 6) {
    case 0:
      if (!st.live.empty()) {
        const live_alloc& a = st.live[in.u16() % st.live.size()];
        const std::size_t off = 1 + in.u16() % std::max<std::size_t>(a.size, 1);
        if (off < a.size) {
          g_counts.add(bad_interior);
          void* q = static_cast<char*>(a.ptr) + off;
          CUCACHE_FUZZ_CHECK(cucacheFree(q) == cudaErrorInvalidValue);
          CUCACHE_FUZZ_CHECK(cucacheFreeAsync(q, nullptr) == cudaErrorInvalidValue);
          CUCACHE_FUZZ_CHECK(cucacheRecordStream(q, nullptr) == cudaErrorInvalidValue);
        }
      }
      break;
    case 1:
      if (!st.freed.empty()) {
        g_counts.add(bad_freed);
        void* q = st.freed[in.u8() % st.freed.size()];
        CUCACHE_FUZZ_CHECK(cucacheFree(q) == cudaErrorInvalidValue);
        CUCACHE_FUZZ_CHECK(cucacheRecordStream(q, nullptr) == cudaErrorInvalidValue);
      }
      break;
    case 2: {
      g_counts.add(bad_foreign);
      int host = 0;
      void* q = (b & 8) ? static_cast<void*>(&host) : reinterpret_cast<void*>(in.u64() | 1);
      CUCACHE_FUZZ_CHECK(cucacheFree(q) == cudaErrorInvalidValue);
      CUCACHE_FUZZ_CHECK(cucacheFreeAsync(q, nullptr) == cudaErrorInvalidValue);
      break;
    }
    case 3:
      g_counts.add(bad_null_out);
      CUCACHE_FUZZ_CHECK(cucacheMalloc(nullptr, 512) == cudaErrorInvalidValue);
      CUCACHE_FUZZ_CHECK(cucacheMallocAsync(nullptr, 512, nullptr) == cudaErrorInvalidValue);
      CUCACHE_FUZZ_CHECK(cucacheGetStats(0, nullptr) == cudaErrorInvalidValue);
      CUCACHE_FUZZ_CHECK(cucacheMemGetInfo(nullptr, nullptr) == cudaErrorInvalidValue);
      break;
    case 4:
      g_counts.add(bad_null_record);
      CUCACHE_FUZZ_CHECK(cucacheRecordStream(nullptr, nullptr) == cudaErrorInvalidValue);
      CUCACHE_FUZZ_CHECK(cucacheFree(nullptr) == cudaSuccess);
      CUCACHE_FUZZ_CHECK(cucacheFreeAsync(nullptr, nullptr) == cudaSuccess);
      break;
    default: {
      g_counts.add(bad_stats_device);
      cucacheStats s{};
      const int dev = (b & 8) ? -1 - (in.u8() & 0x7f) : 1 + in.u8();
      CUCACHE_FUZZ_CHECK(cucacheGetStats(dev, &s) == cudaErrorInvalidDevice);
      CUCACHE_FUZZ_CHECK(cucacheResetPeakStats(dev) == cudaErrorInvalidDevice);
      break;
    }
  }
}

void do_inject(byte_reader& in) {
  // The device calls the allocator makes; the n-th next one fails.
  constexpr std::array<cucache::sim_call, 13> kinds = {cucache::sim_call::segment_malloc,
                                                       cucache::sim_call::segment_free,
                                                       cucache::sim_call::event_record,
                                                       cucache::sim_call::event_query,
                                                       cucache::sim_call::event_create,
                                                       cucache::sim_call::event_synchronize,
                                                       cucache::sim_call::phys_create,
                                                       cucache::sim_call::phys_release,
                                                       cucache::sim_call::map,
                                                       cucache::sim_call::unmap,
                                                       cucache::sim_call::set_access,
                                                       cucache::sim_call::stream_synchronize,
                                                       cucache::sim_call::device_synchronize};
  const std::uint8_t b = in.u8();
  g_counts.add(op_inject_failure);
  sim().fail_nth(kinds[b % kinds.size()], 1 + (b >> 4) % 4);
}

void clear_faults() {
  for (std::size_t k = 0; k < cucache::k_sim_call_kinds; ++k) {
    sim().fail_nth(static_cast<cucache::sim_call>(k), 0);
    sim().fail_always(static_cast<cucache::sim_call>(k), false);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("CUCACHE_BACKEND", "sim", 1);
  unsetenv("CUCACHE_SIM_DEVICES");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  g_counts.add(inputs);
  byte_reader in(data, size);
  // The previous input dropped its registry; this one builds a fresh one from the environment.
  setenv("CUCACHE_CONF", k_configs[in.u8() % k_configs.size()], 1);
  state st;
  check_all(st);
  std::size_t ops = 0;
  while (!in.empty() && ops++ < 4096) {
    const std::uint8_t op = in.u8();
    switch (op % 16) {
      case 0:
      case 1:
      case 2:
        do_malloc(in, st, false);
        break;
      case 3:
      case 4:
        do_malloc(in, st, true);
        break;
      case 5:
      case 6:
        do_release(in, st, 0);
        break;
      case 7:
        do_release(in, st, 1);
        break;
      case 8:
        do_release(in, st, 2);
        break;
      case 9:
        g_counts.add(op_empty_cache);
        if (cucacheEmptyCache() != cudaSuccess) g_counts.add(call_failed);
        break;
      case 10: {
        g_counts.add(op_get_stats);
        cucacheStats s{};
        CUCACHE_FUZZ_CHECK(cucacheGetStats(0, &s) == cudaSuccess);
        CUCACHE_FUZZ_CHECK(s.allocatedBytesPeak >= s.allocatedBytes);
        CUCACHE_FUZZ_CHECK(s.reservedBytesPeak >= s.reservedBytes);
        if (op & 0x10) CUCACHE_FUZZ_CHECK(cucacheResetPeakStats(0) == cudaSuccess);
        break;
      }
      case 11: {
        if (op & 0x10) {
          g_counts.add(op_memory_summary);
          char buf[64];
          const std::size_t len = in.u8() % (sizeof buf + 1);
          const std::size_t n = cucacheMemorySummary(0, len ? buf : nullptr, len);
          CUCACHE_FUZZ_CHECK(n > 0);
          if (len > 0) CUCACHE_FUZZ_CHECK(buf[std::min(n, len - 1)] == '\0');
        } else {
          g_counts.add(op_mem_get_info);
          std::size_t free = 0, total = 0;
          const cudaError_t rc = cucacheMemGetInfo(&free, &total);
          if (rc == cudaSuccess) {
            CUCACHE_FUZZ_CHECK(free <= total);
          } else {
            g_counts.add(call_failed);
          }
        }
        break;
      }
      case 12:
        g_counts.add(op_complete_events);
        if (op & 0x10) {
          sim().complete_all();
        } else {
          sim().complete_stream(pick_stream(in, st));
        }
        break;
      case 13:
        do_inject(in);
        break;
      case 14:
        if ((op & 0x10) && !st.created.empty()) {
          g_counts.add(op_stream_destroy);
          const std::size_t i = in.u8() % st.created.size();
          sim().destroy_stream(st.created[i]);
          st.destroyed.push_back(st.created[i]);
          st.created.erase(st.created.begin() + static_cast<std::ptrdiff_t>(i));
        } else if (st.created.size() < 3) {
          g_counts.add(op_stream_create);
          st.created.push_back(static_cast<cudaStream_t>(sim().create_stream()));
        }
        break;
      default:
        do_bad_input(in, st);
        break;
    }
    check_all(st);
  }
  // Drain: with the faults off, everything freed and the cache emptied, the device holds nothing.
  clear_faults();
  while (!st.live.empty()) {
    CUCACHE_FUZZ_CHECK(cucacheFree(st.live.back().ptr) == cudaSuccess);
    drop_live(st, st.live.size() - 1);
  }
  CUCACHE_FUZZ_CHECK(cucacheEmptyCache() == cudaSuccess);
  check_all(st);
  CUCACHE_FUZZ_CHECK(sim().used_bytes() == 0);
  CUCACHE_FUZZ_CHECK(sim().live_segments() == 0 && sim().live_handles() == 0);
  // Dropped here, not at the next input's start, so that each input frees what it allocated
  // (libFuzzer runs a leak check after any input whose mallocs and frees do not balance).
  cucache::detail::reset_for_testing();
  return 0;
}
