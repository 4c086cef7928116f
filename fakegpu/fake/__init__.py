"""Fake worlds: one process plays one rank of a large logical job (docs/fake-worlds.md).

- ``contract``: the launch contract (NGPU, FAKE_PP_RANK, RANK/WORLD_SIZE, FAKEGPU_DIST_MODE);
- ``semantics``: SPMD-symmetric local completion of collectives on numpy arrays;
- ``world``: replica tiling and whole-world accounting into a ClusterReport;
- ``events`` / ``build_report``: the event format other front ends write, and its report;
- ``process_group``: the ``fakegpu_fake`` torch.distributed backend;
- ``memory``: allocator captures at the four capture points, and their comparison.

Submodules are imported on use, so ``import fakegpu.fake`` does not import torch.
"""
from __future__ import annotations

from fakegpu._lazy import lazy_exports

_EXPORTS = {
    "LaunchContract": "fakegpu.fake.contract",
    "LaunchContractError": "fakegpu.fake.contract",
    "resolve": "fakegpu.fake.contract",
    "WorldAccountant": "fakegpu.fake.world",
    "replica_groups": "fakegpu.fake.world",
    "FakeWorldProcessGroup": "fakegpu.fake.process_group",
    "init_process_group": "fakegpu.fake.process_group",
    "register": "fakegpu.fake.process_group",
    "capture": "fakegpu.fake.memory",
    "CAPTURE_POINTS": "fakegpu.fake.memory",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
