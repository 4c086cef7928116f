"""The fake-world launch contract: valid coordinates and every launch-contract error."""
from __future__ import annotations

import pytest

from fakegpu.fake.contract import LaunchContractError, resolve


def _fake(**env):
    return resolve({k: str(v) for k, v in env.items()})


def _hybrid(**env):
    return resolve({"FAKEGPU_DIST_MODE": "real_pp_fake_spmd", **{k: str(v) for k, v in env.items()}})


# -- pure fake ----------------------------------------------------------------------------------
def test_pure_fake_defaults_to_rank_zero_pp_zero():
    lc = _fake(NGPU=1024)
    assert (lc.mode, lc.world_size, lc.pp_degree, lc.pp_rank, lc.logical_rank) == ("fake", 1024, 1, 0, 0)
    assert lc.physical_ranks == (0,) and lc.physical_world_size == 1
    assert lc.slice_of(0) == (0, 1024)


@pytest.mark.parametrize("pp_rank, expected", [(0, 0), (1, 256), (2, 512), (3, 768)])
def test_pure_fake_pp_coordinate_sets_logical_rank(pp_rank, expected):
    lc = _fake(NGPU=1024, FAKEGPU_PP_DEGREE=4, FAKE_PP_RANK=pp_rank)
    assert lc.logical_rank == expected and lc.pp_rank == pp_rank and lc.spmd_size == 256
    assert lc.physical_ranks == (expected,)


def test_pp_degree_argument_overrides_env():
    lc = resolve({"NGPU": "64", "FAKE_PP_RANK": "1", "FAKEGPU_PP_DEGREE": "4"}, pp_degree=2)
    assert lc.pp_degree == 2 and lc.logical_rank == 32


def test_pure_fake_rank_without_fake_pp_rank():
    lc = _fake(NGPU=64, FAKEGPU_PP_DEGREE=4, RANK=37)
    assert lc.logical_rank == 37 and lc.pp_rank == 2


def test_fake_pp_rank_wins_over_torchrun_rank_zero():
    lc = _fake(NGPU=64, FAKEGPU_PP_DEGREE=4, FAKE_PP_RANK=3, RANK=0, WORLD_SIZE=1)
    assert lc.logical_rank == 48


def test_divisibility_error_says_how_to_fix():
    with pytest.raises(LaunchContractError) as err:
        _fake(NGPU=10, FAKEGPU_PP_DEGREE=4)
    msg = str(err.value)
    assert "NGPU=10 is not divisible by the pipeline degree P=4" in msg
    assert "multiple of 4" in msg and "1, 2, 5, 10" in msg


def test_fake_pp_rank_out_of_range():
    with pytest.raises(LaunchContractError, match=r"FAKE_PP_RANK=4 is out of range for PP degree P=4.*0\.\.3"):
        _fake(NGPU=64, FAKEGPU_PP_DEGREE=4, FAKE_PP_RANK=4)


def test_logical_rank_out_of_range():
    with pytest.raises(LaunchContractError, match=r"RANK=64 is out of range for the logical world NGPU=64"):
        _fake(NGPU=64, RANK=64)


def test_pure_fake_refuses_several_processes():
    with pytest.raises(LaunchContractError, match="pure fake mode runs a single process.*real_pp_fake_spmd"):
        _fake(NGPU=64, WORLD_SIZE=2, RANK=1)


def test_ngpu_required_and_integer():
    with pytest.raises(LaunchContractError, match="NGPU is not set"):
        resolve({})
    with pytest.raises(LaunchContractError, match="NGPU='x' is not an integer"):
        resolve({"NGPU": "x"})
    with pytest.raises(LaunchContractError, match="NGPU=0 must be at least 1"):
        resolve({"NGPU": "0"})
    with pytest.raises(LaunchContractError, match="FAKEGPU_PP_DEGREE=0 must be at least 1"):
        resolve({"NGPU": "8", "FAKEGPU_PP_DEGREE": "0"})
    with pytest.raises(LaunchContractError, match="FAKE_PP_RANK=-1 must be at least 0"):
        resolve({"NGPU": "8", "FAKE_PP_RANK": "-1"})


def test_unknown_mode():
    with pytest.raises(LaunchContractError, match="FAKEGPU_DIST_MODE='real' is not a fake-world mode"):
        resolve({"NGPU": "8", "FAKEGPU_DIST_MODE": "real"})


