"""The cost model against published nccl-tests results (verification/data/published_nccl_tests.csv).

Guards today's level so a change that makes the model less faithful fails: on these 36 points
67 % are within 20 % and the median |error| is 10.4 % (the model before this change: 53 %, 18.3 %).
Known gaps, kept in the table on purpose: a 2x1 H100 forced-Tree run that reached one NIC of
four (+230..270 %), broadcast on 8x H100 (+60 %), latency of 8x RTX 4090 on PCIe (+71 %),
2x H100 sendrecv (+62 %), 8x RTX 5090 (+25 %).
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
    assert within >= 0.66
    assert median <= 0.105
    # large allreduces on NVLink (SXM) systems, one node or several, stay within 12 %
    big = [r for r in table if int(r["size_bytes"]) >= 1 << 30 and "SXM" in r["hardware"] and r["op"] == "allreduce"]
    assert len(big) >= 12
    assert all(abs(r["error"]) <= 0.12 for r in big), [(r["hardware"], r["error"]) for r in big]


def test_every_source_is_public_or_marked():
    for r in calibration.rows():
        assert r["source"].startswith("https://") or r["source"].startswith("unrecorded:"), r["source"]
