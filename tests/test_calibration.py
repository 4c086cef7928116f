"""The cost model against published nccl-tests results (verification/data/published_nccl_tests.csv).

Guards today's level so a change that makes the model less faithful fails. The rows marked
`heldout` in the CSV's `split` column were added after the model's constants were set and were not
fitted on (for GCP A3 Mega only the 1 MB and 8 GB rows fix its YAML's per-message cost and
efficiency; the twelve sizes between are held out). On all 57 points 75 % are within 20 % and the
median |error| is 5.6 %; on the 19 held-out points 79 % and 3.4 %.
Known gaps, kept in the table on purpose: a 2x1 H100 forced-Tree run that reached one NIC of
four (+230..270 %), broadcast on 8x H100 (+60 %), latency of 8x RTX 4090 on PCIe (+71 %),
A3 Mega TCPXO at 32-64 MB (-35..-40 %), AllGather on 32x8 H100 RoCE (+60 %).
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
    assert within >= 0.74
    assert median <= 0.065
    held_within, held_median = calibration.summary(table, "heldout")
    assert len([r for r in table if r["split"] == "heldout"]) >= 15
    assert held_within >= 0.75 and held_median <= 0.12, (held_within, held_median)
    # large allreduces on NVLink (SXM) systems, one node or several, stay within 12 %
    big = [r for r in table if int(r["size_bytes"]) >= 1 << 30 and "SXM" in r["hardware"] and r["op"] == "allreduce"]
    assert len(big) >= 12
    assert all(abs(r["error"]) <= 0.12 for r in big), [(r["hardware"], r["error"]) for r in big]


def test_every_source_is_public_or_marked():
    for r in calibration.rows():
        assert r["source"].startswith("https://") or r["source"].startswith("unrecorded:"), r["source"]
