/*
 * A stand-in for NVIDIA's libnccl.so.2, for tests of the proxy and passthrough modes only.
 * It exports the ncclX functions the forwarding modes need (no AlltoAll/Gather/Scatter, so
 * the shim's send/recv formulation of those is exercised), counts every call
 * (standin_calls("ncclAllReduce")), and computes real results on host memory for any number
 * of ranks held by ONE process, issued from one thread inside ncclGroupStart/End as NCCL
 * requires. Non-blocking like NCCL with config.blocking=0: init and split answer
 * ncclInProgress until every member has arrived; ncclCommGetAsyncError reports progress.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nccl.h"

#define EXPORT __attribute__((visibility("default")))

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

/* ---- call counting ---- */
struct Count { const char* name; long n; };
static struct Count g_counts[64];
static void counted(const char* name) {
  pthread_mutex_lock(&g_mu);
  for (int i = 0; i < 64; i++) {
    if (!g_counts[i].name) g_counts[i].name = name;
    if (strcmp(g_counts[i].name, name) == 0) { g_counts[i].n++; break; }
  }
  pthread_mutex_unlock(&g_mu);
}
EXPORT long standin_calls(const char* name) {
  long n = 0;
  pthread_mutex_lock(&g_mu);
  for (int i = 0; i < 64 && g_counts[i].name; i++)
    if (strcmp(g_counts[i].name, name) == 0) n = g_counts[i].n;
  pthread_mutex_unlock(&g_mu);
  return n;
}

/* ---- worlds and communicators ---- */
#define MAXR 64
struct World;
struct ncclComm {
  uint32_t magic;
  struct World* world;
  int rank;
  int split_seq;  /* splits this member took part in */
  int aborted;
};
struct Pending { struct ncclComm* comm; int color, key; struct ncclComm* child; };
struct World {
  char id[128];
  int nranks, joined;
  struct ncclComm* members[MAXR];
  /* one split rendezvous at a time per world */
  int split_seq, split_arrived;
  struct Pending split[MAXR];
  struct World* next;
};
static struct World* g_worlds;
static char g_last_error[256];

static struct World* new_world(const char* id, int nranks) {
  struct World* w = calloc(1, sizeof(*w));
  memcpy(w->id, id, 128);
  w->nranks = nranks;
  w->next = g_worlds;
  g_worlds = w;
  return w;
}
static int ready(struct ncclComm* c) { return c->world && c->world->joined == c->world->nranks; }

EXPORT ncclResult_t ncclGetVersion(int* v) { counted("ncclGetVersion"); *v = 22999; return ncclSuccess; }
EXPORT const char* ncclGetLastError(ncclComm_t c) { (void)c; return g_last_error; }

EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  static int seq;
  counted("ncclGetUniqueId");
  memset(id, 0, sizeof(*id));
  /* Binary, with zero bytes inside, like NCCL's (a socket address): carried intact? */
  snprintf(id->internal, sizeof(id->internal), "standin");
  int pid = getpid();
  pthread_mutex_lock(&g_mu);
  int s = ++seq;
  pthread_mutex_unlock(&g_mu);
  memcpy(id->internal + 64, &pid, sizeof(pid));
  memcpy(id->internal + 100, &s, sizeof(s));
  id->internal[127] = (char)0xfe;
  return ncclSuccess;
}

EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id, int rank, ncclConfig_t* cfg) {
  (void)cfg;
  counted("ncclCommInitRankConfig");
  if (nranks < 1 || nranks > MAXR || rank < 0 || rank >= nranks) {
    snprintf(g_last_error, sizeof(g_last_error), "stand-in: bad rank %d / nranks %d", rank, nranks);
    return ncclInvalidArgument;
  }
  pthread_mutex_lock(&g_mu);
  struct World* w = g_worlds;
  while (w && (memcmp(w->id, id.internal, 128) != 0 || w->joined == w->nranks)) w = w->next;
  if (!w) w = new_world(id.internal, nranks);
  struct ncclComm* c = calloc(1, sizeof(*c));
  c->magic = 0x57414e44;
  c->world = w;
  c->rank = rank;
  w->members[rank] = c;
  w->joined++;
  int done = w->joined == w->nranks;
  pthread_mutex_unlock(&g_mu);
  *out = c;
  return done ? ncclSuccess : ncclInProgress;
}

EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* out, ncclConfig_t* cfg) {
  (void)cfg;
  counted("ncclCommSplit");
  pthread_mutex_lock(&g_mu);
  struct World* w = comm->world;
  struct Pending* p = &w->split[comm->rank];
  p->comm = comm;
  p->color = color;
  p->key = key;
  p->child = NULL;
  if (color >= 0) {
    p->child = calloc(1, sizeof(*p->child));
    p->child->magic = 0x57414e44;
  }
  *out = p->child;
  if (++w->split_arrived == w->nranks) {
    /* Everyone is here: build one child world per colour, ranks ordered by (key, rank). */
    for (int r = 0; r < w->nranks; r++) {
      struct Pending* a = &w->split[r];
      if (a->color < 0 || a->child->world) continue;
      int members[MAXR], m = 0;
      for (int q = 0; q < w->nranks; q++)
        if (w->split[q].color == a->color) members[m++] = q;
      for (int i = 1; i < m; i++)  /* insertion sort by (key, parent rank) */
        for (int j = i; j > 0; j--) {
          struct Pending* x = &w->split[members[j - 1]];
          struct Pending* y = &w->split[members[j]];
          if (x->key > y->key || (x->key == y->key && members[j - 1] > members[j])) {
            int t = members[j - 1]; members[j - 1] = members[j]; members[j] = t;
          }
        }
      char cid[128] = {0};
      snprintf(cid, sizeof(cid), "split-%p-%d-%d", (void*)w, w->split_seq, a->color);
      struct World* cw = new_world(cid, m);
      for (int i = 0; i < m; i++) {
        struct ncclComm* ch = w->split[members[i]].child;
        ch->world = cw;
        ch->rank = i;
        cw->members[i] = ch;
      }
      cw->joined = m;
    }
    w->split_arrived = 0;
    w->split_seq++;
    pthread_mutex_unlock(&g_mu);
    return ncclSuccess;
  }
  pthread_mutex_unlock(&g_mu);
  return color >= 0 ? ncclInProgress : ncclSuccess;
}

/* Test hook: every communicator reports `code` from now on (a peer failure, say). */
static ncclResult_t g_injected;
EXPORT void standin_inject_async_error(int code) { g_injected = (ncclResult_t)code; }

EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t* st) {
  counted("ncclCommGetAsyncError");
  pthread_mutex_lock(&g_mu);
  *st = c->aborted ? ncclRemoteError : g_injected ? g_injected : ready(c) ? ncclSuccess : ncclInProgress;
  pthread_mutex_unlock(&g_mu);
  return ncclSuccess;
}
EXPORT ncclResult_t ncclCommCount(const ncclComm_t c, int* n) { counted("ncclCommCount"); *n = c->world->nranks; return ncclSuccess; }
EXPORT ncclResult_t ncclCommUserRank(const ncclComm_t c, int* r) { counted("ncclCommUserRank"); *r = c->rank; return ncclSuccess; }
EXPORT ncclResult_t ncclCommFinalize(ncclComm_t c) { (void)c; counted("ncclCommFinalize"); return ncclSuccess; }
EXPORT ncclResult_t ncclCommDestroy(ncclComm_t c) { counted("ncclCommDestroy"); c->magic = 0; return ncclSuccess; }
EXPORT ncclResult_t ncclCommAbort(ncclComm_t c) { counted("ncclCommAbort"); c->aborted = 1; return ncclSuccess; }

/* ---- PreMulSum operators ---- */
struct Op { int used; double scalar; const void* device_scalar; ncclDataType_t dt; };
static struct Op g_ops[16];
EXPORT ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void* scalar, ncclDataType_t dt,
                                             ncclScalarResidence_t res, ncclComm_t c) {
  (void)c;
  counted("ncclRedOpCreatePreMulSum");
  for (int i = 0; i < 16; i++)
    if (!g_ops[i].used) {
      g_ops[i].used = 1;
      g_ops[i].dt = dt;
      g_ops[i].device_scalar = res == ncclScalarDevice ? scalar : NULL;
      g_ops[i].scalar = dt == ncclFloat64 ? *(double*)scalar : dt == ncclFloat32 ? *(float*)scalar : 0;
      *op = (ncclRedOp_t)(ncclNumOps + i);
      return ncclSuccess;
    }
  return ncclInternalError;
}
EXPORT ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t c) {
  (void)c;
  counted("ncclRedOpDestroy");
  g_ops[op - ncclNumOps].used = 0;
  return ncclSuccess;
}

/* ---- operations, queued per thread until the outermost GroupEnd ---- */
enum { AR, BC, RD, AG, RS, SEND, RECV };
struct Call { int kind; const void* s; void* r; size_t count; ncclDataType_t dt; ncclRedOp_t op; int root; ncclComm_t c; int done; };
static __thread struct Call* t_calls;
static __thread size_t t_n, t_cap;
static __thread int t_depth;

