"""Fault injection, executed by the coordinator (docs/faults.md).

Faults come from ``FAKEGPU_FAULTS`` (``kind:key=value:...`` items separated by ``;``) and
from the ``faults:`` list of the cluster YAML (the same keys as mappings). Both go through
``build_fault`` so they are validated, and rejected, identically.

Why the coordinator and not the shim: every rank's calls already pass through it with
their global rank, per-communicator call number and op kind, so one parser and one
matcher serve the environment and the YAML, for every process, with no native code. The
rank-side effects are real ones: ``kill`` sends SIGKILL to the rank's process (HELLO pid,
same host only; a remote rank's connection is dropped instead), ``drop`` closes the
rank's connection (it sees ncclSystemError, its peers ncclRemoteError), ``hang`` swallows
the rank's call so it blocks with the connection open (peers time out with ncclTimeout),
``delay`` holds the call back for ``ms`` before it is matched. ``slow_link`` multiplies the
modeled transfer time between two nodes of the cluster config by ``factor``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from fakegpu import protocol as P
from fakegpu.env import ConfigError
from fakegpu.coordinator.matching import D_CALL_SEQ, D_FLAGS, D_HANDLE, D_KIND

RANK_KINDS = ("kill", "hang", "delay", "drop")
KINDS = RANK_KINDS + ("slow_link",)
_OP_NAMES = {name.lower(): name for name in P.KIND_NAMES.values()}
_KEYS = {
    "kill": {"rank", "seq", "op", "count"},
    "hang": {"rank", "seq", "op", "count"},
    "drop": {"rank", "seq", "op", "count"},
    "delay": {"rank", "seq", "op", "count", "ms"},
    "slow_link": {"nodes", "factor"},
}


class FaultSpecError(ConfigError):
    """A fault specification that cannot be used; the message names the item and the key."""


@dataclass
class Fault:
    kind: str
    text: str                       # the item as written, for messages and the report
    rank: Optional[int] = None      # global rank
    seq: Optional[int] = None       # the rank's call number on a communicator (from 1)
    op: Optional[str] = None        # "AllReduce", "Send", ...
    ms: int = 0                     # delay
    count: int = 1                  # times it fires; 0 = every matching call
    nodes: tuple = ()               # slow_link: two node ids
    factor: float = 1.0             # slow_link
    fired: int = field(default=0)

    @property
    def armed(self) -> bool:
        return self.count == 0 or self.fired < self.count

    def matches(self, global_rank: int, desc) -> bool:
        if self.rank is not None and global_rank != self.rank:
            return False
        if self.seq is not None and desc[D_CALL_SEQ] != self.seq:
            return False
        if self.op is not None and P.KIND_NAMES.get(desc[D_KIND]) != self.op:
            return False
        return True

    def to_dict(self) -> dict:
        out = {"kind": self.kind, "spec": self.text}
        if self.kind == "slow_link":
            out.update(nodes=list(self.nodes), factor=self.factor)
        else:
            out.update(rank=self.rank, seq=self.seq, op=self.op, count=self.count, fired=self.fired)
            if self.kind == "delay":
                out["ms"] = self.ms
        return out


def _int(where: str, key: str, value, minimum: int) -> int:
    try:
        number = int(str(value).strip(), 10) if not isinstance(value, bool) else None
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise FaultSpecError(f"{where}: {key}={value!r} must be an integer >= {minimum}")
    return number


def build_fault(kind, params: dict, where: str, text: str) -> Fault:
    """One validated Fault from its kind and key/value pairs (strings or YAML scalars)."""
    if not isinstance(kind, str) or kind.strip().lower() not in KINDS:
        raise FaultSpecError(f"{where}: unknown fault kind {kind!r} (known: {', '.join(KINDS)})")
    kind = kind.strip().lower()
    unknown = sorted(set(params) - _KEYS[kind])
    if unknown:
        raise FaultSpecError(f"{where}: {kind} does not take {', '.join(unknown)} "
                             f"(it takes: {', '.join(sorted(_KEYS[kind]))})")
    fault = Fault(kind, text)
    if kind == "slow_link":
        if "nodes" not in params or "factor" not in params:
            raise FaultSpecError(f"{where}: slow_link needs nodes=A-B (two node ids) and factor=F")
        nodes = params["nodes"]
        if isinstance(nodes, str):
            nodes = nodes.split("-") if nodes.count("-") == 1 else nodes.split(",")
        nodes = tuple(str(n).strip() for n in (nodes or ()))
        if len(nodes) != 2 or not all(nodes) or nodes[0] == nodes[1]:
            raise FaultSpecError(f"{where}: nodes={params['nodes']!r} must name two different nodes, "
                                 "as A-B (or A,B when an id contains '-')")
        try:
            factor = float(params["factor"])
        except (TypeError, ValueError):
            factor = 0.0
        if not factor >= 1.0 or factor == float("inf"):
            raise FaultSpecError(f"{where}: factor={params['factor']!r} must be a number >= 1 "
                                 "(how many times slower the link is)")
        fault.nodes, fault.factor = nodes, factor
        return fault
    if "rank" not in params:
        raise FaultSpecError(f"{where}: {kind} needs rank=N (the global rank it hits)")
    fault.rank = _int(where, "rank", params["rank"], 0)
    if "seq" in params:
        fault.seq = _int(where, "seq", params["seq"], 1)
    if "op" in params:
        name = _OP_NAMES.get(str(params["op"]).strip().lower())
        if name is None:
            raise FaultSpecError(f"{where}: op={params['op']!r} is not an operation "
                                 f"(known: {', '.join(P.KIND_NAMES.values())})")
        fault.op = name
    if "count" in params:
        fault.count = _int(where, "count", params["count"], 0)
    if kind == "delay":
        if "ms" not in params:
            raise FaultSpecError(f"{where}: delay needs ms=N")
        fault.ms = _int(where, "ms", params["ms"], 1)
    return fault


def parse_fault_env(text: Optional[str], name: str = "FAKEGPU_FAULTS") -> list:
    """``kill:rank=1:seq=5;delay:rank=0:op=AllReduce:ms=200`` -> [Fault, Fault]."""
    faults = []
    for i, item in enumerate(x.strip() for x in (text or "").split(";")):
        if not item:
            continue
        where = f"{name} item {i + 1} {item!r}"
        kind, *pairs = item.split(":")
        params = {}
        for pair in pairs:
            key, eq, value = pair.partition("=")
            key = key.strip().lower()
            if not eq or not key or not value.strip():
                raise FaultSpecError(f"{where}: {pair!r} is not key=value")
            if key in params:
                raise FaultSpecError(f"{where}: {key} is given twice")
            params[key] = value.strip()
        faults.append(build_fault(kind, params, where, item))
    return faults


def parse_fault_yaml(items, source: str = "cluster config") -> list:
    """The ``faults:`` list of a cluster YAML: ``[{kind: kill, rank: 1, seq: 5}, ...]``."""
    if items is None:
        return []
    if not isinstance(items, list):
        raise FaultSpecError(f"{source}: faults must be a list of mappings with a 'kind' key")
    faults = []
    for i, item in enumerate(items):
        where = f"{source}: faults[{i}]"
        if not isinstance(item, dict) or "kind" not in item:
            raise FaultSpecError(f"{where}: each fault is a mapping with a 'kind' key ({', '.join(KINDS)})")
        params = {str(k): v for k, v in item.items() if k != "kind"}
        text = ":".join([str(item["kind"])] + [f"{k}={'-'.join(v) if isinstance(v, list) else v}"
                                                for k, v in params.items()])
        faults.append(build_fault(item["kind"], params, where, text))
    return faults


class FaultPlan:
    """The faults of one coordinator run: which rank call they hit, and what they did."""

    def __init__(self, faults: list):
        self.faults = list(faults)
        self.rank_faults = [f for f in self.faults if f.kind in RANK_KINDS]
        self.slow_links = [f for f in self.faults if f.kind == "slow_link"]

    def __bool__(self) -> bool:
        return bool(self.faults)

    @property
    def armed(self) -> bool:
        return any(f.armed for f in self.rank_faults)

    def match(self, global_rank_of, descs) -> Optional[tuple]:
        """The first armed fault hit by a GROUP frame's ops: (fault, desc, member) or None.
        Only the first step of a call counts, so a call cut into steps triggers once."""
        for fault in self.rank_faults:
            if not fault.armed:
                continue
            for d in descs:
                if not d[D_FLAGS] & P.OP_FLAG_FIRST_STEP and d[D_FLAGS] & P.OP_FLAG_LAST_STEP:
                    continue   # a later step of a call that was cut into steps
                member = global_rank_of(d[D_HANDLE])
                if member is not None and fault.matches(member.global_rank, d):
                    fault.fired += 1
                    return fault, d, member
        return None

    def apply_slow_links(self, topology) -> None:
        """Give the topology its slowed node pairs; the node ids must exist in it."""
        if not self.slow_links:
            return
        if topology is None or getattr(topology, "is_default", False):
            raise FaultSpecError("slow_link needs a cluster config (--cluster-config / FAKEGPU_CLUSTER_CONFIG) "
                                 "whose nodes it names")
        ids = [n.id for n in topology.nodes]
        for f in self.slow_links:
            for node in f.nodes:
                if node not in ids:
                    raise FaultSpecError(f"slow_link {f.text!r}: node {node!r} is not in the cluster config "
                                         f"(nodes: {', '.join(ids)})")
            topology.set_link_factor(ids.index(f.nodes[0]), ids.index(f.nodes[1]), f.factor)


def load_plan(env_text: Optional[str], topology) -> FaultPlan:
    """FAKEGPU_FAULTS plus the cluster config's ``faults:`` section."""
    faults = list(getattr(topology, "faults", ()) or ()) + parse_fault_env(env_text)
    plan = FaultPlan(faults)
    plan.apply_slow_links(topology)
    return plan
