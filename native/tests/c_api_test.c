/*
 * Drives the fakegpu shim through its C API, built against native/include/nccl.h only.
 *
 *   RANK=r WORLD_SIZE=n c_api_test UNIQUE_ID_FILE      one rank of an n-rank job
 *   c_api_test --init-all N                            one process holding N ranks
 *   c_api_test --fork N                                the same, plus a forked child doing it too
 *   c_api_test --threads N                             the same, one thread per rank issuing calls
 *   C_API_TEST_ABORT=1 with 2 ranks: a watchdog thread aborts a blocked allreduce
 *
 * Rank 0 writes the unique id to UNIQUE_ID_FILE (atomically), the others wait for it.
 * Every result is checked against a value computed here; the program prints
 * "c_api_test rank R: OK" and exits 0 only when all checks pass.
 */
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "nccl.h"
#include "test_util.h"

static void test_allreduce(ncclComm_t comm, int rank, int n, size_t count, int in_place) {
  float* send = calloc(count + 1, sizeof(float));
  float* recv = in_place ? send : calloc(count + 1, sizeof(float));
  for (size_t i = 0; i < count; i++) send[i] = val(rank, i);
  CHECK_NCCL(ncclAllReduce(send, recv, count, ncclFloat32, ncclSum, comm, NULL));
  size_t bad = 0;
  for (size_t i = 0; i < count; i++) {
    float want = 0;
    for (int r = 0; r < n; r++) want += val(r, i);
    if (recv[i] != want && bad++ < 3) fprintf(stderr, "  allreduce[%zu]=%g want %g\n", i, recv[i], want);
  }
  EXPECT(bad == 0, "allreduce count=%zu in_place=%d: %zu wrong", count, in_place, bad);
  if (!in_place) free(recv);
  free(send);
}

static void test_int_ops(ncclComm_t comm, int rank, int n) {
  int32_t x[4] = {rank + 1, -(rank + 1), rank * 3, 7}, y[4];
  CHECK_NCCL(ncclAllReduce(x, y, 4, ncclInt32, ncclMax, comm, NULL));
  EXPECT(y[0] == n && y[1] == -1 && y[2] == 3 * (n - 1) && y[3] == 7, "int32 max: %d %d %d %d", y[0], y[1], y[2], y[3]);
  CHECK_NCCL(ncclAllReduce(x, y, 4, ncclInt32, ncclMin, comm, NULL));
  EXPECT(y[0] == 1 && y[1] == -n && y[2] == 0, "int32 min: %d %d %d", y[0], y[1], y[2]);
  double d = rank + 1.0, prod = 0;
  CHECK_NCCL(ncclAllReduce(&d, &prod, 1, ncclFloat64, ncclProd, comm, NULL));
  double want = 1;
  for (int r = 0; r < n; r++) want *= r + 1.0;
  EXPECT(prod == want, "float64 prod %g want %g", prod, want);
  float a = (float)(2 * rank), avg = 0;
  CHECK_NCCL(ncclAllReduce(&a, &avg, 1, ncclFloat32, ncclAvg, comm, NULL));
  EXPECT(avg == (float)(n - 1), "float32 avg %g want %d", avg, n - 1);
}

static void test_premulsum(ncclComm_t comm, int rank, int n) {
  float factor = 0.5f, x = (float)(rank + 1) * 2, y = 0;
  ncclRedOp_t op;
  CHECK_NCCL(ncclRedOpCreatePreMulSum(&op, &factor, ncclFloat32, ncclScalarHostImmediate, comm));
  factor = 100.f; /* host-immediate: already read */
  CHECK_NCCL(ncclAllReduce(&x, &y, 1, ncclFloat32, op, comm, NULL));
  EXPECT(y == (float)(n * (n + 1) / 2), "premulsum host: %g want %d", y, n * (n + 1) / 2);
  CHECK_NCCL(ncclRedOpDestroy(op, comm));

  float dev_factor = 1.0f;
  CHECK_NCCL(ncclRedOpCreatePreMulSum(&op, &dev_factor, ncclFloat32, ncclScalarDevice, comm));
  dev_factor = 0.25f; /* device residence: read when the collective runs */
  CHECK_NCCL(ncclAllReduce(&x, &y, 1, ncclFloat32, op, comm, NULL));
  EXPECT(y == (float)(n * (n + 1)) / 4.0f, "premulsum device: %g want %g", y, (float)(n * (n + 1)) / 4.0f);
  /* wrong datatype for the op: fails that call only */
  double dx = 1, dy;
  EXPECT(ncclAllReduce(&dx, &dy, 1, ncclFloat64, op, comm, NULL) == ncclInvalidArgument, "op/datatype mismatch");
  CHECK_NCCL(ncclRedOpDestroy(op, comm));
}

