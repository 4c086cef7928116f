#include "fake/fake_accounting.h"

#include <algorithm>
#include <cstring>

#include "api/export.h"
#include "fake/fake_events.h"  // json_string

namespace fakegpu::fake {
namespace {

bool is_physical(const Contract& c, int logical_rank) {
  return std::find(c.physical_ranks.begin(), c.physical_ranks.end(), logical_rank) != c.physical_ranks.end();
}

std::string int_list(const std::vector<int>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); i++) out += (i ? "," : "") + std::to_string(v[i]);
  return out + "]";
}

std::string range(int lo, int hi) { return "[" + std::to_string(lo) + "," + std::to_string(hi) + "]"; }

}  // namespace

std::pair<int, int> slice_of(const Contract& c, int logical_rank) {
  std::vector<int> ordered = c.physical_ranks;
  std::sort(ordered.begin(), ordered.end());
  if (ordered.size() <= 1) return {0, c.world_size};
  auto it = std::find(ordered.begin(), ordered.end(), logical_rank);
  if (it == ordered.end()) return {-1, -1};  // not a physical rank: it stands for no slice
  const size_t i = static_cast<size_t>(it - ordered.begin());
  const int lo = i == 0 ? 0 : ordered[i];
  const int hi = i + 1 < ordered.size() ? ordered[i + 1] : c.world_size;
  return {lo, hi};
}

Placement place_op(const Contract& c, const std::vector<int>& members, int rank, bool p2p, int root, int peer) {
  Placement where;
  const int n = static_cast<int>(members.size());
  const bool several = c.physical_ranks.size() > 1;
  bool spans = false;
  std::pair<int, int> mine{0, c.world_size};  // this process's slice of the world
  if (several) {
    mine = slice_of(c, c.logical_rank);
    spans = !std::all_of(members.begin(), members.end(),
                         [&](int m) { return mine.first <= m && m < mine.second; });
    if (!spans) {
      where.has_domain = true;
      where.domain_lo = mine.first;
      where.domain_hi = mine.second;
    }
  }
  if (p2p) {
    const bool has_sender = 0 <= root && root < n, has_receiver = 0 <= peer && peer < n;
    const int sender = has_sender ? members[root] : -1, receiver = has_receiver ? members[peer] : -1;
    // A receive from another physical process: that process's send accounts the transfer.
    if (has_sender && has_receiver && receiver == c.logical_rank && sender != receiver && is_physical(c, sender)) {
      where.account = false;
      return where;
    }
    where.spread = !several;
    // This rank also sends with this offset (to 2*rank - root): that send, spread over the
    // group, already stands for the transfer received here.
    if (where.spread && has_receiver && 0 <= rank && rank < n && receiver == members[rank] && 0 <= 2 * rank - root &&
        2 * rank - root < n)
      where.account = false;
    return where;
  }
  if (spans) {
    where.has_owned = true;
    where.owned_lo = mine.first;
    where.owned_hi = mine.second;
  }
  return where;
}

std::string world_line(const Contract& c, const std::string& frontend) {
  const int physical_rank = c.physical_rank;
  return "{\"event\":\"world\",\"version\":1,\"mode\":" +
         json_string(c.mode == kModeFake ? "fake" : "real_pp_fake_spmd") + ",\"frontend\":" + json_string(frontend) +
         ",\"logical_world_size\":" + std::to_string(c.world_size) + ",\"pp_degree\":" + std::to_string(c.pp_degree) +
         ",\"pp_rank\":" + std::to_string(c.pp_rank) + ",\"logical_rank\":" + std::to_string(c.logical_rank) +
         ",\"physical_rank\":" + std::to_string(physical_rank) +
         ",\"physical_world_size\":" + std::to_string(c.physical_ranks.size()) +
         ",\"physical_logical_ranks\":" + int_list(c.physical_ranks) + "}";
}

std::string comm_line(int id, const std::string& name, const std::vector<int>& members) {
  return "{\"event\":\"comm\",\"id\":" + std::to_string(id) + ",\"name\":" + json_string(name) +
         ",\"members\":" + int_list(members) + "}";
}

std::string op_line(const OpEvent& op, const Placement& where) {
  std::string line = "{\"event\":\"op\",\"comm\":" + std::to_string(op.comm_id) + ",\"kind\":" + json_string(op.kind) +
                     ",\"dtype\":" + json_string(op.dtype) + ",\"elem_size\":" + std::to_string(op.elem_size) +
                     ",\"count\":" + std::to_string(op.count) +
                     ",\"redop\":" + (op.redop.empty() ? std::string("null") : json_string(op.redop)) +
                     ",\"root\":" + std::to_string(op.root) + ",\"peer\":" + std::to_string(op.peer) +
                     ",\"rank\":" + std::to_string(op.rank);
  if (where.has_domain) line += ",\"domain\":" + range(where.domain_lo, where.domain_hi);
  if (where.has_owned) line += ",\"owned\":" + range(where.owned_lo, where.owned_hi);
  if (where.spread) line += ",\"spread\":true";
  return line + "}";
}

}  // namespace fakegpu::fake

