#include "fake/fake_contract.h"

#include <cerrno>
#include <cstdlib>
#include <mutex>
#include <vector>

namespace fakegpu::fake {
namespace {

const char* const kVariables[] = {"NGPU", "FAKEGPU_PP_DEGREE", "FAKE_PP_RANK", "RANK", "WORLD_SIZE",
                                  "FAKEGPU_FAKE_WORLD_ENV", "FAKEGPU_LAUNCH_WORLD_SIZE", "FAKEGPU_LAUNCH_RANK"};

// contract.py's launch_view: when the fake-world entry (fakegpu/fake/entry.py) rewrote
// WORLD_SIZE and RANK to the logical world's, its mark says so, and the launcher's values are
// in FAKEGPU_LAUNCH_WORLD_SIZE / FAKEGPU_LAUNCH_RANK (empty: the launcher set none).
std::map<std::string, std::string> launch_view(const std::map<std::string, std::string>& env) {
  auto get = [&](const char* name) -> const std::string* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : &it->second;
  };
  const std::string* mark = get("FAKEGPU_FAKE_WORLD_ENV");
  if (!mark || mark->empty()) return env;
  auto shown = [&](const char* name) {  // Python's f"{env.get(name)}": None when missing
    const std::string* v = get(name);
    return v ? *v : std::string("None");
  };
  if (*mark != "WORLD_SIZE=" + shown("WORLD_SIZE") + " RANK=" + shown("RANK")) return env;
  std::map<std::string, std::string> view = env;
  for (auto [name, kept] : {std::pair<const char*, const char*>{"WORLD_SIZE", "FAKEGPU_LAUNCH_WORLD_SIZE"},
                            std::pair<const char*, const char*>{"RANK", "FAKEGPU_LAUNCH_RANK"}}) {
    const std::string* v = get(kept);
    if (v && !v->empty()) view[name] = *v;
    else view.erase(name);
  }
  return view;
}

std::string strip(const std::string& s) {
  size_t b = s.find_first_not_of(" \t\n\r\f\v"), e = s.find_last_not_of(" \t\n\r\f\v");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

// Python's repr of a str, for the common case (no quotes or escapes inside).
std::string py_repr(const std::string& s) {
  bool single = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  char q = single ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == q) out += std::string("\\") + q;
    else if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else out += c;
  }
  return out + q;
}

// contract.py's _int_var: unset/blank -> *set = false; not an integer or below minimum -> error.
bool int_var(const std::map<std::string, std::string>& env, const char* name, long long minimum, bool* set,
             long long* value, std::string* error) {
  *set = false;
  auto it = env.find(name);
  if (it == env.end()) return true;
  std::string t = strip(it->second);
  if (t.empty()) return true;
  // int() accepts an optional sign and digits (underscores between digits too).
  std::string digits;
  size_t i = 0;
  bool neg = false;
  if (t[0] == '+' || t[0] == '-') {
    neg = t[0] == '-';
    i = 1;
  }
  bool ok = i < t.size();
  for (size_t k = i; k < t.size() && ok; k++) {
    char c = t[k];
    if (c >= '0' && c <= '9') digits += c;
    else if (c == '_' && k > i && k + 1 < t.size() && t[k - 1] != '_' && t[k + 1] >= '0' && t[k + 1] <= '9') continue;
    else ok = false;
  }
  errno = 0;
  long long v = ok ? strtoll(digits.c_str(), nullptr, 10) : 0;
  if (!ok || errno == ERANGE || v > (1LL << 31) - 1) {
    *error = std::string(name) + "=" + py_repr(it->second) + " is not an integer";
    return false;
  }
  v = neg ? -v : v;
  if (v < minimum) {
    *error = std::string(name) + "=" + std::to_string(v) + " must be at least " + std::to_string(minimum);
    return false;
  }
  *set = true;
  *value = v;
  return true;
}

}  // namespace

