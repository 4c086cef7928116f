"""Alpha-beta cost model of NCCL operations on a Topology (pure functions).

Each algorithm is described by the rank-to-rank transfers it makes (bytes per directed
edge) and its latency term. Time = latency + the busiest resource's bytes / bandwidth,
where resources are each GPU's node-local port (per direction), each node's network
(all NICs together, for ring/tree channels spread over the rails) or one NIC (rail) for
point-to-point style traffic. The same transfers feed the report's per-link and
per-node-pair byte counts, so the bytes and the times can never disagree.
Like NCCL's tuner we evaluate every applicable algorithm and keep the fastest.
The formulas are written out in docs/cost-model.md.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Collection, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from fakegpu.topology import Topology

# Fraction of line rate NCCL's Simple protocol reaches on each fabric, fitted to the
# published nccl-tests numbers in verification/data/published_nccl_tests.csv (docs/cost-model.md).
EFFICIENCY = {
    "nvlink": 0.82,
    "nvswitch": 0.82,
    "pcie": 0.80,
    "shm": 0.80,
    "infiniband": 0.92,
    "roce": 0.90,
    "ethernet": 0.85,
    "tcp": 0.85,
}
# Point-to-point over NVLink reaches less than the collectives: NCCL gives a peer fewer channels.
# 0.65 makes 8x A100 send/recv match the figure quoted in issue 12 (the collectives' 0.82 was
# +26 %); 2x H100 sendrecv_perf plateaus lower still (~180 GB/s, NVIDIA/nccl-tests issue 268).
P2P_EFFICIENCY = {"nvlink": 0.65, "nvswitch": 0.65}
# ...and one pair of GPUs never gets more than this (GB/s) whatever the link: NCCL drives a
# peer with a fixed handful of channels. 190 sits between the 2x H100 sendrecv_perf plateau,
# ~180 GB/s (NVIDIA/nccl-tests issue 268), and the 8x A100 figure quoted in issue 12
# (~195 = 300 x 0.82 / 1.26); NVLink3 (A100) at 0.65 is just under it.
P2P_PEER_MAX_GBS = 190.0
# NVLink SHARP allreduce: algbw as a fraction of one GPU's NVLink line rate (fit to 8x H100
# NVLS busbw ~474 GB/s at 4 GB: algbw = 474 * 8 / 14 = 271 GB/s of 450).
NVLS_EFFICIENCY = 0.60
# NVLS inside each node with rails between nodes (NCCL's NVLSTree): fit to 2x8 H100 with
# 8x NDR, busbw ~468 GB/s at 8 GB: algbw = 468 / (2 * 15 / 16) = 250 GB/s of 450.
NVLS_TREE_EFFICIENCY = 0.555
# NVLS chunking (NCCL 2.19+, src/enqueue.cc, the NVLS branch of the chunk-size rule): a chunk of
# nvlsChunkSize (128 KiB) normally, halved to 64 / 32 / 16 KiB while the message is below
# 64 / 8 / 2 times (NVLS channels x NVLS heads x chunk). Every chunk costs a fixed amount of
# switch/semaphore work, worth NVLS_CHUNK_OVERHEAD_BYTES of transfer at one concurrent op's rate,
# so the port reaches chunk / (chunk + overhead) of its rate. NVLS_EFFICIENCY is the rate reached
# at the full 128 KiB chunk. The overhead, 9.5 KiB, is fitted to the 8x H100 / H200 sweeps
# (Azure ND v5, NVIDIA/nccl-tests issue 290): 64 KiB chunks (64 MB .. 1 GB) are ~7 % and 32 KiB
# chunks (8 .. 64 MB) ~20 % slower than 128 KiB ones, which one overhead explains for both.
NVLS_CHUNK_BYTES = 128 * 1024
NVLS_MIN_CHUNK_BYTES = 16 * 1024
NVLS_CHANNELS = 16           # NCCL_NVLS_NCHANNELS' default on Hopper
NVLS_CHUNK_OVERHEAD_BYTES = 9.5 * 1024
# NVLS pays a fixed set-up cost per call (multicast objects, switch reduction); fitted so
# small messages prefer ring/tree as they do on real H100 systems.
NVLS_BASE_LATENCY_S = 25e-6
# What nccl-tests measures and NCCL's tuner leaves out: launching the kernel and the host's
# enqueue per call (fitted to the smallest published allreduces: 8x H100 / 8x H200 on one node
# 26 / 30 us, 4x8 H100 35 us, 2x8 H100 25 us, 8x A100 20 us; docs/cost-model.md).
LAUNCH_OVERHEAD_S = 10e-6
# NVLS-tree beyond two nodes: fraction of the rails' rate it reaches (NCCL halves it; the
# issue-12 figures for 4 and 8 nodes of 8x H100, 366 and 321 GB/s busbw, give ~0.75).
NVLS_TREE_INTER_SCALE = 0.75
# NVLS-tree's network pipeline fill: the Simple protocol moves a channel's data between nodes in
# chunks of NCCL's net step (buffSize 4 MiB / NCCL_STEPS 8 = 512 KiB), and the first chunk
# crosses every stage of the path (NVLS reduce, the network, NVLS multicast) before the stages
# overlap. NCCL's tuner leaves this out (it does not change the algorithm chosen). Runs show it as
# a fixed cost in proportion to the chunk: the full NVLS_TREE_FILL_S at 512 KiB chunks, the chunk
# halved (down to 64 KiB) while the message is below NVLS_TREE_FILL_DEPTH x channels x chunk, as
# NCCL shrinks chunks for messages too small to keep every channel's pipeline full. Fitted to
# two independent 2x8 H100 NDR sweeps, which both sit 145-217 us above the bandwidth term from
# 128 MB to 4 GB (median 163 us) and about half that at 16 MB (dstack's Nebius example log, the
# project's DGX log; docs/cost-model.md).
NET_CHUNK_BYTES = 512 * 1024
NET_MIN_CHUNK_BYTES = 64 * 1024
NVLS_TREE_FILL_S = 163e-6
NVLS_TREE_FILL_DEPTH = 4

KINDS = ("AllReduce", "Broadcast", "Reduce", "AllGather", "ReduceScatter", "AlltoAll", "Gather", "Scatter", "SendRecv")
_KIND_BY_KEY = {k.lower(): k for k in KINDS}
_KIND_BY_KEY.update({"send": "SendRecv", "recv": "SendRecv", "p2p": "SendRecv", "sendrecv": "SendRecv"})


# Every algorithm name an Estimate can carry (besides "local" for free operations).
ALGORITHMS = ("ring", "tree", "hierarchical", "nvls", "nvls_tree", "collnet_direct", "pat", "pairwise", "direct")
# Algorithms that are not NCCL's and are only considered when asked for by name: "hierarchical"
# (reduce-scatter in the node, allreduce per rail, allgather in the node) moves half a ring's
# bytes between nodes, which NCCL's ring and tree do not achieve without NVLS; letting it compete
# made 2x8 A100 over 4 HDR NICs +100 % and 4x8 H100 +23 % against published results.
NOT_NCCL = ("hierarchical",)


def _check_algorithm(name: str) -> str:
    key = str(name).strip().lower().replace("-", "_")
    key = {"nvlstree": "nvls_tree"}.get(key, key)
    if key not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {', '.join(ALGORITHMS)}")
    return key


def normalize_kind(kind: str) -> str:
    """Canonical OpRecord kind for any common spelling ("all_reduce", "AllToAll", "Send")."""
    key = str(kind).replace("_", "").replace("-", "").lower()
    try:
        return _KIND_BY_KEY[key]
    except KeyError:
        raise ValueError(f"unknown operation kind {kind!r}; expected one of {', '.join(KINDS)}") from None


def is_collective(kind: str) -> bool:
    return normalize_kind(kind) != "SendRecv"


# -- nccl-tests conventions (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md) --
def logical_bytes(kind: str, count: int, elem_size: int, n: int) -> int:
    """S, the payload size nccl-tests divides by time to get algbw."""
    kind = normalize_kind(kind)
    if kind in ("AllGather", "ReduceScatter", "AlltoAll", "Gather", "Scatter"):
        return count * elem_size * n
    return count * elem_size


def busbw_factor(kind: str, n: int) -> float:
    kind = normalize_kind(kind)
    if n <= 1:
        return 1.0 if kind in ("Broadcast", "Reduce", "SendRecv") else 0.0
    if kind == "AllReduce":
        return 2.0 * (n - 1) / n
    if kind in ("AllGather", "ReduceScatter", "AlltoAll", "Gather", "Scatter"):
        return (n - 1) / n
    return 1.0


def algbw_gbs(nbytes: float, seconds: float) -> float:
    """nccl-tests algbw in GB/s (1e9 bytes/s); 0 when no time was modeled."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def busbw_gbs(kind: str, nbytes: float, seconds: float, n: int) -> float:
    return algbw_gbs(nbytes, seconds) * busbw_factor(kind, n)


