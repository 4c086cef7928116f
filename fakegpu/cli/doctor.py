"""`fgpu doctor [fgpu options]`: what fgpu would set, and whether each piece works.

Each check prints OK, FAIL (with how to fix it) or INFO (optional pieces). The exit status is
1 when any check failed. Checks that load the shim run in a child interpreter, so a broken
library cannot take the doctor down with it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Optional, Sequence

import fakegpu
from fakegpu import _deps, launcher

EXPECTED_NCCL_VERSION = 23007

# The NCCL entry points torch 2.14's CUDA build imports; if any is missing `import torch`
# fails under LD_PRELOAD (the names torch 2.14 imports from libnccl.so.2, read off its binary).
TORCH_NCCL_IMPORTS = (
    "ncclAllGather ncclAllReduce ncclAlltoAll ncclBcast ncclBroadcast ncclCommAbort ncclCommCount "
    "ncclCommDeregister ncclCommDestroy ncclCommFinalize ncclCommGetAsyncError ncclCommGetUniqueId "
    "ncclCommGrow ncclCommInitAll ncclCommInitRank ncclCommInitRankConfig ncclCommInitRankScalable "
    "ncclCommMemStats ncclCommRegister ncclCommResume ncclCommRevoke ncclCommShrink ncclCommSplit "
    "ncclCommSuspend ncclCommUserRank ncclCommWindowDeregister ncclCommWindowRegister "
    "ncclDevCommCreate ncclDevCommDestroy ncclGather ncclGetErrorString ncclGetLastError "
    "ncclGetLsaMultimemDevicePointer ncclGetPeerDevicePointer ncclGetUniqueId ncclGetVersion "
    "ncclGroupEnd ncclGroupSimulateEnd ncclGroupStart ncclMemAlloc ncclMemFree ncclPutSignal "
    "ncclRecv ncclRedOpCreatePreMulSum ncclRedOpDestroy ncclReduce ncclReduceScatter ncclSend "
    "ncclSignal ncclWaitSignal ncclWinGetUserPtr"
).split()

# Run in a child with LD_PRELOAD set: the preloaded shim must be what dlopen("libnccl.so.2")
# returns (that is how it replaces the real NCCL under torch), report the right version and
# export every name torch imports.
_SHIM_PROBE = textwrap.dedent("""
    import ctypes, json, os, sys
    expected = sys.argv[1]
    names = sys.argv[2].split()
    out = {}
    lib = ctypes.CDLL("libnccl.so.2")
    version = ctypes.c_int(0)
    out["result"] = lib.ncclGetVersion(ctypes.byref(version))
    out["version"] = version.value
    out["missing"] = [n for n in names if not hasattr(lib, n)]
    with open("/proc/self/maps") as maps:
        mapped = {line.split()[-1] for line in maps if line.rstrip().endswith(".so.2") or "libnccl" in line}
    out["mapped"] = sorted(p for p in mapped if "libnccl" in p)
    out["preloaded"] = os.path.realpath(expected) in {os.path.realpath(p) for p in out["mapped"]}
    print(json.dumps(out))
""")

# Two ranks of this program allreduce through the shim and the coordinator: the whole path.
_ALLREDUCE_RANK = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from fakegpu.nccl import Nccl
    rank, world, uid_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    nccl = Nccl("libnccl.so.2")
    uid = nccl.shared_unique_id(uid_path, rank, timeout_s=30)
    comm = nccl.comm_init_rank(world, uid, rank)
    send = np.arange(1024, dtype=np.float32) * (rank + 1)
    recv = np.zeros_like(send)
    comm.all_reduce(send, recv, send.size, send.dtype, "sum")
    expected = np.arange(1024, dtype=np.float32) * sum(range(1, world + 1))
    comm.destroy()
    if not np.array_equal(recv, expected):
        sys.exit("rank %d: wrong allreduce result %r..." % (rank, recv[:4]))
    print("rank %d ok" % rank)
""")


class Doctor:
    def __init__(self, out=sys.stdout):
        self.out = out
        self.failures = 0

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def ok(self, what: str) -> None:
        self.say(f"  [OK]   {what}")

    def info(self, what: str) -> None:
        self.say(f"  [INFO] {what}")

    def fail(self, what: str, fix: str) -> None:
        self.failures += 1
        self.say(f"  [FAIL] {what}")
        for line in fix.splitlines():
            self.say(f"         {line}")


