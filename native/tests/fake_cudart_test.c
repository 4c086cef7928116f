/*
 * Collectives on "device" buffers of the test-only CUDA runtime (fake_cudart.c), through
 * the shim and a real coordinator: the CPU-only check of the hybrid staging path.
 *
 *   RANK=r WORLD_SIZE=n fake_cudart_test UNIQUE_ID_FILE
 *
 * FAKE_CUDART_LOAD selects how the runtime enters the process, the three ways the shim
 * must find it:  global  dlopen(RTLD_GLOBAL)   local  dlopen(RTLD_LOCAL), as Python
 * extensions do   shim  not at all: FAKEGPU_MODE=hybrid makes the shim load it.
 * Inputs are written with cudaMemcpyAsync on the collective's stream (the fake runtime
 * defers such copies until the stream is synchronized) and results are read back with
 * cudaMemcpyAsync queued after the collective, so stream order is checked too.
 * Prints "fake_cudart_test rank R: OK d2h=.. h2d=.. syncs=.. pinned=.." on success.
 */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "nccl.h"
#include "test_util.h"

#define CHECK_CUDA(call)                                                                   \
  do {                                                                                     \
    int e_ = (call);                                                                       \
    if (e_ != 0) {                                                                         \
      fprintf(stderr, "rank %d: %s:%d: %s -> cuda error %d\n", g_rank, __FILE__, __LINE__, #call, e_); \
      exit(2);                                                                             \
    }                                                                                      \
  } while (0)

enum { H2D = 1, D2H = 2 };
static int (*cudaMalloc_)(void**, size_t);
static int (*cudaFree_)(void*);
static int (*cudaMemcpy_)(void*, const void*, size_t, int);
static int (*cudaMemcpyAsync_)(void*, const void*, size_t, int, void*);
static int (*cudaStreamSynchronize_)(void*);
static int (*cudaStreamCreate_)(void**);
static int (*cudaPointerGetAttributes_)(void*, const void*);
static void (*fake_cudart_counts_)(long*, long*, long*, long*);

static void bind_runtime(void* h) {
#define BIND(name) \
  if (!(*(void**)&name##_ = dlsym(h, #name))) { fprintf(stderr, "missing %s\n", #name); exit(2); }
  BIND(cudaMalloc) BIND(cudaFree) BIND(cudaMemcpy) BIND(cudaMemcpyAsync) BIND(cudaStreamSynchronize)
  BIND(cudaStreamCreate) BIND(cudaPointerGetAttributes) BIND(fake_cudart_counts)
#undef BIND
}

static int attr_type(const void* p) {
  struct { int type; int device; void* dp; void* hp; char pad[64]; } a;
  CHECK_CUDA(cudaPointerGetAttributes_(&a, p));
  return a.type;
}

/* Device buffer holding host[0..n) once `stream` runs (the copy is deferred). */
static float* dev_from(const float* host, size_t n, void* stream) {
  void* d;
  CHECK_CUDA(cudaMalloc_(&d, n * sizeof(float)));
  CHECK_CUDA(cudaMemcpyAsync_(d, host, n * sizeof(float), H2D, stream));
  return d;
}
/* Reads a device buffer back through the stream: ordered after the collective. */
static float* host_from(const float* dev, size_t n, void* stream) {
  float* h = malloc(n * sizeof(float));
  CHECK_CUDA(cudaMemcpyAsync_(h, dev, n * sizeof(float), D2H, stream));
  CHECK_CUDA(cudaStreamSynchronize_(stream));
  return h;
}

static void test_allreduce(ncclComm_t comm, int rank, int n, size_t count, void* stream, int in_place) {
  float* x = malloc(count * sizeof(float));
  for (size_t i = 0; i < count; i++) x[i] = val(rank, i);
  float* dx = dev_from(x, count, stream);
  float* dy = in_place ? dx : dev_from(x, count, stream);
  CHECK_NCCL(ncclAllReduce(dx, dy, count, ncclFloat32, ncclSum, comm, stream));
  float* y = host_from(dy, count, stream);
  for (size_t i = 0; i < count; i++) {
    float want = 0;
    for (int r = 0; r < n; r++) want += val(r, i);
    if (y[i] != want) {
      EXPECT(0, "allreduce(count=%zu, in_place=%d)[%zu] = %g, want %g", count, in_place, i, y[i], want);
      break;
    }
  }
  cudaFree_(dx);
  if (!in_place) cudaFree_(dy);
  free(x);
  free(y);
}

static void test_gathers(ncclComm_t comm, int rank, int n, size_t count, void* stream) {
  /* AllGather: device in, device out. */
  float* x = malloc(n * count * sizeof(float));
  for (size_t i = 0; i < count; i++) x[i] = val(rank, i);
  float* dx = dev_from(x, count, stream);
  float* dy;
  CHECK_CUDA(cudaMalloc_((void**)&dy, n * count * sizeof(float)));
  CHECK_NCCL(ncclAllGather(dx, dy, count, ncclFloat32, comm, stream));
  float* y = host_from(dy, n * count, stream);
  for (int r = 0; r < n; r++)
    for (size_t i = 0; i < count; i++)
      if (y[r * count + i] != val(r, i)) {
        EXPECT(0, "allgather block %d [%zu] = %g, want %g", r, i, y[r * count + i], val(r, i));
        r = n;
        break;
      }
  free(y);
  /* ReduceScatter: device in (n blocks), device out. */
  for (int b = 0; b < n; b++)
    for (size_t i = 0; i < count; i++) x[b * count + i] = val(rank, i) * (float)(b + 1);
  float* dz = dev_from(x, n * count, stream);
  float* dw;
  CHECK_CUDA(cudaMalloc_((void**)&dw, count * sizeof(float)));
  CHECK_NCCL(ncclReduceScatter(dz, dw, count, ncclFloat32, ncclSum, comm, stream));
  float* w = host_from(dw, count, stream);
  for (size_t i = 0; i < count; i++) {
    float want = 0;
    for (int r = 0; r < n; r++) want += val(r, i) * (float)(rank + 1);
    if (w[i] != want) {
      EXPECT(0, "reducescatter[%zu] = %g, want %g", i, w[i], want);
      break;
    }
  }
  free(w);
  /* AlltoAll: host in, device out (mixed residences in one call). */
  for (int b = 0; b < n; b++)
    for (size_t i = 0; i < count; i++) x[b * count + i] = (float)(rank * 1000 + b * 10) + (float)(i % 7);
  CHECK_NCCL(ncclAlltoAll(x, dy, count, ncclFloat32, comm, stream));
  y = host_from(dy, n * count, stream);
  for (int b = 0; b < n; b++)
    for (size_t i = 0; i < count; i++) {
      float want = (float)(b * 1000 + rank * 10) + (float)(i % 7);
      if (y[b * count + i] != want) {
        EXPECT(0, "alltoall block %d [%zu] = %g, want %g", b, i, y[b * count + i], want);
        b = n;
        break;
      }
    }
  free(y);
  cudaFree_(dx); cudaFree_(dy); cudaFree_(dz); cudaFree_(dw);
  free(x);
}

static void test_broadcast_sendrecv(ncclComm_t comm, int rank, int n, void* stream) {
  const size_t count = 333;
  float* x = malloc(count * sizeof(float));
  for (size_t i = 0; i < count; i++) x[i] = val(rank, i);
  float* dx = dev_from(x, count, stream);
  const int root = n - 1;
  CHECK_NCCL(ncclBroadcast(dx, dx, count, ncclFloat32, root, comm, stream));
  float* y = host_from(dx, count, stream);
  for (size_t i = 0; i < count; i++)
    if (y[i] != val(root, i)) {
      EXPECT(0, "broadcast[%zu] = %g, want %g", i, y[i], val(root, i));
      break;
    }
  free(y);
  /* A ring of send/recv in one group: send from device, receive into device. */
  float* dr;
  CHECK_CUDA(cudaMalloc_((void**)&dr, count * sizeof(float)));
  for (size_t i = 0; i < count; i++) x[i] = val(rank, i) + 0.5f;
  CHECK_CUDA(cudaMemcpyAsync_(dx, x, count * sizeof(float), H2D, stream));
  CHECK_NCCL(ncclGroupStart());
  CHECK_NCCL(ncclSend(dx, count, ncclFloat32, (rank + 1) % n, comm, stream));
  CHECK_NCCL(ncclRecv(dr, count, ncclFloat32, (rank + n - 1) % n, comm, stream));
  CHECK_NCCL(ncclGroupEnd());
  y = host_from(dr, count, stream);
  int from = (rank + n - 1) % n;
  for (size_t i = 0; i < count; i++)
    if (y[i] != val(from, i) + 0.5f) {
      EXPECT(0, "recv[%zu] = %g, want %g", i, y[i], val(from, i) + 0.5f);
      break;
    }
  free(y);
  cudaFree_(dx); cudaFree_(dr);
  free(x);
}

static void test_premulsum_device_scalar(ncclComm_t comm, int rank, int n, void* stream) {
  const size_t count = 64;
  float* dscale;
  CHECK_CUDA(cudaMalloc_((void**)&dscale, sizeof(float)));
  ncclRedOp_t op;
  CHECK_NCCL(ncclRedOpCreatePreMulSum(&op, dscale, ncclFloat32, ncclScalarDevice, comm));
  /* The scalar is written on the stream after the op was created: NCCL reads it when the
   * collective runs, so 0.25 (not the old contents) must be used. */
  float scale = 0.25f;
  CHECK_CUDA(cudaMemcpyAsync_(dscale, &scale, sizeof(float), H2D, stream));
  float x[64];
  for (size_t i = 0; i < count; i++) x[i] = val(rank, i);
  float* dx = dev_from(x, count, stream);
  CHECK_NCCL(ncclAllReduce(dx, dx, count, ncclFloat32, op, comm, stream));
  float* y = host_from(dx, count, stream);
  for (size_t i = 0; i < count; i++) {
    float want = 0;
    for (int r = 0; r < n; r++) want += val(r, i) * 0.25f;
    if (y[i] != want) {
      EXPECT(0, "premulsum(device scalar)[%zu] = %g, want %g", i, y[i], want);
      break;
    }
  }
  free(y);
  CHECK_NCCL(ncclRedOpDestroy(op, comm));
  cudaFree_(dx); cudaFree_(dscale);
}

static void test_memalloc(ncclComm_t comm, int rank, int n, void* stream) {
  const size_t count = 1000;
  float* d;
  CHECK_NCCL(ncclMemAlloc((void**)&d, count * sizeof(float)));
  EXPECT(attr_type(d) == 2, "ncclMemAlloc gave memory of type %d, want device (2)", attr_type(d));
  float* x = malloc(count * sizeof(float));
  for (size_t i = 0; i < count; i++) x[i] = val(rank, i);
  CHECK_CUDA(cudaMemcpyAsync_(d, x, count * sizeof(float), H2D, stream));
  CHECK_NCCL(ncclAllReduce(d, d, count, ncclFloat32, ncclMax, comm, stream));
  float* y = host_from(d, count, stream);
  for (size_t i = 0; i < count; i++)
    if (y[i] != val(n - 1, i)) {
      EXPECT(0, "allreduce max on ncclMemAlloc memory [%zu] = %g, want %g", i, y[i], val(n - 1, i));
      break;
    }
  CHECK_NCCL(ncclMemFree(d));
  free(x);
  free(y);
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: RANK=r WORLD_SIZE=n %s UNIQUE_ID_FILE\n", argv[0]);
    return 2;
  }
  g_rank = atoi(getenv("RANK") ? getenv("RANK") : "0");
  int n = atoi(getenv("WORLD_SIZE") ? getenv("WORLD_SIZE") : "1");
  const char* how = getenv("FAKE_CUDART_LOAD") ? getenv("FAKE_CUDART_LOAD") : "global";
  void* h = NULL;
  void* early = NULL;
  if (strcmp(how, "global") == 0) {
    h = dlopen("libcudart.so.12", RTLD_NOW | RTLD_GLOBAL);
  } else if (strcmp(how, "local") == 0) {
    h = dlopen("libcudart.so.12", RTLD_NOW | RTLD_LOCAL);
  } else {
    /* The shim loads the runtime itself (FAKEGPU_MODE=hybrid) on first need. */
    CHECK_NCCL(ncclMemAlloc(&early, 4096));
    h = dlopen("libcudart.so.12", RTLD_NOW | RTLD_NOLOAD);
    EXPECT(h != NULL, "the shim did not load libcudart.so.12 in hybrid mode");
  }
  if (!h) {
    fprintf(stderr, "rank %d: cannot load libcudart.so.12: %s\n", g_rank, dlerror());
    return 2;
  }
  bind_runtime(h);
  if (early) {
    EXPECT(attr_type(early) == 2, "early ncclMemAlloc not device memory");
    CHECK_NCCL(ncclMemFree(early));
  }

  ncclUniqueId id;
  if (g_rank == 0) {
    CHECK_NCCL(ncclGetUniqueId(&id));
    write_id(argv[1], &id);
  } else {
    read_id(argv[1], &id);
  }
  ncclComm_t comm;
  CHECK_NCCL(ncclCommInitRank(&comm, n, id, g_rank));
  void* stream;
  CHECK_CUDA(cudaStreamCreate_(&stream));

  test_allreduce(comm, g_rank, n, 1, stream, 0);
  test_allreduce(comm, g_rank, n, 4099, stream, 0);
  test_allreduce(comm, g_rank, n, 4099, NULL, 1);  /* the legacy default stream */
  test_allreduce(comm, g_rank, n, 70000, stream, 1);  /* cut into steps with a small staging size */
  test_gathers(comm, g_rank, n, 1500, stream);
  test_broadcast_sendrecv(comm, g_rank, n, stream);
  test_premulsum_device_scalar(comm, g_rank, n, stream);
  test_memalloc(comm, g_rank, n, stream);

  long d2h = 0, h2d = 0, syncs = 0, pinned = 0;
  fake_cudart_counts_(&d2h, &h2d, &syncs, &pinned);
  /* Every device input went through a device->host copy and every device output back. */
  EXPECT(d2h >= 10, "only %ld device->host copies: the staging path was not used", d2h);
  EXPECT(h2d >= 10, "only %ld host->device copies", h2d);
  CHECK_NCCL(ncclCommDestroy(comm));
  if (g_failures) {
    fprintf(stderr, "fake_cudart_test rank %d: %d check(s) failed\n", g_rank, g_failures);
    return 1;
  }
  printf("fake_cudart_test rank %d: OK d2h=%ld h2d=%ld syncs=%ld pinned=%ld\n", g_rank, d2h, h2d, syncs, pinned);
  return 0;
}
