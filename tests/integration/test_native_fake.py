"""FAKEGPU_DIST_MODE=fake through the native shim (native/src/modes/mode_fake.cc): no coordinator.

Every process here loads the real shim through fakegpu.nccl (cffi) with NGPU=64, plays one
logical rank, and checks each collective's result bit for bit against
fakegpu/fake/semantics.py on the same numpy inputs; the launch-contract errors must be
contract.py's own messages; the event file must be what build_report turns into a report
that `fakegpu report check --expect-world-size 64` accepts; and `fgpu --dist-mode fake`
must produce that report from a plain script.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.paths import REPO_ROOT



@pytest.fixture(scope="module")
def shim_library() -> str:
    import fakegpu

    try:
        path = Path(fakegpu.nccl_library_path())
    except Exception as exc:  # not built
        pytest.skip(f"fakegpu's libnccl.so.2 is not built: {exc}")
    if not path.exists():
        pytest.skip(f"fakegpu's libnccl.so.2 is not built at {path}")
    return str(path)


def _env(shim: str, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FAKEGPU_") and k not in ("NGPU", "RANK", "WORLD_SIZE", "FAKE_PP_RANK", "LOCAL_RANK")}
    env["FAKEGPU_NCCL_LIBRARY"] = shim
    env["FAKEGPU_DIST_MODE"] = "fake"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _run(script: str, env: dict, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    path = cwd / "worker.py"
    path.write_text(textwrap.dedent(script))
    done = subprocess.run([sys.executable, str(path)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    return done


# ---------------------------------------------------------------------------------------------
# Every collective against semantics.py

COLLECTIVES_WORKER = r"""
import json, sys
import numpy as np
import ml_dtypes
from fakegpu.nccl import Nccl
from fakegpu.fake import semantics as S

N, ME = 64, 5                      # NGPU and RANK from the environment
nccl = Nccl()
world = nccl.comm_init_rank(N, nccl.get_unique_id(), ME)
assert (world.rank, world.size) == (ME, N)
rng = np.random.default_rng(7)
failures, checked = [], 0

DTYPES = [np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64, np.float16, np.float32,
          np.float64, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]

def data(dt, count):
    dt = np.dtype(dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=count, endpoint=True, dtype=dt)
    # Values whose n-fold sums overflow narrow types (saturation) and need rounding.
    hi = {2: 2000.0, 1: 300.0}.get(dt.itemsize, 1e4)
    return (rng.uniform(-hi, hi, size=count)).astype(np.float32).astype(dt)

def same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if got.dtype.kind == "f" or got.dtype in (np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn),
                                             np.dtype(ml_dtypes.float8_e5m2)):
        g, w = got.astype(np.float64), want.astype(np.float64)
        nan = np.isnan(g) & np.isnan(w)
        return bool(np.all(nan | (got.view(np.uint8).reshape(got.size, -1) ==
                                  want.view(np.uint8).reshape(want.size, -1)).all(axis=1)))
    return bool(np.array_equal(got, want))

def check(what, got, want):
    global checked
    checked += 1
    if not same(got, want):
        failures.append(f"{what}: got {np.asarray(got)[:4]} want {np.asarray(want)[:4]}")

def ops_for(dt):
    return ["sum", "prod", "max", "min", "avg", "premulsum"]

