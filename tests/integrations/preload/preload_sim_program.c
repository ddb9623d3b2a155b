/* A plain CUDA program, in C, for the LD_PRELOAD shim on the simulated device
 * (preload_sim.sh): the runtime's allocation calls only, no kernel and no stream (without a
 * driver nothing else of the runtime works). Built twice: with the shared runtime (libcudart.so,
 * whose calls the shim answers with CUCACHE_BACKEND=sim) and with the static one (which cannot
 * run without a driver: the shim then says so at exit). Prints OK and exits 0 when every call
 * succeeded; otherwise the first failing call and its error, exit 1. */
#include <cuda_runtime_api.h>
#include <stdio.h>

static int check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return 0;
  printf("%s: %s\n", what, cudaGetErrorName(err));
  return 1;
}

int main(void) {
  void* a = NULL;
  void* b = NULL;
  void* c = NULL;
  size_t pitch = 0;
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  if (check(cudaMalloc(&a, 1 << 20), "cudaMalloc")) return 1;
  if (check(cudaMallocAsync(&b, 4096, 0), "cudaMallocAsync")) return 1;
  if (check(cudaMallocPitch(&c, &pitch, 1000, 8), "cudaMallocPitch")) return 1;
  if (pitch < 1000) {
    printf("cudaMallocPitch: pitch %zu < width 1000\n", pitch);
    return 1;
  }
  if (check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo")) return 1;
  if (total_bytes == 0 || free_bytes > total_bytes) {
    printf("cudaMemGetInfo: free %zu, total %zu\n", free_bytes, total_bytes);
    return 1;
  }
  if (check(cudaFreeAsync(b, 0), "cudaFreeAsync")) return 1;
  if (check(cudaFree(c), "cudaFree")) return 1;
  if (check(cudaFree(a), "cudaFree")) return 1;
  /* A second free of the same pointer is an error, as without the shim. */
  if (cudaFree(a) == cudaSuccess) {
    printf("double cudaFree succeeded\n");
    return 1;
  }
  printf("OK\n");
  return 0;
}
