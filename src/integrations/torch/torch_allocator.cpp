// libcucache_torch_hooks.so: cucache as a complete c10::cuda::CUDACachingAllocator::CUDAAllocator,
// compiled against torch (docs/torch.md). Everything PyTorch routes through its CUDA allocator --
// tensors, record_stream, empty_cache, memory stats, CUDA graph pools and cudagraph trees'
// checkpoints, MemPool, IPC of CUDA tensors, memory history and snapshots, out-of-memory errors and
// observers -- reaches cucache. The allocator itself stays in libcucache_torch.so, reached only
// through its C interface (cucache_torch.h), so the Python module's statistics and torch's agree.
//
// History (recordHistory) lives here: this class sees every allocation and free, so it keeps the
// trace ring per device, the contexts of live blocks, and calls the trace trackers; snapshot()
// joins them with cucache's segments. Segment events arrive from cucache's observer hub
// (cucache_torch_set_segment_listener).
#include <c10/core/AllocatorConfig.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>
#include <torch/headeronly/version.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "cucache_torch.h"

extern "C" {
/* Makes cucache torch's CUDA allocator (the whole CUDAAllocator interface). Must run before torch
 * initializes CUDA. 0, or -1 with the reason in cucache_torch_last_error(). */
CUCACHE_TORCH_API int cucache_torch_hooks_install(void);
/* The torch version this library was compiled against (TORCH_VERSION of torch/version.h): the
 * Python module refuses a library built for another torch. */
CUCACHE_TORCH_API const char* cucache_torch_hooks_torch_version(void);
}