static void test_gathers(ncclComm_t comm, int rank, int n) {
  const size_t c = 5;
  int32_t send[5], *all = malloc(n * c * sizeof(int32_t));
  for (size_t i = 0; i < c; i++) send[i] = rank * 1000 + (int)i;
  CHECK_NCCL(ncclAllGather(send, all, c, ncclInt32, comm, NULL));
  int bad = 0;
  for (int r = 0; r < n; r++)
    for (size_t i = 0; i < c; i++) bad += all[r * c + i] != r * 1000 + (int)i;
  EXPECT(bad == 0, "allgather: %d wrong", bad);

  /* in-place allgather: my block already sits in the output */
  memset(all, 0, n * c * sizeof(int32_t));
  memcpy(all + rank * c, send, sizeof(send));
  CHECK_NCCL(ncclAllGather(all + rank * c, all, c, ncclInt32, comm, NULL));
  bad = 0;
  for (int r = 0; r < n; r++)
    for (size_t i = 0; i < c; i++) bad += all[r * c + i] != r * 1000 + (int)i;
  EXPECT(bad == 0, "in-place allgather: %d wrong", bad);

  /* reduce-scatter: block j of rank r = r + j*10 + i */
  for (int j = 0; j < n; j++)
    for (size_t i = 0; i < c; i++) all[j * c + i] = rank + j * 10 + (int)i;
  int32_t mine[5];
  CHECK_NCCL(ncclReduceScatter(all, mine, c, ncclInt32, ncclSum, comm, NULL));
  bad = 0;
  for (size_t i = 0; i < c; i++) bad += mine[i] != n * (n - 1) / 2 + n * (rank * 10 + (int)i);
  EXPECT(bad == 0, "reducescatter: %d wrong", bad);

  /* all-to-all: block j sent by r = r*100 + j */
  int32_t* out = malloc(n * c * sizeof(int32_t));
  for (int j = 0; j < n; j++)
    for (size_t i = 0; i < c; i++) all[j * c + i] = rank * 100 + j;
  CHECK_NCCL(ncclAlltoAll(all, out, c, ncclInt32, comm, NULL));
  bad = 0;
  for (int r = 0; r < n; r++)
    for (size_t i = 0; i < c; i++) bad += out[r * c + i] != r * 100 + rank;
  EXPECT(bad == 0, "alltoall: %d wrong", bad);

  /* gather / scatter at the last rank */
  int root = n - 1;
  memset(out, 0, n * c * sizeof(int32_t));
  CHECK_NCCL(ncclGather(send, rank == root ? out : NULL, c, ncclInt32, root, comm, NULL));
  if (rank == root) {
    bad = 0;
    for (int r = 0; r < n; r++)
      for (size_t i = 0; i < c; i++) bad += out[r * c + i] != r * 1000 + (int)i;
    EXPECT(bad == 0, "gather: %d wrong", bad);
  }
  for (int j = 0; j < n; j++)
    for (size_t i = 0; i < c; i++) all[j * c + i] = j * 7 + (int)i;
  CHECK_NCCL(ncclScatter(rank == root ? all : NULL, mine, c, ncclInt32, root, comm, NULL));
  bad = 0;
  for (size_t i = 0; i < c; i++) bad += mine[i] != rank * 7 + (int)i;
  EXPECT(bad == 0, "scatter: %d wrong", bad);
  free(out);
  free(all);
}

