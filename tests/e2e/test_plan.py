"""`fgpu plan` end to end (docs/planning.md): a GPU-style torchrun script recorded in a fake
world, and TorchTitan's llama3 debug model captured on fake tensors (when TorchTitan is
installed), each through the real command line, checked against figures computed here."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from helpers.titan import HAS_TORCHTITAN
from helpers.torchrun import TORCH_UNDER_FGPU, fgpu_env

pytestmark = TORCH_UNDER_FGPU

# An FSDP2 MLP written for GPUs (nccl, cuda, set_device): 4 Linear(512, 512) layers, batch 64.
SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]).cuda()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        x = torch.randn(64, 512, device="cuda")
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    print("trained", dist.get_rank())
""")


def _plan(tmp_path, shim_library, args, timeout=600):
    env = fgpu_env(shim_library, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "fakegpu", "plan", "--output-dir", str(tmp_path), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    return done


def test_plan_of_a_gpu_style_torchrun_script(tmp_path, shim_library):
    (tmp_path / "train.py").write_text(SCRIPT)
    done = _plan(tmp_path, shim_library, ["--json", "--cluster-config", "h100-2node-8gpu-ib-8x400g",
                                          "--tokens-per-step", "64", "--", "torchrun", "--nnodes", "2",
                                          "--nproc-per-node", "8", "train.py"])
    assert done.returncode == 0, done.stderr[-4000:]
    plan = json.loads(done.stdout)             # stdout is the plan alone; the program's output is on stderr
    assert "trained 0" in done.stderr
    # the timed step's matmuls, exactly: forward and weight gradient of all 4 layers, input
    # gradient of the 3 whose input needs one, each 2 x 64 x 512 x 512 FLOPs
    assert plan["flops_per_step"] == 11 * 2 * 64 * 512 * 512
    assert plan["step_seconds"] >= plan["compute_seconds"] > 0
    # FSDP2's all-gathers and reduce-scatters over the 16 ranks on the default group
    assert plan["communication_seconds"]["default_pg"] > 0
    assert 0 <= plan["exposed_communication_seconds"] <= plan["communication_seconds"]["default_pg"] + 1e-12
    assert plan["tokens_per_second_per_gpu"] == pytest.approx(64 / plan["step_seconds"])
    assert plan["gpu"] == "h100" and plan["fits"]
    saved = json.loads((tmp_path / "fakegpu-plan.json").read_text())
    assert saved["step_seconds"] == plan["step_seconds"]
    trace = json.loads((tmp_path / "fakegpu-plan-trace.json").read_text())
    streams = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert "compute stream" in streams and any(s.startswith("comm stream") for s in streams)


# A mixture-of-experts layer with expert parallelism, written for GPUs: top-2 of 8 experts, 2
# per rank, the tokens sent to their experts' ranks by an all-to-all whose split sizes are the
# token counts read to the host (.tolist()), the experts run as grouped matmuls.
MOE_SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.manual_seed(dist.get_rank())
    world, group = dist.get_world_size(), dist.group.WORLD
    E, D, H, T, K = 8, 256, 512, 1024, 2
    local = E // world
    router = torch.nn.Linear(D, E, bias=False).cuda().bfloat16()
    w1 = torch.nn.Parameter(torch.randn(local, D, H, device="cuda", dtype=torch.bfloat16) * 0.02)
    w2 = torch.nn.Parameter(torch.randn(local, H, D, device="cuda", dtype=torch.bfloat16) * 0.02)
    opt = torch.optim.AdamW([*router.parameters(), w1, w2], lr=1e-3)
    for step in range(3):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        scores, ids = torch.topk(router(x).float().softmax(-1), K, dim=-1)
        counts = torch.zeros(E, dtype=torch.int64, device="cuda").scatter_add_(
            0, ids.flatten(), torch.ones_like(ids.flatten()))
        order = torch.argsort(ids.flatten(), stable=True)
        received = funcol.all_to_all_single(counts, None, None, group=group).wait()
        in_splits = counts.view(world, local).sum(1).tolist()
        out_splits = received.view(world, local).sum(1).tolist()
        tokens = funcol.all_to_all_single_autograd(x[order // K], out_splits, in_splits, group=group)
        offs = torch.cumsum(received.view(world, local).sum(0), 0, dtype=torch.int32)
        h = torch._grouped_mm(tokens, w1, offs)
        y = torch._grouped_mm(torch.nn.functional.silu(h), w2, offs)
        back = funcol.all_to_all_single_autograd(y, in_splits, out_splits, group=group)
        out = torch.zeros_like(x).index_add_(0, order // K, back * scores.flatten()[order, None].to(back.dtype))
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print("rows", sum(out_splits))
""")


def test_plan_of_an_expert_parallel_moe_script_counts_its_grouped_matmuls(tmp_path, shim_library):
    (tmp_path / "moe.py").write_text(MOE_SCRIPT)
    done = _plan(tmp_path, shim_library, ["--json", "--cluster-config", "h100-1node-8gpu-nvlink",
                                          "--tokens-per-step", "1024", "--", "torchrun", "--nproc-per-node",
                                          "4", "moe.py"])
    assert done.returncode == 0, done.stderr[-4000:]
    plan = json.loads(done.stdout)
    rows = int([line for line in done.stderr.splitlines() if line.startswith("rows ")][-1].split()[1])
    d, h, t, e, k = 256, 512, 1024, 8, 2
    # the router: forward and weight gradient (x needs no gradient); the experts' rows this rank
    # received: both grouped matmuls forward, both weight gradients, the second's input gradient
    assert plan["flops_per_step"] == 2 * (2 * t * d * e) + 5 * (2 * rows * d * h)
    assert plan["communication_seconds"]["default_pg"] > 0


# Two attention blocks trained under torch's context_parallel (SDPA's ring attention) on a
# 4-rank cp mesh, bf16, 2 x 2048 tokens per step (512 per rank).
CP_SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))

    class Block(torch.nn.Module):
        def __init__(self, dim=256, heads=4):
            super().__init__()
            self.heads = heads
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.out = torch.nn.Linear(dim, dim)

        def forward(self, x):
            b, s, d = x.shape
            q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return x + self.out(y.transpose(1, 2).reshape(b, s, d))

    model = torch.nn.Sequential(Block(), Block()).cuda().bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        x = torch.randn(2, 512 * world, 256, device="cuda", dtype=torch.bfloat16)
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
""")


def test_plan_of_a_context_parallel_sdpa_script_times_torchs_ring_attention(tmp_path, shim_library):
    """SDPA under context_parallel runs as the ring on a GPU runs it (flash kernels per key
    block, head-tail balanced): the timed step's FLOPs are exactly the ring's and the linears',
    each collective of the ring is recorded once, under its communicator's name."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    (tmp_path / "cp.py").write_text(CP_SCRIPT)
    done = _plan(tmp_path, shim_library, ["--json", "--cluster-config", "h100-1node-8gpu-nvlink",
                                          "--tokens-per-step", "1024", "--", "torchrun",
                                          "--nproc-per-node", "4", "cp.py"])
    assert done.returncode == 0, done.stderr[-4000:]
    plan = json.loads(done.stdout)
    # rank 0 of the ring: its 512 queries against its own 512 keys (causal), then 3 blocks of
    # its 256 later queries against 512 keys each; the backward the same blocks
    whole, half = (2, 4, 512, 64), (2, 4, 256, 64)
    attention = sdpa_flop_count(whole, whole, whole) + 3 * sdpa_flop_count(half, whole, whole) \
        + sdpa_backward_flop_count(whole, whole, whole, whole) + 3 * sdpa_backward_flop_count(half, half, whole, whole)
    tokens = 2 * 512
    linears = 2 * tokens * 256 * 768 + 2 * tokens * 256 * 256          # one block's forward
    # forward and weight gradients of both blocks, input gradients of all but the first qkv
    assert plan["flops_per_step"] == 2 * attention + 2 * 2 * linears + 2 * linears - 2 * tokens * 256 * 768
    assert set(plan["communication_seconds"]) == {"default_pg"}   # the cp mesh is the world group
    trace = json.loads((tmp_path / "fakegpu-plan-trace.json").read_text())
    names = [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"]
    # 3 recorded steps x 2 blocks: 4 ring steps each, forward and backward; the keys and values
    # all-gathered once per block forward and backward; their gradients passed 4 times
    assert names.count("_scaled_dot_product_flash_attention") == 24
    assert names.count("_scaled_dot_product_flash_attention_backward") == 24
    assert names.count("all_gather_into_tensor") == 12 and names.count("all_to_all_single") == 24


def test_plan_refuses_a_program_without_an_optimizer_step(tmp_path, shim_library):
    (tmp_path / "noop.py").write_text("import torch.distributed as dist\ndist.init_process_group('nccl')\n")
    done = _plan(tmp_path, shim_library, ["--", "torchrun", "--nproc-per-node", "2", "noop.py"])
    assert done.returncode == 2
    assert "ran no optimizer step" in done.stderr


def test_plan_of_a_bad_launch_names_the_problem(tmp_path, shim_library):
    done = _plan(tmp_path, shim_library, ["--", "mpirun", "-n", "4", "train.py"])
    assert done.returncode == 2 and "cannot plan 'mpirun'" in done.stderr
    done = _plan(tmp_path, shim_library, ["--", "torchrun", "--nproc-per-node", "gpu", "train.py"])
    assert done.returncode == 2 and "--nproc-per-node 'gpu'" in done.stderr


TITAN = ["-m", "torchtitan.train", "--module", "llama3", "--config", "llama3_debugmodel",
         "--training.local_batch_size", "4", "--training.seq_len", "256"]


@pytest.mark.skipif(not HAS_TORCHTITAN, reason="TorchTitan 0.3.0 is not installed")
def test_plan_of_torchtitan_llama3_debug_model(tmp_path, shim_library):
    done = _plan(tmp_path, shim_library, ["--json", "--cluster-config", "h100-1node-8gpu-nvlink", "--",
                                          "torchrun", "--nproc-per-node", "8", *TITAN,
                                          "--parallelism.tensor_parallel_degree", "2"])
    assert done.returncode == 0, done.stderr[-4000:]
    plan = json.loads(done.stdout)
    layout = plan["layout"]
    assert (layout["dp_shard"], layout["tp"], layout["world_size"]) == (4, 2, 8)
    # TorchTitan's own MFU numerator: 6 x non-embedding parameters + 12 x layers x dim x seq
    from torchtitan.config import ConfigManager
    from torchtitan.models.common.decoder import Decoder  # noqa: F401  (registry import)

    config = ConfigManager().parse_args(TITAN[2:])
    model = config.model_spec.model
    dim, vocab, layers = model.dim, model.vocab_size, len(model.layers)
    assert plan["flops_per_token"] == 6 * (plan["nparams"] - vocab * dim) + 12 * layers * dim * 256
    # tokens/s per GPU: local batch x seq x dp / world / step
    assert plan["tokens_per_second_per_gpu"] == pytest.approx(4 * 256 * 4 / 8 / plan["step_seconds"])
    assert plan["mfu"] == pytest.approx(plan["flops_per_token"] * plan["tokens_per_second_per_gpu"] / 989e12)
    # tensor parallelism's collectives run on the tp group and are exposed (on the critical path)
    assert plan["communication_seconds"]["tp"] > 0
    assert plan["exposed_communication_by_group"]["tp"] > 0
    assert 0 < plan["peak_memory_reserved_gib"] < 2 and plan["fits"]


@pytest.mark.skipif(not HAS_TORCHTITAN, reason="TorchTitan 0.3.0 is not installed")
def test_plan_of_torchtitan_deepseek_v3_with_expert_parallelism(tmp_path, shim_library):
    args = ["-m", "torchtitan.train", "--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel",
            "--parallelism.expert_parallel_degree", "4", "--training.local_batch_size", "2",
            "--training.disable_cuda_graphs"]
    done = _plan(tmp_path, shim_library, ["--json", "--cluster-config", "h100-1node-8gpu-nvlink", "--",
                                          "torchrun", "--nproc-per-node", "8", *args])
    assert done.returncode == 0, done.stderr[-4000:]
    plan = json.loads(done.stdout)
    # MFU counts the experts a token is routed to, as TorchTitan's own counting does
    import copy

    import torch
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(args[2:])
    model_config = copy.deepcopy(config.model_spec.model)
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    nparams, flops = model_config.get_nparams_and_flops(model, config.training.seq_len)
    assert (plan["nparams"], plan["flops_per_token"]) == (nparams, flops)
    assert plan["mfu"] == pytest.approx(flops * plan["tokens_per_second_per_gpu"] / 989e12)
    assert plan["exposed_communication_seconds"] > 0 and plan["fits"]


@pytest.mark.skipif(not HAS_TORCHTITAN, reason="TorchTitan 0.3.0 is not installed")
def test_plan_sweep_ranks_fitting_layouts(tmp_path, shim_library):
    done = _plan(tmp_path, shim_library, ["--json", "--sweep", "--cluster-config", "h100-1node-8gpu-nvlink", "--",
                                          "torchrun", "--nproc-per-node", "4", *TITAN], timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout)
    ranked = result["ranked"]
    speeds = [r["tokens_per_second_per_gpu"] for r in ranked]
    assert speeds == sorted(speeds, reverse=True) and len(ranked) >= 4
    layouts = {(r["layout"]["tp"], r["layout"]["pp"], r["layout"]["ac"]) for r in ranked}
    assert (1, 1, "full") in layouts and (2, 1, "selective") in layouts
    # the same global batch everywhere: local batch x data-parallel degree = 4 x 4
    assert all(r["layout"]["local_batch_size"] * r["layout"]["dp_shard"] * r["layout"]["dp_replicate"] == 16
               for r in ranked)


@pytest.mark.skipif(not HAS_TORCHTITAN, reason="TorchTitan 0.3.0 is not installed")
def test_plan_of_context_parallelism_captures_the_key_value_all_gathers_and_the_local_attention(tmp_path,
                                                                                              shim_library):
    """CP 2 on the debug model: each layer's forward all-gathers its local keys and values on the
    cp group (recomputed ones too), the backward reduce-scatters their gradients, and flex
    attention runs the rank's seq / 2 queries against all seq keys with the head-tail mask."""
    from fakegpu.cli.plan import _titan_config
    from fakegpu.plan import titan
    from fakegpu.plan.block_masks import causal_block_mask
    from fakegpu.plan.compute import _block_mask_density

    config = _titan_config([*TITAN[2:6], "--training.local_batch_size", "2", "--training.seq_len", "1024",
                            "--parallelism.context_parallel_degree", "2"], "h100")
    model = config.model_spec.model
    heads = model.layers[0].attention.n_heads
    kv_heads = model.layers[0].attention.n_kv_heads or heads      # None: no grouped-query attention
    head_dim = model.dim // heads
    cap = titan.capture(config, 8, steps=1)
    assert (cap.layout.cp, cap.layout.dp_shard) == (2, 4)
    cp_group = next(g for g, name in cap.labels.items() if name == "cp")
    on_cp = [r.collective for r in cap.records if r.collective is not None and r.collective.group == cp_group]
    kv = 2 * kv_heads * 512 * head_dim                  # local batch x kv heads x seq / 2 x head dim
    forward = [c for c in on_cp if c.kind == "AllGather"]
    backward = [c for c in on_cp if c.kind == "ReduceScatter"]
    assert {c.count for c in forward} == {kv} and {c.count for c in backward} == {kv}
    layers = len(model.layers)
    assert len(backward) == 2 * layers                  # keys and values of every layer
    assert len(forward) >= 2 * layers
    flex = [r for r in cap.records if r.kind == "attention" and r.phase == "forward"]
    assert len(flex) == layers
    _, sq, sk, _, _ = flex[0].attention
    assert (sq, sk) == (512, 1024)
    mask, _ = causal_block_mask(2, 1024, 2, "headtail")
    assert flex[0].work_fraction == pytest.approx(_block_mask_density([mask.as_tuple()]))


@pytest.mark.skipif(not HAS_TORCHTITAN, reason="TorchTitan 0.3.0 is not installed")
def test_plan_of_context_parallelism_with_sdpa_captures_torchs_ring_attention():
    """CP 2 on the debug model with TorchTitan's SDPA attention (what TorchTitan of 2024 ran):
    per layer, the keys and values all-gathered on the cp group in forward and backward, their
    fp32 gradients passed round the ring, and the kernels of the head-tail balanced ring: the
    rank's 512 queries against its own 512 keys (causal), then its later 256 against 512."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    from fakegpu.cli.plan import _titan_config
    from fakegpu.plan import titan

    config = _titan_config([*TITAN[2:6], "--training.local_batch_size", "2", "--training.seq_len", "1024",
                            "--parallelism.context_parallel_degree", "2"], "h100")
    layers = config.model_spec.model.layers
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cap = titan.capture(config, 8, steps=1)
    cp_group = next(g for g, name in cap.labels.items() if name == "cp")
    on_cp = [r.collective for r in cap.records if r.collective is not None and r.collective.group == cp_group]
    gathers = [c for c in on_cp if c.kind == "AllGather"]
    passes = [c for c in on_cp if c.kind == "AlltoAll"]
    assert len(gathers) >= 2 * len(layers) and len(passes) == 2 * len(layers)
    assert {c.elem_size for c in gathers} == {2} and {c.elem_size for c in passes} == {4}
    shapes = {(r.phase, r.attention[1:4]) for r in cap.records if r.kind == "attention"}
    assert shapes == {("forward", (512, 512, True)), ("forward", (256, 512, False)),
                      ("backward", (512, 512, True)), ("backward", (256, 512, False))}


@pytest.mark.skipif(not HAS_TORCHTITAN, reason="TorchTitan 0.3.0 is not installed")
def test_sweep_adds_context_parallelism_for_long_sequences_only():
    from fakegpu.cli.plan import _titan_config, sweep_layouts

    def layouts(seq: int) -> set:
        config = _titan_config([*TITAN[2:4], *TITAN[4:6], "--training.local_batch_size", "1",
                                "--training.seq_len", str(seq)], "h100")
        return {(c.parallelism.tensor_parallel_degree, c.parallelism.context_parallel_degree)
                for c in sweep_layouts(config, 8, 8)}

    assert {cp for _, cp in layouts(2048)} == {1}
    long = layouts(32768)
    assert {cp for _, cp in long} == {1, 2, 4, 8}
    assert all(tp * cp <= 8 for tp, cp in long)
