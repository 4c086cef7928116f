"""Public PyTorch example scripts, unmodified, on fake CUDA devices vs their CPU + gloo ports.

    python verification/public_examples/run_examples.py [--source DIR] [--only NAME ...]

The scripts are pytorch/examples' own (https://github.com/pytorch/examples), each file pinned
to the commit listed in ``PROGRAMS`` below; they are not part of this repository.  ``--source``
(or ``FAKEGPU_EXAMPLES_DIR``) names a directory laid out as the repository is
(``DIR/distributed/ddp/example.py``, ...); files missing there are downloaded from
``raw.githubusercontent.com`` at their pinned commit into that directory.

Each program runs twice, in fresh working directories:

- **fake**: the files exactly as published, ``python -m fakegpu run --device-count 4 --
  torchrun --standalone --nproc-per-node 4 SCRIPT ARGS`` (fake CUDA devices, "nccl" is the
  fakegpu backend);
- **port**: the same files ported by hand to CPU + gloo — the port is the list of textual
  edits in ``PROGRAMS`` (``"cuda"`` -> ``"cpu"``, ``"nccl"`` -> ``"gloo"``, ``device_ids``
  dropped, GPU-count checks answered yes), applied by this driver, each edit required to
  match exactly once — under plain ``torchrun`` without fakegpu.

Neither run's script is otherwise touched: ``observer/sitecustomize.py`` records the losses
(scalars ``backward()`` is called on), the time of each ``optimizer.step()`` and the final
local parameters through torch's public hooks.  The driver compares them: bit for bit where
every reduction group has two ranks, else within rtol 1e-5, and prints a table.  Exit status
1 when a program fails or differs.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
RAW = "https://raw.githubusercontent.com/pytorch/examples/{commit}/{path}"
NPROC = 4


@dataclasses.dataclass
class Program:
    name: str
    parallelism: str
    directory: str                 # in pytorch/examples
    files: dict                    # file name in directory -> pinned commit
    script: str                    # relative to directory
    args: list
    port: dict                     # file -> [(old, new), ...] (the hand port to CPU + gloo)
    two_rank_groups: bool          # every reduction group has 2 ranks: compare bit for bit
    prepare: object = None         # callable(workdir) for data files


def _tiny_text(workdir: Path) -> None:
    # minGPT reads a character corpus; a small deterministic one keeps the epoch short.
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "cat",
             "sees", "a", "bird", "in", "tree", "while", "sun", "sets", "slowly", "far"]
    out, state = [], 12345
    for _ in range(4000):
        state = (state * 1103515245 + 12345) % (1 << 31)
        out.append(words[state % len(words)])
    (workdir / "input.txt").write_text(" ".join(out) + "\n")


PROGRAMS = [
    Program(
        name="ddp-tutorial multigpu_torchrun.py", parallelism="DDP (nccl, device_ids)",
        directory="distributed/ddp-tutorial-series",
        files={"multigpu_torchrun.py": "22e5a0360f6d550600c0ee8d7b496d9f17e00b05",
               "datautils.py": "a7e31a5df144e014866521dc97c0c1fb259b24ec"},
        script="multigpu_torchrun.py", args=["2", "1"],
        port={"multigpu_torchrun.py": [
            ('init_process_group(backend="nccl")', 'init_process_group(backend="gloo")'),
            ("self.model = model.to(self.gpu_id)", "self.model = model"),
            ("DDP(self.model, device_ids=[self.gpu_id])", "DDP(self.model)"),
            ("source = source.to(self.gpu_id)", "source = source"),
            ("targets = targets.to(self.gpu_id)", "targets = targets")]},
        two_rank_groups=False),
    Program(
        name="ddp-tutorial multinode.py", parallelism="DDP (torch.accelerator)",
        directory="distributed/ddp-tutorial-series",
        files={"multinode.py": "17f4f9a5d66c6da5b348d032cd6a6e2410760952",
               "datautils.py": "a7e31a5df144e014866521dc97c0c1fb259b24ec"},
        script="multinode.py", args=["2", "1", "--batch_size", "32"],
        port={"multinode.py": [
            ("self.model = model.to(self.local_rank)", "self.model = model"),
            ("DDP(self.model, device_ids=[self.local_rank])", "DDP(self.model)"),
            ("source = source.to(self.local_rank)", "source = source"),
            ("targets = targets.to(self.local_rank)", "targets = targets")]},
        two_rank_groups=False),
    Program(
        name="ddp/example.py", parallelism="DDP (cuda(k), nccl)",
        directory="distributed/ddp",
        files={"example.py": "08f4d851e2dc01cd4a71f9537590bf47d55e3821"},
        script="example.py", args=["--local_world_size", str(NPROC)],
        port={"example.py": [
            ("n = torch.cuda.device_count() // local_world_size", "n = 1"),
            ("model = ToyModel().cuda(device_ids[0])", "model = ToyModel()"),
            ("ddp_model = DDP(model, device_ids)", "ddp_model = DDP(model)"),
            ("labels = torch.randn(20, 5).to(device_ids[0])", "labels = torch.randn(20, 5)"),
            ('dist.init_process_group(backend="nccl")', 'dist.init_process_group(backend="gloo")')]},
        two_rank_groups=False),
    Program(
        name="FSDP2/example.py", parallelism="FSDP2 fully_shard, DCP-style save",
        directory="distributed/FSDP2",
        files={"example.py": "5e960d874d24e416f25b3a6553eeaab9b451ff9f",
               "model.py": "098ac2c12237c03acb900e9daf5d57347c5273b0",
               "checkpoint.py": "7d43f13e5e8a3735de87d817bdcc0bc6ea5036ba",
               "utils.py": "fbdea94a375628a7576e2a607abcef22d7cea7f1"},
        script="example.py", args=[],
        port={"example.py": [
            ("    return has_gpu and gpu_count >= min_gpus", "    return True"),
            ("init_process_group(backend=backend, device_id=device)", "init_process_group(backend=backend)")]},
        two_rank_groups=False),
    Program(
        name="tensor_parallel_example.py", parallelism="TP (cuda mesh)",
        directory="distributed/tensor_parallelism",
        files={"tensor_parallel_example.py": "242c3280910f095a8275c8a6ccb85fc7b2467bb0"},
        script="tensor_parallel_example.py", args=[],
        port={"tensor_parallel_example.py": [
            ('init_device_mesh(device_type = "cuda"', 'init_device_mesh(device_type = "cpu"'),
            ('ToyModel().to("cuda")', 'ToyModel().to("cpu")'),
            ('device="cuda"', 'device="cpu"')]},
        two_rank_groups=False),
    Program(
        name="sequence_parallel_example.py", parallelism="SP (cuda mesh)",
        directory="distributed/tensor_parallelism",
        files={"sequence_parallel_example.py": "242c3280910f095a8275c8a6ccb85fc7b2467bb0"},
        script="sequence_parallel_example.py", args=[],
        port={"sequence_parallel_example.py": [
            ('init_device_mesh(device_type = "cuda"', 'init_device_mesh(device_type = "cpu"'),
            ('ToyModel().to("cuda")', 'ToyModel().to("cpu")'),
            ('device="cuda"', 'device="cpu"')]},
        two_rank_groups=False),
    Program(
        name="fsdp_tp_example.py", parallelism="FSDP1 x TP/SP, 2x2 mesh",
        directory="distributed/tensor_parallelism",
        files={"fsdp_tp_example.py": "0960b2e204dfc7c413d79f98459826928408e029",
               "llama2_model.py": "ecd951d95258f81a7ea9f516acac44521df9d9e2",
               "log_utils.py": "c4dc481e686b5cc7d1aad9e3977b91d8ba83bddd"},
        script="fsdp_tp_example.py", args=[],
        port={"log_utils.py": [("    return has_cuda and gpu_count >= min_gpus", "    return True")],
              "fsdp_tp_example.py": [
            ('init_device_mesh("cuda"', 'init_device_mesh("cpu"'),
            ('.to("cuda")', '.to("cpu")'),
            ('device="cuda"', 'device="cpu"'),
            ("FSDP(model, device_mesh=dp_mesh, use_orig_params=True)",
             'FSDP(model, device_mesh=dp_mesh, use_orig_params=True, device_id=torch.device("cpu"))')]},
        two_rank_groups=True),
    Program(
        name="minGPT-ddp main.py", parallelism="DDP + AMP fp16 + GradScaler (hydra)",
        directory="distributed/minGPT-ddp/mingpt",
        files={"main.py": "3635e8ec63290e51c75238fa965e4ef0aa700077",
               "trainer.py": "1b36393d6eb1e909efb321eaea7facf473c7e1c4",
               "model.py": "c8dd8c067e7384b5a776629170fa962682bf641e",
               "char_dataset.py": "d91085d2181bf6342ac7dafbeee6fc0a1f64dcec",
               "gpt2_train_cfg.yaml": "4fe95ae6abdeeef24f807167b258df5b75a9677a"},
        script="main.py",
        args=["data_config.path=input.txt", "data_config.block_size=32", "data_config.truncate=0.25",
              "gpt_config.n_layer=2", "gpt_config.n_head=4", "gpt_config.n_embd=64",
              "trainer_config.max_epochs=1", "trainer_config.batch_size=16",
              "trainer_config.data_loader_workers=0", "trainer_config.save_every=1"],
        port={"main.py": [
            ("    return has_gpu and gpu_count >= min_gpus", "    return True"),
            ('device: torch.device = torch.device(f"{acc}:{rank}")', 'device: torch.device = torch.device("cpu")'),
            ("    torch.accelerator.set_device_index(rank)\n", "")],
              "trainer.py": [
            ("self.model = model.to(self.local_rank)", "self.model = model"),
            ("torch.cuda.amp.GradScaler()", 'torch.amp.GradScaler("cpu")'),
            ('autocast(device_type="cuda"', 'autocast(device_type="cpu"'),
            ("DDP(self.model, device_ids=[self.local_rank])", "DDP(self.model)"),
            ("source = source.to(self.local_rank)", "source = source"),
            ("targets = targets.to(self.local_rank)", "targets = targets")]},
        two_rank_groups=False, prepare=_tiny_text),
]


def set_nproc(count: int) -> None:
    global NPROC
    NPROC = count
    for program in PROGRAMS:   # ddp/example.py is told the local world size
        program.args = [str(count) if program.args[i - 1:i] == ["--local_world_size"] else arg
                        for i, arg in enumerate(program.args)]


def fetch(source: Path, program: Program) -> None:
    for name, commit in program.files.items():
        target = source / program.directory / name
        if target.exists():
            continue
        url = RAW.format(commit=commit, path=f"{program.directory}/{name}")
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                target.write_bytes(response.read())
        except OSError as exc:
            raise SystemExit(f"{target} is missing and {url} could not be fetched ({exc}); "
                             "fetch pytorch/examples at that commit and pass --source") from None


def stage(source: Path, program: Program, workdir: Path, ported: bool) -> Path:
    """Copy the program's files into workdir/code (applying the port if asked)."""
    code = workdir / "code"
    code.mkdir(parents=True)
    for name in program.files:
        text = (source / program.directory / name).read_text()
        if ported:
            for old, new in program.port.get(name, []):
                count = text.count(old)
                if count != 1:
                    raise SystemExit(f"port of {program.name}: {old!r} occurs {count} times in {name} "
                                     "(the upstream file changed?)")
                text = text.replace(old, new)
        (code / name).write_text(text)
    if program.prepare is not None:
        program.prepare(workdir)
    return code