# -- result -----------------------------------------------------------------------------
@dataclass
class Estimate:
    kind: str
    algorithm: str
    seconds: float
    latency_s: float
    bandwidth_s: float
    logical_bytes: int
    nranks: int
    # bytes per directed (src global rank, dst global rank) transfer
    transfers: dict[tuple[int, int], int] = field(default_factory=dict)
    # bytes per directed (src node index, dst node index); src == dst is node-local traffic
    node_bytes: dict[tuple[int, int], int] = field(default_factory=dict)
    # modeled seconds of every (algorithm/protocol) candidate, e.g. {"ring/ll": 1.2e-5, ...}
    candidates: dict[str, float] = field(default_factory=dict)
    protocol: str = "simple"
    # link key -> seconds the chosen plan keeps that link busy at the simple protocol's rate
    # (links_of_rank picks one rank's; the busiest link sets bandwidth_s)
    link_seconds: dict[tuple, float] = field(default_factory=dict, repr=False)

    @property
    def algbw_gbs(self) -> float:
        return algbw_gbs(self.logical_bytes, self.seconds)

    @property
    def busbw_gbs(self) -> float:
        return busbw_gbs(self.kind, self.logical_bytes, self.seconds, self.nranks)

    @functools.cached_property
    def intra_node_bytes(self) -> int:
        return sum(b for (s, d), b in self.node_bytes.items() if s == d)

    @functools.cached_property
    def inter_node_bytes(self) -> int:
        return sum(b for (s, d), b in self.node_bytes.items() if s != d)


@dataclass
class _Plan:
    """One algorithm's transfers and latency before timing.

    ``latency_s`` is a function of the protocol: NCCL's base latency for (algorithm, protocol)
    plus the plan's intra-node and inter-node steps at that protocol's per-step latency.
    """
    algorithm: str
    edges: dict[tuple[int, int], float]
    latency_s: "Callable[[str], float]"
    spread: bool = True          # inter-node edges share all NICs (ring/tree channels) vs own rail
    rounds: int = 0              # >0: store-and-forward rounds (binomial tree), not pipelined
    intra_eff: Optional[float] = None   # overrides the fabric efficiency (NVLS)
    inter_scale: float = 1.0     # fraction of the NIC rate the plan gets (NVLS-tree beyond 2 nodes)
    protocols: tuple[str, ...] = ("simple",)
    # network steps of one chunk's path: a proxy transport's per-message cost is paid on each,
    # in a pipeline stage of its own that overlaps the transfers (see estimate())
    inter_steps: float = 0.0


