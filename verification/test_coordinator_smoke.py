"""Coordinator lifecycle, end to end with real processes, on a Unix socket and on TCP:
start it (`python -m fakegpu coordinator`), see it answer --ping, run a 2-rank allreduce
through the shim (exact result), stop it with --shutdown, and check that it exited 0, removed
its socket, and wrote a JSON report that validates against cluster_report.schema.json plus
the Markdown report.

    python3 verification/test_coordinator_smoke.py [--transport unix|tcp|both]   (default both)
"""
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import direct  # noqa: E402

CALL = {"kind": "all_reduce", "dtype": int(direct.DataType.float32), "count": 1024, "seed": 7}


def lifecycle(transport: str, timeout_s: float) -> list[str]:
    """The steps that went wrong (empty when the whole lifecycle worked)."""
    out = Path(tempfile.mkdtemp(prefix="fgpu-smoke-"))
    report, markdown = out / "report.json", out / "report.md"
    coord = direct.CoordinatorProcess(transport, extra_args=("--report", str(report),
                                                             "--markdown-report", str(markdown)))
    token = {"FAKEGPU_COORDINATOR_TOKEN": coord.token}
    problems = []
    try:
        ping = direct.coordinator_cli("--ping", coord.address, env=token)
        if ping.returncode != 0:
            problems.append(f"--ping {coord.address} exited {ping.returncode}: {ping.stdout}{ping.stderr}")
        run = direct.run_ranks(2, [("collective", CALL)], coord, library=direct.shim(), timeout_s=timeout_s)
        for rank in range(2):
            got, want = run.ok(0, rank)["out"], direct.expected_collective(2, rank, **CALL)
            if not direct.data.same_bits(got, want):
                problems.append(f"rank {rank}: {direct.data.describe_mismatch(got, want)}")
        stop = direct.coordinator_cli("--shutdown", coord.address, env=token)
        if stop.returncode != 0:
            problems.append(f"--shutdown exited {stop.returncode}: {stop.stdout}{stop.stderr}")
        deadline = time.monotonic() + 30
        while coord.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        if coord.alive():
            problems.append("the coordinator was still running 30 s after --shutdown")
    finally:
        status = coord.stop()
    if status != 0:
        problems.append(f"the coordinator exited with status {status}:\n{coord.log(20)}")
    if transport == "unix" and os.path.exists(coord.address):
        problems.append(f"the socket {coord.address} was left behind")
    check = direct.subprocess.run([sys.executable, "-m", "fakegpu", "report", "check", str(report),
                                   "--expect-world-size", "2", "--expect-collective", "AllReduce"],
                                  capture_output=True, text=True, timeout=60, cwd=str(direct.REPO),
                                  env={**os.environ, "PYTHONPATH": str(direct.REPO)})
    if check.returncode != 0:
        problems.append(f"report check: {check.stdout}{check.stderr}")
    if not markdown.is_file() or "AllReduce" not in markdown.read_text():
        problems.append(f"no Markdown report with the AllReduce at {markdown}")
    return problems


def check(args) -> int:
    failures = 0
    for transport in direct.transports(args.transport):
        started = time.monotonic()
        try:
            problems = lifecycle(transport, args.timeout)
        except (direct.RankRunFailed, RuntimeError) as exc:
            problems = [str(exc)]
        failures += bool(problems)
        print(f"coordinator smoke over {transport}: "
              + ("; ".join(problems) if problems else
                 f"started, answered --ping, 2-rank allreduce exact, --shutdown exit 0, "
                 f"reports valid [{time.monotonic() - started:.1f} s]"))
    print(f"coordinator smoke: {'FAILED' if failures else 'OK'}")
    return 1 if failures else 0


parser = direct.parser(__doc__)
parser.set_defaults(transport="both")
main = direct.main_of(check, parser)

if __name__ == "__main__":
    sys.exit(main())
