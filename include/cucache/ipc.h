/* cucache's inter-process handle: a plain C99 struct of fixed size that names one live cucache
 * allocation for another process (cucacheIpcGetHandle / cucacheIpcOpenHandle in cucache.h,
 * cucache::ipc_get_handle in cucache.hpp). It holds no pointer: copy it through any byte channel
 * (a pipe, shared memory, a file). When kind is cucacheIpcKindFileDescriptors it also names file
 * descriptors, which only a unix socket can carry to another process: send it with
 * cucacheIpcSendHandle and receive it with cucacheIpcRecvHandle (SCM_RIGHTS). It carries at most
 * CUCACHE_IPC_MAX_PIECES physical handles; cucacheIpcLongHandle (below) carries any number.
 * See docs/api.md. */
#pragma once

#include <stddef.h>
#include <stdint.h>

#define CUCACHE_IPC_MAGIC 0x50494343u /* "CCIP" */
#define CUCACHE_IPC_VERSION 1u
/* The most physical handles the fixed cucacheIpcHandle carries (its arrays' length). A block
 * spanning more travels as a cucacheIpcLongHandle, which has no such limit. */
#define CUCACHE_IPC_MAX_PIECES 16
#define CUCACHE_IPC_LONG_MAGIC 0x4c494343u /* "CCIL" */
#define CUCACHE_IPC_LONG_VERSION 1u

/* What a handle is made of. */
enum cucacheIpcKind {
  /* A cudaMalloc'd segment (default mode): segmentHandle is its cudaIpcMemHandle_t, the block
   * lies at `offset` from the segment's base. */
  cucacheIpcKindSegment = 1,
  /* Expandable segments with ipc_handles:True: pieceCount physical handles, exported as POSIX
   * file descriptors, mapped one after the other; the block lies at `offset` from the first. */
  cucacheIpcKindFileDescriptors = 2
};

typedef struct cucacheIpcHandle {
  uint32_t magic;   /* CUCACHE_IPC_MAGIC */
  uint32_t version; /* CUCACHE_IPC_VERSION */
  int32_t kind;     /* enum cucacheIpcKind */
  int32_t device;   /* the exporter's device ordinal (in the exporter's numbering) */
  int64_t pid;      /* the exporter's process id */
  uint64_t offset;  /* of the block from the segment's base / the first piece's start */
  uint64_t size;    /* of the block, as cucache rounded it (>= the size asked for) */
  uint64_t span;    /* the segment's size / the pieces' total */
  uint8_t segmentHandle[64]; /* kind Segment: cudaIpcMemHandle_t */
  int32_t pieceCount;        /* kind FileDescriptors: 1..CUCACHE_IPC_MAX_PIECES; else 0 */
  int32_t reserved;          /* 0 */
  int32_t fds[CUCACHE_IPC_MAX_PIECES];          /* valid in the process holding the handle */
  uint64_t pieceBytes[CUCACHE_IPC_MAX_PIECES]; /* each piece's size */
} cucacheIpcHandle;

/* One physical handle of a cucacheIpcLongHandle: its file descriptor (valid in the process
 * holding the handle; -1 once released) and its size. 16 bytes. */
typedef struct cucacheIpcPiece {
  int32_t fd;
  uint32_t reserved; /* 0 */
  uint64_t bytes;
} cucacheIpcPiece;

/* The variable-length handle, for a block of any number of pieces (cucacheIpcGetLongHandle in
 * cucache.h, cucache::ipc_get_long_handle in cucache.hpp). One contiguous run of
 * CUCACHE_IPC_LONG_HANDLE_BYTES(pieceCount) bytes, no pointers: this header, then pieceCount
 * cucacheIpcPiece (cucacheIpcLongHandlePieces). The header's first 120 bytes have the fixed
 * handle's layout (magic aside). kind Segment: pieceCount 0, segmentHandle as in the fixed
 * handle. kind FileDescriptors: pieceCount >= 1 pieces, mapped one after the other. Memory from
 * cucacheIpcGetLongHandle / cucacheIpcRecvLongHandle: free it with cucacheIpcFreeLongHandle. */
typedef struct cucacheIpcLongHandle {
  uint32_t magic;   /* CUCACHE_IPC_LONG_MAGIC */
  uint32_t version; /* CUCACHE_IPC_LONG_VERSION */
  int32_t kind;     /* enum cucacheIpcKind */
  int32_t device;
  int64_t pid;
  uint64_t offset;
  uint64_t size;
  uint64_t span;
  uint8_t segmentHandle[64];
  int32_t pieceCount; /* kind FileDescriptors: >= 1; else 0 */
  int32_t reserved;   /* 0 */
  /* followed by cucacheIpcPiece[pieceCount] */
} cucacheIpcLongHandle;

#define CUCACHE_IPC_LONG_HANDLE_BYTES(pieceCount) \
  (sizeof(cucacheIpcLongHandle) + (size_t)(pieceCount) * sizeof(cucacheIpcPiece))

/* The pieces after the header. */
static inline cucacheIpcPiece* cucacheIpcLongHandlePieces(cucacheIpcLongHandle* h) {
  return (cucacheIpcPiece*)(void*)(h + 1);
}
static inline const cucacheIpcPiece* cucacheIpcLongHandlePiecesConst(
    const cucacheIpcLongHandle* h) {
  return (const cucacheIpcPiece*)(const void*)(h + 1);
}