def _child_env(extra: Optional[dict] = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = launcher.python_path_for_children(env.get("PYTHONPATH"))
    env.pop("LD_PRELOAD", None)
    env.update(extra or {})
    return env


def check_shim(doc: Doctor) -> Optional[str]:
    try:
        shim = fakegpu.nccl_library_path()
    except FileNotFoundError as exc:
        doc.fail("shim libnccl.so.2 not found", str(exc))
        return None
    if not os.path.isfile(shim):
        doc.fail(f"shim {shim} does not exist",
                 "FAKEGPU_NCCL_LIBRARY names a missing file; unset it or point it at a built libnccl.so.2")
        return None
    doc.ok(f"shim found: {shim}")
    try:
        done = subprocess.run(
            [sys.executable, "-c", _SHIM_PROBE, shim, " ".join(TORCH_NCCL_IMPORTS)],
            env=_child_env({"LD_PRELOAD": shim}), capture_output=True, text=True, timeout=60,
            stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        doc.fail("loading the shim hung for 60 s", "run with LD_DEBUG=libs to see where loading stops")
        return shim
    if done.returncode != 0:
        doc.fail("the shim does not load under LD_PRELOAD",
                 (done.stderr.strip().splitlines() or ["(no output)"])[-1]
                 + "\nrebuild it: cmake -S . -B build && cmake --build build")
        return shim
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    if probe["preloaded"]:
        doc.ok("LD_PRELOAD makes dlopen(\"libnccl.so.2\") return the shim")
    else:
        doc.fail("dlopen(\"libnccl.so.2\") did not return the preloaded shim "
                 f"(mapped: {', '.join(probe['mapped']) or 'nothing'})",
                 "check that the file's SONAME is libnccl.so.2: readelf -d " + shim)
    if probe["result"] == 0 and probe["version"] == EXPECTED_NCCL_VERSION:
        doc.ok(f"ncclGetVersion = {probe['version']}")
    else:
        doc.fail(f"ncclGetVersion returned result {probe['result']}, version {probe['version']} "
                 f"(expected {EXPECTED_NCCL_VERSION})", "the library is not fakegpu's shim or is out of date")
    if probe["missing"]:
        doc.fail(f"{len(probe['missing'])} of the {len(TORCH_NCCL_IMPORTS)} NCCL names torch imports are "
                 f"missing: {' '.join(probe['missing'][:8])}{' ...' if len(probe['missing']) > 8 else ''}",
                 "import torch will fail under this library; rebuild the shim from this source tree")
    else:
        doc.ok(f"exports all {len(TORCH_NCCL_IMPORTS)} NCCL names torch imports")
    return shim


def check_cluster_config(doc: Doctor, cfg: launcher.LaunchConfig) -> None:
    if cfg.cluster_config is None:
        doc.info("no cluster config: the coordinator derives a default topology from the world size")
        return
    try:
        from fakegpu.topology.loader import load_cluster_config
    except ImportError as exc:  # _deps.MissingPackage: PyYAML or jsonschema is not installed
        doc.fail(f"cluster config {cfg.cluster_config} cannot be read", str(exc))
        return
    try:
        topology = load_cluster_config(cfg.cluster_config)
    except Exception as exc:  # the loader's errors name file, field and line
        doc.fail(f"cluster config {cfg.cluster_config} is invalid", str(exc))
        return
    nodes = getattr(topology, "nodes", None)
    doc.ok(f"cluster config {cfg.cluster_config} is valid"
           + (f" ({len(nodes)} nodes)" if nodes is not None else ""))


def check_coordinator(doc: Doctor, cfg: launcher.LaunchConfig, shim: Optional[str], selftest: bool) -> None:
    if not cfg.needs_coordinator:
        doc.info(f"--dist-mode {cfg.dist_mode} needs no coordinator")
        return
    if cfg.coordinator_addr:
        # Someone else's coordinator: only ask it; never start one in its place.
        token_file = cfg.token_file if cfg.token_file and cfg.token_file.exists() else None
        answered, detail = launcher.ping_coordinator(cfg.coordinator_addr, token_file)
        if answered:
            doc.ok(f"coordinator at {cfg.coordinator_addr} answers ping")
        elif "authentic" in detail.lower():
            doc.fail(f"the coordinator at {cfg.coordinator_addr} refused the ping: {detail}",
                     "pass --token-file with a copy of the coordinator's token file"
                     + ("" if token_file or not cfg.token_file else f" ({cfg.token_file} does not exist)"))
        else:
            doc.fail(f"no coordinator answers at {cfg.coordinator_addr}",
                     (detail or "no output") + "\nstart one with `python -m fakegpu coordinator ...`, or drop "
                     "--coordinator-addr and let fgpu start its own")
        return
    try:
        prepared = launcher.prepare(_throwaway(cfg))
    except (launcher.LaunchError, _deps.MissingPackage) as exc:
        doc.fail("could not start a coordinator", str(exc))
        return
    try:
        where = f"{prepared.endpoint.transport}:{prepared.endpoint.address}"
        answered, detail = launcher.ping_coordinator(prepared.endpoint.address, prepared.token_file)
        if answered:
            doc.ok(f"a throwaway coordinator started at {where} answers ping")
        else:
            doc.fail(f"the throwaway coordinator at {where} does not answer ping", detail or "no output")
            return
        if selftest and shim is not None:
            _allreduce_selftest(doc, prepared)
    finally:
        prepared.close()
        for scratch in (prepared.cfg.report, prepared.cfg.markdown_path):
            try:
                scratch.unlink()
            except OSError:
                pass


def _throwaway(cfg: launcher.LaunchConfig) -> launcher.LaunchConfig:
    """The same launch, but on a free port / private socket and with scratch reports, so the
    doctor neither collides with a real run nor overwrites its reports."""
    scratch = Path(tempfile.gettempdir())
    listen = None
    if cfg.listen:
        host, _ = launcher.parse_tcp_address(cfg.listen)
        listen = f"[{host}]:0" if ":" in host else f"{host}:0"
    return dataclasses.replace(cfg, report=scratch / f"fakegpu-doctor-{os.getpid()}.json",
                               markdown_report=scratch / f"fakegpu-doctor-{os.getpid()}.md",
                               trace=None, keep_coordinator=False, listen=listen, token_file=None)


def _allreduce_selftest(doc: Doctor, prepared: launcher.PreparedLaunch) -> None:
    world = 2
    with tempfile.TemporaryDirectory(prefix="fakegpu-doctor-") as scratch:
        env = launcher.rank_environment(prepared.cfg, prepared.endpoint, prepared.token_file)
        env["FAKEGPU_COORDINATOR_TIMEOUT_MS"] = env.get("FAKEGPU_COORDINATOR_TIMEOUT_MS", "30000")
        uid_path = os.path.join(scratch, "uid")
        procs = []
        for rank in range(world):
            rank_env = dict(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _ALLREDUCE_RANK, str(rank), str(world), uid_path],
                env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                stdin=subprocess.DEVNULL))
        outputs, bad = [], False
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                out += "\n(timed out after 90 s)"
            outputs.append(out.strip())
            bad |= proc.returncode != 0
    if bad:
        doc.fail("2-rank allreduce through the shim and the coordinator failed",
                 "\n".join(f"rank {i}: {o.splitlines()[-1] if o else '(no output)'}" for i, o in enumerate(outputs)))
    else:
        doc.ok("2-rank float32 allreduce through the shim and the coordinator gives the exact sum")