# -- real pipeline, fake SPMD -------------------------------------------------------------------
@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_hybrid_physical_rank_is_pp_coordinate(rank):
    lc = _hybrid(NGPU=1024, FAKEGPU_PP_DEGREE=4, RANK=rank, WORLD_SIZE=4)
    assert lc.pp_rank == rank and lc.logical_rank == rank * 256 and lc.physical_rank == rank
    assert lc.physical_ranks == (0, 256, 512, 768)
    assert lc.slice_of(lc.logical_rank) == (rank * 256, rank * 256 + 256)
    assert lc.is_physical(512) and not lc.is_physical(1)
    assert lc.physical_rank_of(768) == 3


def test_hybrid_world_size_must_equal_pp_degree():
    with pytest.raises(LaunchContractError) as err:
        _hybrid(NGPU=64, FAKEGPU_PP_DEGREE=4, RANK=0, WORLD_SIZE=3)
    msg = str(err.value)
    assert "WORLD_SIZE=3 but the PP degree is P=4" in msg
    assert "exactly one process per PP rank" in msg and "--nproc-per-node 4" in msg


def test_hybrid_refuses_fake_pp_rank():
    with pytest.raises(LaunchContractError, match="FAKE_PP_RANK=1 is invalid in real_pp_fake_spmd mode.*RANK is the PP"):
        _hybrid(NGPU=64, FAKEGPU_PP_DEGREE=2, RANK=0, WORLD_SIZE=2, FAKE_PP_RANK=1)


def test_hybrid_needs_rank_and_world_size():
    with pytest.raises(LaunchContractError, match="needs the physical RANK and WORLD_SIZE.*torchrun --nproc-per-node 2"):
        _hybrid(NGPU=64, FAKEGPU_PP_DEGREE=2)


def test_hybrid_rank_out_of_range():
    with pytest.raises(LaunchContractError, match=r"RANK=2 is out of range for WORLD_SIZE=2"):
        _hybrid(NGPU=64, FAKEGPU_PP_DEGREE=2, RANK=2, WORLD_SIZE=2)


def test_hybrid_divisibility_is_checked_first():
    with pytest.raises(LaunchContractError, match="not divisible by the pipeline degree P=3"):
        _hybrid(NGPU=64, FAKEGPU_PP_DEGREE=3, RANK=0, WORLD_SIZE=3)


@pytest.mark.parametrize("rank", [0, 1])
def test_hybrid_pp_degree_defaults_to_the_processes_launched(rank):
    # fgpu --dist-mode real_pp_fake_spmd -- torchrun --nproc-per-node 2 ...: no FAKEGPU_PP_DEGREE
    lc = _hybrid(NGPU=8, RANK=rank, WORLD_SIZE=2)
    assert lc.pp_degree == 2 and lc.physical_ranks == (0, 4)
    assert lc.pp_rank == rank and lc.logical_rank == rank * 4


def test_hybrid_inferred_pp_degree_must_divide_ngpu():
    with pytest.raises(LaunchContractError) as err:
        _hybrid(NGPU=8, RANK=0, WORLD_SIZE=3)
    msg = str(err.value)
    assert "NGPU=8 is not divisible by the pipeline degree P=3" in msg
    assert "FAKEGPU_PP_DEGREE is unset, so P is the number of processes launched, WORLD_SIZE=3" in msg


def test_explicit_pp_degree_still_wins_over_the_process_count():
    with pytest.raises(LaunchContractError, match="WORLD_SIZE=2 but the PP degree is P=4"):
        _hybrid(NGPU=8, FAKEGPU_PP_DEGREE=4, RANK=0, WORLD_SIZE=2)


def test_pure_fake_pp_degree_does_not_follow_world_size():
    assert _fake(NGPU=8, WORLD_SIZE=1).pp_degree == 1


# -- any subset physical ------------------------------------------------------------------------
def test_explicit_physical_subset():
    lc = _hybrid(NGPU=16, RANK=1, WORLD_SIZE=3, FAKEGPU_PHYSICAL_RANKS="0,5,12")
    assert lc.logical_rank == 5 and lc.physical_ranks == (0, 5, 12)
    assert lc.slice_of(0) == (0, 5) and lc.slice_of(5) == (5, 12) and lc.slice_of(12) == (12, 16)


