// A small CUDA program: repeated y += 2x through a stream-ordered scratch buffer, checked on the
// host. port_before.cu allocates with the CUDA runtime; port_after.cu is the same file after the
// sed line in README.md, allocating with cucache.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
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

__global__ void scale(int n, float a, const float* x, float* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a * x[i];
}

__global__ void add(int n, const float* t, float* y) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] += t[i];
}

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: nothing to run\n");
    return 77;  // "skipped" to ctest
  }

  const int n = 1 << 20;
  const std::size_t bytes = n * sizeof(float);
  const int iterations = 100;
  std::vector<float> hx(n), hy(n);
  for (int i = 0; i < n; ++i) {
    hx[i] = static_cast<float>(i % 1000);
    hy[i] = 1.0f;
  }

  float* x = nullptr;
  float* y = nullptr;
  CHECK(cudaMalloc(&x, bytes));
  CHECK(cudaMalloc(&y, bytes));
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  CHECK(cudaMemcpyAsync(x, hx.data(), bytes, cudaMemcpyHostToDevice, stream));
  CHECK(cudaMemcpyAsync(y, hy.data(), bytes, cudaMemcpyHostToDevice, stream));

  // y += 2x, `iterations` times, each through a fresh scratch buffer: the allocation pattern a
  // caching allocator turns from a device call per iteration into a cache hit.
  const int threads = 256;
  const int blocks = (n + threads - 1) / threads;
  for (int it = 0; it < iterations; ++it) {
    float* scratch = nullptr;
    CHECK(cudaMallocAsync(&scratch, bytes, stream));
    scale<<<blocks, threads, 0, stream>>>(n, 2.0f, x, scratch);
    add<<<blocks, threads, 0, stream>>>(n, scratch, y);
    CHECK(cudaGetLastError());
    CHECK(cudaFreeAsync(scratch, stream));
  }

  CHECK(cudaMemcpyAsync(hy.data(), y, bytes, cudaMemcpyDeviceToHost, stream));
  CHECK(cudaStreamSynchronize(stream));
  int wrong = 0;
  for (int i = 0; i < n; ++i) {
    const float expected = 1.0f + 2.0f * static_cast<float>(iterations) * hx[i];
    if (std::fabs(hy[i] - expected) > 1e-3f * expected) ++wrong;
  }

  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  std::printf("%s: %d of %d results wrong; %zu MiB of %zu MiB free\n", wrong == 0 ? "ok" : "FAIL",
              wrong, n, free_bytes >> 20, total_bytes >> 20);

  CHECK(cudaFree(x));
  CHECK(cudaFree(y));
  CHECK(cudaStreamDestroy(stream));
  return wrong == 0 ? 0 : 1;
}
