// libcucache_torch_hooks.so: installs cucache as PyTorch's allocator from C++, which reaches what
// a Python-built CUDAPluggableAllocator cannot: tensor.record_stream(), torch.cuda.empty_cache(),
// set_per_process_memory_fraction(), torch.cuda.memory_stats() and a real OutOfMemoryError. The
// allocator itself stays in libcucache_torch.so (shared with the Python module's statistics).
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "cucache_torch.h"

extern "C" {
/* Makes cucache torch's CUDA allocator, with every hook. Must run before torch allocates CUDA
 * memory. 0, or -1 with the reason in cucache_torch_last_error(). */
CUCACHE_TORCH_API int cucache_torch_hooks_install(void);
}

namespace cucache::detail {
namespace {

using c10::CachingDeviceAllocator::DeviceStats;
using torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;

void* alloc_or_throw(std::size_t size, int device, cudaStream_t stream) {
  void* p = cucache_torch_alloc(size, device, stream);
  // Raising here gives Python torch.OutOfMemoryError; torch does not check a null itself.
  TORCH_CHECK_WITH(OutOfMemoryError, p != nullptr || size == 0, cucache_torch_last_error());
  return p;
}

void fill(const cucache_torch_stat* from, c10::CachingAllocator::StatArray& to) {
  for (std::size_t i = 0; i < to.size() && i < CUCACHE_TORCH_POOLS; ++i) {
    to[i].current = from[i].current;
    to[i].peak = from[i].peak;
    to[i].allocated = from[i].allocated;
    to[i].freed = from[i].freed;
  }
}

cucache_torch_stats stats_of(c10::DeviceIndex device) {
  cucache_torch_stats s{};
  TORCH_CHECK(cucache_torch_get_stats(device, &s) == 0, cucache_torch_last_error());
  return s;
}

// The statistics calls, which CUDAPluggableAllocator refuses, answered from cucache's own.
struct cucache_allocator final : CUDAPluggableAllocator {
  using CUDAPluggableAllocator::CUDAPluggableAllocator;

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    const cucache_torch_stats s = stats_of(device);
    // c10's DeviceStats, field by field: the plug-in struct uses its names (cucache_torch.h, laid
    // out from the field table), and carries more, which c10 has no place for.
    DeviceStats d;
    fill(s.allocation, d.allocation);
    fill(s.segment, d.segment);
    fill(s.active, d.active);
    fill(s.inactive_split, d.inactive_split);
    fill(s.allocated_bytes, d.allocated_bytes);
    fill(s.reserved_bytes, d.reserved_bytes);
    fill(s.active_bytes, d.active_bytes);
    fill(s.inactive_split_bytes, d.inactive_split_bytes);
    fill(s.requested_bytes, d.requested_bytes);
    d.num_alloc_retries = static_cast<int64_t>(s.num_alloc_retries);
    d.num_ooms = static_cast<int64_t>(s.num_ooms);
    d.oversize_allocations.current = static_cast<int64_t>(s.oversize_allocations);
    d.oversize_segments.current = static_cast<int64_t>(s.oversize_segments);
    d.num_device_alloc = static_cast<int64_t>(s.num_device_alloc);
    d.num_device_free = static_cast<int64_t>(s.num_device_free);
    return d;
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    TORCH_CHECK(cucache_torch_reset_peak_stats(device) == 0, cucache_torch_last_error());
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    TORCH_CHECK(cucache_torch_reset_accumulated_stats(device) == 0, cucache_torch_last_error());
  }
  void cacheInfo(c10::DeviceIndex device, std::size_t* largest_block) override {
    // cuDNN sizes its workspace by this; the largest cached free block is what it can get fast.
    *largest_block = static_cast<std::size_t>(stats_of(device).largest_free_block);
  }
  std::string name() override { return "cucache"; }
};

}  // namespace
}  // namespace cucache::detail

int cucache_torch_hooks_install(void) {
  using namespace cucache::detail;
  try {
    auto a = std::make_shared<cucache_allocator>(&alloc_or_throw, &cucache_torch_free);
    a->set_record_stream_fn([](void* ptr, cudaStream_t stream) {
      // A zero-size tensor has no memory to protect.
      if (ptr != nullptr) {
        TORCH_CHECK(cucache_torch_record_stream(ptr, stream) == 0, cucache_torch_last_error());
      }
    });
    a->set_reset_fn(
        [] { TORCH_CHECK(cucache_torch_empty_cache() == 0, cucache_torch_last_error()); });
    a->set_memory_fraction_fn([](double fraction, int device) {
      TORCH_CHECK(cucache_torch_set_memory_fraction(device, fraction) == 0,
                  cucache_torch_last_error());
    });
    // CUDA graph pools: torch.cuda.graph and torch.compile's "reduce-overhead" route a capture's
    // allocations to a private pool (docs/design.md, "Graph capture").
    a->set_begin_allocate_to_pool(
        [](int device, c10::cuda::MempoolId_t pool, std::function<bool(cudaStream_t)> filter) {
          auto* ctx = new std::function<bool(cudaStream_t)>(std::move(filter));
          const int rc = cucache_torch_begin_allocate_to_pool(
              device, pool.first, pool.second,
              [](void* c, cucache_torch_stream s) {
                return (*static_cast<std::function<bool(cudaStream_t)>*>(c))(s) ? 1 : 0;
              },
              ctx, [](void* c) { delete static_cast<std::function<bool(cudaStream_t)>*>(c); });
          TORCH_CHECK(rc == 0, cucache_torch_last_error());
        });
    a->set_end_allocate_to_pool_fn([](int device, c10::cuda::MempoolId_t pool) {
      TORCH_CHECK(cucache_torch_end_allocate_to_pool(device, pool.first, pool.second) == 0,
                  cucache_torch_last_error());
    });
    a->set_release_pool([](int device, c10::cuda::MempoolId_t pool) {
      TORCH_CHECK(cucache_torch_release_pool(device, pool.first, pool.second) == 0,
                  cucache_torch_last_error());
    });
    a->init(0);
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
    return 0;
  } catch (const std::exception& e) {
    // Reported through the plug-in's last error so the Python module shows one message.
    std::string msg = std::string("cucache_torch_hooks_install: ") + e.what();
    cucache_torch_set_error(msg.c_str());
  } catch (...) {
    cucache_torch_set_error("cucache_torch_hooks_install: unknown error");
  }
  return -1;
}
