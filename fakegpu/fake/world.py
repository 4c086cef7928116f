"""Whole-world accounting for a fake world.

A fake process sees only its own communicators.  Under the SPMD assumption every other
rank runs the same program, so each communicator this rank uses has *replicas*: the groups
of the same shape the other ranks use (this rank's tensor-parallel group, and the 127
other TP groups of a 1024-rank world).  :func:`replica_groups` infers them and
:class:`WorldAccountant` feeds the cluster report one OpRecord per replica, so the report's
link, node-pair and per-rank tables estimate the traffic of the *whole* logical world on
the cluster topology.

Tiling rule: translate the group (keeping its shape) to the lowest rank of the domain
not yet covered, again and again; if every translate fits and nothing overlaps, those
translates are the replicas.  For a group that is an arithmetic progression (start b,
stride s, n members) this yields exactly the groups {b' + k*s}; it also tiles groups of
several mesh axes (e.g. {0, 1, 4, 5}).  If the group does not tile, it is accounted alone
and the report's metadata says so.

Speed: estimates are cached per (operation, size, group *shape* on the topology); a
replica whose members sit on the topology like the base group's (same node pattern, GPU
slots, GPU and NIC types) reuses the base estimate with its ranks renamed, so a
1024-rank world costs one cost-model evaluation per distinct shape, not per replica.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

from fakegpu import costmodel
from fakegpu.common.records import CommRecord, OpRecord
from fakegpu.report.cluster_report import ClusterReport
from fakegpu.topology import Topology

_TILING_CACHE_LIMIT = 4096
_SHIFT_CACHE_LIMIT = 1 << 16


def _arithmetic_stride(members: Sequence[int]) -> Optional[int]:
    if len(members) < 2:
        return None
    s = members[1] - members[0]
    if s <= 0:
        return None
    for a, b in zip(members, members[1:]):
        if b - a != s:
            return None
    return s


def replica_groups(members: Sequence[int], world_size: int,
                   domain: Optional[tuple[int, int]] = None) -> tuple[list[tuple[int, ...]], str]:
    """(replica groups, method) for a communicator with ``members`` (global ranks, in comm
    rank order) in a world of ``world_size`` ranks, tiling the ranks [lo, hi) of ``domain``.

    method is "arithmetic" (an AP group), "translation" (another shape that tiles),
    "none" (does not tile: the list holds only ``members``).  Every replica keeps the member
    order of ``members`` shifted by a constant, so comm rank i of a replica plays the part
    comm rank i plays in the original.
    """
    members = tuple(int(m) for m in members)
    if not members:
        raise ValueError("a communicator needs at least one member")
    lo, hi = domain if domain is not None else (0, world_size)
    if not (0 <= lo < hi <= world_size) or not all(lo <= m < hi for m in members):
        return [members], "none"
    if len(set(members)) != len(members):
        return [members], "none"
    base = min(members)
    shape = tuple(m - base for m in members)
    span = max(shape) + 1
    covered = bytearray(hi - lo)
    groups: list[tuple[int, ...]] = []
    start = lo
    while True:
        while start < hi and covered[start - lo]:
            start += 1
        if start >= hi:
            break
        if start + span > hi:
            return [members], "none"
        group = tuple(start + d for d in shape)
        for g in group:
            if covered[g - lo]:
                return [members], "none"
            covered[g - lo] = 1
        groups.append(group)
    if members not in groups:
        return [members], "none"
    return groups, ("arithmetic" if len(members) == 1 or _arithmetic_stride(members) else "translation")


class FakeWorldReport(ClusterReport):
    """A ClusterReport whose cost estimates are shared by groups of the same shape."""

    def __init__(self, topology: Topology, **kw):
        super().__init__(topology, **kw)
        self._shape_cache: dict[tuple[int, ...], tuple] = {}
        self._base: dict[tuple, tuple[tuple[int, ...], costmodel.Estimate]] = {}
        self._shifted: dict[tuple, costmodel.Estimate] = {}
        self.estimates_computed = 0
        self.extra_notes: list[str] = []

    def _build(self) -> dict:
        report = super()._build()
        report["notes"].extend(self.extra_notes)
        return report

    def _signature(self, members: tuple[int, ...]) -> tuple:
        sig = self._shape_cache.get(members)
        if sig is None:
            topo = self.topology
            node_idx = [topo.node_of(m) for m in members]
            dense = {n: i for i, n in enumerate(sorted(set(node_idx)))}
            # GPU slots relative to the first member's: the cost model orders rings by
            # (node, slot) and picks rails by slot modulo the node's NICs, both of which a
            # common shift preserves.
            local0 = topo.local_index(members[0])
            parts = []
            for m, n in zip(members, node_idx):
                node = topo.nodes[n]
                rel = topo.local_index(m) - local0
                parts.append((dense[n], rel, rel % max(1, node.nics), topo.gpu_of(m).name,
                              node.nics, node.nic_bandwidth_gbps, len(node.ranks)))
            sig = tuple(parts)
            if len(self._shape_cache) > _TILING_CACHE_LIMIT:
                self._shape_cache.clear()
            self._shape_cache[members] = sig
        return sig

    def _estimate(self, op: OpRecord, kind: str) -> costmodel.Estimate:
        members = op.comm.global_ranks
        key = (kind, op.count, op.elem_size, self._signature(members), op.root, op.peer)
        base = self._base.get(key)
        if base is None:
            est = costmodel.estimate(kind, op.count, op.elem_size, members, op.root, op.peer, self.topology)
            self.estimates_computed += 1
            self._base[key] = (members, est)
            return est
        base_members, base_est = base
        if base_members == members:
            return base_est
        skey = (key, members)
        est = self._shifted.get(skey)
        if est is None:
            if len(self._shifted) >= _SHIFT_CACHE_LIMIT:
                self._shifted.clear()
                self._attributions.clear()   # keyed by id() of the estimates just dropped
            est = self._rename(base_est, base_members, members)
            self._shifted[skey] = est
        return est

    def _rename(self, est: costmodel.Estimate, old: tuple[int, ...], new: tuple[int, ...]) -> costmodel.Estimate:
        rank_map = dict(zip(old, new))
        topo = self.topology
        node_map = {topo.node_of(a): topo.node_of(b) for a, b in rank_map.items()}
        transfers = {(rank_map[s], rank_map[d]): b for (s, d), b in est.transfers.items()}
        node_bytes = {(node_map[s], node_map[d]): b for (s, d), b in est.node_bytes.items()}
        return costmodel.Estimate(est.kind, est.algorithm, est.seconds, est.latency_s, est.bandwidth_s,
                                  est.logical_bytes, est.nranks, transfers, node_bytes,
                                  dict(est.candidates), protocol=est.protocol)


class WorldAccountant:
    """Turns fake-world events (see fakegpu.fake.events) into a whole-world ClusterReport."""

    def __init__(self, topology: Topology, world_size: int, *, metadata: Optional[dict] = None,
                 max_operations: int = 4096):
        if topology.world_size < world_size:
            raise ValueError(f"the cluster topology places {topology.world_size} ranks but the logical "
                             f"world has {world_size}: give a cluster config with at least {world_size} "
                             f"GPUs (FAKEGPU_CLUSTER_CONFIG)")
        self.world_size = world_size
        self.report = FakeWorldReport(topology, metadata=metadata, max_operations=max_operations)
        self._tilings: dict[tuple, tuple[list[CommRecord], str]] = {}
        self._next_comm_id = 0
        self._seq = 0
        self.untiled: dict[str, list[int]] = {}
        self.tiling_methods: dict[str, int] = {}
        self.ops = 0
        self.records = 0
        self.worlds: list[dict] = []

    def replicas(self, name: str, members: Sequence[int], domain: Optional[tuple[int, int]] = None,
                 owned: Optional[tuple[int, int]] = None) -> list[CommRecord]:
        """The replica communicators of ``members`` (tiling ``domain``, default the world),
        keeping only those whose lowest member lies in ``owned`` [lo, hi) when given."""
        members = tuple(int(m) for m in members)
        # The name is part of the key: two groups with the same members (DeviceMesh's "dp" and a
        # flattened "dp_shard_cp" over the same ranks) stay two communicators in the report.
        key = (name, members, tuple(domain) if domain else None, tuple(owned) if owned else None)
        entry = self._tilings.get(key)
        if entry is None:
            groups, method = replica_groups(members, self.world_size, domain)
            if owned is not None:
                lo, hi = owned
                groups = [g for g in groups if lo <= min(g) < hi]
            comms = []
            for k, g in enumerate(groups):
                label = name if len(groups) == 1 else f"{name}[{k}]"
                comms.append(CommRecord(self._next_comm_id, label, g))
                self._next_comm_id += 1
                self.report.comm_created(comms[-1], ())
            entry = (comms, method)
            self._tilings[key] = entry
            self.tiling_methods[method] = self.tiling_methods.get(method, 0) + 1
            if method == "none" and len(members) > 1:
                self.untiled[name or "?"] = list(members)
        return entry[0]

    def op(self, name: str, members: Sequence[int], kind: str, datatype: str, elem_size: int,
           count: int, *, redop: Optional[str] = None, root: int = -1, peer: int = -1,
           domain: Optional[tuple[int, int]] = None, owned: Optional[tuple[int, int]] = None,
           spread: bool = False) -> int:
        """Account one operation of this rank, replicated over its communicator's replicas.

        ``spread`` (point-to-point only): the transfer root -> peer stands for every transfer
        with the same offset inside the group, k -> k + (peer - root), as every stage of a
        pipeline (or every member of a ring) makes the same send.  Returns the number of
        OpRecords fed to the report."""
        kind = costmodel.normalize_kind(kind)
        comms = self.replicas(name, members, domain, owned)
        n = len(members)
        if kind == "SendRecv":
            if spread:
                d = peer - root
                pairs = [(k, k + d) for k in range(n) if 0 <= k + d < n]
            else:
                pairs = [(root, peer)]
        else:
            pairs = [(root, peer)]
        nbytes = costmodel.logical_bytes(kind, count, elem_size, n)
        now = time.time()
        self.ops += 1
        all_ranks = tuple(range(n))
        for comm in comms:
            for src, dst in pairs:
                self._seq += 1
                self.report.op_completed(OpRecord(
                    comm=comm, kind=kind, datatype=datatype, redop=redop, count=count,
                    elem_size=elem_size, root=src, peer=dst,
                    ranks=(src, dst) if kind == "SendRecv" else all_ranks, logical_bytes=nbytes,
                    socket_bytes=0, seq=self._seq, started_at=now, rendezvous_s=0.0, execution_s=0.0))
        fed = len(comms) * len(pairs)
        self.records += fed
        return fed

    def summary(self) -> dict:
        return {
            "operations_seen": self.ops,
            "replica_records": self.records,
            "communicators_seen": len(self._tilings),
            "tiling_methods": dict(sorted(self.tiling_methods.items())),
            "untiled_communicators": dict(self.untiled),
            "cost_model_evaluations": self.report.estimates_computed,
        }

    def finish_metadata(self, extra: Optional[dict] = None) -> dict:
        meta = self.report.metadata.setdefault("fake_world", {})
        meta.update(self.summary())
        if extra:
            meta.update(extra)
        return meta

