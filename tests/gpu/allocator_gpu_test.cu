// GPU-tier tests of device_allocator on a real device that need kernels: its blocks are usable by
// kernels, random churn on several streams and threads never hands out overlapping or still-in-use
// memory, and cross-stream frees wait for the other stream's kernel. Each test skips with a
// one-line reason without a GPU. The caching rules that need no kernel (out-of-memory reports and
// recovery, impossible sizes, reserved memory against the driver's free memory, record_stream and
// frees on another stream, in both modes) are in the typed suite,
// tests/allocator/allocator_suite.cpp, whose allocator_suite_cuda_test runs them here.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <exception>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
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
using cucache::device_stats;

// The same for worker threads, which return their first error to the main thread: gtest's fatal
// assertions only leave the function they are in, so a thread must not use them.
#define CUDA_TRY(expr)                                                             \
  do {                                                                             \
    const cudaError_t cuda_try_code = (expr);                                      \
    if (cuda_try_code != cudaSuccess)                                              \
      return std::string(#expr) + " failed: " + cudaGetErrorString(cuda_try_code); \
  } while (false)

constexpr std::size_t mib = std::size_t{1} << 20;
constexpr std::size_t gib = std::size_t{1} << 30;

constexpr unsigned threads_per_block = 256;
constexpr std::size_t max_grid = 1024;

// --- kernels -------------------------------------------------------------------------------------
// Every kernel touches only [data, data + bytes), bytes being the size the caller requested: the
// rounding slack belongs to the allocator, and compute-sanitizer must see no access beyond it.

__device__ std::size_t thread_index() {
  return blockIdx.x * std::size_t{blockDim.x} + threadIdx.x;
}
__device__ std::size_t thread_count() {
  return std::size_t{gridDim.x} * blockDim.x;
}

// Byte `offset` of a buffer filled with `id` as little-endian uint32 words, so that the byte tail
// of a size that is not a multiple of 4 continues the same pattern.
__host__ __device__ std::uint8_t id_byte(std::uint32_t id, std::size_t offset) {
  return static_cast<std::uint8_t>(id >> (8 * (offset % 4)));
}

// Blocks start 256-byte aligned (asserted on the host), so the word accesses are aligned.
__device__ void fill_range(unsigned char* data, std::size_t bytes, std::uint32_t id,
                           std::size_t first, std::size_t stride) {
  const std::size_t words = bytes / 4;
  auto* word_data = reinterpret_cast<std::uint32_t*>(data);
  for (std::size_t i = first; i < words; i += stride) word_data[i] = id;
  for (std::size_t i = words * 4 + first; i < bytes; i += stride) data[i] = id_byte(id, i);
}

__global__ void fill_id(void* data, std::size_t bytes, std::uint32_t id) {
  fill_range(static_cast<unsigned char*>(data), bytes, id, thread_index(), thread_count());
}

__global__ void check_id(const void* data, std::size_t bytes, std::uint32_t id,
                         unsigned long long* mismatches) {
  const auto* byte_data = static_cast<const unsigned char*>(data);
  const auto* word_data = static_cast<const std::uint32_t*>(data);
  const std::size_t words = bytes / 4;
  const std::size_t stride = thread_count();
  unsigned long long local = 0;
  for (std::size_t i = thread_index(); i < words; i += stride) local += word_data[i] != id;
  for (std::size_t i = words * 4 + thread_index(); i < bytes; i += stride) {
    local += byte_data[i] != id_byte(id, i);
  }
  // One atomic per thread that saw a mismatch, not one per word.
  if (local != 0) atomicAdd(mismatches, local);
}

__device__ std::uint64_t global_ns() {
  std::uint64_t t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Launch with ONE block: thread 0 holds the stream for `spin_ns` of wall time (globaltimer, so a
// slow SM clock cannot shorten it), then the block writes `id` over the buffer -- the late use of
// a freed block that a premature reuse would collide with.
__global__ void spin_then_fill(void* data, std::size_t bytes, std::uint64_t spin_ns,
                               std::uint32_t id) {
  if (threadIdx.x == 0) {
    const std::uint64_t start = global_ns();
    while (global_ns() - start < spin_ns) {
    }
  }
  __syncthreads();
  fill_range(static_cast<unsigned char*>(data), bytes, id, thread_index(), thread_count());
}

unsigned grid_for(std::size_t bytes) {
  const std::size_t words = bytes / 4 + 1;
  return static_cast<unsigned>(
      std::min(max_grid, (words + threads_per_block - 1) / threads_per_block));
}

void launch_fill(void* data, std::size_t bytes, std::uint32_t id, cudaStream_t stream) {
  fill_id<<<grid_for(bytes), threads_per_block, 0, stream>>>(data, bytes, id);
}

void launch_check(const void* data, std::size_t bytes, std::uint32_t id,
                  unsigned long long* mismatches, cudaStream_t stream) {
  check_id<<<grid_for(bytes), threads_per_block, 0, stream>>>(data, bytes, id, mismatches);
}

// With lazy module loading (the default), a kernel's first launch loads its module, which may
// synchronize the context: done inside the spin window of the stream tests, it would wait for
// the spinning kernel and hide exactly what they look for. Zero sizes touch no memory.
void warm_up_kernels() {
  fill_id<<<1, threads_per_block>>>(nullptr, 0, 0);
  check_id<<<1, threads_per_block>>>(nullptr, 0, 0, nullptr);
  spin_then_fill<<<1, threads_per_block>>>(nullptr, 0, 0, 0);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaDeviceSynchronize());
}

// --- host helpers --------------------------------------------------------------------------------

// Distinct for every index below 2^32 (multiplication by an odd constant is a bijection mod 2^32)
// and rich in non-zero bytes, so stale or foreign data is never mistaken for a block's own.
std::uint32_t block_id(std::uint64_t index) {
  return static_cast<std::uint32_t>((index + 1) * 0x9e3779b1u);
}

// Log-uniform in [1, max_bytes]: as many tiny as huge requests, so every pool and size rule is hit.
std::size_t log_uniform_size(std::mt19937_64& rng, std::size_t max_bytes) {
  std::uniform_real_distribution<double> exponent(0.0, std::log2(static_cast<double>(max_bytes)));
  const auto bytes = static_cast<std::size_t>(std::exp2(exponent(rng)));
  return std::clamp<std::size_t>(bytes, 1, max_bytes);
}

// Fixed so that a failure replays; CUCACHE_GPU_TEST_SEED explores other sequences.
std::uint64_t test_seed() {
  if (const char* text = std::getenv("CUCACHE_GPU_TEST_SEED")) {
    return std::strtoull(text, nullptr, 0);
  }
  return 0x6375636163686531ull;
}

// CUCACHE_STRESS_SCALE (0 < x <= 1) shortens the two long tests (the churn's operations, the
// workers' cycles), so that compute-sanitizer's racecheck, which slows every fill kernel down,
// runs the whole suite to its end (tools/gpu_suite.sh racecheck). Full size without it.
std::size_t scaled(std::size_t n) {
  if (const char* text = std::getenv("CUCACHE_STRESS_SCALE")) {
    const double v = std::strtod(text, nullptr);
    if (v > 0 && v < 1) return std::max<std::size_t>(1, static_cast<std::size_t>(n * v));
  }
  return n;
}

// A non-blocking stream: it does not synchronize with the legacy default stream, so the
// allocator's per-stream pools face truly independent streams.
class owned_stream {
 public:
  owned_stream() : status_(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)) {}
  ~owned_stream() {
    if (stream_ != nullptr) static_cast<void>(cudaStreamDestroy(stream_));
  }
  owned_stream(const owned_stream&) = delete;
  owned_stream& operator=(const owned_stream&) = delete;
  [[nodiscard]] cudaError_t status() const { return status_; }
  [[nodiscard]] cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;  // declared first: status_'s initializer writes it
  cudaError_t status_;
};

// Mismatch counters in plain cudaMalloc memory, outside the allocator under test so that they do
// not show in its statistics.
class device_counters {
 public:
  explicit device_counters(std::size_t count) : count_(count) {
    status_ = cudaMalloc(&data_, count_ * sizeof(unsigned long long));
    if (status_ == cudaSuccess) status_ = cudaMemset(data_, 0, count_ * sizeof(unsigned long long));
    // The memset runs on the legacy stream, which non-blocking streams do not wait for.
    if (status_ == cudaSuccess) status_ = cudaDeviceSynchronize();
  }
  ~device_counters() {
    if (data_ != nullptr) static_cast<void>(cudaFree(data_));
  }
  device_counters(const device_counters&) = delete;
  device_counters& operator=(const device_counters&) = delete;
  [[nodiscard]] cudaError_t status() const { return status_; }
  [[nodiscard]] unsigned long long* slot(std::size_t i) const { return data_ + i; }
  // Waits for every stream (the checks run on non-blocking ones), then copies the counters back.
  [[nodiscard]] cudaError_t read(std::vector<unsigned long long>& out) const {
    out.assign(count_, 0);
    if (const cudaError_t code = cudaDeviceSynchronize(); code != cudaSuccess) return code;
    return cudaMemcpy(out.data(), data_, count_ * sizeof(unsigned long long),
                      cudaMemcpyDeviceToHost);
  }

 private:
  std::size_t count_;
  unsigned long long* data_ = nullptr;
  cudaError_t status_ = cudaSuccess;
};

// The live blocks by address, to prove that no two of them share a byte. Thread-safe.
class live_ranges {
 public:
  // Adds [ptr, ptr + size); returns a description of the live block it overlaps, or "".
  std::string add(const void* ptr, std::size_t size) {
    const auto start = reinterpret_cast<std::uintptr_t>(ptr);
    const std::uintptr_t end = start + size;
    std::lock_guard lock(mu_);
    const auto next = ends_.lower_bound(start);
    if (next != ends_.end() && next->first < end) return describe(start, end, *next);
    if (next != ends_.begin()) {
      const auto prev = std::prev(next);
      if (prev->second > start) return describe(start, end, *prev);
    }
    ends_.emplace(start, end);
    return {};
  }
  void remove(const void* ptr) {
    std::lock_guard lock(mu_);
    ends_.erase(reinterpret_cast<std::uintptr_t>(ptr));
  }

 private:
  static std::string describe(std::uintptr_t start, std::uintptr_t end,
                              const std::pair<const std::uintptr_t, std::uintptr_t>& other) {
    std::ostringstream out;
    out << std::hex << "new block [0x" << start << ", 0x" << end << ") overlaps live block [0x"
        << other.first << ", 0x" << other.second << ")";
    return out.str();
  }

  std::mutex mu_;
  std::map<std::uintptr_t, std::uintptr_t> ends_;  // start -> end
};

// check_invariants() takes all locks but expects no call in flight (deallocate leaves the pointer
// map before it takes its pool's lock), so tests call it only while no other thread allocates.
void expect_invariants(const device_allocator& alloc, const std::string& where) {
  try {
    alloc.check_invariants();
  } catch (const std::exception& e) {
    FAIL() << "check_invariants (" << where << "): " << e.what();
  }
}

std::shared_ptr<cucache::cuda_backend> device0() {
  return std::make_shared<cucache::cuda_backend>(0);
}

// The suite runs once per configuration: CUCACHE_GPU_TEST_CONF (a CUCACHE_CONF string) selects
// it, e.g. "expandable_segments:True" for the virtual-memory path.
cucache::config test_config() {
  const char* conf = std::getenv("CUCACHE_GPU_TEST_CONF");
  return cucache::parse_config(conf != nullptr ? conf : "");
}
bool expandable_mode() {
  return test_config().expandable_segments;
}

std::int64_t as_i64(std::size_t n) {
  return static_cast<std::int64_t>(n);
}

// --- 1. blocks are usable by kernels -------------------------------------------------------------

TEST(AllocatorGpu, BlocksAreUsableByKernelsAndIndependentOfEachOther) {
  CUCACHE_REQUIRE_GPU();
  ASSERT_NO_FATAL_FAILURE(warm_up_kernels());
  device_allocator alloc(device0(), test_config());
  EXPECT_EQ(alloc.allocate(0), nullptr);

  // Every boundary of the size rules (512 B rounding, the 1 MiB small/large split, the 10 MiB
  // shared-segment limit, segments of their own), then 16 neighbours in one small segment.
  std::vector<std::size_t> sizes = {1,
                                    2,
                                    3,
                                    4,
                                    5,
                                    511,
                                    512,
                                    513,
                                    4095,
                                    65537,
                                    mib - 1,
                                    mib,
                                    mib + 1,
                                    3 * mib + 3,
                                    10 * mib - 1,
                                    10 * mib,
                                    20 * mib + 5,
                                    256 * mib + 1};
  for (int i = 0; i < 16; ++i) sizes.push_back(1000);
  const auto index_of = [&](std::size_t bytes) {
    return static_cast<std::size_t>(std::find(sizes.begin(), sizes.end(), bytes) - sizes.begin());
  };
  const std::size_t host_checked = index_of(4095);
  const std::size_t host_written = index_of(3 * mib + 3);

  device_counters mismatches(sizes.size() + 1);
  CUDA_CHECK(mismatches.status());
  live_ranges ranges;
  std::vector<void*> ptrs;
  std::size_t requested = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    void* p = alloc.allocate(sizes[i]);
    ASSERT_NE(p, nullptr) << sizes[i];
    ptrs.push_back(p);
    requested += sizes[i];
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 256, 0u) << sizes[i];
    const std::size_t rounded = alloc.allocation_size(p);
    EXPECT_GE(rounded, sizes[i]);
    EXPECT_EQ(rounded % 512, 0u) << sizes[i];
    const std::string overlap = ranges.add(p, rounded);
    ASSERT_TRUE(overlap.empty()) << overlap;
    cudaPointerAttributes attributes{};
    CUDA_CHECK(cudaPointerGetAttributes(&attributes, p));
    EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);
    EXPECT_EQ(attributes.device, 0);
    launch_fill(p, sizes[i], block_id(i), nullptr);
    CUDA_CHECK(cudaGetLastError());
  }
  // All fills before any check: a fill that overran its block, or two blocks that overlap, show
  // as mismatches in the neighbour.
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    launch_check(ptrs[i], sizes[i], block_id(i), mismatches.slot(i), nullptr);
    CUDA_CHECK(cudaGetLastError());
  }

  // The ordinary runtime copies see the same bytes the kernels do, in both directions.
  std::vector<unsigned char> host(sizes[host_checked]);
  CUDA_CHECK(cudaMemcpy(host.data(), ptrs[host_checked], host.size(), cudaMemcpyDeviceToHost));
  std::size_t host_mismatches = 0;
  for (std::size_t j = 0; j < host.size(); ++j) {
    host_mismatches += host[j] != id_byte(block_id(host_checked), j);
  }
  EXPECT_EQ(host_mismatches, 0u);
  const std::uint32_t host_id = 0x0badcafeu;
  host.resize(sizes[host_written]);
  for (std::size_t j = 0; j < host.size(); ++j) host[j] = id_byte(host_id, j);
  CUDA_CHECK(cudaMemcpy(ptrs[host_written], host.data(), host.size(), cudaMemcpyHostToDevice));
  launch_check(ptrs[host_written], sizes[host_written], host_id, mismatches.slot(sizes.size()),
               nullptr);
  CUDA_CHECK(cudaGetLastError());

  std::vector<unsigned long long> counts;
  CUDA_CHECK(mismatches.read(counts));
  for (std::size_t i = 0; i < counts.size(); ++i) {
    EXPECT_EQ(counts[i], 0u) << "check " << i << " (block of "
                             << (i < sizes.size() ? sizes[i] : sizes[host_written]) << " bytes)";
  }

  const device_stats during = alloc.stats();
  EXPECT_EQ(during.allocation_count[0].current, as_i64(ptrs.size()));
  EXPECT_EQ(during.requested_bytes[0].current, as_i64(requested));
  ASSERT_NO_FATAL_FAILURE(expect_invariants(alloc, "all live"));
  for (void* p : ptrs) alloc.deallocate(p);
  const device_stats after = alloc.stats();
  EXPECT_EQ(after.allocated_bytes[0].current, 0);
  EXPECT_EQ(after.allocation_count[0].current, 0);
  ASSERT_NO_FATAL_FAILURE(expect_invariants(alloc, "end"));
}

