"""fakegpu's torch backend against gloo on real rank processes (the real shim and a real
coordinator for fakegpu): Works that only C++ holds, all_gather_coalesced's layout, group
timeouts, the default device (DCP + FSDP2), sparse all_reduce, monitored_barrier and
asynchronous collectives.  The programs are tests/integration/torch_programs/backend_cases.py."""
from __future__ import annotations

import importlib.util

import pytest

from helpers.torch_cases import run_case

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed"),
]


@pytest.fixture
def both(shim_library):
    """``both(case, nranks)`` -> (gloo results, fakegpu results), per rank."""

    def run(case, nranks=2, timeout_s=120):
        return (run_case(case, "gloo", nranks, timeout_s=timeout_s),
                run_case(case, "fakegpu", nranks, library=shim_library, timeout_s=timeout_s))

    return run


def test_ddp_join_without_initial_world_size_does_not_hang_and_matches_gloo(both):
    # The reducer keeps the join all-reduce's Work in C++ and calls wait() and result() on it
    # in backward; with a Python-only Work that wait() never returned.
    gloo, fake = both("ddp_join")
    assert fake == gloo


def test_all_gather_coalesced_layout_matches_gloo(both):
    gloo, fake = both("all_gather_coalesced")
    assert fake == gloo
    # output_lists[r][i] is input i of rank r
    assert fake[0]["2"][1] == [[10.0], [110.0, 111.0]]


def test_barrier_joined_by_one_rank_fails_after_the_group_timeout_like_gloo(both):
    gloo, fake = both("barrier_timeout")
    for name, results in (("gloo", gloo), ("fakegpu", fake)):
        rank0 = results[0]
        assert rank0["error"], f"{name}: the barrier did not fail"
        # the group's timeout is 2 s; generous upper bound for a loaded machine
        assert 1.5 <= rank0["elapsed"] < 30, (name, rank0)
    assert "Timed out" in fake[0]["error"] and "barrier" in fake[0]["error"]
    assert "default_pg" in fake[0]["error"]


def test_default_device_is_cpu_and_fsdp2_loads_rank0_full_state_dict(shim_library):
    results = run_case("default_device_and_dcp", "fakegpu", 2, library=shim_library,
                       timeout_s=180)
    assert results == [{"device": "cpu", "loaded_matches_rank0": True}] * 2


def test_sparse_all_reduce_matches_gloo(both):
    gloo, fake = both("sparse_all_reduce")
    assert fake == gloo


def test_monitored_barrier_names_the_rank_that_never_arrived(shim_library):
    results = run_case("monitored", "fakegpu", 2, library=shim_library)
    assert results[1]["error"] is None
    assert "Rank 1 failed to pass monitoredBarrier in 2000 ms" in results[0]["error"]


def test_monitored_barrier_fails_as_gloos_does(both):
    gloo, fake = both("monitored_like_gloo", 3)
    assert fake == gloo
    assert fake[0]["all"] is None and fake[0]["rank_1_absent"] == ["Rank 1", "failed to pass monitoredBarrier"]
    assert fake[2]["rank_1_absent"] == ["successfully reached monitoredBarrier"]
    assert fake[0]["zero_timeout"] == ["Rank 1", "after 0 ms", "failed to pass monitoredBarrier",
                                       "timed out in monitoredBarrier"]


def test_async_op_returns_before_the_peer_issued_and_completes_in_order(both):
    gloo, fake = both("async_order")
    for results in (gloo, fake):
        # rank 1 issues only after rank 0's calls returned: they cannot have completed yet
        assert results[0]["completed_before_peer"] == [False, False]
        for rank in results:
            assert rank["first"] == [3.0] * 4 and rank["second_sum"] == 1000.0
            assert rank["completed_after"] == [True, True]


