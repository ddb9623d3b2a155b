/* The C interface of libcucache_torch.so, the plug-in that makes cucache PyTorch's CUDA allocator
 * through torch.cuda.memory.CUDAPluggableAllocator. Plain C so that ctypes
 * (python/cucache_torch.py) and torch's dlsym can use it; nothing here needs the CUDA or torch
 * headers. */
#ifndef CUCACHE_TORCH_H_
#define CUCACHE_TORCH_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CUCACHE_TORCH_API __attribute__((visibility("default")))

/* cudaStream_t without the CUDA headers: the same type, spelled by its struct. */
typedef struct CUstream_st* cucache_torch_stream;

/* One statistic: current value, peak since the last reset, sums of increases and decreases. */
typedef struct cucache_torch_stat {
  int64_t current;
  int64_t peak;
  int64_t allocated;
  int64_t freed;
} cucache_torch_stat;

/* Pools of the per-pool arrays: 0 all, 1 small (<= 1 MiB), 2 large. */
#define CUCACHE_TORCH_POOLS 3

/* The statistics of one device: cucache::device_stats flattened, field for field in the order of
 * its field table (include/cucache/stats.hpp, CUCACHE_STAT_*_FIELDS) under PyTorch's names;
 * torch_plugin.cpp fails to compile when the two differ. Byte counts unless named a count; see
 * stats.hpp for each field. cucache_torch_stats_layout() describes the layout for bindings. */
typedef struct cucache_torch_stats {
  cucache_torch_stat allocated_bytes[CUCACHE_TORCH_POOLS];
  cucache_torch_stat reserved_bytes[CUCACHE_TORCH_POOLS];
  cucache_torch_stat active_bytes[CUCACHE_TORCH_POOLS];
  cucache_torch_stat requested_bytes[CUCACHE_TORCH_POOLS];
  cucache_torch_stat inactive_split_bytes[CUCACHE_TORCH_POOLS];
  cucache_torch_stat allocation[CUCACHE_TORCH_POOLS];     /* counts */
  cucache_torch_stat segment[CUCACHE_TORCH_POOLS];        /* counts */
  cucache_torch_stat active[CUCACHE_TORCH_POOLS];         /* counts */
  cucache_torch_stat inactive_split[CUCACHE_TORCH_POOLS]; /* counts */
  uint64_t num_device_alloc;
  uint64_t num_device_free;
  uint64_t num_ooms;
  uint64_t num_alloc_retries;
  uint64_t oversize_allocations;
  uint64_t oversize_segments;
  uint64_t events_pending;
  uint64_t take_back_count; /* defer_coalescing: allocations that took back a held freed block */
  uint64_t vm_map_count;
  uint64_t vm_unmap_count;
  uint64_t stitched_pages;
  uint64_t shared_pages;
  uint64_t vm_sync_count;
  uint64_t vm_split_count;
  uint64_t vm_reclaim_count;
  uint64_t vm_host_ns; /* host nanoseconds in cuMemCreate/Map/SetAccess/Unmap/Release */
  uint64_t sync_host_ns; /* host nanoseconds in the pager's device synchronizations */
  uint64_t mapped_bytes;
  uint64_t unmapped_handle_bytes;
  uint64_t free_bytes;
  uint64_t free_block_count;
  uint64_t largest_free_block;
  uint64_t memory_limit;
  uint64_t device_total_bytes;
  uint64_t sleeping_bytes;      /* device bytes of sleeping tags' live blocks (released) */
  uint64_t sleeping_host_bytes; /* pinned host bytes holding their contents */
  double fragmentation_external;
  double fragmentation_overhead;
} cucache_torch_stats;

/* CUDAPluggableAllocator's alloc: `size` bytes on `device` for use on `stream`. Returns NULL for
 * size 0 (no error) and on failure, after storing the message (cucache_torch_last_error) and
 * printing it to stderr. Never throws unless CUCACHE_TORCH_OOM=throw is set (docs/torch.md). */
CUCACHE_TORCH_API void* cucache_torch_alloc(size_t size, int device, cucache_torch_stream stream);
/* CUDAPluggableAllocator's free. A `stream` other than the block's allocation stream orders the
 * free on it: the block is reused only after the work queued on `stream` now has completed. A
 * pointer cucache does not own, or one already freed, is reported to stderr and counted, never
 * fatal. NULL is a no-op. */
CUCACHE_TORCH_API void cucache_torch_free(void* ptr, size_t size, int device,
                                          cucache_torch_stream stream);
