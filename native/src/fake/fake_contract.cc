#include "fake/fake_contract.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

namespace fakegpu::fake {
namespace {

const char* const kVariables[] = {"FAKEGPU_DIST_MODE", "NGPU", "FAKEGPU_PP_DEGREE", "FAKE_PP_RANK", "RANK",
                                  "WORLD_SIZE", "FAKEGPU_PHYSICAL_RANKS", "FAKEGPU_FAKE_WORLD_ENV",
                                  "FAKEGPU_LAUNCH_WORLD_SIZE", "FAKEGPU_LAUNCH_RANK"};

// The launcher's view of the environment: when the fake-world entry (fakegpu/fake/entry.py) rewrote
// WORLD_SIZE and RANK to the logical world's, its mark says so, and the launcher's values are
// in FAKEGPU_LAUNCH_WORLD_SIZE / FAKEGPU_LAUNCH_RANK (empty: the launcher set none).
std::map<std::string, std::string> launch_view(const std::map<std::string, std::string>& env) {
  auto get = [&](const char* name) -> const std::string* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : &it->second;
  };
  const std::string* mark = get("FAKEGPU_FAKE_WORLD_ENV");
  if (!mark || mark->empty()) return env;
  auto shown = [&](const char* name) {  // entry.py writes the mark with Python's f"{value}": None when missing
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

// A value quoted as the Python side shows strings (repr), so messages read the same from C and torch.
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

// An integer as Python's int() reads one (surrounding blanks, an optional sign, digits with
// single underscores between them), up to 2^31 - 1: the grammar launchers and users already
// know from torchrun's variables.
bool parse_int(const std::string& raw, long long* value) {
  std::string t = strip(raw);
  if (t.empty()) return false;
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
  if (!ok || errno == ERANGE || v > (1LL << 31) - 1) return false;
  *value = neg ? -v : v;
  return true;
}

// Unset/blank -> *set = false; not an integer or below minimum -> error.
bool int_var(const std::map<std::string, std::string>& env, const char* name, long long minimum, bool* set,
             long long* value, std::string* error) {
  *set = false;
  auto it = env.find(name);
  if (it == env.end() || strip(it->second).empty()) return true;
  long long v = 0;
  if (!parse_int(it->second, &v)) {
    *error = std::string(name) + "=" + py_repr(it->second) + " is not an integer";
    return false;
  }
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
  std::string mode = "fake";
  if (auto it = env.find("FAKEGPU_DIST_MODE"); it != env.end() && !strip(it->second).empty()) {
    mode = strip(it->second);
    for (char& ch : mode) ch = static_cast<char>(tolower(static_cast<unsigned char>(ch)));
  }
  if (mode != "fake" && mode != "real_pp_fake_spmd") {
    *error = "FAKEGPU_DIST_MODE=" + py_repr(mode) + " is not a fake-world mode; use one of fake, real_pp_fake_spmd";
    return false;
  }
  bool has;
  long long world = 0, p = 1, fake_pp = 0, rank = 0, phys_world = 0;
  if (!int_var(env, "NGPU", 1, &has, &world, error)) return false;
  if (!has) {
    *error = "NGPU is not set: set NGPU to the logical world size (the number of GPUs the job would use for real)";
    return false;
  }
  if (!int_var(env, "FAKEGPU_PP_DEGREE", 1, &has, &p, error)) return false;
  std::string inferred;
  if (!has) {
    p = 1;
    // The real-pipeline mode is one process per pipeline rank, so the launcher's process count
    // is the pipeline degree: `fgpu --dist-mode real_pp_fake_spmd -- torchrun --nproc-per-node P`
    // needs no second statement of P. Not with FAKEGPU_PHYSICAL_RANKS, which names any subset
    // of logical ranks rather than pipeline stages.
    auto listed = env.find("FAKEGPU_PHYSICAL_RANKS");
    bool has_launched = false;
    long long launched = 0;
    if (!int_var(env, "WORLD_SIZE", 1, &has_launched, &launched, error)) return false;
    if (mode == "real_pp_fake_spmd" && has_launched && (listed == env.end() || strip(listed->second).empty())) {
      p = launched;
      inferred = " (FAKEGPU_PP_DEGREE is unset, so P is the number of processes launched, WORLD_SIZE=" +
                 std::to_string(launched) + ": one per pipeline rank)";
    }
  }
  if (world % p) {
    long long lower = (world / p) * p;
    std::string multiples = std::to_string(lower ? lower : p) + " or " + std::to_string((world / p + 1) * p);
    std::vector<long long> divs;  // every divisor, in pairs d and world / d up to sqrt(world)
    for (long long d = 1; d * d <= world; d++)
      if (world % d == 0) {
        divs.push_back(d);
        if (d * d != world) divs.push_back(world / d);
      }
    std::sort(divs.begin(), divs.end());
    std::string listed;
    for (size_t k = 0; k < divs.size() && k < 8; k++) listed += (k ? ", " : "") + std::to_string(divs[k]);
    if (divs.size() > 8) listed += ", ...";
    *error = "NGPU=" + std::to_string(world) + " is not divisible by the pipeline degree P=" + std::to_string(p) +
             inferred + ": every pipeline stage needs NGPU/P whole logical ranks. Fix the logical topology: make NGPU a "
             "multiple of " + std::to_string(p) + " (e.g. " + multiples + ") or use a PP degree that divides " +
             std::to_string(world) + " (" + listed + ")";
    return false;
  }
  const long long spmd = world / p;
  bool has_fake_pp, has_rank, has_world;
  if (!int_var(env, "FAKE_PP_RANK", 0, &has_fake_pp, &fake_pp, error)) return false;
  if (!int_var(env, "RANK", 0, &has_rank, &rank, error)) return false;
  if (!int_var(env, "WORLD_SIZE", 1, &has_world, &phys_world, error)) return false;

  const std::string P = std::to_string(p), W = std::to_string(phys_world);
  if (mode == "fake") {
    if (has_world && phys_world > 1) {
      *error = "WORLD_SIZE=" + W + ": pure fake mode runs a single process. Launch one process (torchrun "
               "--nproc-per-node 1), or use FAKEGPU_DIST_MODE=real_pp_fake_spmd for one process per pipeline rank";
      return false;
    }
    long long logical = 0, pp_rank = 0;
    if (has_fake_pp) {
      if (fake_pp >= p) {
        *error = "FAKE_PP_RANK=" + std::to_string(fake_pp) + " is out of range for PP degree P=" + P +
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
    *out = Contract{kModeFake, static_cast<int>(world), static_cast<int>(p), static_cast<int>(pp_rank),
                    static_cast<int>(logical), 0, {static_cast<int>(logical)}};
    return true;
  }

  // Real pipeline, fake SPMD: one physical process per listed logical rank.
  if (has_fake_pp) {
    *error = "FAKE_PP_RANK=" + std::to_string(fake_pp) + " is invalid in real_pp_fake_spmd mode: the physical "
             "RANK is the PP coordinate there. Unset FAKE_PP_RANK, or use FAKEGPU_DIST_MODE=fake to fake every axis";
    return false;
  }
  if (!has_rank || !has_world) {
    *error = "real_pp_fake_spmd mode needs the physical RANK and WORLD_SIZE of each process: launch it with "
             "torchrun --nproc-per-node " + P + " (one process per PP rank)";
    return false;
  }
  std::vector<int> physical;
  auto listed = env.find("FAKEGPU_PHYSICAL_RANKS");
  const std::string explicit_list = listed == env.end() ? std::string() : strip(listed->second);
  if (!explicit_list.empty()) {
    std::string item;
    bool parsed = true;
    auto take = [&] {
      if (item.empty()) return;
      long long v = 0;
      if (!parse_int(item, &v)) parsed = false;
      else physical.push_back(static_cast<int>(v));
      item.clear();
    };
    for (char ch : explicit_list) {
      if (ch == ',') take();
      else if (ch != ' ') item += ch;
    }
    take();
    if (!parsed) {
      *error = "FAKEGPU_PHYSICAL_RANKS=" + py_repr(explicit_list) + " is not a comma-separated list of logical ranks";
      return false;
    }
    std::string bad;
    for (int g : physical)
      if (g < 0 || g >= world) bad += (bad.empty() ? "" : ", ") + std::to_string(g);
    if (!bad.empty()) {
      *error = "FAKEGPU_PHYSICAL_RANKS names logical ranks [" + bad + "] outside the logical world 0.." +
               std::to_string(world - 1) + " (NGPU=" + std::to_string(world) + ")";
      return false;
    }
    std::vector<int> sorted = physical;
    std::sort(sorted.begin(), sorted.end());
    if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
      *error = "FAKEGPU_PHYSICAL_RANKS=" + py_repr(explicit_list) + " repeats a logical rank";
      return false;
    }
    if (phys_world != static_cast<long long>(physical.size())) {
      *error = "WORLD_SIZE=" + W + " but FAKEGPU_PHYSICAL_RANKS lists " + std::to_string(physical.size()) +
               " logical ranks: the physical allocation must hold exactly one process per listed rank";
      return false;
    }
  } else {
    if (phys_world != p) {
      *error = "WORLD_SIZE=" + W + " but the PP degree is P=" + P + ": in real_pp_fake_spmd mode the physical "
               "allocation must hold exactly one process per PP rank. Launch " + P + " processes (torchrun "
               "--nproc-per-node " + P + ") or set FAKEGPU_PP_DEGREE=" + W + " if NGPU=" + std::to_string(world) +
               " allows it";
      return false;
    }
    for (long long c = 0; c < p; c++) physical.push_back(static_cast<int>(c * spmd));
  }
  if (rank >= phys_world) {
    *error = "RANK=" + std::to_string(rank) + " is out of range for WORLD_SIZE=" + W +
             ": the physical rank must be in 0.." + std::to_string(phys_world - 1);
    return false;
  }
  const int logical = physical[static_cast<size_t>(rank)];
  *out = Contract{kModeRealPipeline, static_cast<int>(world), static_cast<int>(p), static_cast<int>(logical / spmd),
                  logical, static_cast<int>(rank), physical};
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

// The contract for Python (fakegpu/fake/contract.py, through cffi): `names`/`values` hold
// `count` environment entries. On success returns 0 and fills fields[0..5] = mode, world size,
// PP degree, PP rank, logical rank, physical rank, and *physical_count entries of `physical`
// (the whole list is written only when capacity allows; *physical_count is its length either
// way). On an inconsistent launch returns 1 with the message in `error` (NUL-terminated,
// truncated to error_capacity).
extern "C" __attribute__((visibility("default"))) int fakegpu_fake_contract(
    int count, const char* const* names, const char* const* values, int* fields, int* physical,
    int physical_capacity, int* physical_count, char* error, size_t error_capacity) {
  std::map<std::string, std::string> env;
  for (int i = 0; i < count; i++)
    if (names[i] && values[i]) env[names[i]] = values[i];
  fakegpu::fake::Contract c;
  std::string err;
  if (!fakegpu::fake::resolve_contract(env, &c, &err)) {
    if (error && error_capacity) {
      size_t n = std::min(err.size(), error_capacity - 1);
      memcpy(error, err.data(), n);
      error[n] = '\0';
    }
    return 1;
  }
  const int values_out[6] = {c.mode, c.world_size, c.pp_degree, c.pp_rank, c.logical_rank, c.physical_rank};
  memcpy(fields, values_out, sizeof values_out);
  *physical_count = static_cast<int>(c.physical_ranks.size());
  if (*physical_count <= physical_capacity)
    std::copy(c.physical_ranks.begin(), c.physical_ranks.end(), physical);
  return 0;
}
