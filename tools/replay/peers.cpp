// The peer allocators of cucache-replay (see peers.hpp). Each run starts cold and frees what the
// trace leaves live, outside the timed loop, so every run sees the same device.
#include "peers.hpp"
#include "backend/device_guard.hpp"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <optional>
#include <ostream>
#include <system_error>

#include "backend/device_guard.hpp"
#include "c10_peer.h"
#include "cucache/errors.hpp"
#include "replay_loop.hpp"

namespace cucache::replay {
namespace {

using detail::check_runtime;
using detail::throw_runtime_error;

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

std::size_t device_used_bytes() {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  check_runtime(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  return total_bytes - free_bytes;
}

// --- cudaMalloc / cudaFree --------------------------------------------------------------------

struct cuda_malloc_ops {
  void* allocate(std::size_t bytes, stream_handle /*stream*/) {
    void* p = nullptr;
    if (const cudaError_t e = cudaMalloc(&p, bytes); e != cudaSuccess) {
      if (e != cudaErrorMemoryAllocation) throw_runtime_error("cudaMalloc", e);
      detail::clear_expected_error(e);  // so a later, unrelated check does not report it again
      return nullptr;
    }
    return p;
  }
  void deallocate(void* p, stream_handle /*stream*/, bool /*other_stream*/) {
    check_runtime(cudaFree(p), "cudaFree");
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
               std::span<void*> slots) override {
    cuda_malloc_ops ops;
    std::fill(slots.begin(), slots.end(), nullptr);
    check_runtime(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const pass_result r = run_pass(trace, streams, slots, ops);
    free_leftovers(trace, streams, slots,
                   [&](void* p, stream_handle s) { ops.deallocate(p, s, false); });
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
    return {ns_per_op(r, trace), r.failed_allocations, *peak_};
  }

 private:
  std::optional<std::size_t> peak_;
};

// --- cudaMallocAsync on a dedicated pool -------------------------------------------------------

struct async_ops {
  cudaMemPool_t pool = nullptr;
  void* allocate(std::size_t bytes, stream_handle stream) {
    void* p = nullptr;
    if (const cudaError_t e =
            cudaMallocFromPoolAsync(&p, bytes, pool, static_cast<cudaStream_t>(stream));
        e != cudaSuccess) {
      if (e != cudaErrorMemoryAllocation) throw_runtime_error("cudaMallocFromPoolAsync", e);
      detail::clear_expected_error(e);
      return nullptr;
    }
    return p;
  }
  void deallocate(void* p, stream_handle stream, bool /*other_stream*/) {
    // The free's own stream: reuse then follows that stream's order, as cudaFreeAsync promises.
    check_runtime(cudaFreeAsync(p, static_cast<cudaStream_t>(stream)), "cudaFreeAsync");
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
               std::span<void*> slots) override {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = 0;
    props.maxSize = max_pool_bytes_;  // 0: the driver's default (no cap of ours)
    async_ops ops;
    check_runtime(cudaMemPoolCreate(&ops.pool, &props), "cudaMemPoolCreate");
    struct pool_guard {
      cudaMemPool_t pool;
      ~pool_guard() {
        (void)cudaDeviceSynchronize();
        (void)cudaMemPoolDestroy(pool);
      }
    } guard{ops.pool};
    // The default threshold (0) trims the pool at every synchronization; a caching allocator
    // keeps its memory, so compare like with like.
    std::uint64_t threshold = std::numeric_limits<std::uint64_t>::max();
    check_runtime(cudaMemPoolSetAttribute(ops.pool, cudaMemPoolAttrReleaseThreshold, &threshold),
                  "cudaMemPoolSetAttribute(ReleaseThreshold)");
    std::fill(slots.begin(), slots.end(), nullptr);
    check_runtime(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const pass_result r = run_pass(trace, streams, slots, ops);
    free_leftovers(trace, streams, slots,
                   [&](void* p, stream_handle s) { ops.deallocate(p, s, false); });
    check_runtime(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    std::uint64_t high = 0;
    check_runtime(cudaMemPoolGetAttribute(ops.pool, cudaMemPoolAttrReservedMemHigh, &high),
                  "cudaMemPoolGetAttribute(ReservedMemHigh)");
    return {ns_per_op(r, trace), r.failed_allocations, static_cast<std::size_t>(high)};
  }

 private:
  std::size_t max_pool_bytes_;
};

// --- PyTorch's caching allocator through libcucache_c10_peer.so -------------------------------

struct c10_api {
  cucache_peer_c10_init_fn init = nullptr;
  cucache_peer_c10_alloc_fn alloc = nullptr;
  cucache_peer_c10_free_fn free = nullptr;
  cucache_peer_c10_set_memory_fraction_fn set_memory_fraction = nullptr;
  cucache_peer_c10_stats_fn stats = nullptr;
  cucache_peer_c10_reset_fn reset = nullptr;
  cucache_peer_c10_last_error_fn last_error = nullptr;
};

struct c10_ops {
  const c10_api* api;
  void* allocate(std::size_t bytes, stream_handle stream) { return api->alloc(bytes, stream); }
  void deallocate(void* p, stream_handle /*stream*/, bool /*other_stream*/) { api->free(p); }
};

std::filesystem::path c10_library_path() {
  if (const char* env = std::getenv("CUCACHE_C10_PEER"); env != nullptr && env[0] != '\0') {
    return env;
  }
  std::error_code ec;
  const auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "libcucache_c10_peer.so";
  return exe.parent_path() / "libcucache_c10_peer.so";
}

template <class Fn>
Fn symbol(void* lib, const char* name) {
  void* p = dlsym(lib, name);
  if (p == nullptr) throw error(fmt::format("c10 peer: the shim lacks {}", name));
  return reinterpret_cast<Fn>(p);
}

class c10_peer final : public peer {
 public:
  explicit c10_peer(const options& opts) {
    // c10's global state lives as long as the process: one peer per process, never unloaded.
    static bool created = false;
    if (created) throw error("c10 peer: only one per process");
    const auto path = c10_library_path();
    if (!std::filesystem::exists(path)) {
      throw error(fmt::format(
          "c10 peer: {} not found (build it with tools/build_c10_peer.sh on a machine with "
          "torch, or set CUCACHE_C10_PEER)",
          path.string()));
    }
    // c10 reads its settings from the environment when it loads, so set them first: the peer
    // runs with the settings cucache runs with, whatever the caller's environment says.
    const std::string conf = c10_settings(opts.cfg);
    if (conf.empty()) {
      ::unsetenv("PYTORCH_CUDA_ALLOC_CONF");
    } else {
      ::setenv("PYTORCH_CUDA_ALLOC_CONF", conf.c_str(), 1);
    }
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr)
      throw error(fmt::format("c10 peer: dlopen {}: {}", path.string(), dlerror()));
    created = true;
    const auto abi = symbol<cucache_peer_c10_abi_fn>(lib, "cucache_peer_c10_abi");
    if (abi() != CUCACHE_C10_PEER_ABI) {
      throw error(fmt::format("c10 peer: {} has interface version {}, expected {}; rebuild it",
                              path.string(), abi(), CUCACHE_C10_PEER_ABI));
    }
    api_.init = symbol<cucache_peer_c10_init_fn>(lib, "cucache_peer_c10_init");
    api_.alloc = symbol<cucache_peer_c10_alloc_fn>(lib, "cucache_peer_c10_alloc");
    api_.free = symbol<cucache_peer_c10_free_fn>(lib, "cucache_peer_c10_free");
    api_.set_memory_fraction = symbol<cucache_peer_c10_set_memory_fraction_fn>(
        lib, "cucache_peer_c10_set_memory_fraction");
    api_.stats = symbol<cucache_peer_c10_stats_fn>(lib, "cucache_peer_c10_stats");
    api_.reset = symbol<cucache_peer_c10_reset_fn>(lib, "cucache_peer_c10_reset");
    api_.last_error = symbol<cucache_peer_c10_last_error_fn>(lib, "cucache_peer_c10_last_error");
    if (api_.init(conf.c_str()) != 0) fail("init");

    // c10 takes its cap as a fraction of the device: the lower of --config's memory_fraction
    // and --capacity-gib.
    double fraction = opts.cfg.memory_fraction > 0.0 ? opts.cfg.memory_fraction : 1.0;
    if (opts.capacity_bytes) {
      std::size_t free_bytes = 0;
      std::size_t total_bytes = 0;
      check_runtime(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
      fraction = std::min(
          fraction, static_cast<double>(*opts.capacity_bytes) / static_cast<double>(total_bytes));
    }
    if (fraction < 1.0 && api_.set_memory_fraction(fraction) != 0) fail("set_memory_fraction");
  }

  [[nodiscard]] std::string name() const override { return "c10"; }
  [[nodiscard]] std::string peak_source() const override {
    return "c10 DeviceStats reserved_bytes[all].peak";
  }

  peer_run run(const prepared_trace& trace, std::span<const stream_handle> streams,
               std::span<void*> slots) override {
    if (api_.reset() != 0) fail("reset");
    std::fill(slots.begin(), slots.end(), nullptr);
    check_runtime(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    c10_ops ops{&api_};
    const pass_result r = run_pass(trace, streams, slots, ops);
    free_leftovers(trace, streams, slots,
                   [&](void* p, stream_handle s) { ops.deallocate(p, s, false); });
    cucache_c10_stats s{};
    if (api_.stats(&s) != 0) fail("stats");
    if (r.failed_allocations > static_cast<std::uint64_t>(s.num_ooms)) {
      fail("an allocation failed for a reason other than out-of-memory");
    }
    if (api_.reset() != 0) fail("reset");
    return {ns_per_op(r, trace), r.failed_allocations,
            static_cast<std::size_t>(s.peak_reserved_bytes)};
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    throw error(fmt::format("c10 peer: {} failed: {}", what, api_.last_error()));
  }

  c10_api api_;
};

std::unique_ptr<peer> make_peer(const std::string& name, const options& opts) {
  if (name == "cudaMalloc") return std::make_unique<cuda_malloc_peer>();
  if (name == "cudaMallocAsync")
    return std::make_unique<async_peer>(opts.capacity_bytes.value_or(0));
  if (name == "c10") return std::make_unique<c10_peer>(opts);
  throw error(fmt::format("unknown peer '{}' (accepted: cudaMalloc, cudaMallocAsync, c10)", name));
}

}  // namespace

std::vector<std::unique_ptr<peer>> make_peers(std::span<const std::string> names, bool requested,
                                              const options& opts, std::ostream& err) {
  std::vector<std::unique_ptr<peer>> peers;
  for (const std::string& name : names) {
    if (std::find(std::begin(k_peer_names), std::end(k_peer_names), name) ==
        std::end(k_peer_names)) {
      throw error(
          fmt::format("unknown peer '{}' (accepted: cudaMalloc, cudaMallocAsync, c10)", name));
    }
    try {
      peers.push_back(make_peer(name, opts));
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
        check_runtime(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
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
  config shared = cfg;
  shared.memory_limit_bytes = 0;
  shared.memory_fraction = 0.0;
  shared.trace_path.clear();
  return to_string(shared);
}

}  // namespace cucache::replay
