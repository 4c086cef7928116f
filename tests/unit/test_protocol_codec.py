"""The Python codec against tests/vectors/protocol_vectors.json (the C++ shim checks the same file),
plus the incremental parser's limits and error messages.

Regenerate the vectors (only when docs/protocol.md changes, and tell the shim owner):
    PYTHONPATH=. python tests/unit/test_protocol_codec.py --write
"""
from __future__ import annotations

import dataclasses
import json
import struct
import sys
from pathlib import Path

import pytest

from fakegpu import protocol as P

# tests/vectors/ (computed here, not taken from helpers.paths: --write runs this file as a script)
VECTORS_PATH = Path(__file__).resolve().parents[1] / "vectors" / "protocol_vectors.json"


# --------------------------------------------------------------------------- vector set

def _uid(seed: int) -> bytes:
    return bytes((seed * 7 + i * 13) & 0xFF for i in range(128))


def _op(**kw) -> P.OpDesc:
    return P.OpDesc(**kw)


def _vector_messages():
    """(name, request_id, message) for every message type; GROUP vectors are OpDesc-heavy."""
    f16_half = struct.pack("<e", 0.5)
    bf16_quarter = struct.pack("<f", 0.25)[2:]  # bfloat16 = top 2 bytes of float32
    f64_scalar = struct.pack("<d", -1.5)
    i32_scalar = struct.pack("<i", -3)
    allreduce = _op(comm_handle=0x1000000000001, kind=P.KIND_ALLREDUCE, datatype=7, redop=P.REDOP_SUM,
                    flags=P.OP_FLAG_FIRST_STEP | P.OP_FLAG_LAST_STEP, root=-1, total_count=1,
                    step_count=1, in_offset=0, in_len=4, out_offset=0, out_len=4, call_seq=1)
    many_ops = (
        allreduce,
        _op(comm_handle=2, kind=P.KIND_BROADCAST, datatype=9, redop=0, flags=P.OP_FLAG_IN_PLACE | 2 | 4,
            root=3, total_count=5, step_count=5, in_offset=64, in_len=10, out_offset=64, out_len=10,
            call_seq=7),
        _op(comm_handle=2, kind=P.KIND_REDUCE, datatype=6, redop=P.REDOP_PREMULSUM, flags=2, root=0,
            total_count=1 << 33, step_count=1 << 20, in_offset=128, in_len=2 << 20, out_offset=128,
            out_len=2 << 20, scalar=f16_half, call_seq=0xFFFFFFFF, match_seq=0xFFFFFFFE,
            step_index=8191, step_total=8192),
        _op(comm_handle=3, kind=P.KIND_ALLGATHER, datatype=0, flags=4, total_count=3, step_count=3,
            in_offset=4096, in_len=3, out_offset=4096, out_len=12, call_seq=2),
        _op(comm_handle=3, kind=P.KIND_REDUCESCATTER, datatype=9, redop=P.REDOP_AVG, flags=6,
            total_count=2, step_count=2, in_offset=8192, in_len=16, out_offset=8192, out_len=4,
            scalar=bf16_quarter, call_seq=3),
        _op(comm_handle=3, kind=P.KIND_ALLTOALL, datatype=4, flags=6, total_count=1, step_count=1,
            in_offset=12288, in_len=32, out_offset=12288, out_len=32, call_seq=4),
        _op(comm_handle=3, kind=P.KIND_GATHER, datatype=8, flags=6, root=1, total_count=1,
            step_count=1, in_offset=16384, in_len=8, out_offset=16384, out_len=0, call_seq=5),
        _op(comm_handle=3, kind=P.KIND_SCATTER, datatype=5, flags=6, root=1, total_count=1,
            step_count=1, in_offset=20480, in_len=0, out_offset=20480, out_len=8, call_seq=6),
        _op(comm_handle=0xFFFFFFFFFFFFFFFF, kind=P.KIND_SEND, datatype=10, flags=6, root=2,
            total_count=4, step_count=4, in_offset=24576, in_len=4, out_offset=0, out_len=0, call_seq=8),
        _op(comm_handle=4, kind=P.KIND_RECV, datatype=11, flags=6, root=0, total_count=0,
            step_count=0, in_offset=0, in_len=0, out_offset=24576, out_len=0, call_seq=9),
        _op(comm_handle=4, kind=P.KIND_ALLREDUCE, datatype=8, redop=P.REDOP_PREMULSUM, flags=6,
            total_count=1, step_count=1, in_offset=28672, in_len=8, out_offset=28672, out_len=8,
            scalar=f64_scalar, call_seq=10),
        _op(comm_handle=4, kind=P.KIND_ALLREDUCE, datatype=2, redop=P.REDOP_PREMULSUM, flags=6,
            total_count=1, step_count=1, in_offset=32768, in_len=4, out_offset=32768, out_len=4,
            scalar=i32_scalar, call_seq=11),
        _op(comm_handle=4, kind=P.KIND_ALLREDUCE, datatype=99, redop=42,
            flags=P.OP_FLAG_REJECTED | 6, total_count=16384, step_count=0, call_seq=12, match_seq=9),
    )
    return [
        ("hello_shm", 1, P.Hello(flags=1, global_rank=3, local_rank=1, world_size=8, pid=4242,
                                 staging_bytes=32 << 20, token="s3cret", shm_name="/fakegpu-4242-1",
                                 hostname="node-a")),
        ("hello_socket_anonymous", 2, P.Hello(flags=0, global_rank=-1, local_rank=-1, world_size=-1,
                                              pid=1, staging_bytes=1 << 20, token="", shm_name="",
                                              hostname="h\u00e9te")),
        ("hello_ok", 1, P.HelloOk(client_id=7, flags=1, staging_bytes=32 << 20, timeout_ms=600000)),
        ("error_invalid_usage", 9, P.Error(result=P.NCCL_INVALID_USAGE, message="authentication failed")),
        ("error_timeout", 0xFFFFFFFF, P.Error(result=P.NCCL_TIMEOUT, message="")),
        ("ok", 5, P.Ok()),
        ("comm_init", 3, P.CommInit(unique_id=_uid(1), nranks=4, rank=2, name="default_pg")),
        ("comm_init_unnamed", 4, P.CommInit(unique_id=bytes(128), nranks=1, rank=0, name="")),
        ("comm_info", 3, P.CommInfo(comm_handle=0x100000002, rank=2, global_ranks=(0, 1, 2, 3))),
        ("comm_info_nocolor", 6, P.CommInfo(comm_handle=0, rank=-1, global_ranks=())),
        ("comm_split", 6, P.CommSplit(parent_handle=0x100000002, color=1, key=-5, name="tp")),
        ("comm_split_nocolor", 7, P.CommSplit(parent_handle=9, color=-1, key=0, name="")),
        ("comm_shrink", 18, P.CommShrink(parent_handle=0x100000002, flags=1, excluded=(1, 3), name="survivors")),
        ("comm_shrink_none_excluded", 19, P.CommShrink(parent_handle=5, flags=0, excluded=(), name="")),
        ("comm_free_destroy", 8, P.CommFree(comm_handle=0x100000002, how=P.FREE_DESTROY)),
        ("comm_free_abort", 8, P.CommFree(comm_handle=5, how=P.FREE_ABORT)),
        ("comm_free_finalize", 8, P.CommFree(comm_handle=5, how=P.FREE_FINALIZE)),
        ("group_one_allreduce_shm", 10, P.Group(ops=(allreduce,), flags=0)),
        ("group_one_allreduce_socket", 11,
         P.Group(ops=(allreduce,), flags=0, payload=struct.pack("<f", 1.5))),
        ("group_many_ops_partial", 12, P.Group(ops=many_ops, flags=P.GROUP_FLAG_PARTIAL)),
        ("group_empty", 13, P.Group(ops=(), flags=0)),
        ("group_done_ok_shm", 10, P.GroupDone(results=(0,), message="")),
        ("group_done_socket_payload", 11,
         P.GroupDone(results=(0,), message="", payload=struct.pack("<f", 6.0))),
        ("group_done_mixed", 12,
         P.GroupDone(results=(0, 5, 8, 6, 0, 0, 0, 0, 0, 0, 0, 4),
                     message="comm 1 seq 3 AllReduce: rank 1 asked float32 sum count=4, rank 0 asked float16 sum count=4")),
        ("simulate", 14, P.Simulate(ops=many_ops[:3], flags=0)),
        ("simulate_done", 14, P.SimulateDone(estimated_time_us=1234.5)),
        ("account", 20, P.Account(ops=tuple(dataclasses.replace(op, in_offset=0, in_len=0, out_offset=0, out_len=0)
                                            for op in (many_ops[0], many_ops[7], many_ops[8])), flags=0)),
        ("hello_local", 21, P.Hello(flags=P.HELLO_FLAG_SHM | P.HELLO_FLAG_LOCAL, global_rank=0, local_rank=0,
                                    world_size=4, pid=777, staging_bytes=32 << 20, token="",
                                    shm_name="/fakegpu-777-1", hostname="node-a")),
        ("hello_ok_local", 21, P.HelloOk(client_id=3, flags=P.HELLO_FLAG_SHM | P.HELLO_FLAG_LOCAL,
                                         staging_bytes=32 << 20, timeout_ms=600000)),
        ("arena", 22, P.ArenaRequest(comm_handle=0x100000002)),
        ("arena_info_granted", 22, P.ArenaInfo(granted=1, rank=2, slot_bytes=4 << 20,
                                               total_bytes=8192 + 2 * 5 * (4 << 20),
                                               path="/dev/shm/fakegpu-arena-4242-1-0a1b2c3d", reason="")),
        ("arena_info_refused", 23, P.ArenaInfo(granted=0, rank=1, slot_bytes=0, total_bytes=0, path="",
                                               reason="a fault plan is loaded")),
        ("probe_source", 24, P.ProbeSource(comm_handle=0x100000002, timeout_ms=1800000,
                                           recvs_posted=(3, 0, 0xFFFFFFFF, 1))),
        ("probe_source_coordinator_timeout", 25, P.ProbeSource(comm_handle=7, timeout_ms=0, recvs_posted=(0, 0))),
        ("probe_source_empty", 26, P.ProbeSource(comm_handle=7, timeout_ms=5, recvs_posted=())),
        ("source", 24, P.Source(peer=3)),
        ("local_ops", 0, P.LocalOps(comm_handle=0x100000002, nranks=3, records=(
            P.LocalOpRecord(desc=dataclasses.replace(many_ops[0], comm_handle=0x100000002, total_count=4,
                                                     step_count=4, in_len=16, out_len=16),
                            started_at=1700000000.25, rendezvous_s=0.000125, execution_s=3.0517578125e-05,
                            arrival_wait_s=(0.000125, 0.0, 6.103515625e-05)),
            P.LocalOpRecord(desc=P.OpDesc(comm_handle=0x100000002, kind=P.KIND_BROADCAST, datatype=9,
                                          flags=P.OP_FLAG_IN_PLACE | 6, root=1, total_count=5, step_count=5,
                                          in_len=0, out_len=10, call_seq=2),
                            started_at=1700000000.5, rendezvous_s=1.5, execution_s=0.0,
                            arrival_wait_s=(0.0, 1.5, 0.75)),
        ))),
        ("local_ops_empty", 0, P.LocalOps(comm_handle=7, nranks=2, records=())),
        ("ping", 15, P.Ping()),
        ("ping_with_token", 18, P.Ping(token="s3cret")),
        ("pong", 15, P.Pong(description='{"version":"0.1.0","pid":1,"transport":"unix","clients":0}')),
        ("shutdown", 16, P.Shutdown(token="s3cret")),
        ("shutdown_no_token", 17, P.Shutdown(token="")),
    ]


