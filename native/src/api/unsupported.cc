// NCCL entry points fakegpu does not implement: they fail loudly with ncclInvalidUsage and
// a last-error text naming the call — never a silent success. The device API names are
// exported too because the real library exports them (code may link against them).
#include "core/comm.h"
#include "api/export.h"
#include "api/last_error.h"

using namespace fakegpu;

namespace {
ncclResult_t unsupported(const char* fn, const char* why = "is not supported by fakegpu") {
  return failf(ncclInvalidUsage, "%s %s", fn, why);
}
// Layout of the device API's ncclTeam (nccl_device/core.h): returned by value.
struct Team {
  int nRanks, rank, stride;
};
constexpr const char* kDevice = "is part of the NCCL device API, which fakegpu does not implement";
constexpr const char* kWindow = "(one-sided windows/signals) is not supported by fakegpu";
}  // namespace

// ---- communicator features not modelled yet -----------------------------------------------
NCCL_API(ncclResult_t, ncclCommGrow, ncclComm_t comm, int nRanks, const ncclUniqueId* uniqueId, int rank,
         ncclComm_t* newcomm, ncclConfig_t* config) {
  return unsupported("ncclCommGrow", "is not implemented yet in fakegpu");
}
NCCL_API(ncclResult_t, ncclCommGetUniqueId, ncclComm_t comm, ncclUniqueId* uniqueId) {
  return unsupported("ncclCommGetUniqueId", "(used with ncclCommGrow) is not implemented yet in fakegpu");
}
NCCL_API(ncclResult_t, ncclCommRevoke, ncclComm_t comm, int revokeFlags) {
  return unsupported("ncclCommRevoke", "is not implemented yet in fakegpu");
}

// ---- windows and one-sided operations ------------------------------------------------------
NCCL_API(ncclResult_t, ncclCommWindowRegister, ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win,
         int winFlags) {
  return unsupported("ncclCommWindowRegister", kWindow);
}
NCCL_API(ncclResult_t, ncclCommWindowDeregister, ncclComm_t comm, ncclWindow_t win) {
  return unsupported("ncclCommWindowDeregister", kWindow);
}
NCCL_API(ncclResult_t, ncclWinGetUserPtr, ncclComm_t comm, ncclWindow_t win, void** outUserPtr) {
  return unsupported("ncclWinGetUserPtr", kWindow);
}
NCCL_API(ncclResult_t, ncclPutSignal, const void* localbuff, size_t count, ncclDataType_t datatype, int peer,
         ncclWindow_t peerWin, size_t peerWinOffset, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm,
         cudaStream_t stream) {
  return unsupported("ncclPutSignal", kWindow);
}
NCCL_API(ncclResult_t, ncclSignal, int peer, int sigIdx, int ctx, unsigned int flags, ncclComm_t comm,
         cudaStream_t stream) {
  return unsupported("ncclSignal", kWindow);
}
NCCL_API(ncclResult_t, ncclWaitSignal, int nDesc, ncclWaitSignalDesc_t* signalDescs, ncclComm_t comm,
         cudaStream_t stream) {
  return unsupported("ncclWaitSignal", kWindow);
}

// ---- runtime parameters ------------------------------------------------------------------------
constexpr const char* kParam = "(NCCL runtime parameters) is not supported by fakegpu";
NCCL_API(ncclResult_t, ncclParamBind, ncclParamHandle_t* out, const char* key) { return unsupported("ncclParamBind", kParam); }
NCCL_API(ncclResult_t, ncclParamGetI8, ncclParamHandle_t h, int8_t* out) { return unsupported("ncclParamGetI8", kParam); }
NCCL_API(ncclResult_t, ncclParamGetI16, ncclParamHandle_t h, int16_t* out) { return unsupported("ncclParamGetI16", kParam); }
NCCL_API(ncclResult_t, ncclParamGetI32, ncclParamHandle_t h, int32_t* out) { return unsupported("ncclParamGetI32", kParam); }
NCCL_API(ncclResult_t, ncclParamGetI64, ncclParamHandle_t h, int64_t* out) { return unsupported("ncclParamGetI64", kParam); }
NCCL_API(ncclResult_t, ncclParamGetU8, ncclParamHandle_t h, uint8_t* out) { return unsupported("ncclParamGetU8", kParam); }
NCCL_API(ncclResult_t, ncclParamGetU16, ncclParamHandle_t h, uint16_t* out) { return unsupported("ncclParamGetU16", kParam); }
NCCL_API(ncclResult_t, ncclParamGetU32, ncclParamHandle_t h, uint32_t* out) { return unsupported("ncclParamGetU32", kParam); }
NCCL_API(ncclResult_t, ncclParamGetU64, ncclParamHandle_t h, uint64_t* out) { return unsupported("ncclParamGetU64", kParam); }
NCCL_API(ncclResult_t, ncclParamGetStr, ncclParamHandle_t h, const char** out) { return unsupported("ncclParamGetStr", kParam); }
NCCL_API(ncclResult_t, ncclParamGet, ncclParamHandle_t h, void* out, int maxLen, int* len) {
  return unsupported("ncclParamGet", kParam);
}
NCCL_API(ncclResult_t, ncclParamGetParameter, const char* key, const char** value, int* valueLen) {
  return unsupported("ncclParamGetParameter", kParam);
}
NCCL_API(ncclResult_t, ncclParamGetAllParameterKeys, const char*** table, int* tableLen) {
  return unsupported("ncclParamGetAllParameterKeys", kParam);
}
NCCL_API(void, ncclParamDumpAll, void) { unsupported("ncclParamDumpAll", kParam); }