/* cucache_torch_free for callers that can raise (Python's cucache.free): 0, or -1 when the free
 * was refused (not cucache's, already freed, interior, a sleeping block), with the message in
 * cucache_torch_last_error, counted in cucache_torch_bad_free_count and not printed. */
CUCACHE_TORCH_API int cucache_torch_free_checked(void* ptr, size_t size, int device,
                                                 cucache_torch_stream stream);
/* Marks a live allocation as used on `stream` (tensor.record_stream). 0, or -1 on error. */
CUCACHE_TORCH_API int cucache_torch_record_stream(void* ptr, cucache_torch_stream stream);
/* Releases every wholly free cached segment of every device. 0, or -1 on error. */
CUCACHE_TORCH_API int cucache_torch_empty_cache(void);
/* Headroom: *out = the largest single allocation on `device` (legacy stream) that would succeed
 * now (device_allocator::max_allocatable; creates the device's allocator). 0, or -1 on error. */
CUCACHE_TORCH_API int cucache_torch_max_allocatable(int device, size_t* out);
/* Caches `bytes` of free memory on `device` now (device_allocator::reserve). 0, or -1 on error
 * (out of memory included). */
CUCACHE_TORCH_API int cucache_torch_reserve(int device, size_t bytes);
/* Resets peak statistics of `device` (every device when negative). 0, or -1 on error. */
CUCACHE_TORCH_API int cucache_torch_reset_peak_stats(int device);
/* Resets the total allocated/freed sums of `device` (every device when negative). 0, or -1. */
CUCACHE_TORCH_API int cucache_torch_reset_accumulated_stats(int device);
/* Caps what `device` may reserve at `fraction` of its memory, overriding CUCACHE_CONF's
 * memory_fraction (memory_limit_mb, when lower, still wins). Before the device's first allocation
 * or at any time after (memory reserved above a lowered cap is not given back: empty_cache does
 * that; no growth passes it; 0 allows nothing more): 0, or -1 when the fraction is not in
 * [0, 1]. */
CUCACHE_TORCH_API int cucache_torch_set_memory_fraction(int device, double fraction);
/* Changes the size rules from now on, as torch.cuda.memory._set_allocator_settings does:
 * max_split_size_mb, roundup_power2_divisions (both syntaxes) and garbage_collection_threshold
 * go back to their defaults, then take the values `conf` gives (max_non_split_rounding_mb keeps
 * its value unless given). Applies to every device's allocator that exists and to those created
 * later; cached blocks stay. 0, or -1 (nothing changed, the reason in cucache_torch_last_error())
 * when `conf` names another key or a value cucache refuses. */
CUCACHE_TORCH_API int cucache_torch_set_size_rules(const char* conf);
/* CUDA graph pools (PyTorch's MempoolId_t is the pair {first, second}; docs/design.md, "Graph
 * capture"). A capture's allocations come from a private pool that only allocations routed to it
 * ever get, until it is released. The filter decides which streams' allocations are routed (it is
 * called with cucache's locks held and must not call cucache); ctx is passed to it and, when the
 * route ends, to ctx_free (either may be NULL). Each returns 0, or -1 with the reason in
 * cucache_torch_last_error(). */
typedef int (*cucache_torch_stream_filter)(void* ctx, cucache_torch_stream stream);
/* beginAllocateToPool: routes `device`'s allocations accepted by filter to the pool, creating it
 * or adding an owner. */
CUCACHE_TORCH_API int cucache_torch_begin_allocate_to_pool(int device, uint64_t first,
                                                           uint64_t second,
                                                           cucache_torch_stream_filter filter,
                                                           void* ctx, void (*ctx_free)(void*));
/* endAllocateToPool: ends the route (the capture has ended). */
CUCACHE_TORCH_API int cucache_torch_end_allocate_to_pool(int device, uint64_t first,
                                                         uint64_t second);
/* releasePool: drops an owner; with the last, the pool's memory goes back after a device
 * synchronization (at once, or when no capture is underway). A pool cucache never saw: 0. */
CUCACHE_TORCH_API int cucache_torch_release_pool(int device, uint64_t first, uint64_t second);
/* The captures-announced mode (docs/design.md, "Announced captures") of every device's
 * allocator, on (1) or off (0): the torch extension turns it on, since PyTorch routes each of its
 * captures (beginAllocateToPool before the capture begins, endAllocateToPool after it ended), and
 * an allocation on a created stream then asks no capture status while no route is active. A
 * capture PyTorch does not route fails at its first allocation on a created stream (cuda error
 * 901, the capture invalidated). 0, or -1 with the reason in cucache_torch_last_error(). */
