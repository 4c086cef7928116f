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
  if (!u16(&n) || !need(n)) return false;
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

}  // namespace fakegpu::proto
