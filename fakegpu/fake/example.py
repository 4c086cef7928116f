"""A pipelined FSDP x TP training step in a fake world (``python -m fakegpu.fake.example``).

The logical world is a (pp, dp, tp) DeviceMesh.  Each pipeline stage is a small MLP whose
two linears are tensor-parallel (DTensor ColwiseParallel/RowwiseParallel over "tp") and
fully sharded (FSDP2 ``fully_shard`` over "dp"); stages pass activations forward and
gradients back with send/recv over "pp" (GPipe: all forwards, then all backwards).

Pure fake (one process): ``NGPU=1024 FAKE_PP_RANK=0 python -m fakegpu.fake.example --pp 4 --tp 8``.
Real pipeline, fake SPMD: ``FAKEGPU_DIST_MODE=real_pp_fake_spmd NGPU=64 torchrun
--nproc-per-node 2 -m fakegpu.fake.example --pp 2 --tp 4``: the pp send/recv cross the
processes for real (gloo), every other axis is fake.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fakegpu.fake.example", description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=int(os.environ.get("FAKEGPU_PP_DEGREE", "1")), help="pipeline degree P")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel degree")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--nodes", type=int, default=0,
                   help="model a synthetic cluster of this many nodes (with --gpus-per-node) "
                        "instead of FAKEGPU_CLUSTER_CONFIG")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--no-tp-module", action="store_true",
                   help="do not use DTensor tensor parallelism (plain FSDP2 layers plus a TP all-reduce)")
    p.add_argument("--capture-memory", action="store_true",
                   help="capture memory at the four capture points (fakegpu.fake.memory)")
    p.add_argument("--summary-json", help="write a small JSON summary of the run here")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("FAKEGPU_PP_DEGREE", str(args.pp))
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from . import memory
    from .process_group import init_process_group

    t0 = time.time()
    topology = None
    if args.nodes:
        from .cluster import uniform_cluster
        topology = uniform_cluster(args.nodes, args.gpus_per_node)
    world = init_process_group(pp_degree=args.pp, topology=topology)
    lc = world.contract
    if lc.spmd_size % args.tp:
        raise SystemExit(f"NGPU/P = {lc.spmd_size} is not divisible by --tp {args.tp}")
    dp = lc.spmd_size // args.tp
    mesh = init_device_mesh("cpu", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    stage, n_stages = lc.pp_rank, args.pp
    pp_group = mesh["pp"].get_group()
    pp_ranks = dist.get_process_group_ranks(pp_group)
    torch.manual_seed(1234 + stage)
    h = args.hidden
    model = nn.Sequential(nn.Linear(h, 4 * h), nn.ReLU(), nn.Linear(4 * h, h))
    if not args.no_tp_module and args.tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.capture_memory:
        memory.capture("after_init")
    losses = []
    for step in range(args.steps):
        inputs, outputs, step_loss = [], [], 0.0
        for mb in range(args.microbatches):
            if stage == 0:
                x = torch.randn(args.batch, h)
            else:
                x = torch.empty(args.batch, h)
                dist.recv(x, src=pp_ranks[stage - 1], group=pp_group)
                x.requires_grad_(True)
            y = model(x)
            if args.no_tp_module and args.tp > 1:
                with torch.no_grad():
                    dist.all_reduce(y.detach().clone(), group=mesh["tp"].get_group())
            if stage < n_stages - 1:
                dist.send(y.detach().contiguous(), dst=pp_ranks[stage + 1], group=pp_group)
            inputs.append(x)
            outputs.append(y)
        if args.capture_memory and step == args.steps - 1:
            memory.capture("steady_state_fwd_bwd")
        for mb in reversed(range(args.microbatches)):
            x, y = inputs[mb], outputs[mb]
            if stage == n_stages - 1:
                loss = y.float().pow(2).mean() / args.microbatches
                loss.backward()
                step_loss += loss.item()
            else:
                grad = torch.empty_like(y)
                dist.recv(grad, src=pp_ranks[stage + 1], group=pp_group)
                y.backward(grad)
            if stage > 0:
                dist.send(x.grad.contiguous(), dst=pp_ranks[stage - 1], group=pp_group)
        opt.step()
        opt.zero_grad()
        if args.capture_memory and step == 0:
            memory.capture("after_optimizer_warmup")
        losses.append(step_loss)
    if args.capture_memory:
        memory.capture("after_optimizer_step")
    dist.destroy_process_group()
    summary = {"contract": lc.to_dict(), "losses": losses, "seconds": time.time() - t0,
               "report": world.written, "mesh": [args.pp, dp, args.tp]}
    if world.is_lead and world._accountant is not None:
        summary["accounting"] = world.accountant.summary()
    if args.summary_json:
        path = args.summary_json if lc.physical_world_size == 1 else f"{args.summary_json}.rank{lc.physical_rank}"
        with open(path, "w") as fh:
            json.dump(summary, fh, indent=2)
    print(json.dumps({k: summary[k] for k in ("losses", "seconds", "mesh")}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
