"""The in-memory cluster topology: which node each global rank lives on, and the links.

Units: fabric bandwidths are given in the YAML as ``bandwidth_gbps`` = gigabits per
second per direction (network convention: a 400G NIC is 400). Methods ending in
``_bytes_per_s`` convert to bytes/s so the cost model never juggles units.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .profiles import GpuProfile, get_profile

INTRA_NODE_TYPES = ("nvlink", "nvswitch", "pcie", "shm")
INTER_NODE_TYPES = ("infiniband", "roce", "ethernet", "tcp")


@dataclass(frozen=True)
class Fabric:
    type: str
    bandwidth_gbps: float       # Gbit/s per direction (per NIC for the inter-node fabric)
    latency_us: float
    oversubscription: float = 1.0
    # A proxy-driven transport (AWS EFA, GCP GPUDirect-TCPX/TCPXO) pays a host-side cost on every
    # message it moves, whatever the protocol: added to each network step (docs/cost-model.md).
    per_message_us: float = 0.0
    # Fraction of line rate NCCL reaches over this fabric; None: the type's default
    # (costmodel.EFFICIENCY). Proxy transports reach much less than RDMA NICs.
    efficiency: Optional[float] = None
    # GPUDirect RDMA: the NIC reads and writes GPU memory directly. Without it (no nv_peermem,
    # a virtualised NIC, NCCL_NET_GDR_LEVEL=LOC) NCCL stages network data in host memory.
    gpudirect_rdma: bool = True
    # The network switches reduce (InfiniBand SHARP with NCCL's CollNet plugin): AllReduce can
    # use CollNet, whose per-NIC bytes do not grow with the node count.
    collnet: bool = False

    def to_dict(self) -> dict:
        return {
            "type": self.type,
            "bandwidth_gbps": self.bandwidth_gbps,
            "latency_us": self.latency_us,
            "oversubscription": self.oversubscription,
            "per_message_us": self.per_message_us,
            "efficiency": self.efficiency,
            "gpudirect_rdma": self.gpudirect_rdma,
            "collnet": self.collnet,
        }


@dataclass(frozen=True)
class Node:
    id: str
    host: str
    ranks: tuple[int, ...]
    gpus: tuple[GpuProfile, ...]
    nics: int = 1                           # network adapters (rails) on this node
    nic_bandwidth_gbps: Optional[float] = None   # overrides fabric.inter_node.bandwidth_gbps
    nvlink_bridges: tuple[tuple[int, int], ...] = ()   # GPU slot pairs joined by an NVLink bridge
    # GB/s per direction that the host (root complexes, the link between CPU sockets, memory) moves
    # GPU-to-GPU over PCIe for all the node's GPUs together; None: no limit beyond each card's
    pcie_host_gbs: Optional[float] = None

    def to_dict(self, inter: Fabric) -> dict:
        return {
            "id": self.id,
            "host": self.host,
            "ranks": list(self.ranks),
            "gpus": [g.name for g in self.gpus],
            "nics": self.nics,
            "nic_bandwidth_gbps": self.nic_bandwidth_gbps or inter.bandwidth_gbps,
            "pcie_host_gbs": self.pcie_host_gbs,
        }


@dataclass(frozen=True)
class LinkParams:
    """Raw (line-rate) parameters of the path between two ranks."""
    scope: str                  # "self" | "intra_node" | "inter_node"
    type: str                   # fabric type
    bandwidth_bytes_per_s: float
    latency_s: float


@dataclass
class Topology:
    name: str
    nodes: tuple[Node, ...]
    intra_node: Fabric
    inter_node: Fabric
    default_backend: str = "nccl"
    source: Optional[str] = None            # YAML path, None when built in code
    is_default: bool = False                # True when derived from the world size alone
    warnings: list[str] = field(default_factory=list)   # plausible but suspicious inputs
    _rank_node: dict[int, int] = field(default_factory=dict, repr=False)
    _rank_local: dict[int, int] = field(default_factory=dict, repr=False)
    # Injected faults (fakegpu.coordinator.faults.Fault) from the YAML's `faults:` section,
    # and the slowed node pairs (node index pair -> factor) that slow_link faults set.
    faults: list = field(default_factory=list, repr=False)
    link_factors: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for index, node in enumerate(self.nodes):
            for local, rank in enumerate(node.ranks):
                self._rank_node[rank] = index
                self._rank_local[rank] = local

    # -- rank placement -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self._rank_node)

    @property
    def node_count(self) -> int:
        return len(self.nodes)

    def places(self, rank: int) -> bool:
        """Whether the topology puts global rank ``rank`` on a node."""
        return rank in self._rank_node

    def describe(self) -> str:
        """What it is and which ranks it places, for messages: "cluster config X (ranks 0-3)"."""
        where = f"cluster config {self.source}" if self.source else "the default topology"
        return f"{where} (ranks {rank_ranges(sorted(self._rank_node))})"

    def _check_rank(self, rank: int) -> None:
        if rank not in self._rank_node:
            where = f"cluster config {self.source}" if self.source else "the default topology"
            raise ValueError(
                f"global rank {rank} is not placed by {where} (world size {self.world_size})"
            )

    def node_of(self, rank: int) -> int:
        """Index (into ``nodes``) of the node holding ``rank``."""
        self._check_rank(rank)
        return self._rank_node[rank]

    def node_id_of(self, rank: int) -> str:
        return self.nodes[self.node_of(rank)].id

    def local_index(self, rank: int) -> int:
        """Position of ``rank`` within its node (GPU slot, and the rail it uses)."""
        self._check_rank(rank)
        return self._rank_local[rank]

    def same_node(self, a: int, b: int) -> bool:
        return self.node_of(a) == self.node_of(b)

    def gpu_of(self, rank: int) -> GpuProfile:
        return self.nodes[self.node_of(rank)].gpus[self.local_index(rank)]

    # -- bandwidths -----------------------------------------------------------------
    def gpu_port_bytes_per_s(self, rank: int) -> float:
        """Line rate at which ``rank`` can send to (or receive from) node-local peers."""
        fabric = self.intra_node.bandwidth_gbps * 1e9 / 8
        cap = self.gpu_of(rank).intra_node_cap_gbs(self.intra_node.type) * 1e9
        return min(fabric, cap)

    def nic_bytes_per_s(self, node_index: int) -> float:
        """One NIC's line rate on the node, after the fabric's oversubscription."""
        node = self.nodes[node_index]
        gbps = node.nic_bandwidth_gbps or self.inter_node.bandwidth_gbps
        return gbps * 1e9 / 8 / self.inter_node.oversubscription

    def node_network_bytes_per_s(self, node_index: int) -> float:
        """All of a node's NICs together (what collectives spread over, one channel per rail)."""
        return self.nic_bytes_per_s(node_index) * self.nodes[node_index].nics

    def bridge_bytes_per_s(self, a: int, b: int) -> Optional[float]:
        """Rate of the NVLink bridge joining ranks ``a`` and ``b``, or None when none does."""
        if a == b or self.node_of(a) != self.node_of(b):
            return None
        pair = tuple(sorted((self.local_index(a), self.local_index(b))))
        if pair not in self.nodes[self.node_of(a)].nvlink_bridges:
            return None
        rates = [self.gpu_of(r).nvlink_bridge_gbs for r in (a, b)]
        return min(rates) * 1e9 if all(rates) else None

    def link(self, a: int, b: int) -> LinkParams:
        """Line-rate parameters of the path from global rank ``a`` to global rank ``b``."""
        if a == b:
            self._check_rank(a)
            return LinkParams("self", "local", float("inf"), 0.0)
        na, nb = self.node_of(a), self.node_of(b)
        if na == nb:
            bridge = self.bridge_bytes_per_s(a, b)
            if bridge is not None:
                return LinkParams("intra_node", "nvlink_bridge", bridge, self.intra_node.latency_us * 1e-6)
            bw = min(self.gpu_port_bytes_per_s(a), self.gpu_port_bytes_per_s(b))
            return LinkParams("intra_node", self.intra_node.type, bw, self.intra_node.latency_us * 1e-6)
        bw = min(self.nic_bytes_per_s(na), self.nic_bytes_per_s(nb))
        return LinkParams("inter_node", self.inter_node.type, bw, self.inter_node.latency_us * 1e-6)

    def set_link_factor(self, node_a: int, node_b: int, factor: float) -> None:
        self.link_factors[(min(node_a, node_b), max(node_a, node_b))] = float(factor)

    def link_factor(self, node_a: int, node_b: int) -> float:
        """How many times slower than modeled the link between two nodes is (slow_link)."""
        if not self.link_factors:
            return 1.0
        return self.link_factors.get((min(node_a, node_b), max(node_a, node_b)), 1.0)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "source": self.source,
            "is_default": self.is_default,
            "warnings": list(self.warnings),
            "default_backend": self.default_backend,
            "world_size": self.world_size,
            "node_count": self.node_count,
            "nodes": [n.to_dict(self.inter_node) for n in self.nodes],
            "fabric": {
                "intra_node": self.intra_node.to_dict(),
                "inter_node": self.inter_node.to_dict(),
            },
        }


DEFAULT_PROFILE = "h100"


def rank_ranges(ranks) -> str:
    """Sorted ranks as ranges for messages: [0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    parts: list[str] = []
    ranks = sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(parts) or "none"


def default_topology(world_size: int, profile: str = DEFAULT_PROFILE) -> Topology:
    """One node holding every rank, H100 SXM GPUs on NVLink: used when no YAML is given.

    The report flags it (``topology.is_default``) so nobody mistakes its numbers for a
    model of their cluster.
    """
    if world_size < 1:
        raise ValueError(f"world size must be at least 1, got {world_size}")
    gpu = get_profile(profile)
    node = Node("node0", "localhost", tuple(range(world_size)), tuple([gpu] * world_size))
    return Topology(
        name=f"default-1x{world_size}-{gpu.name}",
        nodes=(node,),
        intra_node=Fabric("nvlink", 3600.0, 1.0, 1.0),
        inter_node=Fabric("infiniband", 400.0, 5.0, 1.0),
        is_default=True,
    )
