#include "fake/fake_events.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "core/env.h"
#include "fake/fake_accounting.h"
#include "api/export.h"

extern char** environ;

namespace fakegpu::fake {
namespace {

constexpr size_t kFlushBytes = 1 << 20;

struct Log {
  std::mutex mu;
  bool opened = false, finished = false;
  int fd = -1;
  pid_t owner = 0;
  std::string path, buffer;
  bool write_failed = false;
};

Log& the_log() {
  static Log* log = new Log();  // never destroyed: the exit handler still uses it
  return *log;
}

bool quiet() { return env::str("FAKEGPU_QUIET") == "1"; }

void note(const std::string& msg) {
  if (!quiet()) fprintf(stderr, "fakegpu fake: %s\n", msg.c_str());
}

std::string report_path() {
  std::string p = env::str("FAKEGPU_FAKE_REPORT_PATH");
  return p.empty() ? env::str("FAKEGPU_CLUSTER_REPORT_PATH") : p;
}

std::string default_events_path() {
  std::string p = env::str("FAKEGPU_FAKE_EVENTS_PATH");
  if (!p.empty()) return p;
  std::string r = report_path();
  if (!r.empty()) {
    if (r.size() > 5 && r.compare(r.size() - 5, 5, ".json") == 0) r.resize(r.size() - 5);
    return r + ".events.jsonl";
  }
  return env::str("TMPDIR", "/tmp") + "/fakegpu-fake-events-" + std::to_string(getpid()) + ".jsonl";
}

// Writes the buffer to the file; called with the lock held.
void drain(Log& log) {
  size_t off = 0;
  while (off < log.buffer.size() && log.fd >= 0) {
    ssize_t w = write(log.fd, log.buffer.data() + off, log.buffer.size() - off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      if (!log.write_failed) note("cannot write the event file " + log.path + ": " + strerror(errno));
      log.write_failed = true;
      break;
    }
    off += static_cast<size_t>(w);
  }
  log.buffer.clear();
}

void at_exit() { finish(); }

// Runs the report builder; bounded by FAKEGPU_FAKE_REPORT_TIMEOUT seconds.
int build_report(const std::string& events, const std::string& report) {
  std::string python = env::str("FAKEGPU_PYTHON", "python3");
  std::vector<std::string> args = {python, "-m", "fakegpu.fake.build_report", events, "--report", report};
  // FAKEGPU_FAKE_REPORT_PATH owns its own Markdown (beside it), as in the torch backend.
  std::string md = env::str("FAKEGPU_FAKE_REPORT_PATH").empty() ? env::str("FAKEGPU_CLUSTER_REPORT_MARKDOWN_PATH") : "";
  if (!md.empty()) args.insert(args.end(), {"--markdown", md});
  std::string cfg = env::str("FAKEGPU_CLUSTER_CONFIG");
  if (!cfg.empty()) args.insert(args.end(), {"--cluster-config", cfg});
  std::string trace = env::str("FAKEGPU_TRACE_PATH");
  if (!trace.empty()) args.insert(args.end(), {"--trace", trace});
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(&a[0]);
  argv.push_back(nullptr);

  // The builder's "wrote ..." line goes to stderr: the program's stdout stays its own.
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, 2, 1);
  pid_t pid;
  int rc = posix_spawnp(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    note("cannot run " + python + " to build the report (" + strerror(rc) + "); events are in " + events +
         " (python -m fakegpu.fake.build_report " + events + " --report " + report + ")");
    return 1;
  }
  long long timeout_s = env::integer("FAKEGPU_FAKE_REPORT_TIMEOUT", 600);
  timespec start;
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (;;) {
    int status = 0;
    pid_t w = waitpid(pid, &status, WNOHANG);
    if (w == pid) {
      if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return 0;
      note("building the report from " + events + " failed (status " + std::to_string(status) + ")");
      return 1;
    }
    if (w < 0 && errno != EINTR) {
      note(std::string("waiting for the report builder failed: ") + strerror(errno));
      return 1;
    }
    timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (now.tv_sec - start.tv_sec > timeout_s) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      note("the report builder ran past FAKEGPU_FAKE_REPORT_TIMEOUT=" + std::to_string(timeout_s) +
           " s and was stopped; events are in " + events);
      return 1;
    }
    timespec nap{0, 20 * 1000 * 1000};
    nanosleep(&nap, nullptr);
  }
}

}  // namespace

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

void log_event(const Contract& c, const std::string& json_object) {
  Log& log = the_log();
  std::lock_guard<std::mutex> lk(log.mu);
  if (log.finished) return;
  // A forked child shares the parent's file: its operations are not the logical rank's.
  if (log.opened && log.owner != getpid()) return;
  if (!log.opened) {
    log.opened = true;
    log.owner = getpid();
    log.path = default_events_path();
    log.fd = open(log.path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (log.fd < 0) note("cannot open the event file " + log.path + ": " + strerror(errno) + " (no report)");
    atexit(at_exit);
    log.buffer += world_line(c, "native") + "\n";
  }
  log.buffer += json_object;
  log.buffer += '\n';
  if (log.buffer.size() >= kFlushBytes) drain(log);
}

std::string events_path() {
  Log& log = the_log();
  std::lock_guard<std::mutex> lk(log.mu);
  return log.path;
}

void flush() {
  Log& log = the_log();
  std::lock_guard<std::mutex> lk(log.mu);
  if (log.opened && !log.finished && log.owner == getpid()) drain(log);
}

int finish() {
  Log& log = the_log();
  std::string events, report;
  {
    std::lock_guard<std::mutex> lk(log.mu);
    if (!log.opened || log.finished || log.owner != getpid()) return 0;
    log.finished = true;
    drain(log);
    if (log.fd >= 0) close(log.fd);
    log.fd = -1;
    if (log.write_failed) return 1;
    events = log.path;
  }
  report = report_path();
  if (report.empty()) {
    note("events written to " + events + " (set FAKEGPU_CLUSTER_REPORT_PATH for a report; or run "
         "python -m fakegpu.fake.build_report " + events + " --report report.json)");
    return 0;
  }
  return build_report(events, report);
}

}  // namespace fakegpu::fake

// Writes the events and the report now instead of at exit (idempotent; later fake
// operations are no longer logged). 0 on success.
extern "C" __attribute__((visibility("default"))) int fakegpu_fake_finish(void) { return fakegpu::fake::finish(); }
