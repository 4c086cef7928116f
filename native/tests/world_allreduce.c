/*
 * One rank of a world-wide int32 sum allreduce, checked exactly: a small C program, so that a
 * test (or a measurement) can run hundreds of ranks on a small machine.
 *
 *   RANK=r WORLD_SIZE=n world_allreduce UNIQUE_ID_FILE [count iterations]
 *
 * Rank r contributes (r + 1) * ((i + it) % 13 + 1) at element i of iteration it, so every
 * element of the result is known. Prints "world_allreduce rank R: OK" when every iteration
 * gave exactly the expected values; rank 0 also prints the seconds from init to the end.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nccl.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int read_id(const char* path, ncclUniqueId* id, double deadline) {
  while (now_s() < deadline) {
    FILE* fp = fopen(path, "rb");
    if (fp) {
      size_t got = fread(id, sizeof *id, 1, fp);
      fclose(fp);
      if (got == 1) return 0;
    }
    usleep(20000);
  }
  return -1;
}

int main(int argc, char** argv) {
  if (argc < 2 || !getenv("RANK") || !getenv("WORLD_SIZE")) {
    fprintf(stderr, "usage: RANK=r WORLD_SIZE=n world_allreduce UNIQUE_ID_FILE [count iterations]\n");
    return 2;
  }
  int rank = atoi(getenv("RANK")), n = atoi(getenv("WORLD_SIZE"));
  size_t count = argc > 2 ? strtoull(argv[2], NULL, 10) : 1;
  int iters = argc > 3 ? atoi(argv[3]) : 3;
  double start = now_s();
  ncclUniqueId id;
  if (rank == 0) {
    if (ncclGetUniqueId(&id) != ncclSuccess) {
      fprintf(stderr, "rank 0: ncclGetUniqueId: %s\n", ncclGetLastError(NULL));
      return 1;
    }
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", argv[1]);
    FILE* fp = fopen(tmp, "wb");
    if (!fp || fwrite(&id, sizeof id, 1, fp) != 1) return 1;
    fclose(fp);
    rename(tmp, argv[1]);
  } else if (read_id(argv[1], &id, start + 600) != 0) {
    fprintf(stderr, "rank %d: no unique id in %s\n", rank, argv[1]);
    return 1;
  }
  ncclComm_t comm;
  ncclResult_t rc = ncclCommInitRank(&comm, n, id, rank);
  if (rc != ncclSuccess) {
    fprintf(stderr, "rank %d: ncclCommInitRank: %s: %s\n", rank, ncclGetErrorString(rc), ncclGetLastError(NULL));
    return 1;
  }
  int32_t* in = malloc(sizeof(int32_t) * (count ? count : 1));
  int32_t* out = malloc(sizeof(int32_t) * (count ? count : 1));
  const int64_t ranks_sum = (int64_t)n * (n + 1) / 2;
  for (int it = 0; it < iters; it++) {
    for (size_t i = 0; i < count; i++) in[i] = (int32_t)((rank + 1) * (int32_t)((i + it) % 13 + 1));
    memset(out, 0xA5, sizeof(int32_t) * count);
    rc = ncclAllReduce(in, out, count, ncclInt32, ncclSum, comm, NULL);
    if (rc != ncclSuccess) {
      fprintf(stderr, "rank %d: ncclAllReduce %d: %s: %s\n", rank, it, ncclGetErrorString(rc), ncclGetLastError(comm));
      return 1;
    }
    for (size_t i = 0; i < count; i++) {
      int64_t want = ranks_sum * (int64_t)((i + it) % 13 + 1);
      if (out[i] != (int32_t)want) {
        fprintf(stderr, "rank %d: iteration %d element %zu is %d, expected %lld\n", rank, it, i, out[i],
                (long long)want);
        return 1;
      }
    }
  }
  ncclCommDestroy(comm);
  if (rank == 0) printf("world_allreduce seconds: %.3f\n", now_s() - start);
  printf("world_allreduce rank %d: OK\n", rank);
  return 0;
}
