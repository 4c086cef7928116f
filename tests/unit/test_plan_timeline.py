"""fakegpu.plan.timeline: a rank's compute stream and per-group communication streams,
checked against figures computed by hand."""
from __future__ import annotations

import pytest

from fakegpu.plan import timeline as timeline_module
from fakegpu.plan.timeline import COMPUTE, OVERLAP_SLOWDOWN, Task, Timeline


def simulate(tasks):
    """The ideal overlap (a kernel beside a collective runs at full speed): the hand figures
    below are the streams' arithmetic; the slowdown has its own test at the end."""
    return timeline_module.simulate(tasks, overlap_slowdown=0.0)

approx = pytest.approx


def kernel(name, seconds, reads=(), writes=(), step=0):
    return Task(name, seconds, COMPUTE, tuple(reads), tuple(writes), step=step)


def collective(name, seconds, group, reads=(), writes=(), step=0):
    return Task(name, seconds, f"group:{group}", tuple(reads), tuple(writes), group_label=group, step=step)


# (a) ----------------------------------------------------------------------------------------

def test_compute_tasks_in_program_order_add_up():
    t = simulate([kernel("a", 1.0), kernel("b", 2.0), kernel("c", 3.0)])
    assert isinstance(t, Timeline)
    assert t.start == approx([0.0, 1.0, 3.0])
    assert t.end == approx([1.0, 3.0, 6.0])
    assert t.makespan == approx(6.0)
    assert t.compute_busy == approx(6.0)
    assert t.exposed == {}
    assert t.communication == {}


def test_empty_program():
    t = simulate([])
    assert t.makespan == 0.0
    assert t.exposed == {} and t.tasks == []


def test_kernel_waits_for_a_kernel_it_reads_only_through_stream_order():
    # kernels on one stream: a read of an earlier kernel's output adds nothing, no exposure
    t = simulate([kernel("a", 1.0, writes=["x"]), kernel("b", 1.0, reads=["x"])])
    assert t.start == approx([0.0, 1.0])
    assert t.exposed == {}


# (b) FSDP2-style prefetched all-gather ------------------------------------------------------

def _prefetch(all_gather_seconds):
    # the all-gather is issued first (program order), two kernels that do not need it run,
    # the third kernel reads the gathered parameters
    return simulate([
        collective("all_gather", all_gather_seconds, "fsdp", writes=["params"]),
        kernel("c1", 1.0),
        kernel("c2", 1.0),
        kernel("c3", 1.0, reads=["params"]),
    ])


def test_shorter_all_gather_hides_behind_compute():
    t = _prefetch(1.5)              # ends at 1.5, c3 starts at 2.0 anyway
    assert t.start == approx([0.0, 0.0, 1.0, 2.0])
    assert t.exposed.get("fsdp", 0.0) == approx(0.0)
    assert t.makespan == approx(3.0)                # = the compute sum
    assert t.compute_busy == approx(3.0)
    assert t.communication == {"fsdp": approx(1.5)}


def test_longer_all_gather_exposes_exactly_its_shortfall():
    t = _prefetch(2.5)              # ends at 2.5, c3 was ready at 2.0: 0.5 exposed
    assert t.start[3] == approx(2.5)
    assert t.exposed == {"fsdp": approx(0.5)}
    assert t.makespan == approx(3.5)
    assert t.communication == {"fsdp": approx(2.5)}


def test_all_gather_exactly_as_long_as_the_hiding_compute_is_not_exposed():
    t = _prefetch(2.0)
    assert t.exposed.get("fsdp", 0.0) == approx(0.0)
    assert t.makespan == approx(3.0)


# (c) TP all-reduce read by the next kernel --------------------------------------------------

def test_tp_all_reduce_read_by_the_next_kernel_is_fully_exposed():
    t = simulate([
        kernel("row_parallel_mm", 1.0, writes=["partial"]),
        collective("all_reduce", 0.25, "tp", reads=["partial"], writes=["out"]),
        kernel("next", 1.0, reads=["out"]),
    ])
    assert t.start == approx([0.0, 1.0, 1.25])     # the all-reduce waits for its input
    assert t.exposed == {"tp": approx(0.25)}
    assert t.makespan == approx(2.25)
    assert t.compute_busy == approx(2.0)


