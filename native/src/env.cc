#include "env.h"

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <strings.h>

namespace fakegpu::env {

std::string str(const char* name, const char* fallback) {
  const char* v = getenv(name);
  return (v && *v) ? std::string(v) : std::string(fallback);
}

long long integer(const char* name, long long fallback, bool* bad) {
  if (bad) *bad = false;
  const char* v = getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  errno = 0;
  long long x = strtoll(v, &end, 10);
  while (end && isspace((unsigned char)*end)) end++;
  if (errno != 0 || end == v || (end && *end)) {
    if (bad) *bad = true;
    return fallback;
  }
  return x;
}

bool bytes(const char* text, uint64_t* out) {
  if (!text || !*text) return false;
  char* end = nullptr;
  errno = 0;
  unsigned long long x = strtoull(text, &end, 10);
  if (errno != 0 || end == text) return false;
  uint64_t mult = 1;
  if (*end) {
    switch (toupper((unsigned char)*end)) {
      case 'K': mult = 1ull << 10; break;
      case 'M': mult = 1ull << 20; break;
      case 'G': mult = 1ull << 30; break;
      default: return false;
    }
    end++;
    if (*end == 'i' || *end == 'I') end++;
    if (*end == 'b' || *end == 'B') end++;
    if (*end) return false;
  }
  if (x > UINT64_MAX / mult) return false;
  *out = x * mult;
  return true;
}

bool flag(const char* name) {
  const char* v = getenv(name);
  if (!v || !*v) return false;
  return strcmp(v, "0") != 0 && strcasecmp(v, "false") != 0 && strcasecmp(v, "no") != 0 &&
         strcasecmp(v, "off") != 0;
}

}  // namespace fakegpu::env
