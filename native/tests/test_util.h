/*
 * What the C rank programs in native/tests share: failure reporting, the unique-id hand-off
 * through a file (rank 0 writes it atomically, the others wait for it) and the test values.
 * Header-only: each program is one translation unit built straight from its .c file.
 */
#ifndef FAKEGPU_TEST_UTIL_H
#define FAKEGPU_TEST_UTIL_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "nccl.h"

static int g_rank = -1;
static int g_failures = 0;

#define CHECK_NCCL(call)                                                                     \
  do {                                                                                       \
    ncclResult_t r_ = (call);                                                                \
    if (r_ != ncclSuccess) {                                                                 \
      fprintf(stderr, "rank %d: %s:%d: %s -> %s: %s\n", g_rank, __FILE__, __LINE__, #call,   \
              ncclGetErrorString(r_), ncclGetLastError(NULL));                               \
      exit(2);                                                                               \
    }                                                                                        \
  } while (0)

#define EXPECT(cond, ...)                                                                    \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      fprintf(stderr, "rank %d: %s:%d: check failed: %s: ", g_rank, __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                                          \
      fprintf(stderr, "\n");                                                                 \
      g_failures++;                                                                          \
    }                                                                                        \
  } while (0)

/* Rank 0's side of the hand-off: a temp file renamed into place, so readers never see half an id. */
static __attribute__((unused)) void write_id(const char* path, const ncclUniqueId* id) {
  char tmp[4096];
  snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid());
  FILE* f = fopen(tmp, "wb");
  if (!f || fwrite(id, sizeof(*id), 1, f) != 1 || fclose(f) != 0) {
    perror("write unique id");
    exit(2);
  }
  if (rename(tmp, path) != 0) {
    perror("rename unique id");
    exit(2);
  }
}

/* The other ranks' side: wait up to 30 s for the file. */
static __attribute__((unused)) void read_id(const char* path, ncclUniqueId* id) {
  for (int i = 0; i < 3000; i++) {
    FILE* f = fopen(path, "rb");
    if (f) {
      size_t n = fread(id, sizeof(*id), 1, f);
      fclose(f);
      if (n == 1) return;
    }
    usleep(10000);
  }
  fprintf(stderr, "rank %d: no unique id appeared in %s\n", g_rank, path);
  exit(2);
}

/* Value rank r contributes at index i (exact in float32 and int32). */
static __attribute__((unused)) float val(int r, size_t i) { return (float)((r + 1) * 100 + (int)(i % 97)); }

#endif
