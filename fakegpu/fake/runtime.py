"""The per-process fake world: launch contract, event log, whole-world accountant, report.

One ``FakeWorld`` per process (``current()``).  Front ends (the torch process group, the
memory capture) call :meth:`FakeWorld.comm_op`; the world decides which operations this
process accounts (so that several physical processes never count the same traffic twice),
logs them as events, feeds the accountant, and writes the report once, at exit or when the
default process group is destroyed.

Accounting policy (docs/fake-worlds.md): which process accounts an operation, with which
tiling, is the shim's rule (native/src/fake/fake_accounting.cc, through
fakegpu.fake.accounting), which the native fake mode follows too.
- Physical rank 0 (the store's host) writes the report; the others hand their events over
  through the store (no shared filesystem needed).
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
import zlib
from typing import Optional, Sequence

from . import accounting as _accounting
from . import contract as _contract
from .events import EventLog, replay
from .world import WorldAccountant

_lock = threading.Lock()
_current: Optional["FakeWorld"] = None
_EVENTS_KEY = "fakegpu_fake/events/"


def _log(msg: str) -> None:
    if os.environ.get("FAKEGPU_QUIET", "0") != "1":
        print(f"fakegpu fake: {msg}", file=sys.stderr, flush=True)


def load_topology(world_size: int, path: Optional[str] = None):
    from fakegpu.topology import default_topology, load_cluster_config

    path = path or os.environ.get("FAKEGPU_CLUSTER_CONFIG") or None
    return load_cluster_config(path) if path else default_topology(world_size)


class FakeWorld:
    def __init__(self, lc: _contract.LaunchContract, *, topology=None,
                 report_path: Optional[str] = None, markdown_path: Optional[str] = None,
                 events_path: Optional[str] = None):
        self.contract = lc
        # FAKEGPU_FAKE_REPORT_PATH wins: under fgpu a coordinator may own FAKEGPU_CLUSTER_REPORT_PATH.
        fake_path = os.environ.get("FAKEGPU_FAKE_REPORT_PATH")
        self.report_path = report_path if report_path is not None else \
            fake_path or os.environ.get("FAKEGPU_CLUSTER_REPORT_PATH")
        self.markdown_path = markdown_path if markdown_path is not None else (
            None if fake_path else os.environ.get("FAKEGPU_CLUSTER_REPORT_MARKDOWN_PATH") or None)
        events_path = events_path if events_path is not None else os.environ.get("FAKEGPU_FAKE_EVENTS_PATH")
        if events_path and lc.physical_world_size > 1:
            events_path = f"{events_path}.rank{lc.physical_rank}"
        self.log = EventLog(events_path or None)
        self.log.add_line(_accounting.world_line(lc, "torch"))
        self._topology = topology
        self._accountant: Optional[WorldAccountant] = None
        self._comm_ids: dict[tuple, int] = {}
        self._placed: dict[tuple, tuple] = {}   # operation -> (placement, line)
        self.store = None            # set by the default process group (hybrid event hand-over)
        self.finished = False
        self.written: dict = {}
        self.memory: list[dict] = []
        self._lock = threading.RLock()

    # -- who accounts what ---------------------------------------------------------------------
    @property
    def is_lead(self) -> bool:
        """Physical rank 0 writes the report: it also hosts the store the others hand
        their events to, so it is the one process sure to outlive the hand-over."""
        return self.contract.physical_rank == 0

    # -- events ---------------------------------------------------------------------------------
    def _comm_id(self, name: str, members: tuple[int, ...]) -> int:
        key = (name, members)
        cid = self._comm_ids.get(key)
        if cid is None:
            cid = self._comm_ids[key] = len(self._comm_ids)
            self.log.add_line(_accounting.comm_line(cid, name, members))
        return cid

    @property
    def accountant(self) -> WorldAccountant:
        if self._accountant is None:
            topo = self._topology or load_topology(self.contract.world_size)
            self._accountant = WorldAccountant(topo, self.contract.world_size,
                                               metadata={"mode": "fake"})
        return self._accountant

    def comm_op(self, name: str, members: Sequence[int], rank: int, kind: str, datatype: str,
                elem_size: int, count: int, *, redop: Optional[str] = None, root: int = -1,
                peer: int = -1) -> bool:
        """Log and account one operation issued by comm rank ``rank`` (for ``SendRecv``,
        ``root`` is the sender's comm rank and ``peer`` the receiver's); False if another
        process accounts it.  Who accounts what is the shim's rule (fakegpu.fake.accounting)."""
        members = tuple(int(m) for m in members)
        with self._lock:
            if self.finished:
                return False
            known = self._comm_ids.get((name, members))
            cid = len(self._comm_ids) if known is None else known
            # A training loop repeats the same operations every step: their lines are reused
            # (only for a registered communicator: an id not yet given out names no members).
            key = (cid, kind, datatype, elem_size, count, redop, root, peer, rank)
            placed = self._placed.get(key) if known is not None else None
            if placed is None:
                placed = _accounting.op_event(self.contract, members, cid, kind, datatype, elem_size, count,
                                              redop=redop, root=root, peer=peer, rank=rank)
                if known is not None:
                    if len(self._placed) >= 4096:
                        self._placed.clear()
                    self._placed[key] = placed
            where, line = placed
            if line is None:
                return False
            self._comm_id(name, members)   # its comm line precedes the first op
            self.log.add_line(line)
            if self.is_lead:
                self.accountant.op(name, members, kind, datatype, elem_size, count, redop=redop,
                                   root=root, peer=peer, domain=where.domain, owned=where.owned,
                                   spread=where.spread)
        return True

    def memory_capture(self, record: dict) -> None:
        with self._lock:
            self.memory.append(record)
            self.log.add({"event": "memory", **record})

    # -- the end --------------------------------------------------------------------------------
    def finish(self, timeout_s: Optional[float] = None) -> dict:
        """Write the report (lead) or hand the events to the lead (others).  Idempotent."""
        with self._lock:
            if self.finished:
                return self.written
            self.finished = True
        lc = self.contract
        timeout_s = float(os.environ.get("FAKEGPU_FAKE_MERGE_TIMEOUT", "60")) if timeout_s is None else timeout_s
        self.log.close()
        if not self.is_lead:
            if self.store is not None:
                try:
                    self.store.set(f"{_EVENTS_KEY}{lc.physical_rank}", zlib.compress(self.log.dumps().encode()))
                except Exception as exc:  # the lead may be gone; nothing else to do at exit
                    _log(f"could not hand events to the lead process: {exc}")
            return self.written
        missing = []
        for r, g in enumerate(lc.physical_ranks):
            if g == lc.logical_rank:
                continue
            if self.store is None:
                missing.append(r)
                continue
            key = f"{_EVENTS_KEY}{r}"
            deadline = time.monotonic() + timeout_s
            blob = None
            while time.monotonic() < deadline:
                try:
                    if self.store.check([key]):
                        blob = self.store.get(key)
                        break
                except Exception:
                    break
                time.sleep(0.05)
            if blob is None:
                missing.append(r)
                continue
            text = zlib.decompress(bytes(blob)).decode()
            theirs = replay((json.loads(line) for line in text.splitlines() if line.strip()),
                            self.accountant, source=f"physical rank {r}")
            self.memory.extend(theirs["memory"])
        acc = self.accountant
        extra = {**lc.to_dict(), "events_from_physical_ranks": [r for r in range(lc.physical_world_size)
                                                                 if r not in missing]}
        if missing:
            extra["missing_physical_ranks"] = missing
        meta = acc.finish_metadata(extra)
        acc.report.metadata["mode"] = "fake"
        acc.report.metadata["logical_world_size"] = lc.world_size
        acc.report.metadata["physical_logical_ranks"] = list(lc.physical_ranks)
        if self.memory:
            from .memory import summarize_for_report
            acc.report.metadata["memory_captures"] = summarize_for_report(self.memory)
        notes = [f"fake world ({lc.mode}): {lc.world_size} logical ranks, physical logical ranks "
                 f"{list(lc.physical_ranks)}; every communicator's traffic is replicated over the groups of "
                 f"the same shape (SPMD assumption), so the tables estimate the whole logical world."]
        if meta.get("untiled_communicators"):
            notes.append("communicators that do not tile the world were accounted alone: "
                         + ", ".join(sorted(meta["untiled_communicators"])))
        if missing:
            notes.append(f"no events arrived from physical ranks {missing}: their traffic is missing")
        acc.report.extra_notes.extend(notes)
        if self.report_path:
            self.written = acc.report.write(self.report_path, self.markdown_path)
            _log(f"report written to {self.written['json']} ({acc.records} replica records "
                 f"from {acc.ops} operations)")
        return self.written


def current() -> Optional[FakeWorld]:
    return _current


def get_or_create(lc: Optional[_contract.LaunchContract] = None, **kw) -> FakeWorld:
    global _current
    with _lock:
        if _current is None or _current.finished:
            _current = FakeWorld(lc or _contract.resolve(), **kw)
        return _current


def reset() -> None:
    """Forget the current world without writing anything (tests)."""
    global _current
    with _lock:
        _current = None


def _at_exit() -> None:
    world = _current
    if world is not None and not world.finished:
        try:
            world.finish()
        except Exception as exc:
            _log(f"writing the fake-world report failed: {exc}")


atexit.register(_at_exit)