static size_t dsize(ncclDataType_t dt) {
  switch (dt) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}
static double get(const void* p, ncclDataType_t dt, size_t i) {
  switch (dt) {
    case ncclFloat32: return ((const float*)p)[i];
    case ncclFloat64: return ((const double*)p)[i];
    case ncclInt32: return ((const int32_t*)p)[i];
    case ncclInt64: return (double)((const int64_t*)p)[i];
    default: return ((const uint8_t*)p)[i];
  }
}
static void put(void* p, ncclDataType_t dt, size_t i, double v) {
  switch (dt) {
    case ncclFloat32: ((float*)p)[i] = (float)v; break;
    case ncclFloat64: ((double*)p)[i] = v; break;
    case ncclInt32: ((int32_t*)p)[i] = (int32_t)v; break;
    case ncclInt64: ((int64_t*)p)[i] = (int64_t)v; break;
    default: ((uint8_t*)p)[i] = (uint8_t)v; break;
  }
}
static double combine(ncclRedOp_t op, double a, double b) {
  switch (op) {
    case ncclProd: return a * b;
    case ncclMax: return a > b ? a : b;
    case ncclMin: return a < b ? a : b;
    default: return a + b;  /* Sum, Avg (divided later), PreMulSum (pre-scaled) */
  }
}
static double prescale(ncclRedOp_t op, ncclDataType_t dt, double v) {
  if (op < ncclNumOps) return v;
  struct Op* o = &g_ops[op - ncclNumOps];
  double s = o->device_scalar ? get(o->device_scalar, dt, 0) : o->scalar;
  return v * s;
}

static ncclResult_t queue(int kind, const void* s, void* r, size_t count, ncclDataType_t dt, ncclRedOp_t op,
                          int root, ncclComm_t c) {
  if (!dsize(dt)) {
    snprintf(g_last_error, sizeof(g_last_error), "stand-in: datatype %d not supported", dt);
    return ncclInvalidArgument;
  }
  if (t_n == t_cap) {
    t_cap = t_cap ? 2 * t_cap : 16;
    t_calls = realloc(t_calls, t_cap * sizeof(*t_calls));
  }
  t_calls[t_n++] = (struct Call){kind, s, r, count, dt, op, root, c, 0};
  return ncclSuccess;
}

/* Runs the queued calls: the k-th collective of each member of a world together, each send
 * with the receiver's matching recv. Fails when something cannot be matched. */
static ncclResult_t execute(void) {
  ncclResult_t rc = ncclSuccess;
  for (size_t i = 0; i < t_n; i++) {
    struct Call* a = &t_calls[i];
    if (a->done) continue;
    struct World* w = a->c->world;
    int n = w->nranks;
    size_t es = dsize(a->dt), cnt = a->count;
    if (a->kind == SEND || a->kind == RECV) {
      int src = a->kind == SEND ? a->c->rank : a->root, dst = a->kind == SEND ? a->root : a->c->rank;
      struct Call* b = NULL;
      for (size_t j = 0; j < t_n && !b; j++) {
        struct Call* x = &t_calls[j];
        if (x->done || x == a || x->c->world != w || x->kind == a->kind || (x->kind != SEND && x->kind != RECV)) continue;
        int xs = x->kind == SEND ? x->c->rank : x->root, xd = x->kind == SEND ? x->root : x->c->rank;
        if (xs == src && xd == dst) b = x;
      }
      if (!b) { snprintf(g_last_error, sizeof(g_last_error), "stand-in: unmatched send/recv %d->%d", src, dst); return ncclInvalidUsage; }
      struct Call* snd = a->kind == SEND ? a : b;
      struct Call* rcv = a->kind == SEND ? b : a;
      memcpy(rcv->r, snd->s, cnt * es);
      a->done = b->done = 1;
      continue;
    }
    /* The same-index collective of every member (calls are queued in issue order). */
    struct Call* m[MAXR] = {0};
    int have = 0;
    for (size_t j = i; j < t_n; j++) {
      struct Call* x = &t_calls[j];
      if (x->done || x->c->world != w || x->kind == SEND || x->kind == RECV || m[x->c->rank]) continue;
      m[x->c->rank] = x;
      have++;
    }
    if (have != n) { snprintf(g_last_error, sizeof(g_last_error), "stand-in: %d of %d members issued the collective", have, n); return ncclInvalidUsage; }
    double* acc = calloc(cnt * (size_t)n, sizeof(double));
    switch (a->kind) {
      case AR: case RD: case RS: {
        size_t total = a->kind == RS ? cnt * (size_t)n : cnt;
        for (size_t e = 0; e < total; e++) {
          double v = prescale(a->op, a->dt, get(m[0]->s, a->dt, e));
          for (int r = 1; r < n; r++) v = combine(a->op, v, prescale(a->op, a->dt, get(m[r]->s, a->dt, e)));
          if (a->op == ncclAvg) v /= n;
          acc[e] = v;
        }
        for (int r = 0; r < n; r++) {
          if (a->kind == RD && r != a->root) continue;
          for (size_t e = 0; e < cnt; e++) put(m[r]->r, a->dt, e, acc[(a->kind == RS ? (size_t)r * cnt : 0) + e]);
        }
        break;
      }
      case BC: {
        char* tmp = malloc(cnt * es);
        memcpy(tmp, m[a->root]->s, cnt * es);
        for (int r = 0; r < n; r++) memcpy(m[r]->r, tmp, cnt * es);
        free(tmp);
        break;
      }
      case AG: {
        char* tmp = malloc(cnt * es * (size_t)n);
        for (int r = 0; r < n; r++) memcpy(tmp + (size_t)r * cnt * es, m[r]->s, cnt * es);
        for (int r = 0; r < n; r++) memcpy(m[r]->r, tmp, cnt * es * (size_t)n);
        free(tmp);
        break;
      }
    }
    free(acc);
    for (int r = 0; r < n; r++) m[r]->done = 1;
  }
  return rc;
}

