// Forwarding to NVIDIA's NCCL (passthrough and proxy modes), with per-rank accounting.
#include "modes/mode_passthrough.h"

#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/env.h"
#include "fake/fake_events.h"  // fake::json_string, the shim's one JSON string writer
#include "api/last_error.h"
#include "real/real_nccl.h"

namespace fakegpu {
namespace {

using proto::kNumKinds;

// Logical bytes of one call (nccl-tests' S): what the report sums per kind.
uint64_t call_bytes(const CollCall& c) {
  const uint64_t s = datatype_size(c.datatype), n = static_cast<uint64_t>(c.comm->nranks);
  return c.count * s * (proto::per_member_blocks(c.kind) ? n : 1);
}

struct KindStats {
  uint64_t calls = 0, bytes = 0, failed = 0;
};

// What the report says about one communicator (kept after it is freed).
struct CommRecord {
  int id = 0, parent = -1, rank = -1, nranks = 0, color = 0;
  std::string name, state = "live";
  uint64_t groups = 0;
  KindStats kinds[kNumKinds];
};

struct RealState {
  ncclComm_t real = nullptr;
  std::shared_ptr<CommRecord> record;
};

// A communicator request in flight: the real library's half and, in proxy mode, the
// coordinator's half (the simulate mode's own request state).
struct Inflight {
  ncclComm_t real = nullptr;
  ncclResult_t started = ncclSuccess;
  void* coordinator_state = nullptr;
};

// How long a real init/split/finalize may stay in progress.
long long progress_timeout_ms() {
  static const long long ms = env::integer("FAKEGPU_REAL_NCCL_TIMEOUT_MS", 600000);
  return ms;
}

class ForwardingMode : public DistMode {
 public:
  ForwardingMode(const char* name, DistMode* coordinator) : name_(name), coordinator_(coordinator) {
    static ForwardingMode* self = this;  // for the exit hook (one mode per process)
    atexit([] { self->write_report(); });
  }

  const char* name() const override { return name_; }

  ncclResult_t get_unique_id(uint8_t out[128]) override {
    const real::Nccl* n;
    ncclResult_t rc = real::load(&n);
    if (rc != ncclSuccess) return rc;
    ncclUniqueId id;
    rc = n->GetUniqueId(&id);
    if (rc != ncclSuccess) return real::real_fail(n, rc, "ncclGetUniqueId");
    memcpy(out, id.internal, sizeof(id.internal));
    return ncclSuccess;
  }

  ncclResult_t comm_start(CommRequest* req) override {
    const real::Nccl* n;
    ncclResult_t rc = real::load(&n);
    if (rc != ncclSuccess) return rc;
    auto* st = new Inflight();
    // Always non-blocking underneath: several members of one communicator may be created by
    // one thread (ncclCommInitAll, inits inside a group) and are completed in comm_finish.
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    if (!req->comm->config.name.empty()) cfg.commName = req->comm->config.name.c_str();
    if (req->kind == CommRequest::kInit) {
      ncclUniqueId id;
      memcpy(id.internal, req->unique_id, sizeof(id.internal));
      rc = n->CommInitRankConfig(&st->real, req->nranks, id, req->rank, &cfg);
    } else {
      ncclComm_t parent = lookup(req->parent);
      if (!parent) {
        delete st;
        return fail(ncclInvalidUsage, "ncclCommSplit: the parent communicator has no real NCCL communicator");
      }
      rc = n->CommSplit(parent, req->color, req->key, &st->real, &cfg);
    }
    if (rc != ncclSuccess && rc != ncclInProgress) {
      delete st;
      return real::real_fail(n, rc, req->kind == CommRequest::kInit ? "ncclCommInitRankConfig" : "ncclCommSplit");
    }
    if (coordinator_) {
      req->state = nullptr;
      rc = coordinator_->comm_start(req);
      st->coordinator_state = req->state;
      if (rc != ncclSuccess) {
        if (st->real) n->CommAbort(st->real);
        delete st;
        req->state = nullptr;
        return rc;
      }
    }
    req->state = st;
    return ncclSuccess;
  }

