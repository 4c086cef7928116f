"""Fault injection (FAKEGPU_FAULTS): kills, drops, hangs and delays applied to a rank's calls.
"""
from __future__ import annotations

from fakegpu import protocol as P
from fakegpu.coordinator.matching import D_CALL_SEQ, D_KIND, GroupState, describe_op
from fakegpu.coordinator.registry import Client, Member

from .common import CLOSE, KILL, log


class InjectionMixin:
    """The Core's injection (mixed into fakegpu.coordinator.core.Core)."""

    def _inject(self, client: Client, group: GroupState, descs: list, fault, d, member: Member) -> bool:
        """Carry out a fault that hit this GROUP frame; True when the frame is not to be
        submitted now (the rank is killed, dropped, hung or delayed)."""
        comm = member.comm
        where = (f"{comm.label()} rank {member.rank} (global {member.global_rank}) call {d[D_CALL_SEQ]} "
                 f"{describe_op(d)}")
        info = dict(kind=fault.kind, spec=fault.text, rank=member.global_rank, comm=comm.id,
                    comm_rank=member.rank, call_seq=d[D_CALL_SEQ], op=P.KIND_NAMES.get(d[D_KIND]))
        log.warning("fault injected: %s at %s", fault.text, where)
        if fault.kind == "delay":
            self._event("fault_injected", ms=fault.ms, **info)
            self._delayed.append((self.clock() + fault.ms / 1000.0, client, group, descs))
            return True
        if fault.kind == "hang":
            # The call is swallowed: the rank blocks with its connection open, its peers time out.
            self._event("fault_injected", **info)
            return True
        if fault.kind == "kill":
            info["action"] = self._kill(client)
        self._event("fault_injected", **info)
        client.close(f"injected fault {fault.text}")
        self._out.append((CLOSE, client.id, f"fault injected: {fault.text} at {where}"))
        return True

    def _kill(self, client: Client) -> str:
        """Asks the I/O layer to SIGKILL the rank's process (a KILL action) when it runs on this
        host; what happens is said in the fault event."""
        pid = client.hello.pid
        local = client.transport == "unix" or client.hello.hostname == self.hostname
        if not local or pid <= 1 or pid in self.own_pids:
            return f"connection dropped (pid {pid} on {client.hello.hostname or '?'} cannot be signalled here)"
        self._out.append((KILL, client.id, pid))
        return f"SIGKILL sent to pid {pid}"

    def _release_delayed(self, now: float) -> None:
        due = [x for x in self._delayed if x[0] <= now]
        if not due:
            return
        self._delayed = [x for x in self._delayed if x[0] > now]
        for _, client, group, descs in due:
            if not client.closed and client.groups.get(group.request_id) is group:
                self._submit_group(client, group, descs)