@pytest.mark.parametrize("ranks, world, match", [
    ("0,16", 2, r"outside the logical world 0\.\.15"),
    ("0,0", 2, "repeats a logical rank"),
    ("0,a", 2, "not a comma-separated list"),
    ("0,4,8", 2, "WORLD_SIZE=2 but FAKEGPU_PHYSICAL_RANKS lists 3 logical ranks"),
])
def test_explicit_physical_subset_errors(ranks, world, match):
    with pytest.raises(LaunchContractError, match=match):
        _hybrid(NGPU=16, RANK=0, WORLD_SIZE=world, FAKEGPU_PHYSICAL_RANKS=ranks)


# -- one implementation -------------------------------------------------------------------------
def test_the_rules_are_the_shims():
    """contract.py holds no rules of its own: the same native function the shim's fake mode
    uses answers (native/src/fake/fake_contract.cc)."""
    import inspect

    from fakegpu.fake import contract

    source = inspect.getsource(contract.resolve)
    assert "fakegpu_fake_contract" in source and "NGPU is not set" not in inspect.getsource(contract)
    with pytest.raises(LaunchContractError, match="^NGPU is not set"):
        resolve({})


@pytest.mark.parametrize("raw, expected", [(" 8 ", 8), ("+8", 8), ("1_6", 16), ("008", 8)])
def test_integers_read_as_launchers_write_them(raw, expected):
    assert _fake(NGPU=raw).world_size == expected


@pytest.mark.parametrize("raw", ["1__6", "_16", "16_", "0x10", "1.0", "2147483648", "-"])
def test_what_is_not_an_integer_is_refused_with_the_value(raw):
    with pytest.raises(LaunchContractError, match=r"^NGPU='%s' is not an integer$" % raw.replace(".", r"\.")
                       .replace("+", r"\+")):
        _fake(NGPU=raw)


def test_mode_is_read_case_blind_and_unknown_modes_name_the_choices():
    assert _fake(FAKEGPU_DIST_MODE=" Fake ", NGPU=4).mode == "fake"
    with pytest.raises(LaunchContractError, match=r"^FAKEGPU_DIST_MODE='simulate' is not a fake-world mode; "
                                                  r"use one of fake, real_pp_fake_spmd$"):
        _fake(FAKEGPU_DIST_MODE="SIMULATE", NGPU=4)


def test_a_long_physical_list_comes_back_whole():
    listed = ",".join(str(4 * k) for k in range(300))
    lc = _hybrid(NGPU=1200, RANK=299, WORLD_SIZE=300, FAKEGPU_PHYSICAL_RANKS=listed)
    assert lc.physical_ranks == tuple(range(0, 1200, 4)) and lc.logical_rank == 1196


def test_a_large_prime_world_lists_its_divisors_at_once():
    with pytest.raises(LaunchContractError, match=r"divides 2147483647 \(1, 2147483647\)$"):
        _fake(NGPU=2147483647, FAKEGPU_PP_DEGREE=2)


def test_the_fake_world_entrys_rewrite_is_read_back():
    """After fakegpu.fake.entry rewrote WORLD_SIZE/RANK to the logical world's, the contract
    sees the launcher's values again; a rewrite a launcher replaced is not undone."""
    env = {"FAKEGPU_DIST_MODE": "real_pp_fake_spmd", "NGPU": "8", "FAKEGPU_PP_DEGREE": "2",
           "WORLD_SIZE": "8", "RANK": "4", "FAKEGPU_LAUNCH_WORLD_SIZE": "2", "FAKEGPU_LAUNCH_RANK": "1",
           "FAKEGPU_FAKE_WORLD_ENV": "WORLD_SIZE=8 RANK=4"}
    lc = resolve(env)
    assert (lc.physical_rank, lc.logical_rank, lc.physical_world_size) == (1, 4, 2)
    with pytest.raises(LaunchContractError, match="WORLD_SIZE=8 but the PP degree is P=2"):
        resolve({**env, "RANK": "3"})


def test_real_pipeline_degree_defaults_to_the_processes_launched():
    lc = _hybrid(NGPU=8, RANK=1, WORLD_SIZE=2)
    assert (lc.pp_degree, lc.logical_rank, lc.physical_ranks) == (2, 4, (0, 4))
    with pytest.raises(LaunchContractError, match=r"P=3 \(FAKEGPU_PP_DEGREE is unset, so P is the number of "
                                                  r"processes launched, WORLD_SIZE=3: one per pipeline rank\)"):
        _hybrid(NGPU=8, RANK=0, WORLD_SIZE=3)
    # A named subset is not pipeline stages: P stays 1 there.
    assert _hybrid(NGPU=8, RANK=0, WORLD_SIZE=2, FAKEGPU_PHYSICAL_RANKS="0,3").pp_degree == 1