def _jsonable(value):
    if isinstance(value, (bytes, bytearray)):
        return value.hex()
    if isinstance(value, (P.OpDesc, P.LocalOpRecord)):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def _fields(msg) -> dict:
    out = {f.name: _jsonable(getattr(msg, f.name)) for f in dataclasses.fields(msg)}
    if isinstance(msg, (P.Group, P.Simulate, P.Account)):
        out = {"n_ops": len(msg.ops), **out}
    if isinstance(msg, P.GroupDone):
        out = {"n_ops": len(msg.results), **out}
    if isinstance(msg, P.LocalOps):
        out = {"comm_handle": msg.comm_handle, "n_records": len(msg.records), "nranks": msg.nranks,
               "records": out["records"]}
    if isinstance(msg, P.ProbeSource):
        out = {"comm_handle": msg.comm_handle, "timeout_ms": msg.timeout_ms, "nranks": len(msg.recvs_posted),
               "recvs_posted": list(msg.recvs_posted)}
    if isinstance(msg, P.CommInfo):
        out = {"comm_handle": msg.comm_handle, "rank": msg.rank, "nranks": msg.nranks,
               "global_ranks": list(msg.global_ranks)}
    return out


def build_vectors() -> list:
    return [
        {"name": name, "type": msg.TYPE, "type_name": P.MESSAGE_NAMES[msg.TYPE],
         "request_id": rid, "fields": _fields(msg), "hex": P.encode_frame(msg, rid).hex()}
        for name, rid, msg in _vector_messages()
    ]


