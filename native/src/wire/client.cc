#include "wire/client.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <chrono>

#include "core/env.h"
#include "api/last_error.h"
#include "wire/shm_alloc.h"
#include "transport/transport.h"

namespace fakegpu {

namespace {

constexpr uint64_t kMinStagingBytes = 4096;
constexpr uint64_t kMaxStagingBytes = 1ull << 40;
// Extra time a client waits beyond the coordinator's own timeout before it declares the
// coordinator unresponsive: the coordinator answers timeouts itself, this is the backstop.
// FAKEGPU_CLIENT_WAIT_MARGIN_MS overrides it (tests use a short one).
constexpr int kWaitMarginMs = 30000;

int wait_margin_ms() {
  static const int v = [] {
    long long x = env::integer("FAKEGPU_CLIENT_WAIT_MARGIN_MS", kWaitMarginMs);
    return x < 0 ? kWaitMarginMs : static_cast<int>(x > INT32_MAX / 2 ? INT32_MAX / 2 : x);
  }();
  return v;
}
// Used until HELLO_OK tells us the coordinator's timeout.
constexpr int kDefaultTimeoutMs = 300000;
// FAKEGPU_CONNECT_TIMEOUT_MS: connecting (retried while the socket is refused or missing).
// Short, so that a rank started without its coordinator says so at once.
constexpr long long kConnectTimeoutMs = 2000;
// FAKEGPU_HELLO_ANSWER_TIMEOUT_MS: once connected, the answer to HELLO.  Longer: a coordinator
// that is there but shares a small machine with ranks importing torch can be descheduled for
// seconds (observed: 2 s was missed with 10 ranks starting on 2 cores).
constexpr long long kHelloAnswerTimeoutMs = 30000;
// Pause between tries when the coordinator closed the connection before answering HELLO.
constexpr int kRetryPauseMs = 50;

long long monotonic_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
Client* g_client = nullptr;
// Lock-free read of g_client for the per-call path. Fork is handled by the atfork child
// handler (which resets both), so no getpid() syscall per call is needed.
std::atomic<Client*> g_client_fast{nullptr};

void atfork_child() {
  // The child must not share the parent's stream or staging segment: drop them here and
  // let the next call connect afresh. The old object is leaked on purpose (its mutexes may
  // have been held by threads that do not exist in the child).
  g_mu = PTHREAD_MUTEX_INITIALIZER;
  if (g_client) g_client->abandon_after_fork();
  g_client = nullptr;
  g_client_fast.store(nullptr);
}

// FAKEGPU_LOCAL_COLLECTIVES=0 (or false/no/off) keeps every collective on the coordinator.
bool local_collectives_wanted() {
  const char* v = getenv("FAKEGPU_LOCAL_COLLECTIVES");
  return !v || !*v || env::flag("FAKEGPU_LOCAL_COLLECTIVES");
}

std::string hostname() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "unknown";
  return buf;
}

}  // namespace

// ---- opening the connection ---------------------------------------------------------------

ncclResult_t Client::get(Client** out) {
  Client* fast = g_client_fast.load(std::memory_order_acquire);
  if (fast) {
    *out = fast;
    return ncclSuccess;
  }
  static bool atfork_registered = [] {
    pthread_atfork(nullptr, nullptr, atfork_child);
    return true;
  }();
  (void)atfork_registered;
  pthread_mutex_lock(&g_mu);
  ncclResult_t rc = ncclSuccess;
  if (!g_client) {
    Client* c = nullptr;
    rc = connect_new(&c);
    if (rc == ncclSuccess) {
      g_client = c;
      g_client_fast.store(c, std::memory_order_release);
    }
  }
  *out = g_client;
  pthread_mutex_unlock(&g_mu);
  return rc;
}

void Client::abandon_after_fork() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
  if (shm_base_) munmap(shm_base_, shm_map_len_);
  shm_base_ = nullptr;
}