for dt in DTYPES:
    name = np.dtype(dt).name
    count = 37
    for op in ops_for(dt):
        x = data(dt, count)
        scale = None
        code = op
        if op == "premulsum":
            scale = 3 if np.dtype(dt).kind in "iu" else 0.75
            code = world.create_premul_sum(scale, dt)
        want = S.all_reduce(x, N, op, scale)
        out = np.zeros_like(x)
        world.all_reduce(x, out, count, dt, code)
        check(f"allreduce {name} {op}", out, want)
        inplace = x.copy()
        world.all_reduce(inplace, inplace, count, dt, code)
        check(f"allreduce in-place {name} {op}", inplace, want)
        # reduce: the root gets the result, a non-root output stays untouched
        out = np.zeros_like(x)
        world.reduce(x, out, count, dt, code, ME)
        check(f"reduce root {name} {op}", out, S.reduce(x, N, ME, ME, op, scale))
        sentinel = data(dt, count)
        out = sentinel.copy()
        world.reduce(x, out, count, dt, code, 0)
        check(f"reduce non-root {name} {op}", out, sentinel)
        # reduce-scatter: this rank's share of N copies
        big = data(dt, N * 3)
        out = np.zeros(3, dtype=dt)
        world.reduce_scatter(big, out, 3, dt, code)
        check(f"reducescatter {name} {op}", out, S.reduce_scatter(big, N, ME, op, scale))
        inplace = big.copy()
        world.reduce_scatter(inplace, inplace[ME * 3:], 3, dt, code)
        check(f"reducescatter in-place {name} {op}", inplace[ME * 3:ME * 3 + 3], S.reduce_scatter(big, N, ME, op, scale))
        if op == "premulsum":
            world.destroy_op(code)

    x = data(dt, 5)
    out = np.zeros(N * 5, dtype=dt)
    world.all_gather(x, out, 5, dt)
    check(f"allgather {name}", out, S.all_gather(x, N))
    buf = np.zeros(N * 5, dtype=dt)
    buf[ME * 5:ME * 5 + 5] = x
    world.all_gather(buf[ME * 5:], buf, 5, dt)
    check(f"allgather in-place {name}", buf, S.all_gather(x, N))
    big = data(dt, N * 2)
    out = np.zeros_like(big)
    world.all_to_all(big, out, 2, dt)
    check(f"alltoall {name}", out, S.all_to_all(big, N, ME))
    inplace = big.copy()
    world.all_to_all(inplace, inplace, 2, dt)
    check(f"alltoall in-place {name}", inplace, S.all_to_all(big, N, ME))
    out = np.zeros_like(x)
    world.broadcast(x, out, 5, dt, 0)
    check(f"broadcast {name}", out, S.broadcast(x))
    out = np.zeros(N * 5, dtype=dt)
    world.gather(x, out, 5, dt, ME)
    check(f"gather root {name}", out, S.gather(x, N, ME, ME))
    sentinel = data(dt, N * 5)
    out = sentinel.copy()
    world.gather(x, out, 5, dt, 1)
    check(f"gather non-root {name}", out, sentinel)
    out = data(dt, 5)
    src = data(dt, N * 5)
    world.scatter(src, out, 5, dt, ME)
    check(f"scatter root {name}", out, S.scatter(src, N, ME, ME, 5, dt))
    out = data(dt, 5)
    world.scatter(None, out, 5, dt, 0)
    check(f"scatter non-root {name}", out, S.scatter(None, N, 0, ME, 5, dt))

# Send/recv: a ring step in one group receives what this rank sent (semantics.PeerExchange).
ex = S.PeerExchange()
for dt in (np.float32, ml_dtypes.bfloat16, np.int64):
    x = data(dt, 6)
    got = np.zeros_like(x)
    nccl.group_start()
    world.recv(got, 6, dt, (ME - 1) % N)     # posted first: the group's send still matches
    world.send(x, 6, dt, (ME + 1) % N)
    nccl.group_end()
    ex.send("w", ME, N, (ME + 1) % N, x)
    want, matched = ex.recv("w", ME, N, (ME - 1) % N, 6, x.dtype)
    assert matched
    check(f"ring sendrecv {np.dtype(dt).name}", got, want)
# A receive nothing was sent for (pipeline stage 0 receiving gradients): zeros.
got = np.full(4, 7.0, dtype=np.float32)
world.recv(got, 4, np.float32, ME + 1)
check("unmatched recv", got, ex.recv("w", ME, N, ME + 1, 4, np.float32)[0])
# Sizes must match: a send of 3 elements does not feed a recv of 4.
nccl.group_start()
world.send(np.ones(3, np.float32), 3, np.float32, ME + 2)
got = np.full(4, 9.0, np.float32)
world.recv(got, 4, np.float32, ME - 2)
nccl.group_end()
check("mismatched recv", got, np.zeros(4, np.float32))

# Closed forms: beyond 2^24 element operations semantics.py switches to n*x, x^n, ...
count = (1 << 24) // N + 3
for dt, op in ((np.float32, "sum"), (np.float16, "avg"), (ml_dtypes.bfloat16, "sum"), (np.float32, "prod"),
               (np.int32, "sum"), (ml_dtypes.float8_e5m2, "sum")):
    x = data(dt, count)
    if op == "prod":
        x = rng.uniform(0.9, 1.1, size=count).astype(dt)
    out = np.zeros_like(x)
    world.all_reduce(x, out, count, dt, op)
    check(f"closed-form allreduce {np.dtype(dt).name} {op} x{count}", out, S.all_reduce(x, N, op))

