// cucache-fastpath: a fixed number of cucache_sim fast-path operations, for instruction counts.
// cucache-bench runs as many iterations as its timer wants, so its instruction totals do not
// divide cleanly; this runs exactly N of one case, the measured loop in a function of its own
// (measured_loop), so that callgrind can count only it:
//
//   valgrind --tool=callgrind --toggle-collect='*measured_loop*'
//     build/bin/cucache-fastpath pair 65536 100000   (one command line)
//
// Cases (the same as cucache-bench's, same sizes and churn sequences):
//   pair BYTES N         N alloc+free pairs of BYTES on one stream, after one untimed pair
//   churn_small N        N churn operations, 2000 live blocks of 512 B-1 MiB
//   churn_large N        N churn operations, 1000 live blocks of 512 B-32 MiB
//   threads T N          T threads, each on its own stream, N 64 KiB pairs each
//   threads_one T N      T threads all on one stream, N 64 KiB pairs each
//   scatter BYTES N      2N blocks of BYTES live, then every other one freed in scatter_plan.hpp's
//                        order (N frees, each between live blocks: N free blocks of one size in
//                        one bin of the free index), then allocated again; prints ns per free
//                        (the measured loop) and per allocation
// Options (before the case): --expandable (expandable_segments:True), --conf CUCACHE_CONF,
// --announced (the captures-announced mode: no capture query while no capture is announced),
// --streams-announced (with --announced: stream destructions announced too, the thread's cached
// stream id instead of the id query; the probe destroys no stream).
// Prints the wall ns per pair or operation (indicative only on a shared machine).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "churn_plan.hpp"
#include "cucache/config.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/sim_backend.hpp"
#include "cucache/stats.hpp"
#include "scatter_plan.hpp"

