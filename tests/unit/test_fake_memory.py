"""Memory capture at the four capture points, and comparing two runs."""
from __future__ import annotations

import json
import sys
import types

import pytest

from fakegpu.fake import memory, runtime
from fakegpu.fake.contract import resolve


@pytest.fixture
def fake_world(monkeypatch, tmp_path):
    monkeypatch.delenv("FAKEGPU_CLUSTER_REPORT_PATH", raising=False)
    monkeypatch.delenv("FAKEGPU_FAKE_REPORT_PATH", raising=False)
    monkeypatch.delenv("FAKEGPU_FAKE_EVENTS_PATH", raising=False)
    monkeypatch.setattr(memory, "_captures", [])
    runtime.reset()
    world = runtime.get_or_create(resolve({"NGPU": "64", "FAKEGPU_PP_DEGREE": "4", "FAKE_PP_RANK": "2"}))
    yield world
    world.finished = True
    runtime.reset()


def test_cpu_capture_records_the_logical_rank_and_writes_the_file(fake_world, monkeypatch, tmp_path):
    path = tmp_path / "mem.json"
    monkeypatch.setenv("FAKEGPU_MEMORY_CAPTURE_PATH", str(path))
    keep = bytearray(4 << 20)   # noqa: F841 - something for tracemalloc to see
    for point in memory.CAPTURE_POINTS:
        rec = memory.capture(point)
        assert rec["logical_rank"] == 32 and rec["pp_rank"] == 2 and rec["mode"] == "fake"
        assert rec["device"] == "cpu"
        assert rec["stats"]["rss_bytes"] > 0 and "tracemalloc.peak" in rec["stats"]
    data = json.loads(path.read_text())
    assert [c["point"] for c in data["captures"]] == list(memory.CAPTURE_POINTS)
    assert [m["point"] for m in fake_world.memory] == list(memory.CAPTURE_POINTS)
    rows = memory.summarize_for_report(fake_world.memory)
    assert rows[0]["logical_rank"] == 32 and "rss_bytes" in rows[0]


def test_cuda_capture_uses_memory_stats_and_snapshot(fake_world, monkeypatch):
    stats = {"allocated_bytes.all.current": 100, "allocated_bytes.all.peak": 300,
             "reserved_bytes.all.current": 512, "num_ooms": 0}
    segments = [{"total_size": 512, "blocks": [{"size": 100, "state": "active_allocated"},
                                               {"size": 412, "state": "inactive"}]}]
    cuda = types.SimpleNamespace(is_available=lambda: True, current_device=lambda: 3,
                                 memory_stats=lambda: stats, max_memory_allocated=lambda: 300,
                                 max_memory_reserved=lambda: 512, memory_snapshot=lambda: segments)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    rec = memory.capture("after_init")
    assert rec["device"] == "cuda:3" and rec["max_memory_allocated"] == 300
    assert rec["stats"]["allocated_bytes.all.peak"] == 300 and rec["stats"]["segment.all.current"] == 0
    assert rec["snapshot"] == {"segments": 1, "segment_bytes": 512, "blocks": 2, "active_blocks": 1,
                               "largest_active_blocks": [100]}


def _capture_file(path, rank, pp_rank, point, **stats):
    path.write_text(json.dumps({"version": 1, "captures": [
        {"point": point, "logical_rank": rank, "pp_rank": pp_rank, "device": "cpu", "stats": stats}]}))
    return str(path)


def test_compare_prints_differences(tmp_path, capsys):
    a = _capture_file(tmp_path / "a.json", 256, 1, "steady_state_fwd_bwd", rss_bytes=1 << 20, tracemalloc_peak=10)
    b = _capture_file(tmp_path / "b.json", 256, 1, "steady_state_fwd_bwd", rss_bytes=3 << 20, tracemalloc_peak=10)
    assert memory.main(["compare", a, b, "--rank", "256", "--point", "steady_state_fwd_bwd"]) == 0
    out = capsys.readouterr().out
    assert "logical rank 256, point steady_state_fwd_bwd" in out
    line = next(l for l in out.splitlines() if l.startswith("rss_bytes"))
    assert "1.00 MiB" in line and "3.00 MiB" in line and "2.00 MiB" in line and "3.000" in line


def test_compare_refuses_missing_points_and_other_pp_coordinates(tmp_path, capsys):
    a = _capture_file(tmp_path / "a.json", 0, 0, "after_init", rss_bytes=1)
    b = _capture_file(tmp_path / "b.json", 0, 1, "after_init", rss_bytes=2)
    assert memory.main(["compare", a, b, "--point", "after_optimizer_step"]) == 2
    assert "no capture of logical rank 0 at 'after_optimizer_step'" in capsys.readouterr().err
    assert memory.main(["compare", a, b, "--point", "after_init"]) == 2
    assert "different PP coordinates" in capsys.readouterr().err
    c = _capture_file(tmp_path / "c.json", 5, 0, "after_init", rss_bytes=2)
    assert memory.main(["compare", a, c, "--point", "after_init", "--rank", "0"]) == 2
    assert "no capture of logical rank 0" in capsys.readouterr().err
    (tmp_path / "junk.json").write_text("[1, 2]")
    assert memory.main(["compare", str(tmp_path / "junk.json"), a, "--point", "after_init"]) == 2
    assert "neither a memory capture file nor a cluster report" in capsys.readouterr().err


def test_auto_capture_hooks_the_four_points(fake_world):
    import torch
    import torch.nn as nn

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handles = memory.auto_capture(opt, model)
    for _ in range(3):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    for h in handles:
        h.remove()
    points = [c["point"] for c in memory.captures()]
    assert points == ["after_init", "after_optimizer_warmup", "steady_state_fwd_bwd", "after_optimizer_step",
                      "steady_state_fwd_bwd", "after_optimizer_step"]
    rows = memory.summarize_for_report(fake_world.memory)
    assert sorted(r["point"] for r in rows) == sorted(memory.CAPTURE_POINTS)   # latest of each