CUCACHE_TORCH_API int cucache_torch_set_captures_announced(int on);
/* --- The torch extension's calls (libcucache_torch_hooks.so, torch_allocator.cpp) -------------
 * Nothing below prints: every failure is returned, its message in cucache_torch_last_error(). */

/* What an allocation met (cucache_torch_try_alloc's answer, cucache_torch_last_alloc_error): */
enum {
  CUCACHE_TORCH_ALLOC_OK = 0,
  CUCACHE_TORCH_ALLOC_OUT_OF_MEMORY = 1,    /* no room after the whole out-of-memory ladder */
  CUCACHE_TORCH_ALLOC_INVALID_ARGUMENT = 2, /* a misuse: e.g. allocating under a sleeping tag */
  CUCACHE_TORCH_ALLOC_OTHER_ERROR = 3       /* a device error, an unusable device, ... */
};
/* Allocates `size` bytes on `device` for `stream` into *out (NULL for size 0, with OK). Prints
 * nothing; on failure *out is NULL and the kind is returned, the message stored. */
CUCACHE_TORCH_API int cucache_torch_try_alloc(size_t size, int device, cucache_torch_stream stream,
                                              void** out);
/* torch's raw_delete: frees a live allocation in the order of its own stream (the stream it was
 * allocated on), whichever device holds it. 0; -1 with the reason (unknown, interior, already
 * freed, a sleeping tag's block), the allocator unchanged, nothing printed. NULL: 0. */
CUCACHE_TORCH_API int cucache_torch_delete(void* ptr);

/* Graph pools, PyTorch's semantics (docs/torch.md, "CUDA graphs"). Each returns 0, or -1 with the
 * reason. createOrIncrefPool: one more owner, creating the pool with one. */
CUCACHE_TORCH_API int cucache_torch_create_or_incref_pool(int device, uint64_t first,
                                                          uint64_t second);
/* getPoolUseCount: *out = the pool's owners, 0 for a pool cucache does not know. */
CUCACHE_TORCH_API int cucache_torch_pool_use_count(int device, uint64_t first, uint64_t second,
                                                   uint64_t* out);
/* The pool's allocated blocks: fn(ctx, ptr) once each, in address order. -1 for an unknown pool
 * ("no graph pool (first, second) on device N"). */
CUCACHE_TORCH_API int cucache_torch_pool_live_allocations(int device, uint64_t first,
                                                          uint64_t second,
                                                          void (*fn)(void* ctx, void* ptr),
                                                          void* ctx);
/* releases the pool's wholly free cached segments (emptyCache of one MemPool), after a device
 * synchronization. */
CUCACHE_TORCH_API int cucache_torch_empty_pool_cache(int device, uint64_t first, uint64_t second);
/* setNoSplit (MemPool(no_split=True)): the pool's blocks are never split; each allocation takes a
 * block of its own. 0, or -1 with the reason (refused until the core supports it). */
CUCACHE_TORCH_API int cucache_torch_set_pool_no_split(int device, uint64_t first, uint64_t second);
/* A pool's state for cudagraph trees (getCheckpointState): its segments and live blocks. Opaque;
 * NULL on failure. Free with cucache_torch_checkpoint_free (NULL: no-op). */
typedef struct cucache_torch_checkpoint cucache_torch_checkpoint;
CUCACHE_TORCH_API cucache_torch_checkpoint* cucache_torch_checkpoint_pool(int device,
                                                                          uint64_t first,
                                                                          uint64_t second);
CUCACHE_TORCH_API void cucache_torch_checkpoint_free(cucache_torch_checkpoint* cp);
/* The live blocks a checkpoint holds (for tests and the extension's bookkeeping). */
CUCACHE_TORCH_API size_t cucache_torch_checkpoint_live_count(const cucache_torch_checkpoint* cp);
/* setCheckpointPoolState: frees the pool's live blocks (freed(ctx, ptr) for each), then allocates
 * the checkpoint's live blocks at their addresses (allocated(ctx, ptr, size, requested, stream)
 * for each); either callback may be NULL. 0, or -1 with the reason. */
