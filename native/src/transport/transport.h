// Opening the one stream connection to the coordinator. Each transport turns an address
// into a connected, blocking stream socket; everything above works on the fd.
#pragma once

#include <string>

namespace fakegpu::transport {

// Unix stream socket at `path` ("@name" = Linux abstract namespace). Retries a refused or
// missing socket until `connect_timeout_ms` (the coordinator may still be starting).
// Returns the fd, or -1 with *err set.
int connect_unix(const std::string& path, int connect_timeout_ms, std::string* err);

// TCP to "host:port" or "[v6addr]:port", with TCP_NODELAY. Same retry/timeout rule.
int connect_tcp(const std::string& host_port, int connect_timeout_ms, std::string* err);

// Socket options shared by both transports: big buffers (large payloads go through the
// stream when shared memory is off) and per-call send/receive timeouts.
void tune_socket(int fd, int io_timeout_ms);

}  // namespace fakegpu::transport
