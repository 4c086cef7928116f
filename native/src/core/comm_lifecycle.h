// Creating and freeing communicators through the mode: blocking, non-blocking (a
// background thread) or deferred to the end of a group.
#pragma once

#include "modes/mode.h"
#include "nccl.h"

namespace fakegpu {

// Runs `req` according to its comm's config and the group state. On return *out holds the
// new communicator (or NULL for a NOCOLOR split / a failed blocking init).
// Takes ownership of req.
ncclResult_t create_comm(CommRequest* req, ncclComm_t* out);

// Completes a request already started; updates the comm's init state. Deletes the comm
// when the split gave it no colour. Takes ownership of req.
ncclResult_t finish_comm_request(DistMode* mode, CommRequest* req);

// Fresh unique id (128 bytes, random, tagged "fakegpu").
void make_unique_id(uint8_t out[128]);

void delete_comm(ncclComm* comm);

}  // namespace fakegpu
