"""`fgpu plan --cluster-config YAML [--json] [--sweep] -- CMD`: how fast CMD trains on that cluster.

CMD is the launch a user would run on the cluster (``torchrun --nnodes 16 --nproc-per-node 8
-m torchtitan.train --module llama3 --config llama3_8b ...``, or ``torchrun ... train.py``).
Nothing runs at full size: a TorchTitan job is captured on fake tensors as logical rank 0
(fakegpu.plan.titan); any other script runs once in a fake world (``fgpu --dist-mode fake``,
NGPU = the launch's world size) with its ops and collectives recorded, as the small program it
is on this machine.  Both are timed on the YAML's GPUs and fabric (docs/planning.md).
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

GiB = 1024 ** 3

_TORCHRUN_FLAGS = {"--standalone", "--no-python", "--no_python", "--run-path", "--run_path", "--module"}


class PlanError(Exception):
    pass


def parse_launch(command: Sequence[str]) -> tuple[int, list[str]]:
    """(world size, the program's own command line: ``-m MODULE ARGS`` or ``SCRIPT ARGS``) of a
    torchrun / ``python -m torch.distributed.run`` launch; a plain ``python ...`` is NGPU ranks
    (default 1)."""
    cmd = list(command)
    if not cmd:
        raise PlanError("no command given: put the launch after `--`")
    launcher = os.path.basename(cmd[0])
    if launcher.startswith("python"):
        if cmd[1:3] in (["-m", "torch.distributed.run"], ["-m", "torchrun"]):
            rest = cmd[3:]
        else:
            return int(os.environ.get("NGPU", "1")), cmd[1:]
    elif launcher == "torchrun":
        rest = cmd[1:]
    else:
        raise PlanError(f"cannot plan {cmd[0]!r}: expected torchrun, python -m torch.distributed.run or python")
    nnodes, nproc, i = 1, 1, 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("-") or arg == "-m":
            break
        key, _, value = arg.partition("=")
        if key in _TORCHRUN_FLAGS:
            i += 1
            continue
        if not value:
            if i + 1 >= len(rest):
                raise PlanError(f"torchrun option {key} needs a value")
            value = rest[i + 1]
            i += 2
        else:
            i += 1
        if key in ("--nnodes",):
            nnodes = int(value.split(":")[-1])
        elif key in ("--nproc-per-node", "--nproc_per_node"):
            if not value.isdigit():
                raise PlanError(f"--nproc-per-node {value!r}: give the number of GPUs per node")
            nproc = int(value)
    program = rest[i:]
    if not program:
        raise PlanError("the torchrun command has no program")
    return nnodes * nproc, program


def _is_titan(program: list[str]) -> bool:
    return program[:2] == ["-m", "torchtitan.train"]


def _titan_config(args: list[str], gpu: str = "h100"):
    """TorchTitan's config from its command line, resolved as on the cluster's GPU: its model
    converters ask TorchTitan's ``has_cuda_capability`` (Float8 wants 8.9 or later) when the
    config is built, and this machine has no GPU to answer."""
    import contextlib
    from unittest import mock

    import torchtitan.components.quantization  # noqa: F401 - the converters that ask
    import torchtitan.tools.utils as titan_utils
    from torchtitan.config import ConfigManager

    from fakegpu.fake_cuda.devices import capability_of

    original = titan_utils.has_cuda_capability
    capability = capability_of(gpu)

    def has_cuda_capability(major: int, minor: int) -> bool:
        return capability >= (major, minor)

    with contextlib.ExitStack() as stack:
        for name, module in list(sys.modules.items()):
            if name.startswith("torchtitan") and getattr(module, "has_cuda_capability", None) is original:
                stack.enter_context(mock.patch.object(module, "has_cuda_capability", has_cuda_capability))
        return ConfigManager().parse_args(list(args))


def _format(plan) -> str:
    d = plan.to_dict() if hasattr(plan, "to_dict") else plan
    lines = [f"layout: {d['layout_text']} on {d['gpu']}",
             f"step time:            {d['step_seconds']:.3f} s",
             f"tokens/s per GPU:     {d['tokens_per_second_per_gpu']:,.0f}" if d.get("tokens_per_second_per_gpu")
             else "tokens/s per GPU:     (unknown: pass --tokens-per-step)",
             f"MFU:                  {d['mfu']:.1%}" if d.get("mfu") is not None else "MFU: -",
             (f"peak reserved memory: {d['peak_memory_reserved_gib']:.1f} GiB of {d['gpu_memory_gib']:.1f}"
              + ("" if d.get("fits", True) else "  (does NOT fit)")) if d.get("peak_memory_reserved_gib")
             else "peak reserved memory: (not measured)"]
    phases = d.get("phase_seconds") or {}
    if phases:
        lines.append("phases (compute stream): " + ", ".join(f"{k} {v:.3f} s" for k, v in phases.items()))
    comm = d.get("communication_seconds") or {}
    exposed = d.get("exposed_communication_by_group", d.get("exposed_communication_seconds")) or {}
    shared = d.get("link_contention_seconds") or {}
    for group in sorted(set(comm) | set(exposed)):
        line = f"communication {group:>10}: {comm.get(group, 0.0):.3f} s, exposed {exposed.get(group, 0.0):.3f} s"
        if shared.get(group):
            line += f", slowed {shared[group]:.3f} s by other groups on shared links"
        lines.append(line)
    if d.get("pipeline_bubble_seconds"):
        lines.append(f"pipeline bubble:      {d['pipeline_bubble_seconds']:.3f} s")
    return "\n".join(lines)


def _summary(plan_dict: dict) -> dict:
    out = dict(plan_dict)
    exposed = plan_dict.get("exposed_communication_seconds") or {}
    out["exposed_communication_by_group"] = exposed
    out["exposed_communication_seconds"] = float(sum(exposed.values()))
    return out


def _load_topology(path: Optional[str], world: int):
    from fakegpu.topology import load_cluster_config
    from fakegpu.topology.bundled import resolve_cluster_config
    from fakegpu.topology.model import default_topology

    if not path:
        print("fgpu plan: warning: no --cluster-config; planning on one node of H100 SXM GPUs",
              file=sys.stderr)
        return default_topology(world)
    return load_cluster_config(resolve_cluster_config(path))


def _write_outputs(output_dir: str, trace: Optional[str], result, timeline) -> None:
    """fakegpu-plan.json and the trace; a failure to write them is an error (PlanError)."""
    try:
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "fakegpu-plan.json"), "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
            fh.write("\n")
        if timeline is not None:
            path = trace or os.path.join(output_dir, "fakegpu-plan-trace.json")
            with open(path, "w", encoding="utf-8") as fh:
                json.dump({"traceEvents": timeline.trace_events(), "displayTimeUnit": "ms"}, fh)
    except OSError as exc:
        raise PlanError(f"cannot write the plan: {exc}") from None


def plan_script(program: list[str], world: int, cluster: Optional[str], tokens_per_step: Optional[int],
                topology, timeout: float) -> dict:
    """Run a user's script once in a fake world, recording its ops; time its last step."""
    from fakegpu.plan.generic import plan_records

    with tempfile.TemporaryDirectory(prefix="fgpu-plan-") as tmp:
        out = os.path.join(tmp, "records.pkl")
        env = dict(os.environ, NGPU=str(world), FAKEGPU_PLAN_RECORD=out)
        command = [sys.executable, "-m", "fakegpu", "run", "--dist-mode", "fake"]
        if cluster:
            command += ["--cluster-config", cluster]
        command += ["--", sys.executable, *program]
        try:
            # the program's output goes to stderr: stdout is the plan (one JSON object with --json)
            done = subprocess.run(command, env=env, timeout=timeout, stdout=sys.stderr)
        except subprocess.TimeoutExpired:
            raise PlanError(f"the program did not finish within {timeout:.0f} s (--timeout)") from None
        if done.returncode != 0:
            raise PlanError(f"the program failed (exit status {done.returncode}); its output is above")
        if not os.path.exists(out):
            raise PlanError("the program ran but recorded nothing: did it initialise torch.distributed?")
        with open(out, "rb") as fh:
            captured = pickle.load(fh)
    return plan_records(captured, topology, world, tokens_per_step)


SWEEP_TP = (1, 2, 4, 8)
SWEEP_PP = (1, 2, 4, 8)
SWEEP_AC = ("selective", "full")
SWEEP_CP = (1, 2, 4, 8)
# Context parallelism is swept from this sequence length on: below it a sequence's attention is
# too short a share of the step for splitting it to pay (TorchTitan publishes CP from 32k).
SWEEP_CP_FROM_SEQ = 32768


def sweep_layouts(config, world: int, gpus_per_node: int):
    """Layouts of the same model, cluster and global batch: tp x pp x cp (from
    SWEEP_CP_FROM_SEQ tokens; tp x cp within a node) x (FSDP | HSDP across nodes) x activation
    checkpointing."""
    import copy

    from torchtitan.distributed import ParallelDims

    from fakegpu.plan.block_masks import BLOCK

    dims = ParallelDims.from_config(config.parallelism, world)
    global_batch = int(config.training.local_batch_size) * dims.dp_replicate * dims.dp_shard
    n_layers = len(config.model_spec.model.layers)
    heads = int(getattr(config.model_spec.model.layers[0].attention, "n_heads", 1) or 1)
    seq = int(config.training.seq_len)
    cps = [cp for cp in SWEEP_CP if cp == 1 or (seq >= SWEEP_CP_FROM_SEQ and seq % (2 * cp * BLOCK) == 0)]
    for tp, pp, cp in ((tp, pp, cp) for tp in SWEEP_TP for pp in SWEEP_PP for cp in cps):
        if tp * cp > gpus_per_node or heads % tp or world % (tp * pp * cp) or pp > max(1, n_layers // 2):
            continue
        dp = world // (tp * pp * cp)
        if global_batch % dp:
            continue
        local = global_batch // dp
        if pp > 1 and local < pp:
            continue
        replicas = {1}
        shard_in_node = max(1, gpus_per_node // (tp * cp))
        if dp > shard_in_node and dp % shard_in_node == 0:
            replicas.add(dp // shard_in_node)
        for replicate in sorted(replicas):
            for ac in SWEEP_AC:
                c = copy.deepcopy(config)
                c.parallelism.tensor_parallel_degree = tp
                c.parallelism.pipeline_parallel_degree = pp
                c.parallelism.context_parallel_degree = cp
                c.parallelism.data_parallel_replicate_degree = replicate
                c.parallelism.data_parallel_shard_degree = dp // replicate
                c.training.local_batch_size = local
                _set_ac(c, ac)
                yield c


def _plan_dict(config, world, topology, extrapolate, float8, float8_tp_gathers=False) -> dict:
    from fakegpu.plan.planner import plan_titan

    return plan_titan(config, world, topology, extrapolate=extrapolate, float8=float8,
                      float8_tp_gathers=float8_tp_gathers).to_dict()


_PENDING: list = []      # the layout a forked child plans (configs hold closures: no pickling)


def _plan_pending(conn) -> None:
    try:
        conn.send(("ok", _plan_dict(*_PENDING[0])))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent, which goes on
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def _plan_isolated(config, world, topology, extrapolate, float8, timeout: float = 1800.0,
                   float8_tp_gathers: bool = False) -> dict:
    """One layout of a sweep in a child forked for it: each capture starts from a process with
    no process group, mesh or compiled state left by the layout before (torch and TorchTitan
    keep such state in module globals), and its memory goes back when it ends."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    _PENDING[:] = [(config, world, topology, extrapolate, float8, float8_tp_gathers)]
    parent, child = context.Pipe(duplex=False)
    process = context.Process(target=_plan_pending, args=(child,))
    process.start()
    child.close()
    try:
        if not parent.poll(timeout):
            raise PlanError(f"planning the layout took longer than {timeout:.0f} s")
        status, value = parent.recv()
    except EOFError:
        raise PlanError(f"the planning process died (exit status {process.exitcode})") from None
    finally:
        process.join(5)
        if process.is_alive():
            process.kill()
        _PENDING.clear()
    if status != "ok":
        raise PlanError(value)
    return value


def _set_ac(config, mode: str) -> None:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    config.activation_checkpoint = FullAC.Config() if mode == "full" else SelectiveAC.Config()


def main(argv: Optional[Sequence[str]] = None, prog: str = "fgpu plan") -> int:
    p = argparse.ArgumentParser(prog=prog, usage=f"{prog} --cluster-config YAML [--json] [--sweep] -- CMD ...",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster-config", help="the cluster YAML (a path or a bundled name); nodes are repeated "
                   "when the job has more ranks than it describes")
    p.add_argument("--json", action="store_true", help="print one JSON object (a list with --sweep)")
    p.add_argument("--sweep", action="store_true", help="rank layouts (tp, pp, FSDP/HSDP, AC) of the same model "
                   "and global batch by predicted tokens/s; those that do not fit memory are dropped")
    p.add_argument("--top", type=int, default=10, help="layouts to show with --sweep (default 10)")
    p.add_argument("--output-dir", default=".", help="where fakegpu-plan.json (the plan, with --sweep every "
                   "layout) and fakegpu-plan-trace.json (rank 0's predicted timeline, for ui.perfetto.dev) go "
                   "(default: the current directory)")
    p.add_argument("--trace", help="the Perfetto/Chrome trace's path instead of OUTPUT_DIR/fakegpu-plan-trace.json")
    p.add_argument("--float8", action="store_true", help="cost the linears as TorchTitan's Float8 converter "
                   "runs them (tensorwise scaling; the converter itself needs torchao at config time)")
    p.add_argument("--no-extrapolate", action="store_true", help="capture every layer instead of two depths")
    p.add_argument("--tokens-per-step", type=int, help="tokens one rank trains on per step (a script's; "
                   "TorchTitan's is known)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a script may run (default 1800)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    command = list(a.command)
    if command and command[0] == "--":
        command = command[1:]
    try:
        world, program = parse_launch(command)
        topology = _load_topology(a.cluster_config, world)
        if not _is_titan(program):
            if a.sweep:
                raise PlanError("--sweep enumerates TorchTitan layouts; a script's layout is its own code")
            result, timeline = plan_script(program, world, a.cluster_config, a.tokens_per_step, topology,
                                           a.timeout)
            result = _summary(result)
            _write_outputs(a.output_dir, a.trace, result, timeline)
            print(json.dumps(result, indent=2) if a.json else _format(result))
            return 0
        from fakegpu.plan.planner import plan_titan, scaled_topology

        config = _titan_config(program[2:], topology.gpu_of(0).name)
        if not a.sweep:
            plan = plan_titan(config, world, topology, extrapolate=not a.no_extrapolate,
                              float8=True if a.float8 else None)
            result = _summary(plan.to_dict())
            _write_outputs(a.output_dir, a.trace, result, plan.timeline)
            print(json.dumps(result, indent=2) if a.json else _format(plan))
            return 0
        topology = scaled_topology(topology, world)
        per_node = len(topology.nodes[0].ranks)
        results = []
        candidates = list(sweep_layouts(config, world, per_node))
        for index, candidate in enumerate(candidates, 1):
            try:
                plan = _plan_isolated(candidate, world, topology, not a.no_extrapolate,
                                      True if a.float8 else None)
            except Exception as exc:   # noqa: BLE001 - a layout TorchTitan refuses is reported, not fatal
                print(f"[{index}/{len(candidates)}] skipped: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            print(f"[{index}/{len(candidates)}] {plan['layout_text']}: {plan['tokens_per_second_per_gpu']:,.0f} "
                  f"tokens/s/GPU, {plan['peak_memory_reserved_gib']:.1f} GiB"
                  + ("" if plan["fits"] else " (does not fit)"), file=sys.stderr, flush=True)
            results.append(_summary(plan))
        fitting = sorted((r for r in results if r["fits"]), key=lambda r: -r["tokens_per_second_per_gpu"])
        _write_outputs(a.output_dir, None, {"ranked": fitting,
                                            "dropped_for_memory": [r for r in results if not r["fits"]]}, None)
        if a.json:
            print(json.dumps({"ranked": fitting, "dropped_for_memory": [r for r in results if not r["fits"]]},
                             indent=2))
            return 0 if fitting else 1
        if not fitting:
            print("no layout fits memory", file=sys.stderr)
            return 1
        print(f"{'#':>3} {'tokens/s/GPU':>12} {'MFU':>6} {'step s':>8} {'GiB':>6}  layout")
        for rank, r in enumerate(fitting[:a.top], 1):
            print(f"{rank:>3} {r['tokens_per_second_per_gpu']:>12,.0f} {r['mfu']:>6.1%} {r['step_seconds']:>8.3f} "
                  f"{r['peak_memory_reserved_gib']:>6.1f}  {r['layout_text']}")
        dropped = len(results) - len(fitting)
        if dropped:
            print(f"({dropped} layout(s) dropped: they do not fit in {results[0]['gpu_memory_gib']:.1f} GiB)")
        return 0
    except PlanError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, KeyError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