  ncclResult_t comm_finish(CommRequest* req) override {
    std::unique_ptr<Inflight> st(static_cast<Inflight*>(req->state));
    req->state = nullptr;
    if (!st) return fail(ncclInternalError, "fakegpu: communicator request was never started");
    const real::Nccl* n;
    ncclResult_t rc = real::load(&n);
    if (rc != ncclSuccess) return rc;
    const char* what = req->kind == CommRequest::kInit ? "ncclCommInitRankConfig" : "ncclCommSplit";
    ncclResult_t crc = ncclSuccess;
    if (coordinator_) {  // the coordinator's view first: it names disagreeing ranks
      req->state = st->coordinator_state;
      crc = coordinator_->comm_finish(req);
      req->state = nullptr;
    }
    rc = st->real ? wait_progress(n, st->real, what) : ncclSuccess;
    if (crc != ncclSuccess || rc != ncclSuccess) {
      std::string msg = last_error();
      if (st->real) n->CommAbort(st->real);
      return fail(crc != ncclSuccess ? crc : rc, msg);
    }
    if (!st->real) {  // NCCL_SPLIT_NOCOLOR: no communicator for this member
      if (coordinator_ && !req->no_color_result)
        return failf(ncclInternalError, "%s: the real library gave no communicator but the coordinator did", what);
      req->no_color_result = true;
      return ncclSuccess;
    }
    int rank = -1, count = 0;
    if ((rc = n->CommUserRank(st->real, &rank)) != ncclSuccess || (rc = n->CommCount(st->real, &count)) != ncclSuccess) {
      n->CommAbort(st->real);
      return real::real_fail(n, rc, "ncclCommUserRank/ncclCommCount");
    }
    ncclComm* c = req->comm;
    if (coordinator_ && (c->rank != rank || c->nranks != count)) {
      n->CommAbort(st->real);
      return failf(ncclInternalError, "%s: the coordinator made this member rank %d of %d, the real library rank %d of %d",
                   what, c->rank, c->nranks, rank, count);
    }
    c->rank = rank;
    c->nranks = count;
    auto rec = std::make_shared<CommRecord>();
    rec->rank = rank;
    rec->nranks = count;
    rec->name = c->config.name;
    std::lock_guard<std::mutex> lk(mu_);
    rec->id = static_cast<int>(records_.size());
    if (req->kind == CommRequest::kSplit) {
      auto it = comms_.find(req->parent);
      rec->parent = it == comms_.end() ? -1 : it->second.record->id;
      rec->color = req->color;
    }
    records_.push_back(rec);
    comms_[c] = RealState{st->real, rec};
    return ncclSuccess;
  }

  ncclResult_t comm_free(ncclComm* comm, proto::FreeHow how) override {
    const real::Nccl* n;
    ncclResult_t rc = real::load(&n);
    if (rc != ncclSuccess) return rc;
    RealState rs;
    {
      std::lock_guard<std::mutex> lk(mu_);
      auto it = comms_.find(comm);
      if (it == comms_.end()) return fail(ncclInvalidUsage, "fakegpu: this communicator has no real NCCL communicator");
      rs = it->second;
      comms_.erase(it);
      rs.record->state = how == proto::kFreeAbort ? "aborted" : how == proto::kFreeFinalize ? "finalized" : "destroyed";
    }
    if (how == proto::kFreeAbort) {
      rc = n->CommAbort(rs.real);
      if (rc != ncclSuccess) rc = real::real_fail(n, rc, "ncclCommAbort");
    } else {
      // NCCL: finalize flushes outstanding work, destroy frees. Our ncclCommDestroy does not
      // come back here after a finalize, so the real communicator is freed now.
      rc = n->CommFinalize(rs.real);
      if (rc == ncclSuccess || rc == ncclInProgress) rc = wait_progress(n, rs.real, "ncclCommFinalize");
      else rc = real::real_fail(n, rc, "ncclCommFinalize", rs.real);
      ncclResult_t drc = n->CommDestroy(rs.real);
      if (rc == ncclSuccess && drc != ncclSuccess) rc = real::real_fail(n, drc, "ncclCommDestroy");
    }
    if (coordinator_) {
      ncclResult_t crc = coordinator_->comm_free(comm, how);
      if (rc == ncclSuccess && how != proto::kFreeAbort) rc = crc;
    }
    write_report();
    return rc;
  }

