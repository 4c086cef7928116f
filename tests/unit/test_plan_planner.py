"""The planner's pieces that need no TorchTitan: launch parsing, growing a cluster YAML to the
job's size, clocks under a power cap, collectives captured with their groups, depth
extrapolation, and a captured step's timeline on the cost model (fakegpu.plan)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fakegpu import costmodel
from fakegpu.cli.plan import PlanError, parse_launch
from fakegpu.plan import gpu_compute
from fakegpu.plan.planner import _extrapolate, scaled_topology
from fakegpu.topology import load_cluster_config
from fakegpu.topology.loader import parse_cluster_config
from helpers.paths import REPO_ROOT


def test_torchrun_launches_give_the_world_size_and_the_program():
    assert parse_launch(["torchrun", "--nnodes", "16", "--nproc-per-node", "8", "-m", "torchtitan.train",
                         "--module", "llama3"]) == (128, ["-m", "torchtitan.train", "--module", "llama3"])
    assert parse_launch(["torchrun", "--standalone", "--nproc_per_node=4", "train.py", "--lr", "1"]) == \
        (4, ["train.py", "--lr", "1"])
    assert parse_launch(["python", "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node", "8",
                         "--rdzv-endpoint", "host:29400", "t.py"]) == (16, ["t.py"])
    assert parse_launch(["/usr/bin/torchrun", "t.py"]) == (1, ["t.py"])


def test_a_plain_python_launch_is_ngpu_ranks(monkeypatch):
    monkeypatch.setenv("NGPU", "32")
    assert parse_launch(["python3", "train.py"]) == (32, ["train.py"])


@pytest.mark.parametrize("command, message", [
    ([], "no command given"),
    (["mpirun", "-n", "2", "a.out"], "cannot plan 'mpirun'"),
    (["torchrun", "--nproc-per-node", "auto", "t.py"], "--nproc-per-node 'auto'"),
    (["torchrun", "--nnodes"], "needs a value"),
    (["torchrun", "--nproc-per-node", "8"], "has no program"),
])
def test_bad_launches_name_the_problem(command, message):
    with pytest.raises(PlanError, match=message):
        parse_launch(command)


def test_a_yaml_of_one_node_is_repeated_to_the_jobs_size():
    topo = load_cluster_config(str(REPO_ROOT / "cluster_configs" / "h100-96gb-500w-grand-teton-8gpu-rdma.yaml"))
    grown = scaled_topology(topo, 128)
    assert grown.world_size == 128 and grown.node_count == 16
    assert grown.node_of(127) == 15 and grown.local_index(127) == 7
    assert grown.gpu_of(100).name == "h100-96gb" and grown.gpu_of(100).power_limit_w == 500
    # the repeated nodes keep the YAML's rails: a 16-node all-reduce crosses the network
    est = costmodel.estimate("AllReduce", 1 << 26, 2, list(range(128)), 0, 0, grown)
    assert est.inter_node_bytes > 0
    assert scaled_topology(topo, 8) is topo
    with pytest.raises(ValueError, match="do not fill nodes of 8"):
        scaled_topology(topo, 12)


def test_nodes_of_different_sizes_are_not_guessed():
    topo = load_cluster_config(str(REPO_ROOT / "cluster_configs" / "heterogeneous-3node.yaml"))
    with pytest.raises(ValueError, match="describe every node"):
        scaled_topology(topo, topo.world_size * 4)


def test_a_power_cap_lowers_the_math_peaks_by_the_cube_root_and_leaves_hbm():
    text = """
version: 1
cluster: {name: capped}
nodes:
  - id: n0
    ranks: [0, 1]
    gpus: [{profile: h100-96gb, power_limit_w: 500}, {profile: h100-96gb}]
fabric:
  intra_node: {type: nvlink, bandwidth_gbps: 3600, latency_us: 2}
  inter_node: {type: infiniband, bandwidth_gbps: 400, latency_us: 5}
"""
    topo = parse_cluster_config(text)
    capped, full = (gpu_compute.compute_of(topo.gpu_of(r)) for r in (0, 1))
    factor = (500 / 700) ** (1 / 3)
    assert capped.peak("bf16") == pytest.approx(989e12 * factor)
    assert capped.peak("fp8") == pytest.approx(1979e12 * factor)
    assert full.peak("bf16") == pytest.approx(989e12)
    assert capped.hbm_gbs == full.hbm_gbs == 2400.0
    assert gpu_compute.clock_factor(700, 900) == 1.0 and gpu_compute.clock_factor(None, 500) == 1.0


def test_a_bad_power_limit_is_refused_with_its_place():
    bad = """
version: 1
cluster: {name: bad}
nodes:
  - id: n0
    ranks: [0]
    gpus: [{profile: h100, power_limit_w: -5}]
fabric:
  intra_node: {type: nvlink, bandwidth_gbps: 3600, latency_us: 2}
  inter_node: {type: infiniband, bandwidth_gbps: 400, latency_us: 5}
