// FAKEGPU_DIST_MODE=simulate: the coordinator computes every result. Calls become steps,
// steps are packed into GROUP frames that fit the staging regions, and each frame is one
// request/response on the process's connection.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>

#include "wire/client.h"
#include "cuda/cuda_staging.h"
#include "api/last_error.h"
#include "local/local_collectives.h"
#include "modes/mode.h"
#include "wire/staging.h"

namespace fakegpu {
namespace {

constexpr uint64_t kAlign = 64;           // step placement alignment in the regions
constexpr size_t kMaxOpsPerFrame = 65536; // keeps descriptor bytes far below the frame limit

uint64_t align_up(uint64_t x) { return (x + kAlign - 1) & ~(kAlign - 1); }

bool is_connection_failure(ncclResult_t r) {
  return r == ncclSystemError || r == ncclInternalError || r == ncclRemoteError || r == ncclTimeout;
}

ncclResult_t result_from_wire(int32_t r) {
  return (r >= 0 && r < ncclNumResults) ? static_cast<ncclResult_t>(r) : ncclInternalError;
}

// One request to the coordinator and its answer, decoded into `answer`: an ERROR frame
// becomes the call's error (`what` names the call), any other answer than `answer_type` is
// a protocol error.
template <typename Answer>
ncclResult_t request(Client* client, uint16_t type, const std::vector<uint8_t>& body, uint16_t answer_type,
                     const char* what, Answer* answer) {
  Pending p;
  ncclResult_t rc = client->call(&p, type, body);
  if (rc != ncclSuccess) return rc;
  proto::Reader r(p.body.data(), p.body.size());
  if (p.hdr.type == proto::kError) {
    proto::Error e;
    if (!proto::decode(r, &e)) return fail(ncclSystemError, "fakegpu: malformed ERROR frame");
    return failf(result_from_wire(e.result), "fakegpu: %s: %s", what, e.message.c_str());
  }
  if (p.hdr.type != answer_type || !proto::decode(r, answer))
    return failf(ncclSystemError, "fakegpu: %s: unexpected %s answer", what, proto::type_name(p.hdr.type));
  return ncclSuccess;
}

// Reads a GROUP_DONE whose output bytes travel in the stream (socket staging) straight
// into the user's output buffers.
class GroupDoneSink : public BodySink {
 public:
  GroupDoneSink(const std::vector<CollCall>* calls, const Step* steps, size_t n, bool payload_in_stream,
                uint8_t* device_bounce = nullptr)
      : calls_(calls), steps_(steps), n_(n), payload_in_stream_(payload_in_stream), device_bounce_(device_bounce) {}
  bool wants(const proto::FrameHeader& h) const override { return h.type == proto::kGroupDone; }
  bool consume(Client& c, const proto::FrameHeader& h, std::string* err) override {
    // The head (n_ops, results, message) is the generated GroupDone codec's to read: decode
    // what has arrived, fetch exactly the bytes the decoder found missing, and again (four
    // rounds at most: count, results, message length, message). The output bytes follow.
    std::vector<uint8_t>& head = head_storage();
    head.clear();
    uint64_t left = h.body_len;
    for (;;) {
      proto::Reader r(head.data(), head.size());
      if (proto::decode(r, &done)) break;
      const uint64_t more = r.shortfall();
      if (more == 0 || more > left) return bad(err, "truncated head");
      const size_t have = head.size();
      head.resize(have + more);
      if (!c.read_exact(head.data() + have, more)) return bad(err, "truncated head");
      left -= more;
    }
    if (done.results.size() != n_)
      return bad(err, "GROUP_DONE answers " + std::to_string(done.results.size()) + " ops, the frame had " +
                          std::to_string(n_));
    const std::vector<int32_t>& results = done.results;
    for (size_t i = 0; i < n_ && payload_in_stream_; i++) {
      if (results[i] != 0 || steps_[i].out_len == 0) continue;
      if (steps_[i].out_len > left) return bad(err, "output bytes shorter than the ops' out_len");
      left -= steps_[i].out_len;
      bool ok = true;
      const CollCall& call = (*calls_)[steps_[i].call];
      if (call.recv_on_device) {  // the host must not write device memory: bounce, copied later
        ok = c.read_exact(device_bounce_ + steps_[i].out_offset, steps_[i].out_len);
      } else {
        for_each_output_piece(call, steps_[i].off, steps_[i].cnt,
                              [&](uint8_t* p, uint64_t len) { ok = ok && c.read_exact(p, len); });
      }
      if (!ok) return bad(err, "connection broke in the output bytes");
    }
    if (left != 0) return bad(err, std::to_string(left) + " unexpected trailing bytes");
    return true;
  }
  // Per-thread storage reused across calls: no allocation per call in steady state.
  proto::GroupDone& done = done_storage();

