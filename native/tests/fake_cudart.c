/*
 * A stand-in CUDA runtime for tests only: built as libcudart.so.12, exporting the few
 * cuda* functions the shim's device staging uses, so CI without a GPU drives that path.
 *
 * It is deliberately strict, so that a shim that cuts corners fails loudly:
 *  - "device" memory is mmap'ed PROT_NONE: any direct host access (memcpy by the shim
 *    instead of cudaMemcpy*) is a segfault. Copies lift the protection under a lock.
 *  - cudaMemcpyAsync does NOT copy when called: the copy is queued on its stream and runs
 *    at cudaStreamSynchronize (or a synchronous cudaMemcpy / cudaDeviceSynchronize). A shim
 *    that reads staged input without synchronizing the caller's stream sees stale bytes.
 *  - the direction (cudaMemcpyKind) must match the pointers, else cudaErrorInvalidValue.
 * fake_cudart_counts() reports how many copies and synchronizations happened.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

enum { kSuccess = 0, kInvalidValue = 1, kMemoryAllocation = 2, kInvalidResourceHandle = 400 };
enum { H2H = 0, H2D = 1, D2H = 2, D2D = 3, DEFAULT = 4 };

struct Alloc { uintptr_t base; size_t len; size_t map_len; int device; };
struct Op { void* dst; const void* src; size_t n; };
struct Stream { uint32_t magic; struct Op* ops; size_t n, cap; };

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct Alloc* g_allocs; static size_t g_nallocs, g_cap_allocs;
static struct Alloc* g_pinned; static size_t g_npinned, g_cap_pinned;
static struct Stream g_null_stream = {0x5354524d, NULL, 0, 0};
static struct Stream* g_streams[1024]; static size_t g_nstreams;
static int g_last_error;
static long g_d2h, g_h2d, g_syncs, g_host_register, g_async_bytes;

static size_t page(void) { long p = sysconf(_SC_PAGESIZE); return p > 0 ? (size_t)p : 4096; }

static struct Alloc* find_alloc(const void* p) {
  uintptr_t a = (uintptr_t)p;
  for (size_t i = 0; i < g_nallocs; i++)
    if (a >= g_allocs[i].base && a < g_allocs[i].base + g_allocs[i].len) return &g_allocs[i];
  return NULL;
}
static int is_pinned(const void* p) {
  uintptr_t a = (uintptr_t)p;
  for (size_t i = 0; i < g_npinned; i++)
    if (a >= g_pinned[i].base && a < g_pinned[i].base + g_pinned[i].len) return 1;
  return 0;
}
static int set_error(int e) { if (e) g_last_error = e; return e; }

static struct Stream* stream_of(void* s) {
  /* 0 = legacy default stream, 1/2 = cudaStreamLegacy/PerThread: one queue here. */
  if ((uintptr_t)s <= 2) return &g_null_stream;
  for (size_t i = 0; i < g_nstreams; i++)
    if (g_streams[i] == s) return g_streams[i];
  return NULL;
}

/* One copy with the device side unprotected (lock held). */
static void do_copy(void* dst, const void* src, size_t n) {
  struct Alloc* d = find_alloc(dst);
  struct Alloc* s = find_alloc(src);
  if (d) mprotect((void*)d->base, d->map_len, PROT_READ | PROT_WRITE);
  if (s && s != d) mprotect((void*)s->base, s->map_len, PROT_READ);
  memmove(dst, src, n);
  if (d) mprotect((void*)d->base, d->map_len, PROT_NONE);
  if (s && s != d) mprotect((void*)s->base, s->map_len, PROT_NONE);
}

static void drain(struct Stream* st) {
  for (size_t i = 0; i < st->n; i++) do_copy(st->ops[i].dst, st->ops[i].src, st->ops[i].n);
  st->n = 0;
}
static void drain_all(void) {
  drain(&g_null_stream);
  for (size_t i = 0; i < g_nstreams; i++) drain(g_streams[i]);
}

