"""Shared memory that cannot fault (docs/protocol.md, "Staging size" and "Host-local collectives").

Every shared-memory page a rank or the coordinator maps is allocated first, so a /dev/shm that
is too small ends in a fallback (socket staging, no arena) with a log line, never in a SIGBUS;
and the default staging size shrinks with the world so that large worlds fit /dev/shm at all.

The job tests run a real coordinator and real C ranks (native/tests/world_allreduce.c, which
checks every element of its int32 allreduce exactly) in a private mount namespace whose
/dev/shm is a small tmpfs; they need root, as CI has.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from fakegpu import protocol as P
from fakegpu.coordinator import shm as SHM

from helpers.native_programs import build_c_program
from helpers.world_job import private_shm_problem, run_world_job

from test_coordinator_core import Harness
from helpers.paths import REPO_ROOT

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture(scope="module")
def world_allreduce(shim_library, tmp_path_factory):
    return build_c_program("world_allreduce.c", tmp_path_factory.mktemp("world") / "world_allreduce",
                           shim_library)


@pytest.fixture(scope="module")
def private_shm():
    problem = private_shm_problem()
    if problem:
        pytest.skip(problem)


def _check_job(result: dict, nranks: int) -> None:
    assert not result["timed_out"], "the job did not finish"
    assert result["coordinator_died"] is None, f"the coordinator died ({result['coordinator_died']}; -7 is SIGBUS)"
    bad = {r: (rc, result["outputs"][r][-800:]) for r, rc in enumerate(result["returncodes"]) if rc != 0}
    assert not bad, f"ranks failed (exit -7 is SIGBUS): {bad}\ncoordinator:\n{result['coordinator_log']}"
    for rank in range(nranks):
        assert f"world_allreduce rank {rank}: OK" in result["outputs"][rank]
    assert result["shm_files_after"] == [], "segments or arenas left in /dev/shm"


def _check_arena_used(result: dict, calls: int) -> None:
    """The world had an arena and ran calls in it. A call whose ranks arrive more than the
    arena's patience (5 s) apart is decided by the coordinator instead, which with hundreds of
    processes on a loaded machine can happen; every call is one or the other."""
    status = result["status"]   # "ops" counts every call, "local_ops" those run in an arena
    assert status["arenas"] == 1 and 1 <= status["local_ops"] <= calls and status["ops"] == calls, status


def _lines(result: dict, text: str) -> list[str]:
    return [line for line in result["coordinator_log"].splitlines() if text in line]


# --------------------------------------------------------------------------- the sizing rule


def test_default_staging_shrinks_with_the_world():
    host = 24 * GiB
    ceiling = 32 * MiB
    assert SHM.default_staging_bytes(-1, host, ceiling) == 32 * MiB     # WORLD_SIZE unknown
    assert SHM.default_staging_bytes(4, host, ceiling) == 32 * MiB
    assert SHM.default_staging_bytes(512, host, ceiling) == 4 * MiB    # 24G/4/1024 = 6 MiB -> 4 MiB
    assert SHM.default_staging_bytes(2048, host, ceiling) == 1 * MiB
    assert SHM.default_staging_bytes(4, 260 * MiB, ceiling) == 8 * MiB
    assert SHM.default_staging_bytes(10 ** 6, host, ceiling) == SHM.MIN_DEFAULT_STAGING_BYTES
    assert SHM.default_staging_bytes(4, 0, ceiling) == SHM.MIN_DEFAULT_STAGING_BYTES
    # The segments of a whole world stay within a quarter of the host's shared memory.
    for n in (1, 3, 64, 300, 512, 1000, 2048, 4096):
        s = SHM.default_staging_bytes(n, host, ceiling)
        assert n * 2 * s <= host // 4 and s & (s - 1) == 0


def test_host_shm_bytes_is_the_smaller_of_dev_shm_and_memory():
    got = SHM.host_shm_bytes()
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < got <= memory
    if os.path.isdir("/dev/shm"):
        assert got <= shutil.disk_usage("/dev/shm").total


def _granted(world_size: int, staging: int, host: int = 24 * GiB) -> int:
    h = Harness(host_shm_bytes=host)
    ok = h.hello(0, rank=0, staging=staging, world_size=world_size)
    assert isinstance(ok, P.HelloOk), ok
    return ok.staging_bytes


def test_coordinator_chooses_s_from_the_world_when_the_client_leaves_it_open():
    assert _granted(512, 0) == 4 * MiB
    assert _granted(-1, 0) == 32 * MiB
    assert _granted(4, 0, host=260 * MiB) == 8 * MiB


def test_an_explicit_staging_request_is_granted_whatever_the_world():
    assert _granted(512, 32 * MiB) == 32 * MiB
    assert _granted(512, 64 << 10) == 64 << 10


# --------------------------------------------------------------------------- real jobs


@pytest.mark.parametrize("shm_size", ["260m", "256m"])
def test_arena_that_does_not_fit_dev_shm_is_refused_and_the_results_are_exact(private_shm, world_allreduce,
                                                                                shm_size):
    # 4 ranks of 2 x 32 MiB staging (the old default, asked for explicitly) fill 256 MiB; the
    # 10 MiB arena does not fit. It was created sparse: with 260 MiB the ranks died of SIGBUS
    # at their first 1 MiB allreduce, with 256 MiB the coordinator itself did, writing the
    # arena's header. Now it is refused and the calls go to the coordinator.
    result = run_world_job(world_allreduce, 4, count=MiB // 4, iterations=3, shm_size=shm_size,
                           rank_env={"FAKEGPU_STAGING_CHUNK_BYTES": "32M"}, timeout_s=120)
    _check_job(result, 4)
    refused = _lines(result, "arena in /dev/shm")
    assert len(refused) == 1, result["coordinator_log"]
    assert "No space left on device" in refused[0] and "go through the coordinator" in refused[0]
    assert result["status"]["arenas"] == 0 and result["status"]["local_ops"] == 0
    assert result["status"]["ops"] == 3


def test_default_staging_leaves_room_for_the_arena_in_a_small_dev_shm(private_shm, world_allreduce):
    # Same machine, default settings: S shrinks to 8 MiB for a world of 4 in 260 MiB, the arena
    # fits, and every call runs in it.
    result = run_world_job(world_allreduce, 4, count=MiB // 4, iterations=3, shm_size="260m", timeout_s=120)
    _check_job(result, 4)
    assert result["status"]["arenas"] == 1 and result["status"]["local_ops"] == 3
    assert not _lines(result, "cannot allocate")


def test_a_segment_that_cannot_be_allocated_falls_back_to_socket_staging(private_shm, world_allreduce):
    # 5 ranks of 64 MiB in 260 MiB: the fifth segment cannot be allocated, that rank stages
    # through its socket (one warning), the world has no arena, and every result is exact.
    result = run_world_job(world_allreduce, 5, count=MiB // 4, iterations=2, shm_size="260m",
                           rank_env={"FAKEGPU_STAGING_CHUNK_BYTES": "32M"}, timeout_s=120)
    _check_job(result, 5)
    fallbacks = _lines(result, "staging segment")
    assert len(fallbacks) == 1 and "socket staging" in fallbacks[0], result["coordinator_log"]
    assert result["status"]["arenas"] == 0 and result["status"]["ops"] == 2


def test_64_ranks_in_a_small_dev_shm_all_get_shared_memory_and_an_arena(private_shm, world_allreduce):
    # 64 x 2 x 32 MiB = 4 GiB never fitted 512 MiB: ranks past the eighth staged through their
    # sockets and the world got no arena. With S chosen for the world (1 MiB) all of it fits.
    result = run_world_job(world_allreduce, 64, count=1, iterations=3, shm_size="512m", timeout_s=240)
    _check_job(result, 64)
    assert not _lines(result, "cannot allocate"), result["coordinator_log"]
    _check_arena_used(result, calls=3)


@pytest.mark.slow   # 512 processes on two cores: about 20-30 s
def test_512_ranks_with_default_settings(world_allreduce):
    result = run_world_job(world_allreduce, 512, count=1, iterations=3, timeout_s=600)
    _check_job(result, 512)
    if SHM.host_shm_bytes() >= 8 * GiB:   # a host like the 24 GiB development VM: the arena path
        _check_arena_used(result, calls=3)


def test_coordinator_allocates_an_empty_segment_before_mapping_it():
    from fakegpu.coordinator import server
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    name = f"/fakegpu-test-{os.getpid()}-alloc"
    path = "/dev/shm" + name
    open(path, "wb").close()           # what the shim creates: an empty segment
    try:
        S = 1 << 16
        region = server.map_shm_segment(name, S)
        assert region is not None and region.size == 2 * S
        st = os.stat(path)
        assert st.st_size == 2 * S and st.st_blocks * 512 >= 2 * S   # allocated, not sparse
        region[:] = 7                    # every page is there
    finally:
        os.unlink(path)


_GRANT_WITHOUT_ALLOCATING = r"""
import os, socket, sys, threading
from fakegpu import protocol as P
from fakegpu.nccl import Nccl, NcclError