 private:
  static proto::GroupDone& done_storage() {
    thread_local proto::GroupDone d;
    return d;
  }
  static std::vector<uint8_t>& head_storage() {
    thread_local std::vector<uint8_t> v;
    return v;
  }
  static bool bad(std::string* err, const std::string& why) {
    *err = "GROUP_DONE: " + why;
    return false;
  }
  const std::vector<CollCall>* calls_;
  const Step* steps_;
  size_t n_;
  bool payload_in_stream_;
  uint8_t* device_bounce_;  // socket staging of device outputs: indexed by the step's out_offset
};

class SimulateMode : public DistMode {
 public:
  const char* name() const override { return "simulate"; }

  ncclResult_t comm_start(CommRequest* req) override {
    Client* client;
    ncclResult_t rc = Client::get(&client);
    if (rc != ncclSuccess) return rc;
    local::flush(client);
    std::vector<uint8_t> body;
    proto::Writer w(&body);
    uint16_t type;
    if (req->kind == CommRequest::kInit) {
      proto::CommInit m;
      memcpy(m.unique_id, req->unique_id, sizeof(m.unique_id));
      m.nranks = req->nranks;
      m.rank = req->rank;
      m.name = req->comm->config.name;
      proto::encode(w, m);
      type = proto::kCommInit;
    } else if (req->kind == CommRequest::kShrink) {
      proto::CommShrink m;
      m.parent_handle = req->parent->handle;
      m.flags = req->shrink_flags;
      m.excluded = req->excluded;
      m.name = req->comm->config.name;
      proto::encode(w, m);
      type = proto::kCommShrink;
    } else {
      proto::CommSplit m;
      m.parent_handle = req->parent->handle;
      m.color = req->color;
      m.key = req->key;
      m.name = req->comm->config.name;
      proto::encode(w, m);
      type = proto::kCommSplit;
    }
    auto* p = new Pending();
    iovec iov{body.data(), body.size()};
    rc = client->request(p, type, &iov, 1);
    if (rc != ncclSuccess) {
      delete p;  // never registered: nothing to wait for
      return rc;
    }
    req->state = p;
    return ncclSuccess;
  }