// --- 2. random churn on four streams -------------------------------------------------------------

TEST(AllocatorGpu, RandomChurnOnFourStreamsNeverOverlapsOrCorruptsBlocks) {
  CUCACHE_REQUIRE_GPU();
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " (CUCACHE_GPU_TEST_SEED replays another)");
  const std::size_t ops = scaled(10000);
  constexpr std::size_t max_live = 300;
  constexpr std::size_t max_live_bytes = 8 * gib;
  constexpr std::size_t max_bytes = 64 * mib;
  constexpr std::size_t checkpoint_every = 500;

  std::array<owned_stream, 4> streams;
  for (const owned_stream& s : streams) CUDA_CHECK(s.status());
  // One counter per block (a block is checked once, before its free); at most `ops` blocks.
  device_counters mismatches(ops);
  CUDA_CHECK(mismatches.status());
  ASSERT_NO_FATAL_FAILURE(warm_up_kernels());
  device_allocator alloc(device0(), test_config());

  struct live_block {
    void* ptr;
    std::size_t bytes;
    std::size_t rounded;
    std::size_t index;
    std::size_t stream;
  };
  std::vector<live_block> live;
  std::vector<std::size_t> size_of_block;  // by block index, for failure messages
  live_ranges ranges;
  std::size_t live_rounded = 0;
  std::size_t live_requested = 0;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> coin(0.0, 1.0);

  // The check runs on the block's own stream, and the free is at once reusable on that stream
  // only: the next fill of the same memory is queued after the check.
  auto check_and_free = [&](const live_block& b) {
    launch_check(b.ptr, b.bytes, block_id(b.index), mismatches.slot(b.index),
                 streams[b.stream].get());
    CUDA_CHECK(cudaGetLastError());
    ranges.remove(b.ptr);
    live_rounded -= b.rounded;
    live_requested -= b.bytes;
    try {
      alloc.deallocate(b.ptr);
    } catch (const std::exception& e) {
      FAIL() << "deallocate of block " << b.index << " threw: " << e.what();
    }
  };
  auto checkpoint = [&](std::size_t done) {
    std::vector<unsigned long long> counts;
    CUDA_CHECK(mismatches.read(counts));
    std::size_t bad = 0;
    for (std::size_t i = 0; i < size_of_block.size(); ++i) {
      if (counts[i] != 0 && ++bad <= 10) {
        ADD_FAILURE() << "block " << i << " (" << size_of_block[i] << " bytes): " << counts[i]
                      << " mismatching words/bytes";
      }
    }
    ASSERT_EQ(bad, 0u) << "blocks with mismatches after " << done << " ops";
    ASSERT_NO_FATAL_FAILURE(expect_invariants(alloc, "after " + std::to_string(done) + " ops"));
    const device_stats s = alloc.stats();
    EXPECT_EQ(s.allocation_count[0].current, as_i64(live.size())) << done;
    EXPECT_EQ(s.allocated_bytes[0].current, as_i64(live_rounded)) << done;
    EXPECT_EQ(s.requested_bytes[0].current, as_i64(live_requested)) << done;
  };

  for (std::size_t op = 0; op < ops; ++op) {
    const bool must_free = live.size() >= max_live || live_rounded > max_live_bytes;
    if (live.empty() || (!must_free && coin(rng) < 0.55)) {
      const std::size_t bytes = log_uniform_size(rng, max_bytes);
      const std::size_t stream = rng() % streams.size();
      void* p = nullptr;
      try {
        p = alloc.allocate(bytes, streams[stream].get());
      } catch (const std::exception& e) {
        FAIL() << "op " << op << ": allocate(" << bytes << ") threw: " << e.what();
      }
      ASSERT_NE(p, nullptr) << "op " << op;
      ASSERT_EQ(reinterpret_cast<std::uintptr_t>(p) % 256, 0u) << "op " << op;
      const std::size_t rounded = alloc.allocation_size(p);
      ASSERT_GE(rounded, bytes) << "op " << op;
      const std::string overlap = ranges.add(p, rounded);
      ASSERT_TRUE(overlap.empty()) << "op " << op << ": " << overlap;
      const std::size_t index = size_of_block.size();
      size_of_block.push_back(bytes);
      launch_fill(p, bytes, block_id(index), streams[stream].get());
      CUDA_CHECK(cudaGetLastError());
      live.push_back({p, bytes, rounded, index, stream});
      live_rounded += rounded;
      live_requested += bytes;
    } else {
      const std::size_t pos = rng() % live.size();
      const live_block victim = live[pos];
      live[pos] = live.back();
      live.pop_back();
      ASSERT_NO_FATAL_FAILURE(check_and_free(victim));
    }
    if ((op + 1) % checkpoint_every == 0) ASSERT_NO_FATAL_FAILURE(checkpoint(op + 1));
  }
  while (!live.empty()) {
    const live_block last = live.back();
    live.pop_back();
    ASSERT_NO_FATAL_FAILURE(check_and_free(last));
  }
  ASSERT_NO_FATAL_FAILURE(checkpoint(ops));
  EXPECT_EQ(alloc.stats().allocated_bytes[0].current, 0);
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().reserved_bytes[0].current, 0);
  ASSERT_NO_FATAL_FAILURE(expect_invariants(alloc, "after empty_cache"));
}

