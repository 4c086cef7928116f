/*
 * Allreduce latency/bandwidth through the shim from C (no Python in the ranks), to see the
 * shim + coordinator cost alone.
 *
 *   RANK=r WORLD_SIZE=n shim_bench UNIQUE_ID_FILE [min_bytes max_bytes factor iters]
 *
 * Rank 0 prints one line per size: bytes, median time (us), algbw (GB/s).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "nccl.h"

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}
static int cmp(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return x < y ? -1 : x > y;
}

int main(int argc, char** argv) {
  if (argc < 2) return 2;
  int rank = atoi(getenv("RANK")), n = atoi(getenv("WORLD_SIZE"));
  size_t lo = argc > 2 ? strtoull(argv[2], 0, 10) : 4, hi = argc > 3 ? strtoull(argv[3], 0, 10) : 16 << 20;
  int f = argc > 4 ? atoi(argv[4]) : 16, iters = argc > 5 ? atoi(argv[5]) : 50;
  ncclUniqueId id;
  if (rank == 0) {
    ncclGetUniqueId(&id);
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", argv[1]);
    FILE* fp = fopen(tmp, "wb");
    fwrite(&id, sizeof id, 1, fp);
    fclose(fp);
    rename(tmp, argv[1]);
  } else {
    for (;;) {
      FILE* fp = fopen(argv[1], "rb");
      if (fp && fread(&id, sizeof id, 1, fp) == 1) { fclose(fp); break; }
      if (fp) fclose(fp);
      usleep(10000);
    }
  }
  ncclComm_t comm;
  if (ncclCommInitRank(&comm, n, id, rank) != ncclSuccess) {
    fprintf(stderr, "init: %s\n", ncclGetLastError(NULL));
    return 1;
  }
  float* buf = malloc(hi + 64);
  float* out = malloc(hi + 64);
  for (size_t i = 0; i < hi / 4; i++) buf[i] = (float)(i % 13);
  double* t = malloc(sizeof(double) * iters);
  if (rank == 0) printf("# %d ranks, float32 sum allreduce, median of %d\n#      bytes    time_us   algbw_GB/s\n", n, iters);
  for (size_t bytes = lo; bytes <= hi; bytes = bytes * f > hi && bytes < hi ? hi : bytes * f) {
    size_t count = bytes / 4;
    for (int w = 0; w < 5; w++) ncclAllReduce(buf, out, count, ncclFloat32, ncclSum, comm, NULL);
    for (int i = 0; i < iters; i++) {
      double t0 = now_us();
      ncclResult_t r = ncclAllReduce(buf, out, count, ncclFloat32, ncclSum, comm, NULL);
      t[i] = now_us() - t0;
      if (r != ncclSuccess) {
        fprintf(stderr, "allreduce: %s\n", ncclGetLastError(NULL));
        return 1;
      }
    }
    qsort(t, iters, sizeof(double), cmp);
    double med = t[iters / 2];
    if (rank == 0) printf("%12zu %10.1f %12.3f\n", bytes, med, bytes / med / 1e3);
  }
  ncclCommDestroy(comm);
  return 0;
}