  ncclResult_t comm_finish(CommRequest* req) override {
    std::unique_ptr<Pending> p(static_cast<Pending*>(req->state));
    req->state = nullptr;
    if (!p) return fail(ncclInternalError, "fakegpu: communicator request was never started");
    Client* client;
    ncclResult_t rc = Client::get(&client);
    if (rc != ncclSuccess) return rc;
    rc = client->wait(p.get());
    if (rc != ncclSuccess) return rc;
    const char* what = req->kind == CommRequest::kInit     ? "ncclCommInitRank"
                       : req->kind == CommRequest::kShrink ? "ncclCommShrink"
                                                           : "ncclCommSplit";
    proto::Reader r(p->body.data(), p->body.size());
    if (p->hdr.type == proto::kError) {
      proto::Error e;
      if (!proto::decode(r, &e)) return failf(ncclSystemError, "fakegpu: %s: malformed ERROR frame", what);
      return failf(result_from_wire(e.result), "fakegpu: %s: %s", what, e.message.c_str());
    }
    proto::CommInfo info;
    if (p->hdr.type != proto::kCommInfo || !proto::decode(r, &info))
      return failf(ncclSystemError, "fakegpu: %s: unexpected %s answer", what, proto::type_name(p->hdr.type));
    const int nranks = static_cast<int>(info.global_ranks.size());  // COMM_INFO's nranks on the wire
    if (req->kind == CommRequest::kSplit && (info.comm_handle == 0 || nranks == 0)) {
      req->no_color_result = true;
      return ncclSuccess;
    }
    if (nranks <= 0 || info.rank < 0 || info.rank >= nranks ||
        (req->kind == CommRequest::kInit && (info.rank != req->rank || nranks != req->nranks)))
      return failf(ncclSystemError, "fakegpu: %s: inconsistent COMM_INFO (rank %d of %d)", what, info.rank, nranks);
    ncclComm* c = req->comm;
    c->handle = info.comm_handle;
    c->rank = info.rank;
    c->nranks = nranks;
    c->global_ranks.assign(info.global_ranks.begin(), info.global_ranks.end());
    return ncclSuccess;
  }

  ncclResult_t comm_free(ncclComm* comm, proto::FreeHow how) override {
    Client* client;
    ncclResult_t rc = Client::get(&client);
    if (rc != ncclSuccess) return rc;
    local::release(client, comm);
    local::flush(client);
    std::vector<uint8_t> body;
    proto::Writer w(&body);
    proto::encode(w, proto::CommFree{comm->handle, how});
    Pending p;
    rc = client->call(&p, proto::kCommFree, body);
    if (rc != ncclSuccess) return rc;
    if (p.hdr.type == proto::kError) {
      proto::Reader r(p.body.data(), p.body.size());
      proto::Error e;
      if (!proto::decode(r, &e)) return fail(ncclSystemError, "fakegpu: malformed ERROR frame");
      return failf(result_from_wire(e.result), "fakegpu: freeing communicator: %s", e.message.c_str());
    }
    return ncclSuccess;
  }

