#include "local_collectives.h"

#include <time.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "../last_error.h"
#include "../staging.h"
#include "arena.h"
#include "reduce_n.h"

namespace fakegpu::local {

// What a communicator holds for local collectives.
struct CommState {
  std::unique_ptr<Arena> arena;
  proto::LocalOps batch;                  // rank 0 only: calls not yet told to the coordinator
  std::chrono::steady_clock::time_point oldest;  // when the oldest unflushed call ran
};

namespace {

// Up to this many bytes per rank every member reduces the whole round itself (no second
// barrier); above it each member reduces a slice into the shared output slot.
constexpr uint64_t kDirectReduceBytes = 64 << 10;
// A batch goes to the coordinator once it holds this many calls or its oldest call is this old.
constexpr size_t kBatchRecords = 256;
constexpr auto kBatchAge = std::chrono::milliseconds(250);

std::mutex g_mu;                    // guards g_dirty and every batch
std::vector<ncclComm*> g_dirty;     // communicators with a non-empty batch
bool g_atexit_registered = false;

double wall_now() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

bool is_local_kind(uint8_t kind) {
  return kind == proto::kAllReduce || kind == proto::kBroadcast || kind == proto::kReduce ||
         kind == proto::kAllGather || kind == proto::kReduceScatter;
}

bool rooted(uint8_t kind) { return kind == proto::kBroadcast || kind == proto::kReduce; }

// The fields of two OpDescs that the members must agree on (the coordinator's matching rule):
// kind, datatype, redop, root and count. Offsets per docs/protocol.md's OpDesc table.
bool same_call(const uint8_t* a, const uint8_t* b) {
  return memcmp(a + 8, b + 8, 3) == 0 && memcmp(a + 12, b + 12, 4) == 0 && memcmp(a + 16, b + 16, 8) == 0;
}

void send_batch_locked(Client* client, ncclComm* comm) {
  CommState* st = comm->local;
  if (!st || st->batch.records.empty()) return;
  std::vector<uint8_t> body;
  proto::Writer w(&body);
  proto::encode(w, st->batch);
  st->batch.records.clear();
  iovec iov{body.data(), body.size()};
  client->post(proto::kLocalOps, &iov, 1);  // a lost connection shows up on the next request
}

void flush_at_exit() {
  Client* client;
  if (Client::get(&client) == ncclSuccess) flush(client);
}

// Maps the communicator's arena on first use (one ARENA request); nullptr when refused.
CommState* state_for(Client* client, ncclComm* comm) {
  int status = comm->local_status.load(std::memory_order_acquire);
  if (status == 1) return comm->local;
  if (status == 2) return nullptr;
  std::vector<uint8_t> body;
  proto::Writer w(&body);
  proto::encode(w, proto::ArenaRequest{comm->handle});
  flush(client);
  Pending p;
  proto::ArenaInfo info;
  bool ok = client->call(&p, proto::kArena, body) == ncclSuccess && p.hdr.type == proto::kArenaInfo;
  if (ok) {
    proto::Reader r(p.body.data(), p.body.size());
    ok = proto::decode(r, &info) && info.granted == 1 && static_cast<int>(info.rank) == comm->rank;
  }
  std::unique_ptr<Arena> arena;
  if (ok) {
    std::string err;
    arena.reset(Arena::open(info.path, info.total_bytes, info.slot_bytes, comm->nranks, comm->rank, &err));
    // Every member was told to use the arena; one that cannot would leave the others waiting
    // until the coordinator's timeout, so say so loudly.
    if (!arena) fprintf(stderr, "fakegpu: rank %d cannot use its communicator's arena: %s\n", comm->rank, err.c_str());
  }
  if (!arena) {
    comm->local_status.store(2, std::memory_order_release);
    return nullptr;
  }
  auto* st = new CommState();
  st->arena = std::move(arena);
  st->batch.comm_handle = comm->handle;
  st->batch.nranks = static_cast<uint32_t>(comm->nranks);
  comm->local = st;
  comm->local_status.store(1, std::memory_order_release);
  return st;
}

// Elements of one round: what fits a rank's slot (one block per rank for ReduceScatter).
uint64_t round_elements(const CollCall& c, uint64_t slot, size_t s) {
  return c.kind == proto::kReduceScatter ? slot / (s * static_cast<uint64_t>(c.comm->nranks)) : slot / s;
}

void copy_in(const CollCall& c, const Arena& a, uint64_t round, uint64_t off, uint64_t cnt, size_t s) {
  const auto* send = static_cast<const uint8_t*>(c.sendbuff);
  uint8_t* slot = a.input_slot(round, a.rank());
  switch (c.kind) {
    case proto::kBroadcast:
      if (a.rank() != c.root) break;
      [[fallthrough]];
    case proto::kAllReduce: case proto::kReduce: case proto::kAllGather:
      memcpy(slot, send + off * s, cnt * s);
      break;
    case proto::kReduceScatter:
      for (int j = 0; j < a.nranks(); j++) memcpy(slot + j * cnt * s, send + (j * c.count + off) * s, cnt * s);
      break;
  }
}

// A call runs in rounds of at most a slot per rank. A round is numbered by the generation of
// the barrier that publishes its inputs (the same number on every member, also after members
// withdrew from a barrier), and round r uses parity r % 2 of the slots and records: a member
// writes parity p again only after a barrier that every member reaches after its last read
// of that parity.
struct Round {
  uint64_t round, off, cnt;
};

// AllReduce / Reduce above kDirectReduceBytes: each member reduces a slice of the round into
// the shared output slot, and everyone copies the whole output out after the next barrier.
bool sliced(const CollCall& c, size_t s) {
  return (c.kind == proto::kAllReduce || c.kind == proto::kReduce) && c.count * s > kDirectReduceBytes;
}

void reduce_slice(const CollCall& c, const Arena& a, const Round& rd, size_t s, const uint8_t (*scalars)[8]) {
  const int n = a.nranks(), me = a.rank();
  const uint64_t per = (rd.cnt + n - 1) / n;
  const uint64_t lo = std::min<uint64_t>(rd.cnt, per * me), hi = std::min<uint64_t>(rd.cnt, lo + per);
  if (hi == lo) return;
  thread_local std::vector<const void*> inputs;
  inputs.resize(n);
  for (int r = 0; r < n; r++) inputs[r] = a.input_slot(rd.round, r) + lo * s;
  reduce_n(c.datatype, c.redop, inputs.data(), n, a.output_slot(rd.round) + lo * s, hi - lo, scalars);
}

void copy_out_sliced(const CollCall& c, const Arena& a, const Round& rd, size_t s) {
  if (c.kind == proto::kAllReduce || a.rank() == c.root)
    memcpy(static_cast<uint8_t*>(c.recvbuff) + rd.off * s, a.output_slot(rd.round), rd.cnt * s);
}

// The other kinds (and small reductions): right after the round's barrier every member
// produces its own output from the input slots.
void compute_direct(const CollCall& c, const Arena& a, const Round& rd, size_t s, const uint8_t (*scalars)[8]) {
  const int n = a.nranks(), me = a.rank();
  auto* recv = static_cast<uint8_t*>(c.recvbuff);
  thread_local std::vector<const void*> inputs;
  inputs.resize(n);
  switch (c.kind) {
    case proto::kBroadcast:
      if (!(me == c.root && c.in_place)) memcpy(recv + rd.off * s, a.input_slot(rd.round, c.root), rd.cnt * s);
      return;
    case proto::kAllGather:
      for (int j = 0; j < n; j++) memcpy(recv + (j * c.count + rd.off) * s, a.input_slot(rd.round, j), rd.cnt * s);
      return;
    case proto::kReduceScatter:
      for (int r = 0; r < n; r++) inputs[r] = a.input_slot(rd.round, r) + me * rd.cnt * s;
      reduce_n(c.datatype, c.redop, inputs.data(), n, recv + rd.off * s, rd.cnt, scalars);
      return;
    default:  // AllReduce, Reduce
      if (c.kind == proto::kReduce && me != c.root) return;
      for (int r = 0; r < n; r++) inputs[r] = a.input_slot(rd.round, r);
      reduce_n(c.datatype, c.redop, inputs.data(), n, recv + rd.off * s, rd.cnt, scalars);
  }
}

std::chrono::steady_clock::time_point deadline_from_now(Client* client) {
  return std::chrono::steady_clock::now() + std::chrono::milliseconds(client->timeout_ms());
}

}  // namespace

bool try_run(Client* client, const CollCall& c, ncclResult_t* rc) {
  if (!client->local_collectives() || !is_local_kind(c.kind) || c.send_on_device || c.recv_on_device) return false;
  ncclComm* comm = c.comm;
  if (comm->nranks < 2 || (rooted(c.kind) && (c.root < 0 || c.root >= comm->nranks))) return false;
  const size_t s = datatype_size(c.datatype);
  if (s == 0 || c.redop > 5) return false;  // the coordinator names the bad argument
  CommState* st = state_for(client, comm);
  // A dead coordinator must stop the job as before (ncclSystemError), not go unnoticed here.
  if (!st || !st->arena->usable() || !client->connection_alive()) return false;
  Arena& a = *st->arena;
  const std::function<bool()> give_up = [&] { return comm->aborted.load() || !client->connection_alive(); };

  const uint64_t per_round = round_elements(c, a.slot_bytes(), s);
  if (per_round == 0) return false;
  const uint64_t rounds = c.count == 0 ? 1 : (c.count + per_round - 1) / per_round;
  const int n = comm->nranks, me = comm->rank;

  Step whole;  // the call as one step, for the record
  whole.cnt = c.count;
  whole.flags = proto::kOpFirstStep | proto::kOpLastStep;
  step_lengths(c, c.count, &whole.in_len, &whole.out_len);

  thread_local std::vector<std::array<uint8_t, 8>> scalar_store;
  scalar_store.resize(n);
  const uint8_t(*scalars)[8] = reinterpret_cast<const uint8_t(*)[8]>(scalar_store.data());
  thread_local std::vector<double> arrivals;
  arrivals.resize(n);

  const bool slices = sliced(c, s);
  const uint64_t base = a.generation();  // round k of the call meets at barrier generation base + k
  auto round_at = [&](uint64_t k) {
    Round rd{base + k, k * per_round, 0};
    rd.cnt = std::min(per_round, c.count - rd.off);
    return rd;
  };
  ncclResult_t failure = ncclSuccess;

  // First round: inputs, this member's record, the barrier, and the members' agreement.
  Round rd = round_at(0);
  copy_in(c, a, rd.round, rd.off, rd.cnt, s);
  RankRecord* mine = a.record(rd.round, me);
  encode_step_desc(c, whole, mine->desc);
  mine->round = rd.round;
  mine->arrival = wall_now();
  if (a.barrier(deadline_from_now(client), give_up, true) != Arena::kMet) return false;
  for (int r = 0; r < n; r++) {
    const RankRecord* rec = a.record(rd.round, r);
    // A disagreement: every member sees the same records and hands the call to the
    // coordinator, which reports it as it always has.
    if (!same_call(mine->desc, rec->desc)) return false;
    memcpy(scalar_store[r].data(), rec->desc + 64, 8);
    arrivals[r] = rec->arrival;
  }
  const double first_arrival = *std::min_element(arrivals.begin(), arrivals.end());
  const double last_arrival = *std::max_element(arrivals.begin(), arrivals.end());

  if (slices) {
    // Pipelined: one barrier per round both publishes round k's slices and round k+1's inputs.
    reduce_slice(c, a, rd, s, scalars);
    for (uint64_t k = 0; k < rounds && failure == ncclSuccess; k++) {
      Round cur = round_at(k);
      if (k + 1 < rounds) copy_in(c, a, cur.round + 1, round_at(k + 1).off, round_at(k + 1).cnt, s);
      if (a.barrier(deadline_from_now(client), give_up, false) != Arena::kMet) {
        failure = ncclRemoteError;
        break;
      }
      copy_out_sliced(c, a, cur, s);
      if (k + 1 < rounds) reduce_slice(c, a, round_at(k + 1), s, scalars);
    }
  } else {
    for (uint64_t k = 0; failure == ncclSuccess; k++) {
      compute_direct(c, a, rd, s, scalars);
      if (k + 1 >= rounds) break;
      rd = round_at(k + 1);
      copy_in(c, a, rd.round, rd.off, rd.cnt, s);
      if (a.barrier(deadline_from_now(client), give_up, false) != Arena::kMet) failure = ncclRemoteError;
    }
  }
  if (failure != ncclSuccess) {
    // Part of the call already happened (in-place inputs are overwritten): it fails here.
    if (!client->connection_alive()) {
      comm->async_error.store(ncclSystemError);
      *rc = fail(ncclSystemError, "fakegpu: lost the connection to the coordinator at " + client->address() +
                                      " during a host-local " + proto::kind_name(c.kind));
      return true;
    }
    std::string msg = "fakegpu: " + std::string(proto::kind_name(c.kind)) + " (call " + std::to_string(c.call_seq) +
                      " on rank " + std::to_string(me) + " of " + std::to_string(n) +
                      ") failed with ncclRemoteError: a member of the communicator left or stopped in the middle "
                      "of a host-local call";
    {
      std::lock_guard<std::mutex> lk(comm->mu);
      comm->last_error = msg;
    }
    comm->async_error.store(failure);
    *rc = fail(failure, msg);
    return true;
  }

  if (me == 0) {
    proto::LocalOpRecord rec;
    uint8_t desc[proto::kOpDescSize];
    encode_step_desc(c, whole, desc);
    proto::Reader dr(desc, sizeof(desc));
    proto::decode_opdesc(dr, &rec.desc);
    rec.started_at = first_arrival;
    rec.rendezvous_s = last_arrival - first_arrival;
    rec.execution_s = std::max(0.0, wall_now() - last_arrival);
    rec.arrival_wait_s.resize(n);
    for (int r = 0; r < n; r++) rec.arrival_wait_s[r] = last_arrival - arrivals[r];
    std::lock_guard<std::mutex> lk(g_mu);
    if (st->batch.records.empty()) {
      st->oldest = std::chrono::steady_clock::now();
      g_dirty.push_back(comm);
      if (!g_atexit_registered) {
        g_atexit_registered = true;
        atexit(flush_at_exit);
      }
    }
    st->batch.records.push_back(std::move(rec));
    if (st->batch.records.size() >= kBatchRecords || std::chrono::steady_clock::now() - st->oldest >= kBatchAge) {
      send_batch_locked(client, comm);
      g_dirty.erase(std::remove(g_dirty.begin(), g_dirty.end(), comm), g_dirty.end());
    }
  }
  *rc = ncclSuccess;
  return true;
}

void flush(Client* client) {
  std::lock_guard<std::mutex> lk(g_mu);
  for (ncclComm* comm : g_dirty) send_batch_locked(client, comm);
  g_dirty.clear();
}

void release(Client* client, ncclComm* comm) {
  {
    std::lock_guard<std::mutex> lk(g_mu);
    if (std::find(g_dirty.begin(), g_dirty.end(), comm) != g_dirty.end()) {
      send_batch_locked(client, comm);
      g_dirty.erase(std::remove(g_dirty.begin(), g_dirty.end(), comm), g_dirty.end());
    }
  }
  delete comm->local;
  comm->local = nullptr;
  comm->local_status.store(2, std::memory_order_release);
}

}  // namespace fakegpu::local