# A sub-communicator of 8 (consecutive logical ranks around this one) and a split.
sub = nccl.comm_init_rank(8, nccl.get_unique_id(), 3)
x = data(np.float32, 4)
out = np.zeros_like(x)
sub.all_reduce(x, out, 4, np.float32, "sum")
check("sub-communicator allreduce", out, S.all_reduce(x, 8, "sum"))
child = world.split(0, ME)
assert (child.rank, child.size) == (ME, N), (child.rank, child.size)
assert world.split(-1, 0) is None           # NCCL_SPLIT_NOCOLOR
out = np.zeros(N * 4, np.float32)
child.all_gather(x, out, 4, np.float32)
check("split allgather", out, S.all_gather(x, N))
print(json.dumps({"checked": checked, "failures": failures}))
"""


def test_every_collective_matches_semantics_py(shim_library, tmp_path):
    done = _run(COLLECTIVES_WORKER, _env(shim_library, NGPU=64, RANK=5, FAKEGPU_QUIET=1), tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["failures"] == [], "\n".join(result["failures"][:20])
    assert result["checked"] > 300


EXTREME_WORLD_WORKER = r"""
import json, os
import numpy as np
from fakegpu.nccl import Nccl
from fakegpu.fake import semantics as S

N = int(os.environ["NGPU"])
nccl = Nccl()
world = nccl.comm_init_rank(N, nccl.get_unique_id(), 1)
failures = []
for dt in (np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64):
    info = np.iinfo(dt)
    values = [-1, 1, 2, int(info.min), int(info.max), 0, 100, int(info.max) - 1]
    x = np.array([v % (1 << 64) for v in values], dtype=np.uint64).astype(dt)   # wrapped into dt
    for op in ("sum", "avg", "prod"):
        out = np.zeros_like(x)
        world.all_reduce(x, out, x.size, dt, op)
        want = S.all_reduce(x, N, op, exact_limit=0)          # the closed form (no n-fold loop)
        exact = S.all_reduce(x, N, op)                       # the element-by-element fold
        if not (np.array_equal(out, want) and np.array_equal(want, exact)):
            failures.append(f"{np.dtype(dt).name} {op}: native {out} closed {want} fold {exact}")
print(json.dumps({"failures": failures}))
"""


@pytest.mark.parametrize("world", [128, 256, 1000])
def test_integer_reductions_where_the_world_size_does_not_fit_the_type(shim_library, tmp_path, world):
    """The native closed form, semantics.py's closed form and the rank-by-rank fold agree when n
    does not fit the element type (int8 avg over 128 ranks of -1 is -1, as NCCL computes it)."""
    done = _run(EXTREME_WORLD_WORKER, _env(shim_library, NGPU=world, RANK=1, FAKEGPU_QUIET=1), tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["failures"] == []


def test_narrow_float_conversions_round_like_ml_dtypes(shim_library, tmp_path):
    """n=1..3 copies of every finite value of each narrow type: every rounding case of the
    float32 -> narrow conversion that a symmetric sum/avg can produce, bit for bit."""
    script = r"""
import json
import numpy as np, ml_dtypes
from fakegpu.nccl import Nccl
from fakegpu.fake import semantics as S
nccl = Nccl()
bad = []
for size in (1, 2, 3):
    comm = nccl.comm_init_rank(size, nccl.get_unique_id(), 0)
    for dt, bits in ((np.float16, np.uint16), (ml_dtypes.bfloat16, np.uint16),
                     (ml_dtypes.float8_e4m3fn, np.uint8), (ml_dtypes.float8_e5m2, np.uint8)):
        x = np.arange(np.iinfo(bits).max + 1, dtype=np.int64).astype(bits).view(dt)
        x = x[np.isfinite(x.astype(np.float32))]
        for op in ("sum", "avg", "prod"):
            out = np.zeros_like(x)
            comm.all_reduce(x, out, x.size, dt, op)
            want = S.all_reduce(x, size, op)
            g, w = out.view(bits), want.view(bits)
            ok = (g == w) | (np.isnan(out.astype(np.float32)) & np.isnan(want.astype(np.float32)))
            if not ok.all():
                i = int(np.flatnonzero(~ok)[0])
                bad.append(f"{np.dtype(dt).name} n={size} {op}: x={x[i]!r} got {hex(g[i])} want {hex(w[i])}")
print(json.dumps(bad))
"""
    done = _run(script, _env(shim_library, NGPU=4, FAKEGPU_QUIET=1), tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_nan_payloads_come_out_as_numpy_and_ml_dtypes_give_them(shim_library, tmp_path):
    """Quiet NaNs with payload bits through a symmetric sum: float16 keeps its payload (numpy's
    casts), bfloat16 becomes 0x7fc0 with its sign (ml_dtypes), as the coordinator computes."""
    script = r"""
import json
import numpy as np, ml_dtypes
from fakegpu.nccl import Nccl
from fakegpu.fake import semantics as S
nccl = Nccl()
comm = nccl.comm_init_rank(2, nccl.get_unique_id(), 0)
out = {}
for dt, patterns in ((np.float16, [0x7e01, 0xfe55, 0x7fff]), (ml_dtypes.bfloat16, [0x7fc1, 0xffd5, 0x7fff])):
    x = np.array(patterns, dtype=np.uint16).view(dt)
    got = np.zeros_like(x)
    comm.all_reduce(x, got, x.size, dt, "sum")
    out[np.dtype(dt).name] = [got.view(np.uint16).tolist(), S.all_reduce(x, 2, "sum").view(np.uint16).tolist()]
