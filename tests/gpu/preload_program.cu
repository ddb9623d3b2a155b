// A plain CUDA program that knows nothing of cucache, for tools/preload_check.sh: built twice
// (nvcc's default static runtime, and -cudart shared) and run with and without
// LD_PRELOAD=libcucache_preload.so. cudaMalloc/cudaFree, cudaMallocAsync/cudaFreeAsync on a
// stream, cudaMallocPitch, cudaMemGetInfo, cuMemGetAddressRange, kernels, and a check of every
// result.
//   preload_program [--expect-ipc-refused] [--reset] [--pairs N]
// --pairs N: also times N cudaMallocAsync + cudaFreeAsync pairs of 4 KiB on the created stream
// (cache hits under cucache) and prints ns per pair -- a figure for the benchmarks, never checked.
// Exit 0: correct results; 1: a wrong result or an unexpected error; 77: no usable GPU.
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK(call)                                                           \
  do {                                                                        \
    const cudaError_t e_ = (call);                                            \
    if (e_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "preload_program: %s failed: %s (%s:%d)\n", #call, \
                   cudaGetErrorString(e_), __FILE__, __LINE__);               \
      return 1;                                                               \
    }                                                                         \
  } while (0)

__global__ void fill(float* x, float v, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = v + static_cast<float>(i % 7);
}

__global__ void saxpy(float a, const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}

__global__ void fill_rows(float* m, size_t pitch, int width, int height) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  const int r = blockIdx.y;
  if (c < width && r < height) {
    reinterpret_cast<float*>(reinterpret_cast<char*>(m) + r * pitch)[c] =
        static_cast<float>(r * 1000 + c);
  }
}

