"""Drive native/tests/shim_bench (C ranks, no Python in the ranks) against a fresh coordinator.

    python benchmarks/shim_bench.py --bench /tmp/build/shim_bench [--ranks 4] [--transport unix|tcp]
        [--min 4] [--max 16777216] [--factor 16] [--iters 50] [--profile OUT.txt]

Shows what the shim + coordinator cost alone (no cffi / numpy in the ranks).  ``--profile``
runs the coordinator under cProfile and writes the top functions to OUT.txt.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_split(pid: int) -> tuple:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", required=True, help="path of the built shim_bench executable")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--transport", choices=("unix", "tcp"), default="unix")
    p.add_argument("--min", type=int, default=4)
    p.add_argument("--max", type=int, default=16 << 20)
    p.add_argument("--factor", type=int, default=16)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--py-spy", help="sample the coordinator with py-spy while the ranks run; "
                                      "flat profile to this file")
    p.add_argument("--profile", help="cProfile the coordinator, top functions to this file")
    args = p.parse_args(argv)

    lib = Path(args.bench).resolve().parent / "libnccl.so.2"
    with tempfile.TemporaryDirectory(prefix="fgpu-shimbench-") as tmp:
        tmp = Path(tmp)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        if args.transport == "unix":
            addr = str(tmp / "c.sock")
            listen = ["--transport", "unix", "--address", addr]
        else:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            addr = f"127.0.0.1:{port}"
            listen = ["--transport", "tcp", "--listen", addr]
        prof = str(tmp / "coord.prof")
        py = [sys.executable] + (["-m", "cProfile", "-o", prof] if args.profile else [])
        coord = subprocess.Popen(py + ["-m", "fakegpu", "coordinator", *listen,
                                       "--report", str(tmp / "r.json")], env=env, cwd=tmp)
        try:
            deadline = time.time() + 30
            while args.transport == "unix" and not os.path.exists(addr):
                if time.time() > deadline or coord.poll() is not None:
                    raise SystemExit("coordinator did not start")
                time.sleep(0.05)
            while args.transport == "tcp":
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.time() > deadline or coord.poll() is not None:
                        raise SystemExit("coordinator did not start")
                    time.sleep(0.05)
            time.sleep(0.3)
            coord_cpu0 = _cpu_seconds(coord.pid)
            split0 = _cpu_split(coord.pid)  # imports and startup are not per-op costs
            renv = dict(env, FAKEGPU_COORDINATOR_ADDR=addr, FAKEGPU_COORDINATOR_TRANSPORT=args.transport,
                        WORLD_SIZE=str(args.ranks), LD_LIBRARY_PATH=str(lib.parent))
            ranks = [subprocess.Popen([args.bench, str(tmp / "uid"), str(args.min), str(args.max),
                                       str(args.factor), str(args.iters)],
                                      env=dict(renv, RANK=str(r), LOCAL_RANK=str(r)))
                     for r in range(args.ranks)]
            spy = None
            if args.py_spy:
                spy = subprocess.Popen(["py-spy", "record", "--pid", str(coord.pid), "--format", "raw",
                                        "-r", "500", "-o", args.py_spy],
                                       stdout=subprocess.DEVNULL)
            rc = 0
            rank_cpu = 0.0
            rank_faults = 0
            for r in ranks:
                _, status, usage = os.wait4(r.pid, 0)
                r.returncode = os.waitstatus_to_exitcode(status)
                rc |= r.returncode
                rank_cpu += usage.ru_utime + usage.ru_stime
                rank_faults += usage.ru_minflt
            coord_cpu = _cpu_seconds(coord.pid) - coord_cpu0
            split = [a - b for a, b in zip(_cpu_split(coord.pid), split0)]
            if spy is not None:
                spy.send_signal(2)
                spy.wait(60)
            sizes, b = 0, args.min
            while b <= args.max:
                sizes += 1
                b = args.max if b * args.factor > args.max and b < args.max else b * args.factor
            ops = sizes * (args.iters + 5)
            print(f"# CPU per op (all sizes, incl. warmup): coordinator {coord_cpu / ops * 1e6:.1f} us, "
                  f"(user {split[0] / ops * 1e6:.0f}, system {split[1] / ops * 1e6:.0f}), ranks together {rank_cpu / ops * 1e6:.1f} us, {rank_faults / ops:.0f} page faults (load {os.getloadavg()[0]:.2f})")
        finally:
            subprocess.run([sys.executable, "-m", "fakegpu", "coordinator", "--shutdown", addr],
                           env=env, capture_output=True, timeout=30)
            coord.wait(60)
        if args.profile:
            import pstats
            with open(args.profile, "w") as fh:
                pstats.Stats(prof, stream=fh).sort_stats("tottime").print_stats(30)
        return rc


if __name__ == "__main__":
    sys.exit(main())
