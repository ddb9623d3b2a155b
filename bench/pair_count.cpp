// cucache-pair-count BYTES N [MODE]: N cache-hit allocate+free pairs of BYTES in expandable mode on
// the simulated device, after one warm-up pair. Run it under callgrind for two values of N: the
// difference in instructions over the difference in N is the instructions per pair, a figure that
// is stable where timings are not (docs/benchmarks.md, issue 14).
//   valgrind --tool=callgrind --callgrind-out-file=/dev/null cucache-pair-count 67108864 1000
// MODE (default plain): plain, a device_allocator of its own, without an observer; untagged, the
// process-wide allocator (CUCACHE_BACKEND=sim) once a tag was pushed and popped (the observe hub
// watches every allocation), pairs made outside any tag; tagged, the same with every pair made
// under a tag; limited, under a tag with a limit (set_tag_limit) that every pair stays within;
// untagged_limits, outside any tag while another tag has a limit (every allocation is admitted).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "cucache/config.hpp"
#include "cucache/cucache.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/sim_backend.hpp"

namespace {

void pairs(cucache::device_allocator& a, std::size_t bytes, long n) {
  a.deallocate(a.allocate(bytes, nullptr), nullptr);
  for (long i = 0; i < n; ++i) a.deallocate(a.allocate(bytes, nullptr), nullptr);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 && argc != 4) {
    std::fprintf(stderr,
                 "usage: cucache-pair-count BYTES N "
                 "[plain|untagged|tagged|limited|untagged_limits]\n");
    return 2;
  }
  const std::size_t bytes = std::strtoull(argv[1], nullptr, 0);
  const long n = std::strtol(argv[2], nullptr, 0);
  const char* mode = argc == 4 ? argv[3] : "plain";
  if (std::strcmp(mode, "plain") == 0) {
    cucache::sim_options so;
    so.events_complete_immediately = true;
    auto backend = std::make_shared<cucache::sim_backend>(so);
    cucache::device_allocator a(backend, cucache::parse_config("expandable_segments:True"));
    pairs(a, bytes, n);
    std::printf("%llu maps\n",
                static_cast<unsigned long long>(backend->calls(cucache::sim_call::map)));
    return 0;
  }
  const bool tagged = std::strcmp(mode, "tagged") == 0;
  const bool limited = std::strcmp(mode, "limited") == 0;
  const bool other_limited = std::strcmp(mode, "untagged_limits") == 0;
  if (!tagged && !limited && !other_limited && std::strcmp(mode, "untagged") != 0) {
    std::fprintf(stderr, "cucache-pair-count: unknown mode '%s'\n", mode);
    return 2;
  }
  setenv("CUCACHE_BACKEND", "sim", 1);
  setenv("CUCACHE_CONF", "expandable_segments:True", 1);
  cucache::push_tag("pair");  // turns the observe hub on for every allocator
  if (!tagged && !limited) cucache::pop_tag();
  if (limited) cucache::set_tag_limit(0, "pair", bytes);
  if (other_limited) cucache::set_tag_limit(0, "another", bytes);
  pairs(cucache::get(0), bytes, n);
  std::printf("%s\n", mode);
  return 0;
}