static void test_rooted(ncclComm_t comm, int rank, int n) {
  int64_t b[3] = {0, 0, 0};
  int root = n > 1 ? 1 : 0;
  if (rank == root) b[0] = 42, b[1] = -7, b[2] = (int64_t)1 << 40;
  CHECK_NCCL(ncclBcast(b, 3, ncclInt64, root, comm, NULL));
  EXPECT(b[0] == 42 && b[1] == -7 && b[2] == (int64_t)1 << 40, "bcast: %lld %lld", (long long)b[0], (long long)b[1]);
  uint8_t s = (uint8_t)(rank + 1), r8 = 0;
  CHECK_NCCL(ncclBroadcast(&s, &r8, 1, ncclUint8, 0, comm, NULL));
  EXPECT(r8 == 1, "broadcast uint8: %d", r8);
  uint64_t u = (uint64_t)rank + 1, sum = 0;
  CHECK_NCCL(ncclReduce(&u, rank == 0 ? &sum : NULL, 1, ncclUint64, ncclSum, 0, comm, NULL));
  if (rank == 0) EXPECT(sum == (uint64_t)n * (n + 1) / 2, "reduce: %llu", (unsigned long long)sum);
}

static void test_sendrecv(ncclComm_t comm, int rank, int n) {
  /* ring exchange inside one group, plus a zero-count pair */
  float out[8], in[8];
  for (int i = 0; i < 8; i++) out[i] = (float)(rank * 10 + i);
  int next = (rank + 1) % n, prev = (rank + n - 1) % n;
  CHECK_NCCL(ncclGroupStart());
  CHECK_NCCL(ncclSend(out, 8, ncclFloat32, next, comm, NULL));
  CHECK_NCCL(ncclRecv(in, 8, ncclFloat32, prev, comm, NULL));
  CHECK_NCCL(ncclSend(out, 0, ncclFloat32, next, comm, NULL));
  CHECK_NCCL(ncclRecv(in, 0, ncclFloat32, prev, comm, NULL));
  CHECK_NCCL(ncclGroupEnd());
  int bad = 0;
  for (int i = 0; i < 8; i++) bad += in[i] != (float)(prev * 10 + i);
  EXPECT(bad == 0, "ring sendrecv: %d wrong", bad);
  /* a large ring exchange: with a small FAKEGPU_STAGING_CHUNK_BYTES the group spans several
     frames, and each rank's Recv waits on a Send that sits in its peer's group */
  size_t big = 50000;
  int32_t* bo = malloc(big * sizeof(int32_t));
  int32_t* bi = malloc(big * sizeof(int32_t));
  for (size_t i = 0; i < big; i++) bo[i] = rank * 1000003 + (int32_t)i, bi[i] = -1;
  CHECK_NCCL(ncclGroupStart());
  CHECK_NCCL(ncclRecv(bi, big, ncclInt32, prev, comm, NULL));
  CHECK_NCCL(ncclSend(bo, big, ncclInt32, next, comm, NULL));
  CHECK_NCCL(ncclGroupEnd());
  bad = 0;
  for (size_t i = 0; i < big; i++) bad += bi[i] != prev * 1000003 + (int32_t)i;
  EXPECT(bad == 0, "large ring sendrecv: %d wrong", bad);
  free(bo);
  free(bi);
  /* only ranks 0 and 1 talk; the others do nothing */
  if (n >= 2 && rank < 2) {
    int32_t v = 1000 + rank, w = -1;
    CHECK_NCCL(ncclGroupStart());
    CHECK_NCCL(ncclSend(&v, 1, ncclInt32, 1 - rank, comm, NULL));
    CHECK_NCCL(ncclRecv(&w, 1, ncclInt32, 1 - rank, comm, NULL));
    CHECK_NCCL(ncclGroupEnd());
    EXPECT(w == 1000 + (1 - rank), "pair sendrecv: %d", w);
  }
}

static void test_group_of_many(ncclComm_t comm, int rank, int n) {
  enum { K = 120 };
  static int32_t x[K], y[K];
  CHECK_NCCL(ncclGroupStart());
  CHECK_NCCL(ncclGroupStart()); /* nesting */
  for (int k = 0; k < K; k++) {
    x[k] = rank + k;
    CHECK_NCCL(ncclAllReduce(&x[k], &y[k], 1, ncclInt32, ncclSum, comm, NULL));
  }
  CHECK_NCCL(ncclGroupEnd());
  for (int k = 0; k < K; k++) EXPECT(y[k] == 0, "group ran before the outermost GroupEnd");
  CHECK_NCCL(ncclGroupEnd());
  int bad = 0;
  for (int k = 0; k < K; k++) bad += y[k] != n * (n - 1) / 2 + n * k;
  EXPECT(bad == 0, "group of %d allreduces: %d wrong", K, bad);
}

