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
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
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
constexpr char k_handle_version = 1;

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
    if (pool.first == 0 && pool.second == 0) {
      TORCH_CHECK(cucache_torch_empty_cache() == 0, "cucache: emptyCache: ", last_error());
      return;
    }
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
    TORCH_CHECK(cucache_torch_delete(ptr) == 0, "cucache: raw_delete: ", last_error());
  }
  void init(int /*device_count*/) override { initialized_.store(true); }
  double getMemoryFraction(c10::DeviceIndex device) override {
    double f = 0;
    TORCH_CHECK(cucache_torch_get_memory_fraction(device, &f) == 0,
                "cucache: getMemoryFraction: ", last_error());
    return f;  // 1.0 when no cap is set, as PyTorch answers
  }
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    TORCH_CHECK(cucache_torch_set_memory_fraction(device, fraction) == 0,
                "cucache: setMemoryFraction(", fraction, ", device ", static_cast<int>(device),
                "): ", last_error());
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
  void enable(bool value) override {
    TORCH_CHECK(value, "cucache: enable(False): cucache cannot run uncached; to bypass it, do not "
                       "install it (cucache.torch.install)");
  }
  bool isEnabled() const override { return true; }
  void cacheInfo(c10::DeviceIndex device, std::size_t* largest_block) override {
    // cuDNN sizes its workspace by this: the largest request served from cached memory alone.
    *largest_block = static_cast<std::size_t>(stats_of(device).largest_free_block);
  }
  void* getBaseAllocation(void* ptr, std::size_t* size) override {
    void* base = nullptr;
    TORCH_CHECK(cucache_torch_base_allocation(ptr, &base, size) == 0,
                "cucache: getBaseAllocation: ", last_error());
    return base;
  }
  using cca::CUDAAllocator::recordStream;
  void recordStream(const c10::DataPtr& ptr, c10::cuda::CUDAStream stream) override {
    // A zero-size tensor has no memory; a DataPtr cucache did not make is not its to track.
    if (ptr.get() == nullptr || ptr.get_deleter() != &raw_delete_fn) return;
    TORCH_CHECK(cucache_torch_record_stream(ptr.get(), stream.stream()) == 0,
                "cucache: recordStream: ", last_error());
  }
  cca::SnapshotInfo snapshot(MempoolId_t pool, bool include_traces) override;
  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t pool,
                           std::function<bool(cudaStream_t)> filter) override {
    auto* ctx = new std::function<bool(cudaStream_t)>(std::move(filter));
    const int rc = cucache_torch_begin_allocate_to_pool(
        device, pool.first, pool.second,
        [](void* c, cucache_torch_stream s) {
          return (*static_cast<std::function<bool(cudaStream_t)>*>(c))(s) ? 1 : 0;
        },
        ctx, [](void* c) { delete static_cast<std::function<bool(cudaStream_t)>*>(c); });
    TORCH_CHECK(rc == 0, "cucache: beginAllocateToPool: ", last_error());
  }
  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t pool) override {
    TORCH_CHECK(cucache_torch_end_allocate_to_pool(device, pool.first, pool.second) == 0,
                "cucache: endAllocateToPool: ", last_error());
  }
  void releasePool(c10::DeviceIndex device, MempoolId_t pool) override {
    TORCH_CHECK(cucache_torch_release_pool(device, pool.first, pool.second) == 0,
                "cucache: releasePool: ", last_error());
  }
  int getPoolUseCount(c10::DeviceIndex device, MempoolId_t pool) override {
    std::uint64_t uses = 0;
    TORCH_CHECK(cucache_torch_pool_use_count(device, pool.first, pool.second, &uses) == 0,
                "cucache: getPoolUseCount: ", last_error());
    return static_cast<int>(uses);
  }
  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t pool,
                          std::shared_ptr<cca::CUDAAllocator> allocator) override {
    TORCH_CHECK(allocator == nullptr || allocator.get() == this,
                "cucache: createOrIncrefPool: a MemPool with an allocator of its own (",
                allocator ? allocator->name() : std::string(),
                ") cannot be served while cucache is torch's CUDA allocator: cucache allocates "
                "every pool itself");
    TORCH_CHECK(cucache_torch_create_or_incref_pool(device, pool.first, pool.second) == 0,
                "cucache: createOrIncrefPool: ", last_error());
  }
  void setUseOnOOM(c10::DeviceIndex device, MempoolId_t pool, bool use_on_oom) override {
    // cucache's out-of-memory ladder never borrows a private pool's memory: use_on_oom=False is
    // what it does anyway.
    TORCH_CHECK(!use_on_oom, "cucache: setUseOnOOM(device ", static_cast<int>(device), ", pool (",
                pool.first, ", ", pool.second,
                "), True): cucache never serves other allocations from a private pool's memory "
                "when out of memory (MemPool(use_on_oom=True) is not supported)");
  }
  void setNoSplit(c10::DeviceIndex device, MempoolId_t pool) override {
    TORCH_CHECK(false, "cucache: setNoSplit(device ", static_cast<int>(device), ", pool (",
                pool.first, ", ", pool.second,
                ")): cucache splits a pool's blocks by its own policy (max_split_size); "
                "MemPool(no_split=True) is not supported");
  }
  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t pool,
                                const std::unordered_set<void*>& expected) override {
    std::vector<void*> live;
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
  void on_segment(int device, bool freed, std::uint64_t base, std::uint64_t bytes,
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

  std::mutex mu_;  // everything below
  std::unordered_map<void*, live_rec> live_;
  std::vector<std::vector<TraceEntry>> traces_;  // per device: a ring of max_entries_
  std::vector<std::size_t> trace_next_;          // per device: the slot the next entry overwrites
  std::vector<c10::CachingDeviceAllocator::AnnotationEntry> annotations_;
  std::vector<std::string> compile_context_;
  std::string user_metadata_;
  std::vector<cca::OutOfMemoryObserver> oom_observers_;
  std::vector<cca::AllocatorTraceTracker> trackers_;
};

void raw_delete_fn(void* ptr) {
  if (ptr == nullptr) return;
  g_self->note_free(ptr);
  // A deleter runs in destructors and cannot throw: a refused free is reported here.
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
  void* p = nullptr;
  const int rc = cucache_torch_try_alloc(size, device, stream, &p);
  if (rc == CUCACHE_TORCH_ALLOC_OUT_OF_MEMORY) raise_oom(size, device, stream, last_error());
  TORCH_CHECK(rc == CUCACHE_TORCH_ALLOC_OK, "cucache: allocating ", size, " bytes on device ",
              static_cast<int>(device), " failed: ", last_error());
  if (p != nullptr && recording()) {
    std::shared_ptr<c10::GatheredContext> ctx = gather(cca::RecordContext::STATE);
    std::lock_guard lock(mu_);
    live_[p] = live_rec{size, stream, device, ctx};
    record_locked(TraceEntry::ALLOC, device, reinterpret_cast<std::size_t>(p), size, stream,
                  when_.load() >= cca::RecordContext::ALLOC ? ctx : nullptr);
  }
  return p;
}

void cucache_allocator::note_free(void* ptr) noexcept {
  if (!recording()) return;
  try {
    std::shared_ptr<c10::GatheredContext> ctx = gather(cca::RecordContext::ALL);
    std::lock_guard lock(mu_);
    auto it = live_.find(ptr);
    if (it == live_.end()) return;  // allocated before history was turned on
    const live_rec r = it->second;
    live_.erase(it);
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

void cucache_allocator::on_segment(int device, bool freed, std::uint64_t base,
                                   std::uint64_t bytes, cudaStream_t stream) noexcept {
  if (!recording()) return;
  try {
    std::lock_guard lock(mu_);
    record_locked(freed ? TraceEntry::SEGMENT_FREE : TraceEntry::SEGMENT_ALLOC,
                  static_cast<c10::DeviceIndex>(device), base, bytes, stream, nullptr);
  } catch (...) {
  }
}

void cucache_allocator::record_locked(TraceEntry::Action action, c10::DeviceIndex device,
                                      std::size_t addr, std::size_t size, cudaStream_t stream,
                                      std::shared_ptr<c10::GatheredContext> context) {
  if (skipped(action)) return;
  TraceEntry e(action, device, addr, size, stream, MempoolId_t{0, 0}, c10::getApproximateTime(),
               std::move(context), compile_context_.empty() ? "" : compile_context_.back(),
               user_metadata_);
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
  if (!enabled && !tracking_.load()) live_.clear();
}

cca::SnapshotInfo cucache_allocator::snapshot(MempoolId_t pool, bool include_traces) {
  cca::SnapshotInfo info;
  const bool any_pool = pool.first == 0 && pool.second == 0;
  std::unordered_map<void*, live_rec> live;
  {
    std::lock_guard lock(mu_);
    live = live_;
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
  std::lock_guard lock(mu_);
  if (history_.load()) {
    for (int d = 0; d < n; ++d) {
      record_locked(TraceEntry::SNAPSHOT, static_cast<c10::DeviceIndex>(d), 0, 0, nullptr,
                    nullptr);
    }
  }
  info.device_traces.resize(static_cast<std::size_t>(n));
  if (include_traces) {
    for (std::size_t d = 0; d < traces_.size() && d < info.device_traces.size(); ++d) {
      const std::vector<TraceEntry>& ring = traces_[d];
      auto& out = info.device_traces[d];
      // Oldest first: from the slot the next entry overwrites.
      for (std::size_t i = 0; i < ring.size(); ++i) {
        out.push_back(ring[(trace_next_[d] + i) % ring.size()]);
      }
    }
    info.external_annotations = annotations_;
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
          o.self->live_[p] = live_rec{requested, stream, o.device, nullptr};
        }
        o.delta.dataptrs_allocd.emplace_back(p, p, &raw_delete_fn,
                                             c10::Device(c10::DeviceType::CUDA, o.device));
      },
      &out);
  TORCH_CHECK(rc == 0, "cucache: setCheckpointPoolState: ", last_error());
  return std::move(out.delta);
}

cca::ShareableHandle cucache_allocator::shareIpcHandle(void* ptr) {
  std::string bytes(cucache_torch_ipc_handle_size(), '\0');
  TORCH_CHECK(cucache_torch_ipc_export(ptr, bytes.data(), bytes.size()) == 0,
              "cucache: shareIpcHandle: ", last_error());
  // offset: of the block in what getIpcDevPtr returns (the handle's segment, or first piece).
  std::uint64_t offset = 0;
  static_assert(sizeof(std::uint64_t) == 8);
  // cucacheIpcHandle: magic, version, kind, device (4 bytes each), pid (8), offset (8).
  std::memcpy(&offset, bytes.data() + 24, sizeof offset);
  std::string handle;
  handle.reserve(bytes.size() + 2);
  handle.push_back(k_handle_prefix);
  handle.push_back(k_handle_version);
  handle += bytes;
  return {static_cast<std::ptrdiff_t>(offset), std::move(handle)};
}

std::shared_ptr<void> cucache_allocator::getIpcDevPtr(std::string handle) {
  const std::size_t size = cucache_torch_ipc_handle_size();
  TORCH_CHECK(!handle.empty() && handle[0] == k_handle_prefix,
              "cucache: getIpcDevPtr: this CUDA IPC handle was not made by cucache (its first "
              "byte is ",
              handle.empty() ? -1 : static_cast<int>(static_cast<unsigned char>(handle[0])),
              "; PyTorch's own allocator made it?): the sending and the receiving process must "
              "both use cucache, or both PyTorch's allocator");
  TORCH_CHECK(handle.size() == size + 2 && handle[1] == k_handle_version,
              "cucache: getIpcDevPtr: a cucache IPC handle of another version or size (",
              handle.size(), " bytes, version ", static_cast<int>(handle[1]), "; this cucache reads ",
              size + 2, " bytes, version ", static_cast<int>(k_handle_version), ")");
  void* ptr = nullptr;
  TORCH_CHECK(cucache_torch_ipc_open(handle.data() + 2, size, 1, &ptr) == 0,
              "cucache: getIpcDevPtr: ", last_error());
  std::uint64_t offset = 0;
  std::memcpy(&offset, handle.data() + 2 + 24, sizeof offset);
  void* base = static_cast<char*>(ptr) - offset;
  return std::shared_ptr<void>(base, [ptr](void*) {
    if (cucache_torch_ipc_close(ptr) != 0) {
      std::fprintf(stderr, "cucache: closing a CUDA IPC mapping failed: %s\n",
                   cucache_torch_last_error());
    }
  });
}

void segment_listener(void* /*ctx*/, int device, int freed, std::uint64_t base,
                      std::uint64_t bytes, cucache_torch_stream stream) {
  if (g_self != nullptr) g_self->on_segment(device, freed != 0, base, bytes, stream);
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
    torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(a);
    return 0;
  } catch (const std::exception& e) {
    std::string msg = std::string("cucache_torch_hooks_install: ") + e.what();
    cucache_torch_set_error(msg.c_str());
  } catch (...) {
    cucache_torch_set_error("cucache_torch_hooks_install: unknown error");
  }
  return -1;
}
