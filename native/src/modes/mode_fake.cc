// FAKEGPU_DIST_MODE=fake for C programs: the launch contract (fake/fake_contract.cc, which
// the torch backend's contract.py calls too), the symmetric results (fake/fake_results.cc and
// numerics/fake_numerics.cc, which fakegpu/fake/semantics.py calls too) and the event log that the whole-world report
// is built from. Nothing leaves the process: communicators are
// created locally, collectives are completed on the caller's buffers as if every member
// held what this rank holds, and each operation is logged (fake_events.h) for the
// whole-world report written at exit.
//
// Communicator membership (global logical rank of each comm rank), which the report's
// world accountant tiles over the logical world:
//   - ncclCommInitRank with nranks == NGPU: the world, comm rank i = logical rank i; the
//     rank passed must be the contract's logical rank (as the torch backend demands).
//   - nranks < NGPU: a sub-communicator whose other members are unknown to a lone
//     process. Inferred as an arithmetic progression through this rank, comm rank i =
//     logical rank (L + (i - rank) * stride) mod NGPU, where stride is
//       FAKEGPU_FAKE_COMM_STRIDES' entry for nranks ("SIZE:STRIDE,...", e.g. "32:8" for
//       the data-parallel groups of a (pp, dp=32, tp=8) mesh), else
//       NGPU / P when nranks == P > 1 (the pipeline group of the contract), else
//       1 (consecutive ranks: tensor-parallel style groups).
//     Name it (ncclConfig_t.commName) to tell groups apart in the report.
//   - ncclCommSplit: only this rank's color and key are known; by the SPMD assumption every
//     member passed the same ones, so the child has the parent's members and this rank
//     keeps its parent rank. NCCL_SPLIT_NOCOLOR gives no communicator.
//   - ncclCommShrink (should the API allow it in this mode): the parent's members less the
//     excluded ones.
#include "modes/mode_fake.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/cuda_staging.h"
#include "core/env.h"
#include "fake/fake_accounting.h"
#include "fake/fake_contract.h"
#include "fake/fake_events.h"
#include "fake/fake_results.h"
#include "numerics/fake_numerics.h"
#include "api/last_error.h"

namespace fakegpu {
namespace {

// The event file's kind: Send and Recv are one "SendRecv" kind there.
const char* kind_event_name(uint8_t kind) {
  return proto::kind_info(kind).p2p ? "SendRecv" : proto::kind_name(kind);
}

const char* redop_name(uint8_t redop) { return redop < proto::kNumRedops ? proto::kRedopNames[redop] : "sum"; }

bool reduces(uint8_t kind) { return proto::kind_info(kind).reduces; }

// Bytes of the caller's buffers a call reads (input) and writes (output) on this rank.
void call_bytes(const CollCall& c, uint64_t* in, uint64_t* out) {
  const uint64_t blk = c.count * datatype_size(c.datatype), n = static_cast<uint64_t>(c.comm->nranks);
  const bool root = c.comm->rank == c.root;
  *in = *out = 0;
  switch (c.kind) {
    case proto::kAllReduce: *in = *out = blk; break;
    case proto::kBroadcast: *in = c.sendbuff && c.sendbuff != c.recvbuff ? blk : 0; *out = blk; break;
    case proto::kReduce: *in = blk; *out = root ? blk : 0; break;
    case proto::kAllGather: *in = blk; *out = n * blk; break;
    case proto::kReduceScatter: *in = n * blk; *out = blk; break;
    case proto::kAlltoAll: *in = *out = n * blk; break;
    case proto::kGather: *in = blk; *out = root ? n * blk : 0; break;
    case proto::kScatter: *in = root ? n * blk : 0; *out = blk; break;
    case proto::kSend: *in = blk; break;
    case proto::kRecv: *out = blk; break;
  }
}

struct FakeComm {
  std::string name;
  std::vector<int> members;
};

class FakeMode : public DistMode {
 public:
  const char* name() const override { return "fake"; }