# -- protocols (NCCL's src/graph/tuning.cc, https://github.com/NVIDIA/nccl) -------------------
PROTOCOLS = ("ll", "ll128", "simple")
# Per-step latency of a link at each protocol, as a fraction of its Simple per-step latency (the
# YAML's latency_us): NCCL's ring hwLat table, NVLink {0.6, 1.9, 3.4} us, PCIe {1.0, 2.5, 5.7},
# network {2.7, 4.0, 14.0}.
STEP_RATIO = {
    "nvlink": {"ll": 0.6 / 3.4, "ll128": 1.9 / 3.4, "simple": 1.0},
    "pcie": {"ll": 1.0 / 5.7, "ll128": 2.5 / 5.7, "simple": 1.0},
    "net": {"ll": 2.7 / 14.0, "ll128": 4.0 / 14.0, "simple": 1.0},
}
# Tree steps use NCCL's tree row (NVLink {0.6, 1.25}, PCIe {1.0, 1.9}, network {5.0, 8.5} us for
# LL / LL128), over the same Simple ring normalizers. Tree/Simple keeps the link's own step
# latency (NCCL charges 28 us there, a chunk-size stand-in the model does not need).
TREE_STEP_RATIO = {
    "nvlink": {"ll": 0.6 / 3.4, "ll128": 1.25 / 3.4, "simple": 1.0},
    "pcie": {"ll": 1.0 / 5.7, "ll128": 1.9 / 5.7, "simple": 1.0},
    "net": {"ll": 5.0 / 14.0, "ll128": 8.5 / 14.0, "simple": 1.0},
}
# NCCL's base latency (us) per algorithm and protocol (kernel launch and protocol set-up).
BASE_LATENCY_US = {
    "ring": {"ll": 6.6, "ll128": 14.0, "simple": 8.4},
    "tree": {"ll": 6.8, "ll128": 14.0, "simple": 0.0},
    "hierarchical": {"ll": 6.6, "ll128": 14.0, "simple": 8.4},
}
# Bandwidth of each protocol relative to Simple (LL moves 8 bytes per 16 on the wire and is
# limited by its flag polling; LL128 120 of every 128). Ring LL: 1/4 for AllReduce, Reduce and
# anything spanning nodes, else 1/3. Tree LL 1/3.8, tree LL128 7/9 on one node, 0.915 across.
LL128_RING = 0.92
# LL's busbw ceiling (GB/s): one node (by GPU generation), two nodes, more than two.
LL_MAX_BUSBW_GBS = {"one_node": 87.7, "two_nodes": 39.0, "more_nodes": 20.4}
# NCCL's tree correction for mid sizes (power-of-two sizes 64 B .. 128 MB, per protocol).
TREE_CORRECTION = {
    "ll": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0),
    "ll128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8, .9, .9, 1.0),
    "simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9),
}
# Channels: NCCL runs a ring or tree collective on as many channels (one thread block each) as
# the message feeds: it drops channels while nBytes < channels x threads x threshold
# (src/enqueue.cc, "Ring/Tree channel tuning"; thresholds from src/graph/tuning.cc, the ring's
# LL one multiplied by the rank count). It chooses the algorithm on its full channel count and then
# runs on the reduced one, each channel carrying its share of the bandwidth.
MAX_THREADS = {"ll": 512, "ll128": 640, "simple": 512}
THREAD_THRESHOLD = {"ll": 8, "ll128": 8, "simple": 64}
# A communicator's channel count, from the GPUs' node-local port rate: NCCL's topology search
# finds about one channel per 12.5 GB/s of NVLink (32 on H100/H200 NVSwitch, 24 on A100), at
# least 2 (PCIe boxes), at most 32 (MAXCHANNELS of the NCCL versions the table was measured with).
CHANNEL_GBS = 12.5
MIN_CHANNELS, MAX_CHANNELS = 2, 32
# Multi-node ring AllReduce with Simple reaches a latency plateau once the message is large
# enough (NCCL multiplies its latency by 1.9 from nranks/16 x 64 KiB up).
RING_PLATEAU = 1.9
# What one tree edge between nodes carries per direction, as a fraction of the payload (one tree
# of the two): NCCL's tuner gives tree the ring's bus bandwidth (algbw = busBw x 0.5,
# src/graph/tuning.cc), i.e. a node moves about twice the payload over the network, and
# measured tree runs across nodes follow it; half the payload per tree (the bare data flow)
# would make 2-node trees twice as fast as rings, which no published run shows.
NET_TREE_LOAD = 1.0


def _check_protocol(name: str) -> str:
    key = str(name).strip().lower()
    if key not in PROTOCOLS:
        raise ValueError(f"unknown protocol {name!r}; expected one of {', '.join(PROTOCOLS)}")
    return key


# NCCL_ALGO names -> the model's algorithms (CollNet is not modeled; "hierarchical" may
# be named too, it is the model's own).
_NCCL_ALGO_NAMES = {"ring": ("ring",), "tree": ("tree",), "hierarchical": ("hierarchical",), "nvls": ("nvls",),
                    "nvlstree": ("nvls_tree",), "collnetdirect": ("collnet_direct",), "collnet": ("collnet_direct",),
                    "collnetchain": (), "pat": ("pat",)}


def _parse_nccl_list(text: str, kind: str, names: dict[str, tuple[str, ...]]) -> Optional[set[str]]:
    """NCCL_ALGO / NCCL_PROTO syntax: "a,b", "^a" (all but a), "allreduce:tree;ring" (per function)."""
    chosen = None
    for item in str(text).split(";"):
        item = item.strip()
        if not item:
            continue
        if ":" in item:
            func, item = item.split(":", 1)
            if normalize_kind(func) != kind:
                continue
            chosen = item
            break
        if chosen is None:
            chosen = item
    if chosen is None:
        return None
    exclude = chosen.startswith("^")
    listed: set[str] = set()
    for token in chosen.lstrip("^").split(","):
        token = token.strip().lower().replace("_", "")
        if token:
            listed.update(names.get(token, ()))
    every = {a for group in names.values() for a in group}
    return every - listed if exclude else listed


def gpudirect_from_env(topology: "Topology", environ=None) -> bool:
    """Whether network transfers use GPUDirect RDMA: the fabric has it and NCCL_NET_GDR_LEVEL does
    not forbid it (LOC or 0: never; any other level allows the NIC on the GPU's PCIe switch,
    which is where the model places it)."""
    import os

    env = os.environ if environ is None else environ
    level = str(env.get("NCCL_NET_GDR_LEVEL", "")).strip().upper()
    return topology.inter_node.gpudirect_rdma and level not in ("LOC", "0")


def tuning_from_env(kind: str, environ=None) -> tuple[Optional[set[str]], Optional[set[str]]]:
    """The algorithms and protocols NCCL_ALGO and NCCL_PROTO allow for ``kind`` (None: unset)."""
    import os

    env = os.environ if environ is None else environ
    kind = normalize_kind(kind)
    algos = _parse_nccl_list(env["NCCL_ALGO"], kind, _NCCL_ALGO_NAMES) if env.get("NCCL_ALGO") else None
    if str(env.get("NCCL_NVLS_ENABLE", "")).strip() == "0":
        # NCCL_NVLS_ENABLE=0 takes NVLink SHARP (NVLS and NVLS-tree) out of the choice
        every = {a for group in _NCCL_ALGO_NAMES.values() for a in group} - set(NOT_NCCL)
        algos = (every if algos is None else algos) - {"nvls", "nvls_tree"}
    protos = (_parse_nccl_list(env["NCCL_PROTO"], kind, {p: (p,) for p in PROTOCOLS})
              if env.get("NCCL_PROTO") else None)
    return algos, protos


# -- the model ----------------------------------------------------------------------------
def estimate_seconds(kind: str, count: int, elem_size: int, global_ranks: Sequence[int],
                     root: int, peer: int, topology: "Topology") -> float:
    """Modeled seconds of one operation (the API the coordinator calls)."""
    return estimate(kind, count, elem_size, global_ranks, root, peer, topology).seconds