def run_one(source: Path, program: Program, kind: str, root: Path, timeout: float) -> dict:
    import torch

    workdir = root / kind
    code = stage(source, program, workdir, ported=(kind == "port"))
    out = workdir / "observed"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_")}
    for keep in ("FAKEGPU_NCCL_LIBRARY",):
        if os.environ.get(keep):
            env[keep] = os.environ[keep]
    env["FAKEGPU_OBSERVE_OUT"] = str(out)
    env["OMP_NUM_THREADS"] = "1"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(NPROC), str(code / program.script), *program.args]
    if kind == "fake":
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE / "observer")])
        command = [sys.executable, "-m", "fakegpu", "run", "-q", "--device-count", str(NPROC),
                   "--report", str(workdir / "report.json"), "--", *torchrun]
    else:
        env["PYTHONPATH"] = str(HERE / "observer")
        # The port is plain torch: a fakegpu installed into the environment (its
        # torch.backends entry point) must not load into it.
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
        command = torchrun
    started = time.monotonic()
    done = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - started
    (workdir / "output.txt").write_text(done.stdout + done.stderr)
    ranks = []
    for rank in range(NPROC):
        path = out / f"rank{rank}.pt"
        ranks.append(torch.load(path, weights_only=False) if path.exists() else None)
    return {"rc": done.returncode, "ranks": ranks, "wall": wall, "log": workdir / "output.txt",
            "tail": (done.stdout + done.stderr)[-3000:]}


