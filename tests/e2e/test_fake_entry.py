"""Unmodified programs enter the fake world (fakegpu.fake.entry, docs/fake-worlds.md).

The scripts below call torch.distributed the way real programs do — no fakegpu import — and
run in fresh interpreters with fgpu's torch autoload hook on PYTHONPATH, as fgpu starts them.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from fakegpu.fake import contract
from fakegpu.fake.entry import prepare_environment
from helpers.paths import REPO_ROOT as ROOT

AUTOLOAD = ROOT / "fakegpu" / "torch" / "autoload"


# -- the environment rewrite ----------------------------------------------------------------------

def test_pure_fake_rewrites_world_size_and_rank_and_the_contract_still_resolves():
    env = {"FAKEGPU_DIST_MODE": "fake", "NGPU": "64", "FAKE_PP_RANK": "1", "FAKEGPU_PP_DEGREE": "2"}
    lc = prepare_environment(env)
    assert lc.logical_rank == 32
    assert env["WORLD_SIZE"] == "64" and env["RANK"] == "32" and env["LOCAL_RANK"] == "0"
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"]
    # WORLD_SIZE=64 would be refused in pure fake mode; the rewrite is recognised as ours
    again = contract.resolve(env)
    assert (again.logical_rank, again.physical_world_size) == (32, 1)
    assert prepare_environment(env) == lc and env["RANK"] == "32"     # idempotent


def test_a_launcher_that_sets_fresh_values_overrides_an_inherited_rewrite():
    env = {"FAKEGPU_DIST_MODE": "real_pp_fake_spmd", "NGPU": "8", "FAKEGPU_PP_DEGREE": "2"}
    assert prepare_environment(env) is None and "WORLD_SIZE" not in env   # torchrun's agent: no RANK
    inherited = {"FAKEGPU_DIST_MODE": "fake", "NGPU": "8"}
    prepare_environment(inherited)
    # torchrun starts a worker from that environment with its own WORLD_SIZE / RANK
    worker = dict(inherited, FAKEGPU_DIST_MODE="real_pp_fake_spmd", FAKEGPU_PP_DEGREE="2",
                  WORLD_SIZE="2", RANK="1", LOCAL_RANK="1", MASTER_PORT="1234")
    lc = prepare_environment(worker)
    assert (lc.physical_rank, lc.logical_rank) == (1, 4)
    assert worker["WORLD_SIZE"] == "8" and worker["RANK"] == "4" and worker["LOCAL_RANK"] == "1"
    assert worker["MASTER_PORT"] == "1234"
    assert contract.resolve(worker).physical_ranks == (0, 4)


def test_an_inconsistent_launch_leaves_the_environment_alone():
    env = {"FAKEGPU_DIST_MODE": "fake", "NGPU": "10", "FAKEGPU_PP_DEGREE": "4"}
    assert prepare_environment(env) is None and "WORLD_SIZE" not in env
    assert prepare_environment({"NGPU": "8"}) is None                      # not a fake-world mode
    off = {"FAKEGPU_DIST_MODE": "fake", "NGPU": "8", "FAKEGPU_FAKE_WORLD_ENTRY": "0"}
    assert prepare_environment(off) is None and "WORLD_SIZE" not in off


# -- real interpreters ---------------------------------------------------------------------------

PROGRAM = textwrap.dedent(r"""
    import json, os, sys
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    how = sys.argv[1]
    device = "cpu"
    if how == "env":
        dist.init_process_group()
    elif how == "tcp":
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:1", world_size=8,
                                rank=int(os.environ["RANK"]))
    elif how == "store":
        dist.init_process_group("gloo", store=dist.HashStore(), world_size=int(os.environ["WORLD_SIZE"]),
                                rank=int(os.environ["RANK"]))
    elif how == "torch_fake":
        dist.init_process_group("fake", rank=int(os.environ["RANK"]), world_size=8)   # TorchTitan's dry run
    elif how == "nccl":
        device = "cuda"
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    elif how == "wrong_size":
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:1", world_size=4, rank=0)
    mesh = init_device_mesh(device, (4, 2), mesh_dim_names=("dp", "tp"))
    x = torch.ones(3, device=device)
    dist.all_reduce(x, group=mesh["dp"].get_group())
    out = {"env": [os.environ["WORLD_SIZE"], os.environ["RANK"]],
           "world": dist.get_world_size(), "rank": dist.get_rank(),
           "backend": dist.get_backend(), "dp_backend": dist.get_backend(mesh["dp"].get_group()),
           "dp_ranks": dist.get_process_group_ranks(mesh["dp"].get_group()), "sum": x.tolist()}
    dist.destroy_process_group()
    print("RESULT" + json.dumps(out))
