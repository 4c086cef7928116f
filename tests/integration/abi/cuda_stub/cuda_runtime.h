/* Minimal stand-in for CUDA's cuda_runtime.h, enough for NVIDIA's nccl.h to compile on a
 * machine without the CUDA toolkit: the one CUDA type and macro nccl.h uses, declared
 * exactly as CUDA declares them. Used only by tests/integration/test_abi.py. */
#ifndef FAKEGPU_CUDA_RUNTIME_STUB_H
#define FAKEGPU_CUDA_RUNTIME_STUB_H
#include <stddef.h> /* the real header brings size_t and NULL along */
#define __DRIVER_TYPES_H__ 1
#define CUDART_VERSION 13000
typedef struct CUstream_st* cudaStream_t;
#endif