// For Python (fakegpu/fake/runtime.py): the same rule and the same lines. The contract comes
// as its fields (fakegpu_fake_contract's order: mode, NGPU, P, pp_rank, logical rank,
// physical rank) and its physical ranks.

namespace {

bool contract_from(const int* fields, const int* physical, int physical_count, fakegpu::fake::Contract* c) {
  if (!fields || physical_count < 1 || !physical) return false;
  c->mode = fields[0];
  c->world_size = fields[1];
  c->pp_degree = fields[2];
  c->pp_rank = fields[3];
  c->logical_rank = fields[4];
  c->physical_rank = fields[5];
  c->physical_ranks.assign(physical, physical + physical_count);
  return true;
}

// Copies `text` and its NUL into out; the length, or -(length + 1) when out is too small.
long long copy_out(const std::string& text, char* out, size_t capacity) {
  if (!out || text.size() + 1 > capacity) return -static_cast<long long>(text.size()) - 1;
  memcpy(out, text.c_str(), text.size() + 1);
  return static_cast<long long>(text.size());
}

}  // namespace

// slice[0..1] = [lo, hi) that the physical process playing `logical_rank` stands for;
// returns -1 when no physical process plays it.
extern "C" FG_VISIBLE int fakegpu_fake_slice_of(const int* fields, const int* physical, int physical_count,
                                                int logical_rank, int* slice) {
  fakegpu::fake::Contract c;
  if (!slice || !contract_from(fields, physical, physical_count, &c)) return -1;
  const std::pair<int, int> s = fakegpu::fake::slice_of(c, logical_rank);
  if (s.first < 0) return -1;
  slice[0] = s.first;
  slice[1] = s.second;
  return 0;
}

// Decides whether this process accounts the operation and writes its "op" line: placement
// = {account, has_domain, domain_lo, domain_hi, has_owned, owned_lo, owned_hi, spread};
// returns the line's length (0 with placement[0] == 0 when another process accounts it), or
// -(length + 1) when `line` is too small, or -1 for a bad argument.
extern "C" FG_VISIBLE long long fakegpu_fake_op_event(const int* fields, const int* physical, int physical_count,
                                                      const int* members, int member_count, int comm_id,
                                                      const char* kind, const char* dtype, int elem_size,
                                                      unsigned long long count, const char* redop, int root,
                                                      int peer, int rank, int* placement, char* line,
                                                      size_t capacity) {
  fakegpu::fake::Contract c;
  if (!placement || !kind || !dtype || member_count < 0 || (member_count > 0 && !members) ||
      !contract_from(fields, physical, physical_count, &c))
    return -1;
  const std::vector<int> group(members, members + member_count);
  const bool p2p = strcmp(kind, "SendRecv") == 0;
  const fakegpu::fake::Placement where = fakegpu::fake::place_op(c, group, rank, p2p, root, peer);
  const int fields_out[8] = {where.account,   where.has_domain, where.domain_lo, where.domain_hi,
                             where.has_owned, where.owned_lo,   where.owned_hi,  where.spread};
  memcpy(placement, fields_out, sizeof(fields_out));
  if (!where.account) {
    if (line && capacity) line[0] = '\0';
    return 0;
  }
  fakegpu::fake::OpEvent op;
  op.comm_id = comm_id;
  op.kind = kind;
  op.dtype = dtype;
  op.elem_size = elem_size;
  op.count = count;
  op.redop = redop ? redop : "";
  op.root = root;
  op.peer = peer;
  op.rank = rank;
  return copy_out(fakegpu::fake::op_line(op, where), line, capacity);
}

// The "world" (frontend) and "comm" lines; same return convention.
extern "C" FG_VISIBLE long long fakegpu_fake_world_line(const int* fields, const int* physical, int physical_count,
                                                        const char* frontend, char* line, size_t capacity) {
  fakegpu::fake::Contract c;
  if (!frontend || !contract_from(fields, physical, physical_count, &c)) return -1;
  return copy_out(fakegpu::fake::world_line(c, frontend), line, capacity);
}

extern "C" FG_VISIBLE long long fakegpu_fake_comm_line(int id, const char* name, const int* members, int member_count,
                                                       char* line, size_t capacity) {
  if (!name || member_count < 0 || (member_count > 0 && !members)) return -1;
  return copy_out(fakegpu::fake::comm_line(id, name, std::vector<int>(members, members + member_count)), line,
                  capacity);
}
