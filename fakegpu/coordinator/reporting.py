"""Glue between the core's records and the report layer (fakegpu.report, fakegpu.topology).

The report layer is imported lazily: when it is missing the coordinator still runs, with a
NullRecorder and a warning. Without a cluster YAML the topology is the default one-node
model, sized once the first communicator shows how many ranks the job has (events that
arrive before that are replayed into the report when it is created).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from fakegpu.common.records import NullRecorder

log = logging.getLogger("fakegpu.coordinator")


def load_topology(cluster_config: Optional[str]):
    """The Topology of a cluster YAML (raises the loader's clear error), or None."""
    if not cluster_config:
        return None
    from fakegpu.topology import load_cluster_config
    return load_cluster_config(cluster_config)


def make_cost_fn(topology):
    """estimate_seconds bound to the topology (default topology per call without one), or None."""
    try:
        from fakegpu.costmodel import estimate_seconds
        from fakegpu.topology import default_topology
    except ImportError as exc:
        log.warning("cost model unavailable (%s); SIMULATE requests will fail", exc)
        return None

    cache: dict = {}

    def cost(kind, count, elem_size, global_ranks, root, peer, topo):
        if topo is None:
            size = max(global_ranks) + 1 if global_ranks else 1
            topo = cache.get(size)
            if topo is None:
                topo = cache[size] = default_topology(size)
        return estimate_seconds(kind, count, elem_size, global_ranks, root, peer, topo)

    return cost


class ReportRecorder:
    """A Recorder that feeds ``fakegpu.report.ClusterReport`` and writes it on demand."""

    def __init__(self, topology, *, max_operations: int, metadata: dict,
                 world_size_hint: Callable[[], int] = lambda: 0):
        from fakegpu.report import ClusterReport
        self._cls = ClusterReport
        self.topology = topology
        self.max_operations = max_operations
        self.metadata = metadata
        self.world_size_hint = world_size_hint
        self.report = ClusterReport(topology, max_operations=max_operations, metadata=metadata) \
            if topology is not None else None
        self._early: list = []   # events before the default topology can be sized
        self._warned = False

    def _ensure(self, global_ranks=()) -> bool:
        if self.report is not None:
            return True
        from fakegpu.topology import default_topology
        size = max([self.world_size_hint() or 0, *(g + 1 for g in global_ranks)])
        if size < 1:
            return False
        self.report = self._cls(default_topology(size), max_operations=self.max_operations,
                                metadata=self.metadata)
        early, self._early = self._early, []
        for name, args in early:
            self._call(name, *args)
        return True

    def _call(self, name: str, *args) -> None:
        try:
            getattr(self.report, name)(*args)
        except Exception as exc:  # the report must never break the data path
            if not self._warned:
                log.warning("report layer rejected a %s event: %s", name, exc)
                self._warned = True

    def client_connected(self, client) -> None:
        if self.report is None:
            self._early.append(("client_connected", (client,)))
        else:
            self._call("client_connected", client)

    def client_disconnected(self, client, reason) -> None:
        if self.report is None:
            self._early.append(("client_disconnected", (client, reason)))
        else:
            self._call("client_disconnected", client, reason)

    def comm_created(self, comm, init_wait_s) -> None:
        if self._ensure(comm.global_ranks):
            self._call("comm_created", comm, init_wait_s)

    def op_completed(self, op) -> None:
        if self._ensure(op.comm.global_ranks):
            self._call("op_completed", op)

    def faults_configured(self, faults) -> None:
        if self.report is None:
            self._early.append(("faults_configured", (faults,)))
        else:
            self._call("faults_configured", faults)

    def fault_event(self, event: dict) -> None:
        if self.report is None:
            self._early.append(("fault_event", (event,)))
        else:
            self._call("fault_event", event)

    def write(self, json_path: str, markdown_path: Optional[str], trace_path: Optional[str]) -> Optional[dict]:
        if not self._ensure():
            from fakegpu.topology import default_topology
            self.report = self._cls(default_topology(1), max_operations=self.max_operations,
                                    metadata=self.metadata)
            for name, args in self._early:
                self._call(name, *args)
            self._early = []
        return self.report.write(json_path, markdown_path, trace_path)


def make_recorder(topology, *, report_path: Optional[str], max_operations: int, metadata: dict,
                  world_size_hint: Callable[[], int]):
    """A ReportRecorder, or a NullRecorder when no report is wanted or the layer is missing."""
    if not report_path:
        return NullRecorder()
    try:
        return ReportRecorder(topology, max_operations=max_operations, metadata=metadata,
                              world_size_hint=world_size_hint)
    except ImportError as exc:
        log.warning("report layer unavailable (%s); no cluster report will be written", exc)
        return NullRecorder()


def metadata(transport: str, address: str, cluster_config: Optional[str]) -> dict:
    import os
    from fakegpu import __version__
    return {"coordinator": {"version": __version__, "pid": os.getpid(), "transport": transport,
                            "address": address, "started_at": time.time()},
            "cluster_config": cluster_config}
