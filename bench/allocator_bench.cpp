// Google Benchmark figures for cucache against its peers: cache-hit alloc+free pairs by size,
// random churn over many live blocks, and thread scaling with one stream per thread. Each benchmark
// runs for every allocator available here: cucache on the simulated device (host cost only),
// cucache on the GPU, cudaMalloc, cudaMallocAsync and PyTorch's c10 allocator (dlopen'd shim).
#include <benchmark/benchmark.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "churn_plan.hpp"
#include "common/c10_loader.hpp"
#include "common/child_process.hpp"
#include "common/cuda_check.hpp"
#include "common/device_peers.hpp"
#include "cucache/backend_factory.hpp"
#include "cucache/cucache.hpp"
#include "cucache/cuda_backend.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/observe.hpp"
#include "cucache/stats.hpp"
#include "scatter_plan.hpp"

namespace cucache::bench {
namespace {

// --- definitions shared by every allocator ---------------------------------------------------

constexpr std::size_t k_kib = std::size_t{1} << 10;
constexpr std::size_t k_mib = std::size_t{1} << 20;

struct pair_size {
  std::size_t bytes;
  const char* label;
};
constexpr std::array<pair_size, 7> k_pair_sizes{{{512, "512B"},
                                                 {4 * k_kib, "4KiB"},
                                                 {64 * k_kib, "64KiB"},
                                                 {1 * k_mib, "1MiB"},
                                                 {8 * k_mib, "8MiB"},
                                                 {64 * k_mib, "64MiB"},
                                                 {512 * k_mib, "512MiB"}}};

/// The thread-scaling benchmark: 64 KiB pairs, each thread on its own stream.
constexpr std::size_t k_thread_pair_bytes = 64 * k_kib;
constexpr std::array<int, 5> k_thread_counts{1, 2, 4, 8, 16};
constexpr int k_max_threads = 16;

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

double per(std::int64_t ns, double count) {
  return count > 0 ? static_cast<double>(ns) / count : 0.0;
}

using tools::check_cuda;

/// An allocator that returned no memory: a benchmark cannot go on without its block.
void* require(void* ptr, const char* allocator, std::size_t bytes) {
  if (ptr == nullptr) {
    throw std::runtime_error(std::string(allocator) + ": out of memory allocating " +
                             std::to_string(bytes) + " bytes");
  }
  return ptr;
}

// --- streams ------------------------------------------------------------------------------------

/// Stream i of the simulated device: a distinct non-null handle that is never dereferenced.
stream_handle sim_stream(int index) {
  return reinterpret_cast<stream_handle>(
      std::uintptr_t{0x5000} + std::uintptr_t{0x100} * static_cast<std::uintptr_t>(index));
}

/// Non-blocking GPU streams, one per benchmark thread (stream 0 serves the one-thread benchmarks),
/// made once in main so that every GPU allocator sees the same handles.
std::array<cudaStream_t, k_max_threads> g_gpu_streams{};

stream_handle gpu_stream(int index) {
  return g_gpu_streams[static_cast<std::size_t>(index)];
}

void make_gpu_streams() {
  check_cuda(cudaSetDevice(0), "cudaSetDevice");
  for (auto& s : g_gpu_streams) {
    check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  }
}

void destroy_gpu_streams() noexcept {
  for (auto& s : g_gpu_streams) {
    // The bench is the front end of its allocators: it announces its stream destructions.
    device_allocator::announce_stream_destruction();
    if (s != nullptr) static_cast<void>(cudaStreamDestroy(s));
    s = nullptr;
  }
}

/// The memory counters of allocators with statistics (cucache; c10 when its shim exports them):
/// current and peak reserved bytes, allocated bytes and device allocation calls.
void set_memory_counters(benchmark::State& state, double reserved, double reserved_peak,
                         double allocated, double device_allocs) {
  state.counters["reserved_bytes"] = reserved;
  state.counters["reserved_peak_bytes"] = reserved_peak;
  state.counters["allocated_bytes"] = allocated;
  state.counters["device_allocs"] = device_allocs;
}

// --- the allocators -----------------------------------------------------------------------------
//
// Each is a small class: constructing one makes a fresh instance (an empty cache where the
// allocator has one), allocate/deallocate act on a stream, stream(i) names stream i, synchronize()
// waits for the device. Every one is thread-safe, so the thread benchmark shares one instance.

/// cucache over a device backend: on the simulated device (host cost only) or on GPU 0, in
/// default mode or with expandable segments; `announced`: in the captures-announced mode (no
/// capture query per allocation; docs/design.md, "Announced captures"), the torch extension's;
/// `streams`: with stream destructions announced too (the thread's cached stream id, no id query;
/// "Announced stream destructions"), what the LD_PRELOAD shim offers with
/// CUCACHE_PRELOAD_STREAMS=announced. The bench announces its own destructions. `defer`: with
/// defer_coalescing:True (both announced: the pair the setting is for), in either mode.
template <bool gpu, bool expandable = false, bool announced = false, bool streams = false,
          bool defer = false>
class cucache_alloc {
 public:
  static_assert(!defer || streams, "defer is measured with both announced only");
  static constexpr const char* k_name =
      defer ? (gpu ? (expandable ? "cucache_cuda_expandable_streams_announced_defer"
                                 : "cucache_cuda_streams_announced_defer")
                   : (expandable ? "cucache_sim_expandable_streams_announced_defer"
                                 : "cucache_sim_streams_announced_defer"))
      : streams ? (gpu ? (expandable ? "cucache_cuda_expandable_streams_announced"
                                     : "cucache_cuda_streams_announced")
                       : (expandable ? "cucache_sim_expandable_streams_announced"
                                     : "cucache_sim_streams_announced"))
      : announced
          ? (gpu ? (expandable ? "cucache_cuda_expandable_announced" : "cucache_cuda_announced")
                 : (expandable ? "cucache_sim_expandable_announced" : "cucache_sim_announced"))
      : gpu ? (expandable ? "cucache_cuda_expandable" : "cucache_cuda")
            : (expandable ? "cucache_sim_expandable" : "cucache_sim");