@pytest.mark.parametrize("nranks", [2, 3])
def test_blocking_calls_match_gloo_and_run_on_the_callers_thread(both, nranks):
    gloo, fake = both("blocking_calls", nranks)
    strip = lambda results: [{k: v for k, v in r.items() if k != "ran_now"} for r in results]  # noqa: E731
    assert strip(fake) == strip(gloo)
    assert gloo[0]["sum"] == [float(i * sum(range(1, nranks + 1))) for i in range(6)]
    for rank in fake:
        # every kind with a caller's-thread path took it at least once (the MAX behind the
        # queued call may or may not find the stream idle)
        assert rank["ran_now"] == ["_allgather_base", "_reduce_scatter_base", "allreduce",
                                   "broadcast"], rank["ran_now"]


def test_blocking_calls_keep_to_the_stream_under_a_short_group_timeout(both):
    gloo, fake = both("blocking_calls_short_timeout")
    assert [{k: v for k, v in r.items() if k != "ran_now"} for r in fake] == \
        [{k: v for k, v in r.items() if k != "ran_now"} for r in gloo]
    assert all(rank["ran_now"] == [] for rank in fake)


def test_works_held_only_by_cpp_complete_and_fail(shim_library):
    # Functional collectives: torch's C++ side waits on the Work after its Python object is gone.
    results = run_case("cpp_held_works", "fakegpu", 2, library=shim_library)
    for rank in results:
        assert rank["value"] == [3.0, 3.0, 3.0]
        assert "members disagree on count" in rank["error"]
        assert rank["after"] == [2.0, 2.0]


def _by_sender(received):
    """[[src, data], ...] -> {src: [data, ...]} in the order received."""
    out: dict = {}
    for src, data in received:
        out.setdefault(src, []).append(data)
    return out


@pytest.mark.parametrize("nranks", [2, 4])
def test_recv_and_irecv_without_a_source_get_every_sender_once_like_gloo(both, nranks):
    gloo, fake = both("recv_any_source", nranks)
    senders = set(range(1, nranks))
    for name, results in (("gloo", gloo), ("fakegpu", fake)):
        rank0 = results[0]
        # dist.recv(t) returned the sender, whose two sends arrived in their order, with their data
        assert _by_sender(rank0["recv"]) == {
            r: [[float(r), 0.0, 10.0 * r], [float(r), 1.0, 10.0 * r + 1]] for r in senders}, (name, rank0)
        # irecv() posted n-1 times: each Work's _source_rank() names the rank whose data it holds
        assert sorted(src for src, _ in rank0["irecv"]) == sorted(senders), (name, rank0)
        assert all(data == [src, -100 * src] for src, data in rank0["irecv"]), (name, rank0)
    # the same (sender, data) sets as gloo (the order among senders is arrival order in both)
    assert sorted(map(str, fake[0]["recv"])) == sorted(map(str, gloo[0]["recv"]))
    assert sorted(map(str, fake[0]["irecv"])) == sorted(map(str, gloo[0]["irecv"]))


def test_recv_without_a_source_fails_after_the_group_timeout_when_nobody_sends(both):
    gloo, fake = both("recv_any_source_timeout")
    assert "Timed out" in gloo[0]["error"] and gloo[0]["elapsed"] >= 3.5
    rank0 = fake[0]
    # the group's timeout is 4 s; the wait gives up a margin (1 s) earlier, with its own error
    assert "recv from any source on process group 'default_pg'" in rank0["error"], rank0
    assert "ncclTimeout" in rank0["error"] and "no rank sent to rank 0 within 3000 ms" in rank0["error"]
    assert 2.5 <= rank0["elapsed"] < 30, rank0
    # unlike gloo's (whose pair is closed), a fakegpu group stays usable: nothing was received
    assert [r["after"] for r in fake] == [[2.0], [2.0]]


def test_a_ring_of_recvs_from_any_source_and_isends_completes_like_gloo(both):
    # Every rank's recv from any source waits for its predecessor's isend, which the
    # predecessor queued next to its own any-source recv: both orders must complete.
    gloo, fake = both("recv_any_source_exchange", 3)
    expected = [{order: [(r - 1) % 3, [float((r - 1) % 3), 1000.0 + (r - 1) % 3]]
                 for order in ("recv_first", "send_first")} for r in range(3)]
    assert gloo == expected
    assert fake == expected
