"""The cost model against published nccl-tests results (verification/data/published_nccl_tests.csv).

Guards today's level so a change that makes the model less faithful fails. The rows marked
`heldout` in the CSV's `split` column were added after the model's constants were set and were not
fitted on (for GCP A3 Mega only the 1 MB and 8 GB rows fix its YAML's per-message cost and
efficiency; the twelve sizes between are held out). On all 192 points 81 % are within 20 %,
median |error| 6.5 %; on the 74 held-out points 92 % within 20 %, median 7.4 % (before the
AllGather / ReduceScatter sweeps of 2026-12-05, 149 and 31 points: 78 % / 5.9 % and 90 % / 4.6 %). The Nebius 2x8 H100
sweep fits the fill (its 16 MB / 128 MB rows were +79 / +29 % before, +6 / +1 % now); the OCI
2x8 H100 RoCE and CoreWeave 8x8 H100 SHARP rows came after it. The 72 Azure rows (8x H100, 8x H200, 8x A100, 1 KB .. 8 GB) set the launch
overhead and the channel rule's constant: 64 % within 15 % (before the channel rule: 40 %).
Known gaps, kept in the table on purpose: broadcast on 8x H100 (+58 %), A3 Mega TCPXO at
32-64 MB (+18 / +27 %), 8x H200 (NCCL 2.20.5) at 32-512 KB (-29 %, flat ~31 us where the
2.18.5 H100 run climbs to 42 us), AllGather on 32x8 H100 RoCE (+60 %), 2x1 H100 with four NICs at 2-4 MB
(+33..59 %), 8x A100 on Azure below 16 KB (+50..140 %, its latency floor is twice the other
A100 source's) and at 2-128 MB (+20..55 %), 2x8 A100 over 16x 100G RoCE at 10 GiB (-19 %),
CollNet (SHARP) on 8x8 H100 at 512 MB - 1 GB (+13..16 %), 2x8 H100 NDR at 1 MB (+63 %).
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
    # large allreduces on NVLink (SXM) systems, one node or several, stay within 12 %; with the
    # network switches reducing (SHARP, CollNet) within 20 %
    big = [r for r in table if int(r["size_bytes"]) >= 1 << 30 and "SXM" in r["hardware"] and r["op"] == "allreduce"]
    collnet = [r for r in big if "CollNet" in r["env"]]
    # a known gap, kept visible in the table: 2x8 A100 over 16x 100G RoCE (OCI) reaches 223 GB/s,
    # above what the model's ring (180) or tree (169) gives that network
    known_gap = [r for r in big if "OCI BM.GPU4.8" in r["hardware"]]
    assert [round(r["error"], 2) for r in known_gap] == [-0.19]
    big = [r for r in big if r not in collnet and r not in known_gap]
    assert len(big) >= 12 and len(collnet) >= 4
    assert all(abs(r["error"]) <= 0.12 for r in big), [(r["hardware"], r["error"]) for r in big]
    assert all(abs(r["error"]) <= 0.20 for r in collnet), [(r["hardware"], r["error"]) for r in collnet]
    # AllGather / ReduceScatter on one H100 node (held out): 8-rank forced-ring ReduceScatter within
    # 8 %; the 4-rank sweeps (64 KB .. 8 GB) mostly within 20 %
    ring_rs = [r for r in table if "reduce_scatter (NCCL_ALGO=Ring)" in r["hardware"]]
    assert len(ring_rs) == 7 and all(abs(r["error"]) <= 0.08 for r in ring_rs), ring_rs
    sweeps = [abs(r["error"]) for r in table if r["hardware"].startswith("4 of 8 H100")]
    assert len(sweeps) == 36 and sum(e <= 0.20 for e in sweeps) >= 32, sweeps
    # 2x8 H100 over NDR / RoCE from 16 MB up: NVLS-tree's pipeline fill keeps mid sizes within 10 %
    mid = [r for r in table if r["hardware"].startswith("2x8 H100 SXM") and "A3 Mega" not in r["hardware"]
           and int(r["size_bytes"]) >= 16 << 20]
    assert len(mid) >= 15
    assert all(abs(r["error"]) <= 0.10 for r in mid), [(r["hardware"], r["size_bytes"], r["error"]) for r in mid]


def test_every_source_is_public_or_marked():
    for r in calibration.rows():
        assert r["source"].startswith("https://") or r["source"].startswith("unrecorded:"), r["source"]


def test_another_checkouts_model_is_scored_on_the_same_rows():
    """`calibration.py --before CHECKOUT` times every row with that checkout's own code in a
    process of its own; pointed at this tree it must give this model's times, row for row
    (rows with an NCCL environment excepted: the other process runs without it)."""
    from fakegpu import costmodel

    table = calibration.rows()
    seconds = calibration.other_checkout_seconds(REPO_ROOT, table)
    assert len(seconds) == len(table)
    plain = [(r, s) for r, s in zip(table, seconds) if not r["env"]]
    assert len(plain) > 150
    for r, s in plain:
        busbw = costmodel.busbw_gbs(calibration.OPS_BY_NAME[r["op"]], int(r["size_bytes"]), s,
                                    calibration.ranks_of(r))
        assert abs(busbw - r["model_busbw"]) <= 1e-9 * r["model_busbw"], (r["hardware"], r["size_bytes"])
