"""fakegpu.torch.group_base: the one ProcessGroup surface both torch backends share.

In-process: the real backend's groups are built without a communicator (nothing below the
argument checks runs), the fake backend's inside a fake world of 16 logical ranks.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


@pytest.fixture
def fake_world():
    from fakegpu.fake import runtime
    from fakegpu.fake.contract import resolve

    runtime.reset()
    world = runtime.get_or_create(resolve({"NGPU": "16"}))
    try:
        yield world
    finally:
        world.finished = True
        runtime.reset()


def _fake_group(world, rank=1, size=4, first=4, name="7", desc="mesh_tp"):
    from fakegpu.fake.process_group import FakeWorldProcessGroup

    return FakeWorldProcessGroup(dist.HashStore(), rank, size, global_ranks=range(first, first + size),
                                 group_name=name, group_desc=desc, world=world)


def _real_group(rank=1, size=4, **names):
    from fakegpu.torch import FakeGpuProcessGroup

    # No store: a group given both a name and a description by torch's setters would connect.
    return FakeGpuProcessGroup(None, rank, size, **names)


def test_both_backends_are_one_base_with_one_identity(fake_world):
    from fakegpu.fake.process_group import FakeWorldProcessGroup
    from fakegpu.torch import FakeGpuProcessGroup
    from fakegpu.torch.group_base import GroupBase

    assert issubclass(FakeGpuProcessGroup, GroupBase) and issubclass(FakeWorldProcessGroup, GroupBase)
    # The torch-facing spellings live once, in the base, not in either backend.
    for name in ("getGroupName", "setGroupDesc", "comm_name", "all_gather_single_coalesced",
                 "reduce_scatter_tensor_coalesced", "alltoall_base", "send", "recv", "allgather_coalesced",
                 "comm_split_count"):
        assert name not in FakeWorldProcessGroup.__dict__, name
    real, fake = _real_group(), _fake_group(fake_world, desc="")
    assert (real.getBackendName(), fake.getBackendName()) == ("fakegpu", "fakegpu_fake")
    assert fake.comm_name == "group_7"
    assert real.comm_name == "fakegpu_group"
    fake.setGroupDesc("mesh_dp")
    real.setGroupName("3")
    assert (fake.comm_name, real.comm_name) == ("mesh_dp", "group_3")
    assert (fake.getGroupDesc(), real.getGroupName()) == ("mesh_dp", "3")
    assert _real_group(group_name="3", group_desc="undefined").comm_name == "group_3"


@pytest.mark.parametrize("make", ["real", "fake"])
def test_shape_and_peer_errors_are_the_same_words(make, fake_world):
    pg = _real_group() if make == "real" else _fake_group(fake_world)
    prefix = pg.getBackendName()
    small, big = torch.zeros(3), torch.zeros(10)
    with pytest.raises(ValueError, match=rf"^{prefix} all_gather_single: output has 10 elements, expected 4 x 3$"):
        pg.all_gather_single(big, small)
    with pytest.raises(ValueError, match=rf"^{prefix} reduce_scatter_tensor_coalesced: input has 3 elements, "
                                         r"expected 4 x 3$"):
        pg.reduce_scatter_tensor_coalesced([small], [small])
    with pytest.raises(ValueError, match=rf"^{prefix} allgather_into_tensor_coalesced: 2 outputs for 1 inputs$"):
        pg.allgather_into_tensor_coalesced([big, big], [small])
    with pytest.raises(ValueError, match=rf"^{prefix} allgather: an output list has 2 tensors, the group has 4"):
        pg.allgather([[small, small]], [small])
    with pytest.raises(ValueError, match=rf"^{prefix} alltoall: need 4 input and 4 output tensors, got 1 and 4$"):
        pg.alltoall([small] * 4, [small])
    with pytest.raises(ValueError, match=rf"^{prefix} send: peer 1 is not another rank of this 4-rank group"):
        pg.send([small], 1)
    with pytest.raises(ValueError, match=rf"^{prefix} recv: expected one tensor, got 2$"):
        pg.recv([small, small], 0)
    with pytest.raises(ValueError, match=rf"^{prefix} allgather_coalesced: 1 output lists, expected one per rank"):
        pg.allgather_coalesced([[small]], [small])


def test_fake_backend_translates_reduce_ops_as_the_real_one(fake_world):
    """Ops NCCL lacks are refused with the real backend's words; bitwise ops on integers,
    which a fake world can still answer (identical operands), are kept."""
    pg = _fake_group(fake_world)
    R = dist.ReduceOp
    for op, tensor, match in ((R.MAX, torch.zeros(2, dtype=torch.complex64), "not defined for complex"),
                              (R.BAND, torch.zeros(2), "BAND is not supported by NCCL")):
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        with pytest.raises(ValueError, match=match):
            pg.allreduce([tensor], opts)
    values = torch.tensor([5, 6, 7], dtype=torch.int32)
    for op, expected in ((R.BOR, [5, 6, 7]), (R.BAND, [5, 6, 7]), (R.BXOR, [0, 0, 0]), (R.SUM, [20, 24, 28])):
        t = values.clone()
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        pg.allreduce([t], opts).wait()
        assert t.tolist() == expected, op
    t = torch.tensor([1.0, 2.0])
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist._make_nccl_premul_sum(0.5)
    pg.allreduce([t], opts).wait()
    assert t.tolist() == [2.0, 4.0]  # four members each holding t, scaled by 0.5


def test_fake_backend_gains_the_shared_layouts(fake_world):
    """allgather_coalesced (the transposed list layout) comes from the base, and the fake
    world answers it: every member holds what this rank holds."""
    pg = _fake_group(fake_world)
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3, 4, 5], dtype=torch.int64)
    outputs = [[torch.zeros(2), torch.zeros(3, dtype=torch.int64)] for _ in range(4)]
    work = pg.allgather_coalesced(outputs, [a, b])
    assert work.wait() and work.is_completed()
    for per_rank in outputs:
        assert per_rank[0].tolist() == [1.0, 2.0] and per_rank[1].tolist() == [3, 4, 5]
    out = torch.zeros(2)
    pg.reduce_scatter_single(out, torch.arange(8, dtype=torch.float32)).wait()
    assert out.tolist() == [8.0, 12.0]  # rank 1's share [2, 3] from four identical members


@pytest.mark.parametrize("make", ["real", "fake"])
def test_split_names_follow_one_rule(make, fake_world):
    pg = _real_group(group_name="g", group_desc="mesh") if make == "real" else \
        _fake_group(fake_world, name="g", desc="mesh")
    ranks, name, desc = pg._next_split([3, 1], None, None)
    assert (ranks, name, desc, pg.comm_split_count()) == ([1, 3], "g_split1_1_3", "mesh:split:1", 1)
    assert pg._next_split([0], "mine", "d")[1:] == ("mine", "d")
    assert pg.comm_split_count() == 2
