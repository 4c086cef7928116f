"""The coordinator's logic, sans I/O, in one class put together from its parts.

``Core`` (dispatch.py) takes decoded frames and returns actions for the I/O layer (server.py);
each part owns one responsibility and the state that goes with it:

| module | job |
|---|---|
| dispatch.py | the entry points (on_frame, tick, disconnect, executed), HELLO, authentication, PING, SHUTDOWN |
| communicators.py | COMM_INIT / SPLIT / SHRINK rendezvous, identities, COMM_FREE, members going away |
| groups.py | GROUP / ACCOUNT frames, collective matching by (match_seq, step_index), execution, failed calls |
| p2p.py | Send/Recv matching per (communicator, sender, receiver) |
| arenas.py | host-local arenas (ARENA, LOCAL_OPS) |
| accounting.py | events, SIMULATE, the records the reports are built from |
| injection.py | FAKEGPU_FAULTS: kills, drops, hangs, delays |
| common.py | constants and frame helpers they share |

State lives in the containers ``Core.__init__`` creates (dispatch.py); the registry
(fakegpu/coordinator/registry.py) and matching (fakegpu/coordinator/matching.py) modules
define the objects in them. Each object with a lifecycle (client, communicator, member,
rendezvous, collective slot, Send/Recv step) has a named ``state`` and moves only through
named transitions (fakegpu/coordinator/states.py; the table is in docs/architecture.md,
"Coordinator states"). The core has no side effects but its actions: socket writes and
closes, SIGKILLs and arena flag writes are all performed by server.py.
"""
from .common import (ARENA_ACTIONS, ARENA_CLOSE, ARENA_CLOSING, ARENA_FAILED, ARENA_PENDING, CLOSE, DEFAULT_STAGING_BYTES, KILL, MAX_STAGING_BYTES, MIN_STAGING_BYTES, OFFLOAD_MIN_BYTES, SEND,
                     SHUTDOWN, default_staging_factory, error_frame, frame_bytes, logical_bytes)
from .dispatch import Core
from .groups import Execution

__all__ = ["ARENA_ACTIONS", "ARENA_CLOSE", "ARENA_CLOSING", "ARENA_FAILED", "ARENA_PENDING", "CLOSE", "KILL", "DEFAULT_STAGING_BYTES", "MAX_STAGING_BYTES", "MIN_STAGING_BYTES", "OFFLOAD_MIN_BYTES", "SEND",
           "SHUTDOWN", "Core", "Execution", "default_staging_factory", "error_frame", "frame_bytes", "logical_bytes"]
