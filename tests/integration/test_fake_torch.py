"""The fakegpu_fake torch backend: a whole logical world from one CPU process, and a real
pipeline with fake SPMD axes across two processes.  Each scenario runs in a subprocess so
torch.distributed's global state never leaks between tests."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.paths import REPO_ROOT as ROOT

pytest.importorskip("torch")



def _env(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FAKEGPU_", "NGPU", "FAKE_PP_RANK", "RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.update(PYTHONPATH=str(ROOT), FAKEGPU_QUIET="1", OMP_NUM_THREADS="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _run(args, env, timeout=600):
    proc = subprocess.run([sys.executable, "-W", "ignore", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    return proc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SMALL_WORLD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import torch, torch.nn as nn, torch.distributed as dist
    from fakegpu.fake import contract
    from fakegpu.fake.process_group import FakeWorldProcessGroup, init_process_group, register
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    register()
    # the backend checks its arguments against the launch contract
    try:
        dist.init_process_group("fakegpu_fake", store=dist.HashStore(), rank=0, world_size=4)
    except Exception as exc:
        out["wrong_world_size"] = str(exc)
    world = init_process_group()
    assert dist.get_world_size() == 8 and dist.get_rank() == 0
    n = 8
    t = torch.arange(4, dtype=torch.float32); dist.all_reduce(t)
    out["allreduce_sum"] = t.tolist()
    t = torch.arange(4, dtype=torch.float32); dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["allreduce_avg"] = t.tolist()
    t = torch.tensor([2, -3], dtype=torch.int8); dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    out["allreduce_prod_int8"] = t.tolist()
    t = torch.tensor([1.0078125, 3.0], dtype=torch.bfloat16); dist.all_reduce(t)
    out["allreduce_bf16"] = t.float().tolist()
    t = torch.tensor([True, False]); dist.all_reduce(t)
    out["allreduce_bool"] = t.tolist()
    t = torch.arange(6.).reshape(2, 3).t(); dist.all_reduce(t)    # non-contiguous
    out["allreduce_noncontig"] = t.tolist()
    t = torch.arange(3.); dist.broadcast(t, src=5); out["broadcast"] = t.tolist()
    t = torch.arange(3.); dist.reduce(t, dst=0); out["reduce_root"] = t.tolist()
    outs = [torch.empty(2) for _ in range(n)]; dist.all_gather(outs, torch.tensor([1., 2.]))
    out["all_gather"] = [o.tolist() for o in outs]
    o = torch.empty(16); dist.all_gather_into_tensor(o, torch.tensor([1., 2.])); out["all_gather_tensor"] = o.tolist()
    o = torch.empty(2); dist.reduce_scatter_tensor(o, torch.arange(16.)); out["reduce_scatter"] = o.tolist()
    o = torch.empty(2); dist.reduce_scatter(o, [torch.full((2,), float(i)) for i in range(n)])
    out["reduce_scatter_list"] = o.tolist()
    o = torch.empty(8); dist.all_to_all_single(o, torch.arange(8.)); out["all_to_all"] = o.tolist()
    outs = [torch.empty(1) for _ in range(n)]; dist.all_to_all(outs, [torch.full((1,), float(i)) for i in range(n)])
    out["all_to_all_list"] = [x.item() for x in outs]
    g = [torch.empty(2) for _ in range(n)]; dist.gather(torch.tensor([3., 4.]), g, dst=0)
    out["gather"] = [x.tolist() for x in g]
    s = torch.empty(1); dist.scatter(s, [torch.full((1,), float(i)) for i in range(n)], src=0); out["scatter"] = s.tolist()
    objs = [None] * n; dist.all_gather_object(objs, {"k": 1}); out["all_gather_object"] = objs[:2]
    dist.barrier()
    dist.send(torch.tensor([5., 6.]), dst=1)
    r = torch.zeros(2); dist.recv(r, src=7); out["recv_ring"] = r.tolist()
    r = torch.full((2,), 9.); dist.recv(r, src=1); out["recv_unmatched"] = r.tolist()
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(3), 1), dist.P2POp(dist.irecv, torch.zeros(3), 7)])
    for q in reqs: q.wait()
    # subgroups: new_group learns its global ranks, split_group is local
    sub = dist.new_group([0, 2, 4, 6])
    t = torch.ones(2); dist.all_reduce(t, group=sub); out["subgroup_sum"] = t.tolist()
    pg = dist.distributed_c10d._get_default_group()
    sp = pg.split_group([0, 1])
    out["split"] = [sp.size(), list(sp.members), sp.rank()]
    out["split_non_member"] = pg.split_group([2, 3]) is None
    # DeviceMesh names its groups; DDP chains on get_future
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    out["mesh_groups"] = [mesh["dp"].get_group().group_desc, list(mesh["dp"].get_group().members),
                          mesh["tp"].get_group().group_desc, list(mesh["tp"].get_group().members)]
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 2), process_group=mesh["dp"].get_group())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = nn.Linear(4, 2); ref.load_state_dict(model.module.state_dict())
    x = torch.randn(3, 4)
    model(x).sum().backward(); opt.step()
    ref(x).sum().backward()
    # DDP averages over dp=2 ranks that all hold the same gradient: the reference gradient
    out["ddp_grad_matches"] = bool(torch.allclose(model.module.weight.grad, ref.weight.grad))
    dist.destroy_process_group()
    out["report"] = world.written
    json.dump(out, sys.stdout)
""")


