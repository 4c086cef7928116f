"""Shared fixtures: the shim under test, real coordinator processes, real rank processes."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
# tests/ for `helpers`; the three test folders so that a test module can import another's
# harness by module name whichever folder (or single file) pytest was given: integration's
# test_shared_memory_limits uses unit's test_coordinator_core.Harness. Test file names are
# therefore unique across the folders (pytest's default import mode needs that anyway).
sys.path[:0] = [str(_TESTS)] + [str(_TESTS / folder) for folder in ("unit", "integration", "e2e")]

from helpers.coordinator import CoordinatorProcess, CoordinatorUnavailable  # noqa: E402
from helpers.ranks import run_ranks  # noqa: E402
from helpers.shim import build_shim, locate_shim  # noqa: E402


@pytest.fixture(autouse=True)
def _environment_kept_per_test():
    """Each test starts from the environment the session started with. fakegpu's torch backend
    sets FAKEGPU_REDUCTION_ORDER=gloo in its process when unset (docs/torch.md, "Numerics"); a
    test that creates one in the pytest process must not hand that order to the rank processes
    of later tests, which compare with the rank-order reference."""
    import os

    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def shim_library(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Path of the libnccl.so.2 to test: FAKEGPU_NCCL_LIBRARY, an installed or ./build copy,
    or one built from this checkout once per session."""
    found = locate_shim()
    if found:
        return found
    return build_shim(tmp_path_factory.mktemp("shim-build"))


@pytest.fixture
def start_coordinator():
    """``start_coordinator(transport="unix", extra_env=None)`` -> a running coordinator,
    stopped at the end of the test.  TCP is skipped (with the reason) where unsupported."""
    started: list[CoordinatorProcess] = []

    def start(transport: str = "unix", **kwargs) -> CoordinatorProcess:
        try:
            coordinator = CoordinatorProcess(transport, **kwargs)
        except CoordinatorUnavailable as exc:
            pytest.skip(f"{transport} coordinator unavailable: {exc}")
        started.append(coordinator)
        return coordinator

    yield start
    for coordinator in started:
        coordinator.stop()


@pytest.fixture(scope="module")
def module_coordinator():
    """One Unix-socket coordinator shared by a test module (each run uses its own unique ids)."""
    with CoordinatorProcess("unix") as coordinator:
        yield coordinator


@pytest.fixture
def ranks(shim_library):
    """``ranks(nranks, scenarios, coordinator, env=None, timeout_s=300)`` -> RankRun."""

    def run(nranks, scenarios, coordinator, **kwargs):
        return run_ranks(nranks, scenarios, coordinator, library=shim_library, **kwargs)

    return run
