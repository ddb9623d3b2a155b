// Tag limits (cucacheSetTagLimit, cucache::set_tag_limit) on the simulated device: the exact
// boundary, the refusal as an out-of-memory error naming the tag, its limit, its use and the
// request with nothing else changed, a limit below use, 0 and no limit, per device, misuse, and
// the invariant "a tag never holds more than its limit" under threads and along a seeded random
// run checked after every operation.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "api/registry.hpp"
#include "cucache/cucache.h"
#include "cucache/cucache.hpp"
#include "cucache/errors.hpp"
#include "cucache/observe.hpp"
#include "support/sim_registry.hpp"
#include "support/stat_values.hpp"

namespace {

constexpr std::size_t k_mib = std::size_t{1} << 20;

class TagLimit : public cucache::test::sim_registry_test {
 protected:
  static std::string message() { return cucacheGetLastErrorMessage(); }
  static cudaError_t alloc_under(const char* tag, std::size_t bytes, void** p) {
    EXPECT_EQ(cucachePushTag(tag), cudaSuccess);
    const cudaError_t rc = cucacheMalloc(p, bytes);
    EXPECT_EQ(cucachePopTag(), cudaSuccess);
    return rc;
  }
  static cucacheStats stats() {
    cucacheStats s{};
    EXPECT_EQ(cucacheGetStats(0, &s), cudaSuccess) << message();
    return s;
  }
};

bool same_stats(const cucache::device_stats& a, const cucache::device_stats& b) {
  return cucache::test::stat_values(a) == cucache::test::stat_values(b);
}

TEST_F(TagLimit, RefusesExactlyPastTheLimitNamingTagLimitUseAndRequest) {
  ASSERT_EQ(cucacheSetTagLimit(0, "kv", 10 * k_mib), cudaSuccess) << message();
  std::size_t limit = 0;
  ASSERT_EQ(cucacheGetTagLimit(0, "kv", &limit), cudaSuccess);
  EXPECT_EQ(limit, 10 * k_mib);
  void* a = nullptr;
  void* b = nullptr;
  ASSERT_EQ(alloc_under("kv", 4 * k_mib, &a), cudaSuccess) << message();
  ASSERT_EQ(alloc_under("kv", 6 * k_mib, &b), cudaSuccess) << message();  // exactly at the limit

  const cucache::device_stats before = cucache::get(0).stats();
  void* c = reinterpret_cast<void*>(0x1);
  EXPECT_EQ(alloc_under("kv", 1, &c), cudaErrorMemoryAllocation);
  EXPECT_EQ(c, nullptr);
  const std::string m = message();
  EXPECT_NE(m.find("out of memory under tag 'kv' on device 0"), std::string::npos) << m;
  EXPECT_NE(m.find("allocating 1 B (1 bytes)"), std::string::npos) << m;
  EXPECT_NE(m.find("limit of 10.00 MiB (10485760 bytes)"), std::string::npos) << m;
  EXPECT_NE(m.find("it uses 10.00 MiB (10485760 bytes)"), std::string::npos) << m;
  // Nothing else changed: not the device's statistics (no OOM counted, no retry), not the tag's
  // bytes; only the tag's refusal count.
  EXPECT_TRUE(same_stats(before, cucache::get(0).stats()));
  const cucache::tag_stat t = cucache::tag_stats(0, "kv");
  EXPECT_EQ(t.current_bytes, 10 * k_mib);
  EXPECT_EQ(t.peak_bytes, 10 * k_mib);
  EXPECT_EQ(t.allocations, 2u);
  EXPECT_EQ(t.total_allocations, 2u);
  EXPECT_EQ(t.limit_bytes, 10 * k_mib);
  EXPECT_EQ(t.limit_refusals, 1u);
  cucache::get(0).check_invariants();

  // Others allocate freely: untagged, another tag, both past the limit's size.
  void* u = nullptr;
  ASSERT_EQ(cucacheMalloc(&u, 32 * k_mib), cudaSuccess) << message();
  void* o = nullptr;
  ASSERT_EQ(alloc_under("other", 32 * k_mib, &o), cudaSuccess) << message();
  // A free under the tag makes room again, to the byte.
  ASSERT_EQ(cucacheFree(b), cudaSuccess);
  EXPECT_EQ(alloc_under("kv", 6 * k_mib + 1, &c), cudaErrorMemoryAllocation);
  ASSERT_EQ(alloc_under("kv", 6 * k_mib, &c), cudaSuccess) << message();
  EXPECT_EQ(cucache::tag_stats(0, "kv").limit_refusals, 2u);
  for (void* p : {a, c, u, o}) EXPECT_EQ(cucacheFree(p), cudaSuccess);
  EXPECT_EQ(cucache::tag_stats(0, "kv").current_bytes, 0u);
}

TEST_F(TagLimit, CxxThrowsTagLimitErrorAnOutOfMemory) {
  cucache::set_tag_limit(0, "train", 3 * k_mib);
  cucache::scoped_tag scope("train");
  void* p = cucache::malloc(2 * k_mib);
  try {
    static_cast<void>(cucache::malloc(2 * k_mib));
    ADD_FAILURE() << "no error";
  } catch (const cucache::tag_limit_error& e) {
    EXPECT_EQ(e.tag(), "train");
    EXPECT_EQ(e.device(), 0);
    EXPECT_EQ(e.limit(), 3 * k_mib);
    EXPECT_EQ(e.used(), 2 * k_mib);
    EXPECT_EQ(e.requested(), 2 * k_mib);
  }
  // As the library's out-of-memory error, and std::bad_alloc.
  EXPECT_THROW(static_cast<void>(cucache::malloc(2 * k_mib)), cucache::out_of_memory);
  EXPECT_THROW(static_cast<void>(cucache::malloc(2 * k_mib)), std::bad_alloc);
  // A zero-byte request takes nothing and is never refused.
  EXPECT_EQ(cucache::malloc(0), nullptr);
  cucache::free(p);
}

TEST_F(TagLimit, ALimitBelowUseKeepsWhatIsHeldAndRefusesUntilFreesBringItUnder) {
  void* a = nullptr;
  void* b = nullptr;
  ASSERT_EQ(alloc_under("kv", 4 * k_mib, &a), cudaSuccess);
  ASSERT_EQ(alloc_under("kv", 4 * k_mib, &b), cudaSuccess);
  ASSERT_EQ(cucacheSetTagLimit(0, "kv", 5 * k_mib), cudaSuccess) << message();
  EXPECT_EQ(cucache::tag_stats(0, "kv").current_bytes, 8 * k_mib);  // nothing given back
  void* c = nullptr;
  EXPECT_EQ(alloc_under("kv", 1, &c), cudaErrorMemoryAllocation);
  EXPECT_NE(message().find("it uses 8.00 MiB (8388608 bytes)"), std::string::npos) << message();
  ASSERT_EQ(cucacheFree(a), cudaSuccess);  // 4 MiB: 1 MiB of room
  EXPECT_EQ(alloc_under("kv", k_mib + 1, &c), cudaErrorMemoryAllocation);
  ASSERT_EQ(alloc_under("kv", k_mib, &c), cudaSuccess) << message();
  EXPECT_EQ(cucache::tag_stats(0, "kv").current_bytes, 5 * k_mib);
  EXPECT_EQ(cucache::tag_stats(0, "kv").limit_refusals, 2u);
  for (void* p : {b, c}) EXPECT_EQ(cucacheFree(p), cudaSuccess);
}

TEST_F(TagLimit, ZeroAllowsNothingAndNoLimitRemovesIt) {
  std::size_t limit = 0;
  ASSERT_EQ(cucacheGetTagLimit(0, "never", &limit), cudaSuccess);
  EXPECT_EQ(limit, CUCACHE_NO_TAG_LIMIT);
  EXPECT_EQ(cucache::tag_limit(0, "never"), cucache::k_no_tag_limit);
  ASSERT_EQ(cucacheSetTagLimit(0, "frozen", 0), cudaSuccess);
  void* p = nullptr;
  EXPECT_EQ(alloc_under("frozen", 1, &p), cudaErrorMemoryAllocation);
  // A tag with a limit is listed before it allocates.
  const std::vector<cucache::tag_stat> tags = cucache::tag_stats(0);
  ASSERT_EQ(tags.size(), 1u);
  EXPECT_EQ(tags[0].tag, "frozen");
  EXPECT_EQ(tags[0].limit_bytes, 0u);
  EXPECT_EQ(tags[0].limit_refusals, 1u);
  ASSERT_EQ(cucacheSetTagLimit(0, "frozen", CUCACHE_NO_TAG_LIMIT), cudaSuccess);
  ASSERT_EQ(alloc_under("frozen", 64 * k_mib, &p), cudaSuccess) << message();
  ASSERT_EQ(cucacheGetTagLimit(0, "frozen", &limit), cudaSuccess);
  EXPECT_EQ(limit, CUCACHE_NO_TAG_LIMIT);
  EXPECT_EQ(cucacheFree(p), cudaSuccess);
  // The summary's tag table shows the limit, "-" for none.
  ASSERT_EQ(cucacheSetTagLimit(0, "kv", 12345), cudaSuccess);
  const std::string summary = cucache::memory_summary(0);
  EXPECT_NE(summary.find("limit"), std::string::npos) << summary;
  EXPECT_NE(summary.find("12345"), std::string::npos) << summary;
}

TEST_F(TagLimit, BadArgumentsAreRefusedWithTheirReason) {
  std::size_t limit = 0;
  EXPECT_EQ(cucacheSetTagLimit(0, nullptr, 1), cudaErrorInvalidValue);
  EXPECT_NE(message().find("tag is NULL"), std::string::npos) << message();
  EXPECT_EQ(cucacheSetTagLimit(0, "", 1), cudaErrorInvalidValue);
  EXPECT_NE(message().find("the tag is empty"), std::string::npos) << message();
  EXPECT_EQ(cucacheSetTagLimit(-1, "kv", 1), cudaErrorInvalidDevice);
  EXPECT_NE(message().find("invalid device ordinal -1"), std::string::npos) << message();
  EXPECT_EQ(cucacheSetTagLimit(7, "kv", 1), cudaErrorInvalidDevice);
  EXPECT_EQ(cucacheGetTagLimit(0, "kv", nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheGetTagLimit(0, nullptr, &limit), cudaErrorInvalidValue);
  EXPECT_EQ(cucacheGetTagLimit(3, "kv", &limit), cudaErrorInvalidDevice);
  EXPECT_EQ(cucache::tag_stats(0).size(), 0u);  // nothing was set
}

TEST_F(TagLimit, LimitsArePerDevice) {
  ::setenv("CUCACHE_SIM_DEVICES", "2", 1);
  cucache::detail::reset_for_testing();
  cucache::set_tag_limit(1, "kv", k_mib);
  EXPECT_EQ(cucache::tag_limit(0, "kv"), cucache::k_no_tag_limit);
  cucache::scoped_tag scope("kv");
  void* on0 = cucache::get(0).allocate(8 * k_mib);  // device 0: no limit
  EXPECT_THROW(static_cast<void>(cucache::get(1).allocate(k_mib + 1)), cucache::tag_limit_error);
  void* on1 = cucache::get(1).allocate(k_mib);
  EXPECT_EQ(cucache::tag_stats(0, "kv").current_bytes, 8 * k_mib);
  EXPECT_EQ(cucache::tag_stats(1, "kv").current_bytes, k_mib);
  EXPECT_EQ(cucache::tag_stats(1, "kv").limit_refusals, 1u);
  EXPECT_EQ(cucache::tag_stats(0, "kv").limit_refusals, 0u);
  cucache::get(0).deallocate(on0);
  cucache::get(1).deallocate(on1);
}

TEST_F(TagLimit, ExpandableModeAndFailedAllocationsGiveTheirAdmissionBack) {
  cucache::test::use_sim_registry("expandable_segments:True,memory_limit:64MiB");
  cucache::set_tag_limit(0, "kv", 100 * k_mib);
  cucache::scoped_tag scope("kv");
  // Past the memory limit: the device refuses after the tag admitted it. Its bytes must not stay
  // counted against the tag: the whole limit's worth is then still allocatable in pieces.
  EXPECT_THROW(static_cast<void>(cucache::malloc(80 * k_mib)), cucache::out_of_memory);
  try {
    static_cast<void>(cucache::malloc(80 * k_mib));
  } catch (const cucache::tag_limit_error&) {
    ADD_FAILURE() << "the device's refusal was reported as the tag's";
  } catch (const cucache::out_of_memory&) {
  }
  EXPECT_EQ(cucache::tag_stats(0, "kv").limit_refusals, 0u);
  std::vector<void*> held;
  for (int i = 0; i < 6; ++i) held.push_back(cucache::malloc(10 * k_mib));
  EXPECT_EQ(cucache::tag_stats(0, "kv").current_bytes, 60 * k_mib);
  for (void* p : held) cucache::free(p);
  cucache::get(0).check_invariants();
}

// Threads race to allocate under one limited tag: the tag's peak -- taken under the hub's lock at
// every allocation -- never passes the limit, some allocations are refused, none of a tag without
// a limit is, and once all is freed the whole limit is allocatable again (nothing stays admitted).
TEST_F(TagLimit, ExactUnderThreads) {
  constexpr std::size_t k_limit = 10 * k_mib;
  cucache::set_tag_limit(0, "shared", k_limit);
  constexpr int k_threads = 8;
  constexpr int k_ops = 1500;
  std::atomic<std::uint64_t> refused{0};
  std::atomic<std::uint64_t> served{0};
  std::atomic<std::uint64_t> other_refused{0};
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < k_threads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(1234 + t);
      std::vector<void*> mine;
      // All start together, so that they overlap as much as the machine lets them. (One thread
      // alone can also reach the limit: up to 4 blocks of up to 4 MiB.)
      ready.fetch_add(1);
      while (ready.load() < k_threads) std::this_thread::yield();
      for (int i = 0; i < k_ops; ++i) {
        const bool limited = t % 4 != 3;
        cucache::scoped_tag scope(limited ? "shared" : "free");
        const std::size_t bytes = 1 + rng() % (4 * k_mib);
        try {
          mine.push_back(cucache::malloc(bytes));
          served.fetch_add(1);
        } catch (const cucache::tag_limit_error& e) {
          (limited ? refused : other_refused).fetch_add(1);
          EXPECT_GT(e.used() + e.requested(), e.limit());
        }
        if (mine.size() > 3 || (!mine.empty() && rng() % 4 == 0)) {
          const std::size_t k = rng() % mine.size();
          cucache::free(mine[k]);
          mine.erase(mine.begin() + static_cast<std::ptrdiff_t>(k));
        }
      }
      for (void* p : mine) cucache::free(p);
    });
  }
  for (std::thread& th : threads) th.join();
  const cucache::tag_stat t = cucache::tag_stats(0, "shared");
  EXPECT_LE(t.peak_bytes, k_limit);
  EXPECT_GT(t.peak_bytes, k_limit / 2);
  EXPECT_GT(refused.load(), 0u);
  EXPECT_EQ(t.limit_refusals, refused.load());
  EXPECT_EQ(other_refused.load(), 0u);
  EXPECT_GT(served.load(), 0u);
  EXPECT_EQ(t.current_bytes, 0u);
  EXPECT_EQ(t.allocations, 0u);
  cucache::scoped_tag scope("shared");
  void* whole = cucache::malloc(k_limit);
  cucache::free(whole);
  cucache::get(0).check_invariants();
}