""")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FAKEGPU_", "NGPU", "FAKE_PP_RANK", "RANK", "WORLD_SIZE", "MASTER_", "LOCAL_"))}
    env.update(PYTHONPATH=os.pathsep.join([str(AUTOLOAD), str(ROOT)]), FAKEGPU_QUIET="1",
               OMP_NUM_THREADS="1", FAKEGPU_DIST_MODE="fake", FAKEGPU_FAKE_CUDA="0")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _run(args, env, *, ok=True):
    proc = subprocess.run([sys.executable, "-W", "ignore", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    if ok:
        assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stderr[-6000:]}"
    return proc


def _result(stdout: str) -> dict:
    line = [x for x in stdout.splitlines() if x.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


@pytest.mark.parametrize("how", ["env", "tcp", "store", "torch_fake", "nccl"])
def test_unmodified_init_process_group_enters_the_fake_world(tmp_path, how):
    pytest.importorskip("torch")
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    report = tmp_path / "r.json"
    extra = {"FAKEGPU_FAKE_CUDA": "1", "FAKEGPU_MODE": "simulate"} if how == "nccl" else {}
    out = _result(_run([str(script), how], _env(NGPU=8, RANK=2, FAKEGPU_FAKE_REPORT_PATH=report,
                                                **extra)).stdout)
    assert out["env"] == ["8", "2"] and out["world"] == 8 and out["rank"] == 2
    assert out["backend"] == "fakegpu_fake" and out["dp_backend"] == "fakegpu_fake"
    assert out["dp_ranks"] == [0, 2, 4, 6] and out["sum"] == [4.0, 4.0, 4.0]
    data = json.loads(report.read_text())
    assert data["metadata"]["logical_world_size"] == 8
    assert data["collectives"]["AllReduce"]["calls"] == 2      # the dp all-reduce, over 2 replicas


def test_an_explicit_size_other_than_ngpu_is_a_launch_contract_error(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    proc = _run([str(script), "wrong_size"], _env(NGPU=8), ok=False)
    assert proc.returncode != 0
    assert "LaunchContractError" in proc.stderr and "world_size=4" in proc.stderr and "NGPU=8" in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_pipeline_mode_under_torchrun_enters_unmodified(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "hybrid.py"
    script.write_text(textwrap.dedent(r"""
        import json, os
        import torch, torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        dist.init_process_group()          # env://, as torchrun programs do
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        pp = mesh["pp"].get_group()
        me = dist.get_rank()
        if me == 0:
            dist.send(torch.tensor([3.0, 5.0]), dst=4, group=pp)
            got = None
        else:
            got = torch.zeros(2); dist.recv(got, src=0, group=pp); got = got.tolist()
        # One write(2) per line: the two ranks share the pipe, and print() could interleave them.
        os.write(1, ("RESULT" + json.dumps({"rank": me, "world": dist.get_world_size(), "got": got,
                                            "env": [os.environ["WORLD_SIZE"], os.environ["RANK"]]}) + "\n").encode())
        dist.destroy_process_group()
    """))
    report = tmp_path / "h.json"
    env = _env(FAKEGPU_DIST_MODE="real_pp_fake_spmd", NGPU=8, FAKEGPU_PP_DEGREE=2,
               FAKEGPU_FAKE_REPORT_PATH=report)
    proc = _run(["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
                 str(script)], env)
    results = sorted((json.loads(x[len("RESULT"):]) for x in proc.stdout.splitlines() if x.startswith("RESULT")),
                     key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 4] and all(r["world"] == 8 for r in results)
    assert results[1]["got"] == [3.0, 5.0]                 # crossed the two processes for real
    assert [r["env"] for r in results] == [["8", "0"], ["8", "4"]]
    data = json.loads(report.read_text())
    assert data["metadata"]["physical_logical_ranks"] == [0, 4]


TRAIN = textwrap.dedent(r"""
    import sys
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    mesh = init_device_mesh("cuda", (8,), mesh_dim_names=("dp",))
    width, batch = 256, int(sys.argv[1])
    model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.ReLU(),
                                torch.nn.Linear(4 * width, width)).cuda()
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        loss = model(torch.randn(batch, width, device="cuda")).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
""")


def test_capture_memory_takes_the_four_captures_through_global_hooks(tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    runs = {}
    for batch in (64, 512):
        mem = tmp_path / f"mem{batch}.json"
        report = tmp_path / f"r{batch}.json"
        _run([str(script), str(batch)], _env(NGPU=8, RANK=3, FAKEGPU_FAKE_CUDA=1, FAKEGPU_MODE="simulate",
                                             FAKEGPU_MEMORY_CAPTURE_PATH=mem, FAKEGPU_FAKE_REPORT_PATH=report))
        caps = json.loads(mem.read_text())["captures"]
        latest = {c["point"]: c for c in caps}
        assert set(latest) == {"after_init", "after_optimizer_warmup", "steady_state_fwd_bwd",
                               "after_optimizer_step"}
        assert all(c["logical_rank"] == 3 and c["device"] == "cuda:0" for c in caps)
        # the fake-CUDA allocator's figures: parameters sharded 8 ways (and the first input),
        # then the two Adam moments after the first step
        params = (256 * 1024 * 2 + 1024 + 256) * 4 // 8
        init = latest["after_init"]["stats"]["allocated_bytes.all.current"]
        warm = latest["after_optimizer_warmup"]["stats"]["allocated_bytes.all.current"]
        assert params <= init <= params + batch * 256 * 4 + 4096 and warm >= 3 * params
        rows = json.loads(report.read_text())["metadata"]["memory_captures"]
        assert {r["point"] for r in rows} == set(latest)
        runs[batch] = (mem, latest)
    small = runs[64][1]["steady_state_fwd_bwd"]["stats"]["allocated_bytes.all.current"]
    big = runs[512][1]["steady_state_fwd_bwd"]["stats"]["allocated_bytes.all.current"]
    assert big - small >= (512 - 64) * 1024 * 4           # at least the larger hidden activation
    cmp_ = _run(["-m", "fakegpu.fake.memory", "compare", str(runs[64][0]), str(runs[512][0]),
                 "--point", "steady_state_fwd_bwd"], _env())
    assert "allocated_bytes.all.current" in cmp_.stdout and "logical rank 3" in cmp_.stdout


PIPELINE_PROGRAM = textwrap.dedent(r"""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    dist.init_process_group()
    pp = dist.new_group([0, 1])
    stage = PipelineStage(torch.nn.Linear(4, 4), stage_index=0, num_stages=2, device=torch.device("cpu"),
                          group=pp)
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, target: out.sum())
    schedule.step(torch.ones(4, 4))
