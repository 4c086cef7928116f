// Checks the shim's wire codec (native/src/protocol.cc) against tests/vectors/protocol_vectors.json,
// the byte vectors produced by the coordinator's Python codec: for every vector, encoding
// its fields must give exactly its bytes, and decoding its bytes must give its fields.
//
//   protocol_vectors_test [path/to/protocol_vectors.json]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "wire/protocol.h"

namespace {

using namespace fakegpu::proto;

// ---- a small JSON reader (objects, arrays, strings, numbers kept as text) -----------------
struct Json {
  enum Kind { kNull, kBool, kNum, kStr, kArr, kObj } kind = kNull;
  std::string text;  // number text or string value
  bool b = false;
  std::vector<Json> arr;
  std::map<std::string, Json> obj;
  const Json& operator[](const std::string& k) const {
    static Json none;
    auto it = obj.find(k);
    return it == obj.end() ? none : it->second;
  }
  bool has(const std::string& k) const { return obj.count(k) != 0; }
  long long i() const { return std::stoll(text); }
  unsigned long long u() const { return std::stoull(text); }
  double d() const { return std::stod(text); }
};

class Parser {
 public:
  explicit Parser(const std::string& s) : s_(s) {}
  Json parse() {
    Json v = value();
    ws();
    if (p_ != s_.size()) die("trailing data");
    return v;
  }

 private:
  [[noreturn]] void die(const char* why) {
    fprintf(stderr, "JSON parse error at %zu: %s\n", p_, why);
    exit(2);
  }
  void ws() {
    while (p_ < s_.size() && isspace((unsigned char)s_[p_])) p_++;
  }
  Json value() {
    ws();
    if (p_ >= s_.size()) die("unexpected end");
    char c = s_[p_];
    Json v;
    if (c == '{') {
      v.kind = Json::kObj;
      p_++;
      ws();
      if (s_[p_] == '}') { p_++; return v; }
      for (;;) {
        ws();
        std::string k = str();
        ws();
        if (s_[p_++] != ':') die("expected ':'");
        v.obj[k] = value();
        ws();
        if (s_[p_] == ',') { p_++; continue; }
        if (s_[p_] == '}') { p_++; return v; }
        die("expected ',' or '}'");
      }
    }
    if (c == '[') {
      v.kind = Json::kArr;
      p_++;
      ws();
      if (s_[p_] == ']') { p_++; return v; }
      for (;;) {
        v.arr.push_back(value());
        ws();
        if (s_[p_] == ',') { p_++; continue; }
        if (s_[p_] == ']') { p_++; return v; }
        die("expected ',' or ']'");
      }
    }
    if (c == '"') {
      v.kind = Json::kStr;
      v.text = str();
      return v;
    }
    if (s_.compare(p_, 4, "true") == 0) { p_ += 4; v.kind = Json::kBool; v.b = true; return v; }
    if (s_.compare(p_, 5, "false") == 0) { p_ += 5; v.kind = Json::kBool; return v; }
    if (s_.compare(p_, 4, "null") == 0) { p_ += 4; return v; }
    size_t start = p_;
    while (p_ < s_.size() && (isdigit((unsigned char)s_[p_]) || strchr("+-.eE", s_[p_]))) p_++;
    if (start == p_) die("unexpected character");
    v.kind = Json::kNum;
    v.text = s_.substr(start, p_ - start);
    return v;
  }
  void utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) out += (char)cp;
    else if (cp < 0x800) { out += (char)(0xC0 | (cp >> 6)); out += (char)(0x80 | (cp & 0x3F)); }
    else if (cp < 0x10000) { out += (char)(0xE0 | (cp >> 12)); out += (char)(0x80 | ((cp >> 6) & 0x3F)); out += (char)(0x80 | (cp & 0x3F)); }
    else { out += (char)(0xF0 | (cp >> 18)); out += (char)(0x80 | ((cp >> 12) & 0x3F)); out += (char)(0x80 | ((cp >> 6) & 0x3F)); out += (char)(0x80 | (cp & 0x3F)); }
  }
  std::string str() {
    if (s_[p_] != '"') die("expected string");
    p_++;
    std::string out;
    while (p_ < s_.size() && s_[p_] != '"') {
      char c = s_[p_++];
      if (c != '\\') { out += c; continue; }
      char e = s_[p_++];
      switch (e) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': {
          unsigned cp = std::stoul(s_.substr(p_, 4), nullptr, 16);
          p_ += 4;
          if (cp >= 0xD800 && cp < 0xDC00 && s_.compare(p_, 2, "\\u") == 0) {
            unsigned lo = std::stoul(s_.substr(p_ + 2, 4), nullptr, 16);
            p_ += 6;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          utf8(out, cp);
          break;
        }
        default: out += e;
      }
    }
    p_++;
    return out;
  }
  const std::string& s_;
  size_t p_ = 0;
};

