/* Compiled as C (C11, pedantic, warnings as errors) into c_api_test: proves cucache.h is a C
 * header, and runs a short sequence through every function from C. */
#include "cucache/cucache.h"

#include <string.h>

/* Each function with its exact C type: a changed signature fails to compile here. */
static cudaError_t (*const k_malloc)(void**, size_t) = cucacheMalloc;
static cudaError_t (*const k_malloc_async)(void**, size_t, cudaStream_t) = cucacheMallocAsync;
static cudaError_t (*const k_free)(void*) = cucacheFree;
static cudaError_t (*const k_free_async)(void*, cudaStream_t) = cucacheFreeAsync;
static cudaError_t (*const k_record)(void*, cudaStream_t) = cucacheRecordStream;
static cudaError_t (*const k_mem_get_info)(size_t*, size_t*) = cucacheMemGetInfo;
static cudaError_t (*const k_empty)(void) = cucacheEmptyCache;
static cudaError_t (*const k_stats)(int, cucacheStats*) = cucacheGetStats;
static cudaError_t (*const k_reset_peak)(int) = cucacheResetPeakStats;
static size_t (*const k_summary)(int, char*, size_t) = cucacheMemorySummary;
static const char* (*const k_message)(void) = cucacheGetLastErrorMessage;
static cudaError_t (*const k_capture_ended)(unsigned long long) = cucacheGraphCaptureEnded;
static cudaError_t (*const k_pool_release)(unsigned long long) = cucacheGraphPoolRelease;
static cudaError_t (*const k_ipc_get)(cucacheIpcHandle*, void*) = cucacheIpcGetHandle;
static cudaError_t (*const k_ipc_open)(void**, const cucacheIpcHandle*) = cucacheIpcOpenHandle;
static cudaError_t (*const k_ipc_close)(void*) = cucacheIpcCloseHandle;
static cudaError_t (*const k_ipc_send)(int, const cucacheIpcHandle*) = cucacheIpcSendHandle;
static cudaError_t (*const k_ipc_recv)(int, cucacheIpcHandle*) = cucacheIpcRecvHandle;
static cudaError_t (*const k_ipc_release)(cucacheIpcHandle*) = cucacheIpcReleaseFds;
static cudaError_t (*const k_ipc_get_long)(cucacheIpcLongHandle**, size_t*,
                                           void*) = cucacheIpcGetLongHandle;
static cudaError_t (*const k_ipc_open_long)(void**, const cucacheIpcLongHandle*,
                                            size_t) = cucacheIpcOpenLongHandle;
static cudaError_t (*const k_ipc_send_long)(int, const cucacheIpcLongHandle*,
                                            size_t) = cucacheIpcSendLongHandle;
static cudaError_t (*const k_ipc_recv_long)(int, cucacheIpcLongHandle**,
                                            size_t*) = cucacheIpcRecvLongHandle;
static cudaError_t (*const k_ipc_release_long)(cucacheIpcLongHandle*) =
    cucacheIpcReleaseLongHandleFds;
static void (*const k_ipc_free_long)(cucacheIpcLongHandle*) = cucacheIpcFreeLongHandle;

/* Returns 0 when every step behaves, else the number of the first step that did not. */
int cucache_c_header_check(void) {
  void* p = NULL;
  void* q = NULL;
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  cucacheStats stats;
  char text[64];
  cudaStream_t stream = (cudaStream_t)(void*)0x100;
  cucacheIpcHandle ipc;
  cucacheIpcLongHandle* lh = NULL;
  size_t lbytes = 0;
  cucacheIpcLongHandle* got = NULL;
  size_t got_bytes = 7;
  void* r = NULL;

  if (k_malloc(&p, 1000) != cudaSuccess || p == NULL) return 1;
  if (k_malloc_async(&q, 2000, stream) != cudaSuccess || q == NULL) return 2;
  if (k_record(p, stream) != cudaSuccess) return 3;
  if (k_mem_get_info(&free_bytes, &total_bytes) != cudaSuccess) return 4;
  if (free_bytes == 0 || free_bytes > total_bytes) return 5;
  memset(&stats, 0, sizeof stats);
  if (k_stats(0, &stats) != cudaSuccess) return 6;
  if (stats.allocationCount != 2 || stats.requestedBytes != 3000) return 7;
  memset(&ipc, 0, sizeof ipc);
  if (k_ipc_get(&ipc, p) != cudaSuccess || ipc.kind != cucacheIpcKindSegment) return 19;
  if (ipc.offset != 0 || ipc.size != 1024) return 20;
  if (k_ipc_open(&r, &ipc) != cudaSuccess || r == NULL || r == p) return 21;
  if (k_ipc_close(r) != cudaSuccess) return 22;
  if (k_ipc_close(r) != cudaErrorInvalidValue) return 23;  /* closed twice */
  if (k_ipc_send(-1, &ipc) != cudaErrorUnknown) return 24; /* not a socket */
  if (k_ipc_recv(-1, &ipc) != cudaErrorUnknown) return 25;
  if (k_ipc_release(&ipc) != cudaSuccess) return 26;
  if (k_ipc_get_long(&lh, &lbytes, p) != cudaSuccess || lh == NULL) return 27;
  if (lbytes != CUCACHE_IPC_LONG_HANDLE_BYTES(0) || lh->pieceCount != 0) return 28;
  if (lh->magic != CUCACHE_IPC_LONG_MAGIC || lh->size != 1024) return 29;
  if (cucacheIpcLongHandlePieces(lh) != (cucacheIpcPiece*)(void*)(lh + 1)) return 30;
  if (k_ipc_open_long(&r, lh, lbytes - 1) != cudaErrorInvalidValue || r != NULL) return 31;
  if (k_ipc_open_long(&r, lh, lbytes) != cudaSuccess || r == NULL) return 32;
  if (k_ipc_close(r) != cudaSuccess) return 33;
  if (k_ipc_send_long(-1, lh, lbytes) != cudaErrorUnknown) return 34;
  if (k_ipc_recv_long(-1, &got, &got_bytes) != cudaErrorUnknown) return 35;
  if (got != NULL || got_bytes != 0) return 36; /* nothing is allocated on failure */
  if (k_ipc_release_long(NULL) != cudaErrorInvalidValue) return 37;
  if (k_ipc_release_long(lh) != cudaSuccess) return 38;
  k_ipc_free_long(lh);
  k_ipc_free_long(NULL);
  if (k_free(p) != cudaSuccess) return 8;
  if (k_free_async(q, stream) != cudaSuccess) return 9;
  if (k_free(p) != cudaErrorInvalidValue) return 10; /* double free */
  if (strstr(k_message(), "already freed") == NULL) return 11;
  if (k_empty() != cudaSuccess) return 12;
  if (k_reset_peak(0) != cudaSuccess) return 13;
  if (k_summary(0, text, sizeof text) <= sizeof text) return 14;
  if (strlen(text) != sizeof text - 1) return 15;
  if (k_stats(0, &stats) != cudaSuccess || stats.allocationCount != 0) return 16;
  if (k_capture_ended(12345) != cudaErrorInvalidValue) return 17; /* no such capture */
  if (k_pool_release(12345) != cudaErrorInvalidValue) return 18;
  return 0;
}
