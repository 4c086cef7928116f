// FAKEGPU_DIST_MODE=proxy: NVIDIA's NCCL moves the data (mode_passthrough.cc); the coordinator
// holds a mirror of every communicator. Creation, splits and teardown go through the same
// COMM_INIT / COMM_SPLIT / COMM_FREE requests as the simulate mode (the real library's
// 128-byte unique id travels intact as the communicator's key), so a rank that disagrees on
// membership, size or split colour fails at creation with the coordinator's message, and the
// coordinator's report lists the communicators with their global ranks.
// Every group is checked and accounted on the coordinator before it is forwarded: the
// forwarding mode calls the simulate mode's account_group (one ACCOUNT request, no payload,
// answered by GROUP_DONE); a disagreement between the ranks fails the group with the
// coordinator's message and real NCCL never sees it (docs/protocol.md, ACCOUNT).
#include "modes/mode_passthrough.h"

namespace fakegpu {

DistMode* make_proxy_mode() { return make_forwarding_mode("proxy", make_simulate_mode()); }

}  // namespace fakegpu