def test_small_world_collectives_ddp_groups_and_report(tmp_path):
    script = tmp_path / "small.py"
    script.write_text(SMALL_WORLD)
    report = tmp_path / "r.json"
    events = tmp_path / "ev.jsonl"
    proc = _run([str(script)], _env(tmp_path, NGPU=8, FAKEGPU_CLUSTER_REPORT_PATH=report,
                                    FAKEGPU_FAKE_EVENTS_PATH=events), timeout=300)
    out = json.loads(proc.stdout)
    assert "NGPU=8" in out["wrong_world_size"] and "world_size=NGPU" in out["wrong_world_size"]
    assert out["allreduce_sum"] == [0, 8, 16, 24]
    assert out["allreduce_avg"] == [0, 1, 2, 3]
    assert out["allreduce_prod_int8"] == [0, -95]          # 2**8 wraps to 0; (-3)**8 = 6561 = 161 mod 256 = -95
    assert out["allreduce_bf16"] == [8.0625, 24.0]         # 8 x (1 + 2**-7), exact in bfloat16
    assert out["allreduce_bool"] == [True, False]
    assert out["allreduce_noncontig"] == [[0, 24], [8, 32], [16, 40]]
    assert out["broadcast"] == [0, 1, 2] and out["reduce_root"] == [0, 8, 16]
    assert out["all_gather"] == [[1, 2]] * 8 and out["all_gather_tensor"] == [1, 2] * 8
    assert out["reduce_scatter"] == [0, 8]                 # rank 0's share, summed over 8 ranks
    assert out["reduce_scatter_list"] == [0, 0]
    assert out["all_to_all"] == [0.0] * 8                  # every rank sends us its block 0 == ours
    assert out["all_to_all_list"] == [0.0] * 8
    assert out["gather"] == [[3, 4]] * 8 and out["scatter"] == [0]
    assert out["all_gather_object"] == [{"k": 1}, {"k": 1}]
    assert out["recv_ring"] == [5, 6] and out["recv_unmatched"] == [0, 0]
    assert out["subgroup_sum"] == [4, 4]
    assert out["split"] == [2, [0, 1], 0] and out["split_non_member"] is True
    assert out["mesh_groups"] == ["mesh_dp", [0, 4], "mesh_tp", [0, 1, 2, 3]]
    assert out["ddp_grad_matches"] is True
    data = json.loads(report.read_text())
    check = _run(["-m", "fakegpu", "report", "check", str(report), "--expect-world-size", "8",
                  "--expect-collective", "AllReduce", "--expect-collective", "AlltoAll"], _env(tmp_path))
    assert "OK" in check.stdout
    assert data["metadata"]["mode"] == "fake" and data["metadata"]["physical_logical_ranks"] == [0]
    assert data["point_to_point"]["operations"] > 0
    # the event file rebuilds the same report
    rebuilt = tmp_path / "r2.json"
    _run(["-m", "fakegpu.fake.build_report", str(events), "--report", str(rebuilt)], _env(tmp_path))
    again = json.loads(rebuilt.read_text())
    assert again["totals"]["logical_bytes"] == data["totals"]["logical_bytes"]
    assert again["links"] == data["links"] and again["node_pairs"] == data["node_pairs"]


