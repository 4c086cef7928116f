"""ClusterReport: the Recorder that turns coordinator records into the cluster report.

Every figure in the report comes from one place: each successful operation is costed
once by fakegpu.costmodel, whose per-transfer bytes feed the link, node-pair, rank and
communicator tables, so the tables always add up (``fakegpu report check`` verifies it).
"""
from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from fakegpu import __version__
from fakegpu import costmodel
from fakegpu.common.records import ClientRecord, CommRecord, OpRecord
from fakegpu.report.schedule import ModeledSchedule
from fakegpu.topology import Topology
from fakegpu.topology.model import rank_ranges

SCHEMA_VERSION = 1
_CACHE_LIMIT = 4096


@dataclass
class _KindStats:
    calls: int = 0
    errors: int = 0
    logical_bytes: int = 0
    socket_bytes: int = 0
    bus_bytes: float = 0.0            # sum of logical_bytes x busbw factor, for busbw
    modeled_time_s: float = 0.0
    rendezvous_s: float = 0.0
    execution_s: float = 0.0
    algorithms: Counter = field(default_factory=Counter)
    datatypes: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict:
        return {
            "calls": self.calls,
            "errors": self.errors,
            "logical_bytes": self.logical_bytes,
            "socket_bytes": self.socket_bytes,
            "modeled_time_s": self.modeled_time_s,
            "algbw_gbs": costmodel.algbw_gbs(self.logical_bytes, self.modeled_time_s),
            "busbw_gbs": costmodel.algbw_gbs(self.bus_bytes, self.modeled_time_s),
            "rendezvous_s": self.rendezvous_s,
            "execution_s": self.execution_s,
            "algorithms": dict(sorted(self.algorithms.items())),
            "datatypes": dict(sorted(self.datatypes.items())),
        }


@dataclass
class _LinkStats:
    bytes: int = 0
    transfers: int = 0
    operations: int = 0
    modeled_time_s: float = 0.0
    peak_operation_bytes: int = 0

    def add(self, nbytes: int, transfers: int, seconds: float) -> None:
        self.bytes += nbytes
        self.transfers += transfers
        self.operations += 1
        self.modeled_time_s += seconds
        self.peak_operation_bytes = max(self.peak_operation_bytes, nbytes)


@dataclass
class _PairStats:
    a: int
    b: int
    forward: int = 0                   # bytes a -> b
    backward: int = 0                  # bytes b -> a
    transfers: int = 0
    operations: int = 0
    peak_operation_bytes: int = 0
    modeled_time_s: float = 0.0
    peak_throughput_gbs: float = 0.0
    by_operation: dict = field(default_factory=lambda: defaultdict(lambda: {"operations": 0, "bytes": 0, "transfers": 0}))


@dataclass
class _RankStats:
    rank: int
    pid: Optional[int] = None
    hostname: Optional[str] = None
    transport: Optional[str] = None
    shared_memory: Optional[bool] = None
    connected: bool = False
    disconnect_reason: Optional[str] = None
    wait_s: float = 0.0
    timeouts: int = 0
    errors: int = 0
    absences: int = 0                  # failed collectives this rank never joined
    comm_inits: int = 0
    init_timeouts: int = 0             # communicator inits it waited in until the timeout
    init_wait_s: float = 0.0
    collective_calls: int = 0
    p2p_sends: int = 0
    p2p_recvs: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    modeled_busy_s: float = 0.0
    modeled_clock_s: float = 0.0       # end of its last operation on the modeled timeline


@dataclass
class _CommStats:
    comm: CommRecord
    operations: int = 0
    errors: int = 0
    logical_bytes: int = 0
    modeled_time_s: float = 0.0
    by_kind: Counter = field(default_factory=Counter)