static void test_errors(ncclComm_t comm, int rank, int n) {
  float x = 1, y;
  EXPECT(ncclAllReduce(&x, &y, 1, (ncclDataType_t)99, ncclSum, comm, NULL) == ncclInvalidArgument, "bad dtype");
  EXPECT(strstr(ncclGetLastError(comm), "datatype") != NULL, "last error names the datatype: %s",
         ncclGetLastError(comm));
  EXPECT(ncclAllReduce(&x, &y, 1, ncclFloat32, (ncclRedOp_t)77, comm, NULL) == ncclInvalidArgument, "bad op");
  EXPECT(ncclBroadcast(&x, &y, 1, ncclFloat32, n, comm, NULL) == ncclInvalidArgument, "bad root");
  EXPECT(ncclSend(&x, 1, ncclFloat32, -1, comm, NULL) == ncclInvalidArgument, "bad peer");
  EXPECT(ncclAllReduce(&x, &y, 1, ncclFloat32, ncclSum, NULL, NULL) == ncclInvalidArgument, "null comm");
  EXPECT(ncclAllGather(&x, &y, SIZE_MAX / 2, ncclFloat64, comm, NULL) == ncclInvalidArgument, "count overflow");
  EXPECT(ncclGroupEnd() == ncclInvalidUsage, "GroupEnd without GroupStart");
  EXPECT(ncclSignal(0, 0, 0, 0, comm, NULL) == ncclInvalidUsage, "unsupported signal");
  EXPECT(strstr(ncclGetLastError(NULL), "ncclSignal") != NULL, "last error names ncclSignal");
  /* the communicator is still usable after all that */
  test_allreduce(comm, rank, n, 3, 0);
}

/* A split of a non-blocking communicator is non-blocking too: poll until it is ready. */
static void split_and_wait(ncclComm_t comm, int color, int key, ncclComm_t* out) {
  ncclResult_t r = ncclCommSplit(comm, color, key, out, NULL);
  if (r == ncclInProgress && *out) {
    ncclResult_t st = ncclInProgress;
    for (int i = 0; i < 60000 && st == ncclInProgress; i++) {
      CHECK_NCCL(ncclCommGetAsyncError(*out, &st));
      if (st == ncclInProgress) usleep(1000);
    }
    r = st;
  } else if (r == ncclInProgress) {
    r = ncclSuccess; /* NOCOLOR: nothing to wait for */
  }
  CHECK_NCCL(r);
}

static void test_split(ncclComm_t comm, int rank, int n) {
  ncclComm_t sub = NULL;
  split_and_wait(comm, rank % 2, -rank, &sub);
  int cnt = 0, me = -1;
  CHECK_NCCL(ncclCommCount(sub, &cnt));
  CHECK_NCCL(ncclCommUserRank(sub, &me));
  int want_cnt = (n + 1 - rank % 2) / 2;
  EXPECT(cnt == want_cnt, "split count %d want %d", cnt, want_cnt);
  /* key = -rank: higher parent rank comes first */
  int members_after = 0;
  for (int r = rank + 1; r < n; r++) members_after += (r % 2) == (rank % 2);
  EXPECT(me == members_after, "split rank %d want %d", me, members_after);
  int32_t v = rank, s = 0;
  CHECK_NCCL(ncclAllReduce(&v, &s, 1, ncclInt32, ncclSum, sub, NULL));
  int want = 0;
  for (int r = rank % 2; r < n; r += 2) want += r;
  EXPECT(s == want, "allreduce on split %d want %d", s, want);
  CHECK_NCCL(ncclCommDestroy(sub));

  ncclComm_t none = (ncclComm_t)0x1;
  split_and_wait(comm, rank == 0 ? NCCL_SPLIT_NOCOLOR : 0, 0, &none);
  if (rank == 0)
    EXPECT(none == NULL, "NOCOLOR gives NULL");
  else {
    EXPECT(none != NULL, "colored split gives a comm");
    CHECK_NCCL(ncclCommCount(none, &cnt));
    EXPECT(cnt == n - 1, "split without rank 0 has %d ranks", cnt);
    CHECK_NCCL(ncclCommDestroy(none));
  }
}