// ---- device API (host-side entry points of nccl_device/*.h) -------------------------------------
NCCL_API(ncclResult_t, ncclCommQueryProperties, ncclComm_t comm, void* props) {
  return unsupported("ncclCommQueryProperties", kDevice);
}
NCCL_API(ncclResult_t, ncclDevCommCreate, ncclComm_t comm, const void* reqs, void* outDevComm) {
  return unsupported("ncclDevCommCreate", kDevice);
}
NCCL_API(ncclResult_t, ncclDevCommDestroy, ncclComm_t comm, const void* devComm) {
  return unsupported("ncclDevCommDestroy", kDevice);
}
NCCL_API(ncclResult_t, ncclGetLsaMultimemDevicePointer, ncclWindow_t window, size_t offset, void** outPtr) {
  return unsupported("ncclGetLsaMultimemDevicePointer", kDevice);
}
NCCL_API(ncclResult_t, ncclGetMultimemDevicePointer, ncclWindow_t window, size_t offset, void* multimem, void** outPtr) {
  return unsupported("ncclGetMultimemDevicePointer", kDevice);
}
NCCL_API(ncclResult_t, ncclGetLsaDevicePointer, ncclWindow_t window, size_t offset, int lsaRank, void** outPtr) {
  return unsupported("ncclGetLsaDevicePointer", kDevice);
}
NCCL_API(ncclResult_t, ncclGetPeerDevicePointer, ncclWindow_t window, size_t offset, int peer, void** outPtr) {
  return unsupported("ncclGetPeerDevicePointer", kDevice);
}
NCCL_API(ncclResult_t, ncclGinBarrierCreateRequirement, ncclComm_t comm, Team team, int nBarriers, void* outHandle,
         void* outReq) {
  return unsupported("ncclGinBarrierCreateRequirement", kDevice);
}
NCCL_API(ncclResult_t, ncclGinOutboxCreateRequirement, int nBlocks, int size_log2, void* outHandle, void* outReq) {
  return unsupported("ncclGinOutboxCreateRequirement", kDevice);
}
NCCL_API(ncclResult_t, ncclGinInboxA2ACreateRequirement, Team peers, int nBlocks, int size_log2, void* outHandle,
         void* outReq) {
  return unsupported("ncclGinInboxA2ACreateRequirement", kDevice);
}
NCCL_API(ncclResult_t, ncclLLA2ACreateRequirement, int nBlocks, int nSlots, void* outHandle, void* outReq) {
  return unsupported("ncclLLA2ACreateRequirement", kDevice);
}
NCCL_API(ncclResult_t, ncclLsaBarrierCreateRequirement, Team team, int nBarriers, void* outHandle, void* outReq) {
  return unsupported("ncclLsaBarrierCreateRequirement", kDevice);
}
NCCL_API(int, ncclLLA2ACalcSlots, int maxElts, int maxEltSize) {
  unsupported("ncclLLA2ACalcSlots", kDevice);
  return 0;
}
// Teams are plain descriptions of rank sets, so these answer truthfully: every rank is
// its own load/store-accessible (LSA) island, and the world and rail teams are the comm.
NCCL_API(Team, ncclTeamWorld, ncclComm_t comm) {
  if (check_comm_valid(comm, "ncclTeamWorld") != ncclSuccess) return Team{0, 0, 0};
  return Team{comm->nranks, comm->rank, 1};
}
NCCL_API(Team, ncclTeamLsa, ncclComm_t comm) {
  if (check_comm_valid(comm, "ncclTeamLsa") != ncclSuccess) return Team{0, 0, 0};
  return Team{1, 0, 1};
}
NCCL_API(Team, ncclTeamRail, ncclComm_t comm) {
  if (check_comm_valid(comm, "ncclTeamRail") != ncclSuccess) return Team{0, 0, 0};
  return Team{comm->nranks, comm->rank, 1};
}
NCCL_API(int, ncclTeamRankToWorld, ncclComm_t comm, Team team, int rank) {
  if (check_comm_valid(comm, "ncclTeamRankToWorld") != ncclSuccess) return -1;
  return comm->rank + (rank - team.rank) * team.stride;
}
NCCL_API(int, ncclTeamRankToLsa, ncclComm_t comm, Team team, int rank) {
  if (check_comm_valid(comm, "ncclTeamRankToLsa") != ncclSuccess) return -1;
  int world = comm->rank + (rank - team.rank) * team.stride;
  return world == comm->rank ? 0 : -1;
}