// A seeded random run over three tags, whose limits change (below use too), with a model of each
// tag's use: after every operation the tag statistics equal the model, an allocation is refused
// exactly when use + request passes the limit, a refusal changes neither the device's statistics
// nor the tags' bytes, no tag holds more than its limit unless the limit was lowered under what it
// already held, and the allocator's invariants hold.
TEST_F(TagLimit, SeededRandomRunKeepsTheQuotaInvariant) {
  const char* tags[] = {"a", "b", "c"};
  struct model {
    std::size_t limit = cucache::k_no_tag_limit;
    std::size_t use = 0;
    std::size_t use_at_limit_set = 0;  // what it held when the limit was set
    std::uint64_t refusals = 0;
  };
  std::map<std::string, model> m;
  struct live {
    void* p;
    std::string tag;
    std::size_t bytes;
  };
  std::vector<live> held;
  std::mt19937_64 rng(20261203);
  cucache::device_allocator& a = cucache::get(0);
  for (int op = 0; op < 3000; ++op) {
    const std::string tag = tags[rng() % 3];
    model& t = m[tag];
    const int what = static_cast<int>(rng() % 10);
    if (what == 0) {
      const std::size_t limits[] = {0, 512, 3 * k_mib, 8 * k_mib, 20 * k_mib,
                                    cucache::k_no_tag_limit};
      t.limit = limits[rng() % std::size(limits)];
      t.use_at_limit_set = t.use;
      cucache::set_tag_limit(0, tag, t.limit);
    } else if (what <= 3 && !held.empty()) {
      const std::size_t k = rng() % held.size();
      cucache::free(held[k].p);
      m[held[k].tag].use -= held[k].bytes;
      held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
    } else {
      const std::size_t bytes = 1 + rng() % (rng() % 2 == 0 ? 4096 : 5 * k_mib);
      const bool fits = t.use <= t.limit && bytes <= t.limit - t.use;
      const cucache::device_stats before = a.stats();
      cucache::scoped_tag scope(tag);
      try {
        void* p = cucache::malloc(bytes);
        ASSERT_TRUE(fits) << "op " << op << ": " << bytes << " under " << tag;
        held.push_back({p, tag, bytes});
        t.use += bytes;
      } catch (const cucache::tag_limit_error& e) {
        ASSERT_FALSE(fits) << "op " << op << ": " << e.what();
        ++t.refusals;
        EXPECT_EQ(e.used(), t.use);
        EXPECT_EQ(e.limit(), t.limit);
        ASSERT_TRUE(same_stats(before, a.stats())) << "op " << op;
      }
    }
    for (const auto& [name, mt] : m) {
      const cucache::tag_stat s = cucache::tag_stats(0, name);
      ASSERT_EQ(s.current_bytes, mt.use) << "op " << op << " tag " << name;
      ASSERT_EQ(s.limit_bytes, mt.limit) << "op " << op << " tag " << name;
      ASSERT_EQ(s.limit_refusals, mt.refusals) << "op " << op << " tag " << name;
      ASSERT_TRUE(s.current_bytes <= s.limit_bytes || s.current_bytes <= mt.use_at_limit_set)
          << "op " << op << " tag " << name;
    }
    a.check_invariants();
  }
  for (const live& l : held) cucache::free(l.p);
}

}  // namespace
