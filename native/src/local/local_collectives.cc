#include "local/local_collectives.h"

#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <condition_variable>
#include <thread>
#include <vector>

#include "api/last_error.h"
#include "wire/staging.h"
#include "local/arena.h"
#include "numerics/reduce_n.h"

namespace fakegpu::local {

// What a communicator holds for local collectives.
struct CommState {
  std::unique_ptr<Arena> arena;
  proto::LocalOps batch;                  // rank 0 only: calls not yet told to the coordinator
};

namespace {

// Up to this many bytes per rank every member reduces the whole round itself (no second
// barrier); above it each member reduces a slice into the shared output slot. Measured on 2
// cores, 4 ranks: 256 KiB direct 0.25-0.3 ms vs sliced 0.45 ms; 1 MiB direct 0.75-0.9 ms vs
// sliced 0.4-0.6 ms.
constexpr uint64_t kDirectReduceBytes = 256 << 10;
// How long the members of a call wait for each other in the arena before they take the call to
// the coordinator (see try_run).
constexpr auto kArenaPatience = std::chrono::seconds(5);
// Rank 0's records reach the coordinator within kFlushPeriod (a background thread sends them),
// or as soon as kBatchRecords piled up, or before any other request of this process.
constexpr size_t kBatchRecords = 256;
constexpr auto kFlushPeriod = std::chrono::milliseconds(50);

// Batches of this process. Heap objects that are never destroyed: the flusher thread may still
// wait on them while the process exits.
struct Batches {
  std::mutex mu;                                   // guards dirty and every batch
  std::condition_variable cv;                      // a batch became non-empty
  std::vector<std::shared_ptr<CommState>> dirty;   // communicators with records to send
  bool flusher_started = false, atexit_registered = false;
  pid_t owner = 0;                                 // the process the records belong to
};
Batches& batches() {
  static Batches* b = new Batches();
  return *b;
}

double wall_now() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

bool is_local_kind(uint8_t kind) { return proto::kind_info(kind).local; }

bool rooted(uint8_t kind) { return proto::kind_info(kind).rooted; }

// The fields of two OpDescs that the members must agree on (the coordinator's matching rule):
// kind, datatype, redop, root, count, the reduction order and the call's place in the matching
// order. Offsets per
// docs/protocol.md's OpDesc table.
bool same_call(const uint8_t* a, const uint8_t* b) {
  namespace o = proto::opdesc;
  static_assert(o::kDatatype == o::kKind + 1 && o::kRedop == o::kKind + 2, "kind, datatype, redop side by side");
  return memcmp(a + o::kKind, b + o::kKind, 3) == 0 && memcmp(a + o::kRoot, b + o::kRoot, 4) == 0 &&
         ((a[o::kFlags] ^ b[o::kFlags]) & proto::kOpOrderMask) == 0 &&
         memcmp(a + o::kTotalCount, b + o::kTotalCount, 8) == 0 && memcmp(a + o::kMatchSeq, b + o::kMatchSeq, 4) == 0;
}

void send_batch_locked(Client* client, CommState* st) {
  if (st->batch.records.empty()) return;
  std::vector<uint8_t> body;
  proto::Writer w(&body);
  proto::encode(w, st->batch);
  st->batch.records.clear();
  iovec iov{body.data(), body.size()};
  client->post(proto::kLocalOps, &iov, 1);  // a lost connection shows up on the next request
}

// Sends every batch; the caller holds batches().mu. Records of another process (a fork
// inherited them) are dropped: they belong to the parent.
void send_all_locked(Client* client) {
  Batches& b = batches();
  if (b.owner != getpid()) {
    for (auto& st : b.dirty) st->batch.records.clear();
  } else {
    for (auto& st : b.dirty) send_batch_locked(client, st.get());
  }
  b.dirty.clear();
}

void flush_at_exit() {
  Batches& b = batches();
  std::lock_guard<std::mutex> lk(b.mu);
  if (b.dirty.empty() || b.owner != getpid()) return;
  Client* client;
  if (Client::get(&client) == ncclSuccess) send_all_locked(client);
}

// Sends what piled up every kFlushPeriod, so that a coordinator stopped mid-job (SIGTERM) still
// learns of the calls that completed. Detached: it never has to be joined at exit.
void flusher_loop() {
  Batches& b = batches();
  std::unique_lock<std::mutex> lk(b.mu);
  for (;;) {
    b.cv.wait(lk, [&] { return !b.dirty.empty(); });
    b.cv.wait_for(lk, kFlushPeriod);
    if (b.dirty.empty() || b.owner != getpid()) continue;
    Client* client;
    if (Client::get(&client) == ncclSuccess) send_all_locked(client);
  }
}

void note_record(Client* client, const std::shared_ptr<CommState>& st, proto::LocalOpRecord&& rec) {
  Batches& b = batches();
  std::lock_guard<std::mutex> lk(b.mu);
  if (b.owner != getpid()) {  // first record of this process (or of a forked child)
    b.owner = getpid();
    b.dirty.clear();
    b.flusher_started = false;  // a fork does not copy the parent's threads
  }
  if (st->batch.records.empty()) {
    b.dirty.push_back(st);
    b.cv.notify_one();
  }
  if (!b.atexit_registered) {
    b.atexit_registered = true;
    atexit(flush_at_exit);
  }
  if (!b.flusher_started) {
    b.flusher_started = true;
    std::thread(flusher_loop).detach();
    static bool at_fork = false;
    if (!at_fork) {  // a fork while the flusher holds the lock must not leave it locked in the child
      at_fork = true;
      pthread_atfork([] { batches().mu.lock(); }, [] { batches().mu.unlock(); }, [] { batches().mu.unlock(); });
    }
  }
  st->batch.records.push_back(std::move(rec));
  if (st->batch.records.size() >= kBatchRecords) {
    send_batch_locked(client, st.get());
    b.dirty.erase(std::remove(b.dirty.begin(), b.dirty.end(), st), b.dirty.end());
  }
}

// Maps the communicator's arena on first use (one ARENA request); nullptr when refused.
std::shared_ptr<CommState> state_for(Client* client, ncclComm* comm) {
  int status = comm->local_status.load(std::memory_order_acquire);
  if (status == 1) return std::atomic_load(&comm->local);
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
  auto st = std::make_shared<CommState>();
  st->arena = std::move(arena);
  st->batch.comm_handle = comm->handle;
  st->batch.nranks = static_cast<uint32_t>(comm->nranks);
  std::atomic_store(&comm->local, st);
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
  // The order's plan is over the call's elements: this slice is elements rd.off + lo.. of it.
  reduce_n_planned(c.datatype, c.redop, reduction_order(c), inputs.data(), n, a.output_slot(rd.round) + lo * s,
                   hi - lo, scalars, rd.off + lo, c.count);
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
      // A gloo order's plan covers the whole n·count input, as torch's gloo reduce_scatter_tensor
      // all-reduces it: this rank's block starts at element me·count.
      reduce_n_planned(c.datatype, c.redop, reduction_order(c), inputs.data(), n, recv + rd.off * s, rd.cnt, scalars,
                       static_cast<uint64_t>(me) * c.count + rd.off, static_cast<uint64_t>(n) * c.count);
      return;
    default:  // AllReduce, Reduce
      if (c.kind == proto::kReduce && me != c.root) return;
      for (int r = 0; r < n; r++) inputs[r] = a.input_slot(rd.round, r);
      reduce_n_planned(c.datatype, c.redop, reduction_order(c), inputs.data(), n, recv + rd.off * s, rd.cnt, scalars,
                       rd.off, c.count);
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
  // Held for the whole call: an abort from another thread may release the comm meanwhile.
  std::shared_ptr<CommState> st = state_for(client, comm);
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
  // A member that is late by more than kArenaPatience is waited for at the coordinator instead
  // (its skew then shows in the report like any other call's); the coordinator's own timeout
  // still applies there.
  const auto patience = std::min<std::chrono::steady_clock::duration>(
      kArenaPatience, std::chrono::milliseconds(client->timeout_ms()));
  if (a.barrier(std::chrono::steady_clock::now() + patience, give_up, true) != Arena::kMet) return false;
  for (int r = 0; r < n; r++) {
    const RankRecord* rec = a.record(rd.round, r);
    // A disagreement: every member sees the same records and hands the call to the
    // coordinator, which reports it as it always has.
    if (!same_call(mine->desc, rec->desc)) return false;
    memcpy(scalar_store[r].data(), rec->desc + proto::opdesc::kScalar, 8);
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
    note_record(client, st, std::move(rec));
  }
  *rc = ncclSuccess;
  return true;
}

void flush(Client* client) {
  Batches& b = batches();
  std::lock_guard<std::mutex> lk(b.mu);
  if (!b.dirty.empty()) send_all_locked(client);
}

void release(Client* client, ncclComm* comm) {
  std::shared_ptr<CommState> st = std::atomic_exchange(&comm->local, std::shared_ptr<CommState>());
  comm->local_status.store(2, std::memory_order_release);
  if (!st) return;
  Batches& b = batches();
  std::lock_guard<std::mutex> lk(b.mu);
  auto it = std::find(b.dirty.begin(), b.dirty.end(), st);
  if (it != b.dirty.end()) {
    if (b.owner == getpid()) send_batch_locked(client, st.get());
    else st->batch.records.clear();
    b.dirty.erase(it);
  }
  // The arena is unmapped when the last holder (a call still running on another thread) lets go.
}

}  // namespace fakegpu::local