print(json.dumps(out))
"""
    done = _run(script, _env(shim_library, NGPU=4, FAKEGPU_QUIET=1), tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["float16"][0] == out["float16"][1] == [0x7e01, 0xfe55, 0x7fff]
    assert out["bfloat16"][0] == out["bfloat16"][1] == [0x7fc0, 0xffc0, 0x7fc0]


# ---------------------------------------------------------------------------------------------
# Launch contract

CONTRACT_WORKER = r"""
import json, os
from fakegpu.nccl import Nccl, NcclError
from fakegpu.fake import contract
try:
    expected = contract.resolve()
    expected = {"ok": True, "logical_rank": expected.logical_rank, "world": expected.world_size}
except contract.LaunchContractError as exc:
    expected = {"ok": False, "message": str(exc)}
nccl = Nccl()
uid = nccl.get_unique_id()           # never fails: the contract is checked at init
got = {}
try:
    world_size = int(os.environ.get("NGPU", "1")) if os.environ.get("NGPU", "").strip().isdigit() else 1
    comm = nccl.comm_init_rank(world_size, uid, int(os.environ.get("PLAY", "0")))
    got = {"ok": True, "rank": comm.rank, "size": comm.size}
except NcclError as exc:
    got = {"ok": False, "result": exc.result, "last_error": nccl.last_error()}
