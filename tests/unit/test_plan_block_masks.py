"""fakegpu.plan.block_masks: causal block masks built block by block, against torch's own."""
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from fakegpu.plan.block_masks import BLOCK, busiest_rank, causal_block_mask, sequence_order
from fakegpu.plan.compute import _block_mask_density


def _blocks(mask) -> list:
    return [mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices]


def test_the_whole_mask_is_torchs_causal_block_mask():
    ours, positions = causal_block_mask(2, 8 * BLOCK)
    theirs = create_block_mask(lambda b, h, q, kv: q >= kv, 2, None, 8 * BLOCK, 8 * BLOCK, device="cpu")
    assert positions is None
    for a, b in zip(_blocks(ours), _blocks(theirs)):
        assert torch.equal(a, b)
    # 8 diagonal blocks partial, 28 below them full, of 64 pairs
    assert _block_mask_density([ours.as_tuple()]) == pytest.approx((8 + 28) / 64)


@pytest.mark.parametrize("cp", [2, 4])
def test_a_head_tail_shard_is_the_mask_torchs_load_balancer_gives_each_rank(cp):
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    seq, batch = 16 * BLOCK, 1
    rearranged = _HeadTailLoadBalancer(seq, cp, torch.device("cpu"))._generate_indices()[0]
    local = seq // cp
    for rank in range(cp):
        queries = rearranged[rank * local:(rank + 1) * local]

        def expected(b, h, q, kv, queries=queries):
            return queries[q] >= rearranged[kv]

        theirs = create_block_mask(expected, batch, None, local, seq, device="cpu")
        ours, positions = causal_block_mask(batch, seq, cp, "headtail", rank=rank)
        assert ours.seq_lengths == (local, seq)
        assert torch.equal(positions[0], queries)
        for a, b in zip(_blocks(ours), _blocks(theirs)):
            assert torch.equal(a, b)
        # head-tail balancing: each rank's local blocks see half the keys, plus their diagonal
        pairs = (local // BLOCK) * (seq // BLOCK)
        assert _block_mask_density([ours.as_tuple()]) == pytest.approx(
            (pairs / 2 + local // BLOCK / 2) / pairs)


def test_without_load_balancing_the_last_rank_works_most_and_is_the_one_planned():
    order = sequence_order(8 * BLOCK, 4, None)
    assert order == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert busiest_rank(order) == 3
    mask, positions = causal_block_mask(1, 8 * BLOCK, 4, None)
    assert int(positions[0, 0]) == 6 * BLOCK
    # queries of blocks 6 and 7 against keys 0..7: 6 + 7 full, 2 partial
    assert int(mask.full_kv_num_blocks.sum()) == 13 and int(mask.kv_num_blocks.sum()) == 2


def test_head_tail_ranks_do_equal_work():
    order = sequence_order(32 * BLOCK, 4, "headtail")
    assert order[0] == [0, 1, 2, 3, 28, 29, 30, 31]
    masks = [causal_block_mask(1, 32 * BLOCK, 4, "headtail", rank=r)[0] for r in range(4)]
    work = {int(m.full_kv_num_blocks.sum()) + int(m.kv_num_blocks.sum()) for m in masks}
    assert len(work) == 1


@pytest.mark.parametrize("seq, cp, balancer, message", [
    (1000, 1, None, "multiple of the flex attention block"),
    (3 * BLOCK, 2, "headtail", "2 x 2"),
    (3 * BLOCK, 2, None, "multiple of 2"),
    (8 * BLOCK, 2, "ptrr", "not modeled"),
])
def test_shards_that_do_not_fall_on_blocks_are_refused_by_name(seq, cp, balancer, message):
    with pytest.raises(ValueError, match=message):
        sequence_order(seq, cp, balancer)
