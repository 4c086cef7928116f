"""fakegpu/plan/host_values: the values a program reads to the host from fake tensors (a
balanced router's token counts), through the real OpRecorder on fake tensors.  No processes: a
fake process group in this one."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from fakegpu.plan.capture import HostValueUnknown, OpRecorder  # noqa: E402


def _route(batch, seq, experts, k):
    """TorchTitan's MoE routing: top-k of the router's scores, a one-hot routing map, the
    tokens per expert."""
    scores = torch.randn(batch, seq, experts, device="cuda" if torch.cuda.is_available() else "cpu")
    _, ids = torch.topk(scores, k, dim=-1)
    routing = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, ids, True)
    return ids, routing.sum(dim=(0, 1))


def test_a_balanced_router_sends_every_expert_the_same_number_of_tokens():
    with FakeTensorMode(), OpRecorder():
        ids, counts = _route(4, 4096, 64, 6)
        per_expert = counts.tolist()
        # each token's k experts are distinct
        first = ids[0, 0].tolist()
        # grouped by expert-parallel rank, as the all-to-all's split sizes are
        splits = counts.view(8, -1).sum(dim=1).to("cpu").tolist()
    assert per_expert == [4 * 4096 * 6 // 64] * 64
    assert len(set(first)) == 6
    assert splits == [4 * 4096 * 6 // 8] * 8


def test_counts_that_do_not_divide_evenly_differ_by_at_most_one():
    with FakeTensorMode(), OpRecorder():
        _, counts = _route(1, 10, 4, 1)
        per_expert = counts.tolist()
    assert sorted(per_expert) == [2, 2, 3, 3] and sum(per_expert) == 10


def test_a_value_computed_from_activations_is_refused_with_the_op_named():
    with FakeTensorMode(), OpRecorder():
        x = torch.randn(16, 16)
        with pytest.raises(HostValueUnknown, match=r"_local_scalar_dense.*\.item\(\)"):
            x.sum().item()
        # nor does an integer computed from an activation get a value
        with pytest.raises(HostValueUnknown):
            (x > 0).sum().item()


def test_constants_have_their_values():
    with FakeTensorMode(), OpRecorder():
        assert torch.arange(5).cumsum(0).tolist() == [0, 1, 3, 6, 10]
        assert int(torch.full((3,), 7).sum()) == 21


@pytest.fixture
def fake_world():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_collectives_deliver_what_ranks_holding_the_same_values_would(fake_world):
    import torch.distributed._functional_collectives as funcol

    with FakeTensorMode(), OpRecorder():
        counts = torch.arange(8)
        # all-to-all: rank 0 gets chunk 0 from each of the 4 ranks
        exchanged = funcol.all_to_all_single(counts, None, None, group=fake_world)
        assert funcol.wait_tensor(exchanged).tolist() == [0, 1] * 4
        summed = funcol.all_reduce(counts, "sum", group=fake_world)
        assert funcol.wait_tensor(summed).tolist() == [4 * i for i in range(8)]
        gathered = funcol.all_gather_tensor(counts[:2], 0, group=fake_world)
        assert funcol.wait_tensor(gathered).tolist() == [0, 1] * 4
