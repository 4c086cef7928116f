// Thread-local group state (ncclGroupStart/End nest per thread, as in NCCL): queued calls
// and communicator requests wait for the outermost ncclGroupEnd.
#pragma once

#include "modes/mode.h"
#include "nccl.h"

namespace fakegpu {

bool in_group();
// Queues the call inside a group; outside one it runs now as a group of one.
ncclResult_t enqueue_call(const CollCall& c);
// A communicator request started inside a group; finished at the outermost GroupEnd.
void defer_comm_request(CommRequest* req);

ncclResult_t group_start();
ncclResult_t group_end();
ncclResult_t group_simulate_end(ncclSimInfo_t* info);

}  // namespace fakegpu