namespace cucache::detail {
namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::cuda::MempoolId_t;
using cca::BlockInfo;
using cca::SegmentInfo;
using cca::TraceEntry;

constexpr char k_handle_prefix = '\xCC';  // first byte of a cucache IPC handle string
// Version 1: a fixed cucacheIpcHandle follows (at most CUCACHE_IPC_MAX_PIECES pieces; still
// read). Version 2, what shareIpcHandle writes: a cucacheIpcLongHandle of any number of pieces,
// the string as long as it needs. Both put the block's offset at byte 24 of what follows.
constexpr char k_handle_version_fixed = 1;
constexpr char k_handle_version = 2;
constexpr std::size_t k_handle_offset_at = 24;  // magic, version, kind, device (4 each), pid (8)

std::string last_error() {
  return cucache_torch_last_error();
}

// PyTorch's way of printing a size in its messages: bytes up to 1 KiB, then KiB, MiB, GiB with
// two decimals.
std::string format_size(std::uint64_t size) {
  char text[64];
  if (size <= 1024) {
    std::snprintf(text, sizeof text, "%llu bytes", static_cast<unsigned long long>(size));
  } else if (size <= 1048576) {
    std::snprintf(text, sizeof text, "%.2f KiB", static_cast<double>(size) / 1024.0);
  } else if (size <= 1073741824ULL) {
    std::snprintf(text, sizeof text, "%.2f MiB", static_cast<double>(size) / 1048576.0);
  } else {
    std::snprintf(text, sizeof text, "%.2f GiB", static_cast<double>(size) / 1073741824.0);
  }
  return text;
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
  TORCH_CHECK(cucache_torch_get_stats(device, &s) == 0, "cucache: getDeviceStats: ", last_error());
  return s;
}

int device_count() {
  const int n = cucache_torch_device_count();
  TORCH_CHECK(n >= 0, "cucache: ", last_error());
  return n;
}

class cucache_allocator;
cucache_allocator* g_self = nullptr;  // the installed allocator (never destroyed)

void raw_delete_fn(void* ptr);

// A live allocation's history record (kept only while history is on or a tracker listens).
struct live_rec {
  std::size_t size = 0;
  cudaStream_t stream = nullptr;
  c10::DeviceIndex device = 0;
  std::shared_ptr<c10::GatheredContext> context;
};

// What getCheckpointState hands torch: cucache's checkpoint of one pool.
struct checkpoint_state final : cca::AllocatorState {
  c10::DeviceIndex device = 0;
  MempoolId_t pool{0, 0};
  std::unique_ptr<cucache_torch_checkpoint, void (*)(cucache_torch_checkpoint*)> cp{
      nullptr, &cucache_torch_checkpoint_free};
};

// A MemPool with an allocator of its own (torch.cuda.MemPool(allocator=...): NCCL's ncclMemAlloc
// for symmetric memory and user-buffer registration, or any CUDAPluggableAllocator). PyTorch's
// native allocator treats such a pool as one of its private pools whose segments come from that
// allocator's raw_alloc and go back through its raw_delete; blocks are cached, split and merged
// inside the pool as in any pool. cucache's core cannot take memory from another allocator, so the
// extension keeps these pools itself, with PyTorch's policy: sizes rounded to 512 bytes, requests
// up to 1 MiB packed into 2 MiB segments, up to 10 MiB into 20 MiB segments, larger ones rounded to
// 2 MiB; best fit on the request's stream; a block split when the rest is >= 512 bytes (small) or
// > 1 MiB (large), unless the pool is no_split.
struct foreign_block {
  std::size_t size = 0;
  std::size_t requested = 0;  // 0 when free
  bool allocated = false;
  bool pending = false;  // freed, waiting for record_stream's streams
  std::vector<cudaStream_t> uses;  // record_stream's streams other than the segment's
};
struct foreign_segment {
  void* base = nullptr;
  std::size_t size = 0;
  bool small = false;
  cudaStream_t stream = nullptr;
  std::map<std::uintptr_t, foreign_block> blocks;  // tiling [base, base + size), by address
};
struct foreign_pool {
  c10::DeviceIndex device = 0;
  MempoolId_t id{0, 0};
  std::shared_ptr<cca::CUDAAllocator> allocator;  // kept alive while the pool has memory
  int use_count = 0;  // PyTorch's: MemPool objects, use_mem_pool contexts, graphs
  bool use_on_oom = false;
  bool no_split = false;
  std::list<foreign_segment> segments;  // stable addresses
};
// What the pools with an allocator of their own hold, per device, in PyTorch's statistics' terms
// (PyTorch counts their segments and blocks in memory_stats() as any pool's): added to cucache's
// own figures by getDeviceStats, so that memory_reserved() includes them -- as PyTorch's tests
// that size a memory fraction from memory_reserved() expect. Index 0 is "all", 1 small, 2 large
// (c10's StatType). Peaks are these pools' own; getDeviceStats adds them to cucache's peaks (an
// upper bound of the one peak PyTorch keeps, exact while only one side changes).
struct foreign_stat {
  std::int64_t current = 0, peak = 0, allocated = 0, freed = 0;
  void add(std::int64_t n) {
    current += n;
    if (n > 0) allocated += n; else freed -= n;
    peak = std::max(peak, current);
  }
};
struct foreign_stats {
  std::array<foreign_stat, 3> segment, reserved_bytes, allocation, allocated_bytes, active,
      active_bytes, requested_bytes;
  static void add(std::array<foreign_stat, 3>& s, bool small, std::int64_t n) {
    s[0].add(n);
    s[small ? 1 : 2].add(n);
  }
};

// An allocation route (beginAllocateToPool), of a cucache pool or a foreign one: the newest route
// whose filter accepts the stream decides where an allocation goes.
struct route {
  c10::DeviceIndex device = 0;
  MempoolId_t id{0, 0};
  std::function<bool(cudaStream_t)> filter;
  bool foreign = false;
};

class cucache_allocator final : public cca::CUDAAllocator {
 public:
  // --- c10::Allocator ---------------------------------------------------------------------------
  c10::DataPtr allocate(std::size_t size) override {
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    void* p = alloc_on(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
    return {p, p, &raw_delete_fn, c10::Device(c10::DeviceType::CUDA, device)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &raw_delete_fn; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  // --- c10::DeviceAllocator ---------------------------------------------------------------------
  bool initialized() override { return initialized_.load(); }
  void emptyCache(MempoolId_t pool) override {
    // The context of the call frees segments with (SEGMENT_FREE entries of context="all").
    std::shared_ptr<c10::GatheredContext> ctx = recording() ? gather(cca::RecordContext::ALL)
                                                            : nullptr;
    struct free_ctx_scope {
      explicit free_ctx_scope(std::shared_ptr<c10::GatheredContext>* c) { t_free_ctx = c; }
      ~free_ctx_scope() { t_free_ctx = nullptr; }
    } scope(&ctx);
    const bool any_pool = pool.first == 0 && pool.second == 0;
    if (any_pool) {
      TORCH_CHECK(cucache_torch_empty_cache() == 0, "cucache: emptyCache: ", last_error());
    }
    if (foreign_pools_.load() > 0 && empty_foreign(pool, ctx)) return;
    if (any_pool) return;
    for (int d = 0; d < device_count(); ++d) {
      TORCH_CHECK(cucache_torch_empty_pool_cache(d, pool.first, pool.second) == 0,
                  "cucache: emptyCache(pool (", pool.first, ", ", pool.second, ")): ",
                  last_error());
    }
  }
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    const cucache_torch_stats s = stats_of(device);
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
    d.num_sync_all_streams = static_cast<int64_t>(s.vm_sync_count);
    d.num_device_alloc = static_cast<int64_t>(s.num_device_alloc);
    d.num_device_free = static_cast<int64_t>(s.num_device_free);
    if (foreign_pools_.load() > 0) add_foreign_stats(device, d);
    return d;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    TORCH_CHECK(cucache_torch_reset_accumulated_stats(device) == 0,
                "cucache: resetAccumulatedStats: ", last_error());
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    TORCH_CHECK(cucache_torch_reset_peak_stats(device) == 0, "cucache: resetPeakStats: ",
                last_error());
  }

  // --- CUDAAllocator ----------------------------------------------------------------------------
  void* raw_alloc(std::size_t nbytes) override {
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return alloc_on(nbytes, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }
  void* raw_alloc_with_stream(std::size_t nbytes, cudaStream_t stream) override {
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    return alloc_on(nbytes, device, stream);
  }
  void raw_delete(void* ptr) override {
    if (ptr == nullptr) return;
    note_free(ptr);
    if (free_elsewhere(ptr)) return;
    TORCH_CHECK(cucache_torch_delete(ptr) == 0, "cucache: raw_delete: ", last_error());
  }
  void init(int /*device_count*/) override { initialized_.store(true); }
  double getMemoryFraction(c10::DeviceIndex device) override {
    {
      std::lock_guard lock(fmu_);
      if (auto it = user_fraction_.find(device); it != user_fraction_.end()) return it->second;
    }
    double f = 0;
    TORCH_CHECK(cucache_torch_get_memory_fraction(device, &f) == 0,
                "cucache: getMemoryFraction: ", last_error());
    return f;  // 1.0 when no cap is set, as PyTorch answers
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    std::lock_guard lock(fmu_);
    apply_fraction_locked(device, fraction);
    user_fraction_[device] = fraction;
  }
  std::vector<cca::StreamSegmentSize> getExpandableSegmentSizes(c10::DeviceIndex device) override {
    std::vector<cca::StreamSegmentSize> out;
    walk_segments(device, [&](const cucache_torch_segment_info& s) {
      if (s.expandable == 0) return;
      std::size_t mapped = 0;
      for (std::size_t i = 0; i < s.mapping_count; ++i) mapped += s.mappings[i].size;
      out.emplace_back(s.stream, s.small != 0, mapped);
    });
    return out;
  }
  // torch.cuda.caching_allocator_enable(False): as PyTorch's allocator, every allocation is then
  // a plain cudaMalloc (outside the statistics) until it is enabled again; such memory goes back
  // with cudaFree whenever it is freed.
  void enable(bool value) override { enabled_.store(value); }
  bool isEnabled() const override { return enabled_.load(); }
  void cacheInfo(c10::DeviceIndex device, std::size_t* largest_block) override {
    // cuDNN sizes its workspace by this: the largest request served from cached memory alone.
    *largest_block = static_cast<std::size_t>(stats_of(device).largest_free_block);
  }
  void* getBaseAllocation(void* ptr, std::size_t* size) override {
    if (foreign_pools_.load() > 0) {
      std::lock_guard lock(fmu_);
      if (auto f = find_foreign_locked(ptr); f.seg != nullptr) {
        *size = f.seg->size;
        return f.seg->base;
      }
    }
    void* base = nullptr;
    TORCH_CHECK(cucache_torch_base_allocation(ptr, &base, size) == 0,
                "cucache: getBaseAllocation: ", last_error());
    return base;
  }
  using cca::CUDAAllocator::recordStream;
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    // A zero-size tensor has no memory; a DataPtr cucache did not make is not its to track.
    if (ptr.get() == nullptr || ptr.get_deleter() != &raw_delete_fn) return;
    if (foreign_pools_.load() > 0) {
      std::lock_guard lock(fmu_);
      if (auto f = find_foreign_locked(ptr.get()); f.block != nullptr) {
        cudaStream_t s = stream.stream();
        auto& u = f.block->uses;
        if (s != f.seg->stream && std::find(u.begin(), u.end(), s) == u.end()) u.push_back(s);
        return;
      }
    }
    {
      std::lock_guard lock(fmu_);
      if (uncached_.count(ptr.get()) != 0) return;  // cudaFree waits for the device anyway
    }
    TORCH_CHECK(cucache_torch_record_stream(ptr.get(), stream.stream()) == 0,
                "cucache: recordStream: ", last_error());
  }
  cca::SnapshotInfo snapshot(MempoolId_t pool, bool include_traces) override;
  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t pool,
                           std::function<bool(cudaStream_t)> filter) override {
    {
      std::lock_guard lock(fmu_);
      if (foreign_pool* fp = find_pool_locked(device, pool); fp != nullptr) {
        ++fp->use_count;  // PyTorch's beginAllocateToPool creates or increfs the pool
        routes_.push_back(route{device, pool, std::move(filter), true});
        foreign_routes_.fetch_add(1);
        return;
      }
      routes_.push_back(route{device, pool, filter, false});
    }
    auto* ctx = new std::function<bool(cudaStream_t)>(std::move(filter));
    const int rc = cucache_torch_begin_allocate_to_pool(
        device, pool.first, pool.second,
        [](void* c, cucache_torch_stream s) {
          return (*static_cast<std::function<bool(cudaStream_t)>*>(c))(s) ? 1 : 0;
        },
        ctx, [](void* c) { delete static_cast<std::function<bool(cudaStream_t)>*>(c); });
    if (rc != 0) {
      std::lock_guard lock(fmu_);
      drop_route_locked(device, pool);
    }
    TORCH_CHECK(rc == 0, "cucache: beginAllocateToPool: ", last_error());
  }
  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t pool) override {
    {
      std::lock_guard lock(fmu_);
      const bool foreign = drop_route_locked(device, pool);
      if (foreign) return;
    }
    TORCH_CHECK(cucache_torch_end_allocate_to_pool(device, pool.first, pool.second) == 0,
                "cucache: endAllocateToPool: ", last_error());
  }
  void releasePool(c10::DeviceIndex device, MempoolId_t pool) override {
    {
      std::lock_guard lock(fmu_);
      if (foreign_pool* fp = find_pool_locked(device, pool); fp != nullptr) {
        TORCH_CHECK(fp->use_count > 0, "cucache: releasePool(pool (", pool.first, ", ",
                    pool.second, ")): the pool has no owner left");
        // At 0 the pool is freeable: emptyCache gives its free segments back to its allocator
        // and forgets it once it holds none; it is no longer used when out of memory.
        if (--fp->use_count == 0) fp->use_on_oom = false;
        return;
      }
    }
    TORCH_CHECK(cucache_torch_release_pool(device, pool.first, pool.second) == 0,
                "cucache: releasePool: ", last_error());
  }
  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t pool) override {
    {
      std::lock_guard lock(fmu_);
      if (foreign_pool* fp = find_pool_locked(device, pool); fp != nullptr) return fp->use_count;
    }
    std::uint64_t uses = 0;
    TORCH_CHECK(cucache_torch_pool_use_count(device, pool.first, pool.second, &uses) == 0,
                "cucache: getPoolUseCount: ", last_error());
    return static_cast<int>(uses);
  }
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t pool,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    {
      std::lock_guard lock(fmu_);
      foreign_pool* fp = find_pool_locked(device, pool);
      if (allocator != nullptr && allocator.get() != this) {
        if (fp == nullptr) {
          auto p = std::make_unique<foreign_pool>();
          p->device = device;
          p->id = pool;
          p->allocator = std::move(allocator);
          fp = p.get();
          foreign_[{device, pool}] = std::move(p);
          foreign_pools_.fetch_add(1);
        } else {
          TORCH_CHECK(fp->allocator == allocator, "cucache: createOrIncrefPool: pool (",
                      pool.first, ", ", pool.second, ") has another allocator already");
        }
        ++fp->use_count;
        return;
      }
      if (fp != nullptr) {
        ++fp->use_count;
        return;
      }
    }
    TORCH_CHECK(cucache_torch_create_or_incref_pool(device, pool.first, pool.second) == 0,
                "cucache: createOrIncrefPool: ", last_error());
  }
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t pool, bool use_on_oom) override {
    {
      std::lock_guard lock(fmu_);
      if (foreign_pool* fp = find_pool_locked(device, pool); fp != nullptr) {
        fp->use_on_oom = use_on_oom;
        return;
      }
    }
    // cucache's out-of-memory ladder never borrows a private pool's memory: use_on_oom=False is
    // what it does anyway.
    TORCH_CHECK(!use_on_oom, "cucache: setUseOnOOM(device ", static_cast<int>(device), ", pool (",
                pool.first, ", ", pool.second,
                "), True): cucache never serves other allocations from the memory of a pool it "
                "allocates itself when out of memory (MemPool(use_on_oom=True) is supported for "
                "a MemPool with an allocator of its own)");
  }
  void setNoSplit(c10::DeviceIndex device, MempoolId_t pool) override {
    {
      std::lock_guard lock(fmu_);
      if (foreign_pool* fp = find_pool_locked(device, pool); fp != nullptr) {
        fp->no_split = true;
        return;
      }
    }
    TORCH_CHECK(cucache_torch_set_pool_no_split(device, pool.first, pool.second) == 0,
                "cucache: setNoSplit(device ", static_cast<int>(device), ", pool (", pool.first,
                ", ", pool.second, ")): ", last_error());
  }
  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t pool,
                                const std::unordered_set<void*>& expected) override {
    std::vector<void*> live;
    {
      std::lock_guard lock(fmu_);
      if (foreign_pool* fp = find_pool_locked(device, pool); fp != nullptr) {
        for (const foreign_segment& seg : fp->segments) {
          for (const auto& [addr, b] : seg.blocks) {
            if (b.allocated) live.push_back(reinterpret_cast<void*>(addr));
          }
        }
        if (live.size() != expected.size()) return false;
        return std::all_of(live.begin(), live.end(),
                           [&](void* p) { return expected.count(p) != 0; });
      }
    }
    TORCH_CHECK(cucache_torch_pool_live_allocations(
                    device, pool.first, pool.second,
                    [](void* c, void* p) { static_cast<std::vector<void*>*>(c)->push_back(p); },
                    &live) == 0,
                "cucache: checkPoolLiveAllocations: ", last_error());
    if (live.size() != expected.size()) return false;
    return std::all_of(live.begin(), live.end(), [&](void* p) { return expected.count(p) != 0; });
  }
  cca::ShareableHandle shareIpcHandle(void* ptr) override;
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override;
  bool isHistoryEnabled() override { return history_.load(); }
  void recordHistory(bool enabled, cca::CreateContextFn recorder, std::size_t max_entries,
                     cca::RecordContext when, bool clear_history,
                     const std::vector<std::string>& skip_actions) override;
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    if (!history_.load()) return;
    c10::DeviceIndex device = 0;
    C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
    std::lock_guard lock(mu_);
    annotations_.emplace_back(device, c10::getApproximateTime());
    for (const auto& [name, value] : md) annotations_.back().recordUserMetadata(name, value);
  }
  void pushCompileContext(std::string& md) override {
    std::lock_guard lock(mu_);
    compile_context_.push_back(md);
  }
  void popCompileContext() override {
    std::lock_guard lock(mu_);
    if (!compile_context_.empty()) compile_context_.pop_back();
  }
  void setUserMetadata(const std::string& metadata) override {
    std::lock_guard lock(mu_);
    user_metadata_ = metadata;
  }
  std::string getUserMetadata() override {
    std::lock_guard lock(mu_);
    return user_metadata_;
  }
  void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
    std::lock_guard lock(mu_);
    oom_observers_.push_back(std::move(observer));
  }
  void attachAllocatorTraceTracker(cca::AllocatorTraceTracker tracker) override {
    std::lock_guard lock(mu_);
    trackers_.push_back(std::move(tracker));
    tracking_.store(true);
  }
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    const cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      static_cast<void>(cudaGetLastError());  // clears it
      return;
    }
    C10_CUDA_CHECK(err);
  }
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device,
                          std::size_t count, cudaStream_t stream, bool p2p_enabled) override {
    // cucache's expandable segments are CUDA virtual memory, which plain cudaMemcpyAsync cannot
    // copy across devices without peer access: the peer copy always works.
    if (p2p_enabled || dst_device == src_device) {
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    }
    return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
  }
  std::shared_ptr<cca::AllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          MempoolId_t id) override {
    {
      std::lock_guard lock(fmu_);
      TORCH_CHECK(find_pool_locked(device, id) == nullptr,
                  "cucache: getCheckpointState: pool (", id.first, ", ", id.second,
                  ") has an allocator of its own; cudagraph trees' checkpoints are of the pools "
                  "cucache allocates");
    }
    auto state = std::make_shared<checkpoint_state>();
    state->device = device;
    state->pool = id;
    state->cp.reset(cucache_torch_checkpoint_pool(device, id.first, id.second));
    TORCH_CHECK(state->cp != nullptr, "cucache: getCheckpointState: ", last_error());
    return state;
  }
  cca::CheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<cca::AllocatorState> pps) override;
  std::string name() override { return "cucache"; }

  // --- cucache's side ---------------------------------------------------------------------------
  void* alloc_on(std::size_t size, c10::DeviceIndex device, cudaStream_t stream);
  void note_free(void* ptr) noexcept;
  void report_to_profiler(void* p, std::size_t size, c10::DeviceIndex device);
  void report_free_to_profiler(void* p) noexcept;
  // Frees ptr when it is not cucache's: a cudaMalloc of the uncached mode, or a block of a pool
  // with an allocator of its own. False when cucache holds it.
  bool free_elsewhere(void* ptr);
  // torch's allocator settings changed at run time (the device config parser hook).
  void on_settings(const std::string& env);
  // Set while emptyCache runs: the context SEGMENT_FREE entries get.
  static thread_local std::shared_ptr<c10::GatheredContext>* t_free_ctx;
  // Set while an allocation runs: the context its new segment gets.
  static thread_local std::shared_ptr<c10::GatheredContext>* t_alloc_ctx;
  // event: CUCACHE_TORCH_SEGMENT_*.
  void on_segment(int device, int event, std::uint64_t base, std::uint64_t bytes,
                  cudaStream_t stream) noexcept;

 private:
  template <class Fn>
  void walk_segments(c10::DeviceIndex device, Fn&& fn) {
    const int rc = cucache_torch_segments(
        device,
        [](void* c, const cucache_torch_segment_info* s) {
          (*static_cast<Fn*>(c))(*s);
          return 0;
        },
        &fn);
    TORCH_CHECK(rc == 0, "cucache: segments of device ", static_cast<int>(device), ": ",
                last_error());
  }
  [[noreturn]] void raise_oom(std::size_t size, c10::DeviceIndex device, cudaStream_t stream,
                              const std::string& why);
  bool recording() const noexcept { return history_.load() || tracking_.load(); }
  void live_insert_locked(void* p, live_rec r) {
    live_[p] = std::move(r);
    live_size_.store(live_.size());
  }

  // --- pools with an allocator of their own (REQUIRES fmu_ where named _locked) ---
  struct foreign_ref {
    foreign_pool* pool = nullptr;
    foreign_segment* seg = nullptr;
    foreign_block* block = nullptr;  // the allocated block starting at the pointer
    std::uintptr_t addr = 0;
  };
  foreign_pool* find_pool_locked(c10::DeviceIndex device, MempoolId_t id) {
    auto it = foreign_.find({device, id});
    return it == foreign_.end() ? nullptr : it->second.get();
  }
  foreign_ref find_foreign_locked(const void* ptr) {
    auto it = fptr_.find(const_cast<void*>(ptr));
    if (it == fptr_.end()) return {};
    foreign_ref r;
    r.pool = it->second;
    r.addr = reinterpret_cast<std::uintptr_t>(ptr);
    for (foreign_segment& seg : r.pool->segments) {
      const auto base = reinterpret_cast<std::uintptr_t>(seg.base);
      if (r.addr < base || r.addr >= base + seg.size) continue;
      auto b = seg.blocks.find(r.addr);
      if (b == seg.blocks.end()) return {};
      r.seg = &seg;
      r.block = &b->second;
      return r;
    }
    return {};
  }
  // Removes the newest route of the pool; true when it was a foreign pool's.
  bool drop_route_locked(c10::DeviceIndex device, MempoolId_t id) {
    for (auto it = routes_.rbegin(); it != routes_.rend(); ++it) {
      if (it->device == device && it->id == id) {
        const bool foreign = it->foreign;
        routes_.erase(std::next(it).base());
        if (foreign) foreign_routes_.fetch_sub(1);
        return foreign;
      }
    }
    return false;
  }
  foreign_pool* routed_foreign_pool(c10::DeviceIndex device, cudaStream_t stream) {
    std::lock_guard lock(fmu_);
    for (auto it = routes_.rbegin(); it != routes_.rend(); ++it) {
      if (it->device != device || !it->filter || !it->filter(stream)) continue;
      return it->foreign ? find_pool_locked(device, it->id) : nullptr;
    }
    return nullptr;
  }
  void* foreign_alloc(foreign_pool* fp, std::size_t size, cudaStream_t stream,
                      const std::shared_ptr<c10::GatheredContext>& ctx, std::string* why);
  void* foreign_alloc_locked(foreign_pool* fp, std::size_t size, cudaStream_t stream,
                             bool cached_only, const std::shared_ptr<c10::GatheredContext>& ctx,
                             std::string* why);
  void* use_on_oom_alloc(c10::DeviceIndex device, std::size_t size, cudaStream_t stream,
                         const std::shared_ptr<c10::GatheredContext>& ctx);
  void foreign_free_block_locked(foreign_pool* fp, foreign_segment* seg, std::uintptr_t addr);
  void process_pending_locked(bool wait);
  bool empty_foreign(MempoolId_t pool, const std::shared_ptr<c10::GatheredContext>& ctx);
  std::size_t device_total(c10::DeviceIndex device);
  void apply_fraction_locked(c10::DeviceIndex device, double fraction);
  std::size_t foreign_reserved_locked(c10::DeviceIndex device);
  void reapply_fraction_locked(c10::DeviceIndex device);
  void add_foreign_stats(c10::DeviceIndex device, DeviceStats& d);
  void snapshot_foreign(MempoolId_t pool, const std::unordered_map<void*, live_rec>& live,
                        std::vector<SegmentInfo>& out);
  bool skipped(TraceEntry::Action a) const {
    return std::find(skip_.begin(), skip_.end(), a) != skip_.end();
  }
  // Appends to the device's ring and tells the trackers. REQUIRES: mu_ held.
  void record_locked(TraceEntry::Action action, c10::DeviceIndex device, std::size_t addr,
                     std::size_t size, cudaStream_t stream,
                     std::shared_ptr<c10::GatheredContext> context);
  std::shared_ptr<c10::GatheredContext> gather(cca::RecordContext at_least) const {
    cca::CreateContextFn r = recorder_.load();
    return r != nullptr && when_.load() >= at_least ? r() : nullptr;
  }

  std::atomic<bool> initialized_{false};
  std::atomic<bool> history_{false};
  std::atomic<bool> tracking_{false};
  std::atomic<cca::CreateContextFn> recorder_{nullptr};
  std::atomic<cca::RecordContext> when_{cca::RecordContext::NEVER};
  std::size_t max_entries_ = 1;
  std::vector<TraceEntry::Action> skip_;

  std::atomic<bool> enabled_{true};
  std::atomic<std::size_t> live_size_{0};   // live_.size(), read without mu_
  std::atomic<std::size_t> profiled_size_{0};  // profiled_.size(), read without mu_
  std::atomic<int> foreign_pools_{0};       // foreign_.size(), read without fmu_
  std::atomic<int> foreign_routes_{0};      // routes_ of foreign pools
  std::atomic<std::size_t> uncached_count_{0};

  std::mutex fmu_;  // the pools with an allocator of their own, routes, uncached memory, fractions
  std::map<std::pair<c10::DeviceIndex, MempoolId_t>, std::unique_ptr<foreign_pool>> foreign_;
  std::unordered_map<void*, foreign_pool*> fptr_;  // allocated blocks of foreign pools
  struct pending_free {
    foreign_pool* pool;
    foreign_segment* seg;
    std::uintptr_t addr;
    std::vector<cudaEvent_t> events;
  };
  std::vector<pending_free> pending_;
  std::vector<route> routes_;
  std::unordered_set<void*> uncached_;
  std::map<c10::DeviceIndex, double> user_fraction_;     // setMemoryFraction's, per device
  std::map<c10::DeviceIndex, foreign_stats> foreign_stats_;
  std::map<c10::DeviceIndex, std::size_t> totals_;

  std::mutex mu_;  // everything below
  std::unordered_map<void*, live_rec> live_;
  // Allocations reported to the memory profiler: their size and device for the free's report.
  std::unordered_map<void*, std::pair<std::size_t, c10::DeviceIndex>> profiled_;
  std::unordered_map<std::uint64_t, std::shared_ptr<c10::GatheredContext>> segment_ctx_;
  c10::ApproximateClockToUnixTimeConverter clock_converter_;
  std::vector<std::vector<TraceEntry>> traces_;  // per device: a ring of max_entries_
  std::vector<std::size_t> trace_next_;          // per device: the slot the next entry overwrites
  std::vector<c10::CachingDeviceAllocator::AnnotationEntry> annotations_;
  std::vector<std::string> compile_context_;
  std::string user_metadata_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  std::vector<cca::AllocatorTraceTracker> trackers_;
};

