// The fake mode's event log (fakegpu/fake/events.py's JSON-lines format) and the report
// written from it at process exit.
//
// Where: FAKEGPU_FAKE_EVENTS_PATH; else beside the report (report path with ".json"
// replaced by ".events.jsonl"); else $TMPDIR/fakegpu-fake-events-<pid>.jsonl. Lines are
// buffered in memory and written in large chunks (no per-operation sync); the buffer goes
// to the file when a communicator is destroyed, at exit, or when fakegpu_fake_finish() is
// called.
//
// The report: FAKEGPU_FAKE_REPORT_PATH, else FAKEGPU_CLUSTER_REPORT_PATH. When one is set,
// the exit handler runs `PYTHON -m fakegpu.fake.build_report EVENTS --report R
// [--markdown M] [--cluster-config C] [--trace T]` (PYTHON = FAKEGPU_PYTHON or python3),
// waiting at most FAKEGPU_FAKE_REPORT_TIMEOUT seconds (default 600) for it. That makes a
// plain LD_PRELOAD run produce the report, and `fgpu --dist-mode fake` too (fgpu sets the
// report variables and prints the summary afterwards).
#pragma once

#include <string>

#include "fake/fake_contract.h"

namespace fakegpu::fake {

// Appends one complete JSON object (no newline) to the log; opens the log and writes the
// world line on first use. Thread-safe.
void log_event(const Contract& contract, const std::string& json_object);

// Writes the buffered lines to the file now (a communicator was destroyed: a program that
// leaves with _exit afterwards still leaves its events).
void flush();

// Flushes the log and, if a report path is set, builds the report; idempotent and only
// done in the process that opened the log (a forked child does nothing). Returns 0 when
// there was nothing to do or the report was written.
int finish();

// JSON string literal for `s` (quotes included).
std::string json_string(const std::string& s);

// The events file path this process uses (empty before the first event).
std::string events_path();

}  // namespace fakegpu::fake
