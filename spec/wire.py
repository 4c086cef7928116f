"""The wire protocol's tables, declared once (docs/protocol.md explains them).

Plain data only: spec/generate.py turns this file into native/src/generated/wire_spec.h (C++),
fakegpu/wire_spec.py (Python) and the generated tables of docs/protocol.md. Edit this file and run
`python spec/generate.py`; tests/unit/test_wire_spec.py fails while a generated file is stale.
"""

VERSION = 2
MAGIC = "FGPU"

# (name, wire type) of the 16-byte frame header, in order.
HEADER = [("magic", "u8[4]"), ("version", "u16"), ("type", "u16"), ("request_id", "u32"), ("body_len", "u32")]

# type, NAME, direction (c2s: client to coordinator), body as docs/protocol.md describes it.
# "large": the body may exceed the small-frame limit; "unanswered": the coordinator never replies.
MESSAGES = [
    (1, "HELLO", "c2s", "see below; must be the first frame", {}),
    (2, "HELLO_OK", "s2c", "u32 client_id, u32 flags (bit0: shared memory accepted; bit1: ARENA is answered, "
                           "see \"Host-local collectives\"), u64 staging_bytes granted, u32 timeout_ms", {}),
    (3, "ERROR", "s2c", "i32 nccl_result, str message (answer to any request that failed as a whole)", {}),
    (4, "OK", "s2c", "empty", {}),
    (10, "COMM_INIT", "c2s", "u8[128] unique_id, i32 nranks, i32 rank, str name", {}),
    (11, "COMM_INFO", "s2c", "u64 comm_handle, i32 rank, i32 nranks, i32 global_ranks[nranks]", {}),
    (12, "COMM_SPLIT", "c2s", "u64 parent_handle, i32 color, i32 key, str name", {}),
    (13, "COMM_FREE", "c2s", "u64 comm_handle, u32 how (0 destroy, 1 abort, 2 finalize) → OK", {}),
    (14, "COMM_SHRINK", "c2s", "u64 parent_handle, u32 flags (ncclCommShrink's shrinkFlags), u32 n_excluded, "
                               "i32 excluded[n_excluded], str name → COMM_INFO", {}),
    (15, "ARENA", "c2s", "u64 comm_handle → ARENA_INFO; see \"Host-local collectives\"", {}),
    (16, "ARENA_INFO", "s2c", "u32 granted, u32 rank, u64 slot_bytes, u64 total_bytes, str path, str reason", {}),
    (17, "PROBE_SOURCE", "c2s", "u64 comm_handle, u32 timeout_ms (0: the coordinator's), u32 nranks, "
                                "u32 recvs_posted[nranks] (the caller's Recv calls from each rank so far) → SOURCE, "
                                "or ERROR `ncclTimeout`; see \"Receive from any source\"", {}),
    (18, "SOURCE", "s2c", "i32 peer: the rank (in the communicator) whose Send to the caller waits unclaimed", {}),
    (20, "GROUP", "c2s", "u32 n_ops, u32 flags, OpDesc[n_ops], then socket-staged input bytes", {"large": True}),
    (21, "GROUP_DONE", "s2c", "u32 n_ops, i32 results[n_ops], str message, then socket-staged output bytes",
     {"large": True}),
    (22, "SIMULATE", "c2s", "u32 n_ops, u32 flags, OpDesc[n_ops] (no payload)", {"large": True}),
    (23, "SIMULATE_DONE", "s2c", "f64 estimated_time_us", {}),
    (24, "ACCOUNT", "c2s", "u32 n_ops, u32 flags, OpDesc[n_ops] (no payload) → GROUP_DONE (no payload); "
                           "proxy mode, see below", {"large": True}),
    (25, "LOCAL_OPS", "c2s", "u64 comm_handle, u32 n_records, u32 nranks, then n_records records; never answered; "
                             "see \"Host-local collectives\"", {"large": True, "unanswered": True}),
    (30, "PING", "c2s", "empty, or str token → PONG (before HELLO a coordinator with a token needs it, "
                        "see \"Authentication\")", {}),
    (31, "PONG", "s2c", "str coordinator description (JSON text: version, pid, transport, clients)", {}),
    (32, "SHUTDOWN", "c2s", "str token → OK; the coordinator writes its reports and exits", {}),
]

