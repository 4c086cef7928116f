#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "transport/transport.h"

namespace fakegpu::transport {

namespace {

long long now_ms() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

bool split_host_port(const std::string& s, std::string* host, std::string* port) {
  if (!s.empty() && s[0] == '[') {
    size_t close = s.find(']');
    if (close == std::string::npos || close + 1 >= s.size() || s[close + 1] != ':') return false;
    *host = s.substr(1, close - 1);
    *port = s.substr(close + 2);
  } else {
    size_t colon = s.rfind(':');
    if (colon == std::string::npos) return false;
    *host = s.substr(0, colon);
    *port = s.substr(colon + 1);
  }
  return !host->empty() && !port->empty();
}

// Non-blocking connect bounded by `timeout_ms`; returns 0 or an errno value.
int connect_with_timeout(int fd, const sockaddr* sa, socklen_t len, int timeout_ms) {
  int fl = fcntl(fd, F_GETFL, 0);
  fcntl(fd, F_SETFL, fl | O_NONBLOCK);
  int rc = connect(fd, sa, len);
  int e = rc == 0 ? 0 : errno;
  if (rc != 0 && e == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    int pr = poll(&p, 1, timeout_ms > 0 ? timeout_ms : 1);
    if (pr <= 0) {
      e = pr == 0 ? ETIMEDOUT : errno;
    } else {
      socklen_t el = sizeof(e);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el);
    }
  }
  fcntl(fd, F_SETFL, fl);
  return e;
}

}  // namespace

int connect_tcp(const std::string& host_port, int connect_timeout_ms, std::string* err) {
  std::string host, port;
  if (!split_host_port(host_port, &host, &port)) {
    *err = "expected host:port, got '" + host_port + "'";
    return -1;
  }
  addrinfo hints;
  memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int gai = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (gai != 0) {
    *err = std::string("cannot resolve: ") + gai_strerror(gai);
    return -1;
  }
  long long deadline = now_ms() + (connect_timeout_ms > 0 ? connect_timeout_ms : 0);
  int last = ECONNREFUSED;
  for (;;) {
    for (addrinfo* ai = res; ai; ai = ai->ai_next) {
      int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
      if (fd < 0) {
        last = errno;
        continue;
      }
      long long left = deadline - now_ms();
      last = connect_with_timeout(fd, ai->ai_addr, ai->ai_addrlen, left > 1000 ? 1000 : (left > 0 ? (int)left : 1));
      if (last == 0) {
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
        freeaddrinfo(res);
        return fd;
      }
      close(fd);
    }
    bool retryable = (last == ECONNREFUSED || last == ETIMEDOUT || last == EAGAIN);
    if (!retryable || now_ms() >= deadline) break;
    usleep(50 * 1000);
  }
  freeaddrinfo(res);
  *err = strerror(last);
  return -1;
}

}  // namespace fakegpu::transport