  void post_rejected(const CollCall& c) override {
    if (coordinator_) coordinator_->post_rejected(c);
  }

  ncclResult_t run_group(const std::vector<CollCall>& group_calls) override {
    const real::Nccl* n;
    ncclResult_t rc = real::load(&n);
    if (rc != ncclSuccess) return rc;
    // A rejected call never reaches the real library. In proxy mode the coordinator sees its
    // placeholder (ACCOUNT) and fails the group on every member; without a coordinator it is
    // dropped, and the real library's peers wait as they would under NCCL.
    std::vector<CollCall> valid;
    const std::vector<CollCall>& calls = coordinator_ ? group_calls : without_rejected(group_calls, &valid);
    if (calls.empty()) return ncclSuccess;
    // proxy: the coordinator checks and accounts the group BEFORE it is forwarded -- real NCCL
    // would hang (or corrupt memory) on a collective the ranks disagree on. A refused group
    // never reaches the real library.
    if (coordinator_) {
      rc = coordinator_->account_group(calls);
      if (rc != ncclSuccess) {
        std::string msg = last_error();
        account(calls, false);
        return fail(rc, msg);
      }
    }
    std::vector<std::pair<ncclRedOp_t, ncclComm_t>> ops;  // PreMulSum operators made for this group
    std::vector<ncclComm_t> reals(calls.size());
    rc = n->GroupStart();
    if (rc != ncclSuccess) return real::real_fail(n, rc, "ncclGroupStart");
    ncclResult_t first = ncclSuccess;
    std::string first_msg;
    for (size_t i = 0; i < calls.size() && first == ncclSuccess; i++) {
      reals[i] = lookup(calls[i].comm);
      if (!reals[i]) {
        first = fail(ncclInvalidUsage, "fakegpu: the communicator has no real NCCL communicator");
        break;
      }
      ncclResult_t r = enqueue(n, calls[i], reals[i], &ops);
      if (r != ncclSuccess && r != ncclInProgress) first = r;
    }
    if (first != ncclSuccess) first_msg = last_error();
    rc = n->GroupEnd();
    if (rc == ncclInProgress) rc = ncclSuccess;  // completed below, per communicator
    else if (rc != ncclSuccess && first == ncclSuccess) {
      first = real::real_fail(n, rc, "ncclGroupEnd");
      first_msg = last_error();
    }
    // Our real communicators are non-blocking: wait until each one's work is enqueued.
    if (first == ncclSuccess) {
      for (size_t i = 0; i < calls.size(); i++) {
        if (i > 0 && reals[i] == reals[i - 1]) continue;
        ncclResult_t r = wait_progress(n, reals[i], proto::kind_name(calls[i].kind));
        if (r != ncclSuccess && first == ncclSuccess) {
          first = r;
          first_msg = last_error();
          calls[i].comm->async_error.store(r);
        }
      }
    }
    for (auto& o : ops) n->RedOpDestroy(o.first, o.second);  // allowed once enqueued
    account(calls, first == ncclSuccess);
    if (first != ncclSuccess) return fail(first, first_msg);
    return ncclSuccess;
  }