thread_local std::shared_ptr<c10::GatheredContext>* cucache_allocator::t_free_ctx = nullptr;
thread_local std::shared_ptr<c10::GatheredContext>* cucache_allocator::t_alloc_ctx = nullptr;

void raw_delete_fn(void* ptr) {
  if (ptr == nullptr) return;
  g_self->note_free(ptr);
  // A deleter runs in destructors and cannot throw: a refused free is reported here.
  try {
    if (g_self->free_elsewhere(ptr)) return;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cucache: freeing a tensor's memory failed: %s\n", e.what());
    return;
  }
  if (cucache_torch_delete(ptr) != 0) {
    std::fprintf(stderr, "cucache: freeing a tensor's memory failed: %s\n",
                 cucache_torch_last_error());
  }
}

void* cucache_allocator::alloc_on(std::size_t size, c10::DeviceIndex device,
                                  cudaStream_t stream) {
  constexpr std::size_t one_exa_bytes = 1152921504606846976ULL;
  TORCH_CHECK_WITH(OutOfMemoryError, size < one_exa_bytes,
                   "CUDA out of memory. Tried to allocate more than 1EB memory.");
  if (!enabled_.load()) {
    // The uncached mode (caching_allocator_enable(False)): PyTorch's plain cudaMalloc.
    if (size == 0) return nullptr;
    void* p = nullptr;
    c10::cuda::CUDAGuard guard(device);
    const cudaError_t err = cudaMalloc(&p, size);
    if (err == cudaErrorMemoryAllocation) {
      static_cast<void>(cudaGetLastError());
      raise_oom(size, device, stream, "cudaMalloc of the uncached mode failed");
    }
    C10_CUDA_CHECK(err);
    std::lock_guard lock(fmu_);
    uncached_.insert(p);
    uncached_count_.store(uncached_.size());
    return p;
  }
  // The context is gathered before allocating: a segment the allocation creates gets it too.
  std::shared_ptr<c10::GatheredContext> ctx =
      recording() ? gather(cca::RecordContext::STATE) : nullptr;
  void* p = nullptr;
  foreign_pool* fp = foreign_routes_.load() > 0 ? routed_foreign_pool(device, stream) : nullptr;
  if (fp != nullptr) {
    std::string why;
    p = foreign_alloc(fp, size, stream, ctx, &why);
    if (p == nullptr && size != 0) raise_oom(size, device, stream, why);
  } else {
    struct alloc_ctx_scope {
      explicit alloc_ctx_scope(std::shared_ptr<c10::GatheredContext>* c) { t_alloc_ctx = c; }
      ~alloc_ctx_scope() { t_alloc_ctx = nullptr; }
    } scope(&ctx);
    const int rc = cucache_torch_try_alloc(size, device, stream, &p);
    if (rc == CUCACHE_TORCH_ALLOC_OUT_OF_MEMORY) {
      const std::string why = last_error();
      // PyTorch's use_on_oom: the cached free blocks of such pools serve what no memory can.
      p = foreign_pools_.load() > 0 ? use_on_oom_alloc(device, size, stream, ctx) : nullptr;
      if (p == nullptr) raise_oom(size, device, stream, why);
      if (c10::memoryProfilingEnabled()) report_to_profiler(p, size, device);
      return p;  // recorded by use_on_oom_alloc
    }
    TORCH_CHECK(rc == CUCACHE_TORCH_ALLOC_OK, "cucache: allocating ", size, " bytes on device ",
                static_cast<int>(device), " failed: ", last_error());
  }
  if (p != nullptr && recording()) {
    std::lock_guard lock(mu_);
    live_insert_locked(p, live_rec{size, stream, device, ctx});
    record_locked(TraceEntry::ALLOC, device, reinterpret_cast<std::size_t>(p), size, stream, ctx);
  }
  if (p != nullptr && c10::memoryProfilingEnabled()) report_to_profiler(p, size, device);
  return p;
}

