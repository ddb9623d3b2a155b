/* A stand-in for libcucache_c10_peer.so with no PyTorch behind it, for the loader tests
 * (tools_common_test): host memory for "device" memory, and init's inputs kept for last_error.
 * FAKE_C10_ABI gives another interface version; FAKE_C10_NONE leaves every function out. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "c10_peer.h"

#ifdef FAKE_C10_NONE
int fake_c10_peer_none = 1;
#else

#ifndef FAKE_C10_ABI
#define FAKE_C10_ABI CUCACHE_C10_PEER_ABI
#endif

static char g_message[512];
static int64_t g_allocs;
static int64_t g_live;
static double g_fraction = 1.0;

int cucache_peer_c10_abi(void) {
  return FAKE_C10_ABI;
}

int cucache_peer_c10_init(const char* conf) {
  const char* env = getenv("PYTORCH_CUDA_ALLOC_CONF");
  const char* alloc_env = getenv("PYTORCH_ALLOC_CONF");
  snprintf(g_message, sizeof g_message, "init conf=[%s] env=[%s] alloc_env=[%s]",
           conf != NULL ? conf : "(null)", env != NULL ? env : "(unset)",
           alloc_env != NULL ? alloc_env : "(unset)");
  return conf != NULL && strcmp(conf, "fail") == 0 ? 1 : 0;
}

void* cucache_peer_c10_alloc(size_t bytes, void* stream) {
  (void)stream;
  ++g_allocs;
  ++g_live;
  return malloc(bytes);
}

void cucache_peer_c10_free(void* ptr) {
  --g_live;
  free(ptr);
}

int cucache_peer_c10_set_memory_fraction(double fraction) {
  if (fraction <= 0.0 || fraction > 1.0) {
    snprintf(g_message, sizeof g_message, "fraction %g out of range", fraction);
    return 1;
  }
  g_fraction = fraction;
  return 0;
}

int cucache_peer_c10_stats(cucache_c10_stats* out) {
  memset(out, 0, sizeof *out);
  out->num_device_alloc = g_allocs;
  out->allocated_bytes = g_live;
  return 0;
}

int cucache_peer_c10_reset(void) {
  g_allocs = 0;
  return 0;
}

const char* cucache_peer_c10_last_error(void) {
  return g_message;
}

#endif /* FAKE_C10_NONE */
