// A whole CUDA program over the global C API that returns from main after destroying the streams
// it allocated on -- the shape that crashed with SIGSEGV after main returned in expandable mode
// (the exit handler synchronized a destroyed stream). ctest runs it in both modes and each
// scenario; exit code 0 means every call succeeded, every result was right and the process ended
// cleanly after cucache's exit handler. Exits 77 (ctest: skipped) without a usable GPU.
//
//   process_exit_gpu_check SCENARIO     SCENARIO: stream | record_stream | threads | loop
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cucache/cucache.h"
#include "cucache/cuda_backend.hpp"

namespace {

__global__ void fill(unsigned* p, std::size_t n, unsigned v) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    p[i] = v;
  }
}

__global__ void count_wrong(const unsigned* p, std::size_t n, unsigned v, unsigned* wrong) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    if (p[i] != v) atomicAdd(wrong, 1u);
  }
}

bool ok(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return true;
  std::fprintf(stderr, "process_exit_gpu_check: %s: %s (%s)\n", what, cudaGetErrorString(err),
               cucacheGetLastErrorMessage());
  return false;
}

// Allocates `bytes` on a fresh non-blocking stream, writes and checks it there, frees it, and
// destroys the stream; with `record`, the block is also used on a second stream (record_stream).
bool one_stream(std::size_t bytes, bool record, unsigned tag) {
  cudaStream_t s = nullptr;
  cudaStream_t other = nullptr;
  if (!ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate")) return false;
  if (record && !ok(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking), "cudaStreamCreate")) {
    return false;
  }
  void* p = nullptr;
  unsigned* wrong = nullptr;
  if (!ok(cucacheMallocAsync(&p, bytes, s), "cucacheMallocAsync")) return false;
  if (!ok(cudaMalloc(&wrong, sizeof(unsigned)), "cudaMalloc")) return false;
  if (!ok(cudaMemset(wrong, 0, sizeof(unsigned)), "cudaMemset")) return false;
  const std::size_t n = bytes / sizeof(unsigned);
  fill<<<64, 256, 0, s>>>(static_cast<unsigned*>(p), n, tag);
  if (record) {
    cudaEvent_t e = nullptr;
    if (!ok(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate")) return false;
    if (!ok(cudaEventRecord(e, s), "cudaEventRecord")) return false;
    if (!ok(cudaStreamWaitEvent(other, e, 0), "cudaStreamWaitEvent")) return false;
    count_wrong<<<64, 256, 0, other>>>(static_cast<const unsigned*>(p), n, tag, wrong);
    if (!ok(cucacheRecordStream(p, other), "cucacheRecordStream")) return false;
    if (!ok(cudaEventDestroy(e), "cudaEventDestroy")) return false;
  } else {
    count_wrong<<<64, 256, 0, s>>>(static_cast<const unsigned*>(p), n, tag, wrong);
  }
  if (!ok(cucacheFreeAsync(p, s), "cucacheFreeAsync")) return false;
  if (!ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize")) return false;
  unsigned bad = 0;
  if (!ok(cudaMemcpy(&bad, wrong, sizeof bad, cudaMemcpyDeviceToHost), "cudaMemcpy")) return false;
  if (!ok(cudaFree(wrong), "cudaFree")) return false;
  if (!ok(cudaStreamDestroy(s), "cudaStreamDestroy")) return false;
  if (other != nullptr && !ok(cudaStreamDestroy(other), "cudaStreamDestroy")) return false;
  if (bad != 0) {
    std::fprintf(stderr, "process_exit_gpu_check: %u of %zu words wrong\n", bad, n);
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (!cucache::cuda_available()) {
    std::printf("skipped: %s\n", cucache::cuda_unavailable_reason().c_str());
    return 77;
  }
  const std::string scenario = argc > 1 ? argv[1] : "stream";
  const std::size_t sizes[] = {4096, std::size_t{8} << 20, std::size_t{64} << 20};
  bool good = true;
  if (scenario == "stream" || scenario == "record_stream") {
    for (std::size_t b : sizes) good = good && one_stream(b, scenario == "record_stream", 7);
  } else if (scenario == "threads") {
    std::vector<std::thread> threads;
    std::vector<char> results(8, 0);
    for (int t = 0; t < 8; ++t) {
      threads.emplace_back([t, &results, &sizes] {
        bool r = true;
        for (std::size_t b : sizes) r = r && one_stream(b, false, static_cast<unsigned>(t + 1));
        results[static_cast<std::size_t>(t)] = r ? 1 : 0;
      });
    }
    for (auto& th : threads) th.join();
    for (char r : results) good = good && r != 0;
  } else if (scenario == "loop") {
    for (int i = 0; i < 50 && good; ++i) good = one_stream(sizes[i % 3], i % 2 == 1, 3);
  } else {
    std::fprintf(stderr, "process_exit_gpu_check: unknown scenario '%s'\n", scenario.c_str());
    return 2;
  }
  if (!good) return 1;
  if (!ok(cucacheEmptyCache(), "cucacheEmptyCache")) return 1;
  std::printf("ok: %s\n", scenario.c_str());
  return 0;  // cucache's exit handler runs after this, with every stream destroyed
}