// torch.profiler(profile_memory=True): PyTorch's allocator reports every allocation and free
// (size, then the totals allocated and reserved); the profiler's memory timeline and
// _memory_profiler read them.
void cucache_allocator::report_to_profiler(void* p, std::size_t size, c10::DeviceIndex device) {
  {
    std::lock_guard lock(mu_);
    profiled_[p] = {size, device};
    profiled_size_.store(profiled_.size());
  }
  cucache_torch_stats s{};
  static_cast<void>(cucache_torch_get_stats(device, &s));
  c10::reportMemoryUsageToProfiler(p, static_cast<int64_t>(size),
                                   static_cast<std::size_t>(s.allocated_bytes[0].current),
                                   static_cast<std::size_t>(s.reserved_bytes[0].current),
                                   c10::Device(c10::DeviceType::CUDA, device));
}

void cucache_allocator::report_free_to_profiler(void* p) noexcept {
  if (profiled_size_.load() == 0) return;
  try {
    std::pair<std::size_t, c10::DeviceIndex> rec;
    {
      std::lock_guard lock(mu_);
      auto it = profiled_.find(p);
      if (it == profiled_.end()) return;
      rec = it->second;
      profiled_.erase(it);
      profiled_size_.store(profiled_.size());
    }
    if (!c10::memoryProfilingEnabled()) return;
    cucache_torch_stats s{};
    static_cast<void>(cucache_torch_get_stats(rec.second, &s));
    c10::reportMemoryUsageToProfiler(p, -static_cast<int64_t>(rec.first),
                                     static_cast<std::size_t>(s.allocated_bytes[0].current),
                                     static_cast<std::size_t>(s.reserved_bytes[0].current),
                                     c10::Device(c10::DeviceType::CUDA, rec.second));
  } catch (...) {
  }
}

void cucache_allocator::note_free(void* ptr) noexcept {
  report_free_to_profiler(ptr);
  // Blocks keep their allocation's context while they live, history on or off (as PyTorch's
  // blocks do): live_ is kept up to date whenever it holds anything.
  if (!recording() && live_size_.load() == 0) return;
  try {
    std::shared_ptr<c10::GatheredContext> ctx = gather(cca::RecordContext::ALL);
    std::lock_guard lock(mu_);
    auto it = live_.find(ptr);
    if (it == live_.end()) return;  // allocated before history was turned on
    const live_rec r = it->second;
    live_.erase(it);
    live_size_.store(live_.size());
    if (!recording()) return;
    if (ctx == nullptr) ctx = r.context;  // PyTorch: the free's context, else the allocation's
    // cucache frees at once for the block's own stream (uses on other streams defer its reuse,
    // not the free): requested and completed together.
    record_locked(TraceEntry::FREE_REQUESTED, r.device, reinterpret_cast<std::size_t>(ptr), r.size,
                  r.stream, ctx);
    record_locked(TraceEntry::FREE_COMPLETED, r.device, reinterpret_cast<std::size_t>(ptr), r.size,
                  r.stream, ctx);
  } catch (...) {
    // History is best effort: a failure to record never fails the free.
  }
}

bool cucache_allocator::free_elsewhere(void* ptr) {
  if (uncached_count_.load() > 0) {
    bool mine = false;
    {
      std::lock_guard lock(fmu_);
      mine = uncached_.erase(ptr) != 0;
      uncached_count_.store(uncached_.size());
    }
    if (mine) {
      C10_CUDA_CHECK(cudaFree(ptr));
      return true;
    }
  }
  if (foreign_pools_.load() == 0) return false;
  std::lock_guard lock(fmu_);
  foreign_ref f = find_foreign_locked(ptr);
  if (f.block == nullptr) return false;
  fptr_.erase(ptr);
  if (f.block->uses.empty()) {
    foreign_free_block_locked(f.pool, f.seg, f.addr);
    return true;
  }
  // record_stream: reusable once the work queued on those streams so far is done.
  pending_free pf{f.pool, f.seg, f.addr, {}};
  c10::cuda::CUDAGuard guard(f.pool->device);
  for (cudaStream_t s : f.block->uses) {
    cudaEvent_t ev = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(ev, s));
    pf.events.push_back(ev);
  }
  f.block->uses.clear();
  foreign_stats& fs = foreign_stats_[f.pool->device];
  foreign_stats::add(fs.allocation, f.seg->small, -1);
  foreign_stats::add(fs.allocated_bytes, f.seg->small, -static_cast<std::int64_t>(f.block->size));
  foreign_stats::add(fs.requested_bytes, f.seg->small,
                     -static_cast<std::int64_t>(f.block->requested));
  f.block->allocated = false;
  f.block->pending = true;
  f.block->requested = 0;
  pending_.push_back(std::move(pf));
  return true;
}