bool resolve_contract(const std::map<std::string, std::string>& launch_env, Contract* out, std::string* error) {
  const std::map<std::string, std::string> env = launch_view(launch_env);
  bool has;
  long long world = 0, p = 1, fake_pp = 0, rank = 0, phys_world = 0;
  if (!int_var(env, "NGPU", 1, &has, &world, error)) return false;
  if (!has) {
    *error = "NGPU is not set: set NGPU to the logical world size (the number of GPUs the job would use for real)";
    return false;
  }
  if (!int_var(env, "FAKEGPU_PP_DEGREE", 1, &has, &p, error)) return false;
  if (!has) p = 1;
  if (world % p) {
    long long lower = (world / p) * p;
    std::string multiples = std::to_string(lower ? lower : p) + " or " + std::to_string((world / p + 1) * p);
    std::vector<long long> divs;
    for (long long d = 1; d <= world; d++)
      if (world % d == 0) divs.push_back(d);
    std::string listed;
    for (size_t k = 0; k < divs.size() && k < 8; k++) listed += (k ? ", " : "") + std::to_string(divs[k]);
    if (divs.size() > 8) listed += ", ...";
    *error = "NGPU=" + std::to_string(world) + " is not divisible by the pipeline degree P=" + std::to_string(p) +
             ": every pipeline stage needs NGPU/P whole logical ranks. Fix the logical topology: make NGPU a "
             "multiple of " + std::to_string(p) + " (e.g. " + multiples + ") or use a PP degree that divides " +
             std::to_string(world) + " (" + listed + ")";
    return false;
  }
  const long long spmd = world / p;
  bool has_fake_pp, has_rank, has_world;
  if (!int_var(env, "FAKE_PP_RANK", 0, &has_fake_pp, &fake_pp, error)) return false;
  if (!int_var(env, "RANK", 0, &has_rank, &rank, error)) return false;
  if (!int_var(env, "WORLD_SIZE", 1, &has_world, &phys_world, error)) return false;

  if (has_world && phys_world > 1) {
    *error = "WORLD_SIZE=" + std::to_string(phys_world) + ": pure fake mode runs a single process. Launch one "
             "process (torchrun --nproc-per-node 1), or use FAKEGPU_DIST_MODE=real_pp_fake_spmd for one process "
             "per pipeline rank";
    return false;
  }
  long long logical = 0, pp_rank = 0;
  if (has_fake_pp) {
    if (fake_pp >= p) {
      *error = "FAKE_PP_RANK=" + std::to_string(fake_pp) + " is out of range for PP degree P=" + std::to_string(p) +
               ": the PP coordinate must be in 0.." + std::to_string(p - 1) +
               ". Choose an existing pipeline stage or raise FAKEGPU_PP_DEGREE";
      return false;
    }
    logical = fake_pp * spmd;
    pp_rank = fake_pp;
  } else if (has_rank) {
    if (rank >= world) {
      *error = "RANK=" + std::to_string(rank) + " is out of range for the logical world NGPU=" +
               std::to_string(world) + ": the logical rank must be in 0.." + std::to_string(world - 1) +
               ". Lower RANK, raise NGPU, or set FAKE_PP_RANK instead";
      return false;
    }
    logical = rank;
    pp_rank = rank / spmd;
  }
  out->world_size = static_cast<int>(world);
  out->pp_degree = static_cast<int>(p);
  out->pp_rank = static_cast<int>(pp_rank);
  out->logical_rank = static_cast<int>(logical);
  return true;
}

bool process_contract(Contract* out, std::string* error) {
  static std::once_flag once;
  static bool ok = false;
  static Contract contract;
  static std::string err;
  std::call_once(once, [] {
    std::map<std::string, std::string> env;
    for (const char* name : kVariables)
      if (const char* v = getenv(name)) env[name] = v;
    ok = resolve_contract(env, &contract, &err);
  });
  if (ok) *out = contract;
  else *error = err;
  return ok;
}

}  // namespace fakegpu::fake
