// Collective and point-to-point calls: validate, describe, queue (group.cc).
// An argument error fails only the call; the communicator stays usable.
#include <cstring>
#include <string>
#include <vector>

#include "core/comm.h"
#include "api/export.h"
#include "core/group.h"
#include "api/last_error.h"
#include "modes/mode.h"
#include "wire/staging.h"

using namespace fakegpu;

namespace {

// Rooted collectives and Send/Recv carry a rank (root or peer) in the OpDesc's root field.
bool has_root(uint8_t kind) { return proto::kind_info(kind).rooted || proto::kind_info(kind).p2p; }
bool reduces(uint8_t kind) { return proto::kind_info(kind).reduces; }

// Resolves `op` for `comm`/`dt` into the wire redop and the PreMulSum scalar.
ncclResult_t resolve_op(const char* fn, ncclComm* comm, ncclRedOp_t op, ncclDataType_t dt, CollCall* c) {
  int o = static_cast<int>(op);
  if (o >= 0 && o < ncclNumOps) {
    c->redop = static_cast<uint8_t>(o);
    return ncclSuccess;
  }
  std::lock_guard<std::mutex> lk(comm->mu);
  size_t idx = static_cast<size_t>(o) - ncclNumOps;
  if (o < 0 || idx >= comm->redops.size() || !comm->redops[idx].in_use)
    return failf(ncclInvalidArgument, "%s: op %d is neither a built-in ncclRedOp_t nor an operator created on this "
                 "communicator", fn, o);
  const PreMulSumOp& p = comm->redops[idx];
  if (p.datatype != dt)
    return failf(ncclInvalidArgument, "%s: op %d was created for %s but the call uses %s", fn, o,
                 datatype_name(p.datatype), datatype_name(dt));
  c->redop = 5;
  if (p.residence == ncclScalarDevice)
    c->scalar_ptr = p.pointer;
  else
    memcpy(c->scalar, p.value, sizeof(c->scalar));
  return ncclSuccess;
}

// Gives the call its place in the matching order (comm.h): the k-th collective call of every
// member belongs together, and the k-th Send from a rank to a peer with the peer's k-th Recv
// from that rank.
void assign_match_seq(CollCall* c) {
  ncclComm* comm = c->comm;
  if (c->kind == proto::kSend || c->kind == proto::kRecv) {
    std::lock_guard<std::mutex> lk(comm->mu);
    std::vector<uint32_t>& per_peer = c->kind == proto::kSend ? comm->send_seq : comm->recv_seq;
    if (per_peer.size() < static_cast<size_t>(comm->nranks)) per_peer.resize(comm->nranks, 0);
    c->match_seq = ++per_peer[c->root];
  } else {
    c->match_seq = comm->collective_seq.fetch_add(1, std::memory_order_relaxed) + 1;
  }
  c->call_seq = comm->call_seq.fetch_add(1, std::memory_order_relaxed) + 1;
}

// An argument error (the last error already says which): the call fails on this rank at once,
// and a placeholder still takes the call's place in the matching order, so that the other
// members' matching call fails with it instead of pairing with this rank's next call. Inside a
// group the placeholder travels at ncclGroupEnd; outside one it is posted now, unanswered.
// A Send/Recv naming no valid peer has nobody to keep in step with.
ncclResult_t reject(CollCall c, ncclResult_t rc) {
  const std::string msg = last_error();
  const bool p2p = c.kind == proto::kSend || c.kind == proto::kRecv;
  if (p2p && (c.root < 0 || c.root >= c.comm->nranks)) return rc;
  c.rejected = true;
  c.sendbuff = nullptr;
  c.recvbuff = nullptr;
  c.scalar_ptr = nullptr;
  c.in_place = 0;
  assign_match_seq(&c);
  if (in_group()) {
    (void)enqueue_call(c);  // travels with the group; its result there is this argument error
  } else {
    DistMode* mode;
    if (get_mode(&mode) == ncclSuccess) mode->post_rejected(c);
  }
  {
    std::lock_guard<std::mutex> lk(c.comm->mu);
    c.comm->last_error = msg;
  }
  return fail(rc, msg);
}

ncclResult_t submit(const char* fn, uint8_t kind, const void* sendbuff, void* recvbuff, size_t count,
                    ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  ncclResult_t rc = check_comm_usable(comm, fn);
  if (rc != ncclSuccess) return rc;
  const int n = comm->nranks, me = comm->rank;
  CollCall c;
  c.comm = comm;
  c.kind = kind;
  c.datatype = static_cast<uint8_t>(datatype);  // as passed: a placeholder reports what it was
  c.redop = reduces(kind) ? static_cast<uint8_t>(op) : 0;
  c.root = has_root(kind) ? root : -1;
  c.count = count;
  c.sendbuff = sendbuff;
  c.recvbuff = recvbuff;
  c.stream = stream;
  const size_t s = datatype_size(datatype);
  if (s == 0) return reject(c, failf(ncclInvalidArgument, "%s: invalid datatype %d", fn, (int)datatype));
  if (has_root(kind) && (root < 0 || root >= n))
    return reject(c, failf(ncclInvalidArgument, "%s: %s %d is outside [0, %d)", fn,
                           kind == proto::kSend || kind == proto::kRecv ? "peer" : "root", root, n));
  uint64_t m = block_factor(kind, n), bytes;
  if (__builtin_mul_overflow(static_cast<uint64_t>(count), s * m, &bytes) || bytes > (1ull << 60))
    return reject(c, failf(ncclInvalidArgument, "%s: count %zu of %s over %d ranks overflows", fn, count,
                           datatype_name(datatype), n));
  if (reduces(kind)) {
    rc = resolve_op(fn, comm, op, datatype, &c);
    if (rc != ncclSuccess) return reject(c, rc);
  }

  if (count > 0) {
    const bool root_me = has_root(kind) && root == me;
    // A buffer is needed where this rank has input (resp. output) bytes: the protocol's length table.
    const proto::KindInfo& k = proto::kind_info(kind);
    const bool need_send = k.in_blocks > 0 && (!k.in_root_only || root_me);
    const bool need_recv = k.out_blocks > 0 && (!k.out_root_only || root_me);
    if (need_send && !sendbuff) return reject(c, failf(ncclInvalidArgument, "%s: sendbuff is NULL", fn));
    if (need_recv && !recvbuff) return reject(c, failf(ncclInvalidArgument, "%s: recvbuff is NULL", fn));
    const uint8_t* sb = static_cast<const uint8_t*>(sendbuff);
    const uint8_t* rb = static_cast<const uint8_t*>(recvbuff);
    const uint64_t mine = static_cast<uint64_t>(me) * count * s;
    switch (kind) {
      case proto::kAllGather: case proto::kGather: c.in_place = rb && sb == rb + mine; break;
      case proto::kReduceScatter: case proto::kScatter: c.in_place = sb && rb == sb + mine; break;
      case proto::kSend: case proto::kRecv: break;
      default: c.in_place = sb == rb; break;
    }
  }
  assign_match_seq(&c);
  return enqueue_call(c);
}

constexpr ncclRedOp_t kNoOp = ncclSum;

}  // namespace

