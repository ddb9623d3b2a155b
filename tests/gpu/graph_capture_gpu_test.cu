// CUDA graph capture through cucache on a real GPU (issue 11, item 4): a graph captured in global
// mode allocates, writes and frees through the allocator; it is instantiated and replayed 100
// times while other threads, each on its own stream, allocate, fill and free through the same
// allocator. Every replay's output is checked, no address of the graph's private pool is ever
// handed to another stream while the graph lives, the capture is never invalidated (cucache made
// no illegal call), and releasing the graph's pool gives its memory back. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cucache/config.hpp"
#include "cucache/cuda_backend.hpp"
#include "cucache/device_allocator.hpp"
#include "cucache/errors.hpp"
#include "cucache/stats.hpp"
#include "gpu/gpu_test_support.hpp"

namespace {

using cucache::device_allocator;
using cucache::graph_pool_id;

constexpr std::size_t k_elems = std::size_t{1} << 20;  // 4 MiB of int per buffer
constexpr std::size_t k_bytes = k_elems * sizeof(int);
constexpr int k_replays = 100;
constexpr int k_churn_threads = 3;
constexpr unsigned k_threads_per_block = 256;
constexpr unsigned k_grid = 1024;

// --- kernels: grid-stride loops over n ints ------------------------------------------------------

__global__ void plus_one(const int* in, int* out, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    out[i] = in[i] + 1;
  }
}
__global__ void times_three(const int* in, int* out, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    out[i] = in[i] * 3;
  }
}
__global__ void minus(const int* a, const int* b, int* out, std::size_t n) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    out[i] = a[i] - b[i];
  }
}
__global__ void fill_bytes(unsigned char* p, std::size_t n, unsigned char v) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    p[i] = v;
  }
}

struct range {
  std::uintptr_t begin;
  std::uintptr_t end;
  [[nodiscard]] bool overlaps(std::uintptr_t b, std::uintptr_t e) const noexcept {
    return b < end && begin < e;
  }
};

/// Allocates, fills and frees through `alloc` on a stream of its own until `stop`; records every
/// address range it was given. Returns the first error ("" if none).
std::string churn(device_allocator& alloc, const std::atomic<bool>& stop, unsigned seed,
                  std::vector<range>& seen) {
  cudaStream_t s = nullptr;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
    return "cudaStreamCreateWithFlags failed";
  }
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::size_t> size_of(512, 12 << 20);
  std::string error;
  std::uint64_t n = 0;
  while (!stop.load(std::memory_order_relaxed) && error.empty()) {
    const std::size_t bytes = size_of(rng);
    try {
      void* p = alloc.allocate(bytes, s);
      const auto b = reinterpret_cast<std::uintptr_t>(p);
      seen.push_back({b, b + bytes});
      fill_bytes<<<k_grid, k_threads_per_block, 0, s>>>(static_cast<unsigned char*>(p), bytes,
                                                        0xA5);
      if (cudaGetLastError() != cudaSuccess) error = "fill_bytes launch failed";
      alloc.deallocate(p);  // reusable at once on s, after the fill in stream order
    } catch (const std::exception& e) {
      error = std::string("churn: ") + e.what();
    }
    if (++n % 64 == 0 && cudaStreamSynchronize(s) != cudaSuccess) error = "churn sync failed";
  }
  if (cudaStreamSynchronize(s) != cudaSuccess && error.empty()) error = "churn sync failed";
  static_cast<void>(cudaStreamDestroy(s));
  return error;
}

class GraphCapture : public ::testing::TestWithParam<const char*> {};

/// Ends a capture a failed assertion left open, so that one failure does not make every later
/// test of the binary fail on "operation not permitted when stream is capturing".
struct capture_guard {
  cudaStream_t stream;
  bool armed = true;
  void dismiss() noexcept { armed = false; }  // the capture was ended (the stream may go)
  ~capture_guard() {
    if (!armed) return;
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &status) != cudaSuccess ||
        status == cudaStreamCaptureStatusNone) {
      static_cast<void>(cudaGetLastError());
      return;
    }
    cudaGraph_t graph = nullptr;
    if (cudaStreamEndCapture(stream, &graph) == cudaSuccess && graph != nullptr) {
      static_cast<void>(cudaGraphDestroy(graph));
    }
    static_cast<void>(cudaGetLastError());
  }
};

