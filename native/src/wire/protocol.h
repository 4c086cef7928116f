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
    if (!need(n)) return false;
    memcpy(dst, p_ + pos_, n);
    pos_ += n;
    return true;
  }
  // True when `count` items of `size` bytes remain; checked by division, so a hostile count
  // cannot overflow the check (decoders call it before allocating).
  bool fits(uint64_t count, uint64_t size) {
    if (count <= remaining() / size) return true;
    shortfall_ = count > UINT64_MAX / size ? UINT64_MAX : count * size - remaining();
    return false;
  }
  size_t pos() const { return pos_; }
  size_t remaining() const { return n_ - pos_; }
  // How many more bytes the read that failed needed (0 while none failed). A caller reading a
  // body from a stream decodes what has arrived, fetches exactly this much more and decodes again.
  uint64_t shortfall() const { return shortfall_; }

 private:
  bool need(uint64_t n) {
    if (n <= remaining()) return true;
    shortfall_ = n - remaining();
    return false;
  }
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
  uint64_t shortfall_ = 0;
};

// ---- frame header ------------------------------------------------------------------------

void encode_header(uint8_t out[kHeaderSize], uint16_t type, uint32_t request_id, uint32_t body_len);
// False (with a reason) on a wrong magic, version, unknown type or body_len above max_body.
bool decode_header(const uint8_t in[kHeaderSize], uint64_t max_body, FrameHeader* h, std::string* why);

// A whole frame (header + body) as bytes.
std::vector<uint8_t> frame(uint16_t type, uint32_t request_id, const std::vector<uint8_t>& body);

// ---- messages ----------------------------------------------------------------------------
// OpDesc, the records and every message struct, with encode(Writer&, const M&) and
// decode(Reader&, M*) for each (a record's also take the body's fields that size its arrays),
// encode_opdesc / decode_opdesc, and encode_into for the heads written in place: generated
// from spec/wire.py.
}  // namespace fakegpu::proto

#include "generated/wire_messages.h"
