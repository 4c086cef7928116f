"""Run a verification case under gloo and under fakegpu, and compare the final parameters.

    python verification/run_case.py ddp              # one case
    python verification/run_case.py --all            # every case
    python verification/run_case.py --list

For the fakegpu run it starts its own coordinator on a Unix socket
(``python -m fakegpu coordinator --transport unix --address SOCK --report R.json``), points
the ranks at it with FAKEGPU_COORDINATOR_ADDR and puts fakegpu's torch autoload folder on
PYTHONPATH (no LD_PRELOAD: the CPU backend loads the shim itself through cffi).  After the run
it validates the report with ``python -m fakegpu report check``.

Comparison: each rank's local parameters and losses, gloo against fakegpu.  Cases whose
reductions have a single possible order (two contributions, or none) must match bit for bit;
the others must agree within the case's stated tolerance.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
READY_MARKER = "fakegpu coordinator listening on"
RUN_TIMEOUT_S = float(os.environ.get("FAKEGPU_VERIFY_TIMEOUT_S", "300"))


@dataclasses.dataclass(frozen=True)
class Case:
    script: str
    args: tuple[str, ...] = ()
    nproc: int = 2
    # None: must be bit-identical; else (rtol, atol) for torch.allclose.
    tolerance: Optional[tuple[float, float]] = None
    compare_with_gloo: bool = True
    why: str = ""


CASES: dict[str, Case] = {
    "collectives": Case("check_collectives.py", nproc=4, compare_with_gloo=False,
                        why="every collective, dtype and op checked against locally computed values"),
    "ddp_all": Case("ddp.py", ("--variant", "all"),
                    why="the five DDP variants below, one after another in one torchrun job"),
    "ddp": Case("ddp.py", ("--variant", "plain")),
    "ddp_no_sync": Case("ddp.py", ("--variant", "no_sync")),
    "ddp_find_unused": Case("ddp.py", ("--variant", "find_unused")),
    "ddp_static_graph": Case("ddp.py", ("--variant", "static_graph")),
    "ddp_bucket_view": Case("ddp.py", ("--variant", "bucket_view")),
    "ddp_4rank": Case("ddp.py", ("--variant", "plain"), nproc=4,
                      why="4 ranks, bit for bit: the torch backend sums in gloo's order "
                          "(FAKEGPU_REDUCTION_ORDER=rank allows last-bit differences)"),
    "fsdp1": Case("fsdp1.py"),
    "fsdp2": Case("fsdp2.py", ("--variant", "fp32")),
    "fsdp2_bf16": Case("fsdp2.py", ("--variant", "bf16")),
    "tp": Case("tp.py"),
    "pp_gpipe": Case("pp.py", ("--schedule", "gpipe")),
    "pp_1f1b": Case("pp.py", ("--schedule", "1f1b")),
    "hsdp": Case("hsdp.py", nproc=4),
}


# What --all and the pytest suite run: every workload once (the single DDP variants above are
# covered by ddp_all, which saves one torchrun start per variant and backend).
SUITE = ["collectives", "ddp_all", "ddp_4rank", "fsdp1", "fsdp2", "fsdp2_bf16", "tp",
         "pp_gpipe", "pp_1f1b", "hsdp"]


class CaseFailure(Exception):
    pass


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _pythonpath(*entries: str) -> str:
    existing = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([*entries, *([existing] if existing else [])])


def _torchrun(case: Case, backend: str, out: Path, env: dict[str, str], log: Path) -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={case.nproc}", str(HERE / case.script),
            "--backend", backend, "--out", str(out), *case.args]
    with open(log, "w") as sink:
        try:
            proc = subprocess.run(argv, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                  timeout=RUN_TIMEOUT_S, cwd=REPO)
        except subprocess.TimeoutExpired:
            raise CaseFailure(f"{backend} run timed out after {RUN_TIMEOUT_S:g} s (log: {log})") from None
    if proc.returncode != 0:
        tail = "".join(open(log).readlines()[-40:])
        raise CaseFailure(f"{backend} run exited with {proc.returncode} (log: {log}):\n{tail}")


class Coordinator:
    """A ``python -m fakegpu coordinator`` on a Unix socket, stopped with SIGTERM (which makes
    it write its reports)."""

    def __init__(self, workdir: Path, report: Path, cluster_config: Optional[str] = None):
        self.socket = workdir / "coordinator.sock"
        self.log = workdir / "coordinator.log"
        argv = [sys.executable, "-m", "fakegpu", "coordinator", "--transport", "unix",
                "--address", str(self.socket), "--report", str(report)]
        if cluster_config:
            argv += ["--cluster-config", cluster_config]
        env = _base_env()
        env["PYTHONPATH"] = _pythonpath(str(REPO))
        self._sink = open(self.log, "w")
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=self._sink,
                                     text=True, cwd=REPO)
        ready = threading.Event()

        def pump():
            for line in self.proc.stdout:
                self._sink.write(line)
                self._sink.flush()
                if READY_MARKER in line:
                    ready.set()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        deadline = time.monotonic() + 30
        while not ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise CaseFailure(f"the coordinator did not start (log: {self.log}):\n"
                                  + self.log.read_text()[-3000:])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._pump.join(timeout=5)
        self._sink.close()
        return self.proc.returncode


def check_report(report: Path) -> str:
    from importlib.util import find_spec

    if find_spec("fakegpu.cli.report") is None:
        return "report check skipped: `python -m fakegpu report check` is not available"
    proc = subprocess.run([sys.executable, "-m", "fakegpu", "report", "check", str(report)],
                          env={**_base_env(), "PYTHONPATH": _pythonpath(str(REPO))},
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    if proc.returncode != 0:
        raise CaseFailure(f"report check failed for {report}:\n{proc.stdout}{proc.stderr}")
    return proc.stdout.strip()


def run_fakegpu(case: Case, workdir: Path, cluster_config: Optional[str] = None) -> tuple[Path, Path]:
    from fakegpu.torch.autoload import pythonpath_entry

    out, report = workdir / "fakegpu", workdir / "report.json"
    coordinator = Coordinator(workdir, report, cluster_config)
    try:
        env = _base_env()
        env["FAKEGPU_COORDINATOR_ADDR"] = str(coordinator.socket)
        # The autoload folder registers the backend in every rank without the script asking.
        env["PYTHONPATH"] = _pythonpath(pythonpath_entry(), str(REPO))
        _torchrun(case, "fakegpu", out, env, workdir / "fakegpu.log")
    finally:
        code = coordinator.stop()
    if code not in (0, -signal.SIGTERM):
        raise CaseFailure(f"the coordinator exited with {code} (log: {coordinator.log})")
    if not report.is_file():
        raise CaseFailure(f"the coordinator wrote no report at {report}")
    return out, report


def run_gloo(case: Case, workdir: Path) -> Path:
    out = workdir / "gloo"
    env = _base_env()
    env["PYTHONPATH"] = _pythonpath(str(REPO))
    _torchrun(case, "gloo", out, env, workdir / "gloo.log")
    return out


def compare(case: Case, gloo: Path, fake: Path) -> str:
    """'bit-exact' or 'within rtol/atol'; raises CaseFailure naming the worst tensor."""
    import torch

    exact = True
    worst = (0.0, "")
    if case.tolerance is None and case.nproc > 2 and os.environ.get("FAKEGPU_REDUCTION_ORDER", "").strip() == "rank":
        # rank order associates a >2-way float sum differently from gloo's ring: last bits differ
        case = dataclasses.replace(case, tolerance=(1e-5, 1e-7))
    results = sorted(p.relative_to(gloo) for p in gloo.rglob("rank*.pt"))
    expected = {f"rank{r}.pt" for r in range(case.nproc)}
    if not results or {p.name for p in results} != expected:
        raise CaseFailure(f"gloo run left {[str(p) for p in results]}, expected {sorted(expected)}")
    for rel in results:
        where = f"{rel.parent}/" if str(rel.parent) != "." else ""
        rank = f"{where}{rel.stem}"
        if not (fake / rel).is_file():
            raise CaseFailure(f"the fakegpu run left no {rel}")
        a = torch.load(gloo / rel)
        b = torch.load(fake / rel)
        if set(a["params"]) != set(b["params"]):
            raise CaseFailure(f"{rank}: parameter names differ: {sorted(a['params'])} vs {sorted(b['params'])}")
        pairs = [(f"{rank} {name}", a["params"][name], b["params"][name]) for name in a["params"]]
        pairs.append((f"{rank} losses", torch.tensor(a["losses"]), torch.tensor(b["losses"])))
        for what, x, y in pairs:
            if x.shape != y.shape:
                raise CaseFailure(f"{what}: shape {tuple(x.shape)} (gloo) vs {tuple(y.shape)} (fakegpu)")
            if torch.equal(x, y):
                continue
            exact = False
            diff = (x.double() - y.double()).abs().max().item() if x.numel() else 0.0
            if diff > worst[0]:
                worst = (diff, what)
            if case.tolerance is None:
                raise CaseFailure(f"{what}: not bit-identical (max |diff| {diff:.3g}); "
                                  "this case's reductions have a single order, so they must be")
            rtol, atol = case.tolerance
            if not torch.allclose(x, y, rtol=rtol, atol=atol):
                raise CaseFailure(f"{what}: max |diff| {diff:.3g} beyond rtol={rtol:g} atol={atol:g}")
    if exact:
        return "bit-exact"
    return f"within rtol={case.tolerance[0]:g} atol={case.tolerance[1]:g} (max |diff| {worst[0]:.3g} at {worst[1]})"


def run_case(name: str, workdir: Optional[Path] = None, cluster_config: Optional[str] = None) -> str:
    """Run one case; returns a one-line verdict, raises CaseFailure."""
    case = CASES[name]
    if workdir is None:
        workdir = Path(tempfile.mkdtemp(prefix=f"fakegpu-verify-{name}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    fake, report = run_fakegpu(case, workdir, cluster_config)
    report_line = check_report(report)
    verdict = "checks passed"
    if case.compare_with_gloo:
        verdict = compare(case, run_gloo(case, workdir), fake)
    return f"{name}: {verdict}; {report_line} [{time.monotonic() - started:.1f} s]"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Compare verification workloads under gloo and fakegpu.")
    parser.add_argument("cases", nargs="*", help=f"cases to run: {', '.join(CASES)}")
    parser.add_argument("--all", action="store_true", help=f"run the suite: {', '.join(SUITE)}")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--workdir", help="keep outputs, logs and reports here (default: a temp folder)")
    parser.add_argument("--cluster-config", help="cluster YAML for the fakegpu coordinator")
    args = parser.parse_args(argv)
    if args.list:
        for name, case in CASES.items():
            print(f"{name:18} {case.nproc} ranks  {case.script} {' '.join(case.args)}"
                  f"{'' if name in SUITE else '  (not in --all)'}")
        return 0
    names = SUITE if args.all else args.cases
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        parser.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}" if unknown
                     else "name a case or pass --all")
    sys.path.insert(0, str(REPO))
    failures = 0
    for name in names:
        workdir = Path(args.workdir) / name if args.workdir else None
        try:
            print(run_case(name, workdir, args.cluster_config), flush=True)
        except CaseFailure as exc:
            failures += 1
            print(f"{name}: FAILED: {exc}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