TEST_P(GraphCapture, CapturedAllocationsSurvive100ReplaysWhileOtherStreamsChurn) {
  CUCACHE_REQUIRE_GPU();
  device_allocator alloc(std::make_shared<cucache::cuda_backend>(0),
                         cucache::parse_config(GetParam()));
  cudaStream_t s = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // Input and output live outside cucache: the graph reads `in`, writes `out`.
  int* in = nullptr;
  int* out = nullptr;
  CUDA_CHECK(cudaMalloc(&in, k_bytes));
  CUDA_CHECK(cudaMalloc(&out, k_bytes));
  // Warm the stream's own pool, so the capture's private pool is seen not to take from it.
  void* warm = alloc.allocate(k_bytes, s);
  alloc.deallocate(warm);

  // --- capture: out = 3 (in + 1) - in = 2 in + 3, through three cucache buffers ----------------
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  capture_guard open_capture{s};
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long capture_id = 0;
  CUDA_CHECK(cudaStreamGetCaptureInfo(s, &status, &capture_id));
  ASSERT_EQ(status, cudaStreamCaptureStatusActive);
  std::vector<range> graph_ranges;
  auto* a = static_cast<int*>(alloc.allocate(k_bytes, s));
  auto* b = static_cast<int*>(alloc.allocate(k_bytes, s));
  EXPECT_NE(a, warm);  // not the stream's cached block: the capture has a pool of its own
  EXPECT_NE(b, warm);
  plus_one<<<k_grid, k_threads_per_block, 0, s>>>(in, a, k_elems);    // a = in + 1
  times_three<<<k_grid, k_threads_per_block, 0, s>>>(a, b, k_elems);  // b = 3 in + 3
  alloc.deallocate(a);  // freed inside the capture: a later captured allocation may reuse it
  auto* c = static_cast<int*>(alloc.allocate(k_bytes, s));
  minus<<<k_grid, k_threads_per_block, 0, s>>>(b, in, c, k_elems);  // c = 2 in + 3
  CUDA_CHECK(cudaMemcpyAsync(out, c, k_bytes, cudaMemcpyDeviceToDevice, s));
  alloc.deallocate(b, s);  // an ordered free on the capturing stream itself
  alloc.deallocate(c);
  for (void* p : {static_cast<void*>(a), static_cast<void*>(b), static_cast<void*>(c)}) {
    const auto x = reinterpret_cast<std::uintptr_t>(p);
    graph_ranges.push_back({x, x + k_bytes});
  }
  cudaGraph_t graph = nullptr;
  // An illegal call by cucache during the capture would make this
  // cudaErrorStreamCaptureInvalidated.
  open_capture.dismiss();
  CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  const graph_pool_id pool = graph_pool_id::of_capture(capture_id);
  alloc.end_allocate_to_pool(pool);  // tells cucache the capture has ended
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  {
    const cucache::graph_pool_info info = alloc.graph_pool_state(pool);
    EXPECT_TRUE(info.exists);
    EXPECT_FALSE(info.released);
    EXPECT_GE(info.reserved_bytes, 2 * k_bytes);  // a and b are live together in the graph
    EXPECT_EQ(info.allocated_bytes, 0u);          // all three were freed inside the capture
  }
  alloc.check_invariants();

  // --- replay 100 times while other streams allocate, fill and free ---------------------------
  std::atomic<bool> stop{false};
  std::vector<std::vector<range>> seen(k_churn_threads);
  std::vector<std::string> errors(k_churn_threads);
  std::vector<std::thread> threads;
  for (int t = 0; t < k_churn_threads; ++t) {
    threads.emplace_back([&, t] {
      errors[static_cast<std::size_t>(t)] =
          churn(alloc, stop, 1234u + static_cast<unsigned>(t), seen[static_cast<std::size_t>(t)]);
    });
  }
  std::vector<int> host(k_elems);
  std::vector<int> result(k_elems);
  bool contents_ok = true;
  // No fatal assertion while the threads run: leaving the test would destroy joinable threads.
  auto ok = [&](cudaError_t code, const char* what) {
    if (code == cudaSuccess) return true;
    ADD_FAILURE() << what << " failed: " << cudaGetErrorString(code);
    contents_ok = false;
    return false;
  };
  for (int r = 0; r < k_replays && contents_ok; ++r) {
    for (std::size_t i = 0; i < k_elems; ++i) host[i] = static_cast<int>(i) + 7 * r;
    if (!ok(cudaMemcpyAsync(in, host.data(), k_bytes, cudaMemcpyHostToDevice, s), "copy in") ||
        !ok(cudaGraphLaunch(exec, s), "cudaGraphLaunch") ||
        !ok(cudaMemcpyAsync(result.data(), out, k_bytes, cudaMemcpyDeviceToHost, s), "copy out") ||
        !ok(cudaStreamSynchronize(s), "cudaStreamSynchronize")) {
      break;
    }
    for (std::size_t i = 0; i < k_elems; ++i) {
      if (result[i] != 2 * host[i] + 3) {
        ADD_FAILURE() << "replay " << r << ": out[" << i << "] = " << result[i] << ", expected "
                      << 2 * host[i] + 3;
        contents_ok = false;
        break;
      }
    }
  }
  stop.store(true);
  for (auto& t : threads) t.join();
  for (const std::string& e : errors) EXPECT_EQ(e, "");
  std::size_t churned = 0;
  for (const auto& v : seen) {
    churned += v.size();
    for (const range& x : v) {
      for (const range& g : graph_ranges) {
        ASSERT_FALSE(g.overlaps(x.begin, x.end))
            << "another stream got [" << x.begin << ", " << x.end << ") of the graph's pool";
      }
    }
  }
  EXPECT_GT(churned, 0u);
  alloc.check_invariants();

  // --- release: the graph goes first, then its pool --------------------------------------------
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  alloc.release_graph_pool(pool);
  EXPECT_TRUE(!alloc.graph_pool_state(pool).exists || alloc.graph_pool_state(pool).released);
  alloc.empty_cache();
  const cucache::device_stats st = alloc.stats();
  EXPECT_EQ(st.allocated_bytes[0].current, 0);
  EXPECT_EQ(st.reserved_bytes[0].current, 0);
  alloc.check_invariants();
  CUDA_CHECK(cudaFree(in));
  CUDA_CHECK(cudaFree(out));
  CUDA_CHECK(cudaStreamDestroy(s));
}

