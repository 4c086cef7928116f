/*
 * Prints every ABI-relevant fact of an nccl.h: enum values, type sizes and alignments,
 * struct field offsets, macro values and initializer contents, one "name value" per line.
 *
 * tests/integration/test_abi.py compiles this file once against NVIDIA's nccl.h and once against
 * fakegpu's native/include/nccl.h and requires the two outputs to be identical.
 * It is valid C and C++, so it is also built as C++ (NVIDIA's header takes other
 * include paths there).
 */
#include <nccl.h>

#include <stddef.h>
#include <stdio.h>
#include <string.h>

#ifdef __cplusplus
#define ALIGNOF(T) alignof(T)
#else
#define ALIGNOF(T) _Alignof(T)
#endif

#define INT(name) printf("%s %lld\n", #name, (long long)(name))
#define UINT(name) printf("%s %llu\n", #name, (unsigned long long)(name))
#define TYPE(T) printf("sizeof(%s) %zu\nalignof(%s) %zu\n", #T, sizeof(T), #T, (size_t)ALIGNOF(T))
#define FIELD(T, f) \
  printf("offsetof(%s,%s) %zu sizeof %zu\n", #T, #f, offsetof(T, f), sizeof(((T*)0)->f))

static void enums(void) {
  INT(ncclSuccess); INT(ncclUnhandledCudaError); INT(ncclSystemError); INT(ncclInternalError);
  INT(ncclInvalidArgument); INT(ncclInvalidUsage); INT(ncclRemoteError); INT(ncclInProgress);
  INT(ncclTimeout); INT(ncclNumResults);

  INT(ncclNumOps_dummy);
  INT(ncclSum); INT(ncclProd); INT(ncclMax); INT(ncclMin); INT(ncclAvg); INT(ncclNumOps);
  INT(ncclMaxRedOp);

  INT(ncclInt8); INT(ncclChar); INT(ncclUint8); INT(ncclInt32); INT(ncclInt); INT(ncclUint32);
  INT(ncclInt64); INT(ncclUint64); INT(ncclFloat16); INT(ncclHalf); INT(ncclFloat32);
  INT(ncclFloat); INT(ncclFloat64); INT(ncclDouble); INT(ncclBfloat16); INT(ncclFloat8e4m3);
  INT(ncclFloat8e5m2); INT(ncclNumTypes);

  INT(ncclScalarDevice); INT(ncclScalarHostImmediate);

  INT(ncclStatGpuMemSuspend); INT(ncclStatGpuMemSuspended); INT(ncclStatGpuMemPersist);
  INT(ncclStatGpuMemTotal);
}

static void types(void) {
  TYPE(ncclResult_t); TYPE(ncclRedOp_t); TYPE(ncclRedOp_dummy_t); TYPE(ncclDataType_t);
  TYPE(ncclScalarResidence_t); TYPE(ncclCommMemStat_t);
  TYPE(ncclComm_t); TYPE(ncclWindow_t); TYPE(ncclParamHandle_t); TYPE(cudaStream_t);
  TYPE(ncclUniqueId); TYPE(ncclConfig_t); TYPE(struct ncclConfig_v23000);
  TYPE(ncclSimInfo_t); TYPE(struct ncclSimInfo_v22200); TYPE(ncclWaitSignalDesc_t);
}

static void fields(void) {
  FIELD(ncclUniqueId, internal);

  FIELD(ncclConfig_t, size); FIELD(ncclConfig_t, magic); FIELD(ncclConfig_t, version);
  FIELD(ncclConfig_t, blocking); FIELD(ncclConfig_t, cgaClusterSize);
  FIELD(ncclConfig_t, minCTAs); FIELD(ncclConfig_t, maxCTAs); FIELD(ncclConfig_t, netName);
  FIELD(ncclConfig_t, splitShare); FIELD(ncclConfig_t, trafficClass);
  FIELD(ncclConfig_t, commName); FIELD(ncclConfig_t, collnetEnable);
  FIELD(ncclConfig_t, CTAPolicy); FIELD(ncclConfig_t, shrinkShare);
  FIELD(ncclConfig_t, nvlsCTAs); FIELD(ncclConfig_t, nChannelsPerNetPeer);
  FIELD(ncclConfig_t, nvlinkCentricSched); FIELD(ncclConfig_t, graphUsageMode);
  FIELD(ncclConfig_t, numRmaCtx); FIELD(ncclConfig_t, maxP2pPeers);
  FIELD(ncclConfig_t, graphStreamOrdering);

  FIELD(ncclSimInfo_t, size); FIELD(ncclSimInfo_t, magic); FIELD(ncclSimInfo_t, version);
  FIELD(ncclSimInfo_t, estimatedTime);

  FIELD(ncclWaitSignalDesc_t, opCnt); FIELD(ncclWaitSignalDesc_t, peer);
  FIELD(ncclWaitSignalDesc_t, sigIdx); FIELD(ncclWaitSignalDesc_t, ctx);
}

static void macros(void) {
  INT(NCCL_MAJOR); INT(NCCL_MINOR); INT(NCCL_PATCH);
  printf("NCCL_SUFFIX \"%s\"\n", NCCL_SUFFIX);
  INT(NCCL_VERSION_CODE);
  INT(NCCL_VERSION(2, 8, 4)); INT(NCCL_VERSION(2, 9, 6)); INT(NCCL_VERSION(2, 30, 7));
  INT(NCCL_VERSION(3, 0, 0)); INT(NCCL_VERSION(1, 8, 9));
  INT(NCCL_UNIQUE_ID_BYTES); INT(NCCL_SPLIT_NOCOLOR);
  INT(NCCL_CONFIG_UNDEF_INT);
  printf("NCCL_CONFIG_UNDEF_PTR %d\n", NCCL_CONFIG_UNDEF_PTR == NULL);
  printf("NCCL_COMM_NULL %d\n", NCCL_COMM_NULL == NULL);
  printf("NCCL_UNDEF_FLOAT %a sizeof %zu\n", (double)NCCL_UNDEF_FLOAT, sizeof(NCCL_UNDEF_FLOAT));
  UINT(NCCL_API_MAGIC);
  INT(NCCL_WIN_DEFAULT); INT(NCCL_WIN_COLL_SYMMETRIC); INT(NCCL_WIN_STRICT_ORDERING);
  INT(NCCL_WIN_REQUIRED_ALIGNMENT);
  INT(NCCL_CTA_POLICY_DEFAULT); INT(NCCL_CTA_POLICY_EFFICIENCY); INT(NCCL_CTA_POLICY_ZERO);
  INT(NCCL_SHRINK_DEFAULT); INT(NCCL_SHRINK_ABORT);
  INT(NCCL_REVOKE_DEFAULT); INT(NCCL_SUSPEND_MEM);
}

static void initializers(void) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  ncclSimInfo_t sim = NCCL_SIM_INFO_INITIALIZER;
  UINT(config.size); UINT(config.magic); UINT(config.version);
  INT(config.blocking); INT(config.cgaClusterSize); INT(config.minCTAs); INT(config.maxCTAs);
  INT(config.netName == NULL); INT(config.splitShare); INT(config.trafficClass);
  INT(config.commName == NULL); INT(config.collnetEnable); INT(config.CTAPolicy);
  INT(config.shrinkShare); INT(config.nvlsCTAs); INT(config.nChannelsPerNetPeer);
  INT(config.nvlinkCentricSched); INT(config.graphUsageMode); INT(config.numRmaCtx);
  INT(config.maxP2pPeers); INT(config.graphStreamOrdering);
  UINT(sim.size); UINT(sim.magic); UINT(sim.version);
  printf("sim.estimatedTime %a\n", (double)sim.estimatedTime);
}

int main(void) {
  enums();
  types();
  fields();
  macros();
  initializers();
  return 0;
}