# The 88-byte OpDesc of GROUP / SIMULATE / ACCOUNT and of arena and LOCAL_OPS records, in order:
# (field, wire type, short name of its index in a decoded tuple (D_<short>), what it holds).
OPDESC = [
    ("comm_handle", "u64", "HANDLE", "comm_handle"),
    ("kind", "u8", "KIND", "kind: {kinds}"),
    ("datatype", "u8", "DTYPE", "datatype (`ncclDataType_t`, 0..11)"),
    ("redop", "u8", "REDOP", "redop: {redops}"),
    ("flags", "u8", "FLAGS", "flags: bit0 in place, bit1 first step of the call, bit2 last step of the call, "
                    "bit3 **rejected** (see \"Matching\"), bits 4-5 the reduction order: {orders} "
                    "(see \"Reduction order\")"),
    ("root", "i32", "ROOT", "root (Broadcast/Reduce/Gather/Scatter) or peer (Send/Recv), rank in the communicator; "
                    "-1 otherwise"),
    ("total_count", "u64", "TOTAL", "total_count: the `count` the user passed"),
    ("step_count", "u64", "STEP", "step_count: the `count` of this step (same meaning as NCCL's count for the kind)"),
    ("in_offset", "u64", "IN_OFF", "in_offset: byte offset of this step's input in the input region"),
    ("in_len", "u64", "IN_LEN", "in_len"),
    ("out_offset", "u64", "OUT_OFF", "out_offset: byte offset of this step's output in the output region"),
    ("out_len", "u64", "OUT_LEN", "out_len"),
    ("scalar", "u8[8]", "SCALAR", "PreMulSum scalar as a value of the op's datatype, left-aligned, zero-padded"),
    ("call_seq", "u32", "CALL_SEQ", "call_seq: this rank's count of calls on this communicator, counted from 1 "
                        "(diagnostics, `FAKEGPU_FAULTS` `seq`)"),
    ("match_seq", "u32", "MATCH_SEQ", "match_seq: the call's place in the matching order, counted from 1 (see \"Matching\")"),
    ("step_index", "u32", "STEP_INDEX", "step_index: this step's place among the steps of its call, from 0"),
    ("step_total", "u32", "STEP_TOTAL", "step_total: how many steps the call has on this rank (at least 1)"),
]

# Flag bits: (NAME, bit, meaning).
OP_FLAGS = [("IN_PLACE", 0, "the call is in place"), ("FIRST_STEP", 1, "first step of its call"),
            ("LAST_STEP", 2, "last step of its call"),
            ("REJECTED", 3, "the shim rejected the call's arguments; the step keeps the rank's place in the order")]
# The reduction order of a reducing step (OpDesc flags bits ORDER_SHIFT.., ORDER_MASK): code, NAME,
# meaning. docs/numerics.md "Reduction order" gives the arithmetic (native/src/numerics/reduce_n.h).
OP_ORDER_SHIFT = 4
OP_ORDER_MASK = 0x30
OP_ORDERS = [(0, "RANK", "rank order"),
             (1, "GLOO_ALLREDUCE", "gloo's ring all-reduce over the call (ReduceScatter: over its n·count input)"),
             (2, "GLOO_REDUCE", "gloo's ring reduce over the call")]
GROUP_FLAGS = [("PARTIAL", 0, "more frames of this group follow"),
               ("UNANSWERED", 1, "rejected placeholders sent outside a group: never answered")]
GROUP_ID_SHIFT = 16  # GROUP flags bits 16..31: the id of a group sent in several frames (0: one frame)
HELLO_FLAGS = [("SHM", 0, "shared-memory staging (offered / accepted)"),
               ("LOCAL", 1, "host-local collectives (the client can run them / ARENA is answered)")]

