// The C++ API in a few lines: owning device pointers, stream-ordered allocation, statistics and
// the summary table. Runs on a GPU, or anywhere with CUCACHE_BACKEND=sim (no memory is touched).
#include <cucache/cucache.hpp>

#include <cstdio>
#include <exception>
#include <utility>
#include <vector>

int main() {
  try {
    // Owning pointers: freed back to cucache's cache when they go out of scope.
    std::vector<cucache::unique_device_ptr<float>> buffers;
    for (int i = 0; i < 8; ++i) buffers.push_back(cucache::make_unique_device<float>(1 << 18));

    // Ownership moves; the moved-from pointer is empty.
    cucache::unique_device_ptr<float> kept = std::move(buffers.front());
    std::printf("moved %zu floats; source now %s\n", kept.size(),
                buffers.front() ? "full" : "empty");

    // Freed blocks are reused: this round needs one new device allocation, not eight.
    buffers.clear();
    for (int i = 0; i < 8; ++i) buffers.push_back(cucache::make_unique_device<float>(1 << 18));

    const cucache::device_stats stats = cucache::get().stats();
    std::printf("%lld allocations served by %llu device allocations\n",
                static_cast<long long>(stats.allocation_count[0].allocated),
                static_cast<unsigned long long>(stats.device_alloc_count));
    std::printf("%s", cucache::memory_summary(cucache::get().device()).c_str());
  } catch (const std::exception& e) {
    // out_of_memory's what() is the full report; cuda_error names the failed call.
    std::fprintf(stderr, "cpp_api: %s\n", e.what());
    return 1;
  }
  return 0;
}