void cucache_allocator::foreign_free_block_locked(foreign_pool* fp, foreign_segment* seg,
                                                  std::uintptr_t addr) {
  auto it = seg->blocks.find(addr);
  if (it == seg->blocks.end()) return;
  foreign_stats& fs = foreign_stats_[fp->device];
  const auto bytes = static_cast<std::int64_t>(it->second.size);
  if (it->second.allocated) {
    foreign_stats::add(fs.allocation, seg->small, -1);
    foreign_stats::add(fs.allocated_bytes, seg->small, -bytes);
    foreign_stats::add(fs.requested_bytes, seg->small,
                       -static_cast<std::int64_t>(it->second.requested));
  }
  if (it->second.allocated || it->second.pending) {
    foreign_stats::add(fs.active, seg->small, -1);
    foreign_stats::add(fs.active_bytes, seg->small, -bytes);
  }
  it->second.allocated = false;
  it->second.pending = false;
  it->second.requested = 0;
  it->second.uses.clear();
  // Merges with free neighbours (PyTorch's try_merge_blocks).
  if (auto next = std::next(it);
      next != seg->blocks.end() && !next->second.allocated && !next->second.pending) {
    it->second.size += next->second.size;
    seg->blocks.erase(next);
  }
  if (it != seg->blocks.begin()) {
    auto prev = std::prev(it);
    if (!prev->second.allocated && !prev->second.pending) {
      prev->second.size += it->second.size;
      seg->blocks.erase(it);
    }
  }
}

void cucache_allocator::process_pending_locked(bool wait) {
  for (std::size_t i = 0; i < pending_.size();) {
    pending_free& pf = pending_[i];
    bool done = true;
    for (cudaEvent_t ev : pf.events) {
      const cudaError_t e = wait ? cudaEventSynchronize(ev) : cudaEventQuery(ev);
      if (e == cudaErrorNotReady) {
        static_cast<void>(cudaGetLastError());
        done = false;
        break;
      }
      C10_CUDA_CHECK(e);
    }
    if (!done) {
      ++i;
      continue;
    }
    for (cudaEvent_t ev : pf.events) static_cast<void>(cudaEventDestroy(ev));
    pending_free copy = std::move(pf);
    pending_.erase(pending_.begin() + static_cast<std::ptrdiff_t>(i));
    foreign_free_block_locked(copy.pool, copy.seg, copy.addr);
  }
}

std::size_t cucache_allocator::device_total(c10::DeviceIndex device) {
  if (auto it = totals_.find(device); it != totals_.end()) return it->second;
  std::size_t free_b = 0;
  std::size_t total = 0;
  c10::cuda::CUDAGuard guard(device);
  C10_CUDA_CHECK(cudaMemGetInfo(&free_b, &total));
  totals_[device] = total;
  return total;
}

// The fraction covers cucache's memory and the foreign pools' together (PyTorch counts both
// against it): cucache's core is capped at the fraction less what the foreign pools hold.
void cucache_allocator::apply_fraction_locked(c10::DeviceIndex device, double fraction) {
  double core = fraction;
  if (const std::size_t foreign = foreign_reserved_locked(device); foreign > 0) {
    const double total = static_cast<double>(device_total(device));
    core = std::max(fraction - static_cast<double>(foreign) / total, 1e-12);
  }
  TORCH_CHECK(cucache_torch_set_memory_fraction(device, core) == 0, "cucache: setMemoryFraction(",
              fraction, ", device ", static_cast<int>(device), "): ", last_error());
}

// What the foreign pools of `device` hold: their statistics' reserved bytes.
std::size_t cucache_allocator::foreign_reserved_locked(c10::DeviceIndex device) {
  const auto it = foreign_stats_.find(device);
  return it == foreign_stats_.end()
             ? 0
             : static_cast<std::size_t>(std::max<std::int64_t>(0, it->second.reserved_bytes[0].current));
}

// After the foreign pools' reserved bytes changed: cucache's core cap follows (apply_fraction_locked).
void cucache_allocator::reapply_fraction_locked(c10::DeviceIndex device) {
  if (auto it = user_fraction_.find(device); it != user_fraction_.end() && it->second > 0) {
    apply_fraction_locked(device, it->second);
  }
}

void cucache_allocator::add_foreign_stats(c10::DeviceIndex device, DeviceStats& d) {
  std::lock_guard lock(fmu_);
  auto it = foreign_stats_.find(device);
  if (it == foreign_stats_.end()) return;
  const foreign_stats& f = it->second;
  auto merge = [](const std::array<foreign_stat, 3>& from, c10::CachingAllocator::StatArray& to) {
    for (std::size_t i = 0; i < from.size(); ++i) {
      to[i].current += from[i].current;
      to[i].peak += from[i].peak;
      to[i].allocated += from[i].allocated;
      to[i].freed += from[i].freed;
    }
  };
  merge(f.segment, d.segment);
  merge(f.reserved_bytes, d.reserved_bytes);
  merge(f.allocation, d.allocation);
  merge(f.allocated_bytes, d.allocated_bytes);
  merge(f.active, d.active);
  merge(f.active_bytes, d.active_bytes);
  merge(f.requested_bytes, d.requested_bytes);
}

void* cucache_allocator::foreign_alloc(foreign_pool* fp, std::size_t size, cudaStream_t stream,
                                       const std::shared_ptr<c10::GatheredContext>& ctx,
                                       std::string* why) {
  if (size == 0) return nullptr;
  std::lock_guard lock(fmu_);
  return foreign_alloc_locked(fp, size, stream, false, ctx, why);
}

void* cucache_allocator::foreign_alloc_locked(foreign_pool* fp, std::size_t size,
                                              cudaStream_t stream, bool cached_only,
                                              const std::shared_ptr<c10::GatheredContext>& ctx,
                                              std::string* why) {
  constexpr std::size_t k_min_block = 512;
  constexpr std::size_t k_small_size = 1048576;
  constexpr std::size_t k_small_buffer = 2097152;
  constexpr std::size_t k_large_buffer = 20971520;
  constexpr std::size_t k_min_large_alloc = 10485760;
  constexpr std::size_t k_round_large = 2097152;
  process_pending_locked(false);
  const std::size_t rounded = size < k_min_block ? k_min_block
                                                 : (size + k_min_block - 1) / k_min_block * k_min_block;
  const bool small = rounded <= k_small_size;
  // Best fit on the request's stream.
  foreign_segment* best_seg = nullptr;
  std::uintptr_t best_addr = 0;
  std::size_t best_size = SIZE_MAX;
  for (foreign_segment& seg : fp->segments) {
    if (seg.small != small || seg.stream != stream) continue;
    for (const auto& [addr, b] : seg.blocks) {
      if (b.allocated || b.pending || b.size < rounded || b.size >= best_size) continue;
      best_seg = &seg;
      best_addr = addr;
      best_size = b.size;
    }
  }
  if (best_seg == nullptr) {
    if (cached_only) return nullptr;
    const std::size_t seg_size =
        small ? k_small_buffer
              : (rounded < k_min_large_alloc ? k_large_buffer
                                             : (rounded + k_round_large - 1) / k_round_large *
                                                   k_round_large);
    if (auto it = user_fraction_.find(fp->device); it != user_fraction_.end() && it->second > 0) {
      const auto limit = static_cast<std::size_t>(it->second *
                                                  static_cast<double>(device_total(fp->device)));
      const auto core = static_cast<std::size_t>(stats_of(fp->device).reserved_bytes[0].current);
      const std::size_t foreign = foreign_reserved_locked(fp->device);
      if (core + foreign + seg_size > limit) {
        *why = "the memory fraction " + std::to_string(it->second) + " allows " +
               format_size(limit) + "; cucache holds " + format_size(core) +
               " and pools with an allocator of their own " + format_size(foreign);
        return nullptr;
      }
    }
    void* base = nullptr;
    try {
      c10::cuda::CUDAGuard guard(fp->device);
      base = fp->allocator->raw_alloc(seg_size);
    } catch (const std::exception& e) {
      *why = std::string("the pool's allocator (") + fp->allocator->name() + ") failed: " + e.what();
      return nullptr;
    }
    if (base == nullptr) {
      *why = std::string("the pool's allocator (") + fp->allocator->name() + ") returned NULL for " +
             format_size(seg_size);
      return nullptr;
    }
    foreign_segment& seg = fp->segments.emplace_back();
    seg.base = base;
    seg.size = seg_size;
    seg.small = small;
    seg.stream = stream;
    best_addr = reinterpret_cast<std::uintptr_t>(base);
    seg.blocks[best_addr] = foreign_block{seg_size, 0, false, false, {}};
    best_seg = &seg;
    foreign_stats& fs = foreign_stats_[fp->device];
    foreign_stats::add(fs.segment, small, 1);
    foreign_stats::add(fs.reserved_bytes, small, static_cast<std::int64_t>(seg_size));
    reapply_fraction_locked(fp->device);
    if (recording()) {
      std::lock_guard lock(mu_);
      segment_ctx_[best_addr] = ctx;
      record_locked(TraceEntry::SEGMENT_ALLOC, fp->device, best_addr, seg_size, stream, ctx);
    }
  }
  foreign_block& b = best_seg->blocks[best_addr];
  const std::size_t rest = b.size - rounded;
  if (!fp->no_split && (small ? rest >= k_min_block : rest > k_small_size)) {
    best_seg->blocks[best_addr + rounded] = foreign_block{rest, 0, false, false, {}};
    best_seg->blocks[best_addr].size = rounded;
  }
  foreign_block& got = best_seg->blocks[best_addr];
  got.allocated = true;
  got.requested = size;
  foreign_stats& fs = foreign_stats_[fp->device];
  const auto bytes = static_cast<std::int64_t>(got.size);
  foreign_stats::add(fs.allocation, best_seg->small, 1);
  foreign_stats::add(fs.allocated_bytes, best_seg->small, bytes);
  foreign_stats::add(fs.active, best_seg->small, 1);
  foreign_stats::add(fs.active_bytes, best_seg->small, bytes);
  foreign_stats::add(fs.requested_bytes, best_seg->small, static_cast<std::int64_t>(size));
  void* p = reinterpret_cast<void*>(best_addr);
  fptr_[p] = fp;
  return p;
}

