// cucache-pair-count BYTES N: N cache-hit allocate+free pairs of BYTES in expandable mode on the
// simulated device, after one warm-up pair. Run it under callgrind for two values of N: the
// difference in instructions over the difference in N is the instructions per pair, a figure that
// is stable where timings are not (docs/benchmarks.md, issue 14).
//   valgrind --tool=callgrind --callgrind-out-file=/dev/null cucache-pair-count 67108864 1000
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "cucache/config.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/sim_backend.hpp"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: cucache-pair-count BYTES N\n");
    return 2;
  }
  const std::size_t bytes = std::strtoull(argv[1], nullptr, 0);
  const long n = std::strtol(argv[2], nullptr, 0);
  cucache::sim_options so;
  so.events_complete_immediately = true;
  auto backend = std::make_shared<cucache::sim_backend>(so);
  cucache::device_allocator a(backend, cucache::parse_config("expandable_segments:True"));
  a.deallocate(a.allocate(bytes, nullptr), nullptr);
  for (long i = 0; i < n; ++i) a.deallocate(a.allocate(bytes, nullptr), nullptr);
  std::printf("%llu maps\n",
              static_cast<unsigned long long>(backend->calls(cucache::sim_call::map)));
  return 0;
}