  ncclResult_t run_group(const std::vector<CollCall>& user_calls) override {
    if (user_calls.empty()) return ncclSuccess;
    Client* client;
    ncclResult_t rc = Client::get(&client);
    if (rc != ncclSuccess) return rc;
    const uint64_t S = client->staging_bytes();
    // Device buffers (hybrid mode): the calls are classified and their device scalars read.
    thread_local std::vector<CollCall> staged;
    bool device = false;
    rc = cuda_staging::prepare_group(user_calls, &staged, &device);
    if (rc != ncclSuccess) return rc;
    const std::vector<CollCall>& calls = device ? staged : user_calls;
    // A call alone in its group may run among the ranks in its communicator's arena.
    // (A rejected placeholder must reach the coordinator, which fails the call on every member.)
    if (calls.size() == 1 && !calls[0].rejected && local::try_run(client, calls[0], &rc)) return rc;
    local::flush(client);
    if (device && client->shm()) cuda_staging::pin_staging(client->shm_in(), 2 * S);

    thread_local std::vector<Step> steps;
    rc = plan_steps(calls, S, &steps);
    if (rc != ncclSuccess) return rc;

    // Does the whole group fit in one frame? If not, Send steps go first so that the
    // coordinator can park their payloads and no peer's Recv waits on a later frame of ours.
    uint64_t in_total = 0, out_total = 0;
    for (const Step& st : steps) {
      in_total += align_up(st.in_len);
      out_total += align_up(st.out_len);
    }
    bool split = in_total > S || out_total > S || steps.size() > kMaxOpsPerFrame;
    // The frames of a split group share an id, so that the coordinator can fail the group when
    // a Send it parked from an early frame fails after that frame was answered.
    const uint32_t group_id = split ? next_group_id() : 0;
    if (split)
      std::stable_partition(steps.begin(), steps.end(),
                            [&](const Step& st) { return calls[st.call].kind == proto::kSend; });

    ncclResult_t first_error = ncclSuccess;
    std::string first_msg;
    size_t i = 0;
    while (i < steps.size()) {
      size_t begin = i;
      uint64_t in_used = 0, out_used = 0;
      for (; i < steps.size() && i - begin < kMaxOpsPerFrame; i++) {
        Step& st = steps[i];
        uint64_t in_at = st.in_len ? align_up(in_used) : 0, out_at = st.out_len ? align_up(out_used) : 0;
        if (i > begin && (in_at + st.in_len > S || out_at + st.out_len > S)) break;
        st.in_offset = in_at;
        st.out_offset = out_at;
        if (st.in_len) in_used = in_at + st.in_len;
        if (st.out_len) out_used = out_at + st.out_len;
      }
      bool partial = i < steps.size();
      // The frame's window of the regions: other threads of this process may have frames
      // in flight (one thread per rank), each in its own window.
      Client::Window win;
      if (!client->reserve_staging(in_used, out_used, &win))
        return fail(ncclInvalidUsage,
                    "fakegpu: the staging regions stayed occupied by other threads' calls for too long; when one "
                    "process drives several ranks with large messages, issue their calls from one thread between "
                    "ncclGroupStart/ncclGroupEnd (or raise FAKEGPU_STAGING_CHUNK_BYTES)");
      for (size_t k = begin; k < i; k++) {
        if (steps[k].in_len) steps[k].in_offset += win.in_base;
        if (steps[k].out_len) steps[k].out_offset += win.out_base;
      }
      ncclResult_t frc =
          run_frame(client, calls, &steps[begin], i - begin, partial, group_id, &first_error, &first_msg);
      client->release_staging(win);
      if (frc != ncclSuccess) {  // the connection is gone: nothing further can run
        mark_async(calls, frc);
        return frc;
      }
    }
    if (first_error != ncclSuccess) return fail(first_error, first_msg);
    return ncclSuccess;
  }

  ncclResult_t simulate_group(const std::vector<CollCall>& all_calls, double* estimated_us) override {
    Client* client;
    ncclResult_t rc = Client::get(&client);
    if (rc != ncclSuccess) return rc;
    std::vector<CollCall> valid;  // nothing is matched: rejected calls are simply not modeled
    const std::vector<CollCall>& user_calls = without_rejected(all_calls, &valid);
    if (user_calls.empty()) return ncclSuccess;
    std::vector<CollCall> staged;  // device scalars are read from device memory
    bool device = false;
    rc = cuda_staging::prepare_group(user_calls, &staged, &device);
    if (rc != ncclSuccess) return rc;
    const std::vector<CollCall>& calls = device ? staged : user_calls;
    local::flush(client);
    std::vector<uint8_t> body(proto::kGroupHeadBytes + calls.size() * proto::kOpDescSize);
    proto::encode_into(body.data(), proto::GroupHead{static_cast<uint32_t>(calls.size()), 0});
    for (size_t k = 0; k < calls.size(); k++) {
      Step st;
      st.cnt = calls[k].count;
      st.flags = proto::kOpFirstStep | proto::kOpLastStep;
      step_lengths(calls[k], st.cnt, &st.in_len, &st.out_len);
      encode_step_desc(calls[k], st, body.data() + proto::kGroupHeadBytes + k * proto::kOpDescSize);
    }
    proto::SimulateDone d;
    rc = request(client, proto::kSimulate, body, proto::kSimulateDone, "ncclGroupSimulateEnd", &d);
    if (rc != ncclSuccess) return rc;
    *estimated_us = d.estimated_time_us;
    return ncclSuccess;
  }