static void test_simulate(ncclComm_t comm) {
  float x[256], y[256];
  memset(x, 0, sizeof(x));
  memset(y, 0x7f, sizeof(y));
  ncclSimInfo_t info = NCCL_SIM_INFO_INITIALIZER;
  CHECK_NCCL(ncclGroupStart());
  CHECK_NCCL(ncclAllReduce(x, y, 256, ncclFloat32, ncclSum, comm, NULL));
  CHECK_NCCL(ncclGroupSimulateEnd(&info));
  EXPECT(info.estimatedTime >= 0, "simulate estimate %g", info.estimatedTime);
  unsigned char* yb = (unsigned char*)y;
  EXPECT(yb[0] == 0x7f, "simulated group must not run");
  /* a call far larger than the buffers: simulation never touches user memory */
  ncclSimInfo_t big_info = NCCL_SIM_INFO_INITIALIZER;
  CHECK_NCCL(ncclGroupStart());
  CHECK_NCCL(ncclAllReduce(x, y, (size_t)1 << 30, ncclFloat32, ncclSum, comm, NULL));
  CHECK_NCCL(ncclGroupSimulateEnd(&big_info));
  EXPECT(big_info.estimatedTime > info.estimatedTime, "4 GiB estimate %g <= 1 KiB estimate %g", big_info.estimatedTime,
         info.estimatedTime);
  /* an older, smaller simInfo: the estimate lies past its size and must stay untouched */
  ncclSimInfo_t old_info = NCCL_SIM_INFO_INITIALIZER;
  old_info.size = offsetof(ncclSimInfo_t, estimatedTime);
  old_info.estimatedTime = -42.0f;
  CHECK_NCCL(ncclGroupStart());
  CHECK_NCCL(ncclAllReduce(x, y, 256, ncclFloat32, ncclSum, comm, NULL));
  CHECK_NCCL(ncclGroupSimulateEnd(&old_info));
  EXPECT(old_info.estimatedTime == -42.0f, "simInfo written past its size");
}

/* Callers built against other NCCL versions pass smaller or larger config structs. */
static void test_config_sizes(ncclComm_t comm, int rank, int n) {
  /* larger: ours followed by fields a newer NCCL appended */
  struct {
    ncclConfig_t cfg;
    int newer[5];
  } large;
  ncclConfig_t init = NCCL_CONFIG_INITIALIZER;
  large.cfg = init;
  large.cfg.size = sizeof(large);
  large.cfg.blocking = 1;
  large.cfg.commName = "large-config";
  for (int i = 0; i < 5; i++) large.newer[i] = 12345;
  ncclComm_t c = NULL;
  CHECK_NCCL(ncclCommSplit(comm, 0, rank, &c, &large.cfg));
  int cnt = 0;
  CHECK_NCCL(ncclCommCount(c, &cnt));
  EXPECT(cnt == n, "split with a larger config has %d ranks", cnt);
  CHECK_NCCL(ncclCommDestroy(c));

  /* smaller: an old struct that ends after `blocking`; what follows is garbage */
  unsigned char small[64];
  memset(small, 0xAB, sizeof(small));
  ncclConfig_t* sc = (ncclConfig_t*)small;
  sc->size = offsetof(ncclConfig_t, cgaClusterSize);
  sc->magic = NCCL_API_MAGIC;
  sc->version = 21400;
  sc->blocking = 1;
  CHECK_NCCL(ncclCommSplit(comm, 0, rank, &c, sc));
  CHECK_NCCL(ncclCommCount(c, &cnt));
  EXPECT(cnt == n, "split with a smaller config has %d ranks", cnt);
  CHECK_NCCL(ncclCommDestroy(c));

  /* not initialised with NCCL_CONFIG_INITIALIZER: refused before any communication */
  ncclConfig_t bad = init;
  bad.magic = 0;
  EXPECT(ncclCommSplit(comm, 0, rank, &c, &bad) == ncclInvalidArgument, "config without magic accepted");

  /* ncclCommInitRankScalable with an id every rank derives from the same source */
  ncclUniqueId ids[2];
  memset(ids, 0, sizeof(ids));
  snprintf(ids[0].internal, sizeof(ids[0].internal), "c_api_test-scalable");
  /* unique per job: rank 0's parent pid, broadcast so every rank builds the same id */
  int32_t tag = (int32_t)getppid(), tag0 = 0;
  CHECK_NCCL(ncclBroadcast(&tag, &tag0, 1, ncclInt32, 0, comm, NULL));
  memcpy(ids[0].internal + 100, &tag0, sizeof(tag0));
  ids[1] = ids[0];
  CHECK_NCCL(ncclCommInitRankScalable(&c, n, rank, 2, ids, NULL));
  float one = 1, total = 0;
  CHECK_NCCL(ncclAllReduce(&one, &total, 1, ncclFloat32, ncclSum, c, NULL));
  EXPECT(total == (float)n, "allreduce on a scalable-init comm: %g", total);
  CHECK_NCCL(ncclCommDestroy(c));
}