"""
    with pytest.raises(ValueError, match="power_limit_w"):
        parse_cluster_config(bad)


def test_extrapolation_is_linear_in_depth():
    a = {"step": 1.0, "exposed": {"fsdp": 0.1}, "timeline": "a"}
    b = {"step": 1.5, "exposed": {"fsdp": 0.2, "tp": 0.05}, "timeline": "b"}
    out = _extrapolate([a, b], (2, 4), 32)
    assert out["step"] == pytest.approx(1.5 + 0.25 * 28)
    assert out["exposed"]["fsdp"] == pytest.approx(0.2 + 0.05 * 28)
    assert out["exposed"]["tp"] == pytest.approx(0.05 + 0.025 * 28)
    assert out["timeline"] == "b"
    assert _extrapolate([a], (6,), 6) is a


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=16)
    yield
    dist.destroy_process_group()


def test_collectives_are_captured_with_kind_count_and_group(fake_world):
    from torch._subclasses.fake_tensor import FakeTensorMode
    import torch.distributed._functional_collectives as funcol

    from fakegpu.plan.capture import OpRecorder

    node = dist.new_group(list(range(8)))
    with FakeTensorMode(), OpRecorder() as rec:
        shard = torch.randn(1000, dtype=torch.bfloat16)
        full = torch.empty(16000, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(full, shard)
        grads = torch.randn(16000)
        dist.reduce_scatter_tensor(torch.empty(1000), grads)
        x = torch.randn(4096)
        y = funcol.all_reduce(x, "sum", node)
        z = y * 2
    got = [(r.collective.kind, r.collective.count, r.collective.elem_size, len(r.collective.ranks))
           for r in rec.records if r.collective is not None]
    assert got == [("AllGather", 1000, 2, 16), ("ReduceScatter", 1000, 4, 16), ("AllReduce", 4096, 4, 8)]
    comm = [r for r in rec.records if r.collective is not None]
    # the all-gather writes the output buffer, which is what a consumer waits on
    assert {k for k, _ in comm[0].writes} >= {k for k, _ in comm[0].reads if _ == 32000}
    # the functional all-reduce's output is read by wait_tensor, then by the multiply
    wait = next(r for r in rec.records if r.name == "wait_tensor")
    assert {k for k, _ in wait.reads} & {k for k, _ in comm[2].writes}
    del z


def test_a_custom_op_is_recorded_as_what_its_body_runs(fake_world):
    """Context parallelism's key/value all-gather is a torch.library custom op (opaque to the
    dispatcher): recorded as its two all-gathers, and its backward as two reduce-scatters."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.tensor.experimental._context_parallel._cp_custom_ops import flex_cp_allgather

    from fakegpu.plan.capture import OpRecorder

    cp = dist.new_group([0, 1, 2, 3])
    name = dist._get_process_group_name(cp)
    with FakeTensorMode(), OpRecorder() as rec:
        k = torch.randn(1, 8, 256, 64, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, 8, 256, 64, dtype=torch.bfloat16, requires_grad=True)
        full_k, full_v = flex_cp_allgather(k, v, 2, name)
        assert full_k.shape == (1, 8, 1024, 64)
        (full_k.float().sum() + full_v.float().sum()).backward()
    got = [(r.collective.kind, r.collective.count, r.collective.ranks) for r in rec.records
           if r.collective is not None]
    assert got == [("AllGather", 8 * 256 * 64, (0, 1, 2, 3))] * 2 + [("ReduceScatter", 8 * 256 * 64, (0, 1, 2, 3))] * 2
    assert not any(r.name.startswith("flex_cp_allgather") for r in rec.records)


def test_a_custom_op_whose_body_cannot_run_on_fake_tensors_is_recorded_as_itself(fake_world):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fakegpu.plan.capture import OpRecorder

    @torch.library.custom_op("fakegpu_test::needs_real_data", mutates_args=())
    def needs_real_data(x: torch.Tensor) -> torch.Tensor:
        return x * float(x.sum())           # data-dependent: fails on a fake tensor

    @needs_real_data.register_fake
    def _(x):
        return torch.empty_like(x)

    with FakeTensorMode(), OpRecorder() as rec:
        y = needs_real_data(torch.randn(16))
    assert y.shape == (16,)
    names = [r.name for r in rec.records]
    assert "needs_real_data" in names and "mul" not in names


def test_a_captured_tp_all_reduce_is_exposed_and_a_prefetched_all_gather_is_not(fake_world):
    """A captured step, timed: an all-gather issued before two matmuls and read after them
    hides; an all-reduce read by the next op is exposed for its whole modeled time."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    import torch.distributed._functional_collectives as funcol

    from fakegpu.plan.capture import OpRecorder
    from fakegpu.plan.step import step_times
    from fakegpu.topology.model import default_topology

    tp = dist.new_group([0, 1])
    with FakeTensorMode(), OpRecorder() as rec:
        shard = torch.randn(1 << 16, dtype=torch.bfloat16)
        gathered = torch.empty(1 << 20, dtype=torch.bfloat16)
        a = torch.randn(4096, 4096, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(gathered, shard)
        b = a @ a
        c = b @ a
        d = c + gathered.view(256, 4096).sum()      # reads the all-gather's output
        e = funcol.all_reduce(d, "sum", tp)
        f = e * 2
    topo = default_topology(16)
    st = step_times(rec.records, "h100", topo)
    ag = costmodel.estimate("AllGather", 1 << 16, 2, list(range(16)), 0, 0, topo).seconds
    ar = costmodel.estimate("AllReduce", 4096 * 4096, 2, [0, 1], 0, 0, topo).seconds
    labels = st.communication
    assert labels["0"] == pytest.approx(ag)
    assert st.exposed.get("0", 0.0) == 0.0                      # hidden behind the two matmuls
    group = next(k for k in labels if k != "0")
    assert st.exposed[group] == pytest.approx(ar, rel=1e-9)     # the next op needs it: all exposed
    assert st.step_seconds == pytest.approx(st.timeline.makespan)
    del f