int main(int argc, char** argv) {
  bool expect_ipc_refused = false;
  bool reset = false;  // end with cudaDeviceReset, as many samples do
  long pairs = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--pairs") == 0 && i + 1 < argc) pairs = std::atol(argv[++i]);
    expect_ipc_refused = expect_ipc_refused || std::strcmp(argv[i], "--expect-ipc-refused") == 0;
    reset = reset || std::strcmp(argv[i], "--reset") == 0;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("preload_program: skipped: no usable GPU\n");
    return 77;
  }
  int runtime = 0;
  int driver = 0;
  CHECK(cudaRuntimeGetVersion(&runtime));
  CHECK(cudaDriverGetVersion(&driver));
  std::printf("preload_program: runtime %d, driver %d\n", runtime, driver);

  // 1. cudaMalloc / kernels / cudaFree, many sizes, reused.
  const int n = 1 << 20;
  std::vector<float> host(n);
  for (int round = 0; round < 20; ++round) {
    float* x = nullptr;
    float* y = nullptr;
    CHECK(cudaMalloc(&x, n * sizeof(float)));
    CHECK(cudaMalloc(&y, n * sizeof(float)));
    fill<<<(n + 255) / 256, 256>>>(x, 1.0f, n);
    fill<<<(n + 255) / 256, 256>>>(y, 2.0f, n);
    saxpy<<<(n + 255) / 256, 256>>>(3.0f, x, y, n);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(host.data(), y, n * sizeof(float), cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; ++i) {
      const float want =
          3.0f * (1.0f + static_cast<float>(i % 7)) + 2.0f + static_cast<float>(i % 7);
      if (host[i] != want) {
        std::fprintf(stderr, "preload_program: round %d: y[%d] = %f, want %f\n", round, i, host[i],
                     want);
        return 1;
      }
    }
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
    // Small allocations of many sizes.
    std::vector<void*> small;
    for (int k = 1; k <= 64; ++k) {
      void* p = nullptr;
      CHECK(cudaMalloc(&p, static_cast<size_t>(k) * 1000 + round));
      small.push_back(p);
    }
    for (void* p : small) CHECK(cudaFree(p));
  }

  // 2. Stream-ordered allocation on a stream of its own.
  cudaStream_t s = nullptr;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int round = 0; round < 20; ++round) {
    float* a = nullptr;
    CHECK(cudaMallocAsync(reinterpret_cast<void**>(&a), n * sizeof(float), s));
    fill<<<(n + 255) / 256, 256, 0, s>>>(a, static_cast<float>(round), n);
    CHECK(cudaMemcpyAsync(host.data(), a, n * sizeof(float), cudaMemcpyDeviceToHost, s));
    CHECK(cudaFreeAsync(a, s));
    CHECK(cudaStreamSynchronize(s));
    for (int i = 0; i < n; i += 997) {
      if (host[i] != static_cast<float>(round) + static_cast<float>(i % 7)) {
        std::fprintf(stderr, "preload_program: async round %d: a[%d] = %f\n", round, i, host[i]);
        return 1;
      }
    }
  }

  // 2b. A CUDA graph captured on that stream, allocating and freeing inside the capture (under
  //     cucache: from the capture's private pool, the capture announced by the shim), replayed
  //     three times; then stream-ordered pairs on the stream again, outside any capture.
  {
    float* out = nullptr;
    CHECK(cudaMalloc(&out, n * sizeof(float)));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    float* tmp = nullptr;
    CHECK(cudaMallocAsync(reinterpret_cast<void**>(&tmp), n * sizeof(float), s));
    fill<<<(n + 255) / 256, 256, 0, s>>>(tmp, 2.0f, n);
    CHECK(cudaMemsetAsync(out, 0, n * sizeof(float), s));
    saxpy<<<(n + 255) / 256, 256, 0, s>>>(3.0f, tmp, out, n);
    CHECK(cudaFreeAsync(tmp, s));
    CHECK(cudaStreamEndCapture(s, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int round = 0; round < 3; ++round) {
      CHECK(cudaGraphLaunch(exec, s));
      CHECK(cudaMemcpyAsync(host.data(), out, n * sizeof(float), cudaMemcpyDeviceToHost, s));
      CHECK(cudaStreamSynchronize(s));
      for (int i = 0; i < n; i += 991) {
        if (host[i] != 3.0f * (2.0f + static_cast<float>(i % 7))) {
          std::fprintf(stderr, "preload_program: graph replay %d: out[%d] = %f\n", round, i,
                       host[i]);
          return 1;
        }
      }
    }
    for (int k = 0; k < 100; ++k) {
      void* p = nullptr;
      CHECK(cudaMallocAsync(&p, 4096, s));
      CHECK(cudaFreeAsync(p, s));
    }
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    CHECK(cudaFree(out));
    std::printf("preload_program: graph with an allocation inside its capture: 3 replays right\n");
  }
  if (pairs > 0) {
    for (int rep = 0; rep < 3; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      for (long k = 0; k < pairs; ++k) {
        void* p = nullptr;
        CHECK(cudaMallocAsync(&p, 4096, s));
        CHECK(cudaFreeAsync(p, s));
      }
      const auto t1 = std::chrono::steady_clock::now();
      std::printf("preload_program: %ld pairs on a created stream: %.1f ns per pair\n", pairs,
                  std::chrono::duration<double, std::nano>(t1 - t0).count() /
                      static_cast<double>(pairs));
    }
    CHECK(cudaStreamSynchronize(s));
  }

  // 3. Pitched memory.
  const int width = 1000;
  const int height = 64;
  float* m = nullptr;
  size_t pitch = 0;
  CHECK(cudaMallocPitch(reinterpret_cast<void**>(&m), &pitch, width * sizeof(float), height));
  if (pitch < width * sizeof(float)) {
    std::fprintf(stderr, "preload_program: pitch %zu < row %zu\n", pitch, width * sizeof(float));
    return 1;
  }
  fill_rows<<<dim3((width + 255) / 256, height), 256>>>(m, pitch, width, height);
  std::vector<float> rows(static_cast<size_t>(width) * height);
  CHECK(cudaMemcpy2D(rows.data(), width * sizeof(float), m, pitch, width * sizeof(float), height,
                     cudaMemcpyDeviceToHost));
  for (int r = 0; r < height; ++r) {
    for (int c = 0; c < width; ++c) {
      if (rows[static_cast<size_t>(r) * width + c] != static_cast<float>(r * 1000 + c)) {
        std::fprintf(stderr, "preload_program: m[%d][%d] wrong\n", r, c);
        return 1;
      }
    }
  }

  // 4. Memory info is sane.
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  if (free_bytes > total_bytes || total_bytes == 0) {
    std::fprintf(stderr, "preload_program: cudaMemGetInfo %zu free of %zu\n", free_bytes,
                 total_bytes);
    return 1;
  }
  std::printf("preload_program: cudaMemGetInfo: %zu MiB free of %zu MiB\n", free_bytes >> 20,
              total_bytes >> 20);

  // 5. IPC on an allocation: the driver's handle, or under the shim a loud refusal.
  cudaIpcMemHandle_t handle;
  const cudaError_t ipc = cudaIpcGetMemHandle(&handle, m);
  std::printf("preload_program: cudaIpcGetMemHandle: %s\n", cudaGetErrorString(ipc));
  if (expect_ipc_refused && ipc == cudaSuccess) {
    std::fprintf(stderr, "preload_program: cudaIpcGetMemHandle on cucache memory succeeded\n");
    return 1;
  }
  static_cast<void>(cudaGetLastError());  // a refused IPC call is not sticky

  // 5b. cuMemGetAddressRange from inside an allocation, found as NCCL and CuPy find it (through
  // the runtime's driver entry point lookup, i.e. cuGetProcAddress): the allocation's own start
  // and at least its size -- the driver's answer for its own memory, and cucache's under the shim.
  {
    using range_fn = int (*)(unsigned long long*, size_t*, unsigned long long);
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    CHECK(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault,
                                           &found));
    if (fn == nullptr || found != cudaDriverEntryPointSuccess) {
      std::fprintf(stderr, "preload_program: no cuMemGetAddressRange entry point\n");
      return 1;
    }
    unsigned long long base = 0;
    size_t size = 0;
    const auto at = reinterpret_cast<unsigned long long>(m) + 100;
    const int rc = reinterpret_cast<range_fn>(fn)(&base, &size, at);
    std::printf("preload_program: cuMemGetAddressRange(m + 100): %d, base m%+lld, %zu bytes\n", rc,
                static_cast<long long>(base - reinterpret_cast<unsigned long long>(m)), size);
    if (rc != 0 || base != reinterpret_cast<unsigned long long>(m) || size < pitch * height) {
      std::fprintf(stderr, "preload_program: cuMemGetAddressRange is not the allocation's own\n");
      return 1;
    }
  }
  CHECK(cudaFree(m));

  // 6. A bad free gets the runtime's error, nothing else breaks.
  float* z = nullptr;
  CHECK(cudaMalloc(&z, 4096));
  const cudaError_t bad = cudaFree(z + 16);
  std::printf("preload_program: cudaFree(interior pointer): %s\n", cudaGetErrorString(bad));
  if (bad == cudaSuccess) {
    std::fprintf(stderr, "preload_program: an interior free succeeded\n");
    return 1;
  }
  static_cast<void>(cudaGetLastError());
  CHECK(cudaFree(z));
  CHECK(cudaStreamDestroy(s));
  CHECK(cudaDeviceSynchronize());
  if (reset) CHECK(cudaDeviceReset());
  std::printf("preload_program: OK\n");
  return 0;
}
