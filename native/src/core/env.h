// Reading the FAKEGPU_* / torchrun environment contract (see docs/usage.md).
#pragma once

#include <cstdint>
#include <string>

namespace fakegpu::env {

// The variable's value, or `fallback` when unset or empty.
std::string str(const char* name, const char* fallback = "");
// Integer value; `fallback` when unset. Sets *bad (if given) when set but not an integer.
long long integer(const char* name, long long fallback, bool* bad = nullptr);
// Byte count with an optional K/M/G (binary) suffix; false when malformed.
bool bytes(const char* text, uint64_t* out);
bool flag(const char* name);  // set to something other than "", "0", "false", "no"

// FAKEGPU_REDUCTION_ORDER, read when a communicator is created: true for `gloo` (reduce as
// torch 2.13's CPU gloo associates, docs/numerics.md "Reduction order"), false for `rank`, unset
// or empty. Another value says so on stderr (once per process) and means `rank`: a communicator
// being created cannot fail on one member alone without leaving the others waiting.
bool gloo_reduction_order();

// The token-file rule (docs/usage.md, "Token files"; the coordinator's copy is
// fakegpu/env.py token_from_file_contents, and tests/vectors/token_file_vectors.json pins both): the
// file's bytes without ASCII whitespace (space, \t \n \r \v \f) at either end, which must leave
// one non-empty line of UTF-8 text; the file holds at most kTokenFileMaxBytes. On a bad file
// returns false with *error saying why ("is empty", ...), to follow the file's name.
constexpr size_t kTokenFileMaxBytes = 4096;
bool token_from_file_contents(const std::string& raw, std::string* token, std::string* error);
// FAKEGPU_COORDINATOR_TOKEN as it is, else the token in FAKEGPU_COORDINATOR_TOKEN_FILE by the
// rule above, else "". False with *error (a whole message naming the variable) when both are
// set or the file is unreadable or breaks the rule.
bool coordinator_token(std::string* token, std::string* error);

}  // namespace fakegpu::env
