// The launch contract of a pure fake world (FAKEGPU_DIST_MODE=fake), read natively.
// It mirrors fakegpu/fake/contract.py (its `fake` branch) rule for rule and message for
// message, so the shim and the torch backend agree on who this process is and refuse the
// same launches with the same words.
#pragma once

#include <map>
#include <string>

namespace fakegpu::fake {

struct Contract {
  int world_size = 1;    // NGPU, the logical world size
  int pp_degree = 1;     // P (FAKEGPU_PP_DEGREE)
  int pp_rank = 0;       // this process's PP coordinate
  int logical_rank = 0;  // the logical rank this process plays
  int spmd_size() const { return world_size / pp_degree; }
};

// Reads the contract from `env` (variable -> value; a missing key is unset). Returns false
// and the contract.py error text in *error for an inconsistent launch.
bool resolve_contract(const std::map<std::string, std::string>& env, Contract* out, std::string* error);

// The same from the process environment, resolved once and cached (result and error).
bool process_contract(Contract* out, std::string* error);

}  // namespace fakegpu::fake
