"""The fake-world event format: what a fake process did, one JSON object per line.

Any fake-world front end (the torch backend here, the native shim's fake mode later) writes
these; :mod:`fakegpu.fake.build_report` turns them into a whole-world cluster report.

Lines (``"event"`` says which kind; unknown keys are ignored, unknown events skipped):

``{"event": "world", "version": 1, "mode": "fake", "logical_world_size": 1024,
   "logical_rank": 0, "physical_rank": 0, "physical_logical_ranks": [0], "pp_degree": 4,
   "pp_rank": 0}``
    Starts the events of one process.  Comm ids below are local to the most recent
    ``world`` line, so the files of several processes can simply be concatenated.

``{"event": "comm", "id": 3, "name": "mesh_dp", "members": [0, 8, 16, ...]}``
    A communicator: ``members[i]`` is the global logical rank of comm rank i.

``{"event": "op", "comm": 3, "kind": "AllReduce", "dtype": "float32", "elem_size": 4,
   "count": 1024, "redop": "sum", "root": -1, "peer": -1, "rank": 0, "domain": [0, 1024]}``
    One operation as NCCL would see it: ``count`` is the NCCL count (per-rank elements for
    all-gather/reduce-scatter/all-to-all, as in OpRecord), ``root`` the root's comm rank
    (or the sender for ``SendRecv``), ``peer`` the receiver of a ``SendRecv``, ``rank`` the
    issuing process's comm rank.  ``domain`` [lo, hi) limits the replica tiling to those
    logical ranks (absent or null: the whole world); ``owned`` [lo, hi), when present,
    keeps only the replicas whose lowest member lies in it (several processes sharing the
    replicas of one communicator shape); ``"spread": true`` on a SendRecv makes it stand
    for every transfer with the same offset in the group, k -> k + (peer - root) (pure
    fake: the other pipeline stages' or ring members' transfers).  Kinds: AllReduce, Broadcast, Reduce,
    AllGather, ReduceScatter, AlltoAll, Gather, Scatter, SendRecv (any spelling
    ``fakegpu.costmodel.normalize_kind`` accepts).

``{"event": "memory", "point": "after_init", "logical_rank": 0, ...}``
    A memory capture (fakegpu.fake.memory); kept in the report's metadata.
"""
from __future__ import annotations

import json
import os
import threading
from typing import IO, Iterable, Iterator, Optional

VERSION = 1


class EventFormatError(ValueError):
    pass


class EventLog:
    """Collects event lines in memory and, if given a path, appends them to a JSON-lines file.

    The world, comm and op lines come ready-made from the shim's encoder
    (fakegpu.fake.accounting: the native fake mode writes the same lines); other events
    (memory captures) are dicts encoded here."""

    def __init__(self, path: Optional[str] = None):
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._file: Optional[IO[str]] = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "w", encoding="utf-8")
        self.path = path

    def add(self, event: dict) -> None:
        self.add_line(json.dumps(event, separators=(",", ":")))

    def add_line(self, line: str) -> None:
        """One complete JSON object, without its newline."""
        with self._lock:
            self.lines.append(line)
            if self._file is not None:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def dumps(self) -> str:
        with self._lock:
            return "".join(line + "\n" for line in self.lines)


def parse_lines(lines: Iterable[str], source: str = "<events>") -> Iterator[dict]:
    for lineno, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EventFormatError(f"{source}:{lineno}: not JSON ({exc.msg})") from None
        if not isinstance(event, dict) or "event" not in event:
            raise EventFormatError(f"{source}:{lineno}: an event is a JSON object with an \"event\" key")
        yield event


def read_events(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return list(parse_lines(fh, path))


def replay(events: Iterable[dict], accountant, source: str = "<events>") -> dict:
    """Feed ``events`` to a WorldAccountant; returns {"worlds": [...], "memory": [...]}."""
    comms: dict[int, tuple[str, list[int]]] = {}
    worlds: list[dict] = []
    memory: list[dict] = []
    for i, event in enumerate(events, 1):
        kind = event.get("event")
        if kind == "world":
            if int(event.get("version", VERSION)) > VERSION:
                raise EventFormatError(f"{source}: event version {event['version']} is newer than {VERSION}")
            comms = {}
            worlds.append({k: v for k, v in event.items() if k != "event"})
        elif kind == "comm":
            try:
                comms[int(event["id"])] = (str(event.get("name", "")), [int(m) for m in event["members"]])
            except (KeyError, TypeError, ValueError):
                raise EventFormatError(f"{source}: event {i}: a comm event needs an integer id and "
                                       f"a list of member ranks") from None
        elif kind == "op":
            try:
                name, members = comms[int(event["comm"])]
            except (KeyError, TypeError, ValueError):
                raise EventFormatError(f"{source}: event {i}: op on unknown communicator "
                                       f"{event.get('comm')!r} (its comm event must come first)") from None
            domain = event.get("domain")
            owned = event.get("owned")
            try:
                accountant.op(name, members, event["kind"], str(event.get("dtype", "uint8")),
                              int(event.get("elem_size", 1)), int(event["count"]),
                              redop=event.get("redop"), root=int(event.get("root", -1)),
                              peer=int(event.get("peer", -1)),
                              domain=tuple(domain) if domain else None,
                              owned=tuple(owned) if owned else None,
                              spread=bool(event.get("spread", False)))
            except KeyError as exc:
                raise EventFormatError(f"{source}: event {i}: op event lacks {exc}") from None
            except ValueError as exc:
                raise EventFormatError(f"{source}: event {i}: {exc}") from None
        elif kind == "memory":
            memory.append({k: v for k, v in event.items() if k != "event"})
    return {"worlds": worlds, "memory": memory}
