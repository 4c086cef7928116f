"""The level of fgpu plan's calibration against TorchTitan's published Llama 3.1 figures
(verification/plan_calibration.py, verification/data/published_torchtitan.csv), guarded as
the nccl-tests calibration is: table 1 (Llama 3.1 8B on 8 H100, eager, compile, Float8) is
planned as the script plans it, and each row must stay within its tolerance."""
from __future__ import annotations

import importlib.util
import sys

import pytest
from helpers.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "verification"))
import plan_calibration  # noqa: E402

# The level these rows are at (tokens/s within 10 %, memory within 5 %, planned with the SDPA
# attention the published runs used), with room for the fixed constants to move a little; a
# change past this is a regression.
TPS_TOLERANCE = 0.12
MEMORY_TOLERANCE = 0.08


def test_every_row_names_its_source_and_split():
    rows = plan_calibration.rows()
    assert len(rows) >= 10
    assert {r["split"] for r in rows} <= {"fit", "heldout", "unsupported"}
    # fit on few rows; most are held out
    assert sum(r["split"] == "fit" for r in rows) <= 2 < sum(r["split"] == "heldout" for r in rows)
    for r in rows:
        assert r["source"] and float(r["tokens_per_s_per_gpu"]) > 0 and float(r["memory_gib"]) > 0
        assert int(r["gpus"]) == int(r["dp_shard"]) * int(r["tp"]) * int(r["pp"]) * int(r["cp"]), r


def test_summary_scores_errors_and_table_order():
    results = [{"table": "1", "row": "a", "split": "fit", "tokens_per_s_per_gpu": "100", "predicted_tps": 110,
                "tps_error": 0.10, "memory_error": -0.05},
               {"table": "1", "row": "b", "split": "heldout", "tokens_per_s_per_gpu": "200", "predicted_tps": 105,
                "tps_error": -0.475, "memory_error": 0.02}]
    s = plan_calibration.summary(results)
    assert s["rows"] == 2 and s["max_tps_error"] == pytest.approx(0.475)
    assert s["median_memory_error"] == pytest.approx(0.035)
    assert s["table_order_kept"] is False              # b is published faster, predicted slower
    assert plan_calibration.summary(results, "fit")["table_order_kept"] is True


def test_an_unknown_table_is_refused_naming_the_tables_there_are(capsys):
    with pytest.raises(SystemExit) as exit_info:
        plan_calibration.main(["--rows", "1,13"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "no table 13" in err and "its tables are 1, 2, 3" in err


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                    reason="TorchTitan 0.3.0 is not installed (CI does not install it)")
def test_table_1_stays_within_its_calibrated_level():
    rows = [r for r in plan_calibration.rows() if r["table"] == "1"]
    results = plan_calibration.run(rows)
    for r in results:
        assert abs(r["tps_error"]) <= TPS_TOLERANCE, (r["row"], r["predicted_tps"], r["tokens_per_s_per_gpu"])
        assert abs(r["memory_error"]) <= MEMORY_TOLERANCE, (r["row"], r["predicted_gib"], r["memory_gib"])
    assert plan_calibration.summary(results)["table_order_kept"]


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                    reason="TorchTitan 0.3.0 is not installed (CI does not install it)")
def test_context_parallel_rows_keep_their_level():
    """Table 2 at CP 1 and 2 (8B, 8 GPUs, 32k and 64k tokens): within the calibrated level;
    CP 4's known excess over the published figure (planned as the SDPA ring attention it ran,
    whose published step time grows faster than its modeled work, docs/planning.md) is bounded
    so a change to it shows."""
    rows = [r for r in plan_calibration.rows() if r["table"] == "2" and r["cp"] in ("1", "2", "4")]
    results = {r["cp"]: r for r in plan_calibration.run(rows)}
    for cp in ("1", "2"):
        assert abs(results[cp]["tps_error"]) <= 0.15, results[cp]
    assert 0.30 <= results["4"]["tps_error"] <= 0.60, results["4"]
    for r in results.values():
        assert abs(r["memory_error"]) <= MEMORY_TOLERANCE, r
    assert plan_calibration.summary(list(results.values()))["table_order_kept"]
