// Thrust and CUB on cucache memory: the keys live in a cucache allocation, thrust::sort takes its
// temporary storage from cucache through the execution policy's allocator, and a CUB reduction
// takes its temporary storage from cucache through with_temp_storage. Checked on the host.
// Needs a GPU (exits 77, "skipped" to ctest, without one).
#include <cuda_runtime.h>
#include <thrust/device_ptr.h>
#include <thrust/execution_policy.h>
#include <thrust/sort.h>
#include <cub/device/device_reduce.cuh>

#include <cucache/cucache.h>
#include <cucache/thrust.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

#define CHECK(call)                                                      \
  do {                                                                   \
    const cudaError_t err_ = (call);                                     \
    if (err_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, \
                   cudaGetErrorString(err_));                            \
      return 1;                                                          \
    }                                                                    \
  } while (0)

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: nothing to run\n");
    return 77;  // "skipped" to ctest
  }

  const int n = 1 << 22;
  std::vector<unsigned> host(n);
  std::uint32_t state = 12345;
  for (unsigned& k : host) {
    state = state * 1664525u + 1013904223u;  // a fixed pseudo-random sequence
    k = state >> 8;
  }

  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  unsigned* keys = nullptr;
  unsigned long long* sum = nullptr;
  CHECK(cucacheMallocAsync(&keys, n * sizeof(unsigned), stream));
  CHECK(cucacheMallocAsync(&sum, sizeof(unsigned long long), stream));
  CHECK(cudaMemcpyAsync(keys, host.data(), n * sizeof(unsigned), cudaMemcpyHostToDevice, stream));

  try {
    // The sort's temporary storage comes from cucache, in the order of `stream`.
    cucache::thrust_allocator alloc(stream);
    for (int round = 0; round < 3; ++round) {  // later rounds reuse the cached storage
      thrust::sort(thrust::cuda::par(alloc).on(stream), thrust::device_pointer_cast(keys),
                   thrust::device_pointer_cast(keys) + n);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "thrust::sort: %s\n", e.what());
    return 1;
  }

  // CUB: a reduction whose temporary storage comes from cucache.
  CHECK(cucache::with_temp_storage(stream, [&](void* temp, std::size_t& bytes) {
    return cub::DeviceReduce::Reduce(temp, bytes, keys, sum, n, cuda::std::plus<>{}, 0ull, stream);
  }));

  std::vector<unsigned> sorted(n);
  unsigned long long device_sum = 0;
  CHECK(cudaMemcpyAsync(sorted.data(), keys, n * sizeof(unsigned), cudaMemcpyDeviceToHost, stream));
  CHECK(cudaMemcpyAsync(&device_sum, sum, sizeof device_sum, cudaMemcpyDeviceToHost, stream));
  CHECK(cudaStreamSynchronize(stream));

  cucacheStats stats;
  CHECK(cucacheGetStats(0, &stats));
  CHECK(cucacheFreeAsync(keys, stream));
  CHECK(cucacheFreeAsync(sum, stream));
  CHECK(cudaStreamSynchronize(stream));
  CHECK(cudaStreamDestroy(stream));

  unsigned long long host_sum = 0;
  for (unsigned k : host) host_sum += k;
  std::sort(host.begin(), host.end());
  const bool sorted_ok = sorted == host;
  const bool sum_ok = device_sum == host_sum;
  // The keys and the sum were not all cucache handed out: the temporary storage came from it too.
  const bool temp_from_cucache = stats.allocatedBytesPeak > n * sizeof(unsigned) + 512;
  std::printf(
      "%s: %d keys sorted %s, sum %s, temporary storage %s cucache "
      "(peak allocated %zu MiB, %llu device allocations)\n",
      sorted_ok && sum_ok && temp_from_cucache ? "ok" : "FAIL", n, sorted_ok ? "right" : "WRONG",
      sum_ok ? "right" : "WRONG", temp_from_cucache ? "from" : "NOT from",
      stats.allocatedBytesPeak >> 20, stats.deviceAllocCount);
  return sorted_ok && sum_ok && temp_from_cucache ? 0 : 1;
}