CUCACHE_TORCH_API int cucache_torch_restore_pool(
    int device, const cucache_torch_checkpoint* cp, void (*freed)(void* ctx, void* ptr),
    void (*allocated)(void* ctx, void* ptr, size_t size, size_t requested,
                      cucache_torch_stream stream),
    void* ctx);

/* One block / mapped run / segment as cucache_torch_segments lists them. */
enum { CUCACHE_TORCH_BLOCK_ALLOCATED = 0, CUCACHE_TORCH_BLOCK_PENDING = 1, CUCACHE_TORCH_BLOCK_FREE = 2 };
typedef struct cucache_torch_block_info {
  uint64_t address;
  uint64_t size;      /* bytes it spans */
  uint64_t requested; /* the caller's size when allocated, else 0 */
  int32_t state;      /* CUCACHE_TORCH_BLOCK_* (pending: freed, waiting for other streams) */
  int32_t reserved_;
} cucache_torch_block_info;
typedef struct cucache_torch_mapping_info {
  uint64_t address;
  uint64_t size;
} cucache_torch_mapping_info;
typedef struct cucache_torch_segment_info {
  uint64_t address;
  uint64_t size; /* the whole range (expandable: reserved virtual space, mappings say what is mapped) */
  cucache_torch_stream stream;
  int32_t small;
  int32_t expandable;
  uint64_t pool_first; /* {0, 0}: ordinary memory */
  uint64_t pool_second;
  const cucache_torch_block_info* blocks; /* tiling the range, in address order */
  size_t block_count;
  const cucache_torch_mapping_info* mappings; /* expandable: mapped runs in address order */
  size_t mapping_count;
} cucache_torch_segment_info;
/* Calls fn(ctx, segment) for every segment of `device`, taken consistently under all locks
 * (fn runs after they are released and may call cucache); a nonzero return of fn stops the walk.
 * An unused device has none. 0, or -1 with the reason. */
CUCACHE_TORCH_API int cucache_torch_segments(int device,
                                             int (*fn)(void* ctx,
                                                       const cucache_torch_segment_info* segment),
                                             void* ctx);
/* getBaseAllocation: the segment (an expandable range: its mapped run) holding `ptr`, *base and
 * *size. -1 when no cucache segment holds it. */
CUCACHE_TORCH_API int cucache_torch_base_allocation(const void* ptr, void** base, size_t* size);

/* IPC of a live allocation (include/cucache/ipc.h; docs/api.md "IPC"). export fills `handle`
 * (a cucacheIpcHandle, `handle_size` bytes) for `ptr`; file descriptors of an expandable block
 * stay open in this process (the latest 256 exports' are kept, older ones closed) so that an
 * importer can duplicate them with pidfd_getfd. open maps a handle: with `fds_of_exporter` 1 its
 * descriptors are the exporter's numbers, duplicated from process `pid` (pidfd_open +
 * pidfd_getfd, which needs ptrace permission on the exporter), else they are this process's;
 * `handle` is a cucacheIpcHandle or a cucacheIpcLongHandle (cucache_torch_ipc_export_long);
 * *out = the block's address. close undoes one open. 0, or -1 with the reason. */
CUCACHE_TORCH_API int cucache_torch_ipc_export(void* ptr, void* handle, size_t handle_size);
CUCACHE_TORCH_API int cucache_torch_ipc_open(const void* handle, size_t handle_size,
                                             int fds_of_exporter, void** out);
CUCACHE_TORCH_API int cucache_torch_ipc_close(void* ptr);
/* sizeof(cucacheIpcHandle), for bindings that do not include cucache/ipc.h. */
CUCACHE_TORCH_API size_t cucache_torch_ipc_handle_size(void);
/* The variable-length form, for a block of any number of physical handles (an expandable block
 * past CUCACHE_IPC_MAX_PIECES, which cucache_torch_ipc_export refuses): *handle = a malloc'd
 * cucacheIpcLongHandle of *handle_size bytes (free it with cucache_torch_ipc_free), its fds kept
 * open here as export's are. cucache_torch_ipc_open takes it (it tells the forms apart by the
 * magic and checks the size exactly). 0, or -1 with the reason. */
CUCACHE_TORCH_API int cucache_torch_ipc_export_long(void* ptr, void** handle, size_t* handle_size);
CUCACHE_TORCH_API void cucache_torch_ipc_free(void* handle);

/* Memory fraction at any time: *out = the cap of `device` as a fraction of its memory, 1.0 when
 * none is set (PyTorch's answer). (cucache_torch_set_memory_fraction sets it.) */