def estimate(kind: str, count: int, elem_size: int, global_ranks: Sequence[int],
             root: int, peer: int, topology: "Topology",
             algorithms: Optional[Collection[str]] = None,
             protocols: Optional[Collection[str]] = None,
             gpudirect: Optional[bool] = None) -> Estimate:
    """Fastest algorithm's time and its per-transfer bytes for one operation.

    ``root`` and ``peer`` are ranks in the communicator (index into ``global_ranks``):
    the root of rooted collectives, or sender (root) and receiver (peer) of a SendRecv.
    ``algorithms`` and ``protocols`` restrict the choice (names in ALGORITHMS, PROTOCOLS); left
    out, NCCL_ALGO and NCCL_PROTO in the environment do, as in NCCL. When nothing allowed applies
    to this operation the full choice is used, as NCCL falls back when a setting excludes all.
    ``gpudirect`` says whether network transfers use GPUDirect RDMA; left out, the fabric's
    ``gpudirect_rdma`` unless NCCL_NET_GDR_LEVEL turns it off (gpudirect_from_env).
    """
    kind = normalize_kind(kind)
    members = [int(r) for r in global_ranks]
    n = len(members)
    if n == 0:
        raise ValueError("an operation needs at least one rank")
    if count < 0 or elem_size <= 0:
        raise ValueError(f"invalid count {count} / element size {elem_size}")
    for r in members:
        topology.node_of(r)  # raises a clear error for a rank the topology does not place
    if kind in ("Broadcast", "Reduce", "Gather", "Scatter", "SendRecv") and not 0 <= root < n:
        raise ValueError(f"{kind} needs a root/sender rank in 0..{n - 1}, got {root}")
    if kind == "SendRecv" and not 0 <= peer < n:
        raise ValueError(f"SendRecv needs a receiver rank in 0..{n - 1}, got {peer}")
    size = logical_bytes(kind, count, elem_size, n)
    plans = _plans(kind, count * elem_size, members, root, peer, topology)
    env_algos, env_protos = tuning_from_env(kind) if algorithms is None or protocols is None else (None, None)
    wanted_algos = {_check_algorithm(a) for a in algorithms} if algorithms is not None else env_algos
    wanted_protos = {_check_protocol(p) for p in protocols} if protocols is not None else env_protos
    if wanted_algos is not None:
        # NCCL falls back to what it has when the setting excludes every algorithm that applies.
        plans = ([p for p in plans if p.algorithm in wanted_algos]
                 or [p for p in plans if p.algorithm not in NOT_NCCL] or plans)
    else:
        plans = [p for p in plans if p.algorithm not in NOT_NCCL] or plans
    if not plans or count == 0:
        return Estimate(kind, "local", 0.0, 0.0, 0.0, size, n)

    nnodes = len({topology.node_of(r) for r in members})
    full_channels = channel_count(topology, members)
    ll128_ok = _ll128_capable(members, topology)
    best: Optional[tuple] = None    # (score, total, latency, bandwidth time, plan, protocol, links)
    candidates: dict[str, float] = {}
    gdr = gpudirect_from_env(topology) if gpudirect is None else bool(gpudirect)
    for plan in plans:
        links = _link_seconds(plan, topology, gdr)
        simple_bw_time = _busiest(plan, links)
        # NCCL picks on its own estimate, which gives NVLS-tree the full rail rate at any node
        # count; what the run then reaches beyond two nodes is inter_scale of it. So the choice
        # is made on the full-rate time and the modeled time is the reached one.
        believed_bw_time = (simple_bw_time if plan.inter_scale == 1.0
                            else _bandwidth_time(dataclasses.replace(plan, inter_scale=1.0), topology, gdr))
        protos = [p for p in plan.protocols if p != "ll128" or ll128_ok or (wanted_protos and "ll128" in wanted_protos)]
        if wanted_protos is not None:
            protos = [p for p in protos if p in wanted_protos] or protos
        for proto in protos:
            bw_time = _protocol_bandwidth_time(plan, proto, simple_bw_time, kind, size, n, nnodes)
            believed = _protocol_bandwidth_time(plan, proto, believed_bw_time, kind, size, n, nnodes)
            if plan.algorithm in ("ring", "tree"):
                used = channels_used(plan.algorithm, proto, size, n, full_channels)
                bw_time *= full_channels / used
            elif plan.algorithm == "nvls":
                slower = nvls_chunk_slowdown(count * elem_size, n)
                bw_time *= slower
                believed *= slower
            latency = plan.latency_s(proto)
            if (plan.algorithm == "ring" and proto == "simple" and kind == "AllReduce" and nnodes > 1
                    and count * elem_size >= n / 16.0 * 65536):
                latency *= RING_PLATEAU
            latency += LAUNCH_OVERHEAD_S
            if plan.algorithm == "nvls_tree" and proto == "simple":
                latency += nvls_tree_fill_s(size)
            # A proxy transport handles one message per network step; its host thread is a
            # pipeline stage beside the wire, so the slower of the two sets the pace.
            messages = plan.inter_steps * topology.inter_node.per_message_us * 1e-6
            bw_time = max(bw_time, messages)
            total = latency + bw_time
            # NCCL's tuner does not know the pipeline fill: it chooses without it.
            unknown_to_tuner = nvls_tree_fill_s(size) if plan.algorithm == "nvls_tree" and proto == "simple" else 0.0
            score = latency - unknown_to_tuner + max(believed, messages)
            candidates[f"{plan.algorithm}/{proto}"] = total
            if best is None or score < best[0]:
                best = (score, total, latency, bw_time, plan, proto, links)
    assert best is not None
    _, total, latency, bw_time, plan, proto, links = best
    transfers = {edge: int(round(b)) for edge, b in plan.edges.items() if b > 0}
    node_bytes: dict[tuple[int, int], int] = defaultdict(int)
    for (a, b), nbytes in transfers.items():
        node_bytes[(topology.node_of(a), topology.node_of(b))] += nbytes
    return Estimate(kind, plan.algorithm, total, latency, bw_time, size, n,
                    transfers, dict(node_bytes), candidates, proto, dict(links))


def nvls_tree_fill_s(nbytes: int) -> float:
    """NVLS-tree's network pipeline fill for an ``nbytes`` call (Simple protocol), in proportion
    to the net chunk it runs with (NVLS_TREE_FILL_S at the full 512 KiB)."""
    chunk = NET_CHUNK_BYTES
    while nbytes < NVLS_TREE_FILL_DEPTH * NVLS_CHANNELS * chunk and chunk > NET_MIN_CHUNK_BYTES:
        chunk //= 2
    return NVLS_TREE_FILL_S * chunk / NET_CHUNK_BYTES