path = sys.argv[1]
srv = socket.socket(socket.AF_UNIX)
srv.bind(path)
srv.listen(1)

def serve():
    conn, _ = srv.accept()
    parser = P.FrameParser(1 << 20)
    while True:
        data = conn.recv(65536)
        if not data:
            return
        for frame in parser.feed(data):
            if frame.msg_type == P.HELLO:
                # bit0 (shared memory accepted) for a segment nobody allocated: a coordinator
                # that broke the rule. The shim must refuse to map it, not SIGBUS later.
                ok = P.HelloOk(client_id=1, flags=P.HELLO_FLAG_SHM, staging_bytes=1 << 20, timeout_ms=5000)
                conn.sendall(P.encode_frame(ok, frame.request_id))

threading.Thread(target=serve, daemon=True).start()
os.environ.update(FAKEGPU_COORDINATOR_TRANSPORT="unix", FAKEGPU_COORDINATOR_ADDR=path)
nccl = Nccl()
try:
    nccl.comm_init_rank(1, bytes(128), 0)
except NcclError as exc:
    print("REFUSED", exc.name, exc)
    sys.exit(0)
print("MAPPED")
sys.exit(1)
"""


def test_shim_refuses_to_map_a_segment_the_coordinator_did_not_allocate(shim_library, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_")}
    env.update(FAKEGPU_NCCL_LIBRARY=shim_library, FAKEGPU_DIST_MODE="simulate",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", _GRANT_WITHOUT_ALLOCATING, str(tmp_path / "c.sock")],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "REFUSED ncclSystemError" in proc.stdout and "is not allocated" in proc.stdout, proc.stdout
