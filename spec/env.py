"""Every environment variable fakegpu reads, declared once.

spec/generate.py writes the table of docs/usage.md ("Environment variables") from this list, and
tests/unit/test_wire_spec.py checks it against the code: every FAKEGPU_* name that the shim
(native/src) or the Python package (fakegpu/) reads must be declared here, and every one declared
must be read somewhere. Rows: (variables as the table shows them, default, read by, meaning).
"""

VARIABLES = [
    ('`LD_PRELOAD`', '—', 'dynamic linker', "Must start with the shim's path. Only a preloaded library whose SONAME is `libnccl.so.2` replaces the NCCL that torch's wheels find through their RPATH; `LD_LIBRARY_PATH` does not."),
    ('`FAKEGPU_NCCL_LIBRARY`', 'the installed or `./build` shim', 'fakegpu (Python)', 'Which `libnccl.so.2` `fakegpu.nccl_library_path()` returns (and so what fgpu preloads).'),
    ('`FAKEGPU_MODE`', '`simulate`', 'shim', 'Compute mode, see `--mode`.'),
    ('`FAKEGPU_DIST_MODE`', '`simulate`', 'shim', 'Distribution mode, see `--dist-mode`.'),
    ('`FAKEGPU_COORDINATOR_TRANSPORT`', '`unix`', 'shim', '`unix` or `tcp`.'),
    ('`FAKEGPU_COORDINATOR_ADDR`', 'none — an error at the first NCCL call when a coordinator is needed', 'shim', 'Absolute socket path, or `HOST:PORT`.'),
    ('`FAKEGPU_COORDINATOR_TOKEN`', 'empty', 'shim, coordinator', 'The token itself. Prefer the file: environment variables are easy to leak into logs.'),
    ('`FAKEGPU_COORDINATOR_TOKEN_FILE`', 'none', 'shim, coordinator', 'File holding the token (read by the rule under [Token files](#token-files)). Set only one of it and `FAKEGPU_COORDINATOR_TOKEN`: both set is an error in the shim and the coordinator.'),
    ('`FAKEGPU_COORDINATOR_TIMEOUT_MS`', '600000', "coordinator (the shim adopts the coordinator's value at connect)", 'Rendezvous and operation timeout.'),
    ('`FAKEGPU_CLIENT_WAIT_MARGIN_MS`', '30000', 'shim', "How much longer than the coordinator's timeout a rank waits for an answer before it declares the coordinator unresponsive (`ncclSystemError`)."),
    ('`FAKEGPU_CONNECT_TIMEOUT_MS`', '2000', 'shim', 'How long a rank tries to connect before failing with a message that names the address (short, so that a rank started without its coordinator says so at once). A coordinator that closes the connection before answering HELLO (it sheds connections beyond `--max-unauthenticated`, or is out of descriptors) is tried again while the timeout lasts.'),
    ('`FAKEGPU_HELLO_ANSWER_TIMEOUT_MS`', '30000', 'shim', 'Once connected, how long a rank waits for the coordinator to answer HELLO before failing with `ncclSystemError` (the coordinator is there but overloaded or stuck). Long, because a coordinator sharing a small machine with ranks that are importing torch can be descheduled for seconds.'),
    ('`FAKEGPU_COORDINATOR_HELLO_TIMEOUT_MS`', '10000', 'coordinator', 'A connection that has not completed HELLO by then is closed (also `--hello-timeout-ms`).'),
    ('`FAKEGPU_COORDINATOR_MAX_UNAUTHENTICATED`', '256', 'coordinator', 'Connections open at once without a completed HELLO; a new one beyond this closes the oldest (also `--max-unauthenticated`).'),
    ('`FAKEGPU_STAGING_CHUNK_BYTES`', 'unset: the coordinator chooses', 'shim', 'Staging size requested from the coordinator, which may grant less. Unset, the coordinator picks 32 MiB, shrunk by powers of two until the segments of all `WORLD_SIZE` ranks (2 × S each) fit a quarter of the smaller of `/dev/shm` and the machine\'s memory, but never below 64 KiB: 4 MiB for 512 ranks and 1 MiB for 2048 on a 24 GiB host (docs/protocol.md, "Staging size"). Set it for every rank alike: ranks cut large calls by it, and ranks that cut one differently fail it with `ncclInvalidUsage`. A segment that `/dev/shm` cannot hold is not an error: that rank moves its payloads through its socket (the coordinator logs it).'),
    ('`FAKEGPU_STAGING_FORCE_SOCKET`', 'off', 'shim', '`1` sends payloads in the socket stream instead of shared memory.'),
    ('`FAKEGPU_LOCAL_COLLECTIVES`', 'on', 'shim, coordinator', '`0` (or `false`/`no`/`off`) sends every collective through the coordinator. When on, a call alone in its group (AllReduce, Broadcast, Reduce, AllGather, ReduceScatter) on a communicator whose ranks all share the coordinator\'s host runs among the ranks in a shared-memory arena: same results, same report entries, a fraction of the latency. Fault injection switches it off by itself. See docs/protocol.md, "Host-local collectives".'),
    ('`FAKEGPU_LOCAL_SLOT_BYTES`', '1 MiB, less for large communicators', 'coordinator', 'Bytes per rank an arena moves per round (a multiple of 4096, at least 4096; also `--local-slot-bytes`). Each arena maps `2·(n+1)` slots.'),
    ('`FAKEGPU_REDUCTION_ORDER`', '`rank`; `gloo` in processes that use the `fakegpu` torch backend', 'shim, `fakegpu.torch`', "How a rank's communicators associate floating-point reductions: `rank` folds in rank order (((x0 op x1) op x2) ...), `gloo` as torch 2.13's CPU gloo backend does, bit for bit (docs/numerics.md, \"Reduction order\"). Read when a communicator is created; every rank of a communicator must use the same. The torch backend sets `gloo` when the variable is unset."),
    ('`FAKEGPU_CLUSTER_CONFIG`', 'none', 'coordinator', 'Cluster YAML.'),
    ('`FAKEGPU_REDUCE_THREADS`', 'usable CPUs, at most 8', 'coordinator', 'Threads that share a large reduction or copy (above 4 MiB touched); 1 keeps the coordinator single-threaded.'),
    ('`FAKEGPU_FAULTS`', 'none', 'coordinator', 'Faults to inject (kill, hang, delay, drop, slow_link); see docs/faults.md.'),
    ('`FAKEGPU_CLUSTER_REPORT_PATH`', 'none (fgpu: `./fakegpu-report.json`)', 'coordinator', 'JSON report; written atomically at shutdown.'),
    ('`FAKEGPU_CLUSTER_REPORT_MARKDOWN_PATH`', 'beside the JSON, `.md`', 'coordinator', 'Markdown report.'),
    ('`FAKEGPU_CLUSTER_REPORT_MAX_OPERATIONS`', '4096', 'coordinator', 'Timeline length; 0 disables it.'),
    ('`FAKEGPU_TRACE_PATH`', 'none', 'coordinator', 'Chrome-trace / Perfetto timeline.'),
    ('`FAKEGPU_DEVICE_COUNT`', '`LOCAL_WORLD_SIZE`, else 1', 'fake CUDA devices (torch autoload hook); shim (hybrid/fake modes)', 'Number of fake devices exposed.'),
    ('`FAKEGPU_FAKE_CUDA`', 'fgpu: `1` in simulate mode, `0` in hybrid', 'torch autoload hook', '`1`: fake CUDA devices in every rank whose torch has no usable GPU (docs/fake-cuda.md). Set `0` before fgpu to keep them off.'),
    ('`FAKEGPU_PLAN_RECORD`', 'none', 'fake worlds (set by `fgpu plan`)', "Set by `fgpu plan` on a user's script, not by you: the file where the planning process writes the ops and collectives of the steps it recorded (docs/planning.md)."),
    ('`FAKEGPU_MEMORY_CAPTURE_PATH`', 'none', '`fakegpu.fake.memory`', 'Memory capture file.'),
    ('`NGPU`, `FAKE_PP_RANK`, `FAKEGPU_PP_DEGREE`', '—', 'fake worlds', "Logical world size, this process's pipeline coordinate and the pipeline degree in the fake modes (see docs/fake-worlds.md)."),
    ('`FAKEGPU_TORCH_AUTOLOAD`', '`1`', '`fakegpu.torch` autoload hook', '`0` stops the hook from registering the `fakegpu` torch backend.'),
    ('`FAKEGPU_DEBUG`', 'off', 'shim', 'Also print every error the shim reports to stderr.'),
    ('`RANK`, `LOCAL_RANK`, `WORLD_SIZE`', '—', 'shim', "Sent to the coordinator at connect; `RANK` becomes the process's global rank, which places it on a node of the cluster YAML. torchrun sets them."),
    ('`FAKEGPU_QUIET`', 'off', 'shim (fake mode), fake worlds', "`1` silences the fake modes' start and report lines on stderr."),
    ('`FAKEGPU_FAKE_TIMEOUT`', '300', '`fakegpu_fake` torch backend', 'Seconds a fake-world group waits (the torch ProcessGroup timeout when the program gives none).'),
    ('`FAKEGPU_FAKE_MERGE_TIMEOUT`', '60', 'fake worlds (real-pipeline mode)', "Seconds the pipeline stages' processes wait for each other's events when the whole-world report is merged."),
    ('`FAKEGPU_TORCH_EAGER_INIT`', '`1`', '`fakegpu` torch backend', "`0` defers connecting each group's communicator to its first collective."),
    ('`FAKEGPU_CUDART_PATH`', 'found at run time', 'shim (hybrid mode)', 'The CUDA runtime library to load (docs/gpu.md).'),
    ('`FAKEGPU_CUDA_PIN_STAGING`', 'on', 'shim (hybrid mode)', '`0` stages device buffers through pageable instead of pinned host memory (docs/gpu.md).'),
    ('`FAKEGPU_REAL_NCCL_PATH`', 'the nvidia-nccl wheel on `sys.path`', 'shim (proxy, passthrough)', "NVIDIA's `libnccl.so.2` to forward calls to (docs/gpu.md)."),
    ('`FAKEGPU_REAL_NCCL_TIMEOUT_MS`', '600000', 'shim (proxy, passthrough)', 'How long a forwarded non-blocking call may stay in progress (docs/gpu.md).'),
    ('`FAKEGPU_FAKE_COMM_STRIDES`', 'none', 'shim (fake mode)', "Hints that place a C program's sub-communicators in the logical world (docs/fake-worlds.md)."),
    ('`FAKEGPU_FAKE_EVENTS_PATH`', 'beside the report, `.events.jsonl`', 'shim (fake mode), fake worlds', "The event log a fake world's report is built from (docs/fake-worlds.md)."),
    ('`FAKEGPU_FAKE_REPORT_PATH`', 'none', 'shim (fake mode), fake worlds', 'Where a fake world writes its report at exit (docs/fake-worlds.md).'),
    ('`FAKEGPU_FAKE_REPORT_TIMEOUT`', '600', 'shim (fake mode)', 'Seconds the report hook at exit may take (docs/fake-worlds.md).'),
    ('`FAKEGPU_PHYSICAL_RANKS`', '—', 'fake worlds (real-pipeline mode)', 'The logical ranks each physical process plays (set by fgpu; docs/fake-worlds.md).'),
    ('`FAKEGPU_PYTHON`', 'the interpreter that ran fgpu', 'fgpu, `build/fakegpu-coordinator`', "The Python that runs the coordinator and fakegpu's helpers."),
    ('`FAKEGPU_FAKE_WORLD_ENTRY`', '`1`', 'fake worlds (startup hook)', "`0` stops the program's own `init_process_group()` from entering the fake world, and `WORLD_SIZE`/`RANK` from being rewritten to the logical world's (docs/fake-worlds.md)."),
    ('`FAKEGPU_LAUNCH_WORLD_SIZE`, `FAKEGPU_LAUNCH_RANK`, `FAKEGPU_FAKE_WORLD_ENV`', '—', 'fake worlds (startup hook)', "Set by the startup hook, not by you: the launcher's own `WORLD_SIZE` and `RANK` (the physical processes) once the hook rewrote them to the logical world's, and a mark that the rewrite happened."),
    ('`FAKEGPU_FAKE_CUDA_MEMORY`', '`1`', 'fake CUDA devices', "`1`: per-device memory accounting by the C++ storage tracker (compiled against the installed torch at first use), or by a Python dispatch mode when it cannot be built; `python` asks for the Python mode (about 20 us more per op); `0` leaves the accounting out: the memory API then reports nothing allocated (docs/fake-cuda.md)."),
    ('`FAKEGPU_CACHE_DIR`', '`$XDG_CACHE_HOME/fakegpu`, else `~/.cache/fakegpu`', 'fake CUDA devices', "Where the C++ storage tracker is compiled, once per torch version (`torch-ext/`)."),
]

# The units of a size in the environment (FAKEGPU_STAGING_CHUNK_BYTES, FAKEGPU_LOCAL_SLOT_BYTES,
# fgpu's size flags), case-blind: the bare letters and IEC names are binary, SI names decimal
# ("16MB" is 16,000,000 bytes, "16M" and "16MiB" 16,777,216). Written into both parsers, the
# shim's env::bytes and fakegpu.env.parse_size; tests/vectors/size_vectors.json holds them to it.
SIZE_UNITS = [("", 1), ("b", 1),
              ("k", 1 << 10), ("kb", 1000), ("kib", 1 << 10),
              ("m", 1 << 20), ("mb", 1000 ** 2), ("mib", 1 << 20),
              ("g", 1 << 30), ("gb", 1000 ** 3), ("gib", 1 << 30),
              ("t", 1 << 40), ("tb", 1000 ** 4), ("tib", 1 << 40)]