void* cucache_allocator::use_on_oom_alloc(c10::DeviceIndex device, std::size_t size,
                                          cudaStream_t stream,
                                          const std::shared_ptr<c10::GatheredContext>& ctx) {
  void* p = nullptr;
  {
    std::lock_guard lock(fmu_);
    std::string why;
    for (auto& [key, fp] : foreign_) {
      if (key.first != device || !fp->use_on_oom || fp->use_count == 0) continue;
      p = foreign_alloc_locked(fp.get(), size, stream, true, ctx, &why);
      if (p != nullptr) break;
    }
  }
  if (p != nullptr && recording()) {
    std::lock_guard lock(mu_);
    live_insert_locked(p, live_rec{size, stream, device, ctx});
    record_locked(TraceEntry::ALLOC, device, reinterpret_cast<std::size_t>(p), size, stream, ctx);
  }
  return p;
}

// PyTorch's release_cached_blocks for pools with an allocator of their own: only a freeable pool
// (use count 0) gives its free segments back (through its allocator's raw_delete), and is
// forgotten once it holds none. True when `pool` was such a pool (nothing more to do).
bool cucache_allocator::empty_foreign(MempoolId_t pool,
                                      const std::shared_ptr<c10::GatheredContext>& ctx) {
  const bool any_pool = pool.first == 0 && pool.second == 0;
  bool was_foreign = false;
  std::lock_guard lock(fmu_);
  for (auto it = foreign_.begin(); it != foreign_.end();) {
    foreign_pool& fp = *it->second;
    if (!any_pool && fp.id != pool) {
      ++it;
      continue;
    }
    was_foreign = true;
    if (fp.use_count > 0) {
      ++it;
      continue;
    }
    process_pending_locked(true);
    for (auto seg = fp.segments.begin(); seg != fp.segments.end();) {
      const foreign_block& only = seg->blocks.begin()->second;
      const bool whole_free = seg->blocks.size() == 1 && !only.allocated && !only.pending;
      if (!whole_free) {
        ++seg;
        continue;
      }
      const auto base = reinterpret_cast<std::uintptr_t>(seg->base);
      {
        c10::cuda::CUDAGuard guard(fp.device);
        fp.allocator->raw_delete(seg->base);
      }
      foreign_stats& fs = foreign_stats_[fp.device];
      foreign_stats::add(fs.segment, seg->small, -1);
      foreign_stats::add(fs.reserved_bytes, seg->small, -static_cast<std::int64_t>(seg->size));
      reapply_fraction_locked(fp.device);
      if (recording()) {
        std::lock_guard hl(mu_);
        std::shared_ptr<c10::GatheredContext> c = ctx;
        if (auto sc = segment_ctx_.find(base); sc != segment_ctx_.end()) {
          if (c == nullptr) c = sc->second;
          segment_ctx_.erase(sc);
        }
        record_locked(TraceEntry::SEGMENT_FREE, fp.device, base, seg->size, seg->stream, c);
      }
      seg = fp.segments.erase(seg);
    }
    if (fp.segments.empty()) {
      it = foreign_.erase(it);
      foreign_pools_.fetch_sub(1);
    } else {
      ++it;
    }
  }
  return was_foreign && !any_pool;
}

void cucache_allocator::snapshot_foreign(MempoolId_t pool,
                                         const std::unordered_map<void*, live_rec>& live,
                                         std::vector<SegmentInfo>& out) {
  const bool any_pool = pool.first == 0 && pool.second == 0;
  std::lock_guard lock(fmu_);
  for (const auto& [key, fp] : foreign_) {
    if (!any_pool && fp->id != pool) continue;
    for (const foreign_segment& seg : fp->segments) {
      SegmentInfo si;
      si.device = fp->device;
      si.address = reinterpret_cast<std::size_t>(seg.base);
      si.total_size = seg.size;
      si.stream = seg.stream;
      si.is_large = !seg.small;
      si.is_expandable = false;
      si.owner_private_pool_id = fp->id;
      {
        std::lock_guard hl(mu_);
        if (auto sc = segment_ctx_.find(si.address); sc != segment_ctx_.end()) {
          si.context_when_allocated = sc->second;
        }
      }
      for (const auto& [addr, b] : seg.blocks) {
        BlockInfo bi;
        bi.size = b.size;
        bi.requested_size = b.requested;
        bi.allocated = b.allocated;
        bi.active = b.allocated || b.pending;
        if (b.allocated) {
          if (auto it = live.find(reinterpret_cast<void*>(addr)); it != live.end()) {
            bi.context_when_allocated = it->second.context;
          }
          si.allocated_size += b.size;
          si.requested_size += b.requested;
        }
        if (bi.active) si.active_size += b.size;
        si.blocks.push_back(std::move(bi));
      }
      out.push_back(std::move(si));
    }
  }
}

void cucache_allocator::on_segment(int device, int event, std::uint64_t base,
                                   std::uint64_t bytes, cudaStream_t stream) noexcept {
  if (!recording()) return;
  try {
    std::lock_guard lock(mu_);
    std::shared_ptr<c10::GatheredContext> ctx;
    if (event == CUCACHE_TORCH_SEGMENT_MAP || event == CUCACHE_TORCH_SEGMENT_UNMAP) {
      // Expandable segments: the context of the allocation that maps, or of the call that
      // unmaps (emptyCache, a free that gives pages back) -- PyTorch's as well.
      const bool map = event == CUCACHE_TORCH_SEGMENT_MAP;
      std::shared_ptr<c10::GatheredContext>* c = map ? t_alloc_ctx : t_free_ctx;
      if (c != nullptr) ctx = *c;
      record_locked(map ? TraceEntry::SEGMENT_MAP : TraceEntry::SEGMENT_UNMAP,
                    static_cast<c10::DeviceIndex>(device), base, bytes, stream, std::move(ctx));
      return;
    }
    const bool freed = event == CUCACHE_TORCH_SEGMENT_FREE;
    if (freed) {
      // PyTorch: the context of the call that frees (emptyCache under context="all"), else the
      // segment's allocation context.
      if (t_free_ctx != nullptr) ctx = *t_free_ctx;
      if (auto it = segment_ctx_.find(base); it != segment_ctx_.end()) {
        if (ctx == nullptr) ctx = it->second;
        segment_ctx_.erase(it);
      }
    } else if (t_alloc_ctx != nullptr) {
      ctx = *t_alloc_ctx;
      if (ctx != nullptr) segment_ctx_[base] = ctx;
    }
    record_locked(freed ? TraceEntry::SEGMENT_FREE : TraceEntry::SEGMENT_ALLOC,
                  static_cast<c10::DeviceIndex>(device), base, bytes, stream, std::move(ctx));
  } catch (...) {
  }
}

void cucache_allocator::record_locked(TraceEntry::Action action, c10::DeviceIndex device,
                                      std::size_t addr, std::size_t size, cudaStream_t stream,
                                      std::shared_ptr<c10::GatheredContext> context) {
  if (skipped(action)) return;
  // PyTorch's record_trace: the entry keeps a context only when contexts are recorded for
  // allocations ("alloc" or "all"); "N/A" outside a compile region.
  TraceEntry e(action, device, addr, size, stream, MempoolId_t{0, 0}, c10::getApproximateTime(),
               when_.load() >= cca::RecordContext::ALLOC ? std::move(context) : nullptr,
               compile_context_.empty() ? "N/A" : compile_context_.back(), user_metadata_);
  for (const auto& t : trackers_) t(e);
  if (!history_.load()) return;
  const auto d = static_cast<std::size_t>(device);
  if (traces_.size() <= d) {
    traces_.resize(d + 1);
    trace_next_.resize(d + 1, 0);
  }
  std::vector<TraceEntry>& ring = traces_[d];
  if (ring.size() < max_entries_) {
    ring.push_back(std::move(e));
  } else {
    ring[trace_next_[d]] = std::move(e);
    trace_next_[d] = (trace_next_[d] + 1) % max_entries_;
  }
}

void cucache_allocator::raise_oom(std::size_t size, c10::DeviceIndex device, cudaStream_t stream,
                                  const std::string& why) {
  std::size_t device_free = 0;
  std::size_t device_total = 0;
  {
    c10::cuda::CUDAGuard guard(device);
    if (cudaMemGetInfo(&device_free, &device_total) != cudaSuccess) {
      static_cast<void>(cudaGetLastError());
      device_free = 0;
      device_total = 0;
    }
  }
  cucache_torch_stats s{};
  static_cast<void>(cucache_torch_get_stats(device, &s));
  if (device_total == 0) device_total = s.device_total_bytes;
  const auto allocated = static_cast<std::uint64_t>(s.allocated_bytes[0].current);
  const auto reserved = static_cast<std::uint64_t>(s.reserved_bytes[0].current);
  std::vector<cca::OutOfMemoryObserver> observers;
  {
    std::lock_guard lock(mu_);
    if (recording()) {
      record_locked(TraceEntry::OOM, device, device_free, size, stream,
                    gather(cca::RecordContext::STATE));
    }
    observers = oom_observers_;
  }
  for (const auto& o : observers) o(device, allocated, device_total, device_free);
  std::string allowed;
  if (s.memory_limit != 0 && s.memory_limit < device_total) {
    allowed = "Of which " + format_size(s.memory_limit) + " is allowed (memory fraction). ";
  }
  TORCH_CHECK_WITH(
      OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ", format_size(size),
      ". GPU ", static_cast<int>(device), " has a total capacity of ", format_size(device_total),
      " of which ", format_size(device_free), " is free. Including non-PyTorch memory, this "
      "process has ", format_size(device_total - device_free), " memory in use. ", allowed,
      "Of the allocated memory ", format_size(allocated), " is allocated by PyTorch (cucache), and ",
      format_size(reserved > allocated ? reserved - allocated : 0),
      " is reserved by PyTorch (cucache) but unallocated. If reserved but unallocated memory is "
      "large try setting CUCACHE_CONF=expandable_segments:True to avoid fragmentation (cucache: ",
      why, ")");
}