  void post_rejected(const CollCall& c) override {
    Client* client;
    if (Client::get(&client) != ncclSuccess) return;  // no coordinator: nobody to keep in step
    local::flush(client);  // records of earlier host-local calls go first
    uint8_t body[proto::kGroupHeadBytes + proto::kOpDescSize];
    proto::encode_into(body, proto::GroupHead{1, proto::kGroupUnanswered});
    Step st;
    st.flags = proto::kOpFirstStep | proto::kOpLastStep | proto::kOpRejected;
    encode_step_desc(c, st, body + proto::kGroupHeadBytes);
    iovec iov{body, sizeof(body)};
    client->post(proto::kGroup, &iov, 1);  // a lost connection shows on the next request
  }

  // ACCOUNT: one frame with every call of the group as a single step, nothing staged (lengths
  // and offsets 0, no scalar: a device scalar must not be read here and is not compared).
  ncclResult_t account_group(const std::vector<CollCall>& calls) override {
    if (calls.empty()) return ncclSuccess;
    Client* client;
    ncclResult_t rc = Client::get(&client);
    if (rc != ncclSuccess) return rc;
    local::flush(client);
    std::vector<uint8_t> body(proto::kGroupHeadBytes + calls.size() * proto::kOpDescSize);
    proto::encode_into(body.data(), proto::GroupHead{static_cast<uint32_t>(calls.size()), 0});
    for (size_t k = 0; k < calls.size(); k++) {
      const CollCall& c = calls[k];
      proto::OpDesc d;
      d.comm_handle = c.comm->handle;
      d.kind = c.kind;
      d.datatype = c.datatype;
      d.redop = c.redop;
      d.flags = static_cast<uint8_t>(proto::kOpFirstStep | proto::kOpLastStep | (c.in_place ? proto::kOpInPlace : 0) |
                                     (c.rejected ? proto::kOpRejected : 0));
      d.root = c.root;
      d.total_count = c.count;
      d.step_count = c.rejected ? 0 : c.count;
      d.call_seq = c.call_seq;
      d.match_seq = c.match_seq;
      proto::encode_opdesc(body.data() + proto::kGroupHeadBytes + k * proto::kOpDescSize, d);
    }
    Pending p;
    rc = client->call(&p, proto::kAccount, body);
    if (rc != ncclSuccess) {
      mark_async(calls, rc);
      return rc;
    }
    proto::Reader r(p.body.data(), p.body.size());
    if (p.hdr.type == proto::kError) {
      proto::Error e;
      if (!proto::decode(r, &e)) return fail(ncclSystemError, "fakegpu: malformed ERROR frame");
      return failf(result_from_wire(e.result), "fakegpu: accounting a group on the coordinator: %s",
                   e.message.c_str());
    }
    proto::GroupDone d;
    if (p.hdr.type != proto::kGroupDone || !proto::decode(r, &d) || d.results.size() != calls.size())
      return failf(ncclSystemError, "fakegpu: unexpected %s answer to ACCOUNT", proto::type_name(p.hdr.type));
    ncclResult_t first_error = ncclSuccess;
    std::string first_msg;
    for (size_t k = 0; k < calls.size(); k++) {
      ncclResult_t res = result_from_wire(d.results[k]);
      if (res == ncclSuccess) continue;
      Step st;
      st.call = k;
      note_failure(calls, st, res, d.message, &first_error, &first_msg);
    }
    if (first_error != ncclSuccess) return fail(first_error, first_msg);
    return ncclSuccess;
  }

 private:
  // 1..65535, then again from 1: ids are reused only long after their group ended.
  static uint32_t next_group_id() {
    static std::atomic<uint32_t> counter{0};
    return counter.fetch_add(1, std::memory_order_relaxed) % 0xFFFFu + 1;
  }

  static void mark_async(const std::vector<CollCall>& calls, ncclResult_t r) {
    for (const CollCall& c : calls) c.comm->async_error.store(r);
  }