  ncclResult_t async_error(ncclComm* comm) override {
    const real::Nccl* n;
    if (real::load(&n) != ncclSuccess) return ncclSuccess;
    ncclComm_t r = lookup(comm);
    ncclResult_t st = ncclSuccess;
    if (!r || n->CommGetAsyncError(r, &st) != ncclSuccess) return ncclSuccess;
    // In progress = work still being enqueued on our non-blocking real communicator: not an
    // error for the caller, whose communicator is blocking or already initialized.
    return st == ncclInProgress ? ncclSuccess : st;
  }

  ncclResult_t simulate_group(const std::vector<CollCall>& all_calls, double* estimated_us) override {
    const real::Nccl* n;
    ncclResult_t rc = real::load(&n);
    if (rc != ncclSuccess) return rc;
    std::vector<CollCall> valid;  // rejected calls are not modeled
    const std::vector<CollCall>& calls = without_rejected(all_calls, &valid);
    if (!n->GroupSimulateEnd)
      return failf(ncclInvalidUsage, "ncclGroupSimulateEnd: the real library %s does not provide it", n->path.c_str());
    std::vector<std::pair<ncclRedOp_t, ncclComm_t>> ops;
    n->GroupStart();
    ncclResult_t first = ncclSuccess;
    for (const CollCall& c : calls) {
      ncclComm_t r = lookup(c.comm);
      ncclResult_t e = r ? enqueue(n, c, r, &ops) : fail(ncclInvalidUsage, "fakegpu: no real communicator");
      if (e != ncclSuccess && e != ncclInProgress && first == ncclSuccess) first = e;
    }
    ncclSimInfo_t info = NCCL_SIM_INFO_INITIALIZER;
    rc = n->GroupSimulateEnd(&info);
    for (auto& o : ops) n->RedOpDestroy(o.first, o.second);
    if (first != ncclSuccess) return first;
    if (rc != ncclSuccess && rc != ncclInProgress) return real::real_fail(n, rc, "ncclGroupSimulateEnd");
    *estimated_us = info.estimatedTime;
    return ncclSuccess;
  }

 private:
  ncclComm_t lookup(ncclComm* c) {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = comms_.find(c);
    return it == comms_.end() ? nullptr : it->second.real;
  }