std::vector<uint8_t> unhex(const std::string& h) {
  std::vector<uint8_t> out(h.size() / 2);
  for (size_t i = 0; i < out.size(); i++) out[i] = (uint8_t)std::stoul(h.substr(2 * i, 2), nullptr, 16);
  return out;
}
std::string hex(const uint8_t* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; i++) { s += d[p[i] >> 4]; s += d[p[i] & 15]; }
  return s;
}

int g_failures = 0;
#define EXPECT(cond, ...)                                                   \
  do {                                                                      \
    if (!(cond)) {                                                          \
      fprintf(stderr, "  FAIL %s: ", name.c_str());                         \
      fprintf(stderr, __VA_ARGS__);                                         \
      fprintf(stderr, "\n");                                                \
      g_failures++;                                                         \
    }                                                                       \
  } while (0)

OpDesc op_from(const Json& j) {
  OpDesc d;
  d.comm_handle = j["comm_handle"].u();
  d.kind = (uint8_t)j["kind"].u();
  d.datatype = (uint8_t)j["datatype"].u();
  d.redop = (uint8_t)j["redop"].u();
  d.flags = (uint8_t)j["flags"].u();
  d.root = (int32_t)j["root"].i();
  d.total_count = j["total_count"].u();
  d.step_count = j["step_count"].u();
  d.in_offset = j["in_offset"].u();
  d.in_len = j["in_len"].u();
  d.out_offset = j["out_offset"].u();
  d.out_len = j["out_len"].u();
  std::vector<uint8_t> sc = unhex(j["scalar"].text);
  memcpy(d.scalar, sc.data(), sc.size() < 8 ? sc.size() : 8);
  d.call_seq = (uint32_t)j["call_seq"].u();
  d.match_seq = (uint32_t)j["match_seq"].u();
  d.step_index = (uint32_t)j["step_index"].u();
  d.step_total = (uint32_t)j["step_total"].u();
  return d;
}

bool same_op(const OpDesc& a, const OpDesc& b) {
  uint8_t x[kOpDescSize], y[kOpDescSize];
  encode_opdesc(x, a);
  encode_opdesc(y, b);
  return memcmp(x, y, kOpDescSize) == 0;
}

// Encodes the vector's fields into a body; decodes `body` and compares with the fields.
// Returns false for a type this test does not know.
// The shim reads a GROUP_DONE head from the socket as the decoder asks for it (Reader::shortfall):
// from nothing, each failed decode must name exactly the bytes still missing, and the rounds
// must end with the whole head read and not one byte of the payload.
static bool streamed_head_is_exact(const std::vector<uint8_t>& body, size_t head_len) {
  std::vector<uint8_t> have;
  for (int round = 0; round < 8; round++) {
    Reader r(have.data(), have.size());
    GroupDone d;
    if (decode(r, &d)) return have.size() == head_len;
    const uint64_t more = r.shortfall();
    if (more == 0 || have.size() + more > head_len) return false;
    have.insert(have.end(), body.begin() + have.size(), body.begin() + have.size() + more);
  }
  return false;
}