void cucache_allocator::recordHistory(bool enabled, cca::CreateContextFn recorder,
                                      std::size_t max_entries, cca::RecordContext when,
                                      bool clear_history,
                                      const std::vector<std::string>& skip_actions) {
  TORCH_CHECK(when == cca::RecordContext::NEVER || recorder != nullptr,
              "cucache: recordHistory: a context recorder is needed to record contexts");
  std::vector<TraceEntry::Action> skip;
  for (const std::string& a : skip_actions) {
    static const std::pair<const char*, TraceEntry::Action> names[] = {
        {"alloc", TraceEntry::ALLOC},
        {"free_requested", TraceEntry::FREE_REQUESTED},
        {"free_completed", TraceEntry::FREE_COMPLETED},
        {"segment_alloc", TraceEntry::SEGMENT_ALLOC},
        {"segment_free", TraceEntry::SEGMENT_FREE},
        {"segment_map", TraceEntry::SEGMENT_MAP},
        {"segment_unmap", TraceEntry::SEGMENT_UNMAP},
        {"snapshot", TraceEntry::SNAPSHOT},
        {"oom", TraceEntry::OOM}};
    bool known = false;
    for (const auto& [n, act] : names) {
      if (a == n) {
        skip.push_back(act);
        known = true;
      }
    }
    TORCH_CHECK(known, "cucache: recordHistory: unknown action to skip '", a, "'");
  }
  std::lock_guard lock(mu_);
  history_.store(enabled);
  recorder_.store(enabled ? recorder : nullptr);
  when_ = enabled ? when : cca::RecordContext::NEVER;
  max_entries_ = std::max<std::size_t>(1, max_entries);
  skip_ = std::move(skip);
  if (!enabled || clear_history) {
    traces_.clear();
    trace_next_.clear();
    annotations_.clear();
  }
  // Live blocks keep their contexts (PyTorch's blocks do): note_free forgets each at its free.
}

cca::SnapshotInfo cucache_allocator::snapshot(MempoolId_t pool, bool include_traces) {
  cca::SnapshotInfo info;
  const bool any_pool = pool.first == 0 && pool.second == 0;
  std::unordered_map<void*, live_rec> live;
  std::unordered_map<std::uint64_t, std::shared_ptr<c10::GatheredContext>> seg_ctx;
  {
    std::lock_guard lock(mu_);
    live = live_;
    seg_ctx = segment_ctx_;
  }
  const int n = device_count();
  for (int d = 0; d < n; ++d) {
    const auto device = static_cast<c10::DeviceIndex>(d);
    walk_segments(device, [&](const cucache_torch_segment_info& s) {
      if (!any_pool && (s.pool_first != pool.first || s.pool_second != pool.second)) return;
      // One SegmentInfo per cudaMalloc'd segment, or per mapped run of an expandable range (what
      // PyTorch reports for its expandable segments), its blocks clipped to it.
      std::vector<std::pair<std::uint64_t, std::uint64_t>> runs;
      if (s.expandable == 0) {
        runs.emplace_back(s.address, s.size);
      } else {
        for (std::size_t i = 0; i < s.mapping_count; ++i) {
          const auto& m = s.mappings[i];
          if (!runs.empty() && runs.back().first + runs.back().second == m.address) {
            runs.back().second += m.size;
          } else {
            runs.emplace_back(m.address, m.size);
          }
        }
      }
      for (const auto& [start, len] : runs) {
        SegmentInfo seg;
        seg.device = device;
        seg.address = start;
        seg.total_size = len;
        seg.stream = s.stream;
        seg.is_large = s.small == 0;
        seg.is_expandable = s.expandable != 0;
        seg.owner_private_pool_id = {s.pool_first, s.pool_second};
        if (auto it = seg_ctx.find(s.address); it != seg_ctx.end()) {
          seg.context_when_allocated = it->second;
        }
        for (std::size_t i = 0; i < s.block_count; ++i) {
          const cucache_torch_block_info& b = s.blocks[i];
          const std::uint64_t lo = std::max(b.address, start);
          const std::uint64_t hi = std::min(b.address + b.size, start + len);
          if (lo >= hi) continue;
          BlockInfo block;
          block.size = hi - lo;
          block.allocated = b.state == CUCACHE_TORCH_BLOCK_ALLOCATED;
          block.active = b.state != CUCACHE_TORCH_BLOCK_FREE;
          block.requested_size = block.allocated ? b.requested : 0;
          if (block.allocated) {
            if (auto it = live.find(reinterpret_cast<void*>(b.address)); it != live.end()) {
              block.context_when_allocated = it->second.context;
            }
            seg.allocated_size += block.size;
            seg.requested_size += block.requested_size;
          }
          if (block.active) seg.active_size += block.size;
          seg.blocks.push_back(std::move(block));
        }
        info.segments.push_back(std::move(seg));
      }
    });
  }
  snapshot_foreign(pool, live, info.segments);
  std::lock_guard lock(mu_);
  info.device_traces.resize(static_cast<std::size_t>(n));
  auto tsc_to_ns = clock_converter_.makeConverter();
  if (include_traces) {
    for (std::size_t d = 0; d < traces_.size() && d < info.device_traces.size(); ++d) {
      const std::vector<TraceEntry>& ring = traces_[d];
      auto& out = info.device_traces[d];
      // Oldest first: from the slot the next entry overwrites; times in microseconds (PyTorch's
      // trace() converts them so).
      for (std::size_t i = 0; i < ring.size(); ++i) {
        out.push_back(ring[(trace_next_[d] + i) % ring.size()]);
        out.back().time_.t_ = tsc_to_ns(out.back().time_.approx_t_) / 1000;
      }
    }
    info.external_annotations = annotations_;
    for (auto& a : info.external_annotations) a.time_.t_ = tsc_to_ns(a.time_.approx_t_) / 1000;
  }
  // PyTorch records the SNAPSHOT entry after it has copied the traces: it shows in the next
  // snapshot's trace, not in this one's.
  if (history_.load()) {
    std::vector<std::size_t> active(static_cast<std::size_t>(n), 0);
    for (const SegmentInfo& seg : info.segments) {
      if (seg.device >= 0 && seg.device < n) active[static_cast<std::size_t>(seg.device)] += seg.active_size;
    }
    for (int d = 0; d < n; ++d) {
      record_locked(TraceEntry::SNAPSHOT, static_cast<c10::DeviceIndex>(d), 0,
                    active[static_cast<std::size_t>(d)], nullptr, nullptr);
    }
  }
  // The configuration, as far as PyTorch's fields describe cucache's.
  char buf[1024];
  const int64_t len = cucache_torch_canonical_conf(nullptr, buf, sizeof buf);
  const std::string conf = len >= 0 ? std::string(buf) : std::string();
  info.config_metadata.last_allocator_settings = "cucache:" + conf;
  info.config_metadata.expandable_segments =
      conf.find("expandable_segments:True") != std::string::npos;
  info.config_metadata.max_split_size = SIZE_MAX;
  if (auto at = conf.find("max_split_size_mb:"); at != std::string::npos) {
    info.config_metadata.max_split_size =
        std::stoull(conf.substr(at + std::strlen("max_split_size_mb:"))) << 20;
  }
  info.config_metadata.garbage_collection_threshold = 0;
  if (auto at = conf.find("garbage_collection_threshold:"); at != std::string::npos) {
    info.config_metadata.garbage_collection_threshold =
        std::stod(conf.substr(at + std::strlen("garbage_collection_threshold:")));
  }
  info.config_metadata.pinned_num_register_threads = 1;
  info.config_metadata.release_lock_on_malloc = false;
  info.config_metadata.pinned_use_host_register = false;
  info.config_metadata.graph_capture_record_stream_reuse = false;
  return info;
}

cca::CheckpointDelta cucache_allocator::setCheckpointPoolState(
    c10::DeviceIndex device, std::shared_ptr<cca::AllocatorState> pps) {
  auto* state = dynamic_cast<checkpoint_state*>(pps.get());
  TORCH_CHECK(state != nullptr && state->cp != nullptr,
              "cucache: setCheckpointPoolState: the state was not made by cucache's "
              "getCheckpointState");
  TORCH_CHECK(state->device == device, "cucache: setCheckpointPoolState: the state is of device ",
              static_cast<int>(state->device), ", not ", static_cast<int>(device));
  struct sink {
    cucache_allocator* self;
    c10::DeviceIndex device;
    cca::CheckpointDelta delta;
  } out{this, device, {}};
  const int rc = cucache_torch_restore_pool(
      device, state->cp.get(),
      [](void* c, void* p) {
        auto& o = *static_cast<sink*>(c);
        o.self->note_free(p);
        o.delta.ptrs_freed.push_back(p);
      },
      [](void* c, void* p, std::size_t, std::size_t requested, cucache_torch_stream stream) {
        auto& o = *static_cast<sink*>(c);
        if (o.self->recording()) {
          std::lock_guard lock(o.self->mu_);
          o.self->live_insert_locked(p, live_rec{requested, stream, o.device, nullptr});
        }
        o.delta.dataptrs_allocd.emplace_back(p, p, &raw_delete_fn,
                                             c10::Device(c10::DeviceType::CUDA, o.device));
      },
      &out);
  TORCH_CHECK(rc == 0, "cucache: setCheckpointPoolState: ", last_error());
  return std::move(out.delta);
}