CUCACHE_TORCH_API int cucache_torch_get_memory_fraction(int device, double* out);

/* Segment events: fn(ctx, device, event, base, bytes, stream) for every segment a device
 * allocator creates (CUCACHE_TORCH_SEGMENT_ALLOC) or returns to the device (..._FREE) and, in
 * expandable mode, every run of pages it maps and makes accessible (..._MAP) or every mapping it
 * is about to unmap (..._UNMAP) -- PyTorch's SEGMENT_ALLOC/FREE/MAP/UNMAP trace entries -- from
 * now on, on every device (it turns the allocators' observers on). Runs under the allocator's
 * pool lock: quick, and no call into cucache. NULL clears it. 0, or -1. */
#define CUCACHE_TORCH_SEGMENT_ALLOC 0
#define CUCACHE_TORCH_SEGMENT_FREE 1
#define CUCACHE_TORCH_SEGMENT_MAP 2
#define CUCACHE_TORCH_SEGMENT_UNMAP 3
typedef void (*cucache_torch_segment_listener)(void* ctx, int device, int event, uint64_t base,
                                               uint64_t bytes, cucache_torch_stream stream);
CUCACHE_TORCH_API int cucache_torch_set_segment_listener(cucache_torch_segment_listener fn,
                                                         void* ctx);

/* Fills *out with the statistics of `device` (all zero for a device not used yet). 0, or -1 (a
 * device that does not exist included: cudaErrorInvalidDevice). The text, snapshot, tag and reset
 * functions below refuse such a device too (reset: a negative device means every device). */
CUCACHE_TORCH_API int cucache_torch_get_stats(int device, cucache_torch_stats* out);
/* sizeof(cucache_torch_stats), for bindings to check their copy of the layout. */
CUCACHE_TORCH_API size_t cucache_torch_stats_size(void);
/* The layout of cucache_torch_stats, from the field table: one line per field,
 * "NAME OFFSET SIZE TYPE\n", TYPE one of stat[3] (cucache_torch_stat[CUCACHE_TORCH_POOLS]), u64,
 * f64, in order. python/cucache/_lib.py checks its ctypes copy against it. Never NULL. */
CUCACHE_TORCH_API const char* cucache_torch_stats_layout(void);
/* The text table of memory_summary / the JSON snapshot of `device`. Both copy at most len - 1
 * bytes and a terminating NUL into buf (buf may be NULL when len is 0) and return the full text's
 * length without the NUL: a return >= len means buf was too small. -1 on error. */
CUCACHE_TORCH_API int64_t cucache_torch_memory_summary(int device, char* buf, size_t len);
CUCACHE_TORCH_API int64_t cucache_torch_snapshot_json(int device, char* buf, size_t len);

/* Snapshots, leak hunting and tags (docs/api.md, cucache/observe.hpp): 0 on success, -1 on failure
 * (cucache_torch_last_error says why). write_snapshot writes PyTorch's snapshot schema as JSON to
 * `path` (temporary file, then renamed); leak_report and tag_stats copy JSON as memory_summary
 * does and return its whole length, -1 on failure. */
CUCACHE_TORCH_API int cucache_torch_write_snapshot(const char* path);
CUCACHE_TORCH_API int cucache_torch_mark_step(void);
CUCACHE_TORCH_API int64_t cucache_torch_leak_report(uint64_t steps, char* buf, size_t len);
CUCACHE_TORCH_API int cucache_torch_push_tag(const char* tag);
CUCACHE_TORCH_API int cucache_torch_pop_tag(void);
CUCACHE_TORCH_API int64_t cucache_torch_tag_stats(int device, char* buf, size_t len);
/* Tag limits (cucache::set_tag_limit; docs/api.md, "Tag limits"): UINT64_MAX is no limit. An
 * allocation refused by a limit fails as out of memory (CUCACHE_TORCH_ALLOC_OUT_OF_MEMORY). 0, or
 * -1 with the reason (empty tag, a device that does not exist). */
CUCACHE_TORCH_API int cucache_torch_set_tag_limit(int device, const char* tag, uint64_t bytes);
CUCACHE_TORCH_API int cucache_torch_tag_limit(int device, const char* tag, uint64_t* bytes);
/* cucache::metrics() (Prometheus' text format), copied as tag_stats copies its JSON. */
CUCACHE_TORCH_API int64_t cucache_torch_metrics(char* buf, size_t len);
/* Sleep and wake (docs/api.md, "Sleep and wake"; expandable segments): 0 on success, -1 on
 * failure with nothing changed (cucache_torch_last_error says why). sleeping copies a JSON array of {tag, bytes, host_bytes,
 * copy_seconds} as
 * tag_stats does. */