  cucache_alloc()
      : alloc_(make_backend(gpu ? backend_kind::cuda : backend_kind::sim, 0), make_config()) {
    alloc_.set_captures_announced(announced || streams);
    alloc_.set_stream_destructions_announced(streams);
  }
  static config make_config() {
    config c;
    c.expandable_segments = expandable;
    c.defer_coalescing = defer;
    return c;
  }
  void* allocate(std::size_t bytes, stream_handle stream) { return alloc_.allocate(bytes, stream); }
  void deallocate(void* ptr, stream_handle /*stream*/) { alloc_.deallocate(ptr); }
  static stream_handle stream(int index) { return gpu ? gpu_stream(index) : sim_stream(index); }
  void synchronize() {
    if constexpr (gpu) check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  void add_counters(benchmark::State& state) const {
    const device_stats s = alloc_.stats();
    set_memory_counters(state, static_cast<double>(s.reserved_bytes[0].current),
                        static_cast<double>(s.reserved_bytes[0].peak),
                        static_cast<double>(s.allocated_bytes[0].current),
                        static_cast<double>(s.device_alloc_count));
  }

 private:
  device_allocator alloc_;
};

/// cudaMalloc/cudaFree: no cache, the floor every caching allocator is measured against.
class cuda_malloc_alloc {
 public:
  static constexpr const char* k_name = "cudaMalloc";

  void* allocate(std::size_t bytes, stream_handle /*stream*/) {
    return require(device_.allocate(bytes), k_name, bytes);
  }
  void deallocate(void* ptr, stream_handle /*stream*/) { device_.deallocate(ptr); }
  static stream_handle stream(int index) { return gpu_stream(index); }
  void synchronize() { check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }
  void add_counters(benchmark::State& /*state*/) const {}

 private:
  tools::cuda_malloc_device device_;
};

/// CUDA's stream-ordered allocator on a pool of its own whose release threshold is UINT64_MAX, so
/// it keeps what it has (the default threshold 0 trims the pool at every synchronize).
class cuda_malloc_async_alloc {
 public:
  static constexpr const char* k_name = "cudaMallocAsync";

  void* allocate(std::size_t bytes, stream_handle stream) {
    return require(pool_.allocate(bytes, stream), k_name, bytes);
  }
  void deallocate(void* ptr, stream_handle stream) { pool_.deallocate(ptr, stream); }
  static stream_handle stream(int index) { return gpu_stream(index); }
  void synchronize() { check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }
  void add_counters(benchmark::State& /*state*/) const {}

 private:
  tools::cuda_async_pool pool_{0};
};

/// The c10 peer shim (tools/common/c10_loader.hpp), loaded once in run() when a GPU is usable.
const tools::c10_peer_library* g_c10 = nullptr;

/// PyTorch's caching allocator through the peer shim. Its cache is process-wide; a fresh instance
/// empties it (cucache_peer_c10_reset), so every run starts as the others do.
class c10_alloc {
 public:
  static constexpr const char* k_name = "c10";

