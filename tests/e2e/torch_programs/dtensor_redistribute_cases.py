"""DTensor redistribution between placements, written as a PyTorch test file would be
(``DTensorTestBase`` from the torch wheel, four ranks on CPU), for the suite driver's
``--suite file`` mode: tests/e2e/test_torch_suites.py runs it with gloo groups and with fakegpu
groups. Every check is exact: the tensors hold small integers, so any summation order gives
the same bits, and each rank compares its local shard with its slice of the full tensor that
every rank builds the same way.
"""
from __future__ import annotations

import itertools

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.testing._internal.common_utils import run_tests
from torch.testing._internal.distributed._tensor.common_dtensor import DTensorTestBase, with_comms

# rows x cols of the global tensors: even, and uneven across 4 ranks (torch.chunk's split)
SHAPES = [(8, 4), (9, 5), (3, 10)]


def full_tensor(shape, seed: int) -> torch.Tensor:
    """The same integer-valued float tensor on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-50, 50, shape, generator=generator).float()


def local_part(full: torch.Tensor, placements, coordinate) -> torch.Tensor:
    """What a rank at ``coordinate`` on the mesh holds of ``full`` (Shard and Replicate only)."""
    part = full
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            size = 2 if len(coordinate) == 2 else 4
            chunks = torch.chunk(part, size, dim=placement.dim)
            index = coordinate[mesh_dim]
            part = chunks[index] if index < len(chunks) else part.narrow(placement.dim, 0, 0)
    return part


class DTensorRedistributeCases(DTensorTestBase):
    @property
    def world_size(self) -> int:
        return 4

    def check(self, dtensor: DTensor, full: torch.Tensor, placements, coordinate) -> None:
        self.assertEqual(tuple(dtensor.placements), tuple(placements))
        self.assertEqual(dtensor.to_local(), local_part(full, placements, coordinate), atol=0, rtol=0)
        self.assertEqual(dtensor.full_tensor(), full, atol=0, rtol=0)

    @with_comms
    def test_every_transition_on_a_1d_mesh(self):
        mesh = init_device_mesh("cpu", (4,))
        coordinate = mesh.get_coordinate()
        placements = [Shard(0), Shard(1), Replicate()]
        for seed, (shape, (src, dst)) in enumerate(itertools.product(SHAPES, itertools.product(placements, repeat=2))):
            full = full_tensor(shape, seed)
            moved = distribute_tensor(full, mesh, [src]).redistribute(mesh, [dst])
            self.check(moved, full, [dst], coordinate)

    # One method for the three short 1-D cases: each test method is four fresh processes per
    # backend, most of the driver's time.
    @with_comms
    def test_partial_average_and_backward_on_a_1d_mesh(self):
        mesh = init_device_mesh("cpu", (4,))
        coordinate = mesh.get_coordinate()
        # Partial (sum) to Replicate and to Shard: each rank's own addend; the sum is the reference
        for seed, shape in enumerate(SHAPES):
            addends = [full_tensor(shape, 100 * seed + r) for r in range(4)]
            total = sum(addends[1:], addends[0].clone())
            for dst in (Replicate(), Shard(0), Shard(1)):
                partial = DTensor.from_local(addends[self.rank].clone(), mesh, [Partial()])
                self.check(partial.redistribute(mesh, [dst]), total, [dst], coordinate)
        # Partial("avg") to Replicate
        local = torch.full((6, 2), float(4 * (self.rank + 1)))
        out = DTensor.from_local(local, mesh, [Partial("avg")]).redistribute(mesh, [Replicate()])
        self.assertEqual(out.to_local(), torch.full((6, 2), 10.0), atol=0, rtol=0)
        # backward through Shard -> Replicate: d/dx sum(x^2) = 2x, handed back as a shard
        full = full_tensor((9, 3), 7)
        sharded = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
        replicated = sharded.redistribute(mesh, [Replicate()])
        (replicated * replicated).sum().backward()
        self.check(sharded.grad, 2 * full, [Shard(0)], coordinate)

    @with_comms
    def test_transitions_on_a_2d_mesh(self):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        coordinate = mesh.get_coordinate()
        layouts = [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Replicate(), Shard(0)],
                   [Shard(0), Replicate()], [Replicate(), Replicate()], [Shard(0), Shard(0)]]
        for seed, (shape, (src, dst)) in enumerate(itertools.product(SHAPES[:2], itertools.product(layouts, repeat=2))):
            full = full_tensor(shape, 1000 + seed)
            moved = distribute_tensor(full, mesh, src).redistribute(mesh, dst)
            self.check(moved, full, dst, coordinate)


if __name__ == "__main__":
    run_tests()