  // Sends one GROUP frame of steps[0..n) and applies its GROUP_DONE. Returns non-success
  // only when the connection failed; per-op failures land in *first_error.
  ncclResult_t run_frame(Client* client, const std::vector<CollCall>& calls, Step* steps, size_t n, bool partial,
                         uint32_t group_id, ncclResult_t* first_error, std::string* first_msg) {
    thread_local std::vector<uint8_t> head;
    thread_local std::vector<iovec> iov;
    head.resize(proto::kGroupHeadBytes + n * proto::kOpDescSize);
    proto::encode_into(head.data(), proto::GroupHead{static_cast<uint32_t>(n), (partial ? proto::kGroupPartial : 0) |
                                                                              (group_id << proto::kGroupIdShift)});
    for (size_t k = 0; k < n; k++)
      encode_step_desc(calls[steps[k].call], steps[k], head.data() + proto::kGroupHeadBytes + k * proto::kOpDescSize);
    iov.clear();
    iov.push_back({head.data(), head.size()});

    const bool shm = client->shm();
    // Device pieces are copied on their call's stream; only those streams are waited for.
    cuda_staging::DeviceCopies dev;
    // Socket staging of device buffers goes through host bounce buffers, laid out like
    // the regions (by in_offset/out_offset) so that no pointer moves while they fill.
    thread_local std::vector<uint8_t> in_bounce, out_bounce;
    if (shm) {
      uint8_t* in = client->shm_in();
      for (size_t k = 0; k < n; k++) {
        const CollCall& c = calls[steps[k].call];
        uint8_t* dst = in + steps[k].in_offset;
        for_each_input_piece(c, steps[k].off, steps[k].cnt, [&](const uint8_t* p, uint64_t len) {
          if (c.send_on_device) dev.to_host(dst, p, len, c.stream);
          else memcpy(dst, p, len);
          dst += len;
        });
      }
    } else {
      uint64_t in_need = 0, out_need = 0;
      for (size_t k = 0; k < n; k++) {
        const CollCall& c = calls[steps[k].call];
        if (c.send_on_device) in_need = std::max(in_need, steps[k].in_offset + steps[k].in_len);
        if (c.recv_on_device) out_need = std::max(out_need, steps[k].out_offset + steps[k].out_len);
      }
      if (in_bounce.size() < in_need) in_bounce.resize(in_need);
      if (out_bounce.size() < out_need) out_bounce.resize(out_need);
      for (size_t k = 0; k < n; k++) {
        const CollCall& c = calls[steps[k].call];
        uint8_t* dst = in_bounce.data() + steps[k].in_offset;
        for_each_input_piece(c, steps[k].off, steps[k].cnt, [&](const uint8_t* p, uint64_t len) {
          if (c.send_on_device) {
            dev.to_host(dst, p, len, c.stream);
            iov.push_back({dst, len});
            dst += len;
          } else {
            iov.push_back({const_cast<uint8_t*>(p), len});
          }
        });
      }
    }
    if (dev.any()) {
      ncclResult_t crc = dev.sync();
      if (crc != ncclSuccess) {
        if (*first_error == ncclSuccess) {
          *first_error = crc;
          *first_msg = last_error();
        }
        return crc;
      }
    }

    GroupDoneSink sink(&calls, steps, n, !shm, out_bounce.data());
    Pending p;
    p.sink = &sink;
    ncclResult_t rc = client->request(&p, proto::kGroup, iov.data(), static_cast<int>(iov.size()));
    if (rc == ncclSuccess) rc = client->wait(&p);
    if (rc != ncclSuccess) {
      if (*first_error == ncclSuccess) {
        *first_error = rc;
        *first_msg = last_error();
      }
      return rc;
    }
    if (p.hdr.type == proto::kError) {
      proto::Reader r(p.body.data(), p.body.size());
      proto::Error e;
      if (!proto::decode(r, &e)) {
        e.result = ncclSystemError;
        e.message = "malformed ERROR frame";
      }
      note_failure(calls, steps[0], result_from_wire(e.result), e.message, first_error, first_msg);
      return ncclSuccess;
    }
    if (p.hdr.type != proto::kGroupDone)
      return fail(ncclSystemError, std::string("fakegpu: unexpected ") + proto::type_name(p.hdr.type) + " answer to GROUP");
    for (size_t k = 0; k < n; k++) {
      ncclResult_t r = result_from_wire(sink.done.results[k]);
      if (r != ncclSuccess) {
        note_failure(calls, steps[k], r, sink.done.message, first_error, first_msg);
        continue;
      }
      const CollCall& c = calls[steps[k].call];
      if ((shm || c.recv_on_device) && steps[k].out_len) {
        const uint8_t* src = (shm ? client->shm_out() : out_bounce.data()) + steps[k].out_offset;
        for_each_output_piece(c, steps[k].off, steps[k].cnt, [&](uint8_t* q, uint64_t len) {
          if (c.recv_on_device) dev.to_device(q, src, len, c.stream);
          else memcpy(q, src, len);
          src += len;
        });
      }
    }
    // The results must have left the staging memory before it is reused; work queued on
    // the stream afterwards is ordered after these copies anyway.
    if (dev.any()) {
      ncclResult_t crc = dev.sync();
      if (crc != ncclSuccess) {
        if (*first_error == ncclSuccess) {
          *first_error = crc;
          *first_msg = last_error();
        }
        for (size_t k = 0; k < n; k++) calls[steps[k].call].comm->async_error.store(crc);
      }
    }
    return ncclSuccess;
  }

