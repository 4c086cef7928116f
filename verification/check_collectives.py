"""Every collective of the torch backend against values computed here (torchrun script).

    torchrun --nproc-per-node 4 verification/check_collectives.py --backend fakegpu

Inputs are functions of the rank, so each rank knows what every other rank contributed and
can check its results exactly.  Exits non-zero with a message naming the first mismatch.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _value(rank: int, n: int, dtype=torch.float32, offset: float = 0.0) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) * 0.5 + rank + 1 + offset).to(dtype)


class Checker:
    def __init__(self):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.failures: list[str] = []
        self.checked = 0

    def expect(self, what: str, got: torch.Tensor, want: torch.Tensor, *, exact=True) -> None:
        self.checked += 1
        ok = torch.equal(got, want) if exact else torch.allclose(got.double(), want.double(),
                                                                 rtol=1e-6, atol=1e-6)
        if not ok:
            self.failures.append(f"rank {self.rank}: {what}: got {got.tolist()[:8]} want {want.tolist()[:8]}")

    def run(self) -> None:
        r, w = self.rank, self.world
        ranks = range(w)
        # all_reduce with every op
        sums = sum(_value(i, 5) for i in ranks)
        for op, want, exact in (
            (dist.ReduceOp.SUM, sums, True),
            (dist.ReduceOp.AVG, sums / w, False),
            (dist.ReduceOp.MAX, _value(w - 1, 5), True),
            (dist.ReduceOp.MIN, _value(0, 5), True),
            (dist.ReduceOp.PRODUCT, torch.stack([_value(i, 5) for i in ranks]).prod(0), False),
            (dist._make_nccl_premul_sum(0.25), sums * 0.25, False),
        ):
            t = _value(r, 5)
            dist.all_reduce(t, op=op)
            self.expect(f"all_reduce {op}", t, want, exact=exact)
        for dtype in (torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.uint8):
            t = _value(r, 4, dtype)
            dist.all_reduce(t)
            want = sum(_value(i, 4, dtype).to(torch.float64) for i in ranks).to(dtype) if dtype in (
                torch.float64, torch.int32, torch.int64, torch.uint8) else None
            if want is not None:
                self.expect(f"all_reduce {dtype}", t, want, exact=True)
            else:
                self.expect(f"all_reduce {dtype}", t.double(),
                            sum(_value(i, 4, dtype).double() for i in ranks).to(dtype).double(), exact=False)
        flags = torch.tensor([r == 0, True, False])
        dist.all_reduce(flags)  # bool SUM is "any"
        self.expect("all_reduce bool", flags, torch.tensor([True, True, False]))
        # non-contiguous tensor
        base = torch.stack([_value(r, 4), _value(r, 4, offset=10)], dim=1)  # 4x2
        column = base[:, 0]
        dist.all_reduce(column)
        self.expect("all_reduce non-contiguous", base[:, 0], sums[:4])
        self.expect("all_reduce non-contiguous untouched", base[:, 1], _value(r, 4, offset=10))
        # complex
        c = torch.complex(_value(r, 3), _value(r, 3, offset=1))
        dist.all_reduce(c)
        self.expect("all_reduce complex", c, sum(torch.complex(_value(i, 3), _value(i, 3, offset=1)) for i in ranks))
        # async with future
        t = _value(r, 6)
        work = dist.all_reduce(t, async_op=True)
        value = work.get_future().wait()
        self.expect("all_reduce async future", value[0], sum(_value(i, 6) for i in ranks))
        # coalesced
        ts = [_value(r, 3), _value(r, 7)]
        dist.all_reduce_coalesced(ts)
        self.expect("all_reduce_coalesced 0", ts[0], sum(_value(i, 3) for i in ranks))
        self.expect("all_reduce_coalesced 1", ts[1], sum(_value(i, 7) for i in ranks))
        # broadcast / reduce
        root = w - 1
        t = _value(r, 5)
        dist.broadcast(t, src=root)
        self.expect("broadcast", t, _value(root, 5))
        t = _value(r, 5)
        dist.reduce(t, dst=root, op=dist.ReduceOp.SUM)
        if r == root:
            self.expect("reduce", t, sums)
        # all_gather list / into tensor / uneven
        outs = [torch.empty(3) for _ in ranks]
        dist.all_gather(outs, _value(r, 3))
        for i in ranks:
            self.expect(f"all_gather[{i}]", outs[i], _value(i, 3))
        out = torch.empty(w * 3)
        dist.all_gather_into_tensor(out, _value(r, 3))
        self.expect("all_gather_into_tensor", out, torch.cat([_value(i, 3) for i in ranks]))
        outs = [torch.empty(i + 1) for i in ranks]
        dist.all_gather(outs, _value(r, r + 1))
        for i in ranks:
            self.expect(f"all_gather uneven[{i}]", outs[i], _value(i, i + 1))
        # reduce_scatter list / tensor
        out = torch.empty(2)
        dist.reduce_scatter(out, [_value(r, 2, offset=10 * j) for j in ranks])
        self.expect("reduce_scatter", out, sum(_value(i, 2, offset=10 * r) for i in ranks))
        out = torch.empty(2)
        dist.reduce_scatter_tensor(out, torch.cat([_value(r, 2, offset=10 * j) for j in ranks]))
        self.expect("reduce_scatter_tensor", out, sum(_value(i, 2, offset=10 * r) for i in ranks))
        out = torch.empty(2)
        dist.reduce_scatter_tensor(out, torch.cat([_value(r, 2, offset=10 * j) for j in ranks]),
                                   op=dist.ReduceOp.AVG)
        self.expect("reduce_scatter_tensor avg", out, sum(_value(i, 2, offset=10 * r) for i in ranks) / w,
                    exact=False)
        # all_to_all_single even and uneven, all_to_all list
        inp = torch.cat([_value(r, 2, offset=100 * j) for j in ranks])
        out = torch.empty(2 * w)
        dist.all_to_all_single(out, inp)
        self.expect("all_to_all_single", out, torch.cat([_value(i, 2, offset=100 * r) for i in ranks]))
        # rank i sends (i + j + 1) rows to rank j
        in_splits = [r + j + 1 for j in ranks]
        out_splits = [i + r + 1 for i in ranks]
        inp = torch.cat([_value(r, (r + j + 1) * 2, offset=100 * j).view(-1, 2) for j in ranks])
        out = torch.empty(sum(out_splits), 2)
        dist.all_to_all_single(out, inp, out_splits, in_splits)
        want = torch.cat([_value(i, (i + r + 1) * 2, offset=100 * r).view(-1, 2) for i in ranks])
        self.expect("all_to_all_single uneven", out, want)
        outs = [torch.empty(i + 1) for i in ranks]
        dist.all_to_all(outs, [_value(r, r + 1, offset=j) for j in ranks])
        for i in ranks:
            self.expect(f"all_to_all[{i}]", outs[i], _value(i, i + 1, offset=r))
        # gather / scatter
        gathered = [torch.empty(3) for _ in ranks] if r == root else None
        dist.gather(_value(r, 3), gathered, dst=root)
        if r == root:
            for i in ranks:
                self.expect(f"gather[{i}]", gathered[i], _value(i, 3))
        out = torch.empty(3)
        dist.scatter(out, [_value(root, 3, offset=j) for j in ranks] if r == root else None, src=root)
        self.expect("scatter", out, _value(root, 3, offset=r))
        # point to point: a ring with batch_isend_irecv, then blocking send/recv pairs
        right, left = (r + 1) % w, (r - 1) % w
        got = torch.empty(4)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, _value(r, 4), right),
                                        dist.P2POp(dist.irecv, got, left)])
        for work in works:
            work.wait()
        self.expect("batch_isend_irecv ring", got, _value(left, 4))
        if r % 2 == 0 and r + 1 < w:
            dist.send(_value(r, 5), r + 1)
            back = torch.empty(5)
            dist.recv(back, r + 1)
            self.expect("send/recv", back, _value(r + 1, 5))
        elif r % 2 == 1:
            got = torch.empty(5)
            dist.recv(got, r - 1)
            self.expect("recv", got, _value(r - 1, 5))
            dist.send(_value(r, 5), r - 1)
        # objects and barrier
        objs = [None] * w
        dist.all_gather_object(objs, {"rank": r, "name": f"r{r}"})
        self.expect("all_gather_object", torch.tensor([o["rank"] for o in objs]), torch.arange(w))
        lst = [f"hello {r}"]
        dist.broadcast_object_list(lst, src=root)
        if lst[0] != f"hello {root}":
            self.failures.append(f"rank {r}: broadcast_object_list got {lst!r}")
        dist.barrier()
        # subgroups: even and odd ranks
        evens, odds = list(range(0, w, 2)), list(range(1, w, 2))
        g_even = dist.new_group(evens, group_desc="evens") if _supports_group_desc() else dist.new_group(evens)
        g_odd = dist.new_group(odds) if odds else None
        mine = evens if r % 2 == 0 else odds
        group = g_even if r % 2 == 0 else g_odd
        t = _value(r, 3)
        dist.all_reduce(t, group=group)
        self.expect("subgroup all_reduce", t, sum(_value(i, 3) for i in mine))
        dist.barrier()
        self.run_coalesced_and_functional()
        if dist.get_backend() == "fakegpu":
            self.run_split_group()
            self.run_mismatch_is_reported()

    def run_mismatch_is_reported(self) -> None:
        """Ranks that disagree on a collective get an error naming the group, and the group
        stays usable afterwards."""
        r, ranks = self.rank, range(self.world)
        t = _value(r, 4 + (r == 0))  # rank 0 passes one element more
        try:
            dist.all_reduce(t)
        except Exception as exc:  # DistBackendError
            text = str(exc)
            if "allreduce on process group 'default_pg'" not in text:
                self.failures.append(f"rank {r}: mismatch error lacks the group: {text}")
        else:
            self.failures.append(f"rank {r}: all_reduce with mismatched counts did not fail")
        t = _value(r, 4)
        dist.all_reduce(t)
        self.expect("all_reduce after a failed one", t, sum(_value(i, 4) for i in ranks))

    def run_coalesced_and_functional(self) -> None:
        """The paths DTensor / FSDP2 use: coalescing manager and functional collectives
        (the latter reach the group from C++ through the pybind trampoline)."""
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.distributed_c10d import _coalescing_manager

        r, w, ranks = self.rank, self.world, range(self.world)
        outs = [torch.empty(w * 2), torch.empty(w * 3)]
        with _coalescing_manager(async_ops=True) as cm:
            dist.all_gather_into_tensor(outs[0], _value(r, 2))
            dist.all_gather_into_tensor(outs[1], _value(r, 3, offset=5))
        cm.wait()
        self.expect("coalesced all_gather 0", outs[0], torch.cat([_value(i, 2) for i in ranks]))
        self.expect("coalesced all_gather 1", outs[1], torch.cat([_value(i, 3, offset=5) for i in ranks]))
        outs = [torch.empty(2), torch.empty(1)]
        with _coalescing_manager(async_ops=True) as cm:
            dist.reduce_scatter_tensor(outs[0], torch.cat([_value(r, 2, offset=j) for j in ranks]))
            dist.reduce_scatter_tensor(outs[1], torch.cat([_value(r, 1, offset=3 * j) for j in ranks]))
        cm.wait()
        self.expect("coalesced reduce_scatter 0", outs[0], sum(_value(i, 2, offset=r) for i in ranks))
        self.expect("coalesced reduce_scatter 1", outs[1], sum(_value(i, 1, offset=3 * r) for i in ranks))
        group = dist.group.WORLD
        got = funcol.all_reduce(_value(r, 4), "sum", group)
        self.expect("funcol all_reduce", funcol.wait_tensor(got), sum(_value(i, 4) for i in ranks))
        got = funcol.all_gather_tensor(_value(r, 2), 0, group)
        self.expect("funcol all_gather_tensor", funcol.wait_tensor(got), torch.cat([_value(i, 2) for i in ranks]))
        got = funcol.reduce_scatter_tensor(torch.cat([_value(r, 2, offset=j) for j in ranks]), "sum", 0, group)
        self.expect("funcol reduce_scatter_tensor", funcol.wait_tensor(got), sum(_value(i, 2, offset=r) for i in ranks))
        got = funcol.all_gather_into_tensor_coalesced([_value(r, 1), _value(r, 2)], group)
        self.expect("funcol all_gather coalesced", funcol.wait_tensor(got[1]), torch.cat([_value(i, 2) for i in ranks]))
        got = funcol.reduce_scatter_tensor_coalesced(
            [torch.cat([_value(r, 1, offset=j) for j in ranks])], "sum", [0], group)
        self.expect("funcol reduce_scatter coalesced", funcol.wait_tensor(got[0]), sum(_value(i, 1, offset=r) for i in ranks))

    def run_split_group(self) -> None:
        """torch's split_group needs an accelerator-bound default group; fakegpu's does it on
        CPU through ncclCommSplit."""
        import fakegpu.torch as ft

        r, w = self.rank, self.world
        halves = [list(range(0, w // 2)), list(range(w // 2, w))]
        child = ft.split_group(split_ranks=halves, group_desc="halves")
        mine = halves[0] if r < w // 2 else halves[1]
        if child is None or child.size() != len(mine):
            self.failures.append(f"rank {r}: split_group gave {child!r} for {mine}")
            return
        t = _value(r, 3)
        dist.all_reduce(t, group=child)
        self.expect("split_group all_reduce", t, sum(_value(i, 3) for i in mine))
        self.expect("split_group ranks", torch.tensor(dist.get_process_group_ranks(child)), torch.tensor(mine))


def _supports_group_desc() -> bool:
    import inspect

    return "group_desc" in inspect.signature(dist.new_group).parameters


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="fakegpu")
    parser.add_argument("--out", help="accepted for run_case.py; nothing is written")
    args = parser.parse_args()
    # torch 2.13 renamed several functional collectives; the old names still work back to 2.5.
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.backend == "fakegpu" and not hasattr(dist.Backend, "FAKEGPU"):
        import fakegpu.torch  # noqa: F401 - registers the backend (fgpu's autoload already did)
    dist.init_process_group(args.backend)
    checker = Checker()
    try:
        checker.run()
    finally:
        status = torch.tensor([len(checker.failures)])
        dist.all_reduce(status)
        dist.destroy_process_group()
    for line in checker.failures:
        print("FAIL", line, file=sys.stderr)
    if checker.rank == 0:
        print(f"check_collectives[{args.backend}]: {checker.checked} checks per rank, "
              f"{int(status.item())} failures in total")
    return 1 if status.item() else 0


if __name__ == "__main__":
    sys.exit(main())