@pytest.mark.slow   # ~25 s alone, 80+ s on a loaded 2-core CI box
def test_1024_rank_world_fsdp_tp_pp_from_one_process(tmp_path):
    report = tmp_path / "r.json"
    mem = tmp_path / "mem.json"
    summary = tmp_path / "summary.json"
    _run(["-m", "fakegpu.fake.example", "--pp", "4", "--tp", "8", "--nodes", "128", "--steps", "2",
          "--capture-memory", "--summary-json", str(summary)],
         _env(tmp_path, NGPU=1024, FAKE_PP_RANK=1, FAKEGPU_CLUSTER_REPORT_PATH=report,
              FAKEGPU_MEMORY_CAPTURE_PATH=mem), timeout=900)
    check = _run(["-m", "fakegpu", "report", "check", str(report), "--expect-world-size", "1024",
                  "--expect-node-count", "128", "--expect-collective", "AllGather",
                  "--expect-collective", "ReduceScatter", "--expect-collective", "AllReduce"], _env(tmp_path))
    assert "OK" in check.stdout
    data = json.loads(report.read_text())
    meta = data["metadata"]
    assert meta["mode"] == "fake" and meta["logical_world_size"] == 1024
    assert meta["physical_logical_ranks"] == [256]          # FAKE_PP_RANK=1 of P=4 -> 1 * 1024/4
    assert meta["fake_world"]["untiled_communicators"] == {}
    # FSDP over dp=32: every all-gather has 1024/32 replicas; TP over 8: 128 replicas each
    counts = {c["size"]: 0 for c in data["communicators"]}
    for c in data["communicators"]:
        counts[c["size"]] += 1
    assert counts[32] == 32 and counts[8] == 128 and counts[4] == 256
    assert data["collectives"]["AllGather"]["calls"] % 32 == 0
    assert data["point_to_point"]["operations"] % 256 == 0 and data["point_to_point"]["inter_node_operations"] > 0
    assert all(r["collective_calls"] > 0 for r in data["ranks"])   # the whole world is busy
    assert {m["point"] for m in meta["memory_captures"]} == {
        "after_init", "after_optimizer_warmup", "steady_state_fwd_bwd", "after_optimizer_step"}
    show = _run(["-m", "fakegpu", "report", "show", str(report)], _env(tmp_path))
    assert "world size 1024, 128 node(s)" in show.stdout
    # memory: the same logical rank and capture point across two "runs" (file vs report)
    cmp_ = _run(["-m", "fakegpu.fake.memory", "compare", str(mem), str(report), "--point", "after_optimizer_step"],
                _env(tmp_path))
    assert "logical rank 256, point after_optimizer_step" in cmp_.stdout and "tracemalloc.peak" in cmp_.stdout
    bad = subprocess.run([sys.executable, "-m", "fakegpu.fake.memory", "compare", str(mem), str(mem),
                          "--point", "nowhere"], cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "no capture of logical rank 256 at 'nowhere'" in bad.stderr


HYBRID_CHECK = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from fakegpu.fake.process_group import init_process_group
    world = init_process_group()
    lc = world.contract
    mesh = init_device_mesh("cpu", (2, 4, 2), mesh_dim_names=("pp", "dp", "tp"))
    pp = mesh["pp"].get_group()
    ranks = dist.get_process_group_ranks(pp)
    out = {"logical_rank": lc.logical_rank, "pp_ranks": ranks}
    if lc.pp_rank == 0:
        dist.send(torch.arange(6, dtype=torch.float32) * 1.5, dst=ranks[1], group=pp)
        back = torch.zeros(2, dtype=torch.int64); dist.recv(back, src=ranks[1], group=pp)
        out["got"] = back.tolist()
    else:
        x = torch.zeros(6); dist.recv(x, src=ranks[0], group=pp); out["got"] = x.tolist()
        dist.send(torch.tensor([7, 8]), dst=ranks[0], group=pp)
    t = torch.ones(3); dist.all_reduce(t, group=mesh["dp"].get_group()); out["dp_sum"] = t.tolist()
    dist.destroy_process_group()
    json.dump(out, sys.stdout)
""")


def _launch_pair(args, tmp_path, **env):
    port = _free_port()
    procs = []
    for r in range(2):
        e = _env(tmp_path, FAKEGPU_DIST_MODE="real_pp_fake_spmd", RANK=r, WORLD_SIZE=2, LOCAL_RANK=r,
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **env)
        procs.append(subprocess.Popen([sys.executable, "-W", "ignore", *args], cwd=ROOT, env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, f"rc={p.returncode}\n{se[-6000:]}"
        outs.append(so)
    return outs


def test_real_pipeline_fake_spmd_two_processes(tmp_path):
    script = tmp_path / "hybrid.py"
    script.write_text(HYBRID_CHECK)
    report = tmp_path / "h.json"
    outs = _launch_pair([str(script)], tmp_path, NGPU=16, FAKEGPU_PP_DEGREE=2, FAKEGPU_CLUSTER_REPORT_PATH=report)
    a, b = (json.loads(o) for o in outs)
    assert a["logical_rank"] == 0 and b["logical_rank"] == 8 and a["pp_ranks"] == [0, 8]
    assert b["got"] == [0.0, 1.5, 3.0, 4.5, 6.0, 7.5]         # crossed the processes for real (gloo)
    assert a["got"] == [7, 8]
    assert a["dp_sum"] == [4, 4, 4] and b["dp_sum"] == [4, 4, 4]   # the fake dp axis completes locally
    data = json.loads(report.read_text())
    fw = data["metadata"]["fake_world"]
    assert fw["events_from_physical_ranks"] == [0, 1] and data["metadata"]["physical_logical_ranks"] == [0, 8]
    # each send accounted once (by its sender), replicated over the 8 pipeline groups {b, b+8}
    assert data["point_to_point"]["operations"] == 2 * 8
    # each stage's dp all-reduce tiles its own slice: 2 replicas per stage, 2 stages
    assert data["collectives"]["AllReduce"]["calls"] == 4


def test_real_pipeline_fake_spmd_training_example(tmp_path):
    report = tmp_path / "h.json"
    summary = tmp_path / "s.json"
    events = tmp_path / "ev.jsonl"
    _launch_pair(["-m", "fakegpu.fake.example", "--pp", "2", "--tp", "2", "--steps", "2",
                  "--summary-json", str(summary)], tmp_path, NGPU=16, FAKEGPU_CLUSTER_REPORT_PATH=report,
                 FAKEGPU_FAKE_EVENTS_PATH=events)
    last = json.loads(Path(f"{summary}.rank1").read_text())
    assert last["contract"]["logical_rank"] == 8 and all(loss > 0 for loss in last["losses"])
    check = _run(["-m", "fakegpu", "report", "check", str(report), "--expect-world-size", "16",
                  "--expect-collective", "AllGather", "--expect-collective", "ReduceScatter"], _env(tmp_path))
    assert "OK" in check.stdout
    data = json.loads(report.read_text())
    # 2 steps x 2 microbatches: stage 0 sends activations, stage 1 sends gradients; x 8 pipelines
    assert data["point_to_point"]["operations"] == 2 * 2 * 2 * 8
    # the two processes' event files rebuild the same whole-world report
    rebuilt = tmp_path / "rebuilt.json"
    _run(["-m", "fakegpu", "fake", "build-report", f"{events}.rank0", f"{events}.rank1", "--report", str(rebuilt)],
         _env(tmp_path))
    again = json.loads(rebuilt.read_text())
    assert again["totals"]["operations"] == data["totals"]["operations"]
    assert again["totals"]["logical_bytes"] == data["totals"]["logical_bytes"]
    assert again["links"] == data["links"] and again["node_pairs"] == data["node_pairs"]
    assert again["metadata"]["physical_logical_ranks"] == [0, 8]


SUBSET_CHECK = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from fakegpu.fake.process_group import init_process_group
    world = init_process_group()
    me = world.contract.logical_rank
    real = dist.new_group([0, 1])
    mixed = dist.new_group([0, 2]) if me == 0 else dist.new_group([1, 3])
    out = {"rank": me}
    t = torch.arange(3.) * (me + 1); dist.all_reduce(t, group=real); out["sum"] = t.tolist()
    t = torch.arange(3.) * (me + 1); dist.all_reduce(t, op=dist.ReduceOp.AVG, group=real); out["avg"] = t.tolist()
    t = torch.tensor([5, -7]) * (me + 1); dist.all_reduce(t, op=dist.ReduceOp.AVG, group=real)
    out["avg_int"] = t.tolist()
    t = torch.arange(3.) * (me + 1); dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5), group=real)
    out["premul"] = t.tolist()
    o = torch.empty(4); dist.all_gather_into_tensor(o, torch.full((2,), float(me)), group=real); out["ag"] = o.tolist()
    o = torch.empty(2); dist.reduce_scatter_tensor(o, torch.arange(4.) * (me + 1), op=dist.ReduceOp.AVG, group=real)
    out["rs_avg"] = o.tolist()
    t = torch.full((2,), float(me)); dist.broadcast(t, src=1, group=real); out["bcast"] = t.tolist()
    o = torch.empty(2); dist.all_to_all_single(o, torch.tensor([10. * me, 10. * me + 1]), group=real)
    out["a2a"] = o.tolist()
    dist.barrier(group=real)
    t = torch.ones(2) * (me + 1); dist.all_reduce(t, group=mixed); out["mixed_sum"] = t.tolist()
    dist.destroy_process_group()
    json.dump(out, sys.stdout)
""")