/* 0 when kind agrees with where dst/src live (range checked for device pointers). */
static int check_kind(void* dst, const void* src, size_t n, int kind) {
  struct Alloc* d = find_alloc(dst);
  struct Alloc* s = find_alloc(src);
  if (d && (uintptr_t)dst + n > d->base + d->len) return kInvalidValue;
  if (s && (uintptr_t)src + n > s->base + s->len) return kInvalidValue;
  switch (kind) {
    case H2H: return (!d && !s) ? 0 : kInvalidValue;
    case H2D: return (d && !s) ? 0 : kInvalidValue;
    case D2H: return (!d && s) ? 0 : kInvalidValue;
    case D2D: return (d && s) ? 0 : kInvalidValue;
    case DEFAULT: return 0;
  }
  return kInvalidValue;
}

static void count(void* dst, const void* src, size_t n) {
  if (find_alloc(src) && !find_alloc(dst)) g_d2h++;
  if (find_alloc(dst) && !find_alloc(src)) g_h2d++;
  (void)n;
}

EXPORT int cudaMalloc(void** p, size_t n) {
  if (!p) return set_error(kInvalidValue);
  size_t len = n ? n : 1, map_len = (len + page() - 1) / page() * page();
  void* m = mmap(NULL, map_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return set_error(kMemoryAllocation);
  pthread_mutex_lock(&g_mu);
  if (g_nallocs == g_cap_allocs) {
    g_cap_allocs = g_cap_allocs ? 2 * g_cap_allocs : 64;
    g_allocs = realloc(g_allocs, g_cap_allocs * sizeof(*g_allocs));
  }
  g_allocs[g_nallocs++] = (struct Alloc){(uintptr_t)m, len, map_len, 0};
  pthread_mutex_unlock(&g_mu);
  *p = m;
  return 0;
}

EXPORT int cudaFree(void* p) {
  if (!p) return 0;
  pthread_mutex_lock(&g_mu);
  for (size_t i = 0; i < g_nallocs; i++) {
    if (g_allocs[i].base == (uintptr_t)p) {
      drain_all();  /* cudaFree synchronizes */
      munmap(p, g_allocs[i].map_len);
      g_allocs[i] = g_allocs[--g_nallocs];
      pthread_mutex_unlock(&g_mu);
      return 0;
    }
  }
  pthread_mutex_unlock(&g_mu);
  return set_error(kInvalidValue);
}

/* cudaPointerAttributes as in CUDA 10..13. */
struct Attr { int type; int device; void* devicePointer; void* hostPointer; };

EXPORT int cudaPointerGetAttributes(struct Attr* a, const void* p) {
  if (!a) return set_error(kInvalidValue);
  pthread_mutex_lock(&g_mu);
  struct Alloc* d = find_alloc(p);
  int pinned = !d && is_pinned(p);
  pthread_mutex_unlock(&g_mu);
  memset(a, 0, sizeof(*a));
  if (d) {
    a->type = 2;
    a->devicePointer = (void*)p;
  } else if (pinned) {
    a->type = 1;
    a->hostPointer = (void*)p;
    a->devicePointer = (void*)p;
  } else {
    a->type = 0;  /* unregistered host memory (CUDA >= 11 answers success) */
    a->device = -2;
    a->hostPointer = (void*)p;
  }
  return 0;
}

EXPORT int cudaMemcpyAsync(void* dst, const void* src, size_t n, int kind, void* stream) {
  pthread_mutex_lock(&g_mu);
  struct Stream* st = stream_of(stream);
  int e = !st ? kInvalidResourceHandle : check_kind(dst, src, n, kind);
  if (!e) {
    if (st->n == st->cap) {
      st->cap = st->cap ? 2 * st->cap : 16;
      st->ops = realloc(st->ops, st->cap * sizeof(*st->ops));
    }
    st->ops[st->n++] = (struct Op){dst, src, n};
    count(dst, src, n);
    g_async_bytes += (long)n;
  }
  pthread_mutex_unlock(&g_mu);
  return set_error(e);
}

EXPORT int cudaMemcpy(void* dst, const void* src, size_t n, int kind) {
  pthread_mutex_lock(&g_mu);
  int e = check_kind(dst, src, n, kind);
  if (!e) {
    drain_all();  /* synchronous with respect to all (blocking) streams */
    do_copy(dst, src, n);
    count(dst, src, n);
  }
  pthread_mutex_unlock(&g_mu);
  return set_error(e);
}

EXPORT int cudaStreamSynchronize(void* stream) {
  pthread_mutex_lock(&g_mu);
  struct Stream* st = stream_of(stream);
  if (st) {
    drain(st);
    g_syncs++;
  }
  pthread_mutex_unlock(&g_mu);
  return set_error(st ? 0 : kInvalidResourceHandle);
}

EXPORT int cudaDeviceSynchronize(void) {
  pthread_mutex_lock(&g_mu);
  drain_all();
  pthread_mutex_unlock(&g_mu);
  return 0;
}

EXPORT int cudaStreamCreate(void** out) {
  if (!out) return set_error(kInvalidValue);
  struct Stream* s = calloc(1, sizeof(*s));
  s->magic = 0x5354524d;
  pthread_mutex_lock(&g_mu);
  int e = g_nstreams < sizeof(g_streams) / sizeof(g_streams[0]) ? 0 : kMemoryAllocation;
  if (!e) g_streams[g_nstreams++] = s;
  pthread_mutex_unlock(&g_mu);
  if (e) free(s);
  else *out = s;
  return set_error(e);
}

EXPORT int cudaStreamDestroy(void* stream) {
  pthread_mutex_lock(&g_mu);
  for (size_t i = 0; i < g_nstreams; i++) {
    if (g_streams[i] == stream) {
      drain(g_streams[i]);
      free(g_streams[i]->ops);
      free(g_streams[i]);
      g_streams[i] = g_streams[--g_nstreams];
      pthread_mutex_unlock(&g_mu);
      return 0;
    }
  }
  pthread_mutex_unlock(&g_mu);
  return set_error(kInvalidResourceHandle);
}

EXPORT int cudaHostRegister(void* p, size_t n, unsigned flags) {
  (void)flags;
  pthread_mutex_lock(&g_mu);
  if (g_npinned == g_cap_pinned) {
    g_cap_pinned = g_cap_pinned ? 2 * g_cap_pinned : 8;
    g_pinned = realloc(g_pinned, g_cap_pinned * sizeof(*g_pinned));
  }
  g_pinned[g_npinned++] = (struct Alloc){(uintptr_t)p, n, n, 0};
  g_host_register++;
  pthread_mutex_unlock(&g_mu);
  return 0;
}

EXPORT int cudaHostUnregister(void* p) {
  pthread_mutex_lock(&g_mu);
  for (size_t i = 0; i < g_npinned; i++)
    if (g_pinned[i].base == (uintptr_t)p) {
      g_pinned[i] = g_pinned[--g_npinned];
      pthread_mutex_unlock(&g_mu);
      return 0;
    }
  pthread_mutex_unlock(&g_mu);
  return set_error(kInvalidValue);
}

EXPORT int cudaGetLastError(void) {
  int e = g_last_error;
  g_last_error = 0;
  return e;
}

EXPORT const char* cudaGetErrorString(int e) {
  switch (e) {
    case kSuccess: return "no error";
    case kInvalidValue: return "invalid argument";
    case kMemoryAllocation: return "out of memory";
    case kInvalidResourceHandle: return "invalid resource handle";
  }
  return "unknown error";
}

/* Test introspection: copies device->host and host->device issued (async and sync),
 * stream synchronizations, host registrations. */
EXPORT void fake_cudart_counts(long* d2h, long* h2d, long* syncs, long* host_register) {
  pthread_mutex_lock(&g_mu);
  if (d2h) *d2h = g_d2h;
  if (h2d) *h2d = g_h2d;
  if (syncs) *syncs = g_syncs;
  if (host_register) *host_register = g_host_register;
  pthread_mutex_unlock(&g_mu);
}