def test_exposure_is_reported_under_the_stream_without_a_group_label():
    t = simulate([
        kernel("k", 1.0, writes=["x"]),
        Task("ar", 0.5, "group:dp", reads=("x",), writes=("y",)),
        kernel("k2", 1.0, reads=["y"]),
    ])
    assert t.exposed == {"group:dp": approx(0.5)}
    assert t.communication == {"group:dp": approx(0.5)}


# (d) streams per group ----------------------------------------------------------------------

def test_groups_overlap_each_other_while_one_group_serializes():
    t = simulate([
        collective("ag1", 1.0, "fsdp", writes=["w1"]),
        collective("ar", 1.0, "tp", writes=["z"]),
        collective("ag2", 1.0, "fsdp", writes=["w2"]),
        kernel("use", 0.5, reads=["w1", "z", "w2"]),
    ])
    # fsdp and tp each start at 0 on their own streams; ag2 waits behind ag1 on fsdp's stream
    assert t.start == approx([0.0, 0.0, 1.0, 2.0])
    assert t.end == approx([1.0, 1.0, 2.0, 2.5])
    assert t.makespan == approx(2.5)
    assert t.communication == {"fsdp": approx(2.0), "tp": approx(1.0)}
    # the kernel waited 2.0 s, on the last-finishing input: fsdp's second all-gather
    assert t.exposed == {"fsdp": approx(2.0)}


# (e) tail -----------------------------------------------------------------------------------

def test_communication_after_the_last_kernel_is_exposed_and_extends_the_step():
    t = simulate([
        kernel("backward", 1.0, writes=["grad"]),
        collective("reduce_scatter", 2.0, "fsdp", reads=["grad"], writes=["sharded_grad"]),
    ])
    assert t.makespan == approx(3.0)
    assert t.exposed == {"fsdp": approx(2.0)}


def test_tail_counts_only_what_runs_past_the_last_kernel():
    t = simulate([
        kernel("backward", 1.0, writes=["grad"]),
        collective("reduce_scatter", 1.5, "fsdp", reads=["grad"], writes=["sharded_grad"]),
        kernel("more_backward", 1.0),
    ])
    # reduce-scatter 1.0 .. 2.5, last kernel 1.0 .. 2.0: 0.5 s of tail
    assert t.makespan == approx(2.5)
    assert t.exposed == {"fsdp": approx(0.5)}


# (f) steps ----------------------------------------------------------------------------------

def test_step_seconds_and_exposure_per_step():
    t = simulate([
        kernel("s0a", 1.0, step=0),
        kernel("s0b", 2.0, step=0),
        kernel("s1a", 0.5, writes=["g"], step=1),
        collective("rs", 1.0, "fsdp", reads=["g"], writes=["g2"], step=1),
    ])
    # step 0: 0 .. 3; step 1: kernel 3 .. 3.5, its reduce-scatter 3.5 .. 4.5 (tail)
    assert t.step_seconds(0) == approx(3.0)
    assert t.step_seconds(1) == approx(1.5)
    assert t.makespan == approx(4.5)
    assert t.exposed_in_step(0) == {}
    assert t.exposed_in_step(1) == {"fsdp": approx(1.0)}
    with pytest.raises(ValueError):
        t.step_seconds(2)


# (g) trace ----------------------------------------------------------------------------------

