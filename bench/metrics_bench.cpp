// cucache-metrics-bench: the cost of one metrics scrape (cucache::metrics(), cucacheWriteMetrics)
// with D devices and T tags per device, while L threads allocate and free under those tags on the
// simulated device -- what scraping every second under load costs the process. Figures only (no
// thresholds): docs/api.md, "Metrics".
//   cucache-metrics-bench [--benchmark_min_time=0.2]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cucache/cucache.h"
#include "cucache/cucache.hpp"
#include "cucache/observe.hpp"

namespace {

constexpr int k_max_devices = 4;

std::string tag_name(int i) {
  return "tenant-" + std::to_string(i);
}

// Tags 0..tags-1 hold one block each on devices 0..devices-1, and have a limit there (so that
// every tag metric, the limit included, has a sample). Benchmarks run in registration order with
// growing (devices, tags): each setup is a superset of the one before.
std::vector<void*>& held() {
  static std::vector<void*> blocks;
  return blocks;
}
void set_up(int devices, int tags) {
  static int done_devices = 0;
  static int done_tags = 0;
  for (int d = 0; d < devices; ++d) {
    for (int t = (d < done_devices ? done_tags : 0); t < tags; ++t) {
      cucache::set_tag_limit(d, tag_name(t), std::size_t{1} << 40);
      cucache::scoped_tag scope(tag_name(t));
      held().push_back(cucache::get(d).allocate(4096 + 512 * static_cast<std::size_t>(t)));
    }
  }
  done_devices = std::max(done_devices, devices);
  done_tags = std::max(done_tags, tags);
}

// L threads of allocation churn under the tags until stopped.
class load {
 public:
  load(int threads, int devices, int tags) {
    for (int i = 0; i < threads; ++i) {
      workers_.emplace_back([this, i, devices, tags] {
        std::mt19937_64 rng(static_cast<std::uint64_t>(i) + 1);
        std::vector<std::pair<int, void*>> mine;
        while (!stop_.load(std::memory_order_relaxed)) {
          const int d = static_cast<int>(rng() % static_cast<unsigned>(devices));
          cucache::scoped_tag scope(tag_name(static_cast<int>(rng() % static_cast<unsigned>(tags))));
          mine.emplace_back(d, cucache::get(d).allocate(512 + rng() % (4 << 20)));
          if (mine.size() > 8) {
            cucache::get(mine.front().first).deallocate(mine.front().second);
            mine.erase(mine.begin());
          }
          ops_.fetch_add(1, std::memory_order_relaxed);
        }
        for (auto& [d, p] : mine) cucache::get(d).deallocate(p);
      });
    }
  }
  ~load() {
    stop_.store(true);
    for (std::thread& t : workers_) t.join();
  }
  [[nodiscard]] std::uint64_t ops() const { return ops_.load(); }

 private:
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> ops_{0};
  std::vector<std::thread> workers_;
};

// Args: devices, tags, load threads.
void metrics_text(benchmark::State& state) {
  const int devices = static_cast<int>(state.range(0));
  const int tags = static_cast<int>(state.range(1));
  set_up(devices, tags);
  std::size_t bytes = 0;
  {
    load background(static_cast<int>(state.range(2)), devices, tags);
    for (auto _ : state) {
      std::string text = cucache::metrics();
      bytes = text.size();
      benchmark::DoNotOptimize(text.data());
    }
    state.counters["load_ops"] = benchmark::Counter(static_cast<double>(background.ops()),
                                                    benchmark::Counter::kIsRate);
  }
  state.counters["text_bytes"] = static_cast<double>(bytes);
}

// The C function into a caller's buffer (sized once, with room to grow).
void metrics_write(benchmark::State& state) {
  const int devices = static_cast<int>(state.range(0));
  const int tags = static_cast<int>(state.range(1));
  set_up(devices, tags);
  std::size_t needed = 0;
  if (cucacheWriteMetrics(nullptr, 0, &needed) != cudaSuccess) {
    state.SkipWithError(cucacheGetLastErrorMessage());
    return;
  }
  std::vector<char> buf(needed * 2);
  load background(static_cast<int>(state.range(2)), devices, tags);
  for (auto _ : state) {
    if (cucacheWriteMetrics(buf.data(), buf.size(), &needed) != cudaSuccess) {
      state.SkipWithError(cucacheGetLastErrorMessage());
      return;
    }
    benchmark::DoNotOptimize(buf.data());
  }
  state.counters["text_bytes"] = static_cast<double>(needed);
}

BENCHMARK(metrics_text)
    ->ArgNames({"devices", "tags", "load_threads"})
    ->Args({1, 1, 0})
    ->Args({1, 16, 0})
    ->Args({1, 16, 2})
    ->Args({1, 256, 0})
    ->Args({1, 256, 2})
    ->Args({4, 256, 0})
    ->Args({4, 256, 2})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(metrics_write)
    ->ArgNames({"devices", "tags", "load_threads"})
    ->Args({4, 256, 0})
    ->Args({4, 256, 2})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  ::setenv("CUCACHE_BACKEND", "sim", 0);
  ::setenv("CUCACHE_SIM_DEVICES", std::to_string(k_max_devices).c_str(), 0);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