EXPORT ncclResult_t ncclGroupStart(void) { counted("ncclGroupStart"); t_depth++; return ncclSuccess; }
EXPORT ncclResult_t ncclGroupEnd(void) {
  counted("ncclGroupEnd");
  if (t_depth == 0) return ncclInvalidUsage;
  if (--t_depth > 0) return ncclSuccess;
  ncclResult_t rc = execute();
  t_n = 0;
  return rc;
}

static ncclResult_t run(int kind, const void* s, void* r, size_t count, ncclDataType_t dt, ncclRedOp_t op, int root,
                        ncclComm_t c, const char* name) {
  counted(name);
  if (!c || c->magic != 0x57414e44 || c->aborted) return ncclInvalidArgument;
  ncclResult_t rc = queue(kind, s, r, count, dt, op, root, c);
  if (rc != ncclSuccess || t_depth > 0) return rc;
  rc = execute();  /* outside a group: only a 1-rank world (or a send to oneself) completes */
  t_n = 0;
  return rc;
}

EXPORT ncclResult_t ncclAllReduce(const void* s, void* r, size_t n, ncclDataType_t dt, ncclRedOp_t op, ncclComm_t c, cudaStream_t st) {
  (void)st; return run(AR, s, r, n, dt, op, -1, c, "ncclAllReduce");
}
EXPORT ncclResult_t ncclBroadcast(const void* s, void* r, size_t n, ncclDataType_t dt, int root, ncclComm_t c, cudaStream_t st) {
  (void)st; return run(BC, s, r, n, dt, ncclSum, root, c, "ncclBroadcast");
}
EXPORT ncclResult_t ncclReduce(const void* s, void* r, size_t n, ncclDataType_t dt, ncclRedOp_t op, int root, ncclComm_t c, cudaStream_t st) {
  (void)st; return run(RD, s, r, n, dt, op, root, c, "ncclReduce");
}
EXPORT ncclResult_t ncclAllGather(const void* s, void* r, size_t n, ncclDataType_t dt, ncclComm_t c, cudaStream_t st) {
  (void)st; return run(AG, s, r, n, dt, ncclSum, -1, c, "ncclAllGather");
}
EXPORT ncclResult_t ncclReduceScatter(const void* s, void* r, size_t n, ncclDataType_t dt, ncclRedOp_t op, ncclComm_t c, cudaStream_t st) {
  (void)st; return run(RS, s, r, n, dt, op, -1, c, "ncclReduceScatter");
}
EXPORT ncclResult_t ncclSend(const void* s, size_t n, ncclDataType_t dt, int peer, ncclComm_t c, cudaStream_t st) {
  (void)st; return run(SEND, s, NULL, n, dt, ncclSum, peer, c, "ncclSend");
}
EXPORT ncclResult_t ncclRecv(void* r, size_t n, ncclDataType_t dt, int peer, ncclComm_t c, cudaStream_t st) {
  (void)st; return run(RECV, NULL, r, n, dt, ncclSum, peer, c, "ncclRecv");
}