bool check_body(const std::string& name, uint16_t type, const Json& f, const std::vector<uint8_t>& body,
                std::vector<uint8_t>* encoded) {
  Writer w(encoded);
  Reader r(body.data(), body.size());
  bool decoded = false;
  switch (type) {
    case kHello: {
      Hello m;
      m.flags = (uint32_t)f["flags"].u(); m.global_rank = (int32_t)f["global_rank"].i();
      m.local_rank = (int32_t)f["local_rank"].i(); m.world_size = (int32_t)f["world_size"].i();
      m.pid = (uint32_t)f["pid"].u(); m.staging_bytes = f["staging_bytes"].u();
      m.token = f["token"].text; m.shm_name = f["shm_name"].text; m.hostname = f["hostname"].text;
      encode(w, m);
      Hello d;
      decoded = decode(r, &d) && d.flags == m.flags && d.global_rank == m.global_rank && d.local_rank == m.local_rank &&
                d.world_size == m.world_size && d.pid == m.pid && d.staging_bytes == m.staging_bytes &&
                d.token == m.token && d.shm_name == m.shm_name && d.hostname == m.hostname;
      break;
    }
    case kHelloOk: {
      HelloOk m{(uint32_t)f["client_id"].u(), (uint32_t)f["flags"].u(), f["staging_bytes"].u(),
                (uint32_t)f["timeout_ms"].u()};
      encode(w, m);
      HelloOk d;
      decoded = decode(r, &d) && d.client_id == m.client_id && d.flags == m.flags &&
                d.staging_bytes == m.staging_bytes && d.timeout_ms == m.timeout_ms;
      break;
    }
    case kError: {
      Error m{(int32_t)f["result"].i(), f["message"].text};
      encode(w, m);
      Error d;
      decoded = decode(r, &d) && d.result == m.result && d.message == m.message;
      break;
    }
    case kOk:
      decoded = body.empty();
      break;
    case kPing: {
      Ping m{f["token"].text};
      encode(w, m);
      Ping d;
      decoded = decode(r, &d) && d.token == m.token;
      break;
    }
    case kCommInit: {
      CommInit m;
      std::vector<uint8_t> id = unhex(f["unique_id"].text);
      memcpy(m.unique_id, id.data(), id.size() < kUniqueIdBytes ? id.size() : kUniqueIdBytes);
      m.nranks = (int32_t)f["nranks"].i(); m.rank = (int32_t)f["rank"].i(); m.name = f["name"].text;
      encode(w, m);
      CommInit d;
      decoded = decode(r, &d) && memcmp(d.unique_id, m.unique_id, kUniqueIdBytes) == 0 && d.nranks == m.nranks &&
                d.rank == m.rank && d.name == m.name;
      break;
    }
    case kCommInfo: {
      CommInfo m;
      m.comm_handle = f["comm_handle"].u(); m.rank = (int32_t)f["rank"].i();
      for (const Json& g : f["global_ranks"].arr) m.global_ranks.push_back((int32_t)g.i());
      encode(w, m);
      CommInfo d;
      decoded = decode(r, &d) && d.comm_handle == m.comm_handle && d.rank == m.rank &&
                d.global_ranks == m.global_ranks;
      break;
    }
    case kCommSplit: {
      CommSplit m{f["parent_handle"].u(), (int32_t)f["color"].i(), (int32_t)f["key"].i(), f["name"].text};
      encode(w, m);
      CommSplit d;
      decoded = decode(r, &d) && d.parent_handle == m.parent_handle && d.color == m.color && d.key == m.key &&
                d.name == m.name;
      break;
    }
    case kCommShrink: {
      CommShrink m;
      m.parent_handle = f["parent_handle"].u(); m.flags = (uint32_t)f["flags"].u(); m.name = f["name"].text;
      for (const Json& x : f["excluded"].arr) m.excluded.push_back((int32_t)x.i());
      encode(w, m);
      CommShrink d;
      decoded = decode(r, &d) && d.parent_handle == m.parent_handle && d.flags == m.flags &&
                d.excluded == m.excluded && d.name == m.name;
      break;
    }
    case kCommFree: {
      CommFree m{f["comm_handle"].u(), (uint32_t)f["how"].u()};
      encode(w, m);
      CommFree d;
      decoded = decode(r, &d) && d.comm_handle == m.comm_handle && d.how == m.how;
      break;
    }
    case kGroup: case kSimulate: case kAccount: {
      GroupHead h{(uint32_t)f["n_ops"].u(), (uint32_t)(f.has("flags") ? f["flags"].u() : 0)};
      encode(w, h);
      std::vector<OpDesc> ops;
      for (const Json& o : f["ops"].arr) ops.push_back(op_from(o));
      for (const OpDesc& o : ops) {
        size_t at = encoded->size();
        encoded->resize(at + kOpDescSize);
        encode_opdesc(encoded->data() + at, o);
      }
      std::vector<uint8_t> payload = unhex(f["payload"].text);
      encoded->insert(encoded->end(), payload.begin(), payload.end());
      GroupHead dh;
      decoded = decode(r, &dh) && dh.n_ops == h.n_ops && dh.flags == h.flags && ops.size() == h.n_ops;
      for (size_t k = 0; decoded && k < ops.size(); k++) {
        OpDesc d;
        decoded = decode_opdesc(r, &d) && same_op(d, ops[k]);
      }
      decoded = decoded && r.remaining() == payload.size() &&
                (payload.empty() || memcmp(body.data() + r.pos(), payload.data(), payload.size()) == 0);
      break;
    }
    case kGroupDone: {
      GroupDone m;
      for (const Json& x : f["results"].arr) m.results.push_back((int32_t)x.i());
      m.message = f["message"].text;
      encode(w, m);
      std::vector<uint8_t> payload = unhex(f["payload"].text);
      encoded->insert(encoded->end(), payload.begin(), payload.end());
      GroupDone d;
      decoded = decode(r, &d) && d.results == m.results && d.message == m.message &&
                m.results.size() == f["n_ops"].u() && r.remaining() == payload.size();
      decoded = decoded && streamed_head_is_exact(body, body.size() - payload.size());
      break;
    }
    case kSimulateDone: {
      SimulateDone m{f["estimated_time_us"].d()};
      encode(w, m);
      SimulateDone d;
      decoded = decode(r, &d) && d.estimated_time_us == m.estimated_time_us;
      break;
    }
    case kPong: {
      Pong m{f["description"].text};
      encode(w, m);
      Pong d;
      decoded = decode(r, &d) && d.description == m.description;
      break;
    }
    case kShutdown: {
      Shutdown m{f["token"].text};
      encode(w, m);
      Shutdown d;
      decoded = decode(r, &d) && d.token == m.token;
      break;
    }
    case kArena: {
      ArenaRequest m{f["comm_handle"].u()};
      encode(w, m);
      ArenaRequest d;
      decoded = decode(r, &d) && d.comm_handle == m.comm_handle;
      break;
    }
    case kProbeSource: {
      ProbeSource m;
      m.comm_handle = f["comm_handle"].u(); m.timeout_ms = (uint32_t)f["timeout_ms"].u();
      for (const Json& x : f["recvs_posted"].arr) m.recvs_posted.push_back((uint32_t)x.u());
      encode(w, m);
      ProbeSource d;
      decoded = decode(r, &d) && d.comm_handle == m.comm_handle && d.timeout_ms == m.timeout_ms &&
                d.recvs_posted == m.recvs_posted && f["nranks"].u() == m.recvs_posted.size();
      break;
    }
    case kSource: {
      Source m{(int32_t)f["peer"].i()};
      encode(w, m);
      Source d;
      decoded = decode(r, &d) && d.peer == m.peer;
      break;
    }
    case kArenaInfo: {
      ArenaInfo m;
      m.granted = (uint32_t)f["granted"].u(); m.rank = (uint32_t)f["rank"].u();
      m.slot_bytes = f["slot_bytes"].u(); m.total_bytes = f["total_bytes"].u();
      m.path = f["path"].text; m.reason = f["reason"].text;
      encode(w, m);
      ArenaInfo d;
      decoded = decode(r, &d) && d.granted == m.granted && d.rank == m.rank && d.slot_bytes == m.slot_bytes &&
                d.total_bytes == m.total_bytes && d.path == m.path && d.reason == m.reason;
      break;
    }
    case kLocalOps: {
      LocalOps m;
      m.comm_handle = f["comm_handle"].u(); m.nranks = (uint32_t)f["nranks"].u();
      for (const Json& j : f["records"].arr) {
        LocalOpRecord rec;
        rec.desc = op_from(j["desc"]);
        rec.started_at = j["started_at"].d(); rec.rendezvous_s = j["rendezvous_s"].d();
        rec.execution_s = j["execution_s"].d();
        for (const Json& x : j["arrival_wait_s"].arr) rec.arrival_wait_s.push_back(x.d());
        m.records.push_back(rec);
      }
      encode(w, m);
      LocalOps d;
      decoded = decode(r, &d) && r.remaining() == 0 && d.comm_handle == m.comm_handle && d.nranks == m.nranks &&
                d.records.size() == m.records.size() && m.records.size() == f["n_records"].u();
      for (size_t k = 0; decoded && k < m.records.size(); k++) {
        const LocalOpRecord &a = d.records[k], &b = m.records[k];
        decoded = same_op(a.desc, b.desc) && a.started_at == b.started_at && a.rendezvous_s == b.rendezvous_s &&
                  a.execution_s == b.execution_s && a.arrival_wait_s == b.arrival_wait_s;
      }
      // A body that declares more records (or ranks) than it holds must not decode.
      if (!body.empty()) {
        std::vector<uint8_t> cut(body.begin(), body.end() - 1);
        Reader rc(cut.data(), cut.size());
        LocalOps x;
        EXPECT(m.records.empty() || !decode(rc, &x), "a truncated LOCAL_OPS decodes");
      }
      break;
    }
    default:
      return false;
  }
  EXPECT(decoded, "decoding the vector's bytes does not give its fields");
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::string path = argc > 1 ? argv[1] : "tests/vectors/protocol_vectors.json";
  std::ifstream in(path);
  if (!in) {
    fprintf(stderr, "cannot open %s\n", path.c_str());
    return 2;
  }
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  Json root = Parser(text).parse();
  const Json& vectors = root.kind == Json::kObj ? root["vectors"] : root;
  int checked = 0;
  for (const Json& v : vectors.arr) {
    std::string name = v["name"].text;
    std::vector<uint8_t> bytes = unhex(v["hex"].text);
    uint16_t type = (uint16_t)v["type"].u();
    uint32_t id = (uint32_t)v["request_id"].u();
    // Header: decode and re-encode.
    FrameHeader h;
    std::string why;
    bool ok = bytes.size() >= kHeaderSize && decode_header(bytes.data(), UINT32_MAX, &h, &why);
    EXPECT(ok, "header does not decode: %s", why.c_str());
    if (!ok) continue;
    EXPECT(h.type == type && h.request_id == id && h.body_len == bytes.size() - kHeaderSize,
           "header fields type=%u id=%u len=%u", h.type, h.request_id, h.body_len);
    std::vector<uint8_t> body(bytes.begin() + kHeaderSize, bytes.end());
    std::vector<uint8_t> encoded;
    if (!check_body(name, type, v["fields"], body, &encoded)) {
      EXPECT(false, "message type %u unknown to this test", type);
      continue;
    }
    std::vector<uint8_t> framed = frame(type, id, encoded);
    EXPECT(framed == bytes, "encoding differs:\n    ours   %s\n    vector %s", hex(framed.data(), framed.size()).c_str(),
           v["hex"].text.c_str());
    checked++;
  }
  // Receivers reject bad headers (docs/protocol.md "Frame").
  {
    std::string name = "header_rejections";
    uint8_t hb[kHeaderSize];
    FrameHeader h;
    encode_header(hb, kGroupDone, 1, 100);
    EXPECT(decode_header(hb, 100, &h, nullptr), "valid header rejected");
    EXPECT(!decode_header(hb, 99, &h, nullptr), "oversize body accepted");
    encode_header(hb, 99, 1, 0);
    EXPECT(!decode_header(hb, 100, &h, nullptr), "unknown type accepted");
    encode_header(hb, kOk, 1, 0);
    hb[4] = static_cast<uint8_t>(kVersion + 1);
    EXPECT(!decode_header(hb, 100, &h, nullptr), "wrong version accepted");
    encode_header(hb, kOk, 1, 0);
    hb[0] = 'X';
    EXPECT(!decode_header(hb, 100, &h, nullptr), "wrong magic accepted");
  }
  if (checked == 0) {
    fprintf(stderr, "no vectors in %s\n", path.c_str());
    return 2;
  }
  if (g_failures) {
    fprintf(stderr, "protocol_vectors_test: %d failures over %d vectors\n", g_failures, checked);
    return 1;
  }
  printf("protocol_vectors_test: %d vectors OK\n", checked);
  return 0;
}