def check_torch(doc: Doctor) -> None:
    autoload = launcher.torch_autoload_dir()
    if autoload is not None:
        doc.ok(f"torch backend autoload: {autoload} goes first on PYTHONPATH, so "
               "dist.init_process_group(\"fakegpu\") works without importing fakegpu.torch")
    else:
        doc.info("no torch autoload hook shipped; scripts must `import fakegpu.torch` to use backend \"fakegpu\"")
    try:
        done = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                              env=_child_env(), capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        doc.info("importing torch took more than 120 s; skipped")
        return
    if done.returncode == 0:
        doc.info(f"torch {done.stdout.strip()} is installed")
    else:
        doc.info("torch is not installed (only needed for torch jobs)")


def print_environment(doc: Doctor, cfg: launcher.LaunchConfig, shim: Optional[str]) -> None:
    if cfg.needs_coordinator:
        if cfg.coordinator_addr:
            endpoint = launcher.Endpoint(cfg.transport, cfg.coordinator_addr)
        elif cfg.transport == "tcp":
            endpoint = launcher.Endpoint("tcp", cfg.listen or "127.0.0.1:<free port>")
        else:
            endpoint = launcher.Endpoint("unix", "<private 0700 directory>/coordinator.sock")
        token = cfg.token_file or Path("<private 0700 directory>/token")
    else:
        endpoint, token = None, None
    env = launcher.rank_environment(cfg, endpoint, token, base={k: v for k, v in os.environ.items()
                                                               if k in ("LD_PRELOAD", "PYTHONPATH")},
                                    shim=shim or "<shim not found>")
    doc.say("environment fgpu would give the command:")
    for name in sorted(env):
        doc.say(f"  {name}={env[name]}")


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Show the environment fgpu would set and check the shim and the coordinator. "
                               "Takes the same options as fgpu.", allow_abbrev=False)
    launcher.add_launch_options(parser)
    parser.add_argument("--no-selftest", action="store_true",
                        help="skip the 2-rank allreduce through the shim and the coordinator")
    parser.add_argument("--no-torch", action="store_true", help="skip the torch checks")
    return parser


def main(argv: Optional[Sequence[str]] = None, prog: str = "fgpu doctor") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser(prog).parse_args(argv)
    doc = Doctor()
    doc.say(f"fakegpu {fakegpu.__version__} doctor (python {sys.version.split()[0]}, {sys.executable})")
    try:
        cfg = launcher.config_from_args(ns)
    except launcher.LaunchError as exc:
        doc.say("checks:")
        doc.fail("the options are invalid", str(exc))
        return 1
    try:
        shim_for_env = fakegpu.nccl_library_path()
    except FileNotFoundError:
        shim_for_env = None
    print_environment(doc, cfg, shim_for_env)
    doc.say("checks:")
    shim = check_shim(doc)
    check_cluster_config(doc, cfg)
    check_coordinator(doc, cfg, shim, selftest=not ns.no_selftest)
    if not ns.no_torch:
        check_torch(doc)
    doc.say("all checks passed" if doc.failures == 0 else f"{doc.failures} check(s) failed")
    return 0 if doc.failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