ncclResult_t Client::connect_new(Client** out) {
  std::string transport = env::str("FAKEGPU_COORDINATOR_TRANSPORT", "unix");
  std::string addr = env::str("FAKEGPU_COORDINATOR_ADDR");
  if (transport != "unix" && transport != "tcp")
    return failf(ncclInvalidUsage,
                 "fakegpu: FAKEGPU_COORDINATOR_TRANSPORT=%s is not a transport (use 'unix' or 'tcp')",
                 transport.c_str());
  if (addr.empty())
    return fail(ncclSystemError,
                "fakegpu: FAKEGPU_COORDINATOR_ADDR is not set, so there is no coordinator to talk to; start one "
                "with `python -m fakegpu coordinator --transport unix --address PATH` and export "
                "FAKEGPU_COORDINATOR_ADDR=PATH, or launch the job under `fgpu`");

  bool bad = false;
  long long env_timeout = env::integer("FAKEGPU_COORDINATOR_TIMEOUT_MS", -1, &bad);
  if (bad)
    return failf(ncclInvalidUsage, "fakegpu: FAKEGPU_COORDINATOR_TIMEOUT_MS='%s' is not an integer",
                 getenv("FAKEGPU_COORDINATOR_TIMEOUT_MS"));
  // 0 asks the coordinator to choose S (docs/protocol.md, "Staging size"): it sizes the
  // segments of a world so that they fit the host's shared memory together.
  uint64_t staging = 0;
  std::string staging_text = env::str("FAKEGPU_STAGING_CHUNK_BYTES");
  if (!staging_text.empty() && (!env::bytes(staging_text.c_str(), &staging) || staging < kMinStagingBytes ||
                                staging > kMaxStagingBytes))
    return failf(ncclInvalidUsage,
                 "fakegpu: FAKEGPU_STAGING_CHUNK_BYTES='%s' is not a byte count between %llu and 1T",
                 staging_text.c_str(), (unsigned long long)kMinStagingBytes);
  bool want_shm = transport == "unix" && !env::flag("FAKEGPU_STAGING_FORCE_SOCKET");
  uint32_t timeout_ms = env_timeout > 0 ? static_cast<uint32_t>(env_timeout) : kDefaultTimeoutMs;

  // Getting in is bounded: connecting (retried while refused or missing) within the connect
  // timeout, and then the answer to HELLO within the answer timeout. A coordinator that closes
  // the connection before answering (at its limit of connections without HELLO, or out of
  // descriptors) is tried again while the connect timeout lasts.
  long long t = env::integer("FAKEGPU_CONNECT_TIMEOUT_MS", kConnectTimeoutMs, &bad);
  if (bad || t <= 0)
    return failf(ncclInvalidUsage, "fakegpu: FAKEGPU_CONNECT_TIMEOUT_MS='%s' is not a positive integer",
                 getenv("FAKEGPU_CONNECT_TIMEOUT_MS"));
  int connect_timeout_ms = t > INT32_MAX / 2 ? INT32_MAX / 2 : static_cast<int>(t);
  long long answer = env::integer("FAKEGPU_HELLO_ANSWER_TIMEOUT_MS", kHelloAnswerTimeoutMs, &bad);
  if (bad || answer <= 0)
    return failf(ncclInvalidUsage, "fakegpu: FAKEGPU_HELLO_ANSWER_TIMEOUT_MS='%s' is not a positive integer",
                 getenv("FAKEGPU_HELLO_ANSWER_TIMEOUT_MS"));
  int answer_timeout_ms = answer > INT32_MAX / 2 ? INT32_MAX / 2 : static_cast<int>(answer);
  const long long deadline = monotonic_ms() + connect_timeout_ms;
  for (;;) {
    bool retry = false;
    ncclResult_t rc = connect_once(transport, addr, staging, want_shm, timeout_ms, answer_timeout_ms, deadline,
                                   &retry, out);
    if (rc == ncclSuccess || !retry || monotonic_ms() + kRetryPauseMs >= deadline) return rc;
    usleep(kRetryPauseMs * 1000);
  }
}