  static void note_failure(const std::vector<CollCall>& calls, const Step& st, ncclResult_t r, const std::string& msg,
                           ncclResult_t* first_error, std::string* first_msg) {
    const CollCall& c = calls[st.call];
    std::string text = "fakegpu: " + std::string(proto::kind_name(c.kind)) + " (call " + std::to_string(c.call_seq) +
                       " on rank " + std::to_string(c.comm->rank) + " of " + std::to_string(c.comm->nranks) +
                       ") failed with " + result_name(r) + ": " + msg;
    {
      std::lock_guard<std::mutex> lk(c.comm->mu);
      c.comm->last_error = text;
    }
    // Lost peers and timeouts leave the communicator unusable, as in NCCL; watchdogs
    // polling ncclCommGetAsyncError see them. Disagreements fail only the call.
    if (is_connection_failure(r)) c.comm->async_error.store(r);
    if (*first_error == ncclSuccess) {
      *first_error = r;
      *first_msg = text;
    }
  }

  ncclResult_t probe_source(ncclComm* comm, uint32_t timeout_ms, int* peer) override {
    Client* client;
    ncclResult_t rc = Client::get(&client);
    if (rc != ncclSuccess) return rc;
    std::vector<uint8_t> body;
    proto::Writer w(&body);
    proto::ProbeSource probe;
    probe.comm_handle = comm->handle;
    probe.timeout_ms = timeout_ms;
    {
      // Recvs still in flight (another thread's group) count: the coordinator names a Send
      // that the caller's *next* Recv from its sender pairs with.
      std::lock_guard<std::mutex> lk(comm->mu);
      probe.recvs_posted = comm->recv_seq;
    }
    probe.recvs_posted.resize(comm->nranks, 0);
    proto::encode(w, probe);
    // The coordinator answers within min(timeout_ms, its own timeout): the client's default
    // wait (the coordinator's timeout plus a margin) covers both.
    proto::Source src;
    rc = request(client, proto::kProbeSource, body, proto::kSource, "fakegpu_probe_source", &src);
    if (rc != ncclSuccess) return rc;
    if (src.peer < 0 || src.peer >= comm->nranks || src.peer == comm->rank)
      return failf(ncclInternalError, "fakegpu: fakegpu_probe_source: the coordinator named rank %d, not a peer of "
                   "rank %d of this %d-rank communicator", src.peer, comm->rank, comm->nranks);
    *peer = src.peer;
    return ncclSuccess;
  }
};

}  // namespace

DistMode* make_simulate_mode() { return new SimulateMode(); }

}  // namespace fakegpu
