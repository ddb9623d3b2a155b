/* The C API of cucache: drop-in replacements for cudaMalloc, cudaFree, cudaMallocAsync,
 * cudaFreeAsync and cudaMemGetInfo with the runtime's shapes and error codes, plus statistics.
 * Usable from C and C++; no exception ever crosses it. See docs/api.md. */
#pragma once

#include <stddef.h>

#include <cuda_runtime_api.h>

#include "cucache/ipc.h"

#ifdef __cplusplus
#define CUCACHE_NOEXCEPT noexcept
extern "C" {
#else
#define CUCACHE_NOEXCEPT
#endif

/* Error codes common to every function returning cudaError_t:
 *   cudaSuccess                   the call did what it says.
 *   cudaErrorInvalidValue         a null out-pointer, or a pointer that is not the start of a live
 *                                 cucache allocation (unknown, interior, already freed).
 *   cudaErrorMemoryAllocation     the device is out of memory after cucache released its cache
 *                                 (cucacheGetLastErrorMessage() then holds the out-of-memory
 *                                 report), or the host could not allocate.
 *   cudaErrorInitializationError  CUCACHE_BACKEND or CUCACHE_CONF is malformed, or the trace file
 *                                 CUCACHE_CONF names cannot be created. Nothing is cached: fix the
 *                                 environment and call again.
 *   cudaErrorInvalidDevice        a device ordinal that does not exist.
 *   any other cudaError_t         what the CUDA runtime answered, e.g. cudaErrorInsufficientDriver
 *                                 or cudaErrorNoDevice on a machine without a usable GPU.
 *   cudaErrorUnknown              an unexpected internal failure.
 * On failure cucacheGetLastErrorMessage() says what went wrong. */

/** Statistics of one device's allocator (cucacheGetStats). Bytes unless named a count. "Peak"
 * values are the highest since the process started or the last cucacheResetPeakStats. A fixed
 * subset of cucache::device_stats (cucache/stats.hpp, docs/design.md "Statistics"); the names
 * and order of these fields do not change. */
typedef struct cucacheStats {
  size_t allocatedBytes;     /* in blocks handed to callers (sizes as rounded by cucache) */
  size_t allocatedBytesPeak; /* upper bound when several streams allocate (per-stream peaks add) */
  size_t reservedBytes;      /* device memory cucache holds (segments or physical handles) */
  size_t reservedBytesPeak;  /* exact */
  size_t activeBytes;        /* allocated, plus freed blocks still waiting for other streams */
  size_t activeBytesPeak;    /* upper bound with several streams, as allocatedBytesPeak */
  size_t requestedBytes;     /* the sizes callers asked for */
  size_t requestedBytesPeak; /* upper bound with several streams, as allocatedBytesPeak */
  size_t cachedFreeBytes;    /* reserved - active: cached memory ready for reuse */
  size_t largestFreeBlock;   /* the largest request served from the cache without a new device
                                allocation (on the stream holding it; docs/design.md) */
  size_t allocationCount;    /* live allocations */
  size_t segmentCount;       /* live segments (expandable mode: virtual ranges holding memory) */
  unsigned long long deviceAllocCount; /* device allocations made: cudaMalloc, or cuMemCreate with
                                          expandable segments (calls that succeeded) */
  unsigned long long deviceFreeCount;  /* device allocations released: cudaFree / cuMemRelease */
  unsigned long long oomCount;         /* allocations that failed with cudaErrorMemoryAllocation */
  unsigned long long allocRetryCount;  /* times cucache released its cache and retried */
  double externalFragmentation; /* 1 - largestFreeBlock / cachedFreeBytes; 0 when none cached */
  double overheadFragmentation; /* share of reservedBytes no caller's block uses (cached, or freed
                                   and waiting on events); 1 - allocatedBytes / reservedBytes while
                                   no tag sleeps (a sleeping tag's blocks count on neither side);
                                   in [0, 1]; 0 when none reserved */
  size_t memoryLimit;           /* cap on reservedBytes (CUCACHE_CONF); 0 = none */
  size_t deviceTotalBytes;      /* the device's total memory */
  size_t sleepingBytes;         /* device bytes of sleeping tags' live blocks (cucacheSleep) */
  size_t sleepingHostBytes;     /* pinned host bytes holding their contents (keepContents) */
} cucacheStats;

/** Allocates `size` bytes on the current device, as cudaMalloc. size == 0: cudaSuccess with
 * *devPtr = NULL. On failure *devPtr is set to NULL (when devPtr is not NULL).
 * The memory belongs to the default stream: once freed, the next allocation may reuse it at once,
 * which is safe for work on blocking streams; for work on non-blocking streams, see
 * cucacheRecordStream and cucacheFreeAsync.
 * Errors: cudaErrorInvalidValue (devPtr NULL), cudaErrorMemoryAllocation,
 * cudaErrorInitializationError, CUDA runtime errors (no driver, no device). */
cudaError_t cucacheMalloc(void** devPtr, size_t size) CUCACHE_NOEXCEPT;

/** Allocates `size` bytes on the current device for use on `stream`, as cudaMallocAsync. The
 * memory is ready at once (no work is queued); reuse after cucacheFreeAsync follows the stream's
 * order. Errors as cucacheMalloc. */
cudaError_t cucacheMallocAsync(void** devPtr, size_t size, cudaStream_t stream) CUCACHE_NOEXCEPT;

/** Returns memory from cucacheMalloc/cucacheMallocAsync (of any device) to cucache's cache.
 * Unlike cudaFree it does not synchronize: the memory may be reused by the next allocation on its
 * stream. NULL: cudaSuccess, no-op.
 * Errors: cudaErrorInvalidValue (not the start of a live cucache allocation: unknown, interior or
 * already freed; nothing changes). */
cudaError_t cucacheFree(void* devPtr) CUCACHE_NOEXCEPT;

/** Frees in the order of `stream`, as cudaFreeAsync: the memory is reused only after the work
 * queued on `stream` so far. NULL: cudaSuccess. Errors as cucacheFree. */
cudaError_t cucacheFreeAsync(void* devPtr, cudaStream_t stream) CUCACHE_NOEXCEPT;

/** Declares that the live allocation devPtr is also used on `stream`: when freed, it is not reused
 * until the work queued on `stream` at free time has completed (PyTorch's record_stream).
 * Errors: cudaErrorInvalidValue (NULL, or not the start of a live cucache allocation). */
cudaError_t cucacheRecordStream(void* devPtr, cudaStream_t stream) CUCACHE_NOEXCEPT;

/** Memory of the current device as cucache sees it, in cudaMemGetInfo's shape:
 * *free = the device's free memory + the bytes cached in cucache's free blocks (memory
 * cucacheMalloc can hand out without another process giving any back); *total = the device's
 * total memory. With a memory limit (CUCACHE_CONF memory_limit / memory_fraction), *total is the
 * limit and *free at most limit - activeBytes. The two figures are read a moment apart, so under
 * concurrent allocation they are approximate.
 * Errors: cudaErrorInvalidValue (free or total NULL), cudaErrorInitializationError, CUDA runtime
 * errors. */
cudaError_t cucacheMemGetInfo(size_t* free, size_t* total) CUCACHE_NOEXCEPT;

/** Waits for pending stream-ordered frees and returns every wholly free cached segment of every
 * device to CUDA (PyTorch's empty_cache). Live allocations are untouched. cudaSuccess when
 * nothing was ever allocated. Errors: CUDA runtime errors. */
cudaError_t cucacheEmptyCache(void) CUCACHE_NOEXCEPT;

/** Headroom: *bytes = the largest single cucacheMalloc on the current device (legacy stream) that
 * would succeed now -- from a cached free block, or from new memory once the out-of-memory path
 * gave back what it may (free segments, idle pages), under the device's free memory and the memory
 * limit. Waits for pending stream-ordered frees first. Exact on the simulated device; on a GPU
 * other processes may take memory meanwhile. Errors: cudaErrorInvalidValue (bytes NULL),
 * cudaErrorInitializationError, CUDA runtime errors. */
cudaError_t cucacheMaxAllocatable(size_t* bytes) CUCACHE_NOEXCEPT;
/** Caches `bytes` of free memory on the current device (legacy stream) now, so that the first
 * allocations make no device call: one segment, or mapped pages with expandable segments (as
 * CUCACHE_CONF reserve_mb:N does at the allocator's creation). Reserved memory is ordinary cached
 * memory: cucacheEmptyCache gives it back. Errors: cudaErrorMemoryAllocation (no room),
 * cudaErrorInitializationError, CUDA runtime errors. */
cudaError_t cucacheReserve(size_t bytes) CUCACHE_NOEXCEPT;

/** CUDA graphs. An allocation on a stream that is being captured (cudaStreamBeginCapture) comes
 * from a private pool of that capture, which nobody else gets while a graph replays on it; a free
 * inside the capture returns memory to that pool, and a block of another pool freed (or used) on
 * the capturing stream is held for the graph. While cucache knows of a capture it never
 * synchronizes the device (cucacheEmptyCache then returns cudaErrorStreamCaptureUnsupported).
 * `captureId` is cudaStreamGetCaptureInfo's id; both calls act on the current device.
 *
 * After cudaStreamEndCapture: tells cucache the capture has ended, so that it may synchronize
 * the device again (it also finds out by itself at the next allocation on that stream).
 * Errors: cudaErrorInvalidValue (no such capture known). */
cudaError_t cucacheGraphCaptureEnded(unsigned long long captureId) CUCACHE_NOEXCEPT;
/** Once no graph of the capture will run again (after cudaGraphExecDestroy): its pool's memory
 * and the blocks held for it go back to the cache (free blocks) and the device (free segments),
 * after one device synchronization. Errors: cudaErrorInvalidValue (no such pool, or released
 * already). */
cudaError_t cucacheGraphPoolRelease(unsigned long long captureId) CUCACHE_NOEXCEPT;

/** Fills *stats for `device` (creating its allocator if needed).
 * Errors: cudaErrorInvalidValue (stats NULL), cudaErrorInvalidDevice,
 * cudaErrorInitializationError, CUDA runtime errors. */
cudaError_t cucacheGetStats(int device, cucacheStats* stats) CUCACHE_NOEXCEPT;

/** Resets every peak of `device` to its current value.
 * Errors: cudaErrorInvalidDevice, cudaErrorInitializationError, CUDA runtime errors. */
cudaError_t cucacheResetPeakStats(int device) CUCACHE_NOEXCEPT;

/** Writes the PyTorch-style statistics table of `device` into buf, as snprintf does: at most
 * len - 1 characters and a terminating NUL (nothing when len == 0; buf may then be NULL).
 * Returns the length of the whole table (without the NUL): call with len == 0 to size a buffer;
 * the text was cut when the result is >= len. Returns 0 on failure (the table is never empty):
 * an invalid device, buf NULL with len > 0, or any error of cucacheGetStats; then
 * cucacheGetLastErrorMessage() says why. */
size_t cucacheMemorySummary(int device, char* buf, size_t len) CUCACHE_NOEXCEPT;

/** Seeing where the memory goes (docs/api.md, "Snapshots, leaks and tags").
 *
 * Writes a snapshot of every device's segments and blocks, and (CUCACHE_CONF history:N) the
 * last N events of each device, to `path` as JSON in the schema of PyTorch's
 * torch.cuda.memory._snapshot() (the Python package turns it into the pickle memory_viz reads).
 * The file is written under a temporary name and renamed: nothing partial is left at `path`.
 * Errors: cudaErrorInvalidValue (path NULL, or the file cannot be written: the message names
 * it), cudaErrorInitializationError. */
cudaError_t cucacheSnapshot(const char* path) CUCACHE_NOEXCEPT;

/** Ends a step of the program's loop, for leak hunting (CUCACHE_CONF leak_steps:K).
 * Errors: cudaErrorInvalidValue (leak hunting is off), cudaErrorInitializationError. */
cudaError_t cucacheStepMarker(void) CUCACHE_NOEXCEPT;

/** Writes the leak candidates as JSON into buf, as cucacheMemorySummary writes its table:
 * {"step": S, "steps": K, "candidates": [{device, address, size, stream, tag, step, steps_alive,
 * frames}]} -- allocations alive for more than K steps (K = `steps`, or leak_steps when 0) on a
 * device whose live total grew over the last K steps, largest first. Returns the length of the
 * whole text, 0 on failure: leak hunting off, no step marked yet, steps == 0 without leak_steps,
 * buf NULL with len > 0 (cucacheGetLastErrorMessage() says which). */
size_t cucacheLeakReport(unsigned long long steps, char* buf, size_t len) CUCACHE_NOEXCEPT;

/** Makes `tag` the calling thread's current tag (tags nest): allocations made on this thread
 * until the matching cucachePopTag count for it in cucacheGetTagStats, snapshots and leak reports.
 * Errors: cudaErrorInvalidValue (tag NULL or empty). */
cudaError_t cucachePushTag(const char* tag) CUCACHE_NOEXCEPT;
/** Ends the calling thread's current tag. Errors: cudaErrorInvalidValue (no tag pushed). */
cudaError_t cucachePopTag(void) CUCACHE_NOEXCEPT;
/** Bytes (the sizes callers asked for) of live allocations made under `tag` on `device` now,
 * and their peak since the process started; 0 and 0 for a tag that never allocated there.
 * Errors: cudaErrorInvalidValue (a NULL argument), cudaErrorInitializationError. */
cudaError_t cucacheGetTagStats(int device, const char* tag, size_t* currentBytes,
                               size_t* peakBytes) CUCACHE_NOEXCEPT;
/** No limit on a tag (cucacheSetTagLimit, cucacheGetTagLimit). */
#define CUCACHE_NO_TAG_LIMIT ((size_t)-1)
/** Tag limits (docs/api.md, "Tag limits"). Limits the bytes `tag` may hold on `device`: from now
 * on, an allocation made under the tag on that device that would take its use -- the bytes callers
 * asked for, of its live allocations, as cucacheGetTagStats counts them -- past `bytes` fails with
 * cudaErrorMemoryAllocation, nothing allocated and nothing else changed;
 * cucacheGetLastErrorMessage() names the tag, its limit, its use and the request. Per device, as
 * tag statistics are. A limit below the tag's use is accepted: what it holds stays, and its
 * allocations fail until frees bring it under. CUCACHE_NO_TAG_LIMIT removes the limit; 0 lets
 * nothing be allocated under the tag. Exact under threads for the allocations that start after
 * the call returns.
 * Errors: cudaErrorInvalidValue (tag NULL or empty), cudaErrorInvalidDevice,
 * cudaErrorInitializationError. */
cudaError_t cucacheSetTagLimit(int device, const char* tag, size_t bytes) CUCACHE_NOEXCEPT;
/** *bytes = the limit of `tag` on `device`, CUCACHE_NO_TAG_LIMIT when none. Errors as
 * cucacheSetTagLimit, and cudaErrorInvalidValue for bytes NULL. */
cudaError_t cucacheGetTagLimit(int device, const char* tag, size_t* bytes) CUCACHE_NOEXCEPT;

/** Metrics (docs/api.md, "Metrics"): every statistics field of every device allocator created so
 * far, per device, pool kind and tag, in Prometheus' text exposition format (0.0.4), the body of
 * a /metrics answer. *needed = the size of the whole text with its terminating NUL. When `size`
 * >= *needed, the text and its NUL are written to buf. Otherwise nothing is written (buf[0] = NUL
 * when size > 0) and the call fails with cudaErrorInvalidValue -- except a size query (buf NULL,
 * size 0), which succeeds. The text grows as tags and devices appear: allocate a little more than
 * *needed, and call again when it did not fit. Creates no allocator.
 * Errors: cudaErrorInvalidValue (needed NULL, buf NULL with size > 0, size < *needed),
 * cudaErrorInitializationError. */
cudaError_t cucacheWriteMetrics(char* buf, size_t size, size_t* needed) CUCACHE_NOEXCEPT;

/** Sleep and wake (docs/api.md, "Sleep and wake"; expandable segments only).
 * cucacheMakeTagSleepable makes `tag` sleepable, process-wide and for good: allocations made under
 * it from then on are placed in physical pages of their own (one pool per stream and tag) that no
 * other tag's or untagged block shares. Call it before allocating under the tag.
 * Errors: cudaErrorInvalidValue (tag NULL or empty, too many sleepable tags). */
cudaError_t cucacheMakeTagSleepable(const char* tag) CUCACHE_NOEXCEPT;
/** Releases the physical memory of every live block of `tag` on `device` and of its cached pages,
 * keeping their virtual addresses: pointers stay valid, but no work may touch them until
 * cucacheWake. keepContents != 0: their bytes are copied to pinned host memory first and come back
 * on wake. Waits for the work queued on the device (one device synchronization) first.
 * Errors, each with nothing changed and the message in cucacheGetLastErrorMessage():
 *   cudaErrorInvalidValue  tag NULL, unknown or not sleepable; asleep already; live blocks of the
 *                          tag outside its pages (allocated before cucacheMakeTagSleepable, or in
 *                          a graph capture); freed blocks held for a CUDA graph
 *   cudaErrorNotSupported  the default mode (sleep needs CUCACHE_CONF=expandable_segments:True)
 *   cudaErrorStreamCaptureUnsupported  a graph capture is underway
 *   cudaErrorMemoryAllocation  the host cannot pin the copy (keepContents). */
cudaError_t cucacheSleep(int device, const char* tag, int keepContents) CUCACHE_NOEXCEPT;
/** Puts `count` tags to sleep in one call, tags[i] with keepContents[i] (what an inference
 * engine's sleep does: weights kept, KV cache dropped). One take of the allocator's locks; the
 * device is synchronized once for the whole call (twice when any contents are kept: before and
 * after the copies of all of them). Every tag is checked first, with the errors of cucacheSleep
 * plus a tag named twice, NULL entries and count 0 (cudaErrorInvalidValue): any refusal changes
 * nothing for any tag. A device failure while releasing one tag's pages rolls that tag back as
 * cucacheSleep does; the tags before it in the list stay asleep, those after it are untouched and
 * awake, and the message names both (docs/api.md, "Sleep and wake"). */
cudaError_t cucacheSleepTags(int device, const char* const* tags, const int* keepContents,
                             size_t count) CUCACHE_NOEXCEPT;
/** Pins, ahead of the next cucacheSleep(device, tag, 1), the host buffer that sleep copies into:
 * at least `bytes` and at least the tag's allocated bytes on `device` now (bytes 0: just those).
 * Without it, the first kept sleep pins the buffer itself (cudaHostAlloc takes seconds for
 * gigabytes). No allocator lock is held while pinning: other threads allocate and free meanwhile.
 * Nothing is pinned when the tag's buffer is large enough already. The buffer stays the tag's
 * until a sleep with keepContents 0 (which frees it) or a kept sleep that needs more.
 * *pinnedBytes (when not NULL) gets the buffer's size.
 * Errors, each with nothing changed: cudaErrorInvalidValue (tag NULL, unknown or not sleepable;
 * asleep), cudaErrorNotSupported (the default mode), cudaErrorMemoryAllocation (the host cannot
 * pin that much). */
cudaError_t cucacheSleepPrepare(int device, const char* tag, size_t bytes,
                                size_t* pinnedBytes) CUCACHE_NOEXCEPT;
/** Maps new physical memory at the same addresses under every page the tag's live blocks touch and
 * copies the kept contents back. Other tags' cached (idle) pages are given back first if needed.
 * Errors: cudaErrorInvalidValue (tag NULL, unknown, not sleepable, not asleep),
 * cudaErrorMemoryAllocation (no room: the tag stays asleep with nothing of it mapped; the message
 * says how much was missing). Between sleep and wake, cucacheFree of the tag's blocks and
 * allocations under the tag fail with cudaErrorInvalidValue, changing nothing. */
cudaError_t cucacheWake(int device, const char* tag) CUCACHE_NOEXCEPT;
/** Wakes `count` tags in one call, all or none: each must be asleep and named once
 * (cudaErrorInvalidValue, nothing changed); the room needed is that of all of them together
 * (cudaErrorMemoryAllocation: all stay asleep, nothing of them mapped); their kept contents are
 * copied back under one device synchronization. */
cudaError_t cucacheWakeTags(int device, const char* const* tags, size_t count) CUCACHE_NOEXCEPT;
/** Bytes of `tag` asleep on `device`: device bytes released (that wake maps again) and pinned host
 * bytes holding its contents; 0 and 0 when it is awake. Errors: cudaErrorInvalidValue (NULL). */
cudaError_t cucacheGetSleepingBytes(int device, const char* tag, size_t* deviceBytes,
                                    size_t* hostBytes) CUCACHE_NOEXCEPT;

/** Inter-process sharing (docs/api.md, "IPC"). Fills *handle so that another process can open the
 * live allocation devPtr (the start of a cucacheMalloc block, of any device). Default mode: the
 * segment's cudaIpcMemHandle_t plus the block's offset. Expandable segments: only with
 * CUCACHE_CONF=...,ipc_handles:True, as POSIX file descriptors (new ones, owned by the caller:
 * send them with cucacheIpcSendHandle, then cucacheIpcReleaseFds). The handle is valid while
 * the block is allocated: the exporter may free it at any time, and the importers must have
 * closed it by then (afterwards the memory may belong to another allocation).
 * Errors: cudaErrorInvalidValue (NULL, or not the start of a live cucache allocation),
 * cudaErrorNotSupported (expandable segments without ipc_handles:True, or a block over more than
 * CUCACHE_IPC_MAX_PIECES physical handles, which the fixed struct cannot carry: export it with
 * cucacheIpcGetLongHandle; nothing is exported), CUDA runtime errors. */
cudaError_t cucacheIpcGetHandle(cucacheIpcHandle* handle, void* devPtr) CUCACHE_NOEXCEPT;

/** Opens a handle of another process on the current device: *devPtr is the block's address in
 * this process. Opening blocks of one segment twice maps the segment once. The file descriptors
 * of the handle stay the caller's (cucacheIpcReleaseFds).
 * Errors: cudaErrorInvalidValue (NULL, a malformed handle, or one this process exported with
 * kind Segment: CUDA cannot open its own handles, use the pointer itself), CUDA runtime errors
 * (e.g. the exporter's segment is gone). */
cudaError_t cucacheIpcOpenHandle(void** devPtr, const cucacheIpcHandle* handle) CUCACHE_NOEXCEPT;

/** Closes one cucacheIpcOpenHandle of devPtr (each open needs one close); the last close of a
 * mapping unmaps it. Errors: cudaErrorInvalidValue (not an address cucacheIpcOpenHandle returned
 * and still open, e.g. closed already). */
cudaError_t cucacheIpcCloseHandle(void* devPtr) CUCACHE_NOEXCEPT;

/** Sends *handle over the connected unix socket `socket`, its file descriptors as SCM_RIGHTS.
 * Errors: cudaErrorInvalidValue (NULL or malformed handle), cudaErrorUnknown (the socket call
 * failed; the message names errno). */
cudaError_t cucacheIpcSendHandle(int socket, const cucacheIpcHandle* handle) CUCACHE_NOEXCEPT;
/** Receives a handle sent by cucacheIpcSendHandle: its fds are this process's descriptors.
 * Errors: as cucacheIpcSendHandle, and cudaErrorInvalidValue for what is not a handle. */
cudaError_t cucacheIpcRecvHandle(int socket, cucacheIpcHandle* handle) CUCACHE_NOEXCEPT;
/** Closes the file descriptors of *handle and sets them to -1 (nothing for kind Segment). */
cudaError_t cucacheIpcReleaseFds(cucacheIpcHandle* handle) CUCACHE_NOEXCEPT;

/** The variable-length form (cucacheIpcLongHandle in cucache/ipc.h): a block spanning any number
 * of physical handles, of either kind. *handle is allocated by cucache, *bytes its size
 * (CUCACHE_IPC_LONG_HANDLE_BYTES(pieceCount)); it is plain bytes and may be copied (the fds need
 * cucacheIpcSendLongHandle to reach another process). Free it with cucacheIpcFreeLongHandle.
 * Errors: as cucacheIpcGetHandle, without the piece limit; on error *handle = NULL, *bytes = 0. */
cudaError_t cucacheIpcGetLongHandle(cucacheIpcLongHandle** handle, size_t* bytes,
                                    void* devPtr) CUCACHE_NOEXCEPT;
/** Opens a long handle of `bytes` bytes (it must be exactly
 * CUCACHE_IPC_LONG_HANDLE_BYTES(pieceCount): a truncated or padded one is refused), as
 * cucacheIpcOpenHandle does; the fds stay the caller's. */
cudaError_t cucacheIpcOpenLongHandle(void** devPtr, const cucacheIpcLongHandle* handle,
                                     size_t bytes) CUCACHE_NOEXCEPT;
/** Sends a long handle over a connected unix socket: its bytes, and its fds as SCM_RIGHTS in
 * batches (the kernel passes at most 253 per message). Errors: as cucacheIpcSendHandle. */
cudaError_t cucacheIpcSendLongHandle(int socket, const cucacheIpcLongHandle* handle,
                                     size_t bytes) CUCACHE_NOEXCEPT;
/** Receives what cucacheIpcSendLongHandle sent: *handle allocated by cucache (free it with
 * cucacheIpcFreeLongHandle), its fds this process's descriptors, *bytes its size. Errors: as
 * cucacheIpcRecvHandle (every descriptor received is closed on error). */
cudaError_t cucacheIpcRecvLongHandle(int socket, cucacheIpcLongHandle** handle,
                                     size_t* bytes) CUCACHE_NOEXCEPT;
/** Closes the fds of a long handle and sets them to -1 (the exporter after sending, the importer
 * after opening). */
cudaError_t cucacheIpcReleaseLongHandleFds(cucacheIpcLongHandle* handle) CUCACHE_NOEXCEPT;
/** Closes the fds still open in *handle and frees what cucacheIpcGetLongHandle or
 * cucacheIpcRecvLongHandle allocated. NULL is a no-op. */
void cucacheIpcFreeLongHandle(cucacheIpcLongHandle* handle) CUCACHE_NOEXCEPT;

/** The message of the most recent failed cucache call on this thread (for an out-of-memory error,
 * the full report: request, capacity, free, allocated, cached, largest free block,
 * fragmentation); "" if none failed yet. Successful calls leave it unchanged, as errno. The text
 * stays valid until the next failing cucache call on this thread. Never NULL. */
const char* cucacheGetLastErrorMessage(void) CUCACHE_NOEXCEPT;

#ifdef __cplusplus
}  // extern "C"

// The runtime's C++ headers let `float* p; cudaMalloc(&p, n)` compile through template overloads;
// these keep such code compiling after cudaMalloc is renamed to cucacheMalloc.
template <class T>
inline cudaError_t cucacheMalloc(T** devPtr, size_t size) noexcept {
  return cucacheMalloc(static_cast<void**>(static_cast<void*>(devPtr)), size);
}
template <class T>
inline cudaError_t cucacheMallocAsync(T** devPtr, size_t size, cudaStream_t stream) noexcept {
  return cucacheMallocAsync(static_cast<void**>(static_cast<void*>(devPtr)), size, stream);
}
#endif

#undef CUCACHE_NOEXCEPT