ncclResult_t Client::connect_once(const std::string& transport, const std::string& addr, uint64_t staging,
                                  bool want_shm, uint32_t timeout_ms, int answer_timeout_ms, long long deadline_ms,
                                  bool* retry, Client** out) {
  Client* c = new Client();
  c->address_ = transport + ":" + addr;
  c->staging_bytes_ = staging;
  c->timeout_ms_ = timeout_ms;

  long long left = deadline_ms - monotonic_ms();
  int connect_ms = left > 1 ? static_cast<int>(left) : 1;
  std::string err;
  c->fd_ = transport == "unix" ? transport::connect_unix(addr, connect_ms, &err)
                               : transport::connect_tcp(addr, connect_ms, &err);
  if (c->fd_ < 0) {
    delete c;
    return failf(ncclSystemError,
                 "fakegpu: cannot connect to the coordinator at %s (FAKEGPU_COORDINATOR_ADDR=%s, "
                 "FAKEGPU_COORDINATOR_TRANSPORT=%s): %s; is the coordinator running?",
                 (transport + ":" + addr).c_str(), addr.c_str(), transport.c_str(), err.c_str());
  }
  transport::tune_socket(c->fd_, answer_timeout_ms);  // the HELLO answer is bounded by it too

  if (want_shm) {
    // One segment for the process's whole life, created empty: the coordinator allocates it
    // (posix_fallocate) once it has chosen S, and the shim maps it only after that, so no
    // process ever maps a page /dev/shm could not back (a SIGBUS at the first large copy).
    static std::atomic<int> seq{0};
    c->shm_name_ = "/fakegpu-" + std::to_string(getpid()) + "-" + std::to_string(++seq);
    c->shm_fd_ = shm_open(c->shm_name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (c->shm_fd_ < 0) c->shm_name_.clear();  // fall back to socket staging
  }

  ncclResult_t rc = c->hello(answer_timeout_ms, retry);
  if (!c->shm_name_.empty()) shm_unlink(c->shm_name_.c_str());  // nothing outlives the processes
  if (c->shm_fd_ >= 0) close(c->shm_fd_);
  c->shm_fd_ = -1;
  if (rc != ncclSuccess) {
    if (c->shm_base_) munmap(c->shm_base_, c->shm_map_len_);
    close(c->fd_);
    delete c;
    return rc;
  }
  *out = c;
  return ncclSuccess;
}

ncclResult_t Client::hello(int answer_timeout_ms, bool* retry) {
  proto::Hello h;
  const bool offer_shm = shm_fd_ >= 0;
  h.flags = offer_shm ? proto::kHelloShm : 0;
  // Host-local collectives need the shared memory too (docs/protocol.md, arenas).
  if (offer_shm && local_collectives_wanted()) h.flags |= proto::kHelloLocal;
  h.global_rank = static_cast<int32_t>(env::integer("RANK", -1));
  h.local_rank = static_cast<int32_t>(env::integer("LOCAL_RANK", -1));
  h.world_size = static_cast<int32_t>(env::integer("WORLD_SIZE", -1));
  h.pid = static_cast<uint32_t>(getpid());
  h.staging_bytes = staging_bytes_;
  // The token-file rule (env.h); a bad file fails here, before HELLO is sent.
  std::string token_error;
  if (!env::coordinator_token(&h.token, &token_error)) return fail(ncclInvalidUsage, "fakegpu: " + token_error);
  h.shm_name = shm_name_;
  h.hostname = hostname();
  std::vector<uint8_t> body;
  proto::Writer w(&body);
  proto::encode(w, h);

  Pending p;
  iovec iov{body.data(), body.size()};
  ncclResult_t rc = request(&p, proto::kHello, &iov, 1);
  bool timed_out = false;
  if (rc == ncclSuccess) rc = wait(&p, answer_timeout_ms, &timed_out);
  if (timed_out)
    return failf(ncclSystemError,
                 "fakegpu: the coordinator at %s accepted the connection but did not answer HELLO within %d ms "
                 "(FAKEGPU_HELLO_ANSWER_TIMEOUT_MS): it is overloaded, stuck or out of file descriptors; see its log",
                 address_.c_str(), answer_timeout_ms);
  if (rc != ncclSuccess) {
    *retry = true;
    return failf(ncclSystemError,
                 "fakegpu: the coordinator at %s closed the connection before answering HELLO (%s): it closes "
                 "connections beyond its limit of connections without HELLO (--max-unauthenticated) and when it "
                 "runs out of file descriptors; see its log",
                 address_.c_str(), p.fail_msg.empty() ? "connection broke" : p.fail_msg.c_str());
  }
  proto::Reader r(p.body.data(), p.body.size());
  if (p.hdr.type == proto::kError) {
    proto::Error e;
    if (!proto::decode(r, &e)) return fail(ncclSystemError, "fakegpu: malformed ERROR answer to HELLO");
    return failf(e.result > 0 && e.result < ncclNumResults ? (ncclResult_t)e.result : ncclSystemError,
                 "fakegpu: the coordinator at %s refused this process: %s", address_.c_str(), e.message.c_str());
  }
  proto::HelloOk ok;
  if (p.hdr.type != proto::kHelloOk || !proto::decode(r, &ok))
    return failf(ncclSystemError, "fakegpu: unexpected %s answer to HELLO from %s",
                 proto::type_name(p.hdr.type), address_.c_str());
  if (ok.staging_bytes < kMinStagingBytes || ok.staging_bytes > kMaxStagingBytes ||
      (staging_bytes_ != 0 && ok.staging_bytes > staging_bytes_))
    return failf(ncclSystemError, "fakegpu: the coordinator granted %llu staging bytes (asked for %llu%s)",
                 (unsigned long long)ok.staging_bytes, (unsigned long long)staging_bytes_,
                 staging_bytes_ == 0 ? ", the coordinator's choice" : "");
  client_id_ = ok.client_id;
  if (ok.timeout_ms > 0) timeout_ms_ = ok.timeout_ms;
  staging_bytes_ = ok.staging_bytes;  // the output region starts at the *granted* S
  if ((ok.flags & proto::kHelloShm) && offer_shm) {
    rc = map_staging();
    if (rc != ncclSuccess) return rc;
  }
  local_ = shm_base_ && (h.flags & proto::kHelloLocal) && (ok.flags & proto::kHelloLocal);
  transport::tune_socket(fd_, wait_timeout_ms());
  return ncclSuccess;
}

ncclResult_t Client::map_staging() {
  const size_t len = 2 * staging_bytes_;
  if (!fully_allocated(shm_fd_, len))
    return failf(ncclSystemError,
                 "fakegpu: the coordinator granted shared-memory staging but the segment %s is not allocated to "
                 "%llu bytes; refusing to map it (a page /dev/shm cannot back would be a SIGBUS); set "
                 "FAKEGPU_STAGING_FORCE_SOCKET=1 to stage through the socket",
                 shm_name_.c_str(), (unsigned long long)len);
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, shm_fd_, 0);
  if (p == MAP_FAILED)
    return failf(ncclSystemError, "fakegpu: cannot map the shared-memory staging segment %s (%llu bytes): %s",
                 shm_name_.c_str(), (unsigned long long)len, strerror(errno));
  shm_base_ = static_cast<uint8_t*>(p);
  shm_map_len_ = len;
  return ncclSuccess;
}