  ncclResult_t comm_start(CommRequest* req) override {
    fake::Contract c;
    std::string err;
    if (!fake::process_contract(&c, &err))
      return failf(ncclInvalidUsage, "fakegpu fake mode: launch contract error: %s", err.c_str());
    ncclComm* comm = req->comm;
    FakeComm fc;
    int rank;
    if (req->kind == CommRequest::kInit) {
      const int n = req->nranks, N = c.world_size, L = c.logical_rank;
      rank = req->rank;
      if (n > N)
        return failf(ncclInvalidArgument,
                     "fakegpu fake mode: ncclCommInitRank(nranks=%d) is larger than the logical world NGPU=%d; raise "
                     "NGPU to the job's GPU count", n, N);
      if (n == N && rank != L)
        return failf(ncclInvalidUsage,
                     "fakegpu fake mode: ncclCommInitRank(nranks=%d, rank=%d) spans the logical world but the launch "
                     "contract makes this process logical rank %d; pass rank=%d (choose the rank with RANK or "
                     "FAKE_PP_RANK)", n, rank, L, L);
      int stride = 1;
      if (n == c.pp_degree && n > 1) stride = c.spmd_size();
      if (n < N) {
        ncclResult_t rc = hinted_stride(n, &stride);
        if (rc != ncclSuccess) return rc;
      }
      for (int i = 0; i < n; i++) {
        long long g = static_cast<long long>(L) + static_cast<long long>(i - rank) * stride;
        fc.members.push_back(static_cast<int>(((g % N) + N) % N));
      }
      std::vector<int> sorted = fc.members;
      std::sort(sorted.begin(), sorted.end());
      if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
        return failf(ncclInvalidUsage,
                     "fakegpu fake mode: a communicator of %d ranks with stride %d does not fit in the logical world "
                     "NGPU=%d (members would repeat); fix FAKEGPU_FAKE_COMM_STRIDES", n, stride, N);
    } else if (req->kind == CommRequest::kShrink) {  // the parent's members less the excluded ones
      std::lock_guard<std::mutex> lk(mu_);
      const std::vector<int>& parent = comms_.at(req->parent->handle - 1).members;
      std::vector<bool> out(parent.size(), false);
      for (int32_t e : req->excluded)
        if (e >= 0 && e < static_cast<int>(parent.size())) out[e] = true;
      rank = -1;
      for (size_t i = 0; i < parent.size(); i++) {
        if (out[i]) continue;
        if (static_cast<int>(i) == req->parent->rank) rank = static_cast<int>(fc.members.size());
        fc.members.push_back(parent[i]);
      }
      if (rank < 0) return fail(ncclInvalidArgument, "fakegpu fake mode: ncclCommShrink excludes this rank");
    } else {
      if (req->color == NCCL_SPLIT_NOCOLOR) {
        req->no_color_result = true;
        req->state = this;
        return ncclSuccess;
      }
      std::lock_guard<std::mutex> lk(mu_);
      fc.members = comms_.at(req->parent->handle - 1).members;
      rank = req->parent->rank;
    }
    std::lock_guard<std::mutex> lk(mu_);
    const size_t index = comms_.size();
    fc.name = comm->config.name;
    if (fc.name.empty())
      fc.name = static_cast<int>(fc.members.size()) == c.world_size ? "world" : "comm" + std::to_string(index);
    comm->handle = index + 1;
    comm->rank = rank;
    comm->nranks = static_cast<int>(fc.members.size());
    comm->global_ranks = fc.members;
    comms_.push_back(std::move(fc));
    req->state = this;  // nothing in flight: comm_finish only acknowledges
    return ncclSuccess;
  }

  ncclResult_t comm_finish(CommRequest* req) override {
    req->state = nullptr;
    return ncclSuccess;
  }

  ncclResult_t comm_free(ncclComm* comm, proto::FreeHow how) override {
    mirror_.forget(comm->handle);
    fake::flush();
    return ncclSuccess;
  }

