"""Drive native/tests/shim_bench (C ranks, no Python in the ranks) against a fresh coordinator.

    python benchmarks/shim_bench.py --bench /tmp/build/shim_bench [--ranks 4] [--transport unix|tcp]
        [--min 4] [--max 16777216] [--factor 16] [--iters 50] [--profile OUT.txt]

Shows what the shim + coordinator cost alone (no cffi / numpy in the ranks).  ``--profile``
runs the coordinator under cProfile and writes the top functions to OUT.txt.
"""
from __future__ import annotations

import argparse
import os
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", required=True, help="path of the built shim_bench executable")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--transport", choices=("unix", "tcp"), default="unix")
    p.add_argument("--min", type=int, default=4)
    p.add_argument("--max", type=int, default=16 << 20)
    p.add_argument("--factor", type=int, default=16)
    p.add_argument("--iters", type=int, default=50)
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
            import socket
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
            time.sleep(0.3)
            renv = dict(env, FAKEGPU_COORDINATOR_ADDR=addr, FAKEGPU_COORDINATOR_TRANSPORT=args.transport,
                        WORLD_SIZE=str(args.ranks), LD_LIBRARY_PATH=str(lib.parent))
            ranks = [subprocess.Popen([args.bench, str(tmp / "uid"), str(args.min), str(args.max),
                                       str(args.factor), str(args.iters)],
                                      env=dict(renv, RANK=str(r), LOCAL_RANK=str(r)))
                     for r in range(args.ranks)]
            rc = 0
            rank_cpu = 0.0
            rank_faults = 0
            for r in ranks:
                _, status, usage = os.wait4(r.pid, 0)
                r.returncode = os.waitstatus_to_exitcode(status)
                rc |= r.returncode
                rank_cpu += usage.ru_utime + usage.ru_stime
                rank_faults += usage.ru_minflt
            coord_cpu = _cpu_seconds(coord.pid)
            sizes, b = 0, args.min
            while b <= args.max:
                sizes += 1
                b = args.max if b * args.factor > args.max and b < args.max else b * args.factor
            ops = sizes * (args.iters + 5)
            print(f"# CPU per op (all sizes, incl. warmup): coordinator {coord_cpu / ops * 1e6:.1f} us, "
                  f"ranks together {rank_cpu / ops * 1e6:.1f} us, {rank_faults / ops:.0f} page faults (load {os.getloadavg()[0]:.2f})")
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