static void run_rank_tests(ncclComm_t comm, int rank, int n) {
  int v = 0;
  CHECK_NCCL(ncclGetVersion(&v));
  EXPECT(v == 23007, "version %d", v);
  int cnt = -1, me = -1, dev = -1;
  CHECK_NCCL(ncclCommCount(comm, &cnt));
  CHECK_NCCL(ncclCommUserRank(comm, &me));
  CHECK_NCCL(ncclCommCuDevice(comm, &dev));
  EXPECT(cnt == n && me == rank && dev >= 0, "count %d rank %d dev %d", cnt, me, dev);
  test_allreduce(comm, rank, n, 1, 0);
  test_allreduce(comm, rank, n, 1000, 1);
  size_t big = (size_t)atol(getenv("C_API_TEST_BIG_COUNT") ? getenv("C_API_TEST_BIG_COUNT") : "300000");
  test_allreduce(comm, rank, n, big, 0);
  test_allreduce(comm, rank, n, big, 1);
  test_allreduce(comm, rank, n, 0, 0);
  test_int_ops(comm, rank, n);
  test_premulsum(comm, rank, n);
  test_gathers(comm, rank, n);
  test_rooted(comm, rank, n);
  test_sendrecv(comm, rank, n);
  test_group_of_many(comm, rank, n);
  test_errors(comm, rank, n);
  test_split(comm, rank, n);
  if (!getenv("C_API_TEST_NONBLOCKING")) test_config_sizes(comm, rank, n);
  test_simulate(comm);
  void* mem = NULL;
  CHECK_NCCL(ncclMemAlloc(&mem, 12345));
  EXPECT(mem != NULL && ((uintptr_t)mem % 4096) == 0, "ncclMemAlloc alignment");
  void* handle = NULL;
  CHECK_NCCL(ncclCommRegister(comm, mem, 12345, &handle));
  CHECK_NCCL(ncclCommDeregister(comm, handle));
  CHECK_NCCL(ncclMemFree(mem));
}

static void group_allreduce(ncclComm_t* comms, int n, float* x, float* y) {
  memset(y, 0, n * sizeof(float));
  CHECK_NCCL(ncclGroupStart());
  for (int r = 0; r < n; r++) {
    x[r] = (float)(r + 1);
    CHECK_NCCL(ncclAllReduce(&x[r], &y[r], 1, ncclFloat32, ncclSum, comms[r], NULL));
  }
  CHECK_NCCL(ncclGroupEnd());
  for (int r = 0; r < n; r++) EXPECT(y[r] == (float)(n * (n + 1) / 2), "init-all allreduce member %d: %g", r, y[r]);
}