NCCL_API(ncclResult_t, ncclAllReduce, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
         ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return submit("ncclAllReduce", proto::kAllReduce, sendbuff, recvbuff, count, datatype, op, -1, comm, stream);
}

NCCL_API(ncclResult_t, ncclBroadcast, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
         int root, ncclComm_t comm, cudaStream_t stream) {
  return submit("ncclBroadcast", proto::kBroadcast, sendbuff, recvbuff, count, datatype, kNoOp, root, comm, stream);
}

NCCL_API(ncclResult_t, ncclBcast, void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
         cudaStream_t stream) {
  return submit("ncclBcast", proto::kBroadcast, buff, buff, count, datatype, kNoOp, root, comm, stream);
}

NCCL_API(ncclResult_t, ncclReduce, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
         ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  return submit("ncclReduce", proto::kReduce, sendbuff, recvbuff, count, datatype, op, root, comm, stream);
}

NCCL_API(ncclResult_t, ncclAllGather, const void* sendbuff, void* recvbuff, size_t sendcount,
         ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  return submit("ncclAllGather", proto::kAllGather, sendbuff, recvbuff, sendcount, datatype, kNoOp, -1, comm, stream);
}

NCCL_API(ncclResult_t, ncclReduceScatter, const void* sendbuff, void* recvbuff, size_t recvcount,
         ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return submit("ncclReduceScatter", proto::kReduceScatter, sendbuff, recvbuff, recvcount, datatype, op, -1, comm,
                stream);
}

NCCL_API(ncclResult_t, ncclAlltoAll, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
         ncclComm_t comm, cudaStream_t stream) {
  return submit("ncclAlltoAll", proto::kAlltoAll, sendbuff, recvbuff, count, datatype, kNoOp, -1, comm, stream);
}

NCCL_API(ncclResult_t, ncclGather, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
         int root, ncclComm_t comm, cudaStream_t stream) {
  return submit("ncclGather", proto::kGather, sendbuff, recvbuff, count, datatype, kNoOp, root, comm, stream);
}

NCCL_API(ncclResult_t, ncclScatter, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
         int root, ncclComm_t comm, cudaStream_t stream) {
  return submit("ncclScatter", proto::kScatter, sendbuff, recvbuff, count, datatype, kNoOp, root, comm, stream);
}

NCCL_API(ncclResult_t, ncclSend, const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
         ncclComm_t comm, cudaStream_t stream) {
  return submit("ncclSend", proto::kSend, sendbuff, nullptr, count, datatype, kNoOp, peer, comm, stream);
}

NCCL_API(ncclResult_t, ncclRecv, void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
         cudaStream_t stream) {
  return submit("ncclRecv", proto::kRecv, nullptr, recvbuff, count, datatype, kNoOp, peer, comm, stream);
}