  ncclResult_t run_group(const std::vector<CollCall>& group_calls) override {
    // One rank plays the world: there is nobody to keep in step, so a rejected call is dropped.
    std::vector<CollCall> valid;
    const std::vector<CollCall>& user_calls = without_rejected(group_calls, &valid);
    if (user_calls.empty()) return ncclSuccess;
    fake::Contract contract;
    std::string err;
    if (!fake::process_contract(&contract, &err))  // unreachable: no communicator exists then
      return failf(ncclInvalidUsage, "fakegpu fake mode: launch contract error: %s", err.c_str());

    // Device buffers (a CUDA program): inputs and outputs bounce through host memory on
    // the call's stream, as in the simulate mode.
    std::vector<CollCall> staged;
    bool device = false;
    ncclResult_t rc = cuda_staging::prepare_group(user_calls, &staged, &device);
    if (rc != ncclSuccess) return rc;
    const std::vector<CollCall>& calls = device ? staged : user_calls;
    std::vector<const uint8_t*> in(calls.size());
    std::vector<uint8_t*> out(calls.size());
    std::vector<std::vector<uint8_t>> bounce_in, bounce_out;
    cuda_staging::DeviceCopies dev;
    if (device) {
      bounce_in.resize(calls.size());
      bounce_out.resize(calls.size());
    }
    for (size_t k = 0; k < calls.size(); k++) {
      const CollCall& c = calls[k];
      in[k] = static_cast<const uint8_t*>(c.sendbuff);
      out[k] = static_cast<uint8_t*>(c.recvbuff);
      if (!device) continue;
      uint64_t ib, ob;
      call_bytes(c, &ib, &ob);
      if (c.send_on_device && ib) {
        bounce_in[k].resize(ib);
        dev.to_host(bounce_in[k].data(), c.sendbuff, ib, c.stream);
        in[k] = bounce_in[k].data();
      }
      if (c.recv_on_device && ob) {  // also what the call leaves untouched
        bounce_out[k].resize(ob);
        dev.to_host(bounce_out[k].data(), c.recvbuff, ob, c.stream);
        out[k] = bounce_out[k].data();
      }
    }
    if (dev.any() && (rc = dev.sync()) != ncclSuccess) return rc;

    // The calls of a group run concurrently in NCCL: a receive can take a send of the same
    // group whichever came first, so the sends are recorded first.
    for (size_t k = 0; k < calls.size(); k++)
      if (calls[k].kind == proto::kSend) record_send(calls[k], in[k]);
    for (size_t k = 0; k < calls.size(); k++) {
      rc = complete(calls[k], in[k], out[k]);
      if (rc != ncclSuccess) return rc;
    }
    for (const CollCall& c : calls) log_op(contract, c);

    if (device) {
      for (size_t k = 0; k < calls.size(); k++)
        if (!bounce_out[k].empty())
          dev.to_device(calls[k].recvbuff, bounce_out[k].data(), bounce_out[k].size(), calls[k].stream);
      if (dev.any() && (rc = dev.sync()) != ncclSuccess) return rc;
    }
    return ncclSuccess;
  }

  ncclResult_t simulate_group(const std::vector<CollCall>& calls, double* estimated_us) override {
    return fail(ncclInvalidUsage,
                "fakegpu fake mode: ncclGroupSimulateEnd has no cost model in the process; the whole-world "
                "estimates are in the report written at exit (FAKEGPU_CLUSTER_REPORT_PATH)");
  }

 private:
  // FAKEGPU_FAKE_COMM_STRIDES="SIZE:STRIDE,...": the stride of sub-communicators of SIZE ranks.
  static ncclResult_t hinted_stride(int nranks, int* stride) {
    std::string spec = env::str("FAKEGPU_FAKE_COMM_STRIDES");
    size_t pos = 0;
    while (pos < spec.size()) {
      size_t end = spec.find(',', pos);
      if (end == std::string::npos) end = spec.size();
      std::string item = spec.substr(pos, end - pos);
      pos = end + 1;
      if (item.find_first_not_of(" ") == std::string::npos) continue;
      int size = 0, st = 0;
      char tail = 0;
      if (sscanf(item.c_str(), " %d : %d %c", &size, &st, &tail) != 2 || size < 1 || st < 1)
        return failf(ncclInvalidUsage, "fakegpu fake mode: FAKEGPU_FAKE_COMM_STRIDES entry '%s' is not SIZE:STRIDE "
                     "with positive integers (e.g. FAKEGPU_FAKE_COMM_STRIDES=8:1,32:8)", item.c_str());
      if (size == nranks) *stride = st;
    }
    return ncclSuccess;
  }

