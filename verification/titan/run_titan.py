"""TorchTitan 0.3.0's llama3 debug model under fake CUDA devices vs its CPU + gloo port.

For each configuration (FSDP 4, FSDP 2 x TP 2, PP 2 x FSDP 2, all on 4 ranks) this runs

  fake:  fgpu --device-count 4 -- torchrun --standalone --nproc-per-node 4 -m torchtitan.train OPTS
  port:  torchrun --standalone --nproc-per-node 4 verification/titan/cpu_port.py OPTS

with the same OPTS (TorchTitan's own options only), reads the losses and gradient norms each
run logged to TensorBoard, and prints a table.  Losses must be equal bit for bit where every
reduction group has two ranks and within rtol 1e-5 otherwise; exit status 1 if not.

    PYTHONPATH=$PWD FAKEGPU_NCCL_LIBRARY=build/libnccl.so.2 \\
        nice -n 10 python verification/titan/run_titan.py [--steps 4] [--only fsdp]

Why these options (see docs/fake-cuda.md, "TorchTitan"): TorchTitan's defaults otherwise,
CUDA graphs and the spmd_types backend included, but

  --hf-assets-path / --dataloader.dataset-path the wheel ships neither (assets.py makes them)
  --parallelism.spmd-backend partial_dtensor   only on torch < 2.14, whose FSDP2 cannot take
                                               spmd_types parameters (CPU + gloo fails the same)
  --ac none                                    adds activation-checkpoint:none; the default keeps
                                               the debug config's own selective AC
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from assets import write_assets  # noqa: E402


@dataclass
class Config:
    name: str
    options: list
    two_rank_groups: bool  # every reduction group has two ranks: bit-for-bit expected


CONFIGS = [
    Config("fsdp4", ["--parallelism.data-parallel-shard-degree", "4"], two_rank_groups=False),
    Config("fsdp2_tp2", ["--parallelism.data-parallel-shard-degree", "2",
                         "--parallelism.tensor-parallel-degree", "2"], two_rank_groups=True),
    # TorchTitan refuses CUDA graphs with pipeline parallelism on any device ("CUDA graphs do
    # not support pipeline parallelism yet. Set --training.disable_cuda_graphs").
    Config("pp2_fsdp2", ["--parallelism.data-parallel-shard-degree", "2",
                         "--parallelism.pipeline-parallel-degree", "2",
                         "--training.disable-cuda-graphs"], two_rank_groups=True),
    Config("hsdp2x2", ["--parallelism.data-parallel-replicate-degree", "2",
                       "--parallelism.data-parallel-shard-degree", "2"], two_rank_groups=True),
    # Context parallelism with flex attention needs the sequence to be a multiple of
    # cp degree x 128 (TorchTitan: "Q_LEN 64 is not divisible by CP mesh world size 2 *
    # BLOCK_SIZE 128"); the later --training.seq-len wins.
    Config("cp2_fsdp2", ["--parallelism.data-parallel-shard-degree", "2",
                         "--parallelism.context-parallel-degree", "2", "--training.seq-len", "256"],
           two_rank_groups=True),
]


def torch_needs_partial_dtensor() -> bool:
    """TorchTitan 0.3.0's default spmd_types backend needs torch 2.14's FSDP2."""
    import torch

    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) < (2, 14)
RANKS = 4


def titan_options(assets: Path, steps: int, dump: Path) -> list:
    return [
        "--module", "llama3", "--config", "llama3_debugmodel",
        "--hf-assets-path", str(assets / "tokenizer"),
        "--dataloader.dataset-path", str(assets / "c4_test"),
        "--training.steps", str(steps), "--training.seq-len", "64",
        "--training.local-batch-size", "2",
        "--validator.no-enable", "--checkpoint.no-enable", "--debug.seed", "0",
        "--metrics.enable-tensorboard", "--metrics.disable-color-printing",
        "--dump-folder", str(dump),
    ] + (["--parallelism.spmd-backend", "partial_dtensor"] if torch_needs_partial_dtensor() else [])


@dataclass
class Run:
    losses: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)
    step_times: list = field(default_factory=list)
    wall_s: float = 0.0


def read_tensorboard(dump: Path) -> Run:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(dump.rglob("events.out.tfevents.*"))
    if not files:
        raise RuntimeError(f"no TensorBoard events under {dump}")
    run = Run()
    for path in files:
        events = EventAccumulator(str(path.parent))
        events.Reload()
        tags = events.Tags()["scalars"]
        if "loss_metrics/global_avg_loss" not in tags:
            continue
        run.losses = [e.value for e in events.Scalars("loss_metrics/global_avg_loss")]
        run.grad_norms = [e.value for e in events.Scalars("grad_norm")]
        run.step_times = [e.value for e in events.Scalars("time_metrics/end_to_end(s)")]
        return run
    raise RuntimeError(f"no loss scalars in {files}")


def run_side(side: str, config: Config, assets: Path, steps: int, work: Path, env: dict,
             timeout_s: float, ac: str) -> Run:
    dump = work / config.name / side
    options = titan_options(assets, steps, dump) + config.options
    if ac == "none":
        options.append("activation-checkpoint:none")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(RANKS)]
    if side == "fake":
        command = [sys.executable, "-m", "fakegpu", "run", "-q", "--device-count", str(RANKS),
                   "--", *torchrun, "-m", "torchtitan.train", *options]
        side_env = dict(env)
    else:
        command = [*torchrun, str(HERE / "cpu_port.py"), *options]
        side_env = {k: v for k, v in env.items() if not k.startswith("FAKEGPU_")}
        side_env["PYTHONPATH"] = env["PYTHONPATH"]
    log = work / f"{config.name}_{side}.log"
    started = time.monotonic()
    with open(log, "w") as out:
        done = subprocess.run(command, cwd=work, env=side_env, stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=timeout_s)
    if done.returncode != 0:
        tail = log.read_text()[-4000:]
        raise RuntimeError(f"{config.name} ({side}) exited with {done.returncode}; log {log}:\n{tail}")
    result = read_tensorboard(dump)
    result.wall_s = time.monotonic() - started
    return result


def equal(a: list, b: list, bitwise: bool) -> bool:
    if len(a) != len(b) or not a:
        return False
    if bitwise:
        return all(x == y for x, y in zip(a, b))
    return all(math.isclose(x, y, rel_tol=1e-5, abs_tol=0.0) for x, y in zip(a, b))


def median_step_s(run: Run) -> float:
    later = run.step_times[1:] or run.step_times  # step 1 includes warm-up
    return statistics.median(later)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--only", action="append", choices=[c.name for c in CONFIGS],
                        help="run only this configuration (repeatable)")
    parser.add_argument("--workdir", type=Path, help="keep logs and outputs here")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--ac", choices=["none", "selective"], default="selective",
                        help="activation checkpointing (selective: the debug config's own)")
    args = parser.parse_args(argv)

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("FAKEGPU_COORDINATOR_TIMEOUT_MS", "120000")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fakegpu-titan-"))
    work.mkdir(parents=True, exist_ok=True)
    assets = work / "assets"
    write_assets(str(assets))

    rows, ok, failed = [], True, []
    for config in CONFIGS:
        if args.only and config.name not in args.only:
            continue
        try:
            fake = run_side("fake", config, assets, args.steps, work, env, args.timeout, args.ac)
            port = run_side("port", config, assets, args.steps, work, env, args.timeout, args.ac)
        except RuntimeError as exc:   # one configuration's failure does not hide the others'
            print(exc, file=sys.stderr)
            failed.append(config.name)
            ok = False
            continue
        same = (equal(fake.losses, port.losses, config.two_rank_groups)
                and equal(fake.grad_norms, port.grad_norms, config.two_rank_groups))
        ok &= same
        rows.append((config, fake, port, same))

    print(f"\nTorchTitan llama3_debugmodel, seq 64, local batch 2, {RANKS} ranks, "
          f"activation checkpointing {args.ac} (logs: {work})")
    print("| config | ranks | steps | losses fake CUDA | losses CPU port | equal? | step fake | step port | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for config, fake, port, same in rows:
        # Say what was measured, not only what was required: an rtol-1e-5 configuration whose
        # losses and gradient norms are identical is reported bit for bit.
        identical = fake.losses == port.losses and fake.grad_norms == port.grad_norms
        kind = "bit for bit" if config.two_rank_groups or (same and identical) else "rtol 1e-5"
        verdict = f"yes ({kind})" if same else f"NO ({kind})"
        fs, ps = median_step_s(fake), median_step_s(port)
        print(f"| {config.name} | {RANKS} | {len(fake.losses)} | "
              f"{', '.join(f'{x:.9g}' for x in fake.losses)} | "
              f"{', '.join(f'{x:.9g}' for x in port.losses)} | {verdict} | "
              f"{fs * 1000:.0f} ms | {ps * 1000:.0f} ms | {fs / ps:.2f} |")
    for name in failed:
        print(f"| {name} | {RANKS} | - | failed (log above) | | NO | | | |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