def _message_from_fields(msg_type: int, fields: dict):
    f = dict(fields)
    def unhex(k):
        f[k] = bytes.fromhex(f[k])
    if msg_type == P.COMM_INIT:
        unhex("unique_id")
    if msg_type in (P.GROUP, P.SIMULATE, P.ACCOUNT):
        f.pop("n_ops")
        f["ops"] = tuple(P.OpDesc(**{**o, "scalar": bytes.fromhex(o["scalar"])}) for o in f["ops"])
    if msg_type in (P.GROUP, P.GROUP_DONE):
        unhex("payload")
    if msg_type == P.GROUP_DONE:
        f.pop("n_ops")
        f["results"] = tuple(f["results"])
    if msg_type == P.COMM_SHRINK:
        f["excluded"] = tuple(f["excluded"])
    if msg_type == P.PROBE_SOURCE:
        f.pop("nranks")
        f["recvs_posted"] = tuple(f["recvs_posted"])
    if msg_type == P.LOCAL_OPS:
        f.pop("n_records")
        f["records"] = tuple(
            P.LocalOpRecord(**{**rec, "desc": P.OpDesc(**{**rec["desc"], "scalar": bytes.fromhex(rec["desc"]["scalar"])}),
                               "arrival_wait_s": tuple(rec["arrival_wait_s"])})
            for rec in f["records"])
    if msg_type == P.COMM_INFO:
        f.pop("nranks")
        f["global_ranks"] = tuple(f["global_ranks"])
    cls = {c.TYPE: c for c in (P.Hello, P.HelloOk, P.Error, P.Ok, P.CommInit, P.CommInfo, P.CommSplit, P.CommShrink,
                               P.CommFree, P.Group, P.GroupDone, P.Simulate, P.SimulateDone, P.Account, P.Ping,
                               P.Pong, P.Shutdown, P.ArenaRequest, P.ArenaInfo, P.LocalOps,
                               P.ProbeSource, P.Source)}[msg_type]
    return cls(**f)


