// cucache-first-step: what the first training step's allocations cost with and without reserve
// (config reserve_mb), in both modes. A step allocates a model-like working set (48 activations of
// 24 MiB to 480 MiB and a few small tensors), frees it, and is repeated; for each setting the
// table gives, per step, the device allocation calls (cudaMalloc / cuMemCreate), the VM map calls
// and the host time of the step's allocate and free calls. Device calls are exact on any device;
// the times are what the device makes them: on the simulated device (the default without a GPU)
// device calls are nearly free, so only the counts mean anything there; on a GPU the first step's
// cudaMalloc / cuMemCreate+cuMemMap time is the cost reserve moves out of the step.
//
//   cucache-first-step [sim|cuda] [STEPS]      (default: cuda when a GPU is usable, else sim; 3)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "cucache/backend_factory.hpp"
#include "cucache/device_allocator.hpp"

namespace {

using clock_type = std::chrono::steady_clock;
constexpr std::size_t k_mib = std::size_t{1} << 20;

/// The step's requests, in allocation order (freed in reverse).
std::vector<std::size_t> step_sizes() {
  std::vector<std::size_t> sizes;
  for (int l = 0; l < 48; ++l) {
    sizes.push_back((24 + 10 * static_cast<std::size_t>(l % 46)) * k_mib);
    sizes.push_back(64 * 1024);  // a small tensor per layer (small pool)
  }
  return sizes;
}

std::size_t large_bytes(const std::vector<std::size_t>& sizes) {
  std::size_t n = 0;
  for (std::size_t s : sizes) n += s > k_mib ? s : 0;
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    cucache::backend_kind kind = cucache::count_devices(cucache::backend_kind::cuda).count > 0
                                     ? cucache::backend_kind::cuda
                                     : cucache::backend_kind::sim;
    if (argc > 1) kind = cucache::parse_backend_kind(argv[1], "the first argument");
    const int steps = argc > 2 ? std::max(1, std::atoi(argv[2])) : 3;
    const std::vector<std::size_t> sizes = step_sizes();
    // Rounded up to whole MiB; the large requests only (the small ones use the small pool).
    const std::size_t reserve_mb = (large_bytes(sizes) + k_mib - 1) / k_mib;
    std::printf("cucache-first-step on %s: %zu requests per step, %zu MiB of large ones\n",
                cucache::to_string(kind), sizes.size(), reserve_mb);
    std::printf("%-44s %5s %13s %10s %12s\n", "setting", "step", "device allocs", "VM maps",
                "host us");
    const std::string reserve = "reserve_mb:" + std::to_string(reserve_mb);
    for (const std::string& conf : {std::string(), reserve, std::string("expandable_segments:True"),
                                    "expandable_segments:True," + reserve}) {
      const auto t_create = clock_type::now();
      cucache::device_allocator a(cucache::make_backend(kind, 0), cucache::parse_config(conf));
      const double create_us =
          std::chrono::duration<double, std::micro>(clock_type::now() - t_create).count();
      std::uint64_t allocs = a.stats().device_alloc_count;
      std::uint64_t maps = a.stats().vm_map_count;
      const std::string name = conf.empty() ? "(defaults)" : conf;
      std::printf("%-44s %5s %13llu %10llu %12.1f\n", name.c_str(), "init",
                  static_cast<unsigned long long>(allocs), static_cast<unsigned long long>(maps),
                  create_us);
      std::vector<void*> live;
      for (int step = 1; step <= steps; ++step) {
        const auto t0 = clock_type::now();
        for (std::size_t s : sizes) live.push_back(a.allocate(s));
        while (!live.empty()) {
          a.deallocate(live.back());
          live.pop_back();
        }
        const double us = std::chrono::duration<double, std::micro>(clock_type::now() - t0).count();
        const cucache::device_stats st = a.stats();
        std::printf("%-44s %5d %13llu %10llu %12.1f\n", name.c_str(), step,
                    static_cast<unsigned long long>(st.device_alloc_count - allocs),
                    static_cast<unsigned long long>(st.vm_map_count - maps), us);
        allocs = st.device_alloc_count;
        maps = st.vm_map_count;
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cucache-first-step: %s\n", e.what());
    return 1;
  }
  return 0;
}
