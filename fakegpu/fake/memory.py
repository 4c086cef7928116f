"""Memory capture at fixed points of a training step, per logical rank, and comparison.

``capture(point)`` records the allocator state of the rank this process plays:
- on a GPU: ``torch.cuda.memory_stats()`` (current/peak allocated and reserved, retries,
  OOMs), ``max_memory_allocated/reserved`` and a summary of ``torch.cuda.memory_snapshot()``
  (segments, blocks, the largest live blocks);
- on CPU: tracemalloc current/peak (tracing starts at the first capture, or earlier with
  ``start()``), the process RSS (psutil) and the bytes held by live torch tensors.

The four capture points of the memory workflow are ``CAPTURE_POINTS``; any other name is
accepted too.  ``auto_capture(optimizer, model)`` captures at all four through hooks.  Captures go to ``FAKEGPU_MEMORY_CAPTURE_PATH`` (JSON, rewritten after each
capture; ``.rankR`` appended when several physical processes run) and into the fake-world
report's metadata.  Compare two runs at the same logical rank and capture point with
``python -m fakegpu.fake.memory compare A.json B.json --rank R --point P`` (A and B may be
capture files or cluster reports).  Comparing different PP coordinates is refused: their
ownership differs on purpose.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import tracemalloc
import warnings
from typing import Optional

CAPTURE_POINTS = ("after_init", "after_optimizer_warmup", "steady_state_fwd_bwd", "after_optimizer_step")
_captures: list[dict] = []
_CUDA_KEYS = ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
              "reserved_bytes.all.peak", "active_bytes.all.current", "active_bytes.all.peak",
              "inactive_split_bytes.all.current", "num_alloc_retries", "num_ooms",
              "allocation.all.current", "segment.all.current")


def start() -> None:
    """Start tracemalloc now, so CPU captures see allocations from here on."""
    if not tracemalloc.is_tracing():
        tracemalloc.start()


def _identity() -> dict:
    from . import runtime

    world = runtime.current()
    if world is not None:
        lc = world.contract
        return {"logical_rank": lc.logical_rank, "pp_rank": lc.pp_rank, "mode": lc.mode,
                "logical_world_size": lc.world_size, "physical_rank": lc.physical_rank}
    return {"logical_rank": int(os.environ.get("RANK", "0")), "pp_rank": None, "mode": None,
            "logical_world_size": None, "physical_rank": int(os.environ.get("RANK", "0"))}


def _snapshot_summary(torch) -> dict:
    segments = torch.cuda.memory_snapshot()
    blocks = [b for s in segments for b in s.get("blocks", [])]
    live = sorted((b for b in blocks if b.get("state") == "active_allocated"),
                  key=lambda b: b.get("size", 0), reverse=True)
    return {
        "segments": len(segments),
        "segment_bytes": sum(s.get("total_size", 0) for s in segments),
        "blocks": len(blocks),
        "active_blocks": len(live),
        "largest_active_blocks": [int(b.get("size", 0)) for b in live[:10]],
    }


def _tensor_bytes(torch) -> int:
    seen, total = set(), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # isinstance() on deprecated module attributes warns
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                    storage = obj.untyped_storage()
                    key = storage.data_ptr()
                    if key not in seen:
                        seen.add(key)
                        total += storage.nbytes()
            except Exception:
                continue
    return total


def measure() -> dict:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is optional for the capture file format
        torch = None
    if torch is not None and torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        return {
            "device": f"cuda:{torch.cuda.current_device()}",
            "stats": {k: int(stats.get(k, 0)) for k in _CUDA_KEYS},
            "max_memory_allocated": int(torch.cuda.max_memory_allocated()),
            "max_memory_reserved": int(torch.cuda.max_memory_reserved()),
            "snapshot": _snapshot_summary(torch),
        }
    start()
    current, peak = tracemalloc.get_traced_memory()
    out = {"device": "cpu", "stats": {"tracemalloc.current": int(current), "tracemalloc.peak": int(peak)}}
    try:
        import psutil
        out["stats"]["rss_bytes"] = int(psutil.Process().memory_info().rss)
    except Exception:
        pass
    if torch is not None:
        out["stats"]["torch_cpu_tensor_bytes"] = _tensor_bytes(torch)
    return out


def capture(point: str, *, extra: Optional[dict] = None) -> dict:
    """Record memory at ``point`` for the rank this process plays; returns the record."""
    from . import runtime

    record = {"point": str(point), "time": time.time(), **_identity(), **measure()}
    if extra:
        record["extra"] = dict(extra)
    _captures.append(record)
    world = runtime.current()
    if world is not None:
        world.memory_capture(record)
    path = os.environ.get("FAKEGPU_MEMORY_CAPTURE_PATH")
    if path:
        if world is not None and world.contract.physical_world_size > 1:
            path = f"{path}.rank{world.contract.physical_rank}"
        from fakegpu.report.writer import atomic_write_text
        atomic_write_text(path, json.dumps({"version": 1, "captures": _captures}, indent=2) + "\n")
    return record


def captures() -> list[dict]:
    return list(_captures)


def auto_capture(optimizer, model=None) -> list:
    """Capture at the four points without editing the training loop: ``after_init`` now,
    ``after_optimizer_warmup`` after the first optimizer step, ``after_optimizer_step`` after
    each later one, and (with ``model``) ``steady_state_fwd_bwd`` when backward reaches the
    model's output after the first step, i.e. with the step's activations still alive.
    Returns the hook handles (``.remove()`` them to stop)."""
    capture("after_init")
    steps = [0]

    def after_step(opt, args, kwargs):
        steps[0] += 1
        capture("after_optimizer_warmup" if steps[0] == 1 else "after_optimizer_step")

    handles = [optimizer.register_step_post_hook(after_step)]
    if model is not None:
        def on_backward_start(grad):
            capture("steady_state_fwd_bwd")
            return None   # leave the gradient as it is

        def after_forward(module, args, output):
            out = output[0] if isinstance(output, (tuple, list)) and output else output
            if steps[0] >= 1 and getattr(out, "requires_grad", False):
                out.register_hook(on_backward_start)

        handles.append(model.register_forward_hook(after_forward))
    return handles


_global_hooks: list = []


def install_global_hooks() -> list:
    """The four captures for a program that calls nothing: torch's global module and
    optimizer hooks (``fgpu --capture-memory`` in the fake-world modes installs them).

    - ``after_init``: just before the first top-level module forward (nothing has run yet);
    - ``after_optimizer_warmup``: after the optimizer steps of the first round (with several
      optimizers, e.g. one per pipeline stage, the capture after the last of them is kept);
    - ``after_optimizer_step``: after each later round (the latest is kept);
    - ``steady_state_fwd_bwd``: when the first backward of a round after the first reaches
      the output of a top-level forward, i.e. with that step's activations alive.

    A forward is top-level when no other module forward encloses it and autograd is not in
    a backward (activation-checkpoint recomputation runs forwards from inside backward).
    Idempotent; returns the hook handles."""
    if _global_hooks:
        return list(_global_hooks)
    import torch
    from torch.nn.modules import module as nn_module
    from torch.optim import optimizer as optim_module

    state = {"depth": 0, "init_done": False, "steps": {}, "round": 0, "fwd_bwd_round": 0}

    def in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def on_backward_start(grad):
        # The first backward of a round is the point with the most activations alive (a
        # chunked loss runs several backward passes, each after fewer are left).
        if state["fwd_bwd_round"] != state["round"]:
            state["fwd_bwd_round"] = state["round"]
            capture("steady_state_fwd_bwd")
        return None   # leave the gradient as it is

    def pre_forward(module, args):
        if in_backward():
            return None
        if state["depth"] == 0 and not state["init_done"]:
            state["init_done"] = True
            capture("after_init")
        state["depth"] += 1
        return None

    def post_forward(module, args, output):
        if in_backward():
            return None
        state["depth"] = max(0, state["depth"] - 1)
        if state["depth"] == 0 and state["round"] >= 1:
            out = output[0] if isinstance(output, (tuple, list)) and output else output
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(on_backward_start)
        return None

    def after_step(opt, args, kwargs):
        steps = state["steps"]
        steps[id(opt)] = steps.get(id(opt), 0) + 1
        state["round"] = max(steps.values())
        capture("after_optimizer_warmup" if state["round"] == 1 else "after_optimizer_step")

    _global_hooks.extend([
        nn_module.register_module_forward_pre_hook(pre_forward),
        nn_module.register_module_forward_hook(post_forward, always_call=True),
        optim_module.register_optimizer_step_post_hook(after_step),
    ])
    return list(_global_hooks)


def summarize_for_report(records: list[dict]) -> list[dict]:
    """Compact per-capture rows for the report metadata: the latest capture of each
    (logical rank, point)."""
    latest: dict = {}
    for r in records:
        latest[(r.get("logical_rank"), r.get("point"))] = r
    rows = []
    for r in latest.values():
        row = {"point": r.get("point"), "logical_rank": r.get("logical_rank"), "pp_rank": r.get("pp_rank"),
               "device": r.get("device")}
        row.update(r.get("stats", {}))
        for key in ("max_memory_allocated", "max_memory_reserved"):
            if key in r:
                row[key] = r[key]
        rows.append(row)
    return rows


# -- comparison --------------------------------------------------------------------------------
def load_captures(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    if isinstance(data, dict) and "captures" in data:
        return list(data["captures"])
    if isinstance(data, dict) and "metadata" in data:   # a cluster report
        return [{"point": r.get("point"), "logical_rank": r.get("logical_rank"), "pp_rank": r.get("pp_rank"),
                 "device": r.get("device"),
                 "stats": {k: v for k, v in r.items() if k not in ("point", "logical_rank", "pp_rank", "device")}}
                for r in data["metadata"].get("memory_captures", [])]
    raise ValueError(f"{path}: neither a memory capture file nor a cluster report")


def _flat(record: dict) -> dict:
    out = {}
    for k, v in record.get("stats", {}).items():
        if isinstance(v, (int, float)):
            out[k] = v
    for k in ("max_memory_allocated", "max_memory_reserved"):
        if isinstance(record.get(k), (int, float)):
            out[k] = record[k]
    for k, v in (record.get("snapshot") or {}).items():
        if isinstance(v, (int, float)):
            out[f"snapshot.{k}"] = v
    return out


def _pick(records: list[dict], rank: Optional[int], point: str, label: str) -> dict:
    ranks = sorted({r.get("logical_rank") for r in records})
    if rank is None:
        if len(ranks) != 1:
            raise ValueError(f"{label} holds captures of logical ranks {ranks}: choose one with --rank")
        rank = ranks[0]
    hits = [r for r in records if r.get("logical_rank") == rank and r.get("point") == point]
    if not hits:
        points = sorted({r.get("point") for r in records if r.get("logical_rank") == rank})
        raise ValueError(f"{label} has no capture of logical rank {rank} at {point!r} "
                         f"(points for that rank: {points or 'none'})")
    return hits[-1]


def compare(a: dict, b: dict) -> list[tuple[str, float, float, float]]:
    fa, fb = _flat(a), _flat(b)
    return [(k, fa.get(k, 0), fb.get(k, 0), fb.get(k, 0) - fa.get(k, 0)) for k in sorted(set(fa) | set(fb))]


def _fmt(v: float) -> str:
    sign = "-" if v < 0 else ""
    v = abs(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            return f"{sign}{v:.0f} {unit}" if unit == "B" else f"{sign}{v:.2f} {unit}"
        v /= 1024
    return str(v)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fakegpu.fake.memory",
                                     description="Compare memory captures of two fake-world runs.")
    sub = parser.add_subparsers(dest="command", required=True)
    cmp_ = sub.add_parser("compare", help="compare two runs at the same logical rank and capture point")
    cmp_.add_argument("a")
    cmp_.add_argument("b")
    cmp_.add_argument("--rank", type=int, help="logical rank (default: the only one captured)")
    cmp_.add_argument("--point", required=True, help=f"capture point, e.g. {', '.join(CAPTURE_POINTS)}")
    show = sub.add_parser("show", help="list the captures in a file")
    show.add_argument("path")
    args = parser.parse_args(argv)
    try:
        if args.command == "show":
            for r in load_captures(args.path):
                stats = ", ".join(f"{k}={_fmt(v) if 'bytes' in k or 'memory' in k or 'tracemalloc' in k else v}"
                                  for k, v in _flat(r).items())
                print(f"rank {r.get('logical_rank')} {r.get('point')}: {stats}")
            return 0
        a = _pick(load_captures(args.a), args.rank, args.point, args.a)
        b = _pick(load_captures(args.b), args.rank, args.point, args.b)
    except (OSError, ValueError) as exc:
        print(f"fakegpu memory: {exc}", file=sys.stderr)
        return 2
    if a.get("pp_rank") is not None and b.get("pp_rank") is not None and a["pp_rank"] != b["pp_rank"]:
        print(f"fakegpu memory: the runs play different PP coordinates ({a['pp_rank']} vs {b['pp_rank']}); "
              f"their ownership differs on purpose, so this is no evidence of a regression", file=sys.stderr)
        return 2
    print(f"logical rank {a.get('logical_rank')}, point {args.point}: A={args.a} ({a.get('device')}) "
          f"B={args.b} ({b.get('device')})")
    rows = compare(a, b)
    width = max([len(k) for k, *_ in rows] + [6])
    print(f"{'metric':<{width}}  {'A':>14}  {'B':>14}  {'B - A':>14}  {'B / A':>8}")
    for k, va, vb, d in rows:
        ratio = f"{vb / va:.3f}" if va else "-"
        is_bytes = any(s in k for s in ("bytes", "memory", "tracemalloc"))
        f = _fmt if is_bytes else (lambda v: f"{v:g}")
        print(f"{k:<{width}}  {f(va):>14}  {f(vb):>14}  {f(d):>14}  {ratio:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
