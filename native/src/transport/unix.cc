#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <cstddef>

#include "transport/transport.h"

namespace fakegpu::transport {

namespace {
long long now_ms() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}
}  // namespace

void tune_socket(int fd, int io_timeout_ms) {
  int buf = 4 << 20;  // the kernel caps this at [rw]mem_max; best effort
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  if (io_timeout_ms > 0) {
    timeval tv;
    tv.tv_sec = io_timeout_ms / 1000;
    tv.tv_usec = (io_timeout_ms % 1000) * 1000;
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  }
}

int connect_unix(const std::string& path, int connect_timeout_ms, std::string* err) {
  sockaddr_un addr;
  memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  bool abstract = !path.empty() && path[0] == '@';
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    *err = path.empty() ? "empty socket path"
                        : "socket path is longer than " + std::to_string(sizeof(addr.sun_path) - 1) + " bytes";
    return -1;
  }
  memcpy(addr.sun_path, path.data(), path.size());
  if (abstract) addr.sun_path[0] = '\0';
  socklen_t len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + path.size() + (abstract ? 0 : 1));

  long long deadline = now_ms() + (connect_timeout_ms > 0 ? connect_timeout_ms : 0);
  for (;;) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      *err = std::string("socket(AF_UNIX): ") + strerror(errno);
      return -1;
    }
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) == 0) return fd;
    int e = errno;
    close(fd);
    bool retryable = (e == ENOENT || e == ECONNREFUSED || e == EAGAIN);
    if (!retryable || now_ms() >= deadline) {
      *err = strerror(e);
      return -1;
    }
    usleep(20 * 1000);
  }
}

}  // namespace fakegpu::transport