namespace {

using cucache::device_allocator;
using cucache::stream_handle;

stream_handle sim_stream(int index) {
  return reinterpret_cast<stream_handle>(
      std::uintptr_t{0x5000} + std::uintptr_t{0x100} * static_cast<std::uintptr_t>(index));
}

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

void* volatile g_sink = nullptr;

// The measured loops: never inlined, so that --toggle-collect can name them.
[[gnu::noinline]] void measured_loop_pair(device_allocator& a, std::size_t bytes, long n,
                                          stream_handle s) {
  for (long i = 0; i < n; ++i) {
    void* p = a.allocate(bytes, s);
    g_sink = p;
    a.deallocate(p);
  }
}

[[gnu::noinline]] void measured_loop_churn(device_allocator& a,
                                           const cucache::bench::churn_plan& plan,
                                           std::vector<void*>& live, std::size_t& pos, long n,
                                           stream_handle s) {
  const std::size_t mask = plan.ops.size() - 1;
  for (long i = 0; i < n; ++i) {
    const auto& op = plan.ops[pos++ & mask];
    void*& ptr = live[op.slot];
    a.deallocate(ptr);
    ptr = a.allocate(op.bytes, s);
  }
}

[[gnu::noinline]] void measured_loop_scatter(device_allocator& a, const std::vector<void*>& ptrs) {
  for (void* p : ptrs) a.deallocate(p);
}

int usage() {
  std::fprintf(
      stderr,
      "usage: cucache-fastpath [--expandable] [--announced [--streams-announced]] [--conf CONF] "
      "(pair BYTES N | churn_small N | churn_large N | threads T N | threads_one T N | "
      "scatter BYTES N)\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    int i = 1;
    cucache::config cfg;
    bool announced = false;
    bool streams_announced = false;
    for (; i < argc && std::strncmp(argv[i], "--", 2) == 0; ++i) {
      if (std::strcmp(argv[i], "--expandable") == 0) {
        cfg.expandable_segments = true;
      } else if (std::strcmp(argv[i], "--announced") == 0) {
        announced = true;
      } else if (std::strcmp(argv[i], "--streams-announced") == 0) {
        streams_announced = true;
      } else if (std::strcmp(argv[i], "--conf") == 0 && i + 1 < argc) {
        cfg = cucache::parse_config(argv[++i], cfg);
      } else {
        return usage();
      }
    }
    if (i >= argc) return usage();
    const std::string what = argv[i++];
    auto num = [&](long fallback) { return i < argc ? std::atol(argv[i++]) : fallback; };
    device_allocator a(std::make_shared<cucache::sim_backend>(), cfg);
    a.set_captures_announced(announced);
    a.set_stream_destructions_announced(streams_announced);
    const stream_handle s = sim_stream(0);
    double per = 0;
    long n = 0;
    if (what == "pair") {
      const auto bytes = static_cast<std::size_t>(num(512));
      n = num(100000);
      a.deallocate(a.allocate(bytes, s));
      const std::int64_t t0 = now_ns();
      measured_loop_pair(a, bytes, n, s);
      per = static_cast<double>(now_ns() - t0) / static_cast<double>(n);
    } else if (what == "churn_small" || what == "churn_large") {
      const auto& plan = what == "churn_small" ? cucache::bench::small_churn_plan()
                                               : cucache::bench::large_churn_plan();
      n = num(100000);
      std::vector<void*> live;
      for (std::uint32_t bytes : plan.initial) live.push_back(a.allocate(bytes, s));
      std::size_t pos = 0;
      // Two untimed operations per live block, as cucache-bench does.
      {
        const std::size_t mask = plan.ops.size() - 1;
        for (std::size_t k = 0; k < 2 * live.size(); ++k) {
          const auto& op = plan.ops[pos++ & mask];
          a.deallocate(live[op.slot]);
          live[op.slot] = a.allocate(op.bytes, s);
        }
      }
      const std::int64_t t0 = now_ns();
      measured_loop_churn(a, plan, live, pos, n, s);
      per = static_cast<double>(now_ns() - t0) / static_cast<double>(n);
      for (void* p : live) a.deallocate(p);
    } else if (what == "scatter") {
      const auto bytes = static_cast<std::size_t>(num(512));
      n = num(100000);
      const std::vector<std::size_t> order =
          cucache::bench::scatter_free_order(static_cast<std::size_t>(n));
      std::vector<void*> live(2 * order.size());
      for (void*& p : live) p = a.allocate(bytes, s);
      std::vector<void*> freed;
      for (std::size_t k : order) freed.push_back(live[k]);
      const std::int64_t t0 = now_ns();
      measured_loop_scatter(a, freed);
      per = static_cast<double>(now_ns() - t0) / static_cast<double>(n);
      const std::int64_t t1 = now_ns();
      for (std::size_t k : order) live[k] = a.allocate(bytes, s);
      std::printf("scatter: %.1f ns per allocation after the frees\n",
                  static_cast<double>(now_ns() - t1) / static_cast<double>(n));
      for (void* p : live) a.deallocate(p);
    } else if (what == "threads" || what == "threads_one") {
      const int t = static_cast<int>(num(8));
      n = num(100000);
      const bool one = what == "threads_one";
      std::vector<std::thread> th;
      const std::int64_t t0 = now_ns();
      for (int k = 0; k < t; ++k) {
        th.emplace_back([&, k] {
          const stream_handle st = sim_stream(one ? 0 : k);
          a.deallocate(a.allocate(64 * 1024, st));
          measured_loop_pair(a, 64 * 1024, n, st);
        });
      }
      for (auto& x : th) x.join();
      per = static_cast<double>(now_ns() - t0) / (static_cast<double>(n) * t);
    } else {
      return usage();
    }
    const cucache::device_stats st = a.stats();
    std::printf("%s n=%ld wall_ns_per_op=%.1f device_allocs=%llu\n", what.c_str(), n, per,
                static_cast<unsigned long long>(st.device_alloc_count));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cucache-fastpath: %s\n", e.what());
    return 1;
  }
}
