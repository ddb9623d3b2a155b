/* The C API from C99: allocate, free, statistics and the summary table. Runs on a GPU, or
 * anywhere with CUCACHE_BACKEND=sim (no memory is touched). */
#include <cucache/cucache.h>
#include <cuda_runtime_api.h>

#include <stdio.h>
#include <stdlib.h>

int main(void) {
  void* blocks[8];
  cudaError_t err = cudaSuccess;
  int i;
  size_t len;
  char* table;
  cucacheStats stats;

  /* Allocate, free, allocate again: the second round is served from cucache's cache. */
  for (int round = 0; round < 2; ++round) {
    for (i = 0; i < 8; ++i) {
      err = cucacheMallocAsync(&blocks[i], (size_t)1 << 20, 0);
      if (err != cudaSuccess) {
        fprintf(stderr, "c_api: cucacheMallocAsync: %s\n", cucacheGetLastErrorMessage());
        return 1;
      }
    }
    for (i = 0; i < 8; ++i) {
      err = cucacheFreeAsync(blocks[i], 0);
      if (err != cudaSuccess) {
        fprintf(stderr, "c_api: cucacheFreeAsync: %s\n", cucacheGetLastErrorMessage());
        return 1;
      }
    }
  }
  /* A pointer cucache never handed out is refused, and nothing changes. */
  if (cucacheFree(&err) != cudaErrorInvalidValue) {
    fprintf(stderr, "c_api: a foreign pointer was accepted\n");
    return 1;
  }

  if (cucacheGetStats(0, &stats) != cudaSuccess) {
    fprintf(stderr, "c_api: cucacheGetStats: %s\n", cucacheGetLastErrorMessage());
    return 1;
  }
  printf("16 allocations, %llu device allocations, %zu live\n", stats.deviceAllocCount,
         stats.allocationCount);

  len = cucacheMemorySummary(0, NULL, 0);
  table = (char*)malloc(len + 1);
  if (table == NULL || cucacheMemorySummary(0, table, len + 1) != len) return 1;
  fputs(table, stdout);
  free(table);
  return stats.allocationCount == 0 ? 0 : 1;
}
