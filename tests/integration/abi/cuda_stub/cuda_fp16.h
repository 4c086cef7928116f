/* Empty stand-in for CUDA's cuda_fp16.h (nccl.h includes it but uses nothing from it). */
