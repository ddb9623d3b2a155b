// The peer allocators of cucache-replay (see peers.hpp). Each run starts cold and frees what the
// trace leaves live, outside the timed loop, so every run sees the same device.
#include "peers.hpp"

#include <cuda_runtime_api.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <optional>
#include <ostream>

#include "common/c10_loader.hpp"
#include "common/cuda_check.hpp"
#include "common/device_peers.hpp"
#include "cucache/errors.hpp"
#include "replay_loop.hpp"

namespace cucache::replay {
namespace {

using tools::check_cuda;

double ns_per_op(const pass_result& r, const prepared_trace& trace) {
  return trace.timed_events == 0
             ? 0.0
             : static_cast<double>(r.elapsed.count()) / static_cast<double>(trace.timed_events);
}

/// Frees what a pass left live, each on the stream it was allocated on.
template <class Free>
void free_leftovers(const prepared_trace& trace, std::span<const stream_handle> streams,
                    std::span<void*> slots, Free&& free_one) {
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] == nullptr) continue;
    free_one(slots[i], streams[trace.ops[i].stream]);
    slots[i] = nullptr;
  }
}

std::size_t device_total_bytes() {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  check_cuda(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  return total_bytes;
}

std::size_t device_used_bytes() {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  check_cuda(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  return total_bytes - free_bytes;
}

// --- cudaMalloc / cudaFree --------------------------------------------------------------------

struct cuda_malloc_ops {
  tools::cuda_malloc_device device;
  void* allocate(std::size_t bytes, stream_handle /*stream*/) { return device.allocate(bytes); }
  void deallocate(void* p, stream_handle /*stream*/, bool /*other_stream*/) {
    device.deallocate(p);
  }
};

class cuda_malloc_peer final : public peer {
 public:
  [[nodiscard]] std::string name() const override { return "cudaMalloc"; }
  [[nodiscard]] std::string peak_source() const override {
    return "cudaMemGetInfo used bytes after each allocation (one untimed run), minus the "
           "baseline before it";
  }
  void begin_trace() override { peak_ = std::nullopt; }

  peer_run run(const prepared_trace& trace, std::span<const stream_handle> streams,
               std::span<void*> slots, bool warm) override {
    cuda_malloc_ops ops;
    std::fill(slots.begin(), slots.end(), nullptr);
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const pass_result r = run_pass(trace, streams, slots, ops);
    free_leftovers(trace, streams, slots,
                   [&](void* p, stream_handle s) { ops.deallocate(p, s, false); });
    double warm_ns = 0.0;
    if (warm) {  // no cache: the second pass costs what the first did
      const pass_result w = run_pass(trace, streams, slots, ops);
      free_leftovers(trace, streams, slots,
                     [&](void* p, stream_handle s) { ops.deallocate(p, s, false); });
      warm_ns = ns_per_op(w, trace);
    }
    // The driver does not say how much a cudaMalloc really takes (page rounding, sub-allocation
    // of small requests), so one extra, untimed run watches the device's used memory instead.
    if (!peak_) {
      const std::size_t baseline = device_used_bytes();
      std::size_t peak = baseline;
      run_pass(trace, streams, slots, ops,
               [&](std::size_t) { peak = std::max(peak, device_used_bytes()); });
      free_leftovers(trace, streams, slots,
                     [&](void* p, stream_handle s) { ops.deallocate(p, s, false); });
      peak_ = peak - baseline;
    }
    return {ns_per_op(r, trace), r.failed_allocations, *peak_, warm_ns};
  }

  // cudaMalloc has no limit of its own; only the device's memory bounds it.
  [[nodiscard]] bool limitable() const override { return false; }
  bool fits(const prepared_trace& /*trace*/, std::span<const stream_handle> /*streams*/,
            std::span<void*> /*slots*/, std::size_t /*limit_bytes*/) override {
    throw invalid_argument("cudaMalloc cannot be held to a memory limit");
  }

 private:
  std::optional<std::size_t> peak_;
};

// --- cudaMallocAsync on a dedicated pool -------------------------------------------------------

struct async_ops {
  tools::cuda_async_pool* pool;
  void* allocate(std::size_t bytes, stream_handle stream) { return pool->allocate(bytes, stream); }
  void deallocate(void* p, stream_handle stream, bool /*other_stream*/) {
    pool->deallocate(p, stream);
  }
};

class async_peer final : public peer {
 public:
  explicit async_peer(std::size_t max_pool_bytes) : max_pool_bytes_(max_pool_bytes) {}
  [[nodiscard]] std::string name() const override { return "cudaMallocAsync"; }
  [[nodiscard]] std::string peak_source() const override {
    return "cudaMemPoolAttrReservedMemHigh of a fresh pool";
  }

  peer_run run(const prepared_trace& trace, std::span<const stream_handle> streams,
               std::span<void*> slots, bool warm) override {
    tools::cuda_async_pool pool(0, max_pool_bytes_);  // 0: the driver's default (no cap of ours)
    async_ops ops{&pool};
    std::fill(slots.begin(), slots.end(), nullptr);
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const pass_result r = run_pass(trace, streams, slots, ops);
    free_leftovers(trace, streams, slots,
                   [&](void* p, stream_handle s) { ops.deallocate(p, s, false); });
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const std::size_t peak = pool.reserved_high();  // the cold pass's, as without --warm
    double warm_ns = 0.0;
    if (warm) {  // the same pool: its release threshold keeps what the first pass reserved
      const pass_result w = run_pass(trace, streams, slots, ops);
      free_leftovers(trace, streams, slots,
                     [&](void* p, stream_handle s) { ops.deallocate(p, s, false); });
      check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      warm_ns = ns_per_op(w, trace);
    }
    return {ns_per_op(r, trace), r.failed_allocations, peak, warm_ns};
  }

  bool fits(const prepared_trace& trace, std::span<const stream_handle> streams,
            std::span<void*> slots, std::size_t limit_bytes) override {
    tools::cuda_async_pool pool(0, limit_bytes);
    async_ops ops{&pool};
    std::fill(slots.begin(), slots.end(), nullptr);
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const pass_result r = run_pass<on_failure::stop>(trace, streams, slots, ops);
    free_leftovers(trace, streams, slots,
                   [&](void* p, stream_handle s) { ops.deallocate(p, s, false); });
    return r.failed_allocations == 0;
  }

 private:
  std::size_t max_pool_bytes_;
};

// --- PyTorch's caching allocator through libcucache_c10_peer.so -------------------------------

struct c10_ops {
  const tools::c10_peer_library* lib;
  void* allocate(std::size_t bytes, stream_handle stream) { return lib->allocate(bytes, stream); }
  void deallocate(void* p, stream_handle /*stream*/, bool /*other_stream*/) { lib->deallocate(p); }
};

/// The memory fraction that makes c10 cap its reservations at `limit_bytes` of a device of
/// `total_bytes`: c10 caps at static_cast<size_t>(fraction * total), so half a byte more keeps
/// the product's rounding from landing one byte below the limit.
double fraction_of(std::size_t limit_bytes, std::size_t total_bytes) {
  return std::min(1.0, (static_cast<double>(limit_bytes) + 0.5) / static_cast<double>(total_bytes));
}

class c10_peer final : public peer {
 public:
  explicit c10_peer(const options& opts) : lib_(&tools::load_c10_peer(c10_settings(opts.cfg))) {
    // c10 takes its cap as a fraction of the device: the lower of --config's memory_fraction
    // and --capacity-gib.
    fraction_ = opts.cfg.memory_fraction > 0.0 ? opts.cfg.memory_fraction : 1.0;
    if (opts.capacity_bytes) {
      fraction_ = std::min(fraction_, fraction_of(*opts.capacity_bytes, device_total_bytes()));
    }
    if (fraction_ < 1.0) lib_->set_memory_fraction(fraction_);
  }

  [[nodiscard]] std::string name() const override { return "c10"; }
  [[nodiscard]] std::string peak_source() const override {
    return "c10 DeviceStats reserved_bytes[all].peak";
  }

  peer_run run(const prepared_trace& trace, std::span<const stream_handle> streams,
               std::span<void*> slots, bool warm) override {
    pass_result w;
    const pass_result r = pass(trace, streams, slots, [&](c10_ops& ops) {
      const pass_result cold = run_pass(trace, streams, slots, ops);
      if (warm) {  // c10's cache is process-wide: the second pass finds what the first cached
        free_leftovers(trace, streams, slots,
                       [&](void* p, stream_handle s) { ops.deallocate(p, s, false); });
        w = run_pass(trace, streams, slots, ops);
      }
      return cold;
    });
    return {ns_per_op(r, trace), r.failed_allocations,
            static_cast<std::size_t>(last_stats_.peak_reserved_bytes),
            warm ? ns_per_op(w, trace) : 0.0,
            static_cast<std::uint64_t>(last_stats_.num_device_alloc + last_stats_.num_device_free)};
  }

  bool fits(const prepared_trace& trace, std::span<const stream_handle> streams,
            std::span<void*> slots, std::size_t limit_bytes) override {
    lib_->set_memory_fraction(std::min(fraction_, fraction_of(limit_bytes, device_total_bytes())));
    const pass_result r = pass(trace, streams, slots, [&](c10_ops& ops) {
      return run_pass<on_failure::stop>(trace, streams, slots, ops);
    });
    lib_->set_memory_fraction(fraction_);
    return r.failed_allocations == 0;
  }

 private:
  /// One cold pass (`run_one`), its leftovers freed and its statistics kept in last_stats_;
  /// throws when an allocation failed for another reason than out-of-memory.
  template <class Pass>
  pass_result pass(const prepared_trace& trace, std::span<const stream_handle> streams,
                   std::span<void*> slots, Pass&& run_one) {
    lib_->reset();
    std::fill(slots.begin(), slots.end(), nullptr);
    check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    c10_ops ops{lib_};
    const pass_result r = run_one(ops);
    free_leftovers(trace, streams, slots,
                   [&](void* p, stream_handle s) { ops.deallocate(p, s, false); });
    last_stats_ = lib_->stats();
    if (r.failed_allocations > static_cast<std::uint64_t>(last_stats_.num_ooms)) {
      throw error(
          fmt::format("c10 peer: an allocation failed for a reason other than out-of-memory: {}",
                      lib_->last_error()));
    }
    lib_->reset();
    return r;
  }

  const tools::c10_peer_library* lib_;
  double fraction_ = 1.0;
  cucache_c10_stats last_stats_{};
};

}  // namespace

std::vector<std::unique_ptr<peer>> make_peers(std::span<const std::string> names, bool requested,
                                              const options& opts, std::ostream& err) {
  std::vector<std::unique_ptr<peer>> peers;
  for (const std::string& name : names) {
    try {
      if (name == "cudaMalloc") {
        peers.push_back(std::make_unique<cuda_malloc_peer>());
      } else if (name == "cudaMallocAsync") {
        peers.push_back(std::make_unique<async_peer>(opts.capacity_bytes.value_or(0)));
      } else if (name == "c10") {
        peers.push_back(std::make_unique<c10_peer>(opts));
      } else {
        throw invalid_argument(
            fmt::format("unknown peer '{}' (accepted: {})", name, fmt::join(k_peer_names, ", ")));
      }
    } catch (const invalid_argument&) {
      throw;  // a wrong name is the caller's mistake, never a peer to skip
    } catch (const std::exception& e) {
      if (requested) throw;
      err << "cucache-replay: skipping peer " << name << ": " << e.what() << '\n';
    }
  }
  return peers;
}

cuda_stream_table::cuda_stream_table(std::span<const std::uintptr_t> ids) {
  handles_.reserve(ids.size());
  try {
    for (const std::uintptr_t id : ids) {
      cudaStream_t s = nullptr;
      // Streams that allocate in a PyTorch program are its side streams, which do not
      // synchronize with the legacy default stream.
      if (id != 0)
        check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
      handles_.push_back(s);
    }
  } catch (...) {
    for (stream_handle s : handles_) {
      if (s != nullptr) (void)cudaStreamDestroy(static_cast<cudaStream_t>(s));
    }
    throw;
  }
}

cuda_stream_table::~cuda_stream_table() {
  for (stream_handle s : handles_) {
    if (s != nullptr) (void)cudaStreamDestroy(static_cast<cudaStream_t>(s));
  }
}

std::string c10_settings(const config& cfg) {
  // The keys PyTorch's allocator has, copied onto the defaults: every other key is cucache's own
  // (docs/config.md) and stays at its default, which to_string leaves out.
  config shared;
  shared.max_split_size = cfg.max_split_size;
  shared.max_non_split_rounding = cfg.max_non_split_rounding;
  shared.roundup_power2_divisions = cfg.roundup_power2_divisions;
  shared.garbage_collection_threshold = cfg.garbage_collection_threshold;
  shared.expandable_segments = cfg.expandable_segments;
  return to_string(shared);
}

bool c10_has_every_key(const config& cfg) {
  config mine = cfg;
  mine.memory_limit_bytes = 0;  // c10 takes these through a call (set_memory_fraction)
  mine.memory_fraction = 0.0;
  return c10_settings(cfg) == to_string(mine);
}

}  // namespace cucache::replay