int Client::wait_timeout_ms() const {
  uint64_t t = static_cast<uint64_t>(timeout_ms_) + wait_margin_ms();
  return t > INT32_MAX ? INT32_MAX : static_cast<int>(t);
}

// ---- sending --------------------------------------------------------------------------------

bool Client::send_all(const iovec* iov_in, int iovcnt, std::string* err) {
  // sendmsg (not writev) so a closed peer gives EPIPE instead of SIGPIPE.
  thread_local std::vector<iovec> iov;
  iov.assign(iov_in, iov_in + iovcnt);
  size_t i = 0;
  while (i < iov.size()) {
    if (iov[i].iov_len == 0) {
      i++;
      continue;
    }
    msghdr m;
    memset(&m, 0, sizeof(m));
    m.msg_iov = &iov[i];
    m.msg_iovlen = std::min<size_t>(iov.size() - i, 1024);
    ssize_t n = sendmsg(fd_, &m, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      *err = errno == EAGAIN || errno == EWOULDBLOCK ? "send timed out" : strerror(errno);
      return false;
    }
    size_t left = static_cast<size_t>(n);
    while (left > 0 && i < iov.size()) {
      if (left >= iov[i].iov_len) {
        left -= iov[i].iov_len;
        i++;
      } else {
        iov[i].iov_base = static_cast<uint8_t*>(iov[i].iov_base) + left;
        iov[i].iov_len -= left;
        left = 0;
      }
    }
  }
  return true;
}

