#include "wire/protocol.h"

namespace fakegpu::proto {

const char* type_name(uint16_t type) {
  const MessageInfo* m = message_info(type);
  return m ? m->name : nullptr;
}

bool known_type(uint16_t type) { return message_info(type) != nullptr; }

const char* kind_name(uint8_t kind) { return kind >= 1 && kind < kNumKinds ? kKindInfo[kind].name : "?"; }

void Writer::str(const std::string& s) {
  size_t n = s.size() > 65535 ? 65535 : s.size();
  u16(static_cast<uint16_t>(n));
  raw(s.data(), n);
}

bool Reader::str(std::string* s) {
  uint16_t n;
  if (!u16(&n) || n > remaining()) return false;
  s->assign(reinterpret_cast<const char*>(p_ + pos_), n);
  pos_ += n;
  return true;
}

void encode_header(uint8_t out[kHeaderSize], uint16_t type, uint32_t request_id, uint32_t body_len) {
  memcpy(out, kMagic, 4);
  uint16_t v = kVersion;
  memcpy(out + 4, &v, 2);
  memcpy(out + 6, &type, 2);
  memcpy(out + 8, &request_id, 4);
  memcpy(out + 12, &body_len, 4);
}

bool decode_header(const uint8_t in[kHeaderSize], uint64_t max_body, FrameHeader* h, std::string* why) {
  if (memcmp(in, kMagic, 4) != 0) {
    if (why) *why = "bad frame magic (not a fakegpu coordinator?)";
    return false;
  }
  memcpy(&h->version, in + 4, 2);
  memcpy(&h->type, in + 6, 2);
  memcpy(&h->request_id, in + 8, 4);
  memcpy(&h->body_len, in + 12, 4);
  if (h->version != kVersion) {
    if (why) *why = "coordinator speaks protocol version " + std::to_string(h->version) + ", this shim speaks " +
                    std::to_string(kVersion);
    return false;
  }
  if (!known_type(h->type)) {
    if (why) *why = "unknown message type " + std::to_string(h->type);
    return false;
  }
  if (h->body_len > max_body) {
    if (why) *why = "frame body of " + std::to_string(h->body_len) + " bytes exceeds the limit of " +
                    std::to_string(max_body);
    return false;
  }
  return true;
}

std::vector<uint8_t> frame(uint16_t type, uint32_t request_id, const std::vector<uint8_t>& body) {
  std::vector<uint8_t> out(kHeaderSize + body.size());
  encode_header(out.data(), type, request_id, static_cast<uint32_t>(body.size()));
  if (!body.empty()) memcpy(out.data() + kHeaderSize, body.data(), body.size());
  return out;
}

// ---- encoders ----------------------------------------------------------------------------

void encode(Writer& w, const Hello& m) {
  w.u32(m.flags);
  w.i32(m.global_rank);
  w.i32(m.local_rank);
  w.i32(m.world_size);
  w.u32(m.pid);
  w.u64(m.staging_bytes);
  w.str(m.token);
  w.str(m.shm_name);
  w.str(m.hostname);
}
void encode(Writer& w, const HelloOk& m) {
  w.u32(m.client_id);
  w.u32(m.flags);
  w.u64(m.staging_bytes);
  w.u32(m.timeout_ms);
}
void encode(Writer& w, const Error& m) {
  w.i32(m.result);
  w.str(m.message);
}
void encode(Writer& w, const CommInit& m) {
  w.raw(m.unique_id, kUniqueIdBytes);
  w.i32(m.nranks);
  w.i32(m.rank);
  w.str(m.name);
}
void encode(Writer& w, const CommInfo& m) {
  w.u64(m.comm_handle);
  w.i32(m.rank);
  w.i32(m.nranks);
  for (int32_t g : m.global_ranks) w.i32(g);
}
void encode(Writer& w, const CommSplit& m) {
  w.u64(m.parent_handle);
  w.i32(m.color);
  w.i32(m.key);
  w.str(m.name);
}
void encode(Writer& w, const CommShrink& m) {
  w.u64(m.parent_handle);
  w.u32(m.flags);
  w.u32(static_cast<uint32_t>(m.excluded.size()));
  for (int32_t r : m.excluded) w.i32(r);
  w.str(m.name);
}
void encode(Writer& w, const CommFree& m) {
  w.u64(m.comm_handle);
  w.u32(m.how);
}
void encode(Writer& w, const GroupHead& m) {
  w.u32(m.n_ops);
  w.u32(m.flags);
}
void encode(Writer& w, const GroupDone& m) {
  w.u32(static_cast<uint32_t>(m.results.size()));
  for (int32_t r : m.results) w.i32(r);
  w.str(m.message);
}
void encode(Writer& w, const SimulateDone& m) { w.f64(m.estimated_time_us); }
void encode(Writer& w, const Ping& m) {
  if (!m.token.empty()) w.str(m.token);
}
void encode(Writer& w, const Pong& m) { w.str(m.description); }
void encode(Writer& w, const Shutdown& m) { w.str(m.token); }
void encode(Writer& w, const ArenaRequest& m) { w.u64(m.comm_handle); }
void encode(Writer& w, const ProbeSource& m) {
  w.u64(m.comm_handle);
  w.u32(m.timeout_ms);
  w.u32(static_cast<uint32_t>(m.recvs_posted.size()));
  for (uint32_t n : m.recvs_posted) w.u32(n);
}
void encode(Writer& w, const Source& m) { w.i32(m.peer); }
void encode(Writer& w, const ArenaInfo& m) {
  w.u32(m.granted);
  w.u32(m.rank);
  w.u64(m.slot_bytes);
  w.u64(m.total_bytes);
  w.str(m.path);
  w.str(m.reason);
}
void encode(Writer& w, const LocalOps& m) {
  w.u64(m.comm_handle);
  w.u32(static_cast<uint32_t>(m.records.size()));
  w.u32(m.nranks);
  uint8_t desc[kOpDescSize];
  for (const LocalOpRecord& rec : m.records) {
    encode_opdesc(desc, rec.desc);
    w.raw(desc, kOpDescSize);
    w.f64(rec.started_at);
    w.f64(rec.rendezvous_s);
    w.f64(rec.execution_s);
    for (uint32_t i = 0; i < m.nranks; i++) w.f64(i < rec.arrival_wait_s.size() ? rec.arrival_wait_s[i] : 0.0);
  }
}

void encode_group_head(uint8_t* out, uint32_t n_ops, uint32_t flags) {
  memcpy(out, &n_ops, 4);
  memcpy(out + 4, &flags, 4);
}

void encode_opdesc(uint8_t* o, const OpDesc& d) {
  memcpy(o + 0, &d.comm_handle, 8);
  o[8] = d.kind;
  o[9] = d.datatype;
  o[10] = d.redop;
  o[11] = d.flags;
  memcpy(o + 12, &d.root, 4);
  memcpy(o + 16, &d.total_count, 8);
  memcpy(o + 24, &d.step_count, 8);
  memcpy(o + 32, &d.in_offset, 8);
  memcpy(o + 40, &d.in_len, 8);
  memcpy(o + 48, &d.out_offset, 8);
  memcpy(o + 56, &d.out_len, 8);
  memcpy(o + 64, d.scalar, 8);
  memcpy(o + 72, &d.call_seq, 4);
  memcpy(o + 76, &d.match_seq, 4);
  memcpy(o + 80, &d.step_index, 4);
  memcpy(o + 84, &d.step_total, 4);
}

// ---- decoders ----------------------------------------------------------------------------

bool decode(Reader& r, Hello* m) {
  return r.u32(&m->flags) && r.i32(&m->global_rank) && r.i32(&m->local_rank) && r.i32(&m->world_size) &&
         r.u32(&m->pid) && r.u64(&m->staging_bytes) && r.str(&m->token) && r.str(&m->shm_name) &&
         r.str(&m->hostname);
}
bool decode(Reader& r, HelloOk* m) {
  return r.u32(&m->client_id) && r.u32(&m->flags) && r.u64(&m->staging_bytes) && r.u32(&m->timeout_ms);
}
bool decode(Reader& r, Error* m) { return r.i32(&m->result) && r.str(&m->message); }
bool decode(Reader& r, CommInit* m) {
  return r.raw(m->unique_id, kUniqueIdBytes) && r.i32(&m->nranks) && r.i32(&m->rank) && r.str(&m->name);
}
bool decode(Reader& r, CommInfo* m) {
  if (!(r.u64(&m->comm_handle) && r.i32(&m->rank) && r.i32(&m->nranks))) return false;
  if (m->nranks < 0 || static_cast<uint64_t>(m->nranks) * 4 > r.remaining()) return false;
  m->global_ranks.resize(m->nranks);
  for (auto& g : m->global_ranks)
    if (!r.i32(&g)) return false;
  return true;
}
bool decode(Reader& r, CommSplit* m) {
  return r.u64(&m->parent_handle) && r.i32(&m->color) && r.i32(&m->key) && r.str(&m->name);
}
bool decode(Reader& r, CommShrink* m) {
  uint32_t n;
  if (!(r.u64(&m->parent_handle) && r.u32(&m->flags) && r.u32(&n)) || static_cast<uint64_t>(n) * 4 > r.remaining())
    return false;
  m->excluded.resize(n);
  for (uint32_t i = 0; i < n; i++)
    if (!r.i32(&m->excluded[i])) return false;
  return r.str(&m->name);
}
bool decode(Reader& r, CommFree* m) { return r.u64(&m->comm_handle) && r.u32(&m->how); }
bool decode(Reader& r, GroupHead* m) { return r.u32(&m->n_ops) && r.u32(&m->flags); }
bool decode(Reader& r, GroupDone* m) {
  uint32_t n;
  if (!r.u32(&n) || static_cast<uint64_t>(n) * 4 > r.remaining()) return false;
  m->results.resize(n);
  for (auto& x : m->results)
    if (!r.i32(&x)) return false;
  return r.str(&m->message);
}
bool decode(Reader& r, SimulateDone* m) { return r.f64(&m->estimated_time_us); }
bool decode(Reader& r, Ping* m) {
  m->token.clear();
  return r.remaining() == 0 || r.str(&m->token);
}
bool decode(Reader& r, Pong* m) { return r.str(&m->description); }
bool decode(Reader& r, Shutdown* m) { return r.str(&m->token); }
bool decode(Reader& r, ArenaRequest* m) { return r.u64(&m->comm_handle); }
bool decode(Reader& r, ProbeSource* m) {
  uint32_t n;
  if (!r.u64(&m->comm_handle) || !r.u32(&m->timeout_ms) || !r.u32(&n) || n > r.remaining() / 4) return false;
  m->recvs_posted.resize(n);
  for (uint32_t& v : m->recvs_posted)
    if (!r.u32(&v)) return false;
  return true;
}
bool decode(Reader& r, Source* m) { return r.i32(&m->peer); }
bool decode(Reader& r, ArenaInfo* m) {
  return r.u32(&m->granted) && r.u32(&m->rank) && r.u64(&m->slot_bytes) && r.u64(&m->total_bytes) &&
         r.str(&m->path) && r.str(&m->reason);
}
bool decode(Reader& r, LocalOps* m) {
  uint32_t n;
  if (!(r.u64(&m->comm_handle) && r.u32(&n) && r.u32(&m->nranks))) return false;
  // Check the declared sizes against the body before allocating anything.
  // (Divisions, not products: a hostile nranks or n must not overflow the check.)
  if (n != 0) {
    if (m->nranks > r.remaining() / 8) return false;
    const uint64_t record_bytes = kOpDescSize + 24 + 8ull * m->nranks;
    if (n > r.remaining() / record_bytes) return false;
  }
  m->records.resize(n);
  for (LocalOpRecord& rec : m->records) {
    if (!(decode_opdesc(r, &rec.desc) && r.f64(&rec.started_at) && r.f64(&rec.rendezvous_s) &&
          r.f64(&rec.execution_s)))
      return false;
    rec.arrival_wait_s.resize(m->nranks);
    for (double& x : rec.arrival_wait_s)
      if (!r.f64(&x)) return false;
  }
  return true;
}

bool decode_opdesc(Reader& r, OpDesc* d) {
  return r.u64(&d->comm_handle) && r.u8(&d->kind) && r.u8(&d->datatype) && r.u8(&d->redop) &&
         r.u8(&d->flags) && r.i32(&d->root) && r.u64(&d->total_count) && r.u64(&d->step_count) &&
         r.u64(&d->in_offset) && r.u64(&d->in_len) && r.u64(&d->out_offset) && r.u64(&d->out_len) &&
         r.raw(d->scalar, 8) && r.u32(&d->call_seq) && r.u32(&d->match_seq) &&
         r.u32(&d->step_index) && r.u32(&d->step_total);
}

}  // namespace fakegpu::proto