# Operation kinds. in/out: how many count-sized blocks of this rank's input and output a call
# holds ("n": one per member), and whether only the root has them ("root").
KINDS = [
    # code, name, in, out, properties
    (1, "AllReduce", (1, ""), (1, ""), {"reduces": True, "local": True}),
    (2, "Broadcast", (1, "root"), (1, ""), {"rooted": True, "local": True}),
    (3, "Reduce", (1, ""), (1, "root"), {"reduces": True, "rooted": True, "local": True}),
    (4, "AllGather", (1, ""), ("n", ""), {"local": True, "out_note": "rank j's block at j·c·s"}),
    (5, "ReduceScatter", ("n", ""), (1, ""), {"reduces": True, "local": True}),
    (6, "AlltoAll", ("n", ""), ("n", ""), {"out_note": "block j goes to / comes from rank j"}),
    (7, "Gather", (1, ""), ("n", "root"), {"rooted": True}),
    (8, "Scatter", ("n", "root"), (1, ""), {"rooted": True}),
    (9, "Send", (1, ""), (0, ""), {"p2p": True}),
    (10, "Recv", (0, ""), (1, ""), {"p2p": True}),
]

# ncclDataType_t: code, fakegpu's name, NCCL's enumerator, bytes, floating point.
DATATYPES = [
    (0, "int8", "ncclInt8", 1, False), (1, "uint8", "ncclUint8", 1, False),
    (2, "int32", "ncclInt32", 4, False), (3, "uint32", "ncclUint32", 4, False),
    (4, "int64", "ncclInt64", 8, False), (5, "uint64", "ncclUint64", 8, False),
    (6, "float16", "ncclFloat16", 2, True), (7, "float32", "ncclFloat32", 4, True),
    (8, "float64", "ncclFloat64", 8, True), (9, "bfloat16", "ncclBfloat16", 2, True),
    (10, "float8e4m3", "ncclFloat8e4m3", 1, True), (11, "float8e5m2", "ncclFloat8e5m2", 1, True),
]

# ncclRedOp_t: code, fakegpu's name, NCCL's name.
REDOPS = [(0, "sum", "Sum"), (1, "prod", "Prod"), (2, "max", "Max"), (3, "min", "Min"), (4, "avg", "Avg"),
          (5, "premulsum", "PreMulSum")]

# ncclResult_t: code, NAME (Python constant), NCCL's enumerator.
RESULTS = [
    (0, "SUCCESS", "ncclSuccess"), (1, "UNHANDLED_CUDA_ERROR", "ncclUnhandledCudaError"),
    (2, "SYSTEM_ERROR", "ncclSystemError"), (3, "INTERNAL_ERROR", "ncclInternalError"),
    (4, "INVALID_ARGUMENT", "ncclInvalidArgument"), (5, "INVALID_USAGE", "ncclInvalidUsage"),
    (6, "REMOTE_ERROR", "ncclRemoteError"), (7, "IN_PROGRESS", "ncclInProgress"), (8, "TIMEOUT", "ncclTimeout"),
]

# COMM_FREE.how
FREE_HOW = [(0, "DESTROY"), (1, "ABORT"), (2, "FINALIZE")]

# The host-local arena file's header (docs/protocol.md, "Arena layout").
ARENA_MAGIC = 0x52414746      # the bytes F G A R read as a little-endian u32
ARENA_LAYOUT_VERSION = 2      # 2: rank records hold protocol 2's 88-byte OpDesc
ARENA_HEADER = [("magic", "u32", 0), ("version", "u32", 4), ("nranks", "u32", 8), ("failed", "u32", 12),
                ("slot_bytes", "u64", 16), ("pending", "u32", 24), ("closing", "u32", 28), ("sync", "u64", 64)]
ARENA_RECORDS_AT = 4096       # rank r's 256-byte block (two 128-byte records, one per round parity)
ARENA_RECORD_BLOCK = 256
ARENA_RECORD_BYTES = 128
# One rank's record for a round parity, in order from its start (padded to ARENA_RECORD_BYTES):
# the round it is in, when it arrived (epoch seconds) and its call (the OpDesc of the first round).
ARENA_RECORD = [("round", "u64"), ("arrival", "f64"), ("desc", "OpDesc")]

# OpDesc fields whose default is not 0 (C++ struct initialisers, Python dataclass defaults).
OPDESC_DEFAULTS = {"root": -1, "match_seq": 1, "step_total": 1}