ncclResult_t Client::request(Pending* p, uint16_t type, const iovec* iov, int iovcnt) {
  size_t body_len = 0;
  for (int i = 0; i < iovcnt; i++) body_len += iov[i].iov_len;
  if (body_len > max_body() || body_len > UINT32_MAX)
    return failf(ncclInternalError, "fakegpu: %s frame of %zu bytes exceeds the frame limit", proto::type_name(type),
                 body_len);
  p->id = next_id_.fetch_add(1, std::memory_order_relaxed);
  p->done = false;
  p->claimed = false;
  p->fail = ncclSuccess;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (dead_) return fail(ncclSystemError, dead_msg_);
    pending_.push_back(p);
  }
  ncclResult_t rc = send_frame(type, p->id, iov, iovcnt, body_len);
  if (rc != ncclSuccess) unregister(p);
  return rc;
}

bool Client::connection_alive() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (dead_) return false;
  }
  char b;
  ssize_t n = recv(fd_, &b, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n == 0) return false;  // EOF: the coordinator went away
  return n > 0 || errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
}

ncclResult_t Client::post(uint16_t type, const iovec* iov, int iovcnt) {
  size_t body_len = 0;
  for (int i = 0; i < iovcnt; i++) body_len += iov[i].iov_len;
  if (body_len > max_body() || body_len > UINT32_MAX)
    return failf(ncclInternalError, "fakegpu: %s frame of %zu bytes exceeds the frame limit", proto::type_name(type),
                 body_len);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (dead_) return fail(ncclSystemError, dead_msg_);
  }
  return send_frame(type, 0, iov, iovcnt, body_len);
}

ncclResult_t Client::send_frame(uint16_t type, uint32_t id, const iovec* iov, int iovcnt, size_t body_len) {
  uint8_t hdr[proto::kHeaderSize];
  proto::encode_header(hdr, type, id, static_cast<uint32_t>(body_len));
  iovec small[16];
  std::vector<iovec> big;
  iovec* all = small;
  if (iovcnt + 1 > 16) {
    big.resize(iovcnt + 1);
    all = big.data();
  }
  all[0] = {hdr, sizeof(hdr)};
  for (int i = 0; i < iovcnt; i++) all[i + 1] = iov[i];
  std::string err;
  bool ok;
  {
    std::lock_guard<std::mutex> lk(send_mu_);
    ok = send_all(all, iovcnt + 1, &err);
  }
  if (!ok) {
    mark_dead("fakegpu: lost the connection to the coordinator at " + address_ + " while sending " +
              proto::type_name(type) + ": " + err);
    return fail(ncclSystemError, dead_msg_);
  }
  return ncclSuccess;
}

ncclResult_t Client::call(Pending* p, uint16_t type, const std::vector<uint8_t>& body) {
  iovec iov{const_cast<uint8_t*>(body.data()), body.size()};
  ncclResult_t rc = request(p, type, &iov, 1);
  if (rc != ncclSuccess) return rc;
  return wait(p);
}

// ---- receiving --------------------------------------------------------------------------------

ssize_t Client::fill() {
  for (;;) {
    ssize_t n = recv(fd_, rbuf_.data(), rbuf_.size(), 0);
    if (n > 0) {
      rpos_ = 0;
      rlen_ = static_cast<size_t>(n);
      return n;
    }
    if (n == 0) return 0;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return -2;
    return -1;
  }
}