@dataclass
class _Attribution:
    """An estimate's transfers summed the ways the report needs them."""
    sent: dict[int, int]
    received: dict[int, int]
    scopes: dict[str, tuple[int, int]]                  # scope -> (bytes, transfers)
    node_local: dict[int, tuple[int, int]]              # node -> (bytes, transfers)
    pairs: dict[tuple[int, int], tuple[int, int, int]]  # (low, high) node -> (fwd, back, transfers)

    @classmethod
    def of(cls, est: costmodel.Estimate, topo: Topology) -> "_Attribution":
        sent: dict[int, int] = defaultdict(int)
        received: dict[int, int] = defaultdict(int)
        scopes = {"intra_node": [0, 0], "inter_node": [0, 0]}
        local: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        pairs: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0, 0])
        for (src, dst), nbytes in est.transfers.items():
            sent[src] += nbytes
            received[dst] += nbytes
            ns, nd = topo.node_of(src), topo.node_of(dst)
            if ns == nd:
                scopes["intra_node"][0] += nbytes
                scopes["intra_node"][1] += 1
                local[ns][0] += nbytes
                local[ns][1] += 1
            else:
                scopes["inter_node"][0] += nbytes
                scopes["inter_node"][1] += 1
                key = (min(ns, nd), max(ns, nd))
                pairs[key][0 if ns < nd else 1] += nbytes
                pairs[key][2] += 1
        return cls(
            dict(sent), dict(received),
            {k: (v[0], v[1]) for k, v in scopes.items() if v[1]},
            {k: (v[0], v[1]) for k, v in sorted(local.items())},
            {k: (v[0], v[1], v[2]) for k, v in sorted(pairs.items())},
        )


