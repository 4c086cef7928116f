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

}  // namespace fakegpu::env