  static ncclResult_t wait_progress(const real::Nccl* n, ncclComm_t real, const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(progress_timeout_ms());
    for (int spin = 0;; spin++) {
      ncclResult_t st = ncclSuccess;
      ncclResult_t rc = n->CommGetAsyncError(real, &st);
      if (rc != ncclSuccess) return real::real_fail(n, rc, "ncclCommGetAsyncError", real);
      if (st == ncclSuccess) return ncclSuccess;
      if (st != ncclInProgress) return real::real_fail(n, st, what, real);
      if (std::chrono::steady_clock::now() > deadline)
        return failf(ncclTimeout, "fakegpu: real %s still in progress after %lld ms (FAKEGPU_REAL_NCCL_TIMEOUT_MS)",
                     what, progress_timeout_ms());
      if (spin < 100) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  // Issues one call on the real library (inside its group).
  static ncclResult_t enqueue(const real::Nccl* n, const CollCall& c, ncclComm_t r,
                              std::vector<std::pair<ncclRedOp_t, ncclComm_t>>* ops) {
    const auto dt = static_cast<ncclDataType_t>(c.datatype);
    ncclRedOp_t op = static_cast<ncclRedOp_t>(c.redop);
    if (c.redop == 5) {
      // Our PreMulSum op number means nothing to the real library: make its own.
      void* scalar = c.scalar_ptr ? const_cast<void*>(c.scalar_ptr) : const_cast<uint8_t*>(c.scalar);
      ncclResult_t rc = n->RedOpCreatePreMulSum(&op, scalar, dt, c.scalar_ptr ? ncclScalarDevice : ncclScalarHostImmediate, r);
      if (rc != ncclSuccess) return real::real_fail(n, rc, "ncclRedOpCreatePreMulSum", r);
      ops->push_back({op, r});
    }
    auto* st = static_cast<cudaStream_t>(c.stream);
    const size_t s = datatype_size(c.datatype);
    const int nr = c.comm->nranks;
    ncclResult_t rc = ncclSuccess;
    const char* fn = proto::kind_name(c.kind);
    switch (c.kind) {
      case proto::kAllReduce: rc = n->AllReduce(c.sendbuff, c.recvbuff, c.count, dt, op, r, st); break;
      case proto::kBroadcast: rc = n->Broadcast(c.sendbuff, c.recvbuff, c.count, dt, c.root, r, st); break;
      case proto::kReduce: rc = n->Reduce(c.sendbuff, c.recvbuff, c.count, dt, op, c.root, r, st); break;
      case proto::kAllGather: rc = n->AllGather(c.sendbuff, c.recvbuff, c.count, dt, r, st); break;
      case proto::kReduceScatter: rc = n->ReduceScatter(c.sendbuff, c.recvbuff, c.count, dt, op, r, st); break;
      case proto::kSend: rc = n->Send(c.sendbuff, c.count, dt, c.root, r, st); break;
      case proto::kRecv: rc = n->Recv(c.recvbuff, c.count, dt, c.root, r, st); break;
      case proto::kAlltoAll:
        if (n->AlltoAll) {
          rc = n->AlltoAll(c.sendbuff, c.recvbuff, c.count, dt, r, st);
        } else {  // older NCCL: the usual send/recv formulation, inside the group already open
          for (int p = 0; p < nr && rc == ncclSuccess; p++) {
            rc = n->Send(static_cast<const char*>(c.sendbuff) + p * c.count * s, c.count, dt, p, r, st);
            if (rc == ncclSuccess || rc == ncclInProgress)
              rc = n->Recv(static_cast<char*>(c.recvbuff) + p * c.count * s, c.count, dt, p, r, st);
            if (rc == ncclInProgress) rc = ncclSuccess;
          }
        }
        break;
      case proto::kGather:
        if (n->Gather) {
          rc = n->Gather(c.sendbuff, c.recvbuff, c.count, dt, c.root, r, st);
        } else {
          rc = n->Send(c.sendbuff, c.count, dt, c.root, r, st);
          if (c.comm->rank == c.root)
            for (int p = 0; p < nr && (rc == ncclSuccess || rc == ncclInProgress); p++)
              rc = n->Recv(static_cast<char*>(c.recvbuff) + p * c.count * s, c.count, dt, p, r, st);
        }
        break;
      case proto::kScatter:
        if (n->Scatter) {
          rc = n->Scatter(c.sendbuff, c.recvbuff, c.count, dt, c.root, r, st);
        } else {
          if (c.comm->rank == c.root)
            for (int p = 0; p < nr && (rc == ncclSuccess || rc == ncclInProgress); p++)
              rc = n->Send(static_cast<const char*>(c.sendbuff) + p * c.count * s, c.count, dt, p, r, st);
          if (rc == ncclSuccess || rc == ncclInProgress) rc = n->Recv(c.recvbuff, c.count, dt, c.root, r, st);
        }
        break;
      default:
        return failf(ncclInternalError, "fakegpu: unknown call kind %d", c.kind);
    }
    if (rc != ncclSuccess && rc != ncclInProgress) return real::real_fail(n, rc, fn, r);
    return rc;
  }

  void account(const std::vector<CollCall>& calls, bool ok) {
    std::lock_guard<std::mutex> lk(mu_);
    CommRecord* last = nullptr;
    for (const CollCall& c : calls) {
      auto it = comms_.find(c.comm);
      if (it == comms_.end()) continue;
      CommRecord* rec = it->second.record.get();
      if (rec != last) rec->groups++;
      last = rec;
      KindStats& k = rec->kinds[c.kind < kNumKinds ? c.kind : 0];
      k.calls++;
      if (ok) k.bytes += call_bytes(c);
      else k.failed++;
    }
  }

  std::string report_path() const {
    std::string base = env::str("FAKEGPU_CLUSTER_REPORT_PATH", "fakegpu-report.json");
    std::string rank = env::str("RANK");
    return base + ".rank" + (rank.empty() ? "-pid" + std::to_string(getpid()) : rank);
  }

 public:
  // Atomically replaces this rank's report (called at every free and at exit).
  void write_report() {
    std::lock_guard<std::mutex> lk(mu_);
    if (records_.empty()) return;
    std::string j = "{\n  \"format\": \"fakegpu-rank-report/1\",\n";
    j += "  \"mode\": \"" + std::string(name_) + "\",\n";
    // Numbers, whatever the environment holds (RANK=abc must not make the file invalid JSON).
    auto number = [](const char* name) { return std::to_string(env::integer(name, -1, nullptr)); };
    j += "  \"rank\": " + number("RANK") + ",\n  \"local_rank\": " + number("LOCAL_RANK") +
         ",\n  \"world_size\": " + number("WORLD_SIZE") + ",\n";
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    j += "  \"hostname\": " + fake::json_string(host) + ",\n  \"pid\": " + std::to_string(getpid()) + ",\n";
    const real::Nccl* n = nullptr;
    if (real::load(&n) == ncclSuccess)
      j += "  \"real_nccl\": {\"path\": " + fake::json_string(n->path) + ", \"version\": " + std::to_string(n->version) + "},\n";
    KindStats total[kNumKinds];
    j += "  \"communicators\": [";
    for (size_t i = 0; i < records_.size(); i++) {
      const CommRecord& r = *records_[i];
      j += std::string(i ? "," : "") + "\n    {\"id\": " + std::to_string(r.id) + ", \"parent\": " +
           std::to_string(r.parent) + ", \"color\": " + std::to_string(r.color) + ", \"rank\": " +
           std::to_string(r.rank) + ", \"nranks\": " + std::to_string(r.nranks) + ", \"name\": " + fake::json_string(r.name) +
           ", \"state\": \"" + r.state + "\", \"groups\": " + std::to_string(r.groups) + ", \"ops\": " +
           kinds_json(r.kinds) + "}";
      for (int k = 0; k < kNumKinds; k++) {
        total[k].calls += r.kinds[k].calls;
        total[k].bytes += r.kinds[k].bytes;
        total[k].failed += r.kinds[k].failed;
      }
    }
    j += "\n  ],\n  \"totals\": " + kinds_json(total) + "\n}\n";
    const std::string path = report_path(), tmp = path + ".tmp" + std::to_string(getpid());
    FILE* f = fopen(tmp.c_str(), "w");
    if (!f) return;
    bool ok = fwrite(j.data(), 1, j.size(), f) == j.size();
    ok = (fclose(f) == 0) && ok;
    if (ok) rename(tmp.c_str(), path.c_str());
    else unlink(tmp.c_str());
  }

 private:
  static std::string kinds_json(const KindStats* k) {
    std::string j = "{";
    bool first = true;
    for (int i = 1; i < kNumKinds; i++) {
      if (!k[i].calls) continue;
      j += std::string(first ? "" : ", ") + "\"" + proto::kind_name(static_cast<uint8_t>(i)) + "\": {\"calls\": " +
           std::to_string(k[i].calls) + ", \"bytes\": " + std::to_string(k[i].bytes) + ", \"failed\": " +
           std::to_string(k[i].failed) + "}";
      first = false;
    }
    return j + "}";
  }
  const char* name_;
  DistMode* coordinator_;
  std::mutex mu_;
  std::map<ncclComm*, RealState> comms_;
  std::vector<std::shared_ptr<CommRecord>> records_;
};

}  // namespace

DistMode* make_forwarding_mode(const char* name, DistMode* coordinator) { return new ForwardingMode(name, coordinator); }
DistMode* make_passthrough_mode() { return make_forwarding_mode("passthrough", nullptr); }

}  // namespace fakegpu
