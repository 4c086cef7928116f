"""The cost model against published nccl-tests results (verification/data/published_nccl_tests.csv).

Guards today's level so a change that makes the model less faithful fails: on these 25 points
(5 of them a 2x1 H100 forced-Tree run the model cannot reproduce, +230..270 %) 68 % are within
20 % and the median |error| is 10.8 % (before protocols: 68 %, 13.6 %).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "verification"))

import calibration  # noqa: E402


def test_model_against_published_nccl_tests():
    table = calibration.rows()
    assert len(table) >= 25
    within, median = calibration.summary(table)
    print(f"\n{len(table)} published points: {within:.0%} within 20 %, median |error| {median:.1%}")
    assert within >= 0.68
    assert median <= 0.11
    # large messages on the systems the efficiencies were fitted to stay within 5 %
    big = [r for r in table if int(r["size_bytes"]) >= 1 << 30]
    assert all(abs(r["error"]) <= 0.08 for r in big), [(r["hardware"], r["error"]) for r in big]


def test_every_source_is_public_or_marked():
    for r in calibration.rows():
        assert r["source"].startswith("https://") or r["source"].startswith("unrecorded:"), r["source"]
