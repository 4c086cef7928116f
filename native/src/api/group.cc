// Group calls (state lives in src/group.cc, per thread).
#include "api/export.h"
#include "core/group.h"

NCCL_API(ncclResult_t, ncclGroupStart, void) { return fakegpu::group_start(); }

NCCL_API(ncclResult_t, ncclGroupEnd, void) { return fakegpu::group_end(); }

NCCL_API(ncclResult_t, ncclGroupSimulateEnd, ncclSimInfo_t* simInfo) { return fakegpu::group_simulate_end(simInfo); }
