// Encoding and decoding of the fakegpu wire protocol (docs/protocol.md is the
// contract; tests/vectors/protocol_vectors.json pins the bytes). Pure functions on byte buffers:
// no I/O here, so the encoder/decoder is testable on its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "generated/wire_spec.h"

namespace fakegpu::proto {

constexpr uint8_t kMagic[4] = {'F', 'G', 'P', 'U'};
constexpr size_t kUniqueIdBytes = 128;

// Message types, kinds, flag bits, OpDesc offsets, datatypes: generated from spec/wire.py.
const char* type_name(uint16_t type);  // nullptr for a type the protocol does not have
bool known_type(uint16_t type);
const char* kind_name(uint8_t kind);   // "?" for a code that is no kind

struct FrameHeader {
  uint16_t version = kVersion;
  uint16_t type = 0;
  uint32_t request_id = 0;
  uint32_t body_len = 0;
};

// ---- little-endian writer / bounds-checked reader --------------------------------------

class Writer {
 public:
  explicit Writer(std::vector<uint8_t>* buf) : buf_(buf) {}
  void u8(uint8_t v) { buf_->push_back(v); }
  void u16(uint16_t v) { raw(&v, 2); }
  void u32(uint32_t v) { raw(&v, 4); }
  void i32(int32_t v) { raw(&v, 4); }
  void u64(uint64_t v) { raw(&v, 8); }
  void f64(double v) { raw(&v, 8); }
  void str(const std::string& s);  // u16 length + bytes (truncated at 65535)
  void raw(const void* p, size_t n) {
    const uint8_t* b = static_cast<const uint8_t*>(p);
    buf_->insert(buf_->end(), b, b + n);
  }
  size_t size() const { return buf_->size(); }

 private:
  std::vector<uint8_t>* buf_;
};

class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  bool u8(uint8_t* v) { return raw(v, 1); }
  bool u16(uint16_t* v) { return raw(v, 2); }
  bool u32(uint32_t* v) { return raw(v, 4); }
  bool i32(int32_t* v) { return raw(v, 4); }
  bool u64(uint64_t* v) { return raw(v, 8); }
  bool f64(double* v) { return raw(v, 8); }
  bool str(std::string* s);
  bool raw(void* dst, size_t n) {
    if (n > n_ - pos_) return false;
    memcpy(dst, p_ + pos_, n);
    pos_ += n;
    return true;
  }
  size_t pos() const { return pos_; }
  size_t remaining() const { return n_ - pos_; }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
};

// ---- frame header ------------------------------------------------------------------------

void encode_header(uint8_t out[kHeaderSize], uint16_t type, uint32_t request_id, uint32_t body_len);
// False (with a reason) on a wrong magic, version, unknown type or body_len above max_body.
bool decode_header(const uint8_t in[kHeaderSize], uint64_t max_body, FrameHeader* h, std::string* why);

// A whole frame (header + body) as bytes.
std::vector<uint8_t> frame(uint16_t type, uint32_t request_id, const std::vector<uint8_t>& body);

// ---- messages ----------------------------------------------------------------------------