# --------------------------------------------------------------------------- tests

def _load():
    return json.loads(VECTORS_PATH.read_text())


def test_vectors_file_is_current():
    assert _load() == build_vectors(), "protocol_vectors.json is stale: regenerate it (see module docstring)"


def test_vectors_cover_every_message_type():
    assert {v["type"] for v in _load()} == set(P.MESSAGE_NAMES)
    group = max((v for v in _load() if v["type"] == P.GROUP), key=lambda v: v["fields"]["n_ops"])
    assert {op["kind"] for op in group["fields"]["ops"]} == set(P.KIND_NAMES)


@pytest.mark.parametrize("vector", _load(), ids=lambda v: v["name"])
def test_vector_roundtrip(vector):
    msg = _message_from_fields(vector["type"], vector["fields"])
    raw = bytes.fromhex(vector["hex"])
    assert P.encode_frame(msg, vector["request_id"]) == raw
    rid, decoded = P.decode_frame(raw)
    assert rid == vector["request_id"]
    assert decoded == msg


def test_header_layout_by_hand():
    raw = bytes.fromhex(next(v["hex"] for v in _load() if v["name"] == "ok"))
    assert raw == b"FGPU" + struct.pack("<HHII", P.VERSION, 4, 5, 0)
    ping = bytes.fromhex(next(v["hex"] for v in _load() if v["name"] == "hello_ok"))
    assert ping[16:] == struct.pack("<IIQI", 7, 1, 32 << 20, 600000)