static int init_all_mode(int n, int fork_child) {
  g_rank = 0;
  ncclComm_t* comms = calloc(n, sizeof(ncclComm_t));
  CHECK_NCCL(ncclCommInitAll(comms, n, NULL));
  float* x = calloc(n, sizeof(float));
  float* y = calloc(n, sizeof(float));
  group_allreduce(comms, n, x, y);
  {
    /* NCCL's single-thread pattern: every member's init (and split) inside one group,
       completed by the group's end. */
    ncclUniqueId gid;
    CHECK_NCCL(ncclGetUniqueId(&gid));
    ncclComm_t* g = calloc(n, sizeof(ncclComm_t));
    CHECK_NCCL(ncclGroupStart());
    for (int r = 0; r < n; r++) CHECK_NCCL(ncclCommInitRank(&g[r], n, gid, r));
    CHECK_NCCL(ncclGroupEnd());
    group_allreduce(g, n, x, y);
    ncclComm_t* sub = calloc(n, sizeof(ncclComm_t));
    CHECK_NCCL(ncclGroupStart());
    for (int r = 0; r < n; r++) CHECK_NCCL(ncclCommSplit(g[r], r == 0 ? NCCL_SPLIT_NOCOLOR : 1, r, &sub[r], NULL));
    CHECK_NCCL(ncclGroupEnd());
    EXPECT(sub[0] == NULL, "NOCOLOR member got a communicator in a grouped split");
    if (n > 1) {
      int cnt = 0;
      CHECK_NCCL(ncclCommCount(sub[1], &cnt));
      EXPECT(cnt == n - 1, "grouped split has %d ranks, want %d", cnt, n - 1);
      CHECK_NCCL(ncclGroupStart());
      for (int r = 1; r < n; r++) {
        x[r] = (float)r;
        CHECK_NCCL(ncclAllReduce(&x[r], &y[r], 1, ncclFloat32, ncclSum, sub[r], NULL));
      }
      CHECK_NCCL(ncclGroupEnd());
      for (int r = 1; r < n; r++) EXPECT(y[r] == (float)(n * (n - 1) / 2), "grouped split allreduce %g", y[r]);
      for (int r = 1; r < n; r++) CHECK_NCCL(ncclCommDestroy(sub[r]));
    }
    for (int r = 0; r < n; r++) CHECK_NCCL(ncclCommDestroy(g[r]));
    free(sub);
    free(g);
  }
  if (fork_child) {
    /* A forked child opens its own connection; the parent's keeps working. */
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
      g_rank = 1000;
      ncclComm_t* mine = calloc(n, sizeof(ncclComm_t));
      CHECK_NCCL(ncclCommInitAll(mine, n, NULL));
      group_allreduce(mine, n, x, y);
      for (int r = 0; r < n; r++) CHECK_NCCL(ncclCommDestroy(mine[r]));
      _exit(g_failures ? 1 : 0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT(WIFEXITED(status) && WEXITSTATUS(status) == 0, "forked child failed (status 0x%x)", status);
    group_allreduce(comms, n, x, y);
  }
  for (int r = 0; r < n; r++) {
    int me;
    CHECK_NCCL(ncclCommUserRank(comms[r], &me));
    EXPECT(me == r, "member %d has rank %d", r, me);
    CHECK_NCCL(ncclCommDestroy(comms[r]));
  }
  free(comms);
  free(x);
  free(y);
  if (g_failures) return 1;
  printf("c_api_test init-all %d: OK\n", n);
  return 0;
}

/* One thread per rank in one process: every thread issues its own calls, concurrently. */
struct thread_arg {
  ncclComm_t comm;
  int rank, n, failures;
};

static void* rank_thread(void* p) {
  struct thread_arg* a = p;
  const size_t counts[] = {1, 1000, 100000};
  for (int rep = 0; rep < 20; rep++) {
    size_t count = counts[rep % 3];
    float* x = malloc(count * sizeof(float));
    float* y = malloc(count * sizeof(float));
    for (size_t i = 0; i < count; i++) x[i] = (float)(a->rank + i % 7);
    ncclResult_t r = ncclAllReduce(x, y, count, ncclFloat32, ncclSum, a->comm, NULL);
    if (r != ncclSuccess) {
      fprintf(stderr, "thread %d: allreduce: %s\n", a->rank, ncclGetLastError(a->comm));
      a->failures++;
    } else {
      for (size_t i = 0; i < count; i++)
        if (y[i] != (float)(a->n * (a->n - 1) / 2 + a->n * (int)(i % 7))) {
          a->failures++;
          break;
        }
    }
    free(x);
    free(y);
  }
  return NULL;
}

static int threads_mode(int n) {
  g_rank = 0;
  ncclComm_t* comms = calloc(n, sizeof(ncclComm_t));
  CHECK_NCCL(ncclCommInitAll(comms, n, NULL));
  pthread_t* th = calloc(n, sizeof(pthread_t));
  struct thread_arg* args = calloc(n, sizeof(struct thread_arg));
  for (int r = 0; r < n; r++) {
    args[r] = (struct thread_arg){comms[r], r, n, 0};
    pthread_create(&th[r], NULL, rank_thread, &args[r]);
  }
  int failures = 0;
  for (int r = 0; r < n; r++) {
    pthread_join(th[r], NULL);
    failures += args[r].failures;
  }
  for (int r = 0; r < n; r++) CHECK_NCCL(ncclCommDestroy(comms[r]));
  EXPECT(failures == 0, "%d wrong results across rank threads", failures);
  free(comms);
  free(th);
  free(args);
  if (g_failures) return 1;
  printf("c_api_test threads %d: OK\n", n);
  return 0;
}

/* Watchdog pattern: rank 0 blocks in an allreduce that rank 1 never joins; another thread
   of rank 0 aborts the communicator, which must wake the blocked call with an error. */
static void* abort_later(void* p) {
  usleep(1000 * 1000);
  ncclResult_t r = ncclCommAbort((ncclComm_t)p);
  if (r != ncclSuccess) fprintf(stderr, "ncclCommAbort: %s\n", ncclGetLastError(NULL));
  return NULL;
}

static int abort_mode(ncclComm_t comm, int rank) {
  if (rank == 0) {
    pthread_t th;
    pthread_create(&th, NULL, abort_later, comm);
    float x = 1, y = 0;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    ncclResult_t r = ncclAllReduce(&x, &y, 1, ncclFloat32, ncclSum, comm, NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    pthread_join(th, NULL);
    double waited = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
    EXPECT(r != ncclSuccess, "allreduce on an aborted communicator succeeded");
    EXPECT(waited < 15, "the blocked allreduce returned only after %.1f s", waited);
    fprintf(stderr, "rank 0: blocked allreduce returned %s after %.1f s: %s\n", ncclGetErrorString(r), waited,
            ncclGetLastError(NULL));
    EXPECT(ncclAllReduce(&x, &y, 1, ncclFloat32, ncclSum, comm, NULL) == ncclInvalidUsage,
           "an aborted communicator must refuse new calls");
  } else {
    usleep(3000 * 1000); /* never joins the allreduce */
    ncclResult_t async = ncclSuccess;
    CHECK_NCCL(ncclCommGetAsyncError(comm, &async));
    CHECK_NCCL(ncclCommAbort(comm));
  }
  if (g_failures) return 1;
  printf("c_api_test rank %d: OK\n", rank);
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 3 && strcmp(argv[1], "--init-all") == 0) return init_all_mode(atoi(argv[2]), 0);
  if (argc == 3 && strcmp(argv[1], "--fork") == 0) return init_all_mode(atoi(argv[2]), 1);
  if (argc == 3 && strcmp(argv[1], "--threads") == 0) return threads_mode(atoi(argv[2]));
  if (argc != 2) {
    fprintf(stderr, "usage: RANK=r WORLD_SIZE=n %s UNIQUE_ID_FILE | %s --init-all N\n", argv[0], argv[0]);
    return 2;
  }
  const char* rs = getenv("RANK");
  const char* ws = getenv("WORLD_SIZE");
  if (!rs || !ws) {
    fprintf(stderr, "RANK and WORLD_SIZE must be set\n");
    return 2;
  }
  int rank = atoi(rs), n = atoi(ws);
  g_rank = rank;
  ncclUniqueId id;
  if (rank == 0) {
    CHECK_NCCL(ncclGetUniqueId(&id));
    write_id(argv[1], &id);
  } else {
    read_id(argv[1], &id);
  }
  ncclComm_t comm = NULL;
  if (getenv("C_API_TEST_NONBLOCKING")) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    cfg.commName = "c_api_test";
    ncclResult_t r = ncclCommInitRankConfig(&comm, n, id, rank, &cfg);
    EXPECT(r == ncclInProgress || r == ncclSuccess, "non-blocking init returned %d", r);
    ncclResult_t st = ncclInProgress;
    for (int i = 0; i < 60000 && st == ncclInProgress; i++) {
      CHECK_NCCL(ncclCommGetAsyncError(comm, &st));
      if (st == ncclInProgress) usleep(1000);
    }
    EXPECT(st == ncclSuccess, "non-blocking init finished with %d", st);
  } else {
    CHECK_NCCL(ncclCommInitRank(&comm, n, id, rank));
  }
  if (getenv("C_API_TEST_ABORT")) return abort_mode(comm, rank);
  run_rank_tests(comm, rank, n);
  ncclResult_t async = ncclInProgress;
  CHECK_NCCL(ncclCommGetAsyncError(comm, &async));
  EXPECT(async == ncclSuccess, "async error %d", async);
  CHECK_NCCL(ncclCommFinalize(comm));
  CHECK_NCCL(ncclCommDestroy(comm));
  if (g_failures) {
    fprintf(stderr, "c_api_test rank %d: %d checks failed\n", rank, g_failures);
    return 1;
  }
  printf("c_api_test rank %d: OK\n", rank);
  return 0;
}