bool Client::read_exact(void* dst_v, size_t n) {
  uint8_t* dst = static_cast<uint8_t*>(dst_v);
  while (n > 0) {
    if (rpos_ < rlen_) {
      size_t k = std::min(n, rlen_ - rpos_);
      memcpy(dst, rbuf_.data() + rpos_, k);
      rpos_ += k;
      dst += k;
      n -= k;
      continue;
    }
    if (n >= rbuf_.size() / 2) {
      // Large payload: receive straight into the destination (user buffer), no bounce.
      ssize_t k = recv(fd_, dst, n, MSG_WAITALL);
      if (k > 0) {
        dst += k;
        n -= static_cast<size_t>(k);
        continue;
      }
      if (k < 0 && errno == EINTR) continue;
      return false;
    }
    if (fill() <= 0) return false;
  }
  return true;
}

bool Client::read_discard(size_t n) {
  while (n > 0) {
    if (rpos_ >= rlen_ && fill() <= 0) return false;
    size_t k = std::min(n, rlen_ - rpos_);
    rpos_ += k;
    n -= k;
  }
  return true;
}

Client::ReadOutcome Client::read_one_frame() {
  uint8_t hb[proto::kHeaderSize];
  if (rpos_ >= rlen_) {
    ssize_t k = fill();
    if (k == -2) return kIdleTimeout;  // nothing arrived at all: the connection is still in sync
    if (k == 0) {
      mark_dead("fakegpu: the coordinator at " + address_ + " closed the connection");
      return kDead;
    }
    if (k < 0) {
      mark_dead("fakegpu: lost the connection to the coordinator at " + address_ + ": " + strerror(errno));
      return kDead;
    }
  }
  if (!read_exact(hb, sizeof(hb))) {
    mark_dead("fakegpu: the connection to the coordinator at " + address_ + " broke in the middle of a frame");
    return kDead;
  }
  proto::FrameHeader h;
  std::string why;
  if (!proto::decode_header(hb, max_body(), &h, &why)) {
    mark_dead("fakegpu: protocol error from the coordinator at " + address_ + ": " + why);
    return kDead;
  }
  Pending* t = nullptr;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (Pending* q : pending_)
      if (q->id == h.request_id) {
        t = q;
        t->claimed = true;
        break;
      }
  }
  bool ok;
  std::string err;
  if (!t) {
    ok = read_discard(h.body_len);  // an answer to a request whose waiter gave up
  } else if (t->sink && t->sink->wants(h)) {
    ok = t->sink->consume(*this, h, &err);
  } else {
    t->body.resize(h.body_len);
    ok = read_exact(t->body.data(), h.body_len);
  }
  if (!ok) {
    mark_dead("fakegpu: bad " + std::string(proto::type_name(h.type)) + " frame from the coordinator at " +
                  address_ + (err.empty() ? ": connection broke" : ": " + err),
              t);
    return kDead;
  }
  if (t) {
    std::lock_guard<std::mutex> lk(mu_);
    t->hdr = h;
    t->claimed = false;
    t->done = true;
  }
  return kFrame;
}

void Client::mark_dead(const std::string& why, Pending* reader_claim) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!dead_) {
    dead_ = true;
    dead_msg_ = why;
    if (fd_ >= 0) shutdown(fd_, SHUT_RDWR);  // wake anyone blocked on the socket
  }
  for (Pending* q : pending_) {
    // A request the reader is filling right now stays its business: the reader's receive
    // fails (the socket is shut down) and it resolves the request itself.
    if (q->claimed && q != reader_claim) continue;
    if (!q->done) {
      q->fail = ncclSystemError;
      q->fail_msg = dead_msg_;
      q->claimed = false;
      q->done = true;
    }
  }
  cv_.notify_all();
}

void Client::unregister(Pending* p) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = std::find(pending_.begin(), pending_.end(), p);
  if (it != pending_.end()) pending_.erase(it);
}