def test_opdesc_layout_by_hand():
    op = P.OpDesc(comm_handle=1, kind=3, datatype=6, redop=5, flags=2, root=-1, total_count=2,
                  step_count=3, in_offset=4, in_len=5, out_offset=6, out_len=7, scalar=b"\x01\x02",
                  call_seq=8, match_seq=9, step_index=10, step_total=11)
    raw = op.pack()
    assert len(raw) == 88
    assert raw[0:8] == (1).to_bytes(8, "little")
    assert raw[8:12] == bytes([3, 6, 5, 2])
    assert raw[12:16] == b"\xff\xff\xff\xff"
    assert [int.from_bytes(raw[o:o + 8], "little") for o in range(16, 64, 8)] == [2, 3, 4, 5, 6, 7]
    assert raw[64:72] == b"\x01\x02" + bytes(6)
    assert [int.from_bytes(raw[o:o + 4], "little") for o in range(72, 88, 4)] == [8, 9, 10, 11]


def test_parser_handles_byte_by_byte_and_coalesced_streams():
    vectors = _load()
    stream = b"".join(bytes.fromhex(v["hex"]) for v in vectors)
    for chunking in (1, 3, 17, 1000, len(stream)):
        parser = P.FrameParser(max_body_len=1 << 30)
        frames = []
        for i in range(0, len(stream), chunking):
            frames.extend(parser.feed(stream[i:i + chunking]))
        assert [f.request_id for f in frames] == [v["request_id"] for v in vectors]
        assert [f.msg_type for f in frames] == [v["type"] for v in vectors]
        assert parser.buffered == 0


def test_parser_routes_group_payload_into_targets():
    ops = tuple(P.OpDesc(comm_handle=1, kind=P.KIND_ALLREDUCE, datatype=7, total_count=2,
                         step_count=2, in_offset=off, in_len=8, out_offset=0, out_len=8)
                for off in (16, 0))
    payload = bytes(range(16))
    frame = P.encode_frame(P.Group(ops=ops, payload=payload), 9) + P.encode_frame(P.Ping(), 10)
    staging = bytearray(32)

    def router(prefix, payload_len):
        layout = P.group_payload_layout(prefix, payload_len, 32)
        mv = memoryview(staging)
        return [mv[o:o + n] for o, n in layout]

    for chunking in (1, 5, 50, len(frame)):
        staging[:] = bytes(32)
        parser = P.FrameParser(max_body_len=1 << 20, payload_router=router)
        frames = []
        for i in range(0, len(frame), chunking):
            frames.extend(parser.feed(frame[i:i + chunking]))
        assert [f.msg_type for f in frames] == [P.GROUP, P.PING]
        assert frames[0].payload_placed and len(frames[0].body) == 8 + 2 * P.OPDESC_SIZE
        assert bytes(staging[16:24]) == payload[:8] and bytes(staging[0:8]) == payload[8:]


