"""The cost model against published nccl-tests results (verification/data/published_nccl_tests.csv).

Guards today's level so a change that makes the model less faithful fails. The rows marked
`heldout` in the CSV's `split` column were added after the model's constants were set and were not
fitted on (for GCP A3 Mega only the 1 MB and 8 GB rows fix its YAML's per-message cost and
efficiency; the twelve sizes between are held out). On all 130 points 73 % are within 15 %,
76 % within 20 % and 88 % within 30 %, median |error| 6.2 % (before NVLS chunking and NCCL's
multi-node tree shape: 71 / 73 / 87 %, 7.3 %); on the 20 held-out points 85 % within 20 % and
95 % within 30 %, median 3.9 % (before: 80 %, 85 %, 3.1 %). The 72 Azure rows (8x H100, 8x H200, 8x A100, 1 KB .. 8 GB) set the launch
overhead and the channel rule's constant: 64 % within 15 % (before the channel rule: 40 %).
Known gaps, kept in the table on purpose: broadcast on 8x H100 (+58 %), A3 Mega TCPXO at
32-64 MB (+18 / +27 %), 8x H200 (NCCL 2.20.5) at 32-512 KB (-29 %, flat ~31 us where the
2.18.5 H100 run climbs to 42 us), AllGather on 32x8 H100 RoCE (+60 %), 2x1 H100 with four NICs at 2-4 MB
(+33..59 %), 8x A100 on Azure below 16 KB (+50..140 %, its latency floor is twice the other
A100 source's) and at 2-128 MB (+20..55 %).
"""
from __future__ import annotations

import sys

from helpers.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "verification"))

import calibration  # noqa: E402


def test_model_against_published_nccl_tests():
    table = calibration.rows()
    assert len(table) >= 25
    within, median = calibration.summary(table)
    print(f"\n{len(table)} published points: {within:.0%} within 20 %, median |error| {median:.1%}")
    assert within >= 0.75
    assert median <= 0.07
    held_within, held_median = calibration.summary(table, "heldout")
    assert len([r for r in table if r["split"] == "heldout"]) >= 15
    assert held_within >= 0.75 and held_median <= 0.12, (held_within, held_median)
    # whole size sweeps on one node (1 KB .. 8 GB): most points within 15 %, nearly all within 30 %
    for gpu in ("H100", "H200"):
        sweep = [abs(r["error"]) for r in table if f"Azure ND {gpu} v5" in r["hardware"]]
        assert len(sweep) == 24
        assert sum(e <= 0.15 for e in sweep) >= 13 and sum(e <= 0.30 for e in sweep) >= 22, (gpu, sweep)
    # large allreduces on NVLink (SXM) systems, one node or several, stay within 12 %
    big = [r for r in table if int(r["size_bytes"]) >= 1 << 30 and "SXM" in r["hardware"] and r["op"] == "allreduce"]
    assert len(big) >= 12
    assert all(abs(r["error"]) <= 0.12 for r in big), [(r["hardware"], r["error"]) for r in big]


def test_every_source_is_public_or_marked():
    for r in calibration.rows():
        assert r["source"].startswith("https://") or r["source"].startswith("unrecorded:"), r["source"]
