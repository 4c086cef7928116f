"""`./ftest [NAME ...]`: the maintained check groups the usage doc names (`./ftest tcp_bandwidth`,
`./ftest distributed_resilience`), each a list of commands run from the checkout's root.

    ./ftest                 list the groups and what each runs
    ./ftest NAME [NAME...]  run them; exit 0 only if every command of every group passed

The pytest groups are selections of tests/; the others run verification/ scripts. The shim is
FAKEGPU_NCCL_LIBRARY, else ./build/libnccl.so.2 (cmake -S . -B build && cmake --build build),
else what fakegpu finds installed.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
PYTEST = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider"]

# name -> (what it checks, [commands])
GROUPS: dict[str, tuple[str, list[list[str]]]] = {
    "direct": ("coordinator lifecycle, allreduce/allgather correctness, grouped submission semantics", [
        [PY, "verification/test_coordinator_smoke.py"],
        [PY, "verification/test_allreduce_correctness.py"],
        [PY, "verification/test_allgather_correctness.py"],
        [PY, "verification/test_group_semantics.py"],
    ]),
    "tcp_bandwidth": ("the bandwidth tool over TCP: two logical nodes, separately started ranks "
                      "meeting by --session, disagreeing hosts reported, the usage doc's commands", [
        [*PYTEST, "tests/e2e/test_collectives_bandwidth.py", "-k",
         "listen_tcp or separately_started or mismatched or session_required"],
        [*PYTEST, "tests/e2e/test_multihost_netns.py", "-k", "bandwidth"],
    ]),
    "distributed_resilience": ("failures end calls instead of hanging: killed, hung, slow and missing "
                               "peers, disagreeing calls, a lost coordinator, abort and shrink, "
                               "and how the report counts them", [
        [*PYTEST, "tests/integration/test_faults.py", "tests/unit/test_faults_core.py", "tests/integration/test_report_failures.py",
         "tests/integration/test_local_collectives.py::test_a_rank_that_never_comes_times_out_like_before"],
    ]),
    "multinode_sim": ("torchrun jobs over 2 and 4 simulated ranks on two nodes, every collective "
                      "checked, report validated", [
        ["verification/run_multinode_sim.sh", "2"],
        ["verification/run_multinode_sim.sh", "4"],
        ["verification/run_ddp_multinode.sh", "4"],
    ]),
    "hybrid_numerics": ("the DDP, FSDP and FSDP2 numerics runners (hybrid mode on a GPU, their CPU "
                        "form without one)", [
        [PY, "verification/run_hybrid_ddp_numerics.py", "--variant", "all"],
        [PY, "verification/run_hybrid_fsdp_numerics.py"],
        [PY, "verification/run_hybrid_fsdp2_numerics.py", "--world-size", "4", "--precision", "bf16"],
        [PY, "verification/run_hybrid_fsdp2_numerics.py", "--world-size", "4", "--precision", "bf16",
         "--reduce-precision", "parameter"],
    ]),
    "physical_multihost": ("the SSH controller end to end on two network-namespace hosts (root)", [
        [*PYTEST, "tests/e2e/test_physical_multihost.py"],
    ]),
}


def environment() -> dict:
    env = dict(os.environ)
    shim = REPO / "build" / "libnccl.so.2"
    if not env.get("FAKEGPU_NCCL_LIBRARY") and shim.is_file():
        env["FAKEGPU_NCCL_LIBRARY"] = str(shim)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("FAKEGPU_PYTHON", PY)   # the shell launchers use this interpreter too
    return env


def list_groups() -> None:
    print("check groups (./ftest NAME):")
    for name, (what, commands) in GROUPS.items():
        print(f"  {name:24} {what}")
        for command in commands:
            shown = ["python3" if c == PY else c for c in command]
            print(f"  {'':24}   $ {' '.join(shown)}")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-l", "--list", "-h", "--help"):
        list_groups()
        return 0
    unknown = [n for n in argv if n not in GROUPS]
    if unknown:
        print(f"ftest: unknown group(s) {', '.join(unknown)}; choose from {', '.join(GROUPS)}", file=sys.stderr)
        return 2
    env = environment()
    failed = []
    for name in argv:
        for command in GROUPS[name][1]:
            started = time.monotonic()
            print(f"ftest {name}: $ {' '.join(command)}", flush=True)
            status = subprocess.run(command, cwd=str(REPO), env=env).returncode
            verdict = "PASS" if status == 0 else f"FAIL (exit {status})"
            print(f"ftest {name}: {verdict} [{time.monotonic() - started:.1f} s]", flush=True)
            if status != 0:
                failed.append(f"{name}: {' '.join(command)}")
    print(f"ftest: {'FAILED: ' + '; '.join(failed) if failed else 'all passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
