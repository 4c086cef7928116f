// Host-local collectives (docs/protocol.md, "Host-local collectives"): a call that is alone in
// its group, on a communicator whose members are all processes on the coordinator's host,
// runs among the members in the communicator's shared-memory arena instead of through the
// coordinator. Rank 0 of the communicator tells the coordinator about those calls afterwards,
// in LOCAL_OPS batches, so the reports still count every call.
#pragma once

#include "wire/client.h"
#include "modes/mode.h"

namespace fakegpu::local {

// Runs `call` in its communicator's arena when it can. True: the call ran (or failed) here and
// *rc is its result. False: the caller sends it to the coordinator as before — also when the
// arena was given up (a member left, a timeout, the coordinator disabled it) before any member
// produced a result, so that the coordinator gives the authoritative error.
bool try_run(Client* client, const CollCall& call, ncclResult_t* rc);

// Sends every LOCAL_OPS batch this process holds. Called before any other request to the
// coordinator, so that the coordinator learns of local calls in the order they ran.
void flush(Client* client);

// A communicator is going away: send its batch and unmap its arena.
void release(Client* client, ncclComm* comm);

}  // namespace fakegpu::local