def test_trace_events_one_thread_per_stream_in_microseconds():
    t = simulate([
        collective("all_gather", 0.0015, "fsdp", writes=["p"]),
        kernel("k1", 0.002),
        kernel("k2", 0.001, reads=["p"]),
        kernel("free", 0.0),            # zero-length: no slice
    ])
    slices = [e for e in t.trace_events(pid=7) if e["ph"] == "X"]
    meta = [e for e in t.trace_events(pid=7) if e["ph"] == "M"]
    assert [e["name"] for e in slices] == ["all_gather", "k1", "k2"]
    assert all(e["pid"] == 7 for e in slices + meta)
    by_name = {e["name"]: e for e in slices}
    assert by_name["all_gather"]["ts"] == approx(0.0)
    assert by_name["all_gather"]["dur"] == approx(1500.0)
    assert by_name["k1"]["ts"] == approx(0.0)
    assert by_name["k1"]["dur"] == approx(2000.0)
    assert by_name["k2"]["ts"] == approx(2000.0)
    assert by_name["k2"]["dur"] == approx(1000.0)
    assert by_name["k1"]["tid"] == by_name["k2"]["tid"] != by_name["all_gather"]["tid"]
    assert by_name["k1"]["args"] == {"step": 0}
    names = {e["tid"]: e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert len(names) == 2
    assert names[by_name["k1"]["tid"]] == "compute stream"
    assert names[by_name["all_gather"]["tid"]] == "comm stream: group:fsdp"


# (h) ----------------------------------------------------------------------------------------

def test_negative_duration_raises():
    with pytest.raises(ValueError, match="negative"):
        simulate([kernel("ok", 1.0), kernel("bad", -1e-6)])


def test_a_kernel_beside_a_collective_is_slowed_by_the_overlap_share():
    gather = Task("ag", 2.0, "group:fsdp", reads=("shard",), writes=("full",), group_label="fsdp")
    tasks = [gather, Task("k1", 1.0), Task("k2", 1.0), Task("k3", 1.0, reads=("full",))]
    t = timeline_module.simulate(tasks)
    # k1 runs wholly beside the all-gather: 1 + OVERLAP_SLOWDOWN; k2 only for the gather's last
    # 2 - end(k1) seconds, slowed by that share of them
    k1_end = 1.0 + OVERLAP_SLOWDOWN
    assert t.end[1] == pytest.approx(k1_end)
    assert t.end[2] == pytest.approx(k1_end + 1.0 + OVERLAP_SLOWDOWN * (2.0 - k1_end))
    assert t.start[3] == pytest.approx(max(2.0, t.end[2]))
    assert t.exposed.get("fsdp", 0.0) == 0.0
    ideal = timeline_module.simulate(tasks, overlap_slowdown=0.0)
    assert ideal.makespan == pytest.approx(3.0) and t.makespan > ideal.makespan


# (i) contention: collectives of different groups sharing a link ------------------------------

def _sharing(link_b="port_out"):
    # FSDP's gather keeps the GPU's NVLink port busy 3 s of its 4; the CP gather, issued after a
    # 1 s kernel, needs the same port for 2 s of its 2.5
    return simulate([
        Task("fsdp_ag", 4.0, "group:fsdp", group_label="fsdp", links=((("port_out", 0), 3.0),)),
        kernel("k", 1.0, writes=["q"]),
        Task("cp_ag", 2.5, "group:cp", reads=("q",), group_label="cp", links=(((link_b, 0), 2.0),)),
    ])


def test_a_collective_sharing_a_busy_link_is_slowed_by_the_overlap():
    t = _sharing()
    # the port still has 3 - 1 = 2 s of FSDP bytes queued when the CP gather starts: two fair
    # shares slow it by the shorter of that and its own 2 s on the port
    assert t.start[2] == approx(1.0)
    assert t.end[2] == approx(1.0 + 2.5 + 2.0)
    assert t.contention == {"cp": approx(2.0)}
    assert t.contention_in_step(0) == {"cp": approx(2.0)}
    assert t.link_delays == approx([0.0, 0.0, 2.0])
    assert t.end[0] == approx(4.0)            # the earlier collective's end is not moved
    assert t.communication == {"fsdp": approx(4.0), "cp": approx(2.5)}   # alone-on-the-fabric times


def test_collectives_on_different_links_do_not_slow_each_other():
    t = _sharing(link_b="nic_out")
    assert t.end[2] == approx(3.5) and t.contention == {}


def test_a_link_stays_busy_with_every_collectives_bytes():
    # three groups on one link: the third finds the link busy for the first two's sum
    t = simulate([
        Task("a", 1.0, "group:a", group_label="a", links=((("port_out", 0), 1.0),)),
        Task("b", 1.0, "group:b", group_label="b", links=((("port_out", 0), 1.0),)),
        Task("c", 0.5, "group:c", group_label="c", links=((("port_out", 0), 0.5),)),
    ])
    assert t.end == approx([1.0, 2.0, 1.0])    # b: queued 1 s behind a; c: queued 2 s, slowed 0.5
    assert t.contention == {"b": approx(1.0), "c": approx(0.5)}


def test_collectives_of_one_group_queue_on_its_stream_not_as_contention():
    t = simulate([
        Task("a", 1.0, "group:fsdp", group_label="fsdp", links=((("port_out", 0), 1.0),)),
        Task("b", 1.0, "group:fsdp", group_label="fsdp", links=((("port_out", 0), 1.0),)),
    ])
    assert t.end == approx([1.0, 2.0]) and t.contention == {}
