"""fakegpu.plan.pipeline: pipeline schedules against the textbook figures and a hand-worked
schedule."""
from __future__ import annotations

import pytest

from fakegpu.plan.pipeline import SCHEDULES, normalize_schedule, simulate_pipeline

approx = pytest.approx


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m,f,b", [(4, 8, 1.0, 2.0), (2, 4, 1.0, 2.0), (8, 8, 0.5, 1.0), (3, 1, 1.0, 1.0)])
def test_equal_stages_textbook_makespan(schedule, p, m, f, b):
    run = simulate_pipeline(schedule, p, m, [f], [b])
    assert run.makespan == approx((m + p - 1) * (f + b))
    assert run.busy == approx([m * (f + b)] * p)
    assert len(run.actions) == 2 * m * p


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 8, 4), (2, 4, 2), (4, 4, 2)])
def test_interleaved_makespan(p, m, v):
    f, b = 1.0, 2.0
    run = simulate_pipeline("interleaved_1f1b", p, m, [f / v], [b / v], chunks=v)
    assert run.makespan == approx((m + (p - 1) / v) * (f + b))
    assert run.busy == approx([m * (f + b)] * p)
    assert len(run.actions) == 2 * m * p * v


@pytest.mark.parametrize("schedule,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)])
def test_single_stage(schedule, chunks):
    f, b, m = 1.0, 2.0, 4
    run = simulate_pipeline(schedule, 1, m, [f / chunks], [b / chunks], p2p=0.7, chunks=chunks)
    assert run.makespan == approx(m * (f + b))      # one rank: no hops, no bubble
    assert run.bubble == approx(0.0)


def test_bubble_is_makespan_minus_busiest_rank():
    run = simulate_pipeline("1f1b", 4, 8, [1.0], [2.0])
    assert run.bubble == approx((4 - 1) * (1.0 + 2.0))
    # unequal stages: the busiest rank (stage 1, 6 s per micro-batch) sets the work
    run = simulate_pipeline("1f1b", 2, 4, [1.0, 2.0], [2.0, 4.0])
    assert run.busy == approx([12.0, 24.0])
    assert run.bubble == approx(run.makespan - 24.0)
    assert run.bubble > 0


def test_p2p_on_the_critical_path_hand_worked():
    # p = 2, m = 2, f = 1, b = 2, p2p = 0.5, 1F1B.
    # Orders: rank 0 (1 warm-up forward): F0 F1 B0 B1; rank 1 (none): F0 B0 F1 B1.
    #   rank 0 F0   0.0 ..  1.0
    #   rank 0 F1   1.0 ..  2.0
    #   rank 1 F0   1.0 + 0.5 hop = 1.5 .. 2.5
    #   rank 1 B0   2.5 ..  4.5            (last stage: its own forward, no hop)
    #   rank 1 F1   max(4.5, 2.0 + 0.5) = 4.5 .. 5.5
    #   rank 1 B1   5.5 ..  7.5
    #   rank 0 B0   max(2.0, 4.5 + 0.5) = 5.0 .. 7.0
    #   rank 0 B1   max(7.0, 7.5 + 0.5) = 8.0 .. 10.0
    # makespan 10 = 9 without hops ((m + p - 1)(f + b)) + the two hops on the critical path.
    run = simulate_pipeline("1f1b", 2, 2, [1.0], [2.0], p2p=0.5)
    assert run.makespan == approx(10.0)
    got = {(r, what, mb): (s, e) for r, what, _stage, mb, s, e in run.actions}
    assert got == {
        (0, "F", 0): approx((0.0, 1.0)), (0, "F", 1): approx((1.0, 2.0)),
        (1, "F", 0): approx((1.5, 2.5)), (1, "B", 0): approx((2.5, 4.5)),
        (1, "F", 1): approx((4.5, 5.5)), (1, "B", 1): approx((5.5, 7.5)),
        (0, "B", 0): approx((5.0, 7.0)), (0, "B", 1): approx((8.0, 10.0)),
    }
    assert run.bubble == approx(10.0 - 6.0)
    assert simulate_pipeline("1f1b", 2, 2, [1.0], [2.0]).makespan == approx(9.0)


def _rank_order(run, rank):
    return [(what, mb) for r, what, _s, mb, start, _e in sorted(run.actions, key=lambda a: a[4]) if r == rank]


def test_1f1b_order_rank0_warmup_then_alternate():
    run = simulate_pipeline("1f1b", 4, 8, [1.0], [2.0])
    order = _rank_order(run, 0)
    assert order == [("F", 0), ("F", 1), ("F", 2),                 # p - 0 - 1 = 3 warm-up forwards
                     ("F", 3), ("B", 0), ("F", 4), ("B", 1), ("F", 5), ("B", 2),
                     ("F", 6), ("B", 3), ("F", 7), ("B", 4),       # steady 1F1B
                     ("B", 5), ("B", 6), ("B", 7)]                 # drain
    # the last rank has no warm-up: it alternates from the first micro-batch
    last = _rank_order(run, 3)
    assert last[:4] == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


def test_gpipe_order_all_forwards_then_all_backwards():
    run = simulate_pipeline("gpipe", 3, 4, [1.0], [2.0])
    for rank in range(3):
        assert _rank_order(run, rank) == [("F", mb) for mb in range(4)] + [("B", mb) for mb in range(4)]


@pytest.mark.parametrize("schedule,p,m,v", [("1f1b", 4, 8, 1), ("gpipe", 3, 5, 1),
                                            ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 2, 6, 3)])