def step_time(ranks: list) -> float:
    ends = ranks[0]["step_ends"]
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return statistics.median(gaps) if gaps else float("nan")


def compare(fake: list, port: list, exact: bool) -> tuple[bool, str]:
    import torch

    for rank, (f, p) in enumerate(zip(fake, port)):
        if f is None or p is None:
            return False, f"rank {rank} recorded nothing"
        if not f["params"] or not f["losses"]:
            return False, f"rank {rank}: no losses or parameters recorded"
        if len(f["losses"]) != len(p["losses"]) or len(f["params"]) != len(p["params"]):
            return False, f"rank {rank}: {len(f['losses'])} vs {len(p['losses'])} losses"
        fl, pl = torch.tensor(f["losses"], dtype=torch.float64), torch.tensor(p["losses"], dtype=torch.float64)
        pairs = [(fl, pl)] + list(zip(f["params"], p["params"]))
        for a, b in pairs:
            if a.shape != b.shape or a.dtype != b.dtype:
                return False, f"rank {rank}: shape/dtype {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
            if exact:
                if not _same(a, b):
                    return False, f"rank {rank}: not bit for bit (max diff {_max_diff(a, b):.3g})"
            elif not torch.allclose(a, b, rtol=1e-5, atol=0, equal_nan=True):
                return False, f"rank {rank}: beyond rtol 1e-5 (max diff {_max_diff(a, b):.3g})"
    identical = all(_same(a, b) for f, p in zip(fake, port) for a, b in zip(f["params"], p["params"])) \
        and all(_same(torch.tensor(f["losses"]), torch.tensor(p["losses"])) for f, p in zip(fake, port))
    verdict = "bit for bit" if identical else "rtol 1e-5"
    if any(math.isnan(x) for f in fake for x in f["losses"]):
        verdict += " (NaN losses in both runs)"
    return True, verdict