// --- 3. cross-stream use defers reuse ------------------------------------------------------------

enum class cross_stream_use { record_stream, free_on_stream };

// Block A is allocated on s1 and used late by a kernel on s2 (it spins 200 ms first); A is freed
// while that kernel runs. Allocations of A's size on s1 during the spin must not return A, and
// once s2 is done A must be reused.
void expect_reuse_waits_for_other_stream(cross_stream_use how) {
  constexpr std::size_t block_bytes = 4 * mib;
  constexpr std::size_t blocks_per_segment = 5;  // 4 MiB blocks tile a shared 20 MiB segment
  constexpr std::size_t during_count = 5;
  constexpr std::uint64_t spin_ns = 200'000'000;
  constexpr std::uint32_t sentinel = 0xdeadbeefu;

  owned_stream s1;
  owned_stream s2;
  CUDA_CHECK(s1.status());
  CUDA_CHECK(s2.status());
  device_counters mismatches(during_count + 1);
  CUDA_CHECK(mismatches.status());
  ASSERT_NO_FATAL_FAILURE(warm_up_kernels());
  if (expandable_mode()) {
    GTEST_SKIP() << "the setup warms two cudaMalloc segments; expandable_gpu_test covers "
                    "cross-stream reuse on virtual memory";
  }
  device_allocator alloc(device0(), test_config());

  // Two whole free 20 MiB segments in s1's pool, so every allocation in the spin window is served
  // from the cache: a cudaMalloc there might wait for the spinning kernel.
  std::vector<void*> warm;
  for (std::size_t i = 0; i < 2 * blocks_per_segment; ++i) {
    warm.push_back(alloc.allocate(block_bytes, s1.get()));
  }
  ASSERT_EQ(alloc.stats().segment_count[0].current, 2);
  void* const lowest = *std::min_element(warm.begin(), warm.end());
  for (void* p : warm) alloc.deallocate(p);
  void* const a = alloc.allocate(block_bytes, s1.get());
  // Best fit between two equal free segments takes the lower address. This also makes the test
  // sharp: had A been freed at once, it would merge back into the lower segment and be the very
  // next best fit.
  ASSERT_EQ(a, lowest);
  const std::uint64_t device_allocs = alloc.stats().device_alloc_count;

  spin_then_fill<<<1, threads_per_block, 0, s2.get()>>>(a, block_bytes, spin_ns, sentinel);
  CUDA_CHECK(cudaGetLastError());
  if (how == cross_stream_use::record_stream) {
    alloc.record_stream(a, s2.get());
    alloc.deallocate(a);
  } else {
    alloc.deallocate(a, s2.get());
  }

  std::vector<void*> during;
  std::size_t while_busy = 0;
  bool a_returned_during = false;
  for (std::size_t i = 0; i < during_count; ++i) {
    void* p = alloc.allocate(block_bytes, s1.get());
    ASSERT_NE(p, nullptr);
    during.push_back(p);
    a_returned_during = a_returned_during || p == a;
    // Runs concurrently with the spin. Were p == A, s2's sentinel written after the spin would
    // overwrite it and the check below would count mismatches.
    launch_fill(p, block_bytes, block_id(i), s1.get());
    CUDA_CHECK(cudaGetLastError());
    // Queried after allocate returned: if s2 is busy now, it was busy throughout the call, so A
    // was not reusable then.
    const cudaError_t query = cudaStreamQuery(s2.get());
    if (query == cudaErrorNotReady) {
      // Not an error, but the runtime may still have left it in the last-error slot.
      if (cudaPeekAtLastError() == cudaErrorNotReady) static_cast<void>(cudaGetLastError());
      ++while_busy;
      EXPECT_NE(p, a) << "allocation " << i << " on s1 returned A while s2 was still using it";
    } else {
      CUDA_CHECK(query);
    }
  }
  EXPECT_EQ(alloc.stats().device_alloc_count, device_allocs)
      << "the spin-window allocations were expected to come from the cache";
  if (while_busy == during_count) EXPECT_EQ(alloc.stats().events_pending, 1u);

  CUDA_CHECK(cudaStreamSynchronize(s2.get()));
  for (std::size_t i = 0; i < during.size(); ++i) {
    launch_check(during[i], block_bytes, block_id(i), mismatches.slot(i), s1.get());
    CUDA_CHECK(cudaGetLastError());
  }
  for (void* p : during) alloc.deallocate(p);
  // s2 is done: the next allocation's poll releases A, which merges back into its free segment,
  // the lower of the two equal ones.
  void* const again = alloc.allocate(block_bytes, s1.get());
  EXPECT_EQ(again, a) << "A was not reused after s2 finished";
  EXPECT_EQ(alloc.stats().events_pending, 0u);
  if (again == a && !a_returned_during) {
    // A still holds the sentinel: s2's late write landed, and nothing else wrote there.
    launch_check(again, block_bytes, sentinel, mismatches.slot(during_count), s1.get());
    CUDA_CHECK(cudaGetLastError());
  }
  std::vector<unsigned long long> counts;
  CUDA_CHECK(mismatches.read(counts));
  for (std::size_t i = 0; i < counts.size(); ++i) {
    EXPECT_EQ(counts[i], 0u) << (i < during_count ? "block allocated during the spin, #"
                                                  : "sentinel check of A, #")
                             << i;
  }
  alloc.deallocate(again);
  EXPECT_EQ(alloc.stats().allocated_bytes[0].current, 0);
  ASSERT_NO_FATAL_FAILURE(expect_invariants(alloc, "end"));

  if (while_busy == 0) {
    GTEST_SKIP() << "the 200 ms kernel on s2 ended before the first allocation returned (are "
                    "kernel launches blocking here, e.g. under a sanitizer?): the deferral was "
                    "not exercised";
  }
  if (while_busy < during_count) {
    std::cout << "note: only " << while_busy << " of " << during_count
              << " allocations ran while s2 was busy\n";
  }
}

