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

// ---- LOCAL_OPS (the other messages' codecs are generated: generated/wire_messages.h) ----

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

}  // namespace fakegpu::proto