def _same(a, b) -> bool:
    """Bit for bit, NaN where the other has NaN (a script that computes NaN computes it twice)."""
    import torch

    if a.is_floating_point():
        nan = torch.isnan(a)
        return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])
    return torch.equal(a, b)


def _max_diff(a, b) -> float:
    return float((a.double() - b.double()).nan_to_num(nan=0.0).abs().max())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=Path(os.environ.get(
        "FAKEGPU_EXAMPLES_DIR", Path.home() / ".cache" / "fakegpu" / "pytorch-examples")))
    parser.add_argument("--only", nargs="*", help="names (substrings) of the programs to run")
    parser.add_argument("--keep", type=Path, help="keep the working directories here")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--nproc", type=int, default=NPROC,
                        help="ranks (and fake devices) per run; the target configuration is 4")
    args = parser.parse_args(argv)
    set_nproc(args.nproc)
    chosen = [p for p in PROGRAMS if not args.only or any(s in p.name for s in args.only)]
    root = Path(args.keep or tempfile.mkdtemp(prefix="fakegpu-examples-"))
    rows, failed = [], False
    for index, program in enumerate(chosen):
        fetch(args.source, program)
        base = root / f"{index}"
        if base.exists():
            shutil.rmtree(base)
        fake = run_one(args.source, program, "fake", base, args.timeout)
        port = run_one(args.source, program, "port", base, args.timeout)
        if fake["rc"] != 0 or port["rc"] != 0:
            bad = fake if fake["rc"] != 0 else port
            verdict, ok = f"FAILED ({'fake' if bad is fake else 'port'} rc {bad['rc']}, see {bad['log']})", False
            print(bad["tail"], file=sys.stderr)
        else:
            ok, verdict = compare(fake["ranks"], port["ranks"], exact=program.two_rank_groups)
            if ok and program.two_rank_groups and verdict != "bit for bit":
                ok = False
            verdict = ("yes, " if ok else "NO, ") + verdict
        failed |= not ok
        steps = len(fake["ranks"][0]["step_ends"]) if fake["ranks"][0] else 0
        ratio = (step_time(fake["ranks"]) / step_time(port["ranks"])
                 if fake["ranks"][0] and port["ranks"][0] else float("nan"))
        rows.append((program.name, program.parallelism, str(NPROC), "yes", str(steps), verdict,
                     f"{ratio:.2f}x"))
        print(f"{program.name}: {verdict}", file=sys.stderr, flush=True)
    header = ("program", "parallelism", "ranks", "unmodified?", "steps", "losses/params equal?",
              "step time vs CPU port")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
