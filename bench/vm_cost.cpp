// cucache-vm-cost: what each device call the expandable-segments pager makes costs on this GPU,
// measured through cuda_backend (the calls the allocator makes, with its flags): physical handle
// create/release, map, set-access, unmap at several sizes, an idle device synchronization and a
// memory-info query. Prints one line per call and size: median and range of microseconds over
// N rounds. Then whether handle creation scales with threads (issue 20: could creating pages ahead
// on other threads hide it?): T threads (1, 2, 4, 8) each create and then release ROUNDS handles
// of one page at once; prints the wall time per handle over all threads. Needs a GPU; exits 77
// without one.
//
//   cucache-vm-cost [ROUNDS]      (default 20)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <thread>
#include <vector>

#include "cucache/cuda_backend.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

double us_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::micro>(clock_type::now() - t0).count();
}

void report(const char* call, std::size_t bytes, std::vector<double> us) {
  std::sort(us.begin(), us.end());
  std::printf("%-20s %9zu MiB  median %9.1f us  min %9.1f  max %9.1f  (n=%zu)\n", call, bytes >> 20,
              us[us.size() / 2], us.front(), us.back(), us.size());
}

}  // namespace

int main(int argc, char** argv) {
  if (!cucache::cuda_available()) {
    std::printf("skipped: %s\n", cucache::cuda_unavailable_reason().c_str());
    return 77;
  }
  const int rounds = argc > 1 ? std::max(1, std::atoi(argv[1])) : 20;
  cucache::cuda_backend b(0);
  const std::size_t page = b.vm_granularity();
  std::printf("granularity %zu bytes\n", page);
  {
    std::vector<double> sync, info;
    for (int i = 0; i < rounds; ++i) {
      auto t0 = clock_type::now();
      b.device_synchronize();
      sync.push_back(us_since(t0));
      t0 = clock_type::now();
      static_cast<void>(b.mem_get_info());
      info.push_back(us_since(t0));
    }
    report("device_synchronize", 0, sync);
    report("mem_get_info", 0, info);
  }
  for (std::size_t bytes : {page, 16 * page, 128 * page}) {
    void* va = b.va_reserve(bytes);
    if (va == nullptr) {
      std::fprintf(stderr, "va_reserve(%zu) found no address space\n", bytes);
      return 1;
    }
    std::vector<double> create, map, access, unmap, release;
    for (int i = 0; i < rounds; ++i) {
      auto t0 = clock_type::now();
      const auto h = b.phys_create(bytes);
      create.push_back(us_since(t0));
      if (!h) {
        std::fprintf(stderr, "phys_create(%zu) failed\n", bytes);
        return 1;
      }
      t0 = clock_type::now();
      b.map(va, bytes, *h);
      map.push_back(us_since(t0));
      t0 = clock_type::now();
      b.set_access(va, bytes);
      access.push_back(us_since(t0));
      t0 = clock_type::now();
      b.unmap(va, bytes);
      unmap.push_back(us_since(t0));
      t0 = clock_type::now();
      b.phys_release(*h);
      release.push_back(us_since(t0));
    }
    b.va_free(va, bytes);
    report("phys_create", bytes, create);
    report("map", bytes, map);
    report("set_access", bytes, access);
    report("unmap", bytes, unmap);
    report("phys_release", bytes, release);
  }
  // Creation from several threads at once: wall microseconds per handle (create; release).
  for (int threads : {1, 2, 4, 8}) {
    std::vector<std::vector<cucache::phys_handle>> made(static_cast<std::size_t>(threads));
    auto t0 = clock_type::now();
    {
      std::vector<std::jthread> workers;
      for (int t = 0; t < threads; ++t) {
        workers.emplace_back([&, t] {
          for (int i = 0; i < rounds; ++i) {
            if (const auto h = b.phys_create(page)) made[static_cast<std::size_t>(t)].push_back(*h);
          }
        });
      }
    }
    const double create_us = us_since(t0);
    std::size_t n = 0;
    for (const auto& m : made) n += m.size();
    t0 = clock_type::now();
    {
      std::vector<std::jthread> workers;
      for (int t = 0; t < threads; ++t) {
        workers.emplace_back([&, t] {
          for (const auto& h : made[static_cast<std::size_t>(t)]) b.phys_release(h);
        });
      }
    }
    const double release_us = us_since(t0);
    std::printf("phys_create x%d threads  %zu handles of %zu MiB: %.1f us per handle (wall); "
                "phys_release %.1f us per handle\n",
                threads, n, page >> 20, n ? create_us / static_cast<double>(n) : 0.0,
                n ? release_us / static_cast<double>(n) : 0.0);
    if (n != static_cast<std::size_t>(threads * rounds)) {
      std::fprintf(stderr, "phys_create failed %zu times\n", static_cast<std::size_t>(threads * rounds) - n);
      return 1;
    }
  }
  return 0;
}