def test_any_subset_of_logical_ranks_may_be_physical(tmp_path):
    """Logical ranks 0 and 1 of a 4-rank world are real processes: their group runs over
    gloo with NCCL's AVG/PREMUL_SUM meaning; groups with fake members stay local."""
    script = tmp_path / "subset.py"
    script.write_text(SUBSET_CHECK)
    report = tmp_path / "s.json"
    a, b = (json.loads(o) for o in _launch_pair([str(script)], tmp_path, NGPU=4, FAKEGPU_PHYSICAL_RANKS="0,1",
                                                 FAKEGPU_CLUSTER_REPORT_PATH=report))
    for out in (a, b):
        assert out["sum"] == [0, 3, 6] and out["avg"] == [0, 1.5, 3] and out["premul"] == [0, 1.5, 3]
        assert out["avg_int"] == [7, -10]               # (5 + 10) / 2 and (-7 - 14) / 2, truncated
        assert out["ag"] == [0, 0, 1, 1] and out["bcast"] == [1, 1]
    assert a["rs_avg"] == [0, 1.5] and b["rs_avg"] == [3, 4.5]
    assert a["a2a"] == [0, 10] and b["a2a"] == [1, 11]
    assert a["mixed_sum"] == [2, 2] and b["mixed_sum"] == [4, 4]
    data = json.loads(report.read_text())
    # 5 all-reduces (barrier included) on {0,1} replicated to {2,3}, each counted once, plus
    # one all-reduce on each process's mixed group ({0,2} and {1,3})
    assert data["collectives"]["AllReduce"]["calls"] == 5 * 2 + 2
    assert data["collectives"]["AllGather"]["calls"] == 2
    assert data["metadata"]["physical_logical_ranks"] == [0, 1]