cca::ShareableHandle cucache_allocator::shareIpcHandle(void* ptr) {
  void* bytes = nullptr;
  std::size_t size = 0;
  TORCH_CHECK(cucache_torch_ipc_export_long(ptr, &bytes, &size) == 0,
              "cucache: shareIpcHandle: ", last_error());
  std::unique_ptr<void, void (*)(void*)> owned(bytes, &cucache_torch_ipc_free);
  // offset: of the block in what getIpcDevPtr returns (the handle's segment, or first piece).
  std::uint64_t offset = 0;
  static_assert(sizeof(std::uint64_t) == 8);
  TORCH_CHECK(size >= k_handle_offset_at + sizeof offset, "cucache: shareIpcHandle: a handle of ",
              size, " bytes");
  std::memcpy(&offset, static_cast<const char*>(bytes) + k_handle_offset_at, sizeof offset);
  std::string handle;
  handle.reserve(size + 2);
  handle.push_back(k_handle_prefix);
  handle.push_back(k_handle_version);
  handle.append(static_cast<const char*>(bytes), size);
  return {static_cast<std::ptrdiff_t>(offset), std::move(handle)};
}

std::shared_ptr<void> cucache_allocator::getIpcDevPtr(std::string handle) {
  TORCH_CHECK(!handle.empty() && handle[0] == k_handle_prefix,
              "cucache: getIpcDevPtr: this CUDA IPC handle was not made by cucache (its first "
              "byte is ",
              handle.empty() ? -1 : static_cast<int>(static_cast<unsigned char>(handle[0])),
              "; PyTorch's own allocator made it?): the sending and the receiving process must "
              "both use cucache, or both PyTorch's allocator");
  const std::size_t fixed = cucache_torch_ipc_handle_size();
  const int version = handle.size() >= 2 ? static_cast<int>(handle[1]) : -1;
  // Version 2 is variable length: cucache_torch_ipc_open checks its size against its piece count.
  TORCH_CHECK((version == k_handle_version && handle.size() >= 2 + k_handle_offset_at + 8) ||
                  (version == k_handle_version_fixed && handle.size() == fixed + 2),
              "cucache: getIpcDevPtr: a cucache IPC handle of another version or size (",
              handle.size(), " bytes, version ", version, "; this cucache reads version ",
              static_cast<int>(k_handle_version), ", or version ",
              static_cast<int>(k_handle_version_fixed), " of ", fixed + 2, " bytes)");
  void* ptr = nullptr;
  TORCH_CHECK(cucache_torch_ipc_open(handle.data() + 2, handle.size() - 2, 1, &ptr) == 0,
              "cucache: getIpcDevPtr: ", last_error());
  std::uint64_t offset = 0;
  std::memcpy(&offset, handle.data() + 2 + k_handle_offset_at, sizeof offset);
  void* base = static_cast<char*>(ptr) - offset;
  return std::shared_ptr<void>(base, [ptr](void*) {
    if (cucache_torch_ipc_close(ptr) != 0) {
      std::fprintf(stderr, "cucache: closing a CUDA IPC mapping failed: %s\n",
                   cucache_torch_last_error());
    }
  });
}

// Runtime settings (PyTorch's setAllocatorSettings). Applied: the size rules -- every call resets
// max_split_size_mb, roundup_power2_divisions and garbage_collection_threshold to their defaults
// and applies those it names, as PyTorch's parser does (max_non_split_rounding_mb too when named),
// from the next allocation on, on every device (cucache_torch_set_size_rules) -- and
// per_process_memory_fraction (every device). Left to torch: pinned_* (its pinned host allocator),
// release_lock_on_cudamalloc (cucache never holds a lock over cudaMalloc's wait for other
// threads). Everything else is cucache's configuration, fixed at its first allocation: a value
// that differs from cucache's is named in a warning, never dropped silently.
void cucache_allocator::on_settings(const std::string& env) {
  std::vector<std::string> options;
  std::string cur;
  int depth = 0;
  for (char c : env) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if ((c == ',' && depth == 0)) {
      options.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  options.push_back(cur);
  auto trim = [](std::string t) {
    const auto b = t.find_first_not_of(" \t\n");
    const auto e = t.find_last_not_of(" \t\n");
    return b == std::string::npos ? std::string() : t.substr(b, e - b + 1);
  };
  char buf[1024];
  const int64_t len = cucache_torch_canonical_conf(nullptr, buf, sizeof buf);
  const std::string conf = len >= 0 ? std::string(buf) : std::string();
  std::string fixed;
  std::string size_rules;  // the size-rule keys given, in cucache's (= PyTorch's) syntax
  for (const std::string& raw : options) {
    const std::string o = trim(raw);
    if (o.empty()) continue;
    const auto colon = o.find(':');
    const std::string key = trim(o.substr(0, colon));
    const std::string value = colon == std::string::npos ? std::string() : trim(o.substr(colon + 1));
    if (key == "max_split_size_mb" || key == "roundup_power2_divisions" ||
        key == "garbage_collection_threshold" || key == "max_non_split_rounding_mb") {
      size_rules += (size_rules.empty() ? "" : ",") + key + ":" + value;
      continue;
    }
    if (key == "per_process_memory_fraction") {
      const double f = std::stod(value);
      for (int d = 0; d < device_count(); ++d) setMemoryFraction(f, static_cast<c10::DeviceIndex>(d));
      continue;
    }
    if (key.rfind("pinned_", 0) == 0 || key == "release_lock_on_cudamalloc" ||
        key == "release_lock_on_hipmalloc") {
      continue;
    }
    if (key == "backend") {
      TORCH_CHECK(value == "native", "cucache: allocator setting 'backend:", value,
                  "': cucache is torch's CUDA allocator (its 'native' backend); cudaMallocAsync "
                  "cannot be chosen while it is installed");
      continue;
    }
    if (key == "graph_capture_record_stream_reuse") {
      if (value == "True" || value == "true") {
        TORCH_WARN("cucache: allocator setting 'graph_capture_record_stream_reuse:True' is not "
                   "applied: inside a CUDA graph capture cucache keeps a block used on another "
                   "stream (record_stream) for the graph until the capture ends, it does not "
                   "reuse it after the streams join");
      }
      continue;
    }
    const std::string kv = key + ":" + value;
    if (conf.find(kv) != std::string::npos) continue;
    if (key == "expandable_segments" && (value == "False" || value == "false") &&
        conf.find("expandable_segments:True") == std::string::npos) {
      continue;
    }
    fixed += (fixed.empty() ? "" : ", ") + std::string("'") + kv + "'";
  }
  // Called even when no size rule is named: PyTorch's call resets them all the same.
  TORCH_CHECK(cucache_torch_set_size_rules(size_rules.c_str()) == 0,
              "cucache: allocator settings '", size_rules, "': ", last_error());
  if (!fixed.empty()) {
    TORCH_WARN("cucache: allocator setting", fixed.find(',') == std::string::npos ? " " : "s ",
               fixed, " not applied: cucache's configuration is fixed at its first allocation "
               "(set CUCACHE_CONF, or PYTORCH_ALLOC_CONF, before the first CUDA allocation); "
               "cucache runs with '", conf, "'. Settings it changes at run time: "
               "max_split_size_mb, roundup_power2_divisions, garbage_collection_threshold, "
               "max_non_split_rounding_mb, per_process_memory_fraction");
  }
}

void segment_listener(void* /*ctx*/, int device, int event, std::uint64_t base,
                      std::uint64_t bytes, cucache_torch_stream stream) {
  if (g_self != nullptr) g_self->on_segment(device, event, base, bytes, stream);
}

}  // namespace
}  // namespace cucache::detail

const char* cucache_torch_hooks_torch_version(void) {
  return TORCH_VERSION;
}

int cucache_torch_hooks_install(void) {
  using namespace cucache::detail;
  try {
    TORCH_CHECK(g_self == nullptr, "cucache is torch's allocator already");
    auto current = c10::cuda::CUDACachingAllocator::allocator.load();
    TORCH_CHECK(current == nullptr || !current->initialized(),
                "torch has initialized its CUDA allocator (", current ? current->name() : "",
                ") already: install cucache before anything uses CUDA");
    auto a = std::make_shared<cucache_allocator>();
    g_self = a.get();
    TORCH_CHECK(cucache_torch_set_segment_listener(&segment_listener, nullptr) == 0,
                last_error());
    // PyTorch routes every capture it makes (beginAllocateToPool before cudaStreamBeginCapture,
    // endAllocateToPool after cudaStreamEndCapture), and a route turns cucache's capture query
    // back on: outside routes an allocation asks no capture status (docs/torch.md).
    // CUCACHE_TORCH_CAPTURES=query keeps the query on every allocation (for captures PyTorch does
    // not route, made on PyTorch's streams by another library).
    const char* captures = std::getenv("CUCACHE_TORCH_CAPTURES");
    const bool query = captures != nullptr && std::string_view(captures) == "query";
    TORCH_CHECK(captures == nullptr || query || std::string_view(captures) == "announced",
                "CUCACHE_TORCH_CAPTURES='", captures, "': expected 'announced' or 'query'");
    TORCH_CHECK(cucache_torch_set_captures_announced(query ? 0 : 1) == 0, last_error());
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
    // changeCurrentAllocator swaps only CUDACachingAllocator's pointer; c10::GetAllocator(kCUDA)
    // (torch.accelerator's memory calls through c10::getDeviceAllocator, storages made by
    // device type) still names the native allocator, which c10_cuda registers at priority 0.
    // The shared_ptr above (held by CUDAPluggableAllocator) keeps it alive for good.
    c10::SetAllocator(c10::DeviceType::CUDA, a.get(), /*priority=*/1);
    // torch.cuda.memory._set_allocator_settings / torch._C._accelerator_setAllocatorSettings:
    // c10 calls one device config parser hook after parsing (CUDA's own is registered there);
    // cucache's runs after it.
    auto& hook = c10::CachingAllocator::AcceleratorAllocatorConfig::getConfigParserHook();
    std::function<void(const std::string&)> previous = hook;
    hook = [previous](const std::string& env) {
      if (previous) previous(env);
      if (g_self != nullptr) g_self->on_settings(env);
    };
    return 0;
  } catch (const std::exception& e) {
    std::string msg = std::string("cucache_torch_hooks_install: ") + e.what();
    cucache_torch_set_error(msg.c_str());
  } catch (...) {
    cucache_torch_set_error("cucache_torch_hooks_install: unknown error");
  }
  return -1;
}
