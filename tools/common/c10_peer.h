/* The C interface of libcucache_c10_peer.so, a shim over PyTorch's CUDA caching allocator
 * (c10::cuda::CUDACachingAllocator) that cucache-replay loads with dlopen, so the replay tool
 * itself never links against PyTorch. Plain C so both sides agree without sharing a C++ ABI. */
#ifndef CUCACHE_C10_PEER_H
#define CUCACHE_C10_PEER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped on any change below; the replay refuses a shim of another version. */
#define CUCACHE_C10_PEER_ABI 1

/* Statistics of device 0, from c10's DeviceStats (aggregate pool). */
typedef struct cucache_c10_stats {
  int64_t reserved_bytes;
  int64_t peak_reserved_bytes;
  int64_t allocated_bytes;
  int64_t peak_allocated_bytes;
  int64_t peak_requested_bytes;
  int64_t num_device_alloc;
  int64_t num_device_free;
  int64_t num_alloc_retries;
  int64_t num_ooms;
} cucache_c10_stats;

typedef int (*cucache_peer_c10_abi_fn)(void);
typedef int (*cucache_peer_c10_init_fn)(const char* conf);
typedef void* (*cucache_peer_c10_alloc_fn)(size_t bytes, void* stream);
typedef void (*cucache_peer_c10_free_fn)(void* ptr);
typedef int (*cucache_peer_c10_set_memory_fraction_fn)(double fraction);
typedef int (*cucache_peer_c10_stats_fn)(cucache_c10_stats* out);
typedef int (*cucache_peer_c10_reset_fn)(void);
typedef const char* (*cucache_peer_c10_last_error_fn)(void);

/* CUCACHE_C10_PEER_ABI of the shim. */
int cucache_peer_c10_abi(void);
/* Applies `conf` (PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF syntax; NULL or "" = leave c10's settings alone) and
 * initializes the allocator for every visible device. 0 on success. */
int cucache_peer_c10_init(const char* conf);
/* raw_alloc_with_stream on the current device (0). NULL on failure: out of memory (counted in
 * num_ooms) or another error (see last_error). */
void* cucache_peer_c10_alloc(size_t bytes, void* stream);
/* raw_delete. Errors are kept for last_error. */
void cucache_peer_c10_free(void* ptr);
/* setMemoryFraction on device 0. 0 on success. */
int cucache_peer_c10_set_memory_fraction(double fraction);
/* Statistics of device 0. 0 on success. */
int cucache_peer_c10_stats(cucache_c10_stats* out);
/* Returns every cached segment (emptyCache) and resets peak and accumulated statistics of device
 * 0, so the next replay starts cold. 0 on success. */
int cucache_peer_c10_reset(void);
/* The message of the last failure on this thread; "" when none. */
const char* cucache_peer_c10_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* CUCACHE_C10_PEER_H */