CUCACHE_TORCH_API int cucache_torch_make_sleepable(const char* tag);
CUCACHE_TORCH_API int cucache_torch_sleep(int device, const char* tag, int keep_contents);
/* prepare_sleep: pins ahead the host buffer of the tag's next kept sleep (at least `bytes`, and
 * at least the tag's allocated bytes now); *pinned (when not NULL) gets the buffer's size. */
CUCACHE_TORCH_API int cucache_torch_prepare_sleep(int device, const char* tag, uint64_t bytes,
                                                  uint64_t* pinned);
/* wake: *copy_seconds (when not NULL) gets the seconds its host-to-device copies took. */
CUCACHE_TORCH_API int cucache_torch_wake(int device, const char* tag, double* copy_seconds);
/* sleep_tags / wake_tags: several tags in one call (docs/api.md, "Sleep and wake": every tag
 * checked first, any refusal changes nothing; wake is all or none). *copy_seconds (when not
 * NULL) gets the seconds of the call's host-to-device copies. */
CUCACHE_TORCH_API int cucache_torch_sleep_tags(int device, const char* const* tags,
                                               const int* keep_contents, size_t count);
CUCACHE_TORCH_API int cucache_torch_wake_tags(int device, const char* const* tags, size_t count,
                                              double* copy_seconds);
CUCACHE_TORCH_API int64_t cucache_torch_sleeping(int device, char* buf, size_t len);
/* Whether cucache can serve `device` (any device when negative), building the process registry
 * from the environment if need be: CUCACHE_TORCH_READY, or the kind of failure, its message in
 * cucache_torch_last_error(). The Python package turns these into ValueError (configuration,
 * invalid device) and RuntimeError (no usable CUDA driver or device, a forked child). */
enum {
  CUCACHE_TORCH_READY = 0,
  CUCACHE_TORCH_CONFIG_ERROR = 1,   /* CUCACHE_CONF, CUCACHE_BACKEND or CUCACHE_SIM_DEVICES */
  CUCACHE_TORCH_NO_CUDA = 2,        /* no usable driver or device (cudaGetDeviceCount's reason) */
  CUCACHE_TORCH_INVALID_DEVICE = 3, /* `device` is not one of the process's devices */
  CUCACHE_TORCH_OTHER_ERROR = 4     /* anything else, e.g. a child forked after cucache was used */
};
CUCACHE_TORCH_API int cucache_torch_check_device(int device);
/* The number of devices cucache sees (building the registry), or -1 with the reason stored. */
CUCACHE_TORCH_API int cucache_torch_device_count(void);
/* The canonical form of a CUCACHE_CONF text (only what differs from the defaults, in a fixed
 * order), or with conf NULL that of the configuration the process's allocators use. Copies as
 * memory_summary does; -1 when the text is not a valid configuration (the message names the key). */
CUCACHE_TORCH_API int64_t cucache_torch_canonical_conf(const char* conf, char* buf, size_t len);
/* What the calling thread's last cucache_torch_alloc met (the kinds above): OK (it succeeded
 * or was never called), OUT_OF_MEMORY (the Python package's MemoryError), INVALID_ARGUMENT
 * (ValueError) or OTHER_ERROR (RuntimeError). */
CUCACHE_TORCH_API int cucache_torch_last_alloc_error(void);
/* The message of the latest failure in any thread ("" if none). Valid in the calling thread until
 * its next call of this function. */
CUCACHE_TORCH_API const char* cucache_torch_last_error(void);
/* Stores `message` as the latest error (for the hooks library, which reports through this one). */
CUCACHE_TORCH_API void cucache_torch_set_error(const char* message);
/* Frees of unknown or already freed pointers seen so far. */
CUCACHE_TORCH_API uint64_t cucache_torch_bad_free_count(void);
/* "cuda" or "sim" (CUCACHE_BACKEND=sim). */
CUCACHE_TORCH_API const char* cucache_torch_backend_name(void);
/* Test hook: completes every event recorded so far on the simulated devices, as if every stream
 * had caught up. 0, or -1 with the CUDA backend. */
CUCACHE_TORCH_API int cucache_torch_sim_complete_all(void);

#ifdef __cplusplus
}
#endif

#endif /* CUCACHE_TORCH_H_ */
