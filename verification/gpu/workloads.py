"""One verification workload per invocation, run by every rank under torchrun.

    torchrun --nproc-per-node 4 verification/gpu/workloads.py CASE --out DIR [--device cuda] [--backend nccl]

Each rank trains a small model with the parallelism of CASE, then computes the same training
in a single process (no communication: the reference), compares ITS OWN final parameters with
the reference's, and writes DIR/rank<R>.json: {"case", "rank", "max_abs_err", "rel_err", "tol",
"ok", "losses", ...}. The ranks of one host may all share one GPU (hybrid mode: cuda:LOCAL_RANK
modulo the device count). `bandwidth` instead times all_reduce on device buffers and rank 0 writes
DIR/bandwidth.json.

CASES: ddp_plain ddp_no_sync ddp_find_unused ddp_static_graph ddp_bucket_view, ddp_all (the five
in one job), fsdp1 (FULL_SHARD, full state dict, restoration into a fresh model), fsdp2_<P> with
parameters in P = fp32, fp16 or bf16 and gradients reduced in fp32, fsdp2_<P>_param (gradients
reduced in the parameter dtype), tp, pp, bandwidth
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

DDP_CASES = ("ddp_plain", "ddp_no_sync", "ddp_find_unused", "ddp_static_graph", "ddp_bucket_view")
FSDP2_PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
FSDP2_CASES = ("fsdp2_fp32", "fsdp2_bf16", "fsdp2_fp16", "fsdp2_bf16_param", "fsdp2_fp16_param")
CASES = (*DDP_CASES, "ddp_all", "fsdp1", *FSDP2_CASES, "tp", "pp", "bandwidth")
# What run_all.py runs when no --cases is given (the usage doc's runners pick the others).
SUITE = (*DDP_CASES, "fsdp2_fp32", "fsdp2_bf16", "tp", "pp", "bandwidth")
STEPS = 4
ROWS = 8          # per rank and step
FEATURES, HIDDEN, OUTPUTS = 32, 64, 16
LR = 0.05


class MLP(nn.Module):
    def __init__(self, unused_branch: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = nn.Linear(HIDDEN, OUTPUTS)
        self.extra = nn.Linear(HIDDEN, HIDDEN) if unused_branch else None  # never used in forward

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def make_model(device, unused_branch: bool = False) -> nn.Module:
    torch.manual_seed(1234)  # on the CPU generator: the same weights on every rank and device
    return MLP(unused_branch).to(device)


def global_batch(step: int, nranks: int, device, micro: int = 0):
    """The whole step's batch (every rank's rows), identical everywhere."""
    g = torch.Generator().manual_seed(10_000 * step + micro)
    x = torch.randn(nranks * ROWS, FEATURES, generator=g)
    y = torch.randn(nranks * ROWS, OUTPUTS, generator=g)
    return x.to(device), y.to(device)


def local_rows(t, rank):
    return t[rank * ROWS:(rank + 1) * ROWS]


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu()


# ------------------------------------------------------------------ single-process references

def reference_data_parallel(n, device, micro_steps: int = 1, unused_branch=False, bf16=False):
    """Data parallelism with averaged gradients == one process on the global batch (``bf16``:
    True for bfloat16 compute, or the low-precision dtype itself)."""
    low = torch.bfloat16 if bf16 is True else (None if bf16 is False else bf16)
    model = make_model(device, unused_branch)
    opt = sgd(model.parameters())
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for m in range(micro_steps):
            x, y = global_batch(step, n, device, m)
            if low is not None:
                with torch.autocast(device_type=torch.device(device).type, dtype=low):
                    out = model(x)
                loss = F.mse_loss(out.float(), y)
            else:
                loss = F.mse_loss(model(x), y)
            loss.backward()
            losses.append(loss.item())
        opt.step()
    return {k: v.detach().float().cpu() for k, v in model.named_parameters()}, losses


def reference_pp(n, device, micro: int):
    torch.manual_seed(1234)
    stages = nn.ModuleList([nn.Linear(FEATURES if i == 0 else HIDDEN, HIDDEN if i < n - 1 else OUTPUTS)
                            for i in range(n)]).to(device)
    opt = sgd(stages.parameters())
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = global_batch(step, n, device)
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            h = xm
            for i, layer in enumerate(stages):
                h = layer(h)
                if i < n - 1:
                    h = torch.relu(h)
            (F.mse_loss(h, ym) / micro).backward()
        opt.step()
    return stages


# ------------------------------------------------------------------ distributed workloads

def run_ddp(case, rank, n, device):
    from torch.nn.parallel import DistributedDataParallel as DDP
    unused = case == "ddp_find_unused"
    model = make_model(device, unused)
    kwargs = {}
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    if unused:
        kwargs["find_unused_parameters"] = True
    if case == "ddp_static_graph":
        kwargs["static_graph"] = True
    if case == "ddp_bucket_view":
        kwargs.update(gradient_as_bucket_view=True, bucket_cap_mb=0.01)  # several buckets
    ddp = DDP(model, **kwargs)
    opt = sgd(ddp.parameters())
    micro = 2 if case == "ddp_no_sync" else 1
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for m in range(micro):
            x, y = global_batch(step, n, device, m)
            x, y = local_rows(x, rank), local_rows(y, rank)
            if m < micro - 1:
                with ddp.no_sync():
                    loss = F.mse_loss(ddp(x), y)
                    loss.backward()
            else:
                loss = F.mse_loss(ddp(x), y)
                loss.backward()
            losses.append(loss.item())
        opt.step()
    got = {k: full(v) for k, v in model.named_parameters()}
    ref, _ = reference_data_parallel(n, device, micro, unused)
    return got, ref, losses, (1e-4, 1e-5)


def run_fsdp2(case, rank, n, device):
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    # fsdp2_<precision>[_param]: parameters in <precision>; gradients reduced in fp32, or (with
    # _param) in the parameter dtype itself.
    parts = case.split("_")
    low = None if parts[1] == "fp32" else FSDP2_PRECISIONS[parts[1]]
    param_reduce = parts[-1] == "param"
    mesh = init_device_mesh(device.type, (n,))
    model = make_model(device)
    mp = (MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low if param_reduce else torch.float32)
          if low is not None else MixedPrecisionPolicy())
    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = sgd(model.parameters())
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = global_batch(step, n, device)
        loss = F.mse_loss(model(local_rows(x, rank)).float(), local_rows(y, rank))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    got = {k: full(v) for k, v in model.named_parameters()}
    ref, _ = reference_data_parallel(n, device, 1, False, low)
    # Low precision: the ranks compute in it on their own rows, the reference on all rows; the
    # check is relative to how far training moved the weights (a wrong reduction is off by far more).
    return got, ref, losses, ((5e-2, 5e-3) if low is not None else (1e-4, 1e-5))


def run_fsdp1(case, rank, n, device):
    """FSDP FULL_SHARD: reduce-scattered, averaged gradients, SGD on the shards, the full state
    dict against the reference, then that state dict loaded into a fresh (differently
    initialised) FSDP model must read back identical."""
    from torch.distributed.fsdp import FullStateDictConfig, ShardingStrategy, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    def wrap(module):
        return FSDP(module, sharding_strategy=ShardingStrategy.FULL_SHARD, device_id=device,
                    use_orig_params=False)

    def full_state(m):
        with FSDP.state_dict_type(m, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=device.type == "cuda", rank0_only=False)):
            return {k: v.detach().float().cpu().clone() for k, v in m.state_dict().items()}

    model = wrap(make_model(device))
    opt = sgd(model.parameters())
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = global_batch(step, n, device)
        loss = F.mse_loss(model(local_rows(x, rank)), local_rows(y, rank))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    got = full_state(model)
    fresh_module = make_model(device)
    with torch.no_grad():
        for p in fresh_module.parameters():
            p.fill_(7.0)
    fresh = wrap(fresh_module)
    with FSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=device.type == "cuda", rank0_only=False)):
        fresh.load_state_dict({k: v.to(device) for k, v in got.items()})
    back = full_state(fresh)
    restored = set(back) == set(got) and all(torch.equal(back[k], got[k]) for k in got)
    ref, _ = reference_data_parallel(n, device)
    return got, ref, losses, (1e-4, 1e-5), {"state_dict_restored": restored}


def run_tp(case, rank, n, device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh(device.type, (n,))
    model = make_model(device)
    # Megatron MLP: fc1 split by output features, fc2 by input features (its output is
    # all-reduced in forward); fc3 stays replicated (identical gradients on every rank).
    parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = sgd(model.parameters())
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = global_batch(step, n, device)  # TP: every rank sees the whole batch
        out = model(x)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        loss = F.mse_loss(out, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    got = {k: full(v) for k, v in model.named_parameters()}
    ref, _ = reference_data_parallel(n, device)
    return got, ref, losses, (1e-4, 1e-5)


def run_pp(case, rank, n, device):
    """GPipe by hand: stage r holds layer r; activations and their gradients travel by send/recv."""
    micro = 4
    torch.manual_seed(1234)
    layers = nn.ModuleList([nn.Linear(FEATURES if i == 0 else HIDDEN, HIDDEN if i < n - 1 else OUTPUTS)
                            for i in range(n)])
    layer = layers[rank].to(device)
    opt = sgd(layer.parameters())
    in_dim = FEATURES if rank == 0 else HIDDEN
    mb = n * ROWS // micro
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x, y = global_batch(step, n, device)
        xs, ys = x.chunk(micro), y.chunk(micro)
        inputs, outputs = [], []
        for m in range(micro):
            if rank == 0:
                inp = xs[m]
            else:
                inp = torch.empty(mb, in_dim, device=device)
                dist.recv(inp, rank - 1)
                inp.requires_grad_(True)
            out = layer(inp)
            if rank < n - 1:
                out = torch.relu(out)
                dist.send(out.detach().contiguous(), rank + 1)
            inputs.append(inp)
            outputs.append(out)
        for m in reversed(range(micro)):
            if rank == n - 1:
                loss = F.mse_loss(outputs[m], ys[m]) / micro
                losses.append(loss.item())
                loss.backward()
            else:
                grad = torch.empty_like(outputs[m])
                dist.recv(grad, rank + 1)
                outputs[m].backward(grad)
            if rank > 0:
                dist.send(inputs[m].grad.contiguous(), rank - 1)
        opt.step()
    got = {k: full(v) for k, v in layer.named_parameters()}
    ref_layers = reference_pp(n, device, micro)
    ref = {k: v.detach().float().cpu() for k, v in ref_layers[rank].named_parameters()}
    return got, ref, losses, (1e-4, 1e-5)


def run_bandwidth(out_dir: Path, rank, n, device, max_bytes: int):
    sizes = []
    s = 4096
    while s <= max_bytes:
        sizes.append(s)
        s *= 4
    rows = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        for _ in range(2):
            dist.all_reduce(t)
        iters = 10 if nbytes <= (1 << 20) else 4
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = (time.perf_counter() - t0) / iters
        check = torch.ones(4, dtype=torch.float32, device=device)
        dist.all_reduce(check)
        algbw = nbytes / dt / 1e9
        rows.append({"bytes": nbytes, "time_us": dt * 1e6, "algbw_GBps": algbw,
                     "busbw_GBps": algbw * 2 * (n - 1) / n, "check_ok": bool((check == n).all().item())})
    if rank == 0:
        (out_dir / "bandwidth.json").write_text(json.dumps({"nranks": n, "device": str(device), "rows": rows}, indent=1))
    return rows


def compare(got: dict, ref: dict, tol) -> dict:
    rtol, atol = tol
    worst, worst_name, rel = 0.0, None, 0.0
    init = {k: v.detach().float().cpu() for k, v in make_model("cpu", True).named_parameters()}
    ok = set(got) == set(ref)
    for k, g in got.items():
        if k not in ref:
            continue
        r = ref[k]
        if g.shape != r.shape:
            ok = False
            continue
        err = (g - r).abs().max().item()
        if err > worst:
            worst, worst_name = err, k
        moved = (r - init[k]).abs().max().item() if k in init and init[k].shape == r.shape else 0.0
        if moved > 0:
            rel = max(rel, err / moved)
        if not torch.allclose(g, r, rtol=rtol, atol=atol):
            ok = False
    return {"max_abs_err": worst, "worst_param": worst_name, "err_over_update": rel, "ok": ok,
            "tol": {"rtol": rtol, "atol": atol}, "params": sorted(got)}


def run_named_case(case: str, rank: int, n: int, device) -> dict:
    """One numerical case in this (already initialised) process group: this rank's result,
    {"ok", "max_abs_err", ...}. ddp_all runs the five DDP cases and keeps each one's verdict."""
    if case == "ddp_all":
        parts = {c: run_named_case(c, rank, n, device) for c in DDP_CASES}
        return {"case": case, "rank": rank, "nranks": n, "device": str(device),
                "ok": all(r["ok"] for r in parts.values()),
                "max_abs_err": max(r["max_abs_err"] for r in parts.values()),
                "err_over_update": max(r["err_over_update"] for r in parts.values()),
                "cases": parts}
    runner = {"ddp": run_ddp, "fsdp1": run_fsdp1, "fsdp2": run_fsdp2, "tp": run_tp, "pp": run_pp}[case.split("_")[0]]
    got, ref, losses, tol, *extra = runner(case, rank, n, device)
    result = {"case": case, "rank": rank, "nranks": n, "device": str(device),
              "losses": losses, **compare(got, ref, tol)}
    for checks in extra:
        result.update(checks)
        result["ok"] = result["ok"] and all(checks.values())
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case", choices=CASES)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--backend", default="nccl", help="nccl (GPU), or fakegpu/gloo for a CPU dry run")
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="bandwidth: largest message")
    args = p.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.backend == "fakegpu":
        import fakegpu.torch  # noqa: F401  registers the CPU backend
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, n = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    try:
        if args.case == "bandwidth":
            run_bandwidth(out_dir, rank, n, device, args.max_bytes)
            result = {"case": args.case, "rank": rank, "ok": True}
        else:
            result = run_named_case(args.case, rank, n, device)
        result["seconds"] = time.perf_counter() - t0
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