ncclResult_t Client::wait(Pending* p, int timeout_ms, bool* timed_out_out) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::milliseconds(timeout_ms >= 0 ? timeout_ms : wait_timeout_ms());
  std::unique_lock<std::mutex> lk(mu_);
  bool timed_out = false;
  while (!p->done) {
    if (!reading_) {
      // Become the leader: read frames until ours is in (or time is up).
      reading_ = true;
      lk.unlock();
      ReadOutcome o = read_one_frame();
      lk.lock();
      reading_ = false;
      cv_.notify_all();  // hand leadership on and wake whoever got an answer
      if (o == kIdleTimeout || (!p->done && clock::now() >= deadline)) {
        if (!p->done) timed_out = true;
        break;
      }
      continue;
    }
    if (cv_.wait_until(lk, deadline) == std::cv_status::timeout) {
      while (p->claimed) cv_.wait(lk);  // a reader is writing into p right now
      if (!p->done) timed_out = true;
      break;
    }
  }
  auto it = std::find(pending_.begin(), pending_.end(), p);
  if (it != pending_.end()) pending_.erase(it);
  lk.unlock();
  if (timed_out_out) *timed_out_out = timed_out;
  if (timed_out && timeout_ms >= 0) return ncclSystemError;  // the caller words the message
  if (timed_out)
    return failf(ncclSystemError,
                 "fakegpu: no answer from the coordinator at %s within %d ms (its timeout_ms %u plus a %d ms "
                 "margin); the coordinator is stuck or overloaded",
                 address_.c_str(), wait_timeout_ms(), timeout_ms_, wait_margin_ms());
  if (p->fail != ncclSuccess) return fail(p->fail, p->fail_msg);
  return ncclSuccess;
}

}  // namespace fakegpu

namespace fakegpu {

namespace {
constexpr uint64_t kWindowAlign = 64;

// First fit of `need` bytes in [0, cap) around the sorted busy intervals; UINT64_MAX if none.
uint64_t find_gap(const std::vector<std::pair<uint64_t, uint64_t>>& busy, uint64_t need, uint64_t cap) {
  uint64_t at = 0;
  for (const auto& b : busy) {
    if (at + need <= b.first) return at;
    at = (b.second + kWindowAlign - 1) & ~(kWindowAlign - 1);
  }
  return at + need <= cap ? at : UINT64_MAX;
}

void insert_sorted(std::vector<std::pair<uint64_t, uint64_t>>* busy, uint64_t b, uint64_t e) {
  auto it = std::lower_bound(busy->begin(), busy->end(), std::make_pair(b, e));
  busy->insert(it, {b, e});
}

void erase_interval(std::vector<std::pair<uint64_t, uint64_t>>* busy, uint64_t b, uint64_t e) {
  auto it = std::find(busy->begin(), busy->end(), std::make_pair(b, e));
  if (it != busy->end()) busy->erase(it);
}
}  // namespace

bool Client::reserve_staging(uint64_t in_need, uint64_t out_need, Window* w) {
  const uint64_t S = staging_bytes_;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_timeout_ms());
  std::unique_lock<std::mutex> lk(stg_mu_);
  for (;;) {
    uint64_t ib = in_need ? find_gap(in_busy_, in_need, S) : 0;
    uint64_t ob = out_need ? find_gap(out_busy_, out_need, S) : 0;
    if (ib != UINT64_MAX && ob != UINT64_MAX) {
      if (in_need) insert_sorted(&in_busy_, ib, ib + in_need);
      if (out_need) insert_sorted(&out_busy_, ob, ob + out_need);
      *w = Window{ib, in_need, ob, out_need};
      return true;
    }
    if (stg_cv_.wait_until(lk, deadline) == std::cv_status::timeout) return false;
  }
}

void Client::release_staging(const Window& w) {
  {
    std::lock_guard<std::mutex> lk(stg_mu_);
    if (w.in_len) erase_interval(&in_busy_, w.in_base, w.in_base + w.in_len);
    if (w.out_len) erase_interval(&out_busy_, w.out_base, w.out_base + w.out_len);
  }
  stg_cv_.notify_all();
}

}  // namespace fakegpu
