"""The verification workloads (verification/): each runs under gloo and under fakegpu (real
torchrun ranks, the real shim, a real coordinator) and must give the same parameters, with
the coordinator's report passing ``report check``.  See verification/run_case.py."""
from __future__ import annotations

import importlib.util
import sys

import pytest

from helpers.paths import REPO_ROOT as REPO

pytestmark = [
    pytest.mark.torch,
    pytest.mark.slow,  # each case starts torchrun twice: tens of seconds on two cores
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed"),
]

sys.path.insert(0, str(REPO / "verification"))
import run_case  # noqa: E402


@pytest.mark.parametrize("name", run_case.SUITE)
def test_case_matches_gloo(name, tmp_path, shim_library, monkeypatch):
    monkeypatch.setenv("FAKEGPU_NCCL_LIBRARY", shim_library)
    try:
        verdict = run_case.run_case(name, tmp_path)
    except run_case.CaseFailure as exc:
        pytest.fail(str(exc), pytrace=False)
    case = run_case.CASES[name]
    if case.compare_with_gloo and case.tolerance is None:
        assert "bit-exact" in verdict, verdict
    assert "report check skipped" not in verdict or not (REPO / "fakegpu/cli/report.py").exists()
    report = tmp_path / "report.json"
    assert report.is_file()