# Message bodies whose codecs are generated (native/src/generated/wire_messages.h) and checked
# against the Python codec (tests/unit/test_wire_spec.py): (struct name, message types that
# carry it, fields in wire order). A field is (name, type) or (name, type, default):
#   u8 u16 u32 i32 u64 f64 - a little-endian value;  str - u16 length + UTF-8 bytes;
#   text - a str that encoders cut at a character boundary rather than refuse (diagnostics);
#   str? - a str that is left out, body and all, when empty (PING's optional token);
#   bytes[N] - N raw bytes;  T[count] - an array of T whose length is the earlier field
#   `count`, which is not a member of its own (its value is the array's length).
#   Rec[count] - an array of the records RECORDS declares. A record's field may be an OpDesc,
#   a scalar or an array sized by a field of the enclosing body (that field then stays a member
#   of the body, and every record carries exactly that many values).
# GROUP / SIMULATE / ACCOUNT continue with OpDesc[n_ops] and GROUP_DONE with the payload.
# Bodies of scalars that the shim writes into a frame it assembles in place (a hot path): they
# also get their byte size and encode_into(uint8_t*, const Body&) in C++.
WRITTEN_IN_PLACE = ["GroupHead"]
RECORDS = [
    # One call run in an arena as comm rank 0 saw it; the waits are in comm rank order.
    ("LocalOpRecord", [("desc", "OpDesc"), ("started_at", "f64"), ("rendezvous_s", "f64"), ("execution_s", "f64"),
                       ("arrival_wait_s", "f64[nranks]")]),
]
BODIES = [
    ("Hello", ["HELLO"], [("flags", "u32"), ("global_rank", "i32", -1), ("local_rank", "i32", -1),
                          ("world_size", "i32", -1), ("pid", "u32"), ("staging_bytes", "u64"), ("token", "str"),
                          ("shm_name", "str"), ("hostname", "str")]),
    ("HelloOk", ["HELLO_OK"], [("client_id", "u32"), ("flags", "u32"), ("staging_bytes", "u64"),
                               ("timeout_ms", "u32")]),
    ("Error", ["ERROR"], [("result", "i32"), ("message", "text")]),
    ("CommInit", ["COMM_INIT"], [("unique_id", "bytes[128]"), ("nranks", "i32"), ("rank", "i32"), ("name", "str")]),
    ("CommInfo", ["COMM_INFO"], [("comm_handle", "u64"), ("rank", "i32"), ("nranks", "i32"),
                                 ("global_ranks", "i32[nranks]")]),
    ("CommSplit", ["COMM_SPLIT"], [("parent_handle", "u64"), ("color", "i32"), ("key", "i32"), ("name", "str")]),
    ("CommFree", ["COMM_FREE"], [("comm_handle", "u64"), ("how", "u32")]),
    ("CommShrink", ["COMM_SHRINK"], [("parent_handle", "u64"), ("flags", "u32"), ("n_excluded", "u32"),
                                     ("excluded", "i32[n_excluded]"), ("name", "str")]),
    ("GroupHead", ["GROUP", "SIMULATE", "ACCOUNT"], [("n_ops", "u32"), ("flags", "u32")]),
    ("GroupDone", ["GROUP_DONE"], [("n_ops", "u32"), ("results", "i32[n_ops]"), ("message", "text")]),
    ("SimulateDone", ["SIMULATE_DONE"], [("estimated_time_us", "f64")]),
    ("Ping", ["PING"], [("token", "str?")]),
    ("Pong", ["PONG"], [("description", "text")]),
    ("Shutdown", ["SHUTDOWN"], [("token", "str")]),
    ("ArenaRequest", ["ARENA"], [("comm_handle", "u64")]),
    ("ArenaInfo", ["ARENA_INFO"], [("granted", "u32"), ("rank", "u32"), ("slot_bytes", "u64"),
                                   ("total_bytes", "u64"), ("path", "str"), ("reason", "text")]),
    ("ProbeSource", ["PROBE_SOURCE"], [("comm_handle", "u64"), ("timeout_ms", "u32"), ("nranks", "u32"),
                                       ("recvs_posted", "u32[nranks]")]),
    ("Source", ["SOURCE"], [("peer", "i32", -1)]),
    ("LocalOps", ["LOCAL_OPS"], [("comm_handle", "u64"), ("n_records", "u32"), ("nranks", "u32"),
                                 ("records", "LocalOpRecord[n_records]")]),
]