def nvls_chunk_bytes(nbytes: int, heads: int, channels: int = NVLS_CHANNELS) -> int:
    """NCCL's NVLS chunk for an ``nbytes`` allreduce on ``heads`` NVLS heads (GPUs per node)."""
    chunk = NVLS_CHUNK_BYTES
    concurrent = channels * max(1, heads)
    for factor in (64, 8, 2):
        if nbytes < factor * concurrent * chunk and chunk > NVLS_MIN_CHUNK_BYTES:
            chunk //= 2
    return chunk


def nvls_chunk_slowdown(nbytes: int, heads: int) -> float:
    """Transfer time at the chunk NCCL uses for ``nbytes`` relative to the full 128 KiB chunk."""
    chunk = nvls_chunk_bytes(nbytes, heads)
    return ((chunk + NVLS_CHUNK_OVERHEAD_BYTES) / chunk) / ((NVLS_CHUNK_BYTES + NVLS_CHUNK_OVERHEAD_BYTES) / NVLS_CHUNK_BYTES)


def channel_count(topo: "Topology", members: Sequence[int]) -> int:
    """The communicator's channel count: from the slowest member's node-local port rate."""
    port_gbs = min(topo.gpu_port_bytes_per_s(r) for r in members) / 1e9
    return max(MIN_CHANNELS, min(MAX_CHANNELS, round(port_gbs / CHANNEL_GBS)))