struct Hello {
  uint32_t flags = 0;
  int32_t global_rank = -1, local_rank = -1, world_size = -1;
  uint32_t pid = 0;
  uint64_t staging_bytes = 0;
  std::string token, shm_name, hostname;
};
struct HelloOk {
  uint32_t client_id = 0, flags = 0;
  uint64_t staging_bytes = 0;
  uint32_t timeout_ms = 0;
};
struct Error {
  int32_t result = 0;
  std::string message;
};
struct CommInit {
  uint8_t unique_id[kUniqueIdBytes] = {};
  int32_t nranks = 0, rank = 0;
  std::string name;
};
struct CommInfo {
  uint64_t comm_handle = 0;
  int32_t rank = 0, nranks = 0;
  std::vector<int32_t> global_ranks;
};
struct CommSplit {
  uint64_t parent_handle = 0;
  int32_t color = 0, key = 0;
  std::string name;
};
struct CommShrink {  // ncclCommShrink: the parent's members minus `excluded` (ranks in the parent)
  uint64_t parent_handle = 0;
  uint32_t flags = 0;
  std::vector<int32_t> excluded;
  std::string name;
};
struct CommFree {
  uint64_t comm_handle = 0;
  uint32_t how = 0;
};
struct OpDesc {
  uint64_t comm_handle = 0;
  uint8_t kind = 0, datatype = 0, redop = 0, flags = 0;
  int32_t root = -1;
  uint64_t total_count = 0, step_count = 0;
  uint64_t in_offset = 0, in_len = 0, out_offset = 0, out_len = 0;
  uint8_t scalar[8] = {};
  uint32_t call_seq = 0;    // this rank's count of calls on the communicator (diagnostics, faults)
  uint32_t match_seq = 1;   // the call's place in the matching order (docs/protocol.md "Matching")
  uint32_t step_index = 0, step_total = 1;  // this step's place in its call
};
// GROUP / SIMULATE / ACCOUNT body up to (and including) the descriptors; payload is separate.
struct GroupHead {
  uint32_t n_ops = 0, flags = 0;
};
// GROUP_DONE body up to the message; output bytes follow separately.
struct GroupDone {
  std::vector<int32_t> results;
  std::string message;
};
struct SimulateDone {
  double estimated_time_us = 0;
};
// PING: an empty body, or the token (docs/protocol.md: needed before HELLO when the coordinator has one).
struct Ping {
  std::string token;
};
struct Pong {
  std::string description;
};
struct Shutdown {
  std::string token;
};
// ARENA: the shared-memory arena of the communicator this member handle belongs to.
struct ArenaRequest {
  uint64_t comm_handle = 0;
};
// PROBE_SOURCE: which rank has a Send to the caller waiting in this communicator (docs/protocol.md,
// "Receive from any source"); timeout_ms 0 means the coordinator's own timeout.
struct ProbeSource {
  uint64_t comm_handle = 0;
  uint32_t timeout_ms = 0;
  // The caller's Recv calls from each rank so far (comm->recv_seq), nranks entries on the wire.
  std::vector<uint32_t> recvs_posted;
};
// SOURCE: the answer to PROBE_SOURCE, a rank of the caller's communicator.
struct Source {
  int32_t peer = -1;
};
// ARENA_INFO: granted 1 with the file's path and geometry, or 0 with the reason in `reason`.
struct ArenaInfo {
  uint32_t granted = 0, rank = 0;
  uint64_t slot_bytes = 0, total_bytes = 0;
  std::string path, reason;
};
// One call run in an arena, as comm rank 0 saw it. arrival_wait_s is in comm rank order.
struct LocalOpRecord {
  OpDesc desc;
  double started_at = 0, rendezvous_s = 0, execution_s = 0;
  std::vector<double> arrival_wait_s;
};
// LOCAL_OPS body: every record carries exactly `nranks` arrival waits.
struct LocalOps {
  uint64_t comm_handle = 0;
  uint32_t nranks = 0;
  std::vector<LocalOpRecord> records;
};

void encode(Writer& w, const Hello& m);
void encode(Writer& w, const HelloOk& m);
void encode(Writer& w, const Error& m);
void encode(Writer& w, const CommInit& m);
void encode(Writer& w, const CommInfo& m);
void encode(Writer& w, const CommSplit& m);
void encode(Writer& w, const CommFree& m);
void encode(Writer& w, const CommShrink& m);
void encode(Writer& w, const GroupHead& m);
void encode(Writer& w, const GroupDone& m);
void encode(Writer& w, const SimulateDone& m);
void encode(Writer& w, const Ping& m);  // writes nothing for an empty token
void encode(Writer& w, const Pong& m);
void encode(Writer& w, const Shutdown& m);
void encode(Writer& w, const ArenaRequest& m);
void encode(Writer& w, const ArenaInfo& m);
void encode(Writer& w, const ProbeSource& m);
void encode(Writer& w, const Source& m);
// Writes nranks waits per record (missing ones as 0, extra ones dropped) so the body is always well formed.
void encode(Writer& w, const LocalOps& m);
// Writes the 8-byte prefix of a GROUP / SIMULATE / ACCOUNT body (u32 n_ops, u32 flags) at `out`.
void encode_group_head(uint8_t* out, uint32_t n_ops, uint32_t flags);
// Writes exactly kOpDescSize bytes at `out` (hot path: no vector growth).
void encode_opdesc(uint8_t* out, const OpDesc& d);

bool decode(Reader& r, Hello* m);
bool decode(Reader& r, HelloOk* m);
bool decode(Reader& r, Error* m);
bool decode(Reader& r, CommInit* m);
bool decode(Reader& r, CommInfo* m);
bool decode(Reader& r, CommSplit* m);
bool decode(Reader& r, CommFree* m);
bool decode(Reader& r, CommShrink* m);
bool decode(Reader& r, GroupHead* m);
bool decode(Reader& r, GroupDone* m);  // reads n_ops, results, message
bool decode(Reader& r, SimulateDone* m);
bool decode(Reader& r, Ping* m);
bool decode(Reader& r, Pong* m);
bool decode(Reader& r, Shutdown* m);
bool decode(Reader& r, ArenaRequest* m);
bool decode(Reader& r, ArenaInfo* m);
bool decode(Reader& r, ProbeSource* m);
bool decode(Reader& r, Source* m);
bool decode(Reader& r, LocalOps* m);  // false when the declared counts exceed the body
bool decode_opdesc(Reader& r, OpDesc* d);

}  // namespace fakegpu::proto
