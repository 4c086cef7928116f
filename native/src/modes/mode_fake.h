// FAKEGPU_DIST_MODE=fake through the NCCL API (docs/fake-worlds.md; native/README.md "Fake
// mode"): no coordinator; this process plays one logical rank of an NGPU-rank world and
// every call completes at once, locally, with SPMD-symmetric meaning.
#pragma once

#include "modes/mode.h"

namespace fakegpu {

DistMode* make_fake_mode();

}  // namespace fakegpu
