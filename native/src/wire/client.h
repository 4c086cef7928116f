// The process's one persistent connection to the coordinator.
//
// Requests carry ids; any number of threads may have requests outstanding. There is no
// reader thread: a waiting thread becomes the "leader" and reads frames off the socket,
// handing frames that belong to other waiters over to them (leader/follower). With one
// thread — the common case — a call costs one send and one receive and no thread switch.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "nccl.h"
#include "wire/protocol.h"

namespace fakegpu {

class Client;

// Consumes a response body straight off the stream (e.g. into user buffers), so large
// socket-staged payloads are not copied through an intermediate buffer. Runs on whichever
// thread is reading when the response arrives, while the owner waits.
class BodySink {
 public:
  virtual ~BodySink() = default;
  virtual bool wants(const proto::FrameHeader& h) const = 0;
  // Must read exactly h.body_len bytes through c.read_exact / c.read_discard.
  virtual bool consume(Client& c, const proto::FrameHeader& h, std::string* err) = 0;
};

// One outstanding request. Lives on the requesting thread's stack (or in a comm being
// initialised); registered with the client between request() and the end of wait().
struct Pending {
  uint32_t id = 0;
  BodySink* sink = nullptr;
  std::vector<uint8_t> body;  // the response body when no sink took it
  proto::FrameHeader hdr;     // the response header
  bool done = false;
  bool claimed = false;  // a reader is filling this right now; the owner must stay
  ncclResult_t fail = ncclSuccess;  // connection-level failure (no response)
  std::string fail_msg;
};

class Client {
 public:
  // The process-wide connection, opened (HELLO) on first use; a forked child opens its own.
  static ncclResult_t get(Client** out);

  uint64_t staging_bytes() const { return staging_bytes_; }
  bool shm() const { return shm_base_ != nullptr; }
  uint8_t* shm_in() const { return shm_base_; }
  uint8_t* shm_out() const { return shm_base_ + staging_bytes_; }
  uint32_t timeout_ms() const { return timeout_ms_; }
  uint32_t client_id() const { return client_id_; }
  // Both sides agreed on host-local collectives (HELLO bit1): ARENA requests are answered.
  bool local_collectives() const { return local_; }
  const std::string& address() const { return address_; }
  // Largest body we accept or send: 2 * staging + 16 MiB (docs/protocol.md).
  uint64_t max_body() const { return 2 * staging_bytes_ + (16u << 20); }

  // Sends one request whose body is the concatenation of iov[0..iovcnt). `p` is
  // registered before the bytes leave, so its response cannot be missed.
  ncclResult_t request(Pending* p, uint16_t type, const iovec* iov, int iovcnt);
  // Blocks until p's response arrived, the connection failed, or the wait timed out
  // (after `timeout_ms`, or wait_timeout_ms() when negative; *timed_out tells which).
  ncclResult_t wait(Pending* p, int timeout_ms = -1, bool* timed_out = nullptr);
  // False once the coordinator closed the connection (checked without blocking or reading).
  bool connection_alive();
  // Sends a frame that is never answered (request_id 0), e.g. LOCAL_OPS.
  ncclResult_t post(uint16_t type, const iovec* iov, int iovcnt);
  // request + wait with one body buffer.
  ncclResult_t call(Pending* p, uint16_t type, const std::vector<uint8_t>& body);

  // For BodySinks (reader thread only).
  bool read_exact(void* dst, size_t n);
  bool read_discard(size_t n);

  // Several threads may each have a GROUP frame in flight; each frame holds a window of
  // the input and of the output region for its steps. Blocks (bounded by the wait timeout)
  // while other frames hold the space; false when it never freed up.
  struct Window {
    uint64_t in_base = 0, in_len = 0, out_base = 0, out_len = 0;
  };
  bool reserve_staging(uint64_t in_need, uint64_t out_need, Window* w);
  void release_staging(const Window& w);
  int wait_timeout_ms() const;

  // Fork support: forget the inherited connection without touching the parent's.
  void abandon_after_fork();

 private:
  Client() = default;
  static ncclResult_t connect_new(Client** out);
  // One try at connecting and HELLO; *retry when the coordinator closed the connection
  // before answering HELLO (it may be shedding connections: trying again can succeed).
  static ncclResult_t connect_once(const std::string& transport, const std::string& addr, uint64_t staging,
                                   bool want_shm, uint32_t timeout_ms, int answer_timeout_ms, long long deadline_ms,
                                   bool* retry, Client** out);
  ncclResult_t hello(int answer_timeout_ms, bool* retry);
  // Maps the staging segment the coordinator granted (after making sure it is allocated).
  ncclResult_t map_staging();

  enum ReadOutcome { kFrame, kIdleTimeout, kDead };
  ReadOutcome read_one_frame();
  // Refill rbuf_; >0 bytes, 0 EOF, -1 error (errno), -2 receive timeout.
  ssize_t fill();
  // Fails every outstanding request; `reader_claim` is the one the calling reader holds.
  void mark_dead(const std::string& why, Pending* reader_claim = nullptr);
  void unregister(Pending* p);
  bool send_all(const iovec* iov, int iovcnt, std::string* err);
  ncclResult_t send_frame(uint16_t type, uint32_t id, const iovec* iov, int iovcnt, size_t body_len);

  int fd_ = -1;
  std::string address_;  // "unix:/path" or "tcp:host:port", for messages
  uint32_t client_id_ = 0;
  uint32_t timeout_ms_ = 0;  // the coordinator's rendezvous timeout, from HELLO_OK
  uint64_t staging_bytes_ = 0;
  uint8_t* shm_base_ = nullptr;
  bool local_ = false;
  size_t shm_map_len_ = 0;
  std::string shm_name_;
  int shm_fd_ = -1;  // the staging segment, open from creation until HELLO is answered

  std::atomic<uint32_t> next_id_{1};
  std::mutex send_mu_;  // one frame at a time on the wire

  std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  std::vector<Pending*> pending_;
  bool reading_ = false;  // some thread is the leader
  bool dead_ = false;
  std::string dead_msg_;

  // Buffered receive side; touched only by the current leader.
  std::vector<uint8_t> rbuf_ = std::vector<uint8_t>(64 * 1024);
  size_t rpos_ = 0, rlen_ = 0;

  std::mutex stg_mu_;
  std::condition_variable stg_cv_;
  std::vector<std::pair<uint64_t, uint64_t>> in_busy_, out_busy_;  // [begin, end), sorted
};

}  // namespace fakegpu