print(json.dumps({"expected": expected, "got": got}))
"""


@pytest.mark.parametrize("env, play", [
    ({}, 0),                                                      # NGPU unset
    ({"NGPU": "10", "FAKEGPU_PP_DEGREE": "4"}, 0),                # not divisible
    ({"NGPU": "64", "FAKEGPU_PP_DEGREE": "4", "FAKE_PP_RANK": "4"}, 0),
    ({"NGPU": "64", "RANK": "64"}, 0),
    ({"NGPU": "64", "WORLD_SIZE": "2", "RANK": "1"}, 0),          # pure fake is one process
    ({"NGPU": "sixty-four"}, 0),
    ({"NGPU": "64", "FAKEGPU_PP_DEGREE": "0"}, 0),
    ({"NGPU": "64", "RANK": "-1"}, 0),
])
def test_launch_contract_errors_are_init_errors_with_the_contract_message(shim_library, tmp_path, env, play):
    done = _run(CONTRACT_WORKER, _env(shim_library, PLAY=play, FAKEGPU_QUIET=1, **env), tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    expected, got = result["expected"], result["got"]
    assert expected["ok"] is False
    assert got["ok"] is False and got["result"] == 5  # ncclInvalidUsage
    assert expected["message"] in got["last_error"], (expected["message"], got["last_error"])
    assert "launch contract" in got["last_error"]


@pytest.mark.parametrize("env, logical", [
    ({"NGPU": "64", "FAKEGPU_PP_DEGREE": "4", "FAKE_PP_RANK": "1"}, 16),
    ({"NGPU": "64", "RANK": "37"}, 37),
    ({"NGPU": "64"}, 0),
])
def test_the_world_communicator_must_use_the_contracts_logical_rank(shim_library, tmp_path, env, logical):
    done = _run(CONTRACT_WORKER, _env(shim_library, PLAY=logical, FAKEGPU_QUIET=1, **env), tmp_path)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["expected"] == {"ok": True, "logical_rank": logical, "world": 64}
    assert result["got"] == {"ok": True, "rank": logical, "size": 64}
    wrong = (logical + 1) % 64
    done = _run(CONTRACT_WORKER, _env(shim_library, PLAY=wrong, FAKEGPU_QUIET=1, **env), tmp_path)
    got = json.loads(done.stdout.strip().splitlines()[-1])["got"]
    assert got["ok"] is False and f"logical rank {logical}; pass rank={logical}" in got["last_error"]


def test_native_and_python_contracts_agree_on_many_launches(shim_library, tmp_path):
    """The contract module's own decision for a batch of launches, compared in one process each
    would be slow; instead the shim's logical rank for valid ones is read from its events."""
    cases = [{"NGPU": "8", "FAKEGPU_PP_DEGREE": "2", "FAKE_PP_RANK": "1"},
             {"NGPU": "1024", "FAKEGPU_PP_DEGREE": "4", "RANK": "700"},
             {"NGPU": "12", "FAKEGPU_PP_DEGREE": "3", "FAKE_PP_RANK": " 2 ", "RANK": "1"},
             {"NGPU": "64", "WORLD_SIZE": "1", "RANK": "3"},
             # rewritten by the fake-world entry to the logical world; the launcher's values kept aside
             {"NGPU": "64", "WORLD_SIZE": "64", "RANK": "5", "FAKEGPU_FAKE_WORLD_ENV": "WORLD_SIZE=64 RANK=5",
              "FAKEGPU_LAUNCH_WORLD_SIZE": "1", "FAKEGPU_LAUNCH_RANK": "0"},
             {"NGPU": "16", "WORLD_SIZE": "16", "RANK": "0", "FAKEGPU_FAKE_WORLD_ENV": "WORLD_SIZE=16 RANK=0",
              "FAKEGPU_LAUNCH_WORLD_SIZE": "", "FAKEGPU_LAUNCH_RANK": ""},
             # a mark that does not match: the values are the launcher's own
             {"NGPU": "8", "WORLD_SIZE": "1", "RANK": "2", "FAKEGPU_FAKE_WORLD_ENV": "WORLD_SIZE=8 RANK=2",
              "FAKEGPU_LAUNCH_WORLD_SIZE": "4"}]
    from fakegpu.fake import contract

    for i, env in enumerate(cases):
        lc = contract.resolve(dict(env, FAKEGPU_DIST_MODE="fake"))
        events = tmp_path / f"ev{i}.jsonl"
        script = f"""
from fakegpu.nccl import Nccl
import numpy as np
n = Nccl()
c = n.comm_init_rank(2, n.get_unique_id(), 0)
x = np.ones(2, np.float32)
c.all_reduce(x, x, 2, np.float32, "sum")
"""
        done = _run(script, _env(shim_library, FAKEGPU_FAKE_EVENTS_PATH=events, FAKEGPU_QUIET=1, **env), tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        world = json.loads(events.read_text().splitlines()[0])
        assert world["event"] == "world" and world["frontend"] == "native"
        for key, value in lc.to_dict().items():
            assert world[key] == value, (env, key, world[key], value)


# ---------------------------------------------------------------------------------------------
# Events and the whole-world report

EVENTS_WORKER = r"""
import numpy as np
from fakegpu.nccl import Nccl
nccl = Nccl()
world = nccl.comm_init_rank(64, nccl.get_unique_id(), 0)
tp = nccl.comm_init_rank(8, nccl.get_unique_id(), 0, name="tp")
dp = nccl.comm_init_rank(4, nccl.get_unique_id(), 0, name="dp")     # FAKEGPU_FAKE_COMM_STRIDES=4:16
pp = nccl.comm_init_rank(2, nccl.get_unique_id(), 0, name="pp")     # P=2: stride NGPU/P
x = np.ones(1024, np.float32)
dp.all_reduce(x, x, 1024, np.float32, "sum")
pp.send(x, 1024, np.float32, 1)
x = np.ones(1024, np.float32)
y = np.zeros(1024 * 8, np.float32)
for step in range(3):
    world.all_reduce(x, x, 1024, np.float32, "avg")
    tp.all_gather(x, y, 1024, np.float32)
    tp.reduce_scatter(y, x, 1024, np.float32, "sum")
nccl.group_start()
world.send(x, 1024, np.float32, 1)          # ring: the send stands for every k -> k+1
world.recv(x, 1024, np.float32, 63)         # from the wrap: this rank cannot send with offset -63
nccl.group_end()
world.broadcast(x, x, 16, np.float32, 0)
print("done")
"""


def test_events_and_report_describe_the_whole_world(shim_library, tmp_path):
    report = tmp_path / "report.json"
    done = _run(EVENTS_WORKER, _env(shim_library, NGPU=64, FAKEGPU_PP_DEGREE=2, FAKEGPU_FAKE_COMM_STRIDES="4:16",
                                    FAKEGPU_CLUSTER_REPORT_PATH=report), tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "done"          # the report builder's output went to stderr
    events_file = tmp_path / "report.events.jsonl"
    lines = [json.loads(line) for line in events_file.read_text().splitlines()]
    assert lines[0]["event"] == "world" and lines[0]["logical_world_size"] == 64
    comms = {e["id"]: e for e in lines if e["event"] == "comm"}
    members = {c["name"]: c["members"] for c in comms.values()}
    assert sorted(members) == ["dp", "pp", "tp", "world"]
    assert members["tp"] == list(range(8)) and members["dp"] == [0, 16, 32, 48] and members["pp"] == [0, 32]
    ops = [e for e in lines if e["event"] == "op"]
    kinds = [e["kind"] for e in ops]
    assert kinds.count("AllReduce") == 4 and kinds.count("AllGather") == 3 and kinds.count("ReduceScatter") == 3
    p2p = [e for e in ops if e["kind"] == "SendRecv"]
    assert [(e["root"], e["peer"], e.get("spread")) for e in p2p] == [(0, 1, True), (0, 1, True), (63, 0, True)]
    assert [e["redop"] for e in ops if e["kind"] == "AllReduce"] == ["sum", "avg", "avg", "avg"]
    assert report.exists() and report.with_suffix(".md").exists()
    check = subprocess.run([sys.executable, "-m", "fakegpu", "report", "check", str(report),
                            "--expect-world-size", "64"], capture_output=True, text=True, timeout=120,
                           env=_env(shim_library))
    assert check.returncode == 0, check.stdout + check.stderr
    data = json.loads(report.read_text())
    meta = data["metadata"]
    assert meta["mode"] == "fake" and meta["logical_world_size"] == 64
    # The 8-rank tp group is replicated over the 8 groups of the world.
    assert meta["fake_world"]["replica_records"] >= 3 * 8 * 2


def test_finish_hook_and_default_events_path_without_a_report(shim_library, tmp_path):
    script = r"""
import ctypes, numpy as np, os
from fakegpu.nccl import Nccl
nccl = Nccl()
c = nccl.comm_init_rank(4, nccl.get_unique_id(), 0)
x = np.ones(4, np.int32)
c.all_reduce(x, x, 4, np.int32, "sum")
assert ctypes.CDLL(os.environ["FAKEGPU_NCCL_LIBRARY"]).fakegpu_fake_finish() == 0
print(int(x[0]))
"""
    env = _env(shim_library, NGPU=4, TMPDIR=tmp_path)
    done = _run(script, env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "4"
    written = list(tmp_path.glob("fakegpu-fake-events-*.jsonl"))
    assert len(written) == 1 and "events written to" in done.stderr
    assert [json.loads(line)["event"] for line in written[0].read_text().splitlines()] == ["world", "comm", "op"]


def test_fgpu_dist_mode_fake_end_to_end(shim_library, tmp_path):
    (tmp_path / "job.py").write_text(textwrap.dedent("""
        import numpy as np, os
        from fakegpu.nccl import Nccl
        nccl = Nccl(os.environ["FAKEGPU_NCCL_LIBRARY"])
        world = nccl.comm_init_rank(int(os.environ["NGPU"]), nccl.get_unique_id(), 16)
        x = np.arange(4, dtype=np.float32)
        world.all_reduce(x, x, 4, np.float32, "sum")
        print("allreduce", x.tolist())
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_")}
    env.update(NGPU="64", FAKEGPU_PP_DEGREE="4", FAKE_PP_RANK="1", FAKEGPU_NCCL_LIBRARY=shim_library,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-m", "fakegpu", "run", "--dist-mode", "fake", "--report", "r.json",
                           "--", sys.executable, "job.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "allreduce [0.0, 64.0, 128.0, 192.0]" in done.stdout
    check = subprocess.run([sys.executable, "-m", "fakegpu", "report", "check", str(tmp_path / "r.json"),
                            "--expect-world-size", "64"], capture_output=True, text=True, timeout=120, env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    meta = json.loads((tmp_path / "r.json").read_text())["metadata"]
    assert meta["physical_logical_ranks"] == [16] and meta["fake_world"]["pp_degree"] == 4


# ---------------------------------------------------------------------------------------------
# Device buffers (a CUDA program): checked with the test-only CUDA runtime of
# native/tests/fake_cudart.c, whose "device" memory the host cannot touch.

DEVICE_WORKER = r"""
import ctypes, json, os
import numpy as np
cudart = ctypes.CDLL(os.environ["FAKEGPU_CUDART_PATH"], mode=ctypes.RTLD_GLOBAL)
from fakegpu.nccl import Nccl
from fakegpu.fake import semantics as S

def dev(nbytes):
    p = ctypes.c_void_p()
    assert cudart.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(nbytes)) == 0
    return p.value

def h2d(ptr, arr):
    assert cudart.cudaMemcpy(ctypes.c_void_p(ptr), arr.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(arr.nbytes), 1) == 0

def d2h(ptr, like):
    out = np.empty_like(like)
    assert cudart.cudaMemcpy(out.ctypes.data_as(ctypes.c_void_p), ctypes.c_void_p(ptr), ctypes.c_size_t(out.nbytes), 2) == 0
    return out

N, ME = 16, 3
nccl = Nccl()
world = nccl.comm_init_rank(N, nccl.get_unique_id(), ME)
bad = []
x = np.arange(10, dtype=np.float32) - 4.5
a, b = dev(x.nbytes), dev(x.nbytes * N)
h2d(a, x)
world.all_reduce(a, a, 10, np.float32, "sum")                 # in place, on the device
if not np.array_equal(d2h(a, x), S.all_reduce(x, N, "sum")): bad.append("allreduce")
h2d(a, x)
world.all_gather(a, b, 10, np.float32)
if not np.array_equal(d2h(b, np.zeros(10 * N, np.float32)), S.all_gather(x, N)): bad.append("allgather")
sentinel = np.full(10, 5.0, np.float32)
h2d(b, sentinel)
world.reduce(a, b, 10, np.float32, "sum", 0)                   # non-root: untouched
if not np.array_equal(d2h(b, sentinel), sentinel): bad.append("reduce non-root")
got = dev(x.nbytes)
nccl.group_start()
world.send(a, 10, np.float32, ME + 1)
world.recv(got, 10, np.float32, ME - 1)
nccl.group_end()
if not np.array_equal(d2h(got, x), x): bad.append("sendrecv")
counts = [ctypes.c_long() for _ in range(4)]
cudart.fake_cudart_counts(*[ctypes.byref(c) for c in counts])
print(json.dumps({"bad": bad, "d2h": counts[0].value, "h2d": counts[1].value}))
"""


def test_device_buffers_bounce_through_the_cuda_runtime(shim_library, tmp_path):
    import shutil

    if shutil.which("cc") is None:
        pytest.skip("needs a C compiler")
    cudart = tmp_path / "libcudart.so.12"
    build = subprocess.run(["cc", "-std=c11", "-O1", "-shared", "-fPIC", "-fvisibility=hidden",
                            "-Wl,-soname,libcudart.so.12", "-o", str(cudart),
                            str(REPO_ROOT / "native" / "tests" / "fake_cudart.c"), "-pthread"],
                           capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    done = _run(DEVICE_WORKER, _env(shim_library, NGPU=16, RANK=3, FAKEGPU_MODE="hybrid",
                                    FAKEGPU_CUDART_PATH=cudart, FAKEGPU_QUIET=1), tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bad"] == []
    # The worker itself copies 4 times to the host and 3 times to the device; the rest are the shim's
    # bounces (the fake runtime segfaults on any direct access).
    assert result["d2h"] >= 4 + 5 and result["h2d"] >= 3 + 3, result


LIFECYCLE_WORKER = r"""
import json
import numpy as np
from fakegpu.nccl import Nccl, NcclError
nccl = Nccl()
seen = {}
# Non-blocking init completes in the background, as in NCCL.
nb = nccl.comm_init_rank(8, nccl.get_unique_id(), 2, blocking=False)
nb.wait_ready(timeout_s=30)
seen["nonblocking"] = [nb.rank, nb.size]
# Inits inside a group complete at the outermost ncclGroupEnd.
nccl.group_start()
g = nccl.comm_init_rank(4, nccl.get_unique_id(), 1)
nccl.group_end()
seen["in_group"] = [g.rank, g.size]
# ncclCommInitAll: one process, several comm ranks of a sub-world.
comms = nccl.comm_init_all(4)
seen["init_all"] = [[c.rank, c.size] for c in comms]
x = np.full(3, 2, np.int64)
nccl.group_start()
for c in comms:
    c.all_reduce(x, x, 3, np.int64, "sum")        # each: the sum of 4 copies of x
nccl.group_end()
seen["init_all_result"] = x.tolist()
# Argument errors fail the call only; the communicator stays usable.
try:
    g.all_reduce(x, x, 3, 77, "sum")
except NcclError as exc:
    seen["bad_dtype"] = [exc.result, nccl.last_error()]
g.all_reduce(x, x, 3, np.int64, "max")
seen["after_error"] = x.tolist()
try:
    nccl.comm_init_rank(32, nccl.get_unique_id(), 0)
except NcclError as exc:
    seen["too_big"] = [exc.result, nccl.last_error()]
g.finalize(); g.destroy(); nb.abort()
for c in comms:
    c.destroy()
print(json.dumps(seen))
"""


def test_communicator_lifecycle_in_fake_mode(shim_library, tmp_path):
    done = _run(LIFECYCLE_WORKER, _env(shim_library, NGPU=16, FAKEGPU_QUIET=1), tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["nonblocking"] == [2, 8] and seen["in_group"] == [1, 4]
    assert seen["init_all"] == [[i, 4] for i in range(4)]
    assert seen["init_all_result"] == [2 * 4 ** 4] * 3          # four in-place sums of 4 copies
    assert seen["bad_dtype"][0] == 4 and "invalid datatype 77" in seen["bad_dtype"][1]
    assert seen["after_error"] == [2 * 4 ** 4] * 3
    assert seen["too_big"][0] == 4 and "larger than the logical world NGPU=16" in seen["too_big"][1]


@pytest.mark.parametrize("strides, message", [
    ("4:8,oops", "entry 'oops' is not SIZE:STRIDE"),
    ("4:8", "4 ranks with stride 8 does not fit in the logical world NGPU=16"),
])
def test_bad_comm_stride_hints_fail_init_clearly(shim_library, tmp_path, strides, message):
    script = r"""
import json
from fakegpu.nccl import Nccl, NcclError
nccl = Nccl()
try:
    nccl.comm_init_rank(4, nccl.get_unique_id(), 0)
    print(json.dumps("created"))
except NcclError as exc:
    print(json.dumps(nccl.last_error()))
"""
    done = _run(script, _env(shim_library, NGPU=16, FAKEGPU_FAKE_COMM_STRIDES=strides, FAKEGPU_QUIET=1), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert message in json.loads(done.stdout.strip().splitlines()[-1])


def test_destroying_a_communicator_writes_the_events_even_if_the_process_exits_hard(shim_library, tmp_path):
    events = tmp_path / "ev.jsonl"
    script = r"""
import os, numpy as np
from fakegpu.nccl import Nccl
nccl = Nccl()
c = nccl.comm_init_rank(2, nccl.get_unique_id(), 0)
x = np.ones(2, np.float64)
c.all_reduce(x, x, 2, np.float64, "prod")
c.destroy()
os._exit(0)          # no atexit: no report, but the events are on disk
"""
    done = _run(script, _env(shim_library, NGPU=2, FAKEGPU_FAKE_EVENTS_PATH=events, FAKEGPU_QUIET=1), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [json.loads(line)["event"] for line in events.read_text().splitlines()] == ["world", "comm", "op"]


# ---------------------------------------------------------------------------------------------
# The native fake mode and the torch fake backend's world account the same operations and
# write the same lines (both call native/src/fake/fake_accounting.cc).

SAME_LINES_WORKER = r"""
import numpy as np
from fakegpu.nccl import Nccl
nccl = Nccl()
world = nccl.comm_init_rank(4, nccl.get_unique_id(), 1)
tp = nccl.comm_init_rank(2, nccl.get_unique_id(), 1, name="tp")    # consecutive: [0, 1]
x = np.ones(16, np.float32)
world.all_reduce(x, x, 16, np.float32, "max")
tp.all_gather(x[:8], x, 8, np.float32)
nccl.group_start()
world.send(x, 16, np.float32, 2)     # offset +1: spread over the group
world.recv(x, 16, np.float32, 0)     # offset +1 too: covered by the send, not logged
world.recv(x, 16, np.float32, 3)     # offset -2 to rank 1: 2*1 - 3 < 0, logged
nccl.group_end()
world.broadcast(x, x, 16, np.float32, 0)
print("done")
"""


def test_native_and_torch_fake_worlds_write_the_same_lines(shim_library, tmp_path):
    events = tmp_path / "native.jsonl"
    done = _run(SAME_LINES_WORKER, _env(shim_library, NGPU=4, RANK=1, FAKEGPU_FAKE_EVENTS_PATH=events,
                                        FAKEGPU_QUIET=1), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    native = events.read_text().splitlines()

    from fakegpu.fake import runtime
    from fakegpu.fake.contract import resolve

    world = runtime.FakeWorld(resolve({"NGPU": "4", "RANK": "1"}), events_path=str(tmp_path / "torch.jsonl"))
    everyone = [0, 1, 2, 3]
    assert world.comm_op("world", everyone, 1, "AllReduce", "float32", 4, 16, redop="max")
    assert world.comm_op("tp", [0, 1], 1, "AllGather", "float32", 4, 8)
    assert world.comm_op("world", everyone, 1, "SendRecv", "float32", 4, 16, root=1, peer=2)
    assert not world.comm_op("world", everyone, 1, "SendRecv", "float32", 4, 16, root=0, peer=1)
    assert world.comm_op("world", everyone, 1, "SendRecv", "float32", 4, 16, root=3, peer=1)
    assert world.comm_op("world", everyone, 1, "Broadcast", "float32", 4, 16, root=0)
    world.finished = True
    world.log.close()
    torch_lines = (tmp_path / "torch.jsonl").read_text().splitlines()

    assert native[1:] == torch_lines[1:]            # comm and op lines, byte for byte
    assert len(native) == 1 + 2 + 5
    head_native, head_torch = json.loads(native[0]), json.loads(torch_lines[0])
    assert head_native.pop("frontend") == "native" and head_torch.pop("frontend") == "torch"
    assert head_native == head_torch