  void record_send(const CollCall& c, const uint8_t* in) {
    mirror_.send(c.comm->handle, c.root, c.datatype, c.count, in, c.count * datatype_size(c.datatype));
  }

  // This rank's result of one call: fake/fake_results.cc, which the torch fake backend
  // (semantics.py) calls too.
  ncclResult_t complete(const CollCall& c, const uint8_t* in, uint8_t* out) {
    const uint64_t blk = c.count * datatype_size(c.datatype);
    if (c.kind == proto::kSend) return ncclSuccess;  // recorded before the group ran
    if (c.kind == proto::kRecv) {
      mirror_.recv(c.comm->handle, c.comm->rank, c.comm->nranks, c.root, c.datatype, c.count, out, blk);
      return ncclSuccess;
    }
    const void* scalar = c.scalar_ptr ? c.scalar_ptr : c.scalar;
    switch (fake::collective_result(c.kind, c.datatype, c.redop, c.comm->nranks, c.comm->rank, c.root, in, out,
                                    c.count, datatype_size(c.datatype), scalar, fake::kExactElementOps)) {
      case fake::ResultStatus::kOk:
        return ncclSuccess;
      case fake::ResultStatus::kCannotReduce:
        return failf(ncclInvalidArgument, "fakegpu fake mode: %s: cannot reduce %s with op %d", proto::kind_name(c.kind),
                     datatype_name(c.datatype), c.redop);
      case fake::ResultStatus::kBadArgument:
        return failf(ncclInvalidArgument, "fakegpu fake mode: %s: bad arguments (rank %d of %d)",
                     proto::kind_name(c.kind), c.comm->rank, c.comm->nranks);
      case fake::ResultStatus::kUnknownKind:
        break;
    }
    return failf(ncclInternalError, "fakegpu fake mode: unknown operation kind %d", c.kind);
  }

  // One "op" event: the accounting rule and the lines are fake/fake_accounting.cc's (the
  // torch fake backend calls the same code). In pure fake mode a send or receive is spread
  // over the group, and a receive is left out when this rank also sends with that offset.
  void log_op(const fake::Contract& contract, const CollCall& c) {
    const int r = c.comm->rank;
    int root = -1, peer = -1;
    const bool p2p = c.kind == proto::kSend || c.kind == proto::kRecv;
    if (c.kind == proto::kSend) {
      root = r;
      peer = c.root;
    } else if (c.kind == proto::kRecv) {
      root = c.root;
      peer = r;
    } else if (c.kind == proto::kBroadcast || c.kind == proto::kReduce || c.kind == proto::kGather ||
               c.kind == proto::kScatter) {
      root = c.root;
    }
    std::lock_guard<std::mutex> lk(mu_);
    const FakeComm& fc = comms_.at(c.comm->handle - 1);
    const fake::Placement where = fake::place_op(contract, fc.members, r, p2p, root, peer);
    if (!where.account) return;
    auto key = std::make_pair(fc.name, fc.members);
    auto it = event_ids_.find(key);
    int id;
    if (it == event_ids_.end()) {
      id = static_cast<int>(event_ids_.size());
      event_ids_.emplace(key, id);
      // Logged under the lock so that a comm line precedes its first op in the file.
      fake::log_event(contract, fake::comm_line(id, fc.name, fc.members));
    } else {
      id = it->second;
    }
    fake::OpEvent op;
    op.comm_id = id;
    op.kind = kind_event_name(c.kind);
    op.dtype = datatype_name(c.datatype);
    op.elem_size = static_cast<int>(datatype_size(c.datatype));
    op.count = c.count;
    op.redop = reduces(c.kind) ? redop_name(c.redop) : "";
    op.root = root;
    op.peer = peer;
    op.rank = r;
    fake::log_event(contract, fake::op_line(op, where));
  }

  std::mutex mu_;
  std::deque<FakeComm> comms_;  // comm->handle - 1 indexes this; never shrinks (tiny)
  std::map<std::pair<std::string, std::vector<int>>, int> event_ids_;
  fake::PeerMirror mirror_;  // sends by communicator handle, for the receives that mirror them
};

}  // namespace

DistMode* make_fake_mode() { return new FakeMode(); }

}  // namespace fakegpu