def test_dependencies_and_one_action_at_a_time(schedule, p, m, v):
    hop = 0.25
    fw = [0.3 + 0.1 * s for s in range(p * v)]
    bw = [2 * x for x in fw]
    run = simulate_pipeline(schedule, p, m, fw, bw, p2p=hop, chunks=v)
    end = {(what, stage, mb): e for _r, what, stage, mb, _s, e in run.actions}
    n = p * v
    assert len(end) == 2 * n * m
    for r, what, stage, mb, s, e in run.actions:
        assert stage % p == r
        assert e - s == approx(fw[stage] if what == "F" else bw[stage])
        if what == "F" and stage > 0:
            assert s >= end[("F", stage - 1, mb)] + hop - 1e-12
        if what == "B":
            if stage == n - 1:
                assert s >= end[("F", stage, mb)] - 1e-12
            else:
                assert s >= end[("B", stage + 1, mb)] + hop - 1e-12
    for r in range(p):
        spans = sorted((s, e) for rr, _w, _st, _mb, s, e in run.actions if rr == r)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
    assert run.makespan == approx(max(e for *_x, e in run.actions))


def test_interleaved_needs_microbatches_multiple_of_stages():
    with pytest.raises(ValueError, match="multiple"):
        simulate_pipeline("interleaved_1f1b", 4, 6, [0.5], [1.0], chunks=2)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_chunks_only_for_interleaved(schedule):
    with pytest.raises(ValueError, match="chunk"):
        simulate_pipeline(schedule, 4, 8, [0.5], [1.0], chunks=2)


def test_unknown_schedule_names_the_valid_ones():
    with pytest.raises(ValueError) as err:
        simulate_pipeline("zigzag", 2, 2, [1.0], [1.0])
    message = str(err.value)
    assert "zigzag" in message
    for name in SCHEDULES:
        assert name in message
    with pytest.raises(ValueError):
        normalize_schedule("")


def test_non_positive_sizes_and_wrong_time_count():
    with pytest.raises(ValueError):
        simulate_pipeline("1f1b", 0, 2, [1.0], [1.0])
    with pytest.raises(ValueError):
        simulate_pipeline("1f1b", 2, 0, [1.0], [1.0])
    with pytest.raises(ValueError, match="virtual stage"):
        simulate_pipeline("1f1b", 2, 2, [1.0, 1.0, 1.0], [1.0])


@pytest.mark.parametrize("name,expected", [("1F1B", "1f1b"), ("Interleaved1F1B", "interleaved_1f1b"),
                                           ("GPipe", "gpipe"), ("interleaved-1f1b", "interleaved_1f1b"),
                                           (" gpipe ", "gpipe"), ("interleaved_1f1b", "interleaved_1f1b")])
def test_torchtitan_names(name, expected):
    assert normalize_schedule(name) == expected


def test_torchtitan_names_run():
    a = simulate_pipeline("Interleaved1F1B", 4, 8, [0.5], [1.0], chunks=2)
    b = simulate_pipeline("interleaved_1f1b", 4, 8, [0.5], [1.0], chunks=2)
    assert a.makespan == approx(b.makespan)
    assert simulate_pipeline("1F1B", 4, 8, [1.0], [2.0]).makespan == approx(33.0)
    assert simulate_pipeline("GPipe", 4, 8, [1.0], [2.0]).makespan == approx(33.0)