class ClusterReport:
    """Recorder (see fakegpu.common.records) that accumulates the cluster report."""

    def __init__(self, topology: Topology, *, max_operations: int = 4096, metadata: Optional[dict] = None):
        self.topology = topology
        self.max_operations = max(0, int(max_operations))
        self.metadata: dict[str, Any] = dict(metadata or {})
        self._lock = threading.RLock()
        self._created_at = time.time()
        self._clients: dict[int, ClientRecord] = {}
        self._clients_connected = 0
        self._clients_disconnected = 0
        self._ranks: dict[int, _RankStats] = {r: _RankStats(r) for r in range(topology.world_size)}
        self._kinds: dict[str, _KindStats] = {}
        self._p2p = _KindStats()
        self._p2p_intra = 0
        self._p2p_inter = 0
        self._links = {"intra_node": _LinkStats(), "inter_node": _LinkStats()}
        self._per_node_intra: dict[int, _LinkStats] = defaultdict(_LinkStats)
        self._pairs: dict[tuple[int, int], _PairStats] = {}
        self._comms: dict[int, _CommStats] = {}
        self._timeline: list[dict] = []
        self._schedule = ModeledSchedule()
        self._dropped = 0
        self._status = Counter()
        self._unattributed: list[str] = []
        self._unattributed_count = 0
        self._estimates: dict[tuple, costmodel.Estimate] = {}
        # Per-estimate sums of its transfers, so a repeated operation (the common case) costs
        # O(ranks + node pairs) instead of O(transfers), e.g. n^2 for an all-to-all.
        self._attributions: dict[int, tuple[costmodel.Estimate, "_Attribution"]] = {}
        self._faults: list[dict] = []
        self._events: list[dict] = []
        self._events_dropped = 0
        self._event_counts = Counter()
        self._seen_ranks: set[int] = set()   # ranks the job used: connected with RANK, or members

    # -- Recorder protocol -------------------------------------------------------------
    def client_connected(self, client: ClientRecord) -> None:
        with self._lock:
            self._clients[client.client_id] = client
            self._clients_connected += 1
            if client.global_rank >= 0:
                self._seen_ranks.add(client.global_rank)
                stats = self._rank(client.global_rank)
                stats.pid, stats.hostname = client.pid, client.hostname
                stats.transport, stats.shared_memory = client.transport, client.shared_memory
                stats.connected, stats.disconnect_reason = True, None

    def client_disconnected(self, client: ClientRecord, reason: str) -> None:
        with self._lock:
            self._clients_disconnected += 1
            self._clients.pop(client.client_id, None)
            if client.global_rank >= 0:
                stats = self._rank(client.global_rank)
                stats.connected = False
                stats.disconnect_reason = reason or "closed"

    def comm_created(self, comm: CommRecord, init_wait_s: Sequence[float]) -> None:
        with self._lock:
            if comm.comm_id not in self._comms:
                self._comms[comm.comm_id] = _CommStats(comm)
            waits = list(init_wait_s)
            self._seen_ranks.update(comm.global_ranks)
            for i, g in enumerate(comm.global_ranks):
                stats = self._rank(g)
                stats.comm_inits += 1
                if i < len(waits):
                    stats.init_wait_s += float(waits[i])

    def op_completed(self, op: OpRecord) -> None:
        with self._lock:
            try:
                self._record(op)
            except Exception as exc:  # never let accounting take the coordinator down
                self._unattributed_count += 1
                if len(self._unattributed) < 20:
                    self._unattributed.append(f"{op.kind} seq {op.seq} on comm {op.comm.comm_id}: {exc}")

    def faults_configured(self, faults) -> None:
        """The injected faults of this run (fakegpu.coordinator.faults.FaultPlan or dicts)."""
        with self._lock:
            self._fault_objs = list(getattr(faults, "faults", faults))

    def fault_event(self, event: dict) -> None:
        """A failure or recovery event (fault injected, op failed, abort, shrink, disconnect)."""
        with self._lock:
            self._event_counts[event.get("event", "?")] += 1
            if event.get("event") == "init_timeout":
                # The ranks that waited; the missing ones are comm ranks of a communicator that
                # never formed, so their global ranks are unknown (the event lists them).
                for g in event.get("arrived_global_ranks", ()):
                    if isinstance(g, int) and g >= 0:
                        self._rank(g).init_timeouts += 1
            if len(self._events) < max(self.max_operations, 100):
                self._events.append(_jsonable(dict(event)))
            else:
                self._events_dropped += 1

    # -- accounting ---------------------------------------------------------------------
    def _rank(self, g: int) -> _RankStats:
        stats = self._ranks.get(g)
        if stats is None:
            stats = self._ranks[g] = _RankStats(g)
        return stats

    def _estimate(self, op: OpRecord, kind: str) -> costmodel.Estimate:
        key = (kind, op.count, op.elem_size, op.comm.global_ranks, op.root, op.peer)
        est = self._estimates.get(key)
        if est is None:
            if len(self._estimates) >= _CACHE_LIMIT:
                self._estimates.clear()
                self._attributions.clear()
            est = costmodel.estimate(kind, op.count, op.elem_size, op.comm.global_ranks,
                                     op.root, op.peer, self.topology)
            self._estimates[key] = est
        return est

    def _record(self, op: OpRecord) -> None:
        kind = costmodel.normalize_kind(op.kind)
        members = op.comm.global_ranks
        ok = op.status == "ok"
        pair: Optional[tuple[int, int]] = None     # (sender, receiver) global ranks of a SendRecv
        if kind == "SendRecv":
            src = op.root if op.root >= 0 else (op.ranks[0] if len(op.ranks) == 2 else -1)
            dst = op.peer if op.peer >= 0 else (op.ranks[1] if len(op.ranks) == 2 else -1)
            if src >= 0 and dst >= 0:
                if (src, dst) != (op.root, op.peer):
                    op = dataclasses.replace(op, root=src, peer=dst)
                pair = (members[src], members[dst])
                participants = list(pair)
            elif ok:
                raise ValueError("a completed SendRecv needs its sender and receiver")
            else:  # a failed send or recv may know only the side that showed up
                participants = [members[r] for r in op.ranks]
        else:
            participants = [members[r] for r in (op.ranks or range(len(members)))]
        # Everything that can reject the record (unplaced rank, bad kind) runs before any
        # counter moves, so a rejected record leaves the report consistent.
        est = self._estimate(op, kind) if ok else None
        node_of = self.topology.node_of
        for g in participants:
            node_of(g)  # raises for a rank the topology does not place
        ranks = [self._rank(g) for g in participants]
        self._status[op.status] += 1
        comm = self._comms.get(op.comm.comm_id)
        if comm is None:
            comm = self._comms[op.comm.comm_id] = _CommStats(op.comm)
        stats = self._p2p if kind == "SendRecv" else self._kinds.setdefault(kind, _KindStats())
        seconds = est.seconds if est is not None else 0.0
        waits = op.arrival_wait_s
        collective_ok = ok and pair is None
        for r in ranks:
            if waits:
                r.wait_s += float(waits.get(r.rank, 0.0))
            if op.status == "timeout":
                r.timeouts += 1
            elif not ok:
                r.errors += 1
            if collective_ok:
                r.collective_calls += 1
            r.modeled_busy_s += seconds
        if not ok:
            stats.errors += 1
            comm.errors += 1
            if kind != "SendRecv" and op.ranks:
                # Members that never joined: whom the others were waiting for.
                joined = set(participants)
                for g in members:
                    if g not in joined:
                        self._rank(g).absences += 1
        else:
            assert est is not None
            stats.calls += 1
            stats.logical_bytes += op.logical_bytes
            stats.socket_bytes += op.socket_bytes
            stats.bus_bytes += op.logical_bytes * costmodel.busbw_factor(kind, len(members))
            stats.modeled_time_s += est.seconds
            stats.rendezvous_s += op.rendezvous_s
            stats.execution_s += op.execution_s
            stats.algorithms[est.algorithm] += 1
            stats.datatypes[op.datatype] += 1
            comm.operations += 1
            comm.logical_bytes += op.logical_bytes
            comm.modeled_time_s += est.seconds
            comm.by_kind[kind] += 1
            if pair is not None:
                ranks[0].p2p_sends += 1
                ranks[1].p2p_recvs += 1
                if self.topology.same_node(*pair):
                    self._p2p_intra += 1
                else:
                    self._p2p_inter += 1
            self._attribute(kind, est)

        entry = None
        if len(self._timeline) < self.max_operations:
            entry = self._timeline_entry(op, kind, participants, pair, est)
            self._timeline.append(entry)
        else:
            self._dropped += 1
        # Modeled timeline: placed in each rank's program order (fakegpu/report/schedule.py).
        roles = {pair[0]: "send", pair[1]: "recv"} if pair is not None and pair[0] != pair[1] else None
        # tiebreak (seq first): records without arrival times (fake worlds) number their
        # operations in program order
        self._schedule.add(participants, seconds, _arrivals(op), (op.seq, op.comm.comm_id), entry,
                           frames=op.frames, roles=roles)

    def _attribute(self, kind: str, est: costmodel.Estimate) -> None:
        att = self._attributions.get(id(est))
        if att is None or att[0] is not est:
            att = (est, _Attribution.of(est, self.topology))
            self._attributions[id(est)] = att
        a = att[1]
        for rank, nbytes in a.sent.items():
            self._ranks[rank].bytes_sent += nbytes
        for rank, nbytes in a.received.items():
            self._ranks[rank].bytes_received += nbytes
        for scope, (nbytes, transfers) in a.scopes.items():
            self._links[scope].add(nbytes, transfers, est.seconds)
        for node, (nbytes, transfers) in a.node_local.items():
            self._per_node_intra[node].add(nbytes, transfers, est.seconds)
        for (na, nb), (fwd, back, transfers) in a.pairs.items():
            pair = self._pairs.get((na, nb))
            if pair is None:
                pair = self._pairs[(na, nb)] = _PairStats(na, nb)
            total = fwd + back
            pair.forward += fwd
            pair.backward += back
            pair.transfers += transfers
            pair.operations += 1
            pair.modeled_time_s += est.seconds
            pair.peak_operation_bytes = max(pair.peak_operation_bytes, total)
            if est.seconds > 0:
                pair.peak_throughput_gbs = max(pair.peak_throughput_gbs, total / est.seconds / 1e9)
            slot = pair.by_operation[kind]
            slot["operations"] += 1
            slot["bytes"] += total
            slot["transfers"] += transfers

    def _timeline_entry(self, op: OpRecord, kind: str, participants: list[int],
                        pair: Optional[tuple[int, int]], est: Optional[costmodel.Estimate]) -> dict:
        members = op.comm.global_ranks
        return {
            "seq": op.seq,
            "comm_id": op.comm.comm_id,
            "comm_name": op.comm.name,
            "kind": kind,
            "status": op.status,
            "error": op.error,
            "global_ranks": list(participants),
            "root": members[op.root] if 0 <= op.root < len(members) and kind != "SendRecv" else None,
            "src": pair[0] if pair else None,
            "dst": pair[1] if pair else None,
            "datatype": op.datatype,
            "redop": op.redop,
            "count": op.count,
            "elem_size": op.elem_size,
            "logical_bytes": op.logical_bytes,
            "socket_bytes": op.socket_bytes,
            "started_at": op.started_at,
            "rendezvous_s": op.rendezvous_s,
            "execution_s": op.execution_s,
            "algorithm": est.algorithm if est else None,
            "modeled_s": est.seconds if est else 0.0,
            "modeled_start_s": 0.0,   # set by the schedule
            "intra_node_bytes": est.intra_node_bytes if est else 0,
            "inter_node_bytes": est.inter_node_bytes if est else 0,
        }

    # -- output --------------------------------------------------------------------------
    def to_dict(self) -> dict:
        with self._lock:
            return self._build()

    def _build(self) -> dict:
        topo = self.topology
        for g, end in self._schedule.clocks().items():
            self._rank(g).modeled_clock_s = end
        # program order on the modeled timeline, whatever order the operations were reported in
        self._timeline.sort(key=lambda e: (e["modeled_start_s"], e["comm_id"], e["seq"]))
        nodes = topo.nodes
        kinds = {k: s.to_dict() for k, s in sorted(self._kinds.items())}
        p2p = self._p2p
        totals_ops = sum(s.calls for s in self._kinds.values()) + p2p.calls
        totals = {
            "operations": totals_ops,
            "failed_operations": sum(s.errors for s in self._kinds.values()) + p2p.errors,
            "logical_bytes": sum(s.logical_bytes for s in self._kinds.values()) + p2p.logical_bytes,
            "socket_bytes": sum(s.socket_bytes for s in self._kinds.values()) + p2p.socket_bytes,
            "modeled_time_s": sum(s.modeled_time_s for s in self._kinds.values()) + p2p.modeled_time_s,
            "modeled_makespan_s": max((r.modeled_clock_s for r in self._ranks.values()), default=0.0),
            "by_status": dict(sorted(self._status.items())),
            "unattributed_operations": self._unattributed_count,
        }
        links = {}
        for scope, link in self._links.items():
            fabric = topo.intra_node if scope == "intra_node" else topo.inter_node
            entry = {
                "fabric_type": fabric.type,
                "bandwidth_gbps": fabric.bandwidth_gbps,
                "latency_us": fabric.latency_us,
                "oversubscription": fabric.oversubscription,
                "bytes": link.bytes,
                "transfers": link.transfers,
                "operations": link.operations,
                "peak_operation_bytes": link.peak_operation_bytes,
                "modeled_time_s": link.modeled_time_s,
                "modeled_avg_throughput_gbs": costmodel.algbw_gbs(link.bytes, link.modeled_time_s),
            }
            if scope == "intra_node":
                entry["per_node"] = [
                    {
                        "node": nodes[i].id,
                        "bytes": s.bytes,
                        "transfers": s.transfers,
                        "operations": s.operations,
                        "peak_operation_bytes": s.peak_operation_bytes,
                        "modeled_time_s": s.modeled_time_s,
                    }
                    for i, s in sorted(self._per_node_intra.items())
                ]
            links[scope] = entry
        pairs = []
        for (a, b), p in sorted(self._pairs.items()):
            na, nb = nodes[a].id, nodes[b].id
            total = p.forward + p.backward
            pairs.append({
                "nodes": [na, nb],
                "hosts": [nodes[a].host, nodes[b].host],
                "directions": {f"{na}->{nb}": p.forward, f"{nb}->{na}": p.backward},
                "total_bytes": total,
                "transfers": p.transfers,
                "operations": p.operations,
                "peak_operation_bytes": p.peak_operation_bytes,
                "modeled_time_s": p.modeled_time_s,
                "modeled_avg_throughput_gbs": costmodel.algbw_gbs(total, p.modeled_time_s),
                "modeled_peak_throughput_gbs": p.peak_throughput_gbs,
                "by_operation": {k: dict(v) for k, v in sorted(p.by_operation.items())},
            })
        ranks = []
        for g, r in sorted(self._ranks.items()):
            placed = g < topo.world_size
            ranks.append({
                "rank": g,
                "node": topo.node_id_of(g) if placed else None,
                "gpu_profile": topo.gpu_of(g).name if placed else None,
                "pid": r.pid,
                "hostname": r.hostname,
                "transport": r.transport,
                "shared_memory": r.shared_memory,
                "connected": r.connected,
                "disconnect_reason": r.disconnect_reason,
                "wait_s": r.wait_s,
                "timeouts": r.timeouts,
                "errors": r.errors,
                "absences": r.absences,
                "comm_inits": r.comm_inits,
                "init_timeouts": r.init_timeouts,
                "init_wait_s": r.init_wait_s,
                "collective_calls": r.collective_calls,
                "p2p_sends": r.p2p_sends,
                "p2p_recvs": r.p2p_recvs,
                "bytes_sent": r.bytes_sent,
                "bytes_received": r.bytes_received,
                "modeled_busy_s": r.modeled_busy_s,
                "modeled_end_s": r.modeled_clock_s,
            })
        comms = []
        for cid, c in sorted(self._comms.items()):
            members = list(c.comm.global_ranks)
            node_ids = sorted({topo.node_id_of(g) for g in members if g < topo.world_size})
            comms.append({
                "id": cid,
                "name": c.comm.name,
                "parent_id": c.comm.parent_id,
                "size": len(members),
                "members": members,
                "nodes": node_ids,
                "operations": c.operations,
                "errors": c.errors,
                "logical_bytes": c.logical_bytes,
                "modeled_time_s": c.modeled_time_s,
                "by_kind": dict(sorted(c.by_kind.items())),
            })
        notes = [
            "modeled_* figures come from the alpha-beta cost model on the topology (docs/cost-model.md); "
            "they estimate the time on the described cluster, not what this machine measured.",
            "rendezvous_s and execution_s are wall-clock times observed by the coordinator.",
        ]
        if topo.is_default:
            notes.append(
                f"No cluster config was given: the default topology (one node, {topo.world_size} "
                f"{topo.gpu_of(0).name} GPUs on NVLink) was assumed."
            )
        notes.extend(f"cluster config warning: {w}" for w in topo.warnings)
        unused = self.unused_ranks_warning()
        if unused:
            notes.append(f"cluster config warning: {unused}")
        if self._dropped:
            notes.append(f"The timeline kept the first {self.max_operations} operations; "
                         f"{self._dropped} later ones are counted in the summaries only.")
        notes.extend(f"unattributed: {u}" for u in self._unattributed)
        return {
            "schema_version": SCHEMA_VERSION,
            "generator": {"name": "fakegpu", "version": __version__, "host": socket.gethostname()},
            "generated_at": time.time(),
            "started_at": self._created_at,
            "world_size": topo.world_size,
            "metadata": _jsonable(self.metadata),
            "topology": topo.to_dict(),
            "clients": {
                "connected_total": self._clients_connected,
                "disconnected_total": self._clients_disconnected,
                "connected_now": len(self._clients),
            },
            "totals": totals,
            "collectives": kinds,
            "point_to_point": {
                "operations": p2p.calls,
                "sends": p2p.calls,
                "recvs": p2p.calls,
                "errors": p2p.errors,
                "bytes": p2p.logical_bytes,
                "socket_bytes": p2p.socket_bytes,
                "modeled_time_s": p2p.modeled_time_s,
                "intra_node_operations": self._p2p_intra,
                "inter_node_operations": self._p2p_inter,
                "modeled_avg_throughput_gbs": costmodel.algbw_gbs(p2p.logical_bytes, p2p.modeled_time_s),
            },
            "links": links,
            "node_pairs": pairs,
            "ranks": ranks,
            "communicators": comms,
            "timeline": {
                "max_operations": self.max_operations,
                "retained": len(self._timeline),
                "dropped_operations": self._dropped,
                "operations": [dict(e) for e in self._timeline],
            },
            "notes": notes,
            "events": {
                "faults": [_jsonable(f.to_dict() if hasattr(f, "to_dict") else dict(f))
                           for f in getattr(self, "_fault_objs", [])],
                "retained": len(self._events),
                "dropped": self._events_dropped,
                "by_event": dict(sorted(self._event_counts.items())),
                "items": [dict(e) for e in self._events],
            },
        }

    def unused_ranks_warning(self) -> Optional[str]:
        """When the cluster config places ranks the job never used: which ones (else None)."""
        topo = self.topology
        with self._lock:
            if topo.is_default or not self._seen_ranks:
                return None
            unused = [g for g in range(topo.world_size) if topo.places(g) and g not in self._seen_ranks]
            if not unused:
                return None
            used = topo.world_size - len(unused)
            return (f"{topo.describe()} places {topo.world_size} ranks but the job used {used}: ranks "
                    f"{rank_ranges(unused)} never connected or joined a communicator, and their nodes' "
                    "figures describe idle GPUs")

    def write(self, json_path, markdown_path=None, trace_path=None) -> dict:
        """Write the JSON report (and Markdown beside it, and a trace if asked) atomically.

        Returns the paths written, keyed "json", "markdown" and "trace".
        """
        from .writer import write_report_files

        return write_report_files(self.to_dict(), json_path, markdown_path, trace_path)


def _arrivals(op: OpRecord) -> dict[int, float]:
    """Each participant's arrival wall time: the record's own, else what its waits imply (the
    last arrival, started_at + rendezvous_s, minus the rank's wait), else started_at."""
    if op.arrived_at:
        return dict(op.arrived_at)
    last = op.started_at + op.rendezvous_s
    if op.arrival_wait_s:
        return {g: last - w for g, w in op.arrival_wait_s.items()}
    return {g: op.started_at for g in op.comm.global_ranks}


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
