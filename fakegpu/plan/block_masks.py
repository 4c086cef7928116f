"""Causal flex-attention block masks built block by block, whole or as one context-parallel rank's shard.

``torch.nn.attention.flex_attention.create_block_mask`` evaluates the mask on every (query, key)
pair: a sequence of 32k tokens is a 1 GiB boolean matrix, 256k tokens 64 GiB, and torch's
context-parallel sharding (``_create_cp_block_mask``) also compiles it.  What the planner needs
of a mask is its blocks: which (query block, key block) pairs a kernel computes, fully or
partially, which is what prices flex attention (fakegpu.plan.compute's ``work_fraction``).
For the causal mask that is known per block: a key block before the query block is full, the
diagonal block partial, later ones empty.

Context parallelism (TorchTitan's ``cp_shard``) gives each rank a slice of the sequence, after
an optional load-balancing rearrangement; the keys and values are all-gathered in that same
rearranged order.  ``headtail`` (TorchTitan's default) splits the sequence into 2 x cp chunks
and gives rank r chunks r and 2cp - 1 - r, so every rank does the same causal work.
"""
from __future__ import annotations

import bisect
from typing import Optional

BLOCK = 128     # torch's default sparse block size (_DEFAULT_SPARSE_BLOCK_SIZE)


def sequence_order(seq_len: int, cp: int, load_balancer: Optional[str]) -> list[list[int]]:
    """For each CP rank, the global token blocks (indices of BLOCK-token blocks) it holds, in
    its local order.  Raises ValueError where the shard does not fall on block boundaries."""
    if seq_len % BLOCK:
        raise ValueError(f"sequence length {seq_len} is not a multiple of the flex attention block ({BLOCK})")
    blocks = seq_len // BLOCK
    if cp == 1:
        return [list(range(blocks))]
    balancer = (load_balancer or "").lower() or None
    if balancer == "headtail":
        if blocks % (2 * cp):
            raise ValueError(f"context parallelism {cp} with head-tail load balancing needs the sequence "
                             f"({seq_len}) to be a multiple of 2 x {cp} x {BLOCK}")
        return _shards(blocks, cp, balancer)
    if balancer is None:
        if blocks % cp:
            raise ValueError(f"context parallelism {cp} needs the sequence ({seq_len}) to be a multiple "
                             f"of {cp} x {BLOCK}")
        return _shards(blocks, cp, balancer)
    raise ValueError(f"context-parallel load balancer {load_balancer!r} is not modeled "
                     "(modeled: 'headtail', or none)")


def _shards(units: int, cp: int, balancer: Optional[str]) -> list[list[int]]:
    """For each CP rank, the indices of the ``units`` (tokens or blocks) it holds, in its local
    order: with ``headtail``, chunks r and 2cp - 1 - r of 2 x cp equal chunks; with none, chunk
    r of cp.  ``units`` divides into those chunks (the callers check, with their own words)."""
    if balancer == "headtail":
        chunk = units // (2 * cp)
        return [list(range(r * chunk, (r + 1) * chunk)) + list(range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk))
                for r in range(cp)]
    chunk = units // cp
    return [list(range(r * chunk, (r + 1) * chunk)) for r in range(cp)]


def _block_counts(query_blocks: list[int], key_blocks: list[int]) -> tuple[int, int]:
    """(partial, full) computed block pairs of the causal mask."""
    partial = full = 0
    keys = sorted(key_blocks)
    for q in query_blocks:
        before = bisect.bisect_left(keys, q)
        full += before
        partial += 1 if before < len(keys) and keys[before] == q else 0
    return partial, full


def busiest_rank(order: list[list[int]]) -> int:
    """The CP rank with the most causal work (the others wait for it at every all-gather)."""
    keys = [b for rank in order for b in rank]
    work = [sum(_block_counts(rank, keys)) for rank in order]
    return max(range(len(order)), key=lambda r: work[r])


def causal_block_mask(batch: int, seq_len: int, cp: int = 1, load_balancer: Optional[str] = "headtail",
                      rank: Optional[int] = None):
    """The causal BlockMask one CP rank's flex attention runs with (the whole mask when
    ``cp`` is 1): its local queries against the all-gathered keys.  ``rank``: which CP rank
    (default :func:`busiest_rank`).  Returns ``(block_mask, positions)``: ``positions`` are the
    global token positions of the rank's local tokens, (batch, seq_len // cp), what RoPE is
    given under context parallelism; None when ``cp`` is 1."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    order = sequence_order(seq_len, cp, load_balancer)
    rank = busiest_rank(order) if rank is None else rank
    query_blocks = order[rank]
    key_blocks = [b for each in order for b in each]
    q = torch.tensor(query_blocks).view(-1, 1)
    k = torch.tensor(key_blocks).view(1, -1)
    full = q > k
    partial = q == k

    def indices(dense):
        counts = dense.sum(-1).to(torch.int32)
        # the computed blocks' key indices first (a stable sort of "computed" descending)
        order_ = torch.argsort((~dense).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts.view(1, 1, -1).expand(batch, 1, -1).contiguous(), \
            order_.view(1, 1, *order_.shape).expand(batch, 1, *order_.shape).contiguous()

    kv_num, kv_idx = indices(partial)
    full_num, full_idx = indices(full)
    token_of = torch.tensor([b * BLOCK + i for b in key_blocks for i in range(BLOCK)])  # gathered -> global
    local = torch.tensor([b * BLOCK + i for b in query_blocks for i in range(BLOCK)])   # local -> global

    def mask_mod(b, h, q_idx, kv_idx):
        return local[q_idx] >= token_of[kv_idx]

    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(len(query_blocks) * BLOCK, seq_len))
    positions = local.view(1, -1).expand(batch, -1).contiguous() if cp > 1 else None
    return mask, positions


def ring_positions(batch: int, seq_len: int, cp: int, load_balancer: Optional[str] = "headtail",
                   rank: int = 0):
    """The global token positions CP rank ``rank`` holds under SDPA's ring attention, as
    TorchTitan's ``cp_shard`` shards them (:func:`_shards`, token by token: SDPA has no
    blocks).  (batch, seq_len // cp), for RoPE."""
    import torch

    balancer = (load_balancer or "").lower() or None
    if balancer not in (None, "headtail"):
        raise NotImplementedError(f"context_parallel_load_balancer={load_balancer!r} with SDPA: "
                                  "modeled: 'headtail', or none")
    if seq_len % (2 * cp if balancer else cp):
        raise ValueError(f"seq_len {seq_len} does not split into {2 * cp if balancer else cp} equal "
                         f"context-parallel chunks")
    local = torch.tensor(_shards(seq_len, cp, balancer)[rank])
    return local.view(1, -1).expand(batch, -1).contiguous()
