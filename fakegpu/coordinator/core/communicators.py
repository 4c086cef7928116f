"""Communicators: COMM_INIT / COMM_SPLIT / COMM_SHRINK rendezvous, identity checks, COMM_FREE, and what
happens to a communicator's calls when a member goes away or a rendezvous times out.
"""
from __future__ import annotations

from typing import Optional

from fakegpu import protocol as P
from fakegpu.coordinator.matching import Step, describe_op
from fakegpu.coordinator.registry import (Client, Comm, InitRendezvous, Member, ShrinkRendezvous,
                                          SplitRendezvous, assign_global_ranks)
from fakegpu.coordinator.states import MemberState, RendezvousState
from fakegpu.topology.model import rank_ranges

from .common import frame_bytes, log

NCCL_SPLIT_NOCOLOR = -1   # ncclCommSplit's color for "in no new communicator" (nccl.h)


class CommunicatorsMixin:
    """The Core's communicators (mixed into fakegpu.coordinator.core.Core)."""

    def _uid_label(self, rdv: InitRendezvous) -> str:
        return f"(unique id {rdv.uid[:8].hex()}…" + (f", name {rdv.name!r}" if rdv.name else "") + ")"

    def _new_comm(self, name: str, clients_by_rank: list, global_ranks: list, parent_id) -> Comm:
        comm = Comm(self._next_comm, name, parent_id)
        self._next_comm += 1
        members = []
        for rank, (client, g) in enumerate(zip(clients_by_rank, global_ranks)):
            m = Member(self._next_handle, comm, rank, client, g)
            self._next_handle += 1
            self.handles[m.handle] = m
            client.members.append(m)
            members.append(m)
        comm.set_members(members)
        self.comms[comm.id] = comm
        return comm

    def _comm_info_frame(self, request_id: int, handle: int, rank: int, global_ranks) -> bytes:
        return frame_bytes(P.COMM_INFO, request_id, P.encode_body(P.CommInfo(handle, rank, tuple(global_ranks))))

    def _comm_init(self, client: Client, frame: P.Frame) -> None:
        msg = P.decode_body(P.COMM_INIT, frame.body)
        rid = frame.request_id
        if msg.nranks < 1 or not 0 <= msg.rank < msg.nranks:
            self._error(client, rid, P.NCCL_INVALID_ARGUMENT,
                        f"communicator init: rank {msg.rank} is not valid for nranks {msg.nranks}")
            return
        now = self.clock()
        rdv = self.inits.get(msg.unique_id)
        if rdv is None:
            rdv = InitRendezvous(msg.unique_id, msg.nranks, msg.name, now, now + self.timeout_s, self.wall())
            self.inits[msg.unique_id] = rdv
            self._waiting[rdv] = None
        elif rdv.nranks != msg.nranks:
            self._error(client, rid, P.NCCL_INVALID_USAGE,
                        f"communicator init {self._uid_label(rdv)}: ranks {sorted(rdv.arrivals)} were "
                        f"called with nranks={rdv.nranks}, rank {msg.rank} with nranks={msg.nranks}")
            return
        if msg.rank in rdv.arrivals:
            self._error(client, rid, P.NCCL_INVALID_USAGE,
                        f"communicator init {self._uid_label(rdv)}: rank {msg.rank} joined twice")
            return
        rdv.arrivals[msg.rank] = (client, rid, now)
        if not rdv.name and msg.name:
            rdv.name = msg.name
        if len(rdv.arrivals) < rdv.nranks:
            return
        del self.inits[msg.unique_id]
        self._waiting.pop(rdv, None)
        arrivals = [rdv.arrivals[r] for r in range(rdv.nranks)]
        clients = [a[0] for a in arrivals]
        before = [c.global_ranks for c in clients]
        global_ranks = assign_global_ranks(clients)
        problem = self._comm_identity_problem(clients, global_ranks)
        if problem is not None:
            for c, g in zip(clients, before):   # the refused communicator gives nobody a global rank
                c.global_ranks = g
            msg = f"communicator init {self._uid_label(rdv)} of {rdv.nranks} ranks: {problem}"
            rdv.fail()
            log.error("%s", msg)
            for c, r_id, _ in arrivals:
                self._error(c, r_id, P.NCCL_INVALID_USAGE, msg)
            return
        rdv.complete()
        comm = self._new_comm(rdv.name, clients, global_ranks, None)
        if self.recording:
            self.flush_records()
            self.recorder.comm_created(comm.record, [now - a[2] for a in arrivals])
        for m, (c, r_id, _) in zip(comm.members, arrivals):
            self._send(c, self._comm_info_frame(r_id, m.handle, m.rank, comm.record.global_ranks))

    def _comm_identity_problem(self, clients: list, global_ranks: list) -> Optional[str]:
        """Why these members cannot form a communicator (global ranks of two processes collide,
        or the cluster config does not place one), or None. Ranks from RANK were checked at
        HELLO; this catches the ones taken from a process's first communicator."""
        owner: dict = {}
        for rank, (c, g) in enumerate(zip(clients, global_ranks)):
            other = owner.setdefault(g, (rank, c))
            if other[1] is not c:
                def origin(cl: Client) -> str:
                    how = "its RANK" if cl.hello.global_rank >= 0 else "its first communicator"
                    return f"{cl.describe()}, global rank from {how}"
                return (f"ranks {other[0]} ({origin(other[1])}) and {rank} ({origin(c)}) would both be global rank "
                        f"{g}; set RANK (and WORLD_SIZE) for every process of the job")
        topo = self.topology
        if topo is not None:
            unplaced = sorted({g for g in global_ranks if not topo.places(g)})
            if unplaced:
                return f"global ranks {rank_ranges(unplaced)} are not placed by {topo.describe()}"
        return None

    def _own_member(self, client: Client, handle: int, what: str, rid: int) -> Optional[Member]:
        m = self.handles.get(handle)
        if m is None or m.client is not client:
            self._error(client, rid, P.NCCL_INVALID_ARGUMENT,
                        f"{what}: communicator handle {handle:#x} is not a live communicator of this process")
            return None
        return m

    def _comm_split(self, client: Client, frame: P.Frame) -> None:
        msg = P.decode_body(P.COMM_SPLIT, frame.body)
        rid = frame.request_id
        member = self._own_member(client, msg.parent_handle, "ncclCommSplit", rid)
        if member is None:
            return
        comm = member.comm
        if msg.color < NCCL_SPLIT_NOCOLOR:
            self._error(client, rid, P.NCCL_INVALID_ARGUMENT,
                        f"ncclCommSplit on {comm.label()}: color {msg.color} is negative "
                        "(only NCCL_SPLIT_NOCOLOR = -1 is allowed)")
            return
        if comm.gone_ranks:
            self._error(client, rid, *self._gone_error(comm, "ncclCommSplit"))
            return
        seq = member.split_seq
        member.split_seq += 1
        now = self.clock()
        rdv = comm.splits.get(seq)
        if rdv is None:
            rdv = comm.splits[seq] = SplitRendezvous(comm, seq, now, now + self.timeout_s)
            self._waiting[rdv] = None
        rdv.arrivals[member.rank] = (member, rid, msg.color, msg.key, msg.name, now)
        if len(rdv.arrivals) < comm.nranks:
            return
        del comm.splits[seq]
        self._waiting.pop(rdv, None)
        rdv.complete()
        by_color: dict = {}
        for rank in range(comm.nranks):
            a = rdv.arrivals[rank]
            if a[2] != NCCL_SPLIT_NOCOLOR:
                by_color.setdefault(a[2], []).append(a)
            else:
                self._send(a[0].client, self._comm_info_frame(a[1], 0, -1, ()))
        for color in sorted(by_color):
            group = sorted(by_color[color], key=lambda a: (a[3], a[0].rank))
            name = next((a[4] for a in group if a[4]), "")
            new = self._new_comm(name, [a[0].client for a in group], [a[0].global_rank for a in group], comm.id)
            if self.recording:
                self.flush_records()
                self.recorder.comm_created(new.record, [now - a[5] for a in group])
            for m, a in zip(new.members, group):
                self._send(a[0].client, self._comm_info_frame(a[1], m.handle, m.rank, new.record.global_ranks))

    def _comm_shrink(self, client: Client, frame: P.Frame) -> None:
        """ncclCommShrink: the parent's members minus the excluded ranks (which never call,
        usually because they died), keeping their order. Works on a communicator whose
        excluded members are gone, which COMM_SPLIT refuses."""
        msg = P.decode_body(P.COMM_SHRINK, frame.body)
        rid = frame.request_id
        member = self._own_member(client, msg.parent_handle, "ncclCommShrink", rid)
        if member is None:
            return
        comm = member.comm
        excluded = tuple(sorted(set(msg.excluded)))
        what = f"ncclCommShrink on {comm.label()}"
        if (any(not 0 <= r < comm.nranks for r in excluded) or member.rank in excluded
                or len(excluded) != len(msg.excluded) or len(excluded) >= comm.nranks):
            self._error(client, rid, P.NCCL_INVALID_ARGUMENT,
                        f"{what}: rank {member.rank} cannot exclude {list(msg.excluded)} (distinct ranks of "
                        f"0..{comm.nranks - 1}, not itself, at least one rank left)")
            return
        seq = member.shrink_seq
        member.shrink_seq += 1
        now = self.clock()
        rdv = comm.shrinks.get(seq)
        if rdv is None:
            rdv = comm.shrinks[seq] = ShrinkRendezvous(comm, seq, excluded, now, now + self.timeout_s)
            self._waiting[rdv] = None
        if rdv.state is RendezvousState.GATHERING and rdv.excluded != excluded:
            asked = "; ".join(f"rank {r} excludes {list(a[2])}" for r, a in sorted(rdv.arrivals.items()))
            rdv.fail_with(P.NCCL_INVALID_USAGE, f"{what} #{seq}: the ranks disagree on whom to exclude: {asked}; "
                                                f"rank {member.rank} excludes {list(excluded)}")
            for a in rdv.arrivals.values():
                self._error(a[0].client, a[1], *rdv.failed)
        if rdv.state is RendezvousState.FAILED:
            # Later callers of this shrink learn it failed at once (the entry expires on its deadline).
            self._error(client, rid, *rdv.failed)
            return
        rdv.arrivals[member.rank] = (member, rid, excluded, msg.name, now)
        survivors = rdv.survivors()
        if len(rdv.arrivals) < len(survivors):
            return
        del comm.shrinks[seq]
        self._waiting.pop(rdv, None)
        rdv.complete()
        group = [rdv.arrivals[r] for r in survivors]
        name = next((a[3] for a in group if a[3]), "")
        new = self._new_comm(name, [a[0].client for a in group], [a[0].global_rank for a in group], comm.id)
        if self.recording:
            self.flush_records()
            self.recorder.comm_created(new.record, [now - a[4] for a in group])
        self._event("comm_shrink", comm=new.id, name=new.name, parent=comm.id, excluded=list(excluded),
                    excluded_global=[comm.members[r].global_rank for r in excluded],
                    members=list(new.record.global_ranks))
        for m, a in zip(new.members, group):
            self._send(a[0].client, self._comm_info_frame(a[1], m.handle, m.rank, new.record.global_ranks))

    def _expire_shrink(self, rdv: ShrinkRendezvous) -> None:
        comm = rdv.comm
        if comm.shrinks.get(rdv.seq) is rdv:
            del comm.shrinks[rdv.seq]
        failed = rdv.state is RendezvousState.FAILED
        rdv.expire()
        if failed:   # its callers were answered when it failed
            return
        missing = [r for r in rdv.survivors() if r not in rdv.arrivals]
        msg = (f"ncclCommShrink #{rdv.seq} on {comm.label()} excluding {list(rdv.excluded)}: ranks {missing} did "
               f"not arrive within {self.timeout_ms} ms (FAKEGPU_COORDINATOR_TIMEOUT_MS); arrived: "
               f"{sorted(rdv.arrivals)}")
        log.warning("timeout: %s", msg)
        for a in rdv.arrivals.values():
            self._error(a[0].client, a[1], P.NCCL_TIMEOUT, msg)

    def _comm_free(self, client: Client, frame: P.Frame) -> None:
        msg = P.decode_body(P.COMM_FREE, frame.body)
        if msg.how not in (P.FREE_DESTROY, P.FREE_ABORT, P.FREE_FINALIZE):
            self._error(client, frame.request_id, P.NCCL_INVALID_ARGUMENT,
                        f"COMM_FREE: unknown mode {msg.how} (0 destroy, 1 abort, 2 finalize)")
            return
        if self._freed.get(msg.comm_handle) is client:
            # Destroy after finalize (or a second abort): already done, as in NCCL.
            self._send(client, frame_bytes(P.OK, frame.request_id, b""))
            return
        member = self._own_member(client, msg.comm_handle, "COMM_FREE", frame.request_id)
        if member is None:
            return
        self._freed[member.handle] = client
        if msg.how == P.FREE_ABORT:
            self._event("comm_abort", comm=member.comm.id, name=member.comm.name, rank=member.rank,
                        global_rank=member.global_rank)
            self._member_gone(member, P.NCCL_REMOTE_ERROR, f"rank {member.rank} aborted the communicator")
        else:
            verb = "destroyed" if msg.how == P.FREE_DESTROY else "finalized"
            self._member_gone(member, P.NCCL_INVALID_USAGE, f"rank {member.rank} has {verb} the communicator")
        self._send(client, frame_bytes(P.OK, frame.request_id, b""))

    def _gone_error(self, comm: Comm, what: str) -> tuple:
        rank, (code, reason) = next(iter(comm.gone_ranks.items()))
        return code, f"{what} on {comm.label()}: {reason}"

    def _member_gone(self, member: Member, code: int, reason: str) -> None:
        """A member left (disconnect, abort, destroy): fail everything that waits on it."""
        if member.state is MemberState.GONE:
            return
        member.leave(code, reason)
        comm = member.comm
        comm.member_left(member.rank, code, reason)
        self.handles.pop(member.handle, None)
        if member in member.client.members:
            member.client.members.remove(member)
        rank = member.rank
        for key, slot in list(comm.slots.items()):
            if comm.slots.get(key) is not slot:   # failed with an earlier slot of its call
                continue
            del comm.slots[key]
            self._waiting.pop(slot, None)
            slot.fail()
            seq = slot.seq
            arrived = [s for s in slot.steps if s is not None]
            op = describe_op(arrived[0].desc) if arrived else "?"
            msg = f"{comm.label()} collective #{seq} {op}: {reason}"
            for s in arrived:
                self._op_done(s.group, s.index, code, msg)
            self._fail_call(comm, seq, arrived, code, msg, started=slot.first_wall,
                            missing=[r for r, s in enumerate(slot.steps) if s is None])
        reported: set = set()   # (pair, match_seq): a call with several steps waiting is one failure

        def fail_p2p(table: dict, k: tuple, s: Step, pair: tuple, msg: str) -> None:
            del table[k]
            self._waiting.pop(s, None)
            s.fail()
            self._op_done(s.group, s.index, code, msg)   # a parked Send was answered: no-op
            self._parked_resolved(s, code, msg)
            if (pair, k[0]) not in reported:
                reported.add((pair, k[0]))
                self._report_failed_call(comm, None, [s], code, msg, self._arrival_wall(s), [rank])

        for (src, dst), q in comm.p2p.items():
            if dst == rank:
                for k, s in list(q.sends.items()):
                    fail_p2p(q.sends, k, s, (src, dst),
                             f"{comm.label()} Send from rank {src} to rank {dst}: {reason}")
                for k, s in list(q.recvs.items()):
                    fail_p2p(q.recvs, k, s, (src, dst), f"{comm.label()} Recv on rank {dst}: {reason}")
            if src == rank:
                for k, s in list(q.recvs.items()):
                    fail_p2p(q.recvs, k, s, (src, dst), f"{comm.label()} Recv on rank {dst} from rank {src}: {reason}")
                for k, s in list(q.sends.items()):
                    fail_p2p(q.sends, k, s, (src, dst), f"{comm.label()} Send from rank {src}: {reason}")
        for seq, rdv in list(comm.splits.items()):
            del comm.splits[seq]
            self._waiting.pop(rdv, None)
            rdv.fail()
            for a in rdv.arrivals.values():
                if a[0] is not member:
                    self._error(a[0].client, a[1], code, f"ncclCommSplit on {comm.label()}: {reason}")
        for seq, rdv in list(comm.shrinks.items()):
            if rank in rdv.excluded or rdv.state is RendezvousState.FAILED:
                continue
            rdv.fail_with(code, f"ncclCommShrink on {comm.label()}: {reason}")
            for a in rdv.arrivals.values():
                if a[0] is not member:
                    self._error(a[0].client, a[1], *rdv.failed)
        if comm.arena is not None:
            self._arena_failed(comm, rank)
            self._arena_pending(comm)
        if all(m.state is MemberState.GONE for m in comm.members):
            comm.free()
            self.comms.pop(comm.id, None)
            self._close_arena(comm.id)

    def _expire_init(self, rdv: InitRendezvous) -> None:
        self.inits.pop(rdv.uid, None)
        rdv.expire()
        missing = [r for r in range(rdv.nranks) if r not in rdv.arrivals]
        msg = (f"communicator init {self._uid_label(rdv)} of {rdv.nranks} ranks: ranks {missing} did not "
               f"arrive within {self.timeout_ms} ms (FAKEGPU_COORDINATOR_TIMEOUT_MS); arrived: "
               f"{sorted(rdv.arrivals)}")
        log.warning("timeout: %s", msg)
        arrived = sorted(rdv.arrivals)
        self._event("init_timeout", name=rdv.name, unique_id=rdv.uid[:8].hex(), nranks=rdv.nranks,
                    arrived_ranks=arrived, missing_ranks=missing,
                    arrived_global_ranks=[self._known_global_rank(rdv.arrivals[r][0]) for r in arrived],
                    timeout_ms=self.timeout_ms, message=msg)
        for client, rid, _ in rdv.arrivals.values():
            self._error(client, rid, P.NCCL_TIMEOUT, msg)

    @staticmethod
    def _known_global_rank(client: Client) -> int:
        """The global rank of a process waiting in a communicator init, or -1 when it has none yet
        (no RANK and no communicator so far); for one process holding several ranks, its first."""
        return client.global_ranks[0] if client.global_ranks else -1

    def _expire_split(self, rdv: SplitRendezvous) -> None:
        comm = rdv.comm
        comm.splits.pop(rdv.seq, None)
        rdv.expire()
        missing = [r for r in range(comm.nranks) if r not in rdv.arrivals]
        msg = (f"ncclCommSplit #{rdv.seq} on {comm.label()}: ranks {missing} did not arrive within "
               f"{self.timeout_ms} ms (FAKEGPU_COORDINATOR_TIMEOUT_MS); arrived: {sorted(rdv.arrivals)}")
        log.warning("timeout: %s", msg)
        for a in rdv.arrivals.values():
            self._error(a[0].client, a[1], P.NCCL_TIMEOUT, msg)
