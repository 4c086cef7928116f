"""The fake world's accounting rule and event lines (native/src/fake/fake_accounting.cc through
fakegpu.fake.accounting): who accounts an operation, with which tiling, and the exact lines."""
from __future__ import annotations

import json

import pytest

from fakegpu.fake import accounting
from fakegpu.fake.contract import resolve
from fakegpu.fake.events import EventLog, parse_lines


def _pure(ngpu=8, rank=0):
    return resolve({"NGPU": str(ngpu), "RANK": str(rank)})


def _hybrid(physical="0,5,12", ngpu=16, rank=1):
    return resolve({"NGPU": str(ngpu), "FAKEGPU_DIST_MODE": "real_pp_fake_spmd", "FAKEGPU_PHYSICAL_RANKS": physical,
                    "WORLD_SIZE": "3", "RANK": str(rank)})


def _op(lc, members, kind="AllReduce", *, root=-1, peer=-1, rank=0, redop="sum"):
    return accounting.op_event(lc, members, 3, kind, "bfloat16", 2, 1024, redop=redop, root=root, peer=peer,
                               rank=rank)


def test_pure_fake_collective_is_tiled_over_the_world():
    where, line = _op(_pure(), list(range(8)))
    assert where == accounting.Placement(True)
    assert json.loads(line) == {"event": "op", "comm": 3, "kind": "AllReduce", "dtype": "bfloat16", "elem_size": 2,
                                "count": 1024, "redop": "sum", "root": -1, "peer": -1, "rank": 0}


def test_pure_fake_send_is_spread_and_a_covered_receive_is_left_out():
    lc = _pure(ngpu=4, rank=1)
    members = [0, 1, 2, 3]
    where, line = _op(lc, members, "SendRecv", root=1, peer=2, rank=1, redop=None)
    assert where.account and where.spread and json.loads(line)["spread"] is True
    assert json.loads(line)["redop"] is None
    # Receiving from 0 (offset +1): this rank's own send to 2 has that offset already.
    where, line = _op(lc, members, "SendRecv", root=0, peer=1, rank=1, redop=None)
    assert not where.account and line is None
    # Receiving from 3 (offset -2, to rank 1): 2*1 - 3 = -1 is no comm rank, so it counts.
    where, line = _op(lc, members, "SendRecv", root=3, peer=1, rank=1, redop=None)
    assert where.account and where.spread


def test_several_physical_processes_tile_their_slice_or_own_replicas():
    lc = _hybrid()                        # physical logical ranks 0, 5, 12; this is 5: slice [5, 12)
    assert lc.slice_of(5) == (5, 12) and lc.slice_of(0) == (0, 5) and lc.slice_of(12) == (12, 16)
    with pytest.raises(ValueError, match="logical rank 7 is not played by a physical process"):
        lc.slice_of(7)
    inside, _ = _op(lc, [5, 6, 7], rank=0)
    assert inside == accounting.Placement(True, domain=(5, 12))
    spanning, line = _op(lc, [0, 5, 12], rank=1)
    assert spanning == accounting.Placement(True, owned=(5, 12))
    assert json.loads(line)["owned"] == [5, 12] and "domain" not in json.loads(line)


def test_several_physical_processes_account_a_transfer_once():
    lc = _hybrid()
    pipeline = [0, 5, 12]
    send, _ = _op(lc, pipeline, "SendRecv", root=1, peer=2, rank=1, redop=None)
    assert send.account and not send.spread
    from_physical, line = _op(lc, pipeline, "SendRecv", root=0, peer=1, rank=1, redop=None)
    assert not from_physical.account and line is None     # rank 0's process accounts its send
    from_fake, _ = _op(lc, [5, 6], "SendRecv", root=1, peer=0, rank=0, redop=None)
    assert from_fake == accounting.Placement(True, domain=(5, 12))


def test_lines_escape_names_and_grow_past_the_first_buffer():
    members = list(range(1024))
    line = accounting.comm_line(7, 'mesh "dp"\n\t\\', members)
    assert json.loads(line) == {"event": "comm", "id": 7, "name": 'mesh "dp"\n\t\\', "members": members}
    lc = _hybrid()
    world = json.loads(accounting.world_line(lc, "torch"))
    assert world == {"event": "world", "version": 1, "frontend": "torch", **lc.to_dict()}
    assert world["physical_logical_ranks"] == [0, 5, 12] and world["physical_rank"] == 1


def test_event_log_keeps_ready_lines_and_dict_events(tmp_path):
    path = tmp_path / "e.jsonl"
    log = EventLog(str(path))
    log.add_line(accounting.world_line(_pure(), "torch"))
    log.add({"event": "memory", "point": "after_init"})
    log.close()
    events = list(parse_lines(path.read_text().splitlines()))
    assert [e["event"] for e in events] == ["world", "memory"]
    assert log.dumps() == path.read_text()


def test_a_reused_line_belongs_to_its_own_communicator(monkeypatch):
    """FakeWorld reuses an operation's line per communicator id: a receive left out on one
    group must not leave out the same call on another group registered later with that id."""
    from fakegpu.fake import runtime

    for var in ("FAKEGPU_CLUSTER_REPORT_PATH", "FAKEGPU_FAKE_REPORT_PATH", "FAKEGPU_FAKE_EVENTS_PATH"):
        monkeypatch.delenv(var, raising=False)
    world = runtime.FakeWorld(_pure(ngpu=8, rank=1))
    # On [0, 1, 2] rank 1 receiving from 0 is covered by its own send to 2: not logged, and the
    # group gets no id. On [0, 1] (next id) there is no rank 2 to send to: logged.
    assert not world.comm_op("a", [0, 1, 2], 1, "SendRecv", "float32", 4, 8, root=0, peer=1)
    assert world.comm_op("b", [0, 1], 1, "SendRecv", "float32", 4, 8, root=0, peer=1)
    assert world.comm_op("b", [0, 1], 1, "SendRecv", "float32", 4, 8, root=0, peer=1)
    assert not world.comm_op("a", [0, 1, 2], 1, "SendRecv", "float32", 4, 8, root=0, peer=1)
    world.finished = True
    ops = [json.loads(line) for line in world.log.lines if '"op"' in line]
    assert len(ops) == 2 and {op["comm"] for op in ops} == {0}