""")


def test_a_pipeline_schedule_in_pure_fake_mode_says_why_it_cannot_run(tmp_path):
    """The schedule needs its neighbour stage's shapes from that stage's process; in pure fake mode
    there is none. The failure names the reason and the mode to use, not only torch's metadata error."""
    pytest.importorskip("torch")
    script = tmp_path / "pp.py"
    script.write_text(PIPELINE_PROGRAM)
    proc = _run([str(script)], _env(NGPU=2, FAKEGPU_PP_DEGREE=2, FAKE_PP_RANK=0), ok=False)
    assert proc.returncode != 0
    assert "pipelining schedules cannot run in pure fake mode" in proc.stderr, proc.stderr[-3000:]
    assert "--dist-mode real_pp_fake_spmd" in proc.stderr


GRAPH_PROGRAM = textwrap.dedent(r"""
    import json, os
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    static = torch.zeros(3, device="cuda")
    out = torch.zeros(3, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reduced = static * 2
        dist.all_reduce(reduced)
        out.copy_(reduced)
    sums = []
    for value in (1.0, 3.0):
        static.fill_(value)
        graph.replay()
        sums.append(out.tolist())
    dist.destroy_process_group()
    print("RESULT" + json.dumps({"sums": sums}))
""")


def test_a_collective_in_a_cuda_graph_reduces_again_on_each_replay_in_a_fake_world(tmp_path):
    """A fake world's group is a Python backend that torch calls from C++: inside a capture its
    collective is a step of the graph, so each replay reduces this replay's values (SPMD
    symmetry: the sum over 4 replicas) and reaches the report."""
    pytest.importorskip("torch")
    script = tmp_path / "graph.py"
    script.write_text(GRAPH_PROGRAM)
    report = tmp_path / "r.json"
    out = _result(_run([str(script)], _env(NGPU=4, RANK=1, LOCAL_RANK=0, FAKEGPU_FAKE_REPORT_PATH=report,
                                           FAKEGPU_FAKE_CUDA="1", FAKEGPU_MODE="simulate")).stdout)
    assert out["sums"] == [[8.0] * 3, [24.0] * 3]
    data = json.loads(report.read_text())
    # the capture ran it once (a GPU's capture would not) and the two replays once each
    assert data["collectives"]["AllReduce"]["calls"] == 3