def test_parser_zero_copy_receive_into_targets():
    """The BufferedProtocol path: recv_into the destination the parser exposes."""
    ops = tuple(P.OpDesc(comm_handle=1, kind=P.KIND_ALLREDUCE, datatype=7, total_count=1,
                         step_count=1, in_offset=off, in_len=4, out_offset=0, out_len=4) for off in (4, 0))
    raw = P.encode_frame(P.Group(ops=ops, payload=b"abcdWXYZ"), 3)
    staging = bytearray(8)
    mv = memoryview(staging)
    parser = P.FrameParser(1 << 20, payload_router=lambda prefix, n: [mv[o:o + k] for o, k in
                                                                      P.group_payload_layout(prefix, n, 8)])
    header_and_descs = len(raw) - 8
    assert parser.feed(raw[:header_and_descs]) == []
    frames = []
    pos = header_and_descs
    while (target := parser.direct_buffer()) is not None:
        take = min(3, len(target))           # a short read
        target[:take] = raw[pos:pos + take]
        pos += take
        frames += parser.direct_filled(take)
    assert [f.msg_type for f in frames] == [P.GROUP] and bytes(staging) == b"WXYZabcd"


@pytest.mark.parametrize("raw, expected", [
    (b"XGPU" + struct.pack("<HHII", P.VERSION, 30, 0, 0), "bad magic"),
    (b"FGPU" + struct.pack("<HHII", 1, 30, 0, 0), "unsupported protocol version 1"),
    (b"FGPU" + struct.pack("<HHII", P.VERSION, 99, 0, 0), "unknown message type 99"),
    (b"FGPU" + struct.pack("<HHII", P.VERSION, 30, 0, 1 << 31), "exceeds the limit"),
    (b"FGPU" + struct.pack("<HHII", P.VERSION, 2, 0, 0), "not accepted in this direction"),
])
def test_parser_rejects_bad_headers(raw, expected):
    parser = P.FrameParser(max_body_len=1 << 20, accepted_types=P.CLIENT_TO_SERVER)
    with pytest.raises(P.ProtocolError, match=expected):
        parser.feed(raw)


@pytest.mark.parametrize("msg_type, body, expected", [
    (P.HELLO, b"\0" * 10, "HELLO body truncated"),
    (P.PING, b"\x01\x00tx", "1 unexpected trailing bytes"),
    (P.PING, b"x", "PING body truncated"),
    (P.SHUTDOWN, b"\x02\x00\xff\xfe", "not valid UTF-8"),
    (P.GROUP, struct.pack("<II", 2, 0) + bytes(88), "2 OpDesc"),
    (P.COMM_INIT, bytes(100), "unique_id"),
])
def test_decode_body_names_the_problem(msg_type, body, expected):
    with pytest.raises(P.ProtocolError, match=expected):
        P.decode_body(msg_type, body)


def test_group_payload_layout_checks_bounds_and_total():
    op = P.OpDesc(comm_handle=1, kind=1, datatype=7, in_offset=60, in_len=8)
    prefix = P.encode_body(P.Group(ops=(op,)))
    with pytest.raises(P.ProtocolError, match="outside the 64-byte input region"):
        P.group_payload_layout(prefix, 8, 64)
    with pytest.raises(P.ProtocolError, match="add up to 8"):
        P.group_payload_layout(prefix, 7, 128)


def test_long_error_message_is_truncated_not_rejected():
    body = P.encode_body(P.Error(5, "\u00e9" * 40000))
    msg = P.decode_body(P.ERROR, body)
    assert len(msg.message.encode()) <= P.MAX_STR_BYTES


if __name__ == "__main__":
    if "--write" in sys.argv:
        VECTORS_PATH.write_text(json.dumps(build_vectors(), indent=1) + "\n")
        print(f"wrote {VECTORS_PATH}")