INSTANTIATE_TEST_SUITE_P(Modes, GraphCapture, ::testing::Values("", "expandable_segments:True"),
                         [](const auto& param) {
                           return std::string(param.index == 0 ? "Default" : "Expandable");
                         });

// --- while a capture is underway, another thread allocates, misses and polls ---------------------

__global__ void spin(int* p, long long cycles) {
  const long long start = clock64();
  int n = 0;
  while (clock64() - start < cycles) p[threadIdx.x] = ++n;
}

TEST_P(GraphCapture, AnotherThreadsMissesAndPollsDuringAGlobalCaptureLeaveItValid) {
  // Global mode forbids "potentially unsafe" calls (cudaMalloc, cuMemCreate/Map, cudaEventQuery)
  // to every thread while the capture runs; cucache makes its own in relaxed mode, and never
  // synchronizes. The capture must end cleanly, and the graph must compute.
  CUCACHE_REQUIRE_GPU();
  device_allocator alloc(std::make_shared<cucache::cuda_backend>(0),
                         cucache::parse_config(GetParam()));
  cudaStream_t s = nullptr;
  cudaStream_t t = nullptr;
  cudaStream_t u = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithFlags(&u, cudaStreamNonBlocking));
  int* in = nullptr;
  int* out = nullptr;
  CUDA_CHECK(cudaMalloc(&in, k_bytes));
  CUDA_CHECK(cudaMalloc(&out, k_bytes));
  CUDA_CHECK(cudaMemset(in, 0, k_bytes));
  CUDA_CHECK(cudaDeviceSynchronize());

  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  capture_guard open_capture{s};
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long capture_id = 0;
  CUDA_CHECK(cudaStreamGetCaptureInfo(s, &status, &capture_id));
  auto* a = static_cast<int*>(alloc.allocate(k_bytes, s));
  plus_one<<<k_grid, k_threads_per_block, 0, s>>>(in, a, k_elems);
  std::string worker_error;
  std::thread worker([&] {
    try {
      std::vector<void*> live;
      for (int i = 0; i < 200; ++i) {
        // New sizes keep missing: cudaMalloc (or cuMemCreate + cuMemMap) during the capture.
        const std::size_t bytes = (std::size_t{1} + static_cast<std::size_t>(i % 13)) << 20;
        void* p = alloc.allocate(bytes, t);
        fill_bytes<<<k_grid, k_threads_per_block, 0, t>>>(static_cast<unsigned char*>(p), bytes,
                                                          0x5A);
        if (i % 3 == 0) alloc.record_stream(p, u);  // an event on u at its free, polled later
        live.push_back(p);
        if (live.size() > 4) {
          alloc.deallocate(live.front());
          live.erase(live.begin());
        }
      }
      for (void* p : live) alloc.deallocate(p);
    } catch (const std::exception& e) {
      worker_error = e.what();
    }
  });
  worker.join();
  EXPECT_EQ(worker_error, "");
  times_three<<<k_grid, k_threads_per_block, 0, s>>>(a, out, k_elems);  // out = 3 (in + 1)
  alloc.deallocate(a);
  cudaGraph_t graph = nullptr;
  open_capture.dismiss();
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess) << "cucache invalidated the capture";
  alloc.end_allocate_to_pool(graph_pool_id::of_capture(capture_id));
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<int> host(k_elems, 0);
  for (int r = 0; r < 3; ++r) {
    for (std::size_t i = 0; i < k_elems; ++i) host[i] = static_cast<int>(i) - r;
    CUDA_CHECK(cudaMemcpyAsync(in, host.data(), k_bytes, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaGraphLaunch(exec, s));
    std::vector<int> result(k_elems);
    CUDA_CHECK(cudaMemcpyAsync(result.data(), out, k_bytes, cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    for (std::size_t i = 0; i < k_elems; i += 4099) {
      ASSERT_EQ(result[i], 3 * (host[i] + 1)) << "replay " << r << " at " << i;
    }
  }
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  alloc.release_graph_pool(graph_pool_id::of_capture(capture_id));
  alloc.check_invariants();
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().reserved_bytes[0].current, 0);
  CUDA_CHECK(cudaFree(in));
  CUDA_CHECK(cudaFree(out));
  for (cudaStream_t x : {s, t, u}) CUDA_CHECK(cudaStreamDestroy(x));
}

// --- item 3: a destroyed stream's handle comes back while its kernel still runs ----------------

TEST_P(GraphCapture, ADestroyedStreamsBlockIsNotHandedToTheNextStreamWithItsHandle) {
  CUCACHE_REQUIRE_GPU();
  device_allocator alloc(std::make_shared<cucache::cuda_backend>(0),
                         cucache::parse_config(GetParam()));
  cudaStream_t s = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int* p = static_cast<int*>(alloc.allocate(1 << 20, s));
  cudaEvent_t done = nullptr;
  CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  spin<<<1, 32, 0, s>>>(p, 2'000'000'000LL);  // about a second: still running below
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaEventRecord(done, s));
  alloc.deallocate(p);               // legal: ordered after the kernel on s
  CUDA_CHECK(cudaStreamDestroy(s));  // legal: returns at once, the kernel goes on
  cudaStream_t t = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&t, cudaStreamNonBlocking));
  if (t != s) std::printf("note: the runtime gave the new stream another handle this time\n");
  void* q = alloc.allocate(1 << 20, t);
  const bool running = cudaEventQuery(done) == cudaErrorNotReady;
  static_cast<void>(cudaGetLastError());
  if (running)
    EXPECT_NE(q, static_cast<void*>(p)) << "the new stream got the running kernel's block";
  CUDA_CHECK(cudaEventSynchronize(done));
  alloc.deallocate(q);
  alloc.check_invariants();
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().reserved_bytes[0].current, 0);
  CUDA_CHECK(cudaEventDestroy(done));
  CUDA_CHECK(cudaStreamDestroy(t));
}

}  // namespace