def test_report_written_at_exit_without_destroy_and_topology_checked_first(tmp_path):
    script = tmp_path / "exit.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from fakegpu.fake.process_group import init_process_group
        init_process_group()
        t = torch.ones(4); dist.all_reduce(t, group=dist.new_group([0, 1]))
        # no destroy_process_group(): the atexit hook writes the report
    """))
    report = tmp_path / "r.json"
    _run([str(script)], _env(tmp_path, NGPU=16, FAKEGPU_CLUSTER_REPORT_PATH=report), timeout=300)
    data = json.loads(report.read_text())
    assert data["collectives"]["AllReduce"]["calls"] == 8 and data["world_size"] == 16
    cfg = tmp_path / "small.yaml"
    from fakegpu.fake.cluster import uniform_cluster_yaml
    cfg.write_text(uniform_cluster_yaml(1, 8))
    proc = subprocess.run([sys.executable, "-W", "ignore", str(script)], cwd=ROOT, capture_output=True, text=True,
                          env=_env(tmp_path, NGPU=16, FAKEGPU_CLUSTER_CONFIG=cfg), timeout=300)
    assert proc.returncode != 0
    assert "places 8 ranks but the logical world has 16" in proc.stderr


PIPELINING = textwrap.dedent("""
    import json, sys, torch, torch.nn as nn, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.fsdp import fully_shard
    from fakegpu.fake.process_group import init_process_group
    world = init_process_group()
    lc = world.contract
    mesh = init_device_mesh("cpu", (2, 4, 2), mesh_dim_names=("pp", "dp", "tp"))
    torch.manual_seed(lc.pp_rank)
    block = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    fully_shard(block, mesh=mesh["dp"])
    stage = PipelineStage(block, lc.pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=lambda out, tgt: (out - tgt).pow(2).mean())
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    torch.manual_seed(99)
    out = {"rank": lc.logical_rank, "losses": []}
    for step in range(2):
        x, y = torch.randn(8, 16), torch.randn(8, 16)
        if lc.pp_rank == 0:
            schedule.step(x)
        else:
            losses = []
            schedule.step(target=y, losses=losses)
            out["losses"].append(sum(l.item() for l in losses))
        opt.step(); opt.zero_grad()
    dist.destroy_process_group()
    json.dump(out, sys.stdout)