  c10_alloc() { g_c10->reset(); }
  void* allocate(std::size_t bytes, stream_handle stream) {
    void* ptr = g_c10->allocate(bytes, stream);
    if (ptr == nullptr) {
      throw std::runtime_error("cucache_peer_c10_alloc failed: " + g_c10->last_error());
    }
    return ptr;
  }
  void deallocate(void* ptr, stream_handle /*stream*/) { g_c10->deallocate(ptr); }
  static stream_handle stream(int index) { return gpu_stream(index); }
  void synchronize() { check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); }
  void add_counters(benchmark::State& state) const {
    const cucache_c10_stats s = g_c10->stats();
    set_memory_counters(
        state, static_cast<double>(s.reserved_bytes), static_cast<double>(s.peak_reserved_bytes),
        static_cast<double>(s.allocated_bytes), static_cast<double>(s.num_device_alloc));
  }
};

// --- pair: one size, cache hit ------------------------------------------------------------------

/// One alloc+free pair per iteration on stream 0 (a created, non-blocking stream on the GPU), or
/// with `legacy` on the legacy default stream (nullptr: PyTorch's default stream, the one
/// stream cucache asks the driver nothing about), after one untimed pair has warmed the cache.
template <class A>
void bm_pair(benchmark::State& state, std::size_t bytes, bool legacy) {
  try {
    A alloc;
    const stream_handle stream = legacy ? nullptr : A::stream(0);
    alloc.deallocate(alloc.allocate(bytes, stream), stream);
    const std::int64_t start = now_ns();
    for (auto _ : state) {
      void* ptr = alloc.allocate(bytes, stream);
      benchmark::DoNotOptimize(ptr);
      alloc.deallocate(ptr, stream);
    }
    const std::int64_t stop = now_ns();
    alloc.synchronize();
    state.counters["bytes"] = static_cast<double>(bytes);
    state.counters["ns_per_pair"] = per(stop - start, static_cast<double>(state.iterations()));
    alloc.add_counters(state);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

// --- scatter: thousands of free blocks of one size, each between live ones ---------------------

/// One iteration: 2N blocks of 512 B allocated (untimed), every other one freed in scatter_plan's
/// order (timed: N free blocks of one size, none next to another, so nothing merges), the N
/// allocated again (timed), then everything freed (untimed). ns_per_free and ns_per_alloc: the two
/// timed phases over all iterations.
template <class A>
void bm_scatter(benchmark::State& state, int count) {
  try {
    A alloc;
    const stream_handle stream = A::stream(0);
    const std::vector<std::size_t> order = scatter_free_order(static_cast<std::size_t>(count));
    std::vector<void*> live(2 * order.size());
    auto allocate = [&](void*& p) {
      p = require(alloc.allocate(k_scatter_bytes, stream), A::k_name, k_scatter_bytes);
    };
    std::int64_t free_ns = 0;
    std::int64_t alloc_ns = 0;
    for (auto _ : state) {
      for (void*& p : live) allocate(p);
      const std::int64_t t0 = now_ns();
      for (std::size_t k : order) alloc.deallocate(live[k], stream);
      const std::int64_t t1 = now_ns();
      for (std::size_t k : order) allocate(live[k]);
      const std::int64_t t2 = now_ns();
      free_ns += t1 - t0;
      alloc_ns += t2 - t1;
      state.SetIterationTime(static_cast<double>(t2 - t0) * 1e-9);
      for (void* p : live) alloc.deallocate(p, stream);
    }
    alloc.synchronize();
    const double ops = static_cast<double>(state.iterations()) * static_cast<double>(order.size());
    state.counters["ns_per_free"] = per(free_ns, ops);
    state.counters["ns_per_alloc"] = per(alloc_ns, ops);
    alloc.add_counters(state);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

// --- churn: many live blocks, free a random one and allocate a new one --------------------------

template <class A>
void bm_churn(benchmark::State& state, const churn_plan* plan) {
  try {
    A alloc;
    const stream_handle stream = A::stream(0);
    std::vector<void*> live;
    live.reserve(plan->initial.size());
    for (std::uint32_t bytes : plan->initial) live.push_back(alloc.allocate(bytes, stream));
    const std::size_t mask = plan->ops.size() - 1;
    std::size_t pos = 0;
    auto step = [&] {
      const churn_plan::op& op = plan->ops[pos++ & mask];
      void*& ptr = live[op.slot];
      alloc.deallocate(ptr, stream);
      ptr = alloc.allocate(op.bytes, stream);
    };
    // Two untimed operations per live block bring the cache near its steady state.
    for (std::size_t i = 0; i < 2 * live.size(); ++i) step();
    const std::int64_t start = now_ns();
    for (auto _ : state) step();
    const std::int64_t stop = now_ns();
    state.counters["live_blocks"] = static_cast<double>(live.size());
    state.counters["ns_per_op"] = per(stop - start, static_cast<double>(state.iterations()));
    alloc.add_counters(state);
    for (void* ptr : live) alloc.deallocate(ptr, stream);
    alloc.synchronize();
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

// --- threads: one stream per thread, 64 KiB pairs -----------------------------------------------

/// The allocator the threads of one run share: made by Setup before the threads start, destroyed
/// by Teardown after they end (Google Benchmark runs both on the main thread).
template <class A>
std::unique_ptr<A> g_shared;
template <class A>
std::string g_shared_error;

template <class A>
void threads_setup(const benchmark::State& /*state*/) {
  g_shared_error<A>.clear();
  try {
    g_shared<A> = std::make_unique<A>();
  } catch (const std::exception& e) {
    g_shared_error<A> = e.what();
  }
}

template <class A>
void threads_teardown(const benchmark::State& /*state*/) {
  if (!g_shared<A>) return;
  try {
    g_shared<A>->synchronize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cucache-bench: %s: %s\n", A::k_name, e.what());
  }
  g_shared<A>.reset();
}

/// `shared`: every thread on stream 0 (one pool, one lock), else each on its own stream.
template <class A>
void bm_threads(benchmark::State& state, bool shared) {
  A* alloc = g_shared<A>.get();
  if (alloc == nullptr) {
    state.SkipWithError(("allocator setup failed: " + g_shared_error<A>).c_str());
    return;
  }
  try {
    const stream_handle stream = A::stream(shared ? 0 : state.thread_index());
    alloc->deallocate(alloc->allocate(k_thread_pair_bytes, stream), stream);
    // Timed from the first iteration: the start barrier lies between the setup and it.
    std::int64_t start = 0;
    for (auto _ : state) {
      if (start == 0) [[unlikely]]
        start = now_ns();
      void* ptr = alloc->allocate(k_thread_pair_bytes, stream);
      benchmark::DoNotOptimize(ptr);
      alloc->deallocate(ptr, stream);
    }
    const std::int64_t stop = now_ns();
    // Each thread's wall time over the pairs of all threads; Google Benchmark sums counters over
    // threads, kAvgThreads turns the sum back into the mean.
    const double all_pairs = static_cast<double>(state.iterations()) * state.threads();
    state.counters["ns_per_pair"] =
        benchmark::Counter(per(stop - start, all_pairs), benchmark::Counter::kAvgThreads);
    if (state.thread_index() == 0) {
      state.counters["bytes"] = static_cast<double>(k_thread_pair_bytes);
      alloc->add_counters(state);
    }
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

// --- pending: pairs while thousands of frees wait on a busy stream (cucache_sim only) -----------

/// One 512 B alloc+free pair per iteration on stream 0 while `pending` earlier frees (4 KiB blocks
/// used on stream 1 by record_stream) wait for events on stream 1, which never completes: a long
/// kernel, a stalled copy. Every allocation polls the pool's pending frees. On the simulated
/// device only: its events complete only when told to, so the count stays exact.
void bm_pending(benchmark::State& state, int pending) {
  try {
    auto sim = std::make_shared<sim_backend>();
    device_allocator alloc(sim);
    const stream_handle own = sim_stream(0);
    const stream_handle busy = sim_stream(1);
    for (int i = 0; i < pending; ++i) {
      void* p = alloc.allocate(4 * k_kib, own);
      alloc.record_stream(p, busy);
      alloc.deallocate(p);
    }
    alloc.deallocate(alloc.allocate(512, own));
    const std::uint64_t queries = sim->calls(sim_call::event_query);
    const std::int64_t start = now_ns();
    for (auto _ : state) {
      void* ptr = alloc.allocate(512, own);
      benchmark::DoNotOptimize(ptr);
      alloc.deallocate(ptr);
    }
    const std::int64_t stop = now_ns();
    const auto iterations = static_cast<double>(state.iterations());
    const device_stats s = alloc.stats();
    state.counters["pending_frees"] = static_cast<double>(s.events_pending);
    state.counters["ns_per_pair"] = per(stop - start, iterations);
    state.counters["event_queries_per_pair"] =
        iterations > 0
            ? static_cast<double>(sim->calls(sim_call::event_query) - queries) / iterations
            : 0.0;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void register_pending() {
  for (int pending : {0, 100, 10'000}) {
    const std::string name = "pending_frees/cucache_sim/" + std::to_string(pending);
    benchmark::RegisterBenchmark(name.c_str(), bm_pending, pending);
  }
}

// --- stats() with many pools: the cost of what changed, not of every pool -------------------
//
// `pools` streams each hold a block of their own pool (expandable mode, so that every pool's
// largest cached request is a dry run of its pages); the loop frees and allocates on one of them
// and then takes stats(): the ledger summarizes that pool again, not all of them
// (docs/design.md, "What a stream costs").
void bm_stats(benchmark::State& state, int pools) {
  try {
    auto sim = std::make_shared<sim_backend>();
    config cfg;
    cfg.expandable_segments = true;
    device_allocator alloc(sim, cfg);
    std::vector<stream_handle> streams;
    std::vector<void*> held;
    for (int i = 0; i < pools; ++i) {
      streams.push_back(sim->create_stream());
      held.push_back(alloc.allocate(8 * k_kib, streams.back()));
      alloc.deallocate(alloc.allocate(4 * k_mib, streams.back()), streams.back());  // cached
    }
    (void)alloc.stats();
    const stream_handle own = streams.front();
    const std::int64_t start = now_ns();
    for (auto _ : state) {
      void* ptr = alloc.allocate(4 * k_mib, own);
      alloc.deallocate(ptr, own);
      const device_stats s = alloc.stats();
      benchmark::DoNotOptimize(s.largest_free_block);
    }
    const std::int64_t stop = now_ns();
    state.counters["ns_per_pair_and_stats"] =
        per(stop - start, static_cast<double>(state.iterations()));
    for (std::size_t i = 0; i < held.size(); ++i) alloc.deallocate(held[i], streams[i]);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

// --- stats() with roundup_power2_divisions in expandable mode (issue 30, item 8) --------------
//
// One stream holds 24 blocks from 40 MiB to 1.5 GiB with every other one freed: free spans of
// mapped pages, whose largest cached request the pager's dry run looks for page by page, asking
// the size policy for the largest rounded size within each page boundary. The loop changes the
// pool (a 4 MiB pair) and takes stats(), so that the pool is summarized again every time.
void bm_stats_divisions(benchmark::State& state, const char* conf) {
  try {
    auto sim = std::make_shared<sim_backend>();
    device_allocator alloc(sim, parse_config(conf));
    const stream_handle s = sim->create_stream();
    std::vector<void*> held;
    for (int i = 0; i < 24; ++i) {
      held.push_back(alloc.allocate((40 + static_cast<std::size_t>(i) * 64) * k_mib, s));
    }
    for (std::size_t i = 0; i < held.size(); i += 2) {
      alloc.deallocate(held[i], s);
      held[i] = nullptr;
    }
    (void)alloc.stats();
    const std::int64_t start = now_ns();
    for (auto _ : state) {
      alloc.deallocate(alloc.allocate(4 * k_mib, s), s);
      const device_stats st = alloc.stats();
      benchmark::DoNotOptimize(st.largest_free_block);
    }
    const std::int64_t stop = now_ns();
    state.counters["ns_per_pair_and_stats"] =
        per(stop - start, static_cast<double>(state.iterations()));
    for (void* p : held) {
      if (p != nullptr) alloc.deallocate(p, s);
    }
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void register_stats() {
  for (int pools : {1, 100, 10'000}) {
    const std::string name = "stats_many_pools/cucache_sim/" + std::to_string(pools);
    benchmark::RegisterBenchmark(name.c_str(), bm_stats, pools);
  }
  benchmark::RegisterBenchmark("stats_divisions/cucache_sim/expandable", bm_stats_divisions,
                               "expandable_segments:True");
  benchmark::RegisterBenchmark("stats_divisions/cucache_sim/expandable_divisions4",
                               bm_stats_divisions,
                               "expandable_segments:True,roundup_power2_divisions:4");
}

// --- stream queries: what an allocation on a stream asks the device (GPU only) ----------------
//
// Every allocation on a stream other than the legacy default one asks for the stream's capture
// status and its id (docs/design.md, "Streams that die", "Graph capture"). These cases time each
// candidate call alone, the runtime's wrapper and the driver's entry point (looked up the way
// cuda_backend does, cudaGetDriverEntryPointByVersion), and the backend's combined query
// (device_backend::identify), one thread and 8 and 16 threads each on a stream of its own: one
// H200 run decides which calls the hot path should make. cuCtxGetCurrent is the floor: the
// cheapest driver call there is (no stream to look at).

enum class stream_call : std::uint8_t {
  runtime_get_capture_info,  ///< cudaStreamGetCaptureInfo
  runtime_is_capturing,      ///< cudaStreamIsCapturing
  runtime_get_id,            ///< cudaStreamGetId
  runtime_query,             ///< cudaStreamQuery
  driver_get_capture_info,   ///< cuStreamGetCaptureInfo (ABI 12000: its second version)
  driver_is_capturing,       ///< cuStreamIsCapturing
  driver_get_id,             ///< cuStreamGetId
  driver_query,              ///< cuStreamQuery
  driver_ctx_get_current,    ///< cuCtxGetCurrent: the floor of a driver call
  backend_capture_status,    ///< cuda_backend::capture_status
  backend_stream_id,         ///< cuda_backend::stream_id
  backend_identify,          ///< cuda_backend::identify: capture status + id, what allocate asks
};

struct driver_stream_calls {
  PFN_cuStreamGetCaptureInfo_v11030 get_capture_info = nullptr;
  PFN_cuStreamIsCapturing_v10000 is_capturing = nullptr;
  PFN_cuStreamGetId_v12000 get_id = nullptr;
  PFN_cuStreamQuery_v2000 query = nullptr;
  PFN_cuCtxGetCurrent_v4000 ctx_get_current = nullptr;
};

template <typename Fn>
void resolve_driver(const char* symbol, Fn& fn) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  check_cuda(cudaGetDriverEntryPointByVersion(symbol, &address, 12000, cudaEnableDefault, &status),
             symbol);
  if (status != cudaDriverEntryPointSuccess || address == nullptr) {
    throw std::runtime_error(std::string("the driver has no ") + symbol);
  }
  fn = reinterpret_cast<Fn>(address);
}

const driver_stream_calls& driver_calls() {
  static const driver_stream_calls calls = [] {
    driver_stream_calls c;
    resolve_driver("cuStreamGetCaptureInfo", c.get_capture_info);
    resolve_driver("cuStreamIsCapturing", c.is_capturing);
    resolve_driver("cuStreamGetId", c.get_id);
    resolve_driver("cuStreamQuery", c.query);
    resolve_driver("cuCtxGetCurrent", c.ctx_get_current);
    return c;
  }();
  return calls;
}

/// One call of `which` on `s`; returns something that depends on the answer.
std::uint64_t stream_call_once(stream_call which, cudaStream_t s, device_backend& backend,
                               const driver_stream_calls& d) {
  const auto cu = static_cast<CUstream>(s);
  switch (which) {
    case stream_call::runtime_get_capture_info: {
      cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
      unsigned long long id = 0;
      return static_cast<std::uint64_t>(cudaStreamGetCaptureInfo(s, &st, &id)) + st + id;
    }
    case stream_call::runtime_is_capturing: {
      cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
      return static_cast<std::uint64_t>(cudaStreamIsCapturing(s, &st)) + st;
    }
    case stream_call::runtime_get_id: {
      unsigned long long id = 0;
      return static_cast<std::uint64_t>(cudaStreamGetId(s, &id)) + id;
    }
    case stream_call::runtime_query:
      return static_cast<std::uint64_t>(cudaStreamQuery(s));
    case stream_call::driver_get_capture_info: {
      CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
      cuuint64_t id = 0;
      return static_cast<std::uint64_t>(
                 d.get_capture_info(cu, &st, &id, nullptr, nullptr, nullptr)) +
             st + id;
    }
    case stream_call::driver_is_capturing: {
      CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
      return static_cast<std::uint64_t>(d.is_capturing(cu, &st)) + st;
    }
    case stream_call::driver_get_id: {
      unsigned long long id = 0;
      return static_cast<std::uint64_t>(d.get_id(cu, &id)) + id;
    }
    case stream_call::driver_query:
      return static_cast<std::uint64_t>(d.query(cu));
    case stream_call::driver_ctx_get_current: {
      CUcontext ctx = nullptr;
      return static_cast<std::uint64_t>(d.ctx_get_current(&ctx)) +
             reinterpret_cast<std::uintptr_t>(ctx);
    }
    case stream_call::backend_capture_status:
      return backend.capture_status(s).id;
    case stream_call::backend_stream_id:
      return backend.stream_id(s);
    case stream_call::backend_identify:
      return backend.identify(s).id;
  }
  return 0;
}

/// One call per iteration on this thread's GPU stream (stream 0 for every thread when `shared`).
/// ns_per_query: wall time per call, the mean over the threads (with several threads each makes
/// its own calls at the same time).
void bm_stream_query(benchmark::State& state, stream_call which, bool shared) {
  try {
    // One for every case and thread (a function-local static: made once, by whichever thread
    // comes first).
    static const std::shared_ptr<device_backend> backend = make_backend(backend_kind::cuda, 0);
    const driver_stream_calls& d = driver_calls();
    const auto s = static_cast<cudaStream_t>(gpu_stream(shared ? 0 : state.thread_index()));
    std::uint64_t sink = 0;
    std::int64_t start = 0;
    for (auto _ : state) {
      if (start == 0) start = now_ns();  // after the threads' start barrier
      sink += stream_call_once(which, s, *backend, d);
    }
    const std::int64_t stop = now_ns();
    benchmark::DoNotOptimize(sink);
    state.counters["ns_per_query"] =
        benchmark::Counter(per(stop - start, static_cast<double>(state.iterations())),
                           benchmark::Counter::kAvgThreads);
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void register_stream_queries() {
  constexpr std::array<std::pair<stream_call, const char*>, 12> calls{{
      {stream_call::runtime_get_capture_info, "runtime/cudaStreamGetCaptureInfo"},
      {stream_call::runtime_is_capturing, "runtime/cudaStreamIsCapturing"},
      {stream_call::runtime_get_id, "runtime/cudaStreamGetId"},
      {stream_call::runtime_query, "runtime/cudaStreamQuery"},
      {stream_call::driver_get_capture_info, "driver/cuStreamGetCaptureInfo"},
      {stream_call::driver_is_capturing, "driver/cuStreamIsCapturing"},
      {stream_call::driver_get_id, "driver/cuStreamGetId"},
      {stream_call::driver_query, "driver/cuStreamQuery"},
      {stream_call::driver_ctx_get_current, "driver/cuCtxGetCurrent"},
      {stream_call::backend_capture_status, "cucache_cuda/capture_status"},
      {stream_call::backend_stream_id, "cucache_cuda/stream_id"},
      {stream_call::backend_identify, "cucache_cuda/identify"},
  }};
  for (const auto& [which, label] : calls) {
    const std::string name = std::string("stream_query/") + label;
    benchmark::RegisterBenchmark(name.c_str(), bm_stream_query, which, false)
        ->Threads(1)
        ->Threads(8)
        ->Threads(16)
        ->UseRealTime();
    // Every thread on stream 0, as threads_one_stream: does the driver serialize on a stream?
    const std::string shared = std::string("stream_query_one_stream/") + label;
    benchmark::RegisterBenchmark(shared.c_str(), bm_stream_query, which, true)
        ->Threads(8)
        ->UseRealTime();
  }
}

// --- observe: what tags and call stacks cost a pair (global API, simulated device) ---------------

/// The state the global API is in for one observe case.
enum class observe_case {
  off,         ///< no tag ever set, nothing observed: the allocator has no observer at all
  tag_popped,  ///< a tag was set and ended before: the observe hub listens, no tag is current
  tagged,      ///< inside a scoped_tag: every allocation is recorded under the tag
  backtraces,  ///< record_backtraces:True: every allocation's call stack is captured
};

/// Pairs each observe case times, in its child process.
constexpr std::size_t k_observe_pairs = 1'000'000;

/// One observe case: 64 KiB pairs through cucache::malloc/free on stream 0 of the simulated
/// device, in a child process of its own (tools::run_in_child), whose process registry is made
/// from the case's CUCACHE_CONF at its first call -- the registry takes its settings once per
/// process, and once a tag is set its observer stays. Returns ns per pair.
double observe_pairs(observe_case c) {
  const tools::child_answer answer = tools::run_in_child([c] {
    ::setenv("CUCACHE_BACKEND", "sim", 1);
    if (c == observe_case::backtraces) {
      ::setenv("CUCACHE_CONF", "record_backtraces:True", 1);
    } else {
      ::unsetenv("CUCACHE_CONF");
    }
    if (c == observe_case::tag_popped) {
      push_tag("bench");
      pop_tag();
    }
    std::optional<scoped_tag> tag;
    if (c == observe_case::tagged) tag.emplace("bench");
    const stream_handle stream = sim_stream(0);
    const std::size_t bytes = k_thread_pair_bytes;
    cucache::free(cucache::malloc(bytes, stream));
    const std::int64_t start = now_ns();
    for (std::size_t i = 0; i < k_observe_pairs; ++i) {
      void* ptr = cucache::malloc(bytes, stream);
      benchmark::DoNotOptimize(ptr);
      cucache::free(ptr);
    }
    const std::int64_t stop = now_ns();
    return std::to_string(per(stop - start, static_cast<double>(k_observe_pairs)));
  });
  if (!answer.ok) throw std::runtime_error(answer.error);
  return std::stod(answer.text);
}

/// One iteration = one child of k_observe_pairs pairs (manual time: the child's loop).
/// pair/cucache_sim/64KiB is the same pair on a bare device_allocator: the ratio of `off` to it
/// is what the global API with every observing feature off costs over no front end at all.
void bm_observe(benchmark::State& state, observe_case c) {
  try {
    double ns = 0.0;
    for (auto _ : state) {
      ns = observe_pairs(c);
      state.SetIterationTime(ns * static_cast<double>(k_observe_pairs) * 1e-9);
    }
    state.counters["bytes"] = static_cast<double>(k_thread_pair_bytes);
    state.counters["ns_per_pair"] = ns;
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

void register_observe() {
  constexpr std::array<std::pair<observe_case, const char*>, 4> cases{
      {{observe_case::off, "off"},
       {observe_case::tag_popped, "tag_popped"},
       {observe_case::tagged, "tagged"},
       {observe_case::backtraces, "backtraces"}}};
  for (const auto& [c, label] : cases) {
    const std::string name = std::string("observe/global_sim/") + label;
    benchmark::RegisterBenchmark(name.c_str(), bm_observe, c)->Iterations(1)->UseManualTime();
  }
}

// --- registration -------------------------------------------------------------------------------

template <class A>
void register_pairs() {
  // pair/: on a created stream (two stream queries per allocation on the GPU); pair_legacy/: on
  // the legacy default stream (none).
  for (const bool legacy : {false, true}) {
    for (const pair_size& size : k_pair_sizes) {
      const std::string name =
          std::string(legacy ? "pair_legacy/" : "pair/") + A::k_name + "/" + size.label;
      benchmark::RegisterBenchmark(name.c_str(), bm_pair<A>, size.bytes, legacy);
    }
  }
}

template <class A>
void register_churn() {
  benchmark::RegisterBenchmark((std::string("churn_small/") + A::k_name).c_str(), bm_churn<A>,
                               &small_churn_plan());
  benchmark::RegisterBenchmark((std::string("churn_large/") + A::k_name).c_str(), bm_churn<A>,
                               &large_churn_plan());
}

template <class A>
void register_scatter() {
  for (int count : k_scatter_counts) {
    const std::string name = std::string("scatter/") + A::k_name + "/" + std::to_string(count);
    benchmark::RegisterBenchmark(name.c_str(), bm_scatter<A>, count)->UseManualTime();
  }
}

template <class A>
void register_threads() {
  for (const bool shared : {false, true}) {
    const std::string name = std::string(shared ? "threads_one_stream/" : "threads/") + A::k_name;
    auto* b = benchmark::RegisterBenchmark(name.c_str(), bm_threads<A>, shared);
    for (int t : k_thread_counts) b->Threads(t);
    b->UseRealTime()->Setup(threads_setup<A>)->Teardown(threads_teardown<A>);
  }
}

struct allocator_entry {
  void (*pairs)();
  void (*churn)();
  void (*threads)();
  void (*scatter)();
};
template <class A>
constexpr allocator_entry entry_of() {
  return {register_pairs<A>, register_churn<A>, register_threads<A>, register_scatter<A>};
}
template <class A>
constexpr allocator_entry pairs_only() {
  return {register_pairs<A>, [] {}, [] {}, [] {}};
}

/// Loads the c10 peer shim with the PYTORCH_CUDA_ALLOC_CONF string of $CUCACHE_C10_CONF ("" =
/// c10's defaults) and records where it came from in the JSON context. Returns "" on success,
/// else why not.
std::string load_c10_peer() {
  const char* conf = std::getenv("CUCACHE_C10_CONF");
  try {
    g_c10 = &tools::load_c10_peer(conf != nullptr ? conf : "");
  } catch (const std::exception& e) {
    return e.what();
  }
  benchmark::AddCustomContext("c10_peer", g_c10->path().string());
  benchmark::AddCustomContext("c10_conf", g_c10->conf());
  return {};
}

int run(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;

  std::vector<allocator_entry> allocators{
      entry_of<cucache_alloc<false>>(), entry_of<cucache_alloc<false, true>>(),
      pairs_only<cucache_alloc<false, false, true, true, true>>(),
      pairs_only<cucache_alloc<false, true, true, true, true>>()};
  if (count_devices(backend_kind::cuda).count > 0) {
    try {
      make_gpu_streams();
      cudaDeviceProp prop{};
      check_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
      benchmark::AddCustomContext("cuda_device", prop.name);
      allocators.push_back(entry_of<cucache_alloc<true>>());
      allocators.push_back(entry_of<cucache_alloc<true, true>>());
      // The captures-announced mode changes the allocation's stream queries only: pairs.
      allocators.push_back(pairs_only<cucache_alloc<true, false, true>>());
      allocators.push_back(pairs_only<cucache_alloc<true, true, true>>());
      allocators.push_back(pairs_only<cucache_alloc<true, false, true, true>>());
      allocators.push_back(pairs_only<cucache_alloc<true, true, true, true>>());
      allocators.push_back(pairs_only<cucache_alloc<true, false, true, true, true>>());
      allocators.push_back(pairs_only<cucache_alloc<true, true, true, true, true>>());
      register_stream_queries();
      // No scatter case for cudaMalloc: nothing cached, so nothing to index.
      allocator_entry cuda_malloc = entry_of<cuda_malloc_alloc>();
      cuda_malloc.scatter = [] {};
      allocators.push_back(cuda_malloc);
      allocators.push_back(entry_of<cuda_malloc_async_alloc>());
      if (const std::string why = load_c10_peer(); why.empty()) {
        allocators.push_back(entry_of<c10_alloc>());
      } else {
        std::fprintf(stderr, "cucache-bench: c10 not registered: %s\n", why.c_str());
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "cucache-bench: GPU allocators not registered: %s\n", e.what());
    }
  } else {
    std::fprintf(stderr, "cucache-bench: GPU allocators not registered: %s\n",
                 cuda_unavailable_reason().c_str());
  }
  for (const auto& a : allocators) a.pairs();
  for (const auto& a : allocators) a.churn();
  for (const auto& a : allocators) a.threads();
  for (const auto& a : allocators) a.scatter();
  register_pending();
  register_stats();
  register_observe();

  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  destroy_gpu_streams();
  return 0;
}

}  // namespace
}  // namespace cucache::bench

int main(int argc, char** argv) {
  return cucache::bench::run(argc, argv);
}