TEST(AllocatorGpu, RecordStreamDefersReuseUntilTheOtherStreamFinishes) {
  CUCACHE_REQUIRE_GPU();
  expect_reuse_waits_for_other_stream(cross_stream_use::record_stream);
}

TEST(AllocatorGpu, FreeOnAnotherStreamDefersReuseUntilThatStreamFinishes) {
  CUCACHE_REQUIRE_GPU();
  expect_reuse_waits_for_other_stream(cross_stream_use::free_on_stream);
}

// --- 4. threads --------------------------------------------------------------------------------

const std::size_t worker_cycles = scaled(2000);
constexpr std::size_t worker_window = 4;  // blocks each worker keeps live, so frees interleave
constexpr std::size_t worker_max_bytes = 4 * mib;

// One worker: alloc/fill/check/free cycles on its own stream. Returns its first error, or "".
std::string churn_on_stream(device_allocator& alloc, live_ranges& ranges, cudaStream_t stream,
                            unsigned long long* mismatches, std::uint64_t seed,
                            std::size_t worker) {
  struct held {
    void* ptr;
    std::size_t bytes;
    std::uint32_t id;
  };
  std::deque<held> window;
  std::mt19937_64 rng(seed);
  auto release = [&]() -> std::string {
    const held h = window.front();
    window.pop_front();
    launch_check(h.ptr, h.bytes, h.id, mismatches, stream);
    CUDA_TRY(cudaGetLastError());
    ranges.remove(h.ptr);  // before the free: afterwards another thread may get the same bytes
    alloc.deallocate(h.ptr);
    return {};
  };
  try {
    for (std::size_t cycle = 0; cycle < worker_cycles; ++cycle) {
      const std::size_t bytes = log_uniform_size(rng, worker_max_bytes);
      void* p = alloc.allocate(bytes, stream);
      if (p == nullptr) return "allocate(" + std::to_string(bytes) + ") returned nullptr";
      const std::size_t rounded = alloc.allocation_size(p);
      if (rounded < bytes) return "allocation_size below the request";
      if (std::string overlap = ranges.add(p, rounded); !overlap.empty()) {
        return "cycle " + std::to_string(cycle) + ": " + overlap;
      }
      const std::uint32_t id = block_id(worker * worker_cycles + cycle);
      launch_fill(p, bytes, id, stream);
      CUDA_TRY(cudaGetLastError());
      window.push_back({p, bytes, id});
      if (window.size() > worker_window) {
        if (std::string error = release(); !error.empty()) return error;
      }
    }
    while (!window.empty()) {
      if (std::string error = release(); !error.empty()) return error;
    }
  } catch (const std::exception& e) {
    return std::string("threw: ") + e.what();
  }
  return {};
}

