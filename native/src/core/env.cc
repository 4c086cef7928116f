#include "core/env.h"
#include "generated/wire_spec.h"

#include <atomic>
#include <cctype>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <strings.h>

#include <fcntl.h>

#include <unistd.h>

namespace fakegpu::env {

bool gloo_reduction_order() {
  const char* v = getenv("FAKEGPU_REDUCTION_ORDER");
  if (!v || !*v || strcasecmp(v, "rank") == 0) return false;
  if (strcasecmp(v, "gloo") == 0) return true;
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true))
    fprintf(stderr, "fakegpu: FAKEGPU_REDUCTION_ORDER=%s is neither `rank` nor `gloo`; reducing in rank order\n", v);
  return false;
}

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

// The size grammar of fakegpu/env.py's parse_size (pinned for both by tests/vectors/size_vectors.json):
// optional spaces, digits with an optional fraction, optional spaces, a unit (case-insensitive;
// K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024, KB/MB/GB/TB powers of 1000, B or nothing is
// bytes), optional spaces; the value must be a whole number of bytes.
bool bytes(const char* text, uint64_t* out) {
  if (!text) return false;
  const char* p = text;
  while (isspace((unsigned char)*p)) p++;
  if (!isdigit((unsigned char)*p)) return false;
  using Wide = unsigned __int128;
  const Wide kLimit = static_cast<Wide>(UINT64_MAX) * 1000000000000ull;  // beyond any answer
  Wide mantissa = 0, scale = 1;  // value = mantissa / scale
  for (; isdigit((unsigned char)*p); p++) {
    mantissa = mantissa * 10 + static_cast<unsigned>(*p - '0');
    if (mantissa > kLimit) return false;
  }
  if (*p == '.') {
    p++;
    if (!isdigit((unsigned char)*p)) return false;
    for (; isdigit((unsigned char)*p); p++) {
      if (scale > kLimit / 10) {  // more fraction digits than can matter: only zeros keep it whole
        if (*p != '0') return false;
        continue;
      }
      mantissa = mantissa * 10 + static_cast<unsigned>(*p - '0');
      scale *= 10;
    }
  }
  while (isspace((unsigned char)*p)) p++;
  char unit[env_spec::kMaxSizeUnitLength + 1] = {};
  size_t len = 0;
  for (; isalpha((unsigned char)*p); p++) {
    if (len == env_spec::kMaxSizeUnitLength) return false;
    unit[len++] = static_cast<char>(tolower((unsigned char)*p));
  }
  while (isspace((unsigned char)*p)) p++;
  if (*p) return false;
  const unsigned long long* mult = nullptr;  // the units are spec/env.py's (generated/wire_spec.h)
  for (const auto& u : env_spec::kSizeUnits)
    if (strcmp(u.name, unit) == 0) mult = &u.bytes;
  if (!mult) return false;
  const Wide total = mantissa * *mult;  // mantissa <= kLimit and mult <= 2^40 (spec/env.py): no overflow
  if (total % scale != 0) return false;
  const Wide value = total / scale;
  if (value > UINT64_MAX) return false;
  *out = static_cast<uint64_t>(value);
  return true;
}

namespace {

bool token_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

// Well-formed UTF-8 as Python's decoder accepts it: no overlong forms, surrogates or values past U+10FFFF.
bool valid_utf8(const std::string& s) {
  size_t i = 0, n = s.size();
  while (i < n) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80 ? 1 : (c >= 0xC2 && c <= 0xDF) ? 2 : (c >= 0xE0 && c <= 0xEF) ? 3 : (c >= 0xF0 && c <= 0xF4) ? 4 : 0;
    if (len == 0 || i + len > n) return false;
    for (size_t k = 1; k < len; k++)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    unsigned char c1 = static_cast<unsigned char>(len > 1 ? s[i + 1] : 0);
    if ((c == 0xE0 && c1 < 0xA0) || (c == 0xED && c1 > 0x9F) || (c == 0xF0 && c1 < 0x90) || (c == 0xF4 && c1 > 0x8F))
      return false;
    i += len;
  }
  return true;
}

}  // namespace

bool token_from_file_contents(const std::string& raw, std::string* token, std::string* error) {
  if (raw.size() > kTokenFileMaxBytes) {
    *error = "is larger than " + std::to_string(kTokenFileMaxBytes) + " bytes; a token file holds one token";
    return false;
  }
  size_t b = 0, e = raw.size();
  while (b < e && token_space(raw[b])) b++;
  while (e > b && token_space(raw[e - 1])) e--;
  std::string t = raw.substr(b, e - b);
  if (t.empty()) {
    *error = "is empty";
    return false;
  }
  if (t.find_first_of("\r\n") != std::string::npos) {
    *error = "holds more than one line; a token file holds one token";
    return false;
  }
  if (!valid_utf8(t)) {
    *error = "is not UTF-8 text";
    return false;
  }
  *token = t;
  return true;
}

bool coordinator_token(std::string* token, std::string* error) {
  std::string direct = str("FAKEGPU_COORDINATOR_TOKEN");
  std::string path = str("FAKEGPU_COORDINATOR_TOKEN_FILE");
  token->clear();
  if (!direct.empty() && !path.empty()) {
    *error = "set only one of FAKEGPU_COORDINATOR_TOKEN and FAKEGPU_COORDINATOR_TOKEN_FILE";
    return false;
  }
  if (path.empty()) {
    *token = direct;
    return true;
  }
  // Read one byte past the limit, like the coordinator (a FIFO or /dev/zero has no size).
  std::string raw(kTokenFileMaxBytes + 1, '\0');
  size_t got = 0;
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  int err = fd < 0 ? errno : 0;
  while (fd >= 0 && got < raw.size()) {
    ssize_t n = read(fd, &raw[got], raw.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) err = errno;
    if (n <= 0) break;
    got += static_cast<size_t>(n);
  }
  if (fd >= 0) close(fd);
  if (err) {
    *error = "FAKEGPU_COORDINATOR_TOKEN_FILE='" + path + "' cannot be read: " + strerror(err);
    return false;
  }
  raw.resize(got);
  std::string why;
  if (!token_from_file_contents(raw, token, &why)) {
    *error = "FAKEGPU_COORDINATOR_TOKEN_FILE='" + path + "' " + why;
    return false;
  }
  return true;
}

bool flag(const char* name) {
  const char* v = getenv(name);
  if (!v || !*v) return false;
  return strcmp(v, "0") != 0 && strcasecmp(v, "false") != 0 && strcasecmp(v, "no") != 0 &&
         strcasecmp(v, "off") != 0;
}

}  // namespace fakegpu::env

// Test hook (tests/unit/test_env_sizes.py): the size grammar above, as the shim reads it.
extern "C" __attribute__((visibility("default"))) int fakegpu_test_parse_bytes(const char* text, uint64_t* out) {
  return fakegpu::env::bytes(text, out) ? 1 : 0;
}
