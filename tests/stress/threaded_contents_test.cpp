// 16 threads on one allocator over a simulated device with host memory behind every device byte
// (ctest label `stress`): each thread allocates on its own stream and on a shared one, fills every
// block with a pattern of its own, and checks the pattern before the block is freed -- by itself,
// in the order of another stream, after record_stream, or by another thread that takes it from a
// shared mailbox. A block handed to two owners at once, or reused before its pending events
// completed, shows up as a pattern overwritten. Between phases (all threads joined: the invariant
// checker needs no concurrent frees) every live block's contents and the invariants are checked.
//
// CUCACHE_STRESS_SCALE scales the operations per thread (0.25 under ASan, 0.2 under TSan).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cucache/errors.hpp"
#include "support/sim_device.hpp"

namespace cucache::test {
namespace {

constexpr int k_threads = 16;
constexpr int k_phases = 6;
constexpr int k_ops_per_phase = 1'000;  // per thread
constexpr std::size_t k_max_live_per_thread = 24;

struct block {
  void* ptr;
  std::size_t size;
  std::uint64_t tag;  // seeds the pattern: unique per allocation
};

/// Host memory behind [p, p + n), a piece at a time: the sim maps it per segment or per VM
/// mapping, so a block of an expandable segment may span several host ranges (pieces never cross
/// a granularity boundary, and every mapping is a whole number of granules).
template <class F>
void for_each_piece(sim_backend& sim, void* p, std::size_t n, F&& f) {
  const std::size_t granule = sim.options().granularity_bytes;
  auto a = reinterpret_cast<std::uintptr_t>(p);
  std::size_t offset = 0;
  while (offset < n) {
    const std::size_t piece = std::min(n - offset, granule - (a + offset) % granule);
    std::byte* host = sim.host_view(reinterpret_cast<void*>(a + offset), piece);
    ASSERT_NE(host, nullptr) << "no host memory behind " << p << " + " << offset;
    f(host, offset, piece);
    offset += piece;
  }
}

// Words of the pattern: cheap to write and check, different for every block and offset.
std::uint64_t word(std::uint64_t tag, std::size_t index) {
  std::uint64_t x = tag * 0x9E3779B97F4A7C15ULL + index;
  x ^= x >> 29;
  return x * 0xBF58476D1CE4E5B9ULL;
}

/// Writes (Check = false) or compares (Check = true) the pattern of `tag` over the piece of a
/// block at `offset`, a word at a time.
template <bool Check>
bool pattern(std::byte* host, std::size_t offset, std::size_t n, std::uint64_t tag) {
  std::size_t i = 0;
  while (i < n) {
    const std::size_t at = offset + i;
    const std::size_t in_word = at % 8;
    const std::size_t len = std::min<std::size_t>(8 - in_word, n - i);
    const std::uint64_t w = word(tag, at / 8);
    std::byte bytes[8];
    std::memcpy(bytes, &w, 8);
    if constexpr (Check) {
      if (std::memcmp(host + i, bytes + in_word, len) != 0) return false;
    } else {
      std::memcpy(host + i, bytes + in_word, len);
    }
    i += len;
  }
  return true;
}

void fill(sim_backend& sim, const block& b) {
  for_each_piece(sim, b.ptr, b.size, [&](std::byte* host, std::size_t offset, std::size_t n) {
    pattern<false>(host, offset, n, b.tag);
  });
}

/// True when the block still holds its pattern.
bool intact(sim_backend& sim, const block& b) {
  bool ok = true;
  for_each_piece(sim, b.ptr, b.size, [&](std::byte* host, std::size_t offset, std::size_t n) {
    ok = ok && pattern<true>(host, offset, n, b.tag);
  });
  return ok;
}

class threaded_contents : public ::testing::TestWithParam<std::string> {};

TEST_P(threaded_contents, EveryBlockKeepsItsContentsUntilItsFree) {
  sim_options o;
  o.capacity_bytes = 256 * MiB;  // all of it host memory
  o.host_memory = true;
  sim_allocator a(parse_config(GetParam()), o);
  const int ops = std::max(1, static_cast<int>(k_ops_per_phase * stress_scale()));
  const stream_handle shared_stream = stream(0x5000);

  std::vector<std::vector<block>> live(k_threads);  // each thread's, kept across phases
  std::mutex mailbox_mu;
  std::vector<block> mailbox;  // blocks handed to whichever thread frees them
  std::atomic<std::uint64_t> next_tag{1};
  std::atomic<std::uint64_t> allocs{0}, ooms{0}, checked{0}, cross_thread{0}, corrupt{0};

  for (int phase = 0; phase < k_phases; ++phase) {
    std::vector<std::thread> threads;
    for (int t = 0; t < k_threads; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937_64 rng(static_cast<std::uint64_t>(phase * 1000 + t));
        const stream_handle own = stream(0x1000 * static_cast<std::uintptr_t>(t + 1));
        auto& mine = live[static_cast<std::size_t>(t)];
        auto release = [&](const block& b) {
          ++checked;
          if (!intact(*a.sim, b)) ++corrupt;
          switch (rng() % 4) {
            case 0:
              a.alloc.deallocate(b.ptr, shared_stream);
              break;
            case 1:
              a.alloc.record_stream(b.ptr, rng() % 2 ? shared_stream : own);
              a.alloc.deallocate(b.ptr);
              break;
            default:
              a.alloc.deallocate(b.ptr);
              break;
          }
        };
        for (int i = 0; i < ops; ++i) {
          const unsigned r = static_cast<unsigned>(rng() % 100);
          if (r < 45 && mine.size() < k_max_live_per_thread) {
            // Log-uniform from 1 B to 2 MiB: both pools, splits, blocks over two pages.
            const double l = std::uniform_real_distribution<double>(0.0, std::log(2.0 * MiB))(rng);
            const auto size = std::max<std::size_t>(1, static_cast<std::size_t>(std::exp(l)));
            void* p = nullptr;
            try {
              p = a.alloc.allocate(size, rng() % 4 == 0 ? shared_stream : own);
            } catch (const out_of_memory&) {
              ++ooms;
              continue;
            }
            ++allocs;
            const block b{p, size, next_tag++};
            fill(*a.sim, b);
            mine.push_back(b);
          } else if (r < 85 && !mine.empty()) {
            const std::size_t j = rng() % mine.size();
            const block b = mine[j];
            mine[j] = mine.back();
            mine.pop_back();
            release(b);
          } else if (r < 92 && !mine.empty()) {
            // Hand a block to another thread, which checks and frees it.
            const std::size_t j = rng() % mine.size();
            std::lock_guard lock(mailbox_mu);
            mailbox.push_back(mine[j]);
            mine[j] = mine.back();
            mine.pop_back();
          } else if (r < 97) {
            std::vector<block> taken;
            {
              std::lock_guard lock(mailbox_mu);
              taken.swap(mailbox);
            }
            for (const block& b : taken) {
              ++cross_thread;
              release(b);
            }
          } else if (r < 99) {
            a.sim->complete_stream(rng() % 2 ? own : shared_stream);
          } else {
            // Device-wide paths while others allocate and free: stats and emptying the cache.
            (void)a.alloc.stats();
            if (rng() % 4 == 0) a.alloc.empty_cache();
            a.sim->complete_all();
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    SCOPED_TRACE("after phase " + std::to_string(phase));
    ASSERT_NO_THROW(a.alloc.check_invariants());
    std::size_t live_count = mailbox.size();
    for (const block& b : mailbox) EXPECT_TRUE(intact(*a.sim, b)) << "mailbox block " << b.ptr;
    for (const auto& mine : live) {
      live_count += mine.size();
      for (const block& b : mine) EXPECT_TRUE(intact(*a.sim, b)) << "live block " << b.ptr;
    }
    const auto s = a.stats();
    ASSERT_EQ(static_cast<std::size_t>(s.allocation_count[0].current), live_count);
    ASSERT_EQ(a.sim->used_bytes(), static_cast<std::size_t>(s.reserved_bytes[0].current));
  }
  EXPECT_EQ(corrupt.load(), 0u) << "blocks whose contents changed before their free";
  for (auto& mine : live) {
    for (const block& b : mine) {
      EXPECT_TRUE(intact(*a.sim, b));
      a.alloc.deallocate(b.ptr);
    }
  }
  for (const block& b : mailbox) a.alloc.deallocate(b.ptr);
  a.alloc.empty_cache();
  a.alloc.check_invariants();
  EXPECT_EQ(a.reserved(), 0);
  EXPECT_EQ(a.sim->used_bytes(), 0u);
  EXPECT_GT(allocs.load(), static_cast<std::uint64_t>(k_threads * k_phases * ops / 4));
  EXPECT_GT(cross_thread.load(), 0u);
  std::printf(
      "threaded_contents: %llu allocations, %llu blocks checked before their free (%llu "
      "freed by another thread), %llu out of memory, %llu corrupt\n",
      static_cast<unsigned long long>(allocs.load()),
      static_cast<unsigned long long>(checked.load()),
      static_cast<unsigned long long>(cross_thread.load()),
      static_cast<unsigned long long>(ooms.load()),
      static_cast<unsigned long long>(corrupt.load()));
}

INSTANTIATE_TEST_SUITE_P(
    Modes, threaded_contents,
    ::testing::Values("", "expandable_segments:True",
                      "roundup_power2_divisions:4,max_split_size_mb:40,"
                      "garbage_collection_threshold:0.7",
                      // Tight: the out-of-memory ladder runs while other threads allocate and free.
                      "expandable_segments:True,memory_limit:40MiB", "memory_limit:40MiB"),
    [](const ::testing::TestParamInfo<std::string>& p) {
      return "config" + std::to_string(p.index);
    });

}  // namespace
}  // namespace cucache::test