std::string run_worker(device_allocator& alloc, live_ranges& ranges, unsigned long long* mismatches,
                       std::uint64_t seed, std::size_t worker) {
  cudaStream_t stream = nullptr;
  CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::string error = churn_on_stream(alloc, ranges, stream, mismatches, seed, worker);
  const cudaError_t sync = cudaStreamSynchronize(stream);
  static_cast<void>(cudaStreamDestroy(stream));
  if (error.empty() && sync != cudaSuccess) {
    error = std::string("cudaStreamSynchronize failed: ") + cudaGetErrorString(sync);
  }
  return error;
}

TEST(AllocatorGpu, EightThreadsOnTheirOwnStreamsShareOneAllocator) {
  CUCACHE_REQUIRE_GPU();
  constexpr std::size_t workers = 8;
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + " (CUCACHE_GPU_TEST_SEED replays another)");
  device_counters mismatches(workers);
  CUDA_CHECK(mismatches.status());
  ASSERT_NO_FATAL_FAILURE(warm_up_kernels());
  device_allocator alloc(device0(), test_config());
  live_ranges ranges;

  std::vector<std::string> errors(workers);
  std::vector<std::thread> threads;
  for (std::size_t w = 0; w < workers; ++w) {
    threads.emplace_back(
        [&, w] { errors[w] = run_worker(alloc, ranges, mismatches.slot(w), seed + w, w); });
  }
  for (std::thread& t : threads) t.join();
  for (std::size_t w = 0; w < workers; ++w) {
    EXPECT_TRUE(errors[w].empty()) << "worker " << w << ": " << errors[w];
  }

  std::vector<unsigned long long> counts;
  CUDA_CHECK(mismatches.read(counts));
  for (std::size_t w = 0; w < workers; ++w) {
    EXPECT_EQ(counts[w], 0u) << "worker " << w << " saw foreign data in its blocks";
  }
  ASSERT_NO_FATAL_FAILURE(expect_invariants(alloc, "after all workers"));
  const device_stats s = alloc.stats();
  EXPECT_EQ(s.allocated_bytes[0].current, 0);
  EXPECT_EQ(s.allocation_count[0].current, 0);
  EXPECT_EQ(s.events_pending, 0u);
}

}  // namespace