""")


def test_real_pipeline_fake_spmd_with_torch_pipelining_schedule(tmp_path):
    """torch.distributed.pipelining's 1F1B schedule (shape inference, batched isend/irecv)
    between two real processes, FSDP2 over the fake dp axis of each stage."""
    script = tmp_path / "pipe.py"
    script.write_text(PIPELINING)
    report = tmp_path / "p.json"
    a, b = (json.loads(o) for o in _launch_pair([str(script)], tmp_path, NGPU=16, FAKEGPU_PP_DEGREE=2,
                                                 FAKEGPU_CLUSTER_REPORT_PATH=report))
    assert a["losses"] == [] and len(b["losses"]) == 2 and all(v > 0 for v in b["losses"])
    data = json.loads(report.read_text())
    assert check_report_ok(report, tmp_path, 16)
    p2p = data["point_to_point"]["operations"]
    assert p2p > 0 and p2p % 8 == 0                    # replicated over the 8 pipelines {b, b+8}
    assert data["collectives"]["AllGather"]["calls"] > 0 and data["collectives"]["ReduceScatter"]["calls"] > 0


def check_report_ok(report, tmp_path, world_size) -> bool:
    proc = _run(["-m", "fakegpu", "report", "check", str(report), "--expect-world-size", str(world_size)],
                _env(tmp_path))
    return "OK" in proc.stdout


def test_group_ranks_recovered_from_torch_when_the_creator_was_not_told(monkeypatch):
    """A group made by a creator without the extended API learns its global ranks from
    torch's own record at first use."""
    import torch.distributed as dist

    from fakegpu.fake import runtime
    from fakegpu.fake.contract import resolve
    from fakegpu.fake.process_group import FakeWorldProcessGroup

    runtime.reset()
    world = runtime.get_or_create(resolve({"NGPU": "16"}))
    try:
        pg = FakeWorldProcessGroup(dist.HashStore(), 1, 4, world=world)
        monkeypatch.setitem(dist.distributed_c10d._world.pg_group_ranks, pg, {8: 0, 9: 1, 10: 2, 11: 3})
        assert pg.members == (8, 9, 10, 11)
        whole = FakeWorldProcessGroup(dist.HashStore(), 0, 16, world=world)
        assert whole.members == tuple(range(16))
        orphan = FakeWorldProcessGroup(dist.HashStore(), 0, 4, world=world)
        with pytest.raises(RuntimeError, match="cannot tell which global ranks form group"):
            orphan.members
    finally:
        world.finished = True
        runtime.reset()
