// The launch contract of a fake world: which logical rank this process plays and which
// logical ranks are backed by a real process (docs/fake-worlds.md, "Launch contract").
// The one implementation: the shim's fake mode reads it here, and the torch backend's
// fakegpu/fake/contract.py calls fakegpu_fake_contract() below through cffi, so both agree on
// who this process is and refuse the same launches with the same words.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace fakegpu::fake {

enum ContractMode { kModeFake = 0, kModeRealPipeline = 1 };  // "fake", "real_pp_fake_spmd"

struct Contract {
  int mode = kModeFake;
  int world_size = 1;    // NGPU, the logical world size
  int pp_degree = 1;     // P (FAKEGPU_PP_DEGREE)
  int pp_rank = 0;       // this process's PP coordinate
  int logical_rank = 0;  // the logical rank this process plays
  int physical_rank = 0; // this process's index among the physical ones
  std::vector<int> physical_ranks{0};  // the logical rank each physical process plays
  int spmd_size() const { return world_size / pp_degree; }
};

// Reads the contract from `env` (variable -> value; a missing key is unset): FAKEGPU_DIST_MODE,
// NGPU, FAKEGPU_PP_DEGREE, FAKE_PP_RANK, RANK, WORLD_SIZE, FAKEGPU_PHYSICAL_RANKS and the
// fake-world entry's rewrite mark. Returns false and a message naming the variable at fault
// (and how to fix the logical topology) in *error for an inconsistent launch.
bool resolve_contract(const std::map<std::string, std::string>& env, Contract* out, std::string* error);

// The same from the process environment, resolved once and cached (result and error).
bool process_contract(Contract* out, std::string* error);

}  // namespace fakegpu::fake