def channels_used(algorithm: str, proto: str, nbytes: int, n: int, channels: int) -> int:
    """How many of ``channels`` NCCL runs a ring/tree operation of ``nbytes`` on."""
    # NCCL scales only the ring's LL threshold by the rank count (src/graph/tuning.cc)
    threshold = THREAD_THRESHOLD[proto] * (n if algorithm == "ring" and proto == "ll" else 1)
    per_channel = MAX_THREADS[proto] * threshold
    return max(1, min(channels, int(nbytes // per_channel) if nbytes >= per_channel else 1))


def _ll128_capable(members: list[int], topo: "Topology") -> bool:
    """NCCL enables LL128 by default only on NVLink-connected GPUs of one (tested) generation."""
    gpus = {topo.gpu_of(r).name for r in members}
    if len(gpus) != 1:
        return False
    return _bridged_pair(topo, members) or (topo.intra_node.type in ("nvlink", "nvswitch")
                                            and all(topo.gpu_of(r).nvlink_gbs for r in members))


def _protocol_bandwidth_time(plan: _Plan, proto: str, simple_time: float, kind: str, size: int,
                             n: int, nnodes: int) -> float:
    """The plan's transfer time at ``proto``, from its Simple time (NCCL's per-protocol factors)."""
    t = simple_time
    if plan.algorithm in ("ring", "hierarchical"):
        if proto == "ll":
            t *= 4.0 if (nnodes > 1 or kind in ("AllReduce", "Reduce")) else 3.0
        elif proto == "ll128":
            t /= LL128_RING
    elif plan.algorithm == "tree" and not plan.rounds:
        if proto == "ll":
            t *= 3.8
        elif proto == "ll128":
            t /= (7.0 / 9.0) if nnodes == 1 else 0.915
        log_size = int(math.log2(max(size, 64) // 64))
        if log_size < len(TREE_CORRECTION[proto]):
            t /= TREE_CORRECTION[proto][log_size]
    if proto == "ll" and t > 0:
        cap = LL_MAX_BUSBW_GBS["one_node" if nnodes == 1 else "two_nodes" if nnodes == 2 else "more_nodes"]
        t = max(t, size * busbw_factor(kind, n) / (cap * 1e9))
    return t


def _eff(fabric_type: str) -> float:
    return EFFICIENCY.get(fabric_type, 0.85)


def _bandwidth_time(plan: _Plan, topo: "Topology", gpudirect: bool = True) -> float:
    return _busiest(plan, _link_seconds(plan, topo, gpudirect))


def _busiest(plan: _Plan, links: "_LinkSeconds") -> float:
    """The plan's bandwidth time at the simple protocol from its links' seconds."""
    if not links:
        return 0.0
    if plan.rounds:
        # Store-and-forward tree: every round moves the whole payload over its slowest link.
        slowest = min(links.capacity.values())
        return plan.rounds * max(plan.edges.values()) / slowest
    return max(links.values())


class _LinkSeconds(dict):
    """Link key -> seconds the plan keeps that link busy alone (its bytes / its rate); the
    rates themselves in ``capacity``."""

    def __init__(self):
        super().__init__()
        self.capacity: dict[tuple, float] = {}


# Which field of a link key names the GPU (a global rank) or the node it belongs to; a
# link keyed by a pair of GPUs ("peer") belongs to that pair alone.
_RANK_LINKS = frozenset({"port_out", "port_in", "bridge_out", "bridge_in", "gpu_pcie_out", "gpu_pcie_in",
                         "host_staging"})
_NODE_LINKS = frozenset({"net_out", "net_in", "net_pcie_out", "net_pcie_in", "pcie_host", "nic_out", "nic_in"})


def links_of_rank(estimate: "Estimate", rank: int, topology: "Topology") -> dict[tuple, float]:
    """The links of ``rank``'s own GPU and node that ``estimate``'s collective uses, each with
    the seconds of its bandwidth time it keeps that link busy (the busiest link: all of it).

    Two collectives of different communicators running at once share these links (FSDP's
    and context parallelism's rings both through a GPU's NVLink port; FSDP's all-gather and a
    pipeline's send both through its NIC), which each estimate alone does not see."""
    if not estimate.link_seconds or estimate.bandwidth_s <= 0:
        return {}
    node = topology.node_of(rank)
    rail = None
    busiest = max(estimate.link_seconds.values())
    out = {}
    for key, seconds in estimate.link_seconds.items():
        name = key[0]
        if name in _RANK_LINKS:
            mine = key[1] == rank
        elif name in ("nic_out", "nic_in"):
            if rail is None:
                rail = _rail(topology, rank, node)[0]
            mine = key[1] == node and key[2] == rail
        elif name in _NODE_LINKS:
            mine = key[1] == node
        else:
            mine = False
        if mine and seconds > 0:
            out[key] = estimate.bandwidth_s * seconds / busiest
    return out


def _link_seconds(plan: _Plan, topo: "Topology", gpudirect: bool = True) -> _LinkSeconds:
    intra_eff = plan.intra_eff if plan.intra_eff is not None else _eff(topo.intra_node.type)
    if plan.algorithm in ("direct", "pairwise") and plan.intra_eff is None:
        # point-to-point (send/recv, all-to-all, gather/scatter) has its own efficiency
        intra_eff = P2P_EFFICIENCY.get(topo.intra_node.type, intra_eff)
    inter_eff = topo.inter_node.efficiency or _eff(topo.inter_node.type)
    load: dict[tuple, float] = defaultdict(float)
    capacity: dict[tuple, float] = {}
    node_pcie: Optional[dict[int, float]] = None   # made on the first spread network edge
    for (a, b), nbytes in plan.edges.items():
        if nbytes <= 0 or a == b:
            continue
        na, nb = topo.node_of(a), topo.node_of(b)
        bridge = topo.bridge_bytes_per_s(a, b) if na == nb else None
        if bridge is not None:
            # an NVLink bridge is its own link, beside the GPU's PCIe port
            ends = ((("bridge_out", a), bridge * _eff("nvlink")), (("bridge_in", b), bridge * _eff("nvlink")))
        elif na == nb:
            ends = ((("port_out", a), topo.gpu_port_bytes_per_s(a) * intra_eff),
                    (("port_in", b), topo.gpu_port_bytes_per_s(b) * intra_eff))
            if plan.algorithm in ("direct", "pairwise"):
                # one peer gets few channels: a per-pair ceiling on fast NVLink ports
                ends += ((("peer", a, b), P2P_PEER_MAX_GBS * 1e9),)
            host = topo.nodes[na].pcie_host_gbs
            if host and _intra_kind(topo, (a, b)) == "pcie":
                # every GPU-to-GPU PCIe flow of the node also crosses the host (root complexes,
                # the link between CPU sockets), which has a rate of its own for all of them
                ends += ((("pcie_host", na), host * 1e9 * intra_eff),)
        elif plan.spread:
            ends = ((("net_out", na), topo.node_network_bytes_per_s(na) * inter_eff),
                    (("net_in", nb), topo.node_network_bytes_per_s(nb) * inter_eff))
        else:
            # a GPU's own rail: its NIC, or its share of the node's NICs when there are more
            # NICs than GPUs (2 x 100G per GPU on a 16-NIC node), shared when there are fewer
            ra, rate_a = _rail(topo, a, na)
            rb, rate_b = _rail(topo, b, nb)
            ends = ((("nic_out", na, ra), rate_a * inter_eff * plan.inter_scale),
                    (("nic_in", nb, rb), rate_b * inter_eff * plan.inter_scale))
        if na != nb and gpudirect:
            # With GPUDirect RDMA the NIC reads and writes GPU memory across the GPU's own PCIe
            # link, whichever NIC it is: however many NICs a node has, a GPU moves no more than
            # its PCIe rate over the network (one H100 with four 400G NICs reaches ~one NIC's
            # worth, NVIDIA/nccl-tests issue 232). Spread channels share the node's GPUs' links.
            if plan.spread:
                if node_pcie is None:
                    node_pcie = _node_pcie_bytes_per_s(plan, topo)
                ends += ((("net_pcie_out", na), node_pcie[na]), (("net_pcie_in", nb), node_pcie[nb]))
            else:
                ends += ((("gpu_pcie_out", a), _gpu_pcie_bytes_per_s(topo, a)),
                         (("gpu_pcie_in", b), _gpu_pcie_bytes_per_s(topo, b)))
        if na != nb and not gpudirect:
            # Without GPUDirect RDMA the bytes are staged in host memory: the GPU writes them
            # there and the NIC reads them (the receiver the other way round), so each crosses
            # the GPU's PCIe link to the host twice, once in each direction. A GPU sending and
            # receiving at once carries its network traffic twice per direction ("~halves",
            # the NCCL maintainers say of a GPU and NIC on one PCIe switch, NVIDIA/nccl 638).
            ends += tuple((("host_staging", r), _gpu_pcie_bytes_per_s(topo, r)) for r in (a, b))
        if na != nb:
            # slow_link faults (docs/faults.md): the pair's bytes count factor times.
            nbytes *= topo.link_factor(na, nb)
        for key, cap in ends:
            load[key] += nbytes
            capacity[key] = cap
    links = _LinkSeconds()
    for key, nbytes in load.items():
        links[key] = nbytes / capacity[key]
    links.capacity = capacity
    return links


def _gpu_pcie_bytes_per_s(topo: "Topology", rank: int) -> float:
    """What NCCL reaches over ``rank``'s own PCIe link to the host and its NICs, each way."""
    return topo.gpu_of(rank).pcie_gbs * 1e9 * _eff("pcie")


def _node_pcie_bytes_per_s(plan: _Plan, topo: "Topology") -> dict[int, float]:
    """Per node, the PCIe links of the plan's GPUs there, summed: spread channels share them."""
    gpus_on: dict[int, set[int]] = defaultdict(set)
    for edge in plan.edges:
        for r in edge:
            gpus_on[topo.node_of(r)].add(r)
    return {node: sum(_gpu_pcie_bytes_per_s(topo, r) for r in gpus) for node, gpus in gpus_on.items()}


def _rail(topo: "Topology", rank: int, node_index: int) -> tuple[int, float]:
    """(rail id, bytes/s) of the NICs ``rank`` drives for rail-bound traffic."""
    node = topo.nodes[node_index]
    per_gpu = max(1, node.nics // max(1, len(node.ranks)))
    return topo.local_index(rank) % node.nics // per_gpu, topo.nic_bytes_per_s(node_index) * per_gpu


def _fixed(seconds: float) -> Callable[[str], float]:
    """Latency of a Simple-only plan (the same whatever protocol is asked)."""
    return lambda proto: seconds


def _bridged_pair(topo: "Topology", members) -> bool:
    """A communicator of exactly two GPUs joined by an NVLink bridge."""
    return len(members) == 2 and topo.bridge_bytes_per_s(members[0], members[1]) is not None


def _intra_kind(topo: "Topology", members) -> str:
    nvlink = topo.intra_node.type in ("nvlink", "nvswitch") and all(topo.gpu_of(r).nvlink_gbs for r in members)
    return "nvlink" if nvlink or _bridged_pair(topo, members) else "pcie"


def _steps(topo: "Topology", members, algorithm: str, intra_steps: float, inter_steps: float) -> Callable[[str], float]:
    """NCCL's latency: base(algorithm, protocol) + intra-node steps x the node-local per-step latency
    + inter-node steps x the network's, each scaled to the protocol (STEP_RATIO); LL's node-local
    steps cost 1.8x when the communicator spans nodes."""
    kind = _intra_kind(topo, members)
    a_intra = topo.intra_node.latency_us * 1e-6
    a_inter = topo.inter_node.latency_us * 1e-6
    multi = inter_steps > 0
    base = BASE_LATENCY_US.get(algorithm, BASE_LATENCY_US["ring"])
    ratio = TREE_STEP_RATIO if algorithm == "tree" else STEP_RATIO

    def latency(proto: str) -> float:
        intra = a_intra * ratio[kind][proto] * (1.8 if multi and proto == "ll" else 1.0)
        net = a_inter * ratio["net"][proto]
        return base[proto] * 1e-6 + intra_steps * intra + inter_steps * net
    return latency


def _node_count(topo: "Topology", members) -> int:
    return len({topo.node_of(r) for r in members})


def _alpha(topo: "Topology", a: int, b: int) -> float:
    link = topo.link(a, b)
    if link.scope == "inter_node":
        return link.latency_s + topo.inter_node.per_message_us * 1e-6
    return link.latency_s


def _max_alpha(topo: "Topology", edges) -> float:
    return max((_alpha(topo, a, b) for a, b in edges if a != b), default=0.0)


def _ring_order(members: list[int], topo: "Topology") -> list[int]:
    """Members ordered node by node, GPU slot by slot, as NCCL's topology search lays rings."""
    return sorted(members, key=lambda r: (topo.node_of(r), topo.local_index(r)))


def _ring_edges(order: list[int]) -> list[tuple[int, int]]:
    n = len(order)
    return [(order[i], order[(i + 1) % n]) for i in range(n)]


def _plans(kind: str, nbytes_per_rank: int, members: list[int], root: int, peer: int,
           topo: "Topology") -> list[_Plan]:
    n = len(members)
    c = float(nbytes_per_rank)   # count * elem_size
    if kind == "SendRecv":
        src, dst = members[root], members[peer]
        if src == dst:
            return []
        return [_Plan("direct", {(src, dst): c}, _fixed(_alpha(topo, src, dst)), spread=False)]
    if n == 1:
        return []
    order = _ring_order(members, topo)
    ring = _ring_edges(order)
    nnodes = _node_count(topo, members)
    protos = PROTOCOLS
    plans: list[_Plan] = []

    if kind == "AllReduce":
        per_edge = 2.0 * (n - 1) / n * c
        # a chunk's path around the ring: 2(n-1) hops, 2N of them between nodes (NCCL's count)
        inter = min(2 * nnodes, 2 * (n - 1)) if nnodes > 1 else 0
        plans.append(_Plan("ring", {e: per_edge for e in ring},
                           _steps(topo, members, "ring", 2 * (n - 1) - inter, inter), protocols=protos,
                           inter_steps=inter))
        if n > 2:
            plans.append(_double_binary_tree(order, c, topo))
        hier = _hierarchical(order, c, topo)
        if hier is not None:
            plans.append(hier)
        plans.extend(_nvls(order, c, topo))
        collnet = _collnet_direct(order, c, topo)
        if collnet is not None:
            plans.append(collnet)
    elif kind in ("AllGather", "ReduceScatter"):
        per_edge = (n - 1) * c   # (n-1)/n of the total n*c
        inter = nnodes - 1
        plans.append(_Plan("ring", {e: per_edge for e in ring},
                           _steps(topo, members, "ring", n - 1 - inter, inter), protocols=protos,
                           inter_steps=inter))
        if nnodes == n > 2:
            # PAT (NCCL 2.23+, one GPU per node): a Bruck-like schedule whose chunks reach every
            # rank in log2(n) network steps instead of the ring's n-1; it moves the ring's bytes
            # (each rank still sends and receives (n-1)/n of the total), Simple protocol only.
            steps = math.ceil(math.log2(n))
            plans.append(_Plan("pat", {e: per_edge for e in ring}, _steps(topo, members, "ring", 0, steps),
                               protocols=("simple",), inter_steps=steps))
    elif kind in ("Broadcast", "Reduce"):
        root_g = members[root]
        start = order.index(root_g)
        chain = order[start:] + order[:start]
        links = [(chain[i], chain[i + 1]) for i in range(n - 1)]
        if kind == "Reduce":
            links = [(b, a) for a, b in links]
        inter = sum(1 for a, b in links if not topo.same_node(a, b))
        plans.append(_Plan("ring", {e: c for e in links}, _steps(topo, members, "ring", len(links) - inter, inter),
                           protocols=protos, inter_steps=inter))
        tree_links, rounds = _binomial(chain)
        if kind == "Reduce":
            tree_links = [(b, a) for a, b in tree_links]
        plans.append(_Plan("tree", {e: c for e in tree_links}, _fixed(rounds * _max_alpha(topo, tree_links)),
                           rounds=rounds))
    elif kind == "AlltoAll":
        edges = {(a, b): c for a in members for b in members if a != b}
        plans.append(_Plan("pairwise", edges, _fixed((n - 1) * _max_alpha(topo, edges)), spread=False))
    elif kind in ("Gather", "Scatter"):
        root_g = members[root]
        others = [r for r in members if r != root_g]
        if kind == "Gather":
            edges = {(r, root_g): c for r in others}
        else:
            edges = {(root_g, r): c for r in others}
        plans.append(_Plan("direct", edges, _fixed(_max_alpha(topo, edges)), spread=False))
    return plans


def _add(edges: dict, a: int, b: int, nbytes: float) -> None:
    edges[(a, b)] = edges.get((a, b), 0.0) + nbytes


def _double_binary_tree(order: list[int], c: float, topo: "Topology") -> _Plan:
    """Two complementary binary trees, each reducing then broadcasting half the payload."""
    n = len(order)
    edges: dict[tuple[int, int], float] = {}
    groups = _uniform_nodes(order, topo)
    if groups is None:
        # one node (or uneven nodes): two binary trees over the ranks
        for shift in (0, 1):
            ranks = order[shift:] + order[:shift]
            for i in range(1, n):
                child, parent = ranks[i], ranks[(i - 1) // 2]
                _add(edges, child, parent, c / 2)   # reduce up
                _add(edges, parent, child, c / 2)   # broadcast down
    else:
        # NCCL's shape across nodes (src/graph/trees.cc, connect.cc): inside each node the GPUs
        # form a chain, and the chains' heads form a binary tree of the nodes; the second tree
        # mirrors the first, so a node that is an inner node in one is a leaf in the other.
        # Each node then sends and receives the payload about once over the network, half a
        # ring's bytes; a binary tree over all the ranks would cross nodes on most of its edges.
        nn = len(groups)
        for mirror in (False, True):
            nodes = groups[::-1] if mirror else groups
            for members in nodes:
                for a, b in zip(members, members[1:]):
                    _add(edges, b, a, c / 2)      # reduce up the chain
                    _add(edges, a, b, c / 2)      # broadcast down
            for i in range(1, nn):
                child, parent = nodes[i][0], nodes[(i - 1) // 2][0]
                _add(edges, child, parent, c * NET_TREE_LOAD)
                _add(edges, parent, child, c * NET_TREE_LOAD)
    # NCCL's tree latency: a chain of g-1 node-local hops and log2(N) network hops, up and down
    nnodes = _node_count(topo, order)
    g = n / nnodes
    inter = math.ceil(math.log2(nnodes)) if nnodes > 1 else 0
    return _Plan("tree", edges, _steps(topo, order, "tree", 2 * (g - 1), 2 * inter), protocols=PROTOCOLS,
                 inter_steps=2 * inter)


def _binomial(chain: list[int]) -> tuple[list[tuple[int, int]], int]:
    n = len(chain)
    links = []
    rounds = 0
    span = 1
    while span < n:
        for i in range(span):
            if i + span < n:
                links.append((chain[i], chain[i + span]))
        span *= 2
        rounds += 1
    return links, rounds


def _uniform_nodes(order: list[int], topo: "Topology") -> Optional[list[list[int]]]:
    """Members grouped per node, or None if nodes hold different numbers of members."""
    groups: dict[int, list[int]] = defaultdict(list)
    for r in order:
        groups[topo.node_of(r)].append(r)
    per_node = list(groups.values())
    if len(per_node) < 2 or len({len(g) for g in per_node}) != 1:
        return None
    return per_node


def _hierarchical(order: list[int], c: float, topo: "Topology") -> Optional[_Plan]:
    """Reduce-scatter inside each node, allreduce each 1/g shard across nodes on its rail,
    allgather inside the node; the stages are pipelined, so the slowest one sets the pace."""
    groups = _uniform_nodes(order, topo)
    if groups is None:
        return None
    g, nn = len(groups[0]), len(groups)
    if g < 2:
        return None
    edges: dict[tuple[int, int], float] = {}
    for members in groups:
        for a, b in _ring_edges(members):
            _add(edges, a, b, 2.0 * (g - 1) / g * c)
    for j in range(g):
        rail = [members[j] for members in groups]
        for a, b in _ring_edges(rail):
            _add(edges, a, b, 2.0 * (nn - 1) / nn * c / g)
    return _Plan("hierarchical", edges, _steps(topo, order, "hierarchical", 2 * (g - 1), 2 * (nn - 1)),
                 spread=False, protocols=PROTOCOLS, inter_steps=2 * (nn - 1))


def _collnet_direct(order: list[int], c: float, topo: "Topology") -> Optional[_Plan]:
    """CollNet Direct (NCCL with a SHARP-capable network, ``inter_node.collnet``): the GPUs of a
    node reduce-scatter among themselves, each sends its 1/g shard once to the network switch,
    which reduces it across all nodes and sends the sum back, and the node allgathers. Unlike
    a ring, the bytes on each NIC do not grow with the node count.

    Bytes: every GPU sends each local peer c/g for the reduce-scatter and c/g for the allgather,
    and its shard c/g up to the switch and back (attributed to the rail ring over the nodes,
    the switch being no rank). Latency: NCCL's Simple base, two node-local and two network
    steps (up to the switch and down), whatever the node count. Simple only.
    """
    if not topo.inter_node.collnet:
        return None
    groups = _uniform_nodes(order, topo)
    if groups is None:
        return None
    g = len(groups[0])
    edges: dict[tuple[int, int], float] = {}
    for members in groups:
        for a in members:
            for b in members:
                if a != b:
                    _add(edges, a, b, 2.0 * c / g)
    for j in range(g):
        rail = [members[j] for members in groups]
        for a, b in _ring_edges(rail):
            _add(edges, a, b, c / g)
    a_intra = topo.intra_node.latency_us * 1e-6
    a_inter = topo.inter_node.latency_us * 1e-6
    steps = 2 * a_intra if g > 1 else 0.0
    return _Plan("collnet_direct", edges, _fixed(BASE_LATENCY_US["ring"]["simple"] * 1e-6 + steps + 2 * a_inter),
                 spread=False, inter_steps=2)


def _nvls_capable(order: list[int], topo: "Topology") -> bool:
    return topo.intra_node.type in ("nvlink", "nvswitch") and all(topo.gpu_of(r).nvls for r in order)


def _nvls(order: list[int], c: float, topo: "Topology") -> list[_Plan]:
    """NVLink SHARP: the switch reduces, so each GPU pushes and pulls the payload about once.

    Modeled with an effective port rate (NVLS_EFFICIENCY) instead of the per-fabric
    efficiency; single node ("nvls") or NVLS inside nodes plus rails between them ("nvls_tree").
    """
    if len(order) < 3 or not _nvls_capable(order, topo):
        return []
    a_intra = topo.intra_node.latency_us * 1e-6
    groups = _uniform_nodes(order, topo)
    if topo.node_of(order[0]) == topo.node_of(order[-1]):
        groups_local = [order]
    elif groups is not None:
        groups_local = groups
    else:
        return []
    edges: dict[tuple[int, int], float] = {}
    for members in groups_local:
        g = len(members)
        if g < 2:
            return []
        for a in members:
            for b in members:
                if a != b:
                    # pairwise S/(g-1) so each port carries S in each direction
                    _add(edges, a, b, c / (g - 1))
    if len(groups_local) == 1:
        return [_Plan("nvls", edges, _fixed(NVLS_BASE_LATENCY_S + 2 * a_intra), intra_eff=NVLS_EFFICIENCY)]
    g, nn = len(groups_local[0]), len(groups_local)
    for j in range(g):
        rail = [members[j] for members in groups_local]
        for a, b in _ring_edges(rail):
            _add(edges, a, b, 2.0 * (nn - 1) / nn * c / g)
    a_inter = topo.inter_node.latency_us * 1e-6
    # NVLS-tree: a tree between the nodes (2 log2 N network hops); beyond two nodes NCCL counts
    # half the network bandwidth, fitted here as NVLS_TREE_INTER_SCALE of it (docs/cost-model.md).
    hops = 2 * math.ceil(math.log2(nn))
    return [_Plan("nvls_tree", edges, _fixed(NVLS_BASE_LATENCY_S + 2 * a_intra + hops * a_inter), spread=False,
                  inter_steps=hops,
                  intra_eff=NVLS_TREE_EFFICIENCY, inter_scale=1.0 if nn <= 2 else NVLS_TREE_INTER_SCALE)]


# -- `python -m fakegpu.costmodel` is `python -m fakegpu model` (fakegpu/cli/model.py) ---------
def main(argv: Optional[Sequence[str]] = None) -> int:
    from fakegpu.cli import model

    return model.main(argv, prog="python -m fakegpu.costmodel")


if __name__ == "__main__":
    raise SystemExit(main())
