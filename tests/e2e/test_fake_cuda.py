"""Fake CUDA devices (docs/fake-cuda.md): unmodified GPU programs on a CPU-only torch.

- the caching-allocator model against figures worked out by hand from the allocator's rules;
- the runtime in a fresh interpreter set up as fgpu sets up a rank (tests/e2e/fake_cuda/probe_*.py);
- GPU-style training programs under `fgpu -- torchrun`, compared with their hand ports to
  CPU + gloo (verification/fake_cuda/): bit for bit, with two ranks and with four (the backend
  reduces in gloo's order, docs/torch.md).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fakegpu.fake_cuda import allocator as A
from fakegpu.fake_cuda import device_count_from

from helpers.shim import REPO_ROOT
from helpers.titan import HAS_TORCHTITAN

MiB = 1 << 20
PROBES = Path(__file__).parent / "fake_cuda"
PROGRAMS = REPO_ROOT / "verification" / "fake_cuda"
AUTOLOAD = REPO_ROOT / "fakegpu" / "torch" / "autoload"
HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = [pytest.mark.torch, pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")]


# ---------------------------------------------------------------------------------------------
# The allocator model (no torch needed)


def test_rounding_and_segment_sizes_follow_the_caching_allocator():
    assert [A.round_size(n) for n in (0, 1, 511, 512, 513, 4000)] == [512, 512, 512, 512, 1024, 4096]
    assert A.segment_size(512) == 2 * MiB                       # small pool
    assert A.segment_size(1 * MiB) == 2 * MiB                   # <= 1 MiB is still small
    assert A.segment_size(1 * MiB + 512) == 20 * MiB            # large, under 10 MiB
    assert A.segment_size(10 * MiB - 512) == 20 * MiB
    assert A.segment_size(10 * MiB) == 10 * MiB                 # >= 10 MiB: rounded to 2 MiB
    assert A.segment_size(12 * MiB + 512) == 14 * MiB


def test_small_blocks_share_a_segment_and_merge_back():
    m = A.CachingAllocatorModel(0, 80 << 30)
    blocks = [m.malloc(n) for n in (4, 1000, 600_000)]
    assert m.allocated == 512 + 1024 + 600_064
    assert m.reserved == 2 * MiB and len(m.segments) == 1
    for b in blocks:
        m.free(b)
    assert m.allocated == 0 and m.reserved == 2 * MiB
    assert len(m.segments[0].blocks) == 1                        # merged into one free block
    m.release_cached()
    assert m.reserved == 0
    stats = m.memory_stats()
    assert stats["allocated_bytes.all.peak"] == 512 + 1024 + 600_064
    assert stats["segment.small_pool.allocated"] == 1 and stats["num_device_free"] == 1


def test_large_requests_split_20mib_segments_and_reuse_free_blocks():
    m = A.CachingAllocatorModel(0, 80 << 30)
    a = m.malloc(3 * MiB)            # new 20 MiB segment, 17 MiB remainder stays free
    b = m.malloc(3 * MiB)            # best fit: the remainder
    assert (m.allocated, m.reserved) == (6 * MiB, 20 * MiB)
    c = m.malloc(12 * MiB + 1)       # 12 MiB + 512 fits the 14 MiB remainder
    assert (m.allocated, m.reserved) == (18 * MiB + 512, 20 * MiB)
    d = m.malloc(12 * MiB)           # nothing free fits: a 12 MiB segment of its own
    assert m.reserved == 32 * MiB
    m.free(a)
    m.release_cached()               # the 20 MiB segment still holds b and c
    assert m.reserved == 32 * MiB
    m.free(d)
    m.release_cached()
    assert m.reserved == 20 * MiB
    m.free(b)
    m.free(c)
    assert m.allocated == 0
    m.release_cached()
    assert m.reserved == 0 and m.memory_stats()["allocated_bytes.all.peak"] == 30 * MiB + 512


def test_small_remainders_of_large_blocks_are_not_split_off():
    m = A.CachingAllocatorModel(0, 80 << 30)
    big = m.malloc(19 * MiB + 512)   # 20 MiB segment; the 512 KiB left is <= 1 MiB: no split
    assert len(m.segments[0].blocks) == 1
    assert m.allocated == 20 * MiB   # an unsplit block counts whole, as allocated_bytes does on a GPU
    assert m.memory_stats()["requested_bytes.all.current"] == 19 * MiB + 512
    m.free(big)


def test_out_of_memory_after_releasing_the_cache():
    m = A.CachingAllocatorModel(3, 30 * MiB)
    kept = m.malloc(3 * MiB)                       # 20 MiB segment
    spare = m.malloc(12 * MiB)                     # fits the 17 MiB remainder
    m.free(spare)
    with pytest.raises(A.OutOfMemory, match="Tried to allocate 20.00 MiB. GPU 3"):
        m.malloc(20 * MiB)                         # would need a 20 MiB segment: 40 > 30 MiB
    assert m.num_alloc_retries == 1 and m.num_ooms == 1
    m.free(kept)
    m.release_cached()
    assert m.malloc(20 * MiB).size == 20 * MiB     # fits once the cache is released


def test_random_allocation_sequences_keep_the_allocators_invariants():
    import random

    rng = random.Random(7)
    m = A.CachingAllocatorModel(0, 4 << 30)
    live = {}
    for step in range(3000):
        if live and rng.random() < 0.45:
            key = rng.choice(list(live))
            m.free(live.pop(key))
        else:
            nbytes = rng.choice([1, 700, 4096, 600_000, 1 << 20, 3 * MiB + 5, 12 * MiB])
            live[step] = m.malloc(nbytes)
        if step % 250 == 0:
            m.release_cached()
    segments = m.segments
    assert m.allocated == sum(b.size for b in live.values())
    assert m.reserved == sum(s.size for s in segments)
    for segment in segments:
        blocks = segment.blocks
        assert sum(b.size for b in blocks) == segment.size
        assert [b.address for b in blocks] == sorted(b.address for b in blocks)
        assert blocks[0].address == segment.address
        for a, b in zip(blocks, blocks[1:]):
            assert a.address + a.size == b.address
            assert a.allocated or b.allocated, "two free neighbours were not merged"
    stats = m.memory_stats()
    assert stats["allocation.all.current"] == len(live)
    assert stats["requested_bytes.all.current"] == sum(b.requested for b in live.values())
    assert stats["allocated_bytes.all.peak"] >= m.allocated
    for block in list(live.values()):
        m.free(block)
    m.release_cached()
    assert (m.allocated, m.reserved, len(m.segments)) == (0, 0, 0)


def test_cuda_visible_devices_narrows_the_devices_as_cuda_does():
    from fakegpu.fake_cuda import visible_devices

    env = {"FAKEGPU_DEVICE_COUNT": "4"}
    assert device_count_from(dict(env, CUDA_VISIBLE_DEVICES="2,3")) == 2
    assert visible_devices(4, {"CUDA_VISIBLE_DEVICES": "3, 1"}) == [3, 1]      # order kept
    assert visible_devices(4, {"CUDA_VISIBLE_DEVICES": "0,1,7,2"}) == [0, 1]   # ends at 7 (out of range)
    assert visible_devices(4, {"CUDA_VISIBLE_DEVICES": "1,1,2"}) == [1]        # ends at the repeat
    assert visible_devices(4, {"CUDA_VISIBLE_DEVICES": "-1,0"}) == []          # CUDA's way to hide all
    assert visible_devices(4, {"CUDA_VISIBLE_DEVICES": ""}) == []
    assert visible_devices(4, {"CUDA_VISIBLE_DEVICES": "GPU-8f0c2e1a,GPU-1"}) == [0, 1, 2, 3]  # UUIDs: not applied
    assert visible_devices(4, {}) == [0, 1, 2, 3]


def test_visible_devices_take_their_physical_gpus_profiles(tmp_path):
    from fakegpu.fake_cuda.devices import profiles_for_this_process

    config = tmp_path / "mixed.yaml"
    config.write_text(textwrap.dedent("""
        version: 1
        cluster:
          name: mixed
        nodes:
          - id: node0
            ranks: [0, 1, 2, 3]
            gpus: [{profile: h100}, {profile: h100}, {profile: a100}, {profile: a100}]
        fabric:
          intra_node: {type: nvlink, bandwidth_gbps: 3600, latency_us: 3}
          inter_node: {type: infiniband, bandwidth_gbps: 400, latency_us: 5}
    """))
    from fakegpu.topology import load_cluster_config

    load_cluster_config(str(config))   # the YAML itself is valid (a broken one falls back silently)
    env = {"FAKEGPU_CLUSTER_CONFIG": str(config), "RANK": "0", "FAKEGPU_DEVICE_COUNT": "4"}
    assert profiles_for_this_process(4, env) == ["h100", "h100", "a100", "a100"]
    assert profiles_for_this_process(2, dict(env, CUDA_VISIBLE_DEVICES="2,0")) == ["a100", "h100"]


def test_device_count_defaults():
    assert device_count_from({}) == 1
    assert device_count_from({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert device_count_from({"LOCAL_WORLD_SIZE": "4", "FAKEGPU_DEVICE_COUNT": "8"}) == 8
    with pytest.raises(ValueError, match="FAKEGPU_DEVICE_COUNT='zero'"):
        device_count_from({"FAKEGPU_DEVICE_COUNT": "zero"})


# ---------------------------------------------------------------------------------------------
# The runtime in a rank-like interpreter


def _rank_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_")}
    env["PYTHONPATH"] = os.pathsep.join([str(AUTOLOAD), str(REPO_ROOT)])
    env.update(extra)
    return env


def _run_probe(name: str, env: dict, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(PROBES / name)], env=env, capture_output=True,
                          text=True, timeout=180, stdin=subprocess.DEVNULL)
    if check:
        assert done.returncode == 0, done.stderr[-4000:]
    return done


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_a_daemon_thread_computing_at_exit_does_not_abort_the_finished_program(shim_library):
    # Before the shim parked such threads (native/src/python/thread_exit.cc), this exited with
    # SIGABRT every time: "terminate called without an active exception".
    done = _run_probe("probe_daemon_thread_at_exit.py",
                      _rank_env(FAKEGPU_FAKE_CUDA="1", LD_PRELOAD=shim_library), check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "main done"
    assert "terminate called" not in done.stderr


@pytest.mark.parametrize("memory", ["1", "0"])
@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_optimizers_of_fake_device_parameters_take_the_gpu_foreach_path_with_the_same_bits(memory):
    done = _run_probe("probe_optim_defaults.py", _rank_env(FAKEGPU_FAKE_CUDA="1", FAKEGPU_FAKE_CUDA_MEMORY=memory),
                      check=False)
    if memory == "0":
        # Without memory tracking no storage is placed: every CPU parameter counts as the GPU's.
        assert done.returncode != 0 and "CPU parameters took the foreach path" in done.stderr, done.stderr[-3000:]
    else:
        assert done.returncode == 0, done.stderr[-4000:]
        assert done.stdout.strip() == "ok"


TWO_GPU_NODE = textwrap.dedent("""
    version: 1
    cluster: {name: probe, default_backend: nccl}
    nodes:
      - {id: n0, host: 127.0.0.1, ranks: [0, 1], gpus: [{profile: h100}, {profile: a100}]}
    fabric:
      intra_node: {type: nvlink, bandwidth_gbps: 300, latency_us: 3}
      inter_node: {type: infiniband, bandwidth_gbps: 200, latency_us: 15}
""")


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> dict:
    if not HAS_TORCH:
        pytest.skip("torch is not installed")
    yaml_path = tmp_path_factory.mktemp("probe") / "cluster.yaml"
    yaml_path.write_text(TWO_GPU_NODE)
    done = _run_probe("probe_api.py", _rank_env(FAKEGPU_FAKE_CUDA="1", FAKEGPU_DEVICE_COUNT="2",
                                                FAKEGPU_CLUSTER_CONFIG=str(yaml_path)))
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.torch
def test_devices_come_from_the_cluster_profile(probe):
    assert probe["available"] and probe["count"] == 2
    assert probe["names"] == ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"]
    assert probe["capability"] == [[9, 0], [8, 0]]
    assert probe["props1"] == {"total_memory": 40_000_000_000, "sms": 108, "major": 8}
    assert probe["bf16"]
    assert (probe["current_after_set"], probe["inside_ctx"], probe["after_ctx"]) == (1, 0, 1)
    assert probe["accelerator"] == "cuda" and probe["acc_available"] and probe["acc_count"] == 2
    assert probe["acc_inside"] == 1 and probe["device_module_count"] == 2


@pytest.mark.torch
def test_memory_api_reports_the_caching_allocator_figures(probe):
    m = probe["memory"]
    assert (m["small_alloc"], m["small_reserved"], m["dev0_untouched"]) == (4096, 2 * MiB, 0)
    assert m["after_op"] == 2 * 4096                      # small * 2 lives on cuda:1 too
    assert (m["two_3mib"], m["two_3mib_reserved"]) == (6 * MiB, 20 * MiB)
    assert (m["with_12mib"], m["with_12mib_reserved"]) == (18 * MiB + 512, 20 * MiB)
    assert m["after_free_a_empty_cache"] == [15 * MiB + 512, 20 * MiB]
    assert m["segments"] == [20 * MiB]
    assert m["after_free_all"] == [0, 20 * MiB] and m["after_empty_cache"] == [0, 0]
    assert m["peak"] == m["stats_peak"] == 18 * MiB + 512 and m["peak_after_reset"] == 0
    assert m["mem_get_info1"] == [40_000_000_000 - 2 * MiB, 40_000_000_000]
    assert m["cuda_call"] == 2 * 4096 + 256 * 256 * 4      # .cuda(1) of a CPU tensor
    assert probe["load_charged"] == 4096                  # torch.load(map_location="cuda:1")


@pytest.mark.torch
def test_tensors_behave_as_in_the_cpu_port(probe):
    assert probe["to_cuda_same_storage"]                  # .to("cuda") / .cuda(): no copy
    assert probe["module_param_device"] == "cpu"          # the documented consequence
    assert probe["rng_equal"] and probe["generator_equal"]
    assert probe["streams_ok"]
    assert probe["autocast_dtype"] == "torch.bfloat16"
    assert probe["backward_grad"] == [4.0, 4.0, 4.0]      # cuda tensors made inside backward
    assert probe["thread_charged"] == 4096                # a thread the program started


@pytest.mark.torch
def test_gpu_only_kernels_fall_back_to_exact_cpu_math(probe):
    assert probe["fused_equal"]
    assert probe["sdpa_efficient_equals_math"]
    assert probe["direct_attention_ops_equal_math"]


@pytest.mark.parametrize("dummy", [None], ids=["custom-cuda-op"])
@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_an_op_without_cpu_kernel_fails_with_one_line(dummy):
    done = _run_probe("probe_unsupported_op.py", _rank_env(FAKEGPU_FAKE_CUDA="1"), check=False)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("fakegpu: fgpu_probe::cuda_only has no CPU implementation")
    assert "fake CUDA devices" in lines[0] and "--mode hybrid" in lines[0]


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_cuda_and_nccl_requests_outside_fake_devices_get_an_fgpu_hint():
    done = _run_probe("probe_hints.py", _rank_env())
    messages = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(messages) == {"cuda", "nccl"}
    for text in messages.values():
        assert "fakegpu:" in text and "fgpu" in text and "\n" not in text


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_fake_devices_turned_off_say_so():
    done = _run_probe("probe_hints.py", _rank_env(FAKEGPU_FAKE_CUDA="0", FAKEGPU_MODE="simulate"))
    messages = json.loads(done.stdout.strip().splitlines()[-1])
    assert "fake CUDA devices are off" in messages["nccl"] and "FAKEGPU_FAKE_CUDA=0" in messages["nccl"]


# ---------------------------------------------------------------------------------------------
# GPU programs under fgpu -- torchrun against their CPU + gloo ports


def _run_program(tmp_path: Path, program: str, nproc: int, shim_library: str, under_fgpu: bool,
                 extra_args=()) -> list[dict]:
    import torch

    from helpers.torchrun import fgpu_env, run_fgpu_torchrun

    out = tmp_path / ("fake" if under_fgpu else "port")
    out.mkdir()
    torchrun = ["--standalone", "--nproc-per-node", str(nproc), str(PROGRAMS / program), str(out),
                *extra_args]
    env = fgpu_env(shim_library, FAKEGPU_COORDINATOR_TIMEOUT_MS="60000")
    if under_fgpu:
        run_fgpu_torchrun(tmp_path, env, ["-q", "--device-count", str(nproc)], torchrun)
    else:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *torchrun], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr[-5000:]
    return [torch.load(out / f"rank{r}.pt") for r in range(nproc)]


def _compare(fake: list[dict], port: list[dict], exact: bool) -> None:
    import torch

    for rank, (f, p) in enumerate(zip(fake, port)):
        if exact:
            assert f["losses"] == p["losses"], rank
        else:
            assert f["losses"] == pytest.approx(p["losses"], rel=1e-5), rank
        assert f["params"].keys() == p["params"].keys()
        for name in f["params"]:
            if exact:
                assert torch.equal(f["params"][name], p["params"][name]), (rank, name)
            else:
                torch.testing.assert_close(f["params"][name], p["params"][name], rtol=1e-5, atol=1e-7)


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_unmodified_ddp_gpu_script_matches_its_cpu_port_bit_for_bit(tmp_path, shim_library):
    fake = _run_program(tmp_path, "ddp_gpu.py", 2, shim_library, under_fgpu=True)
    port = _run_program(tmp_path, "ddp_cpu.py", 2, shim_library, under_fgpu=False)
    _compare(fake, port, exact=True)
    assert [f["device_count"] for f in fake] == [2, 2]
    assert [f["current_device"] for f in fake] == [0, 1]
    assert all(f["max_memory_allocated"] > 0 for f in fake)


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_accelerator_only_fsdp2_script_matches_its_cpu_port_bit_for_bit(tmp_path, shim_library):
    fake = _run_program(tmp_path, "accel_fsdp2_gpu.py", 2, shim_library, under_fgpu=True)
    port = _run_program(tmp_path, "accel_fsdp2_cpu.py", 2, shim_library, under_fgpu=False)
    _compare(fake, port, exact=True)
    assert [f["device_count"] for f in fake] == [2, 2]


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_fsdp2_mixed_precision_script_matches_its_cpu_port_bit_for_bit(tmp_path, shim_library):
    import torch

    # bfloat16 parameters and compute, float32 gradient reduce-scatter (TorchTitan's default)
    fake = _run_program(tmp_path, "accel_fsdp2_gpu.py", 2, shim_library, under_fgpu=True, extra_args=["bf16"])
    port = _run_program(tmp_path, "accel_fsdp2_cpu.py", 2, shim_library, under_fgpu=False, extra_args=["bf16"])
    _compare(fake, port, exact=True)
    assert all(p.dtype == torch.float32 for p in fake[0]["params"].values())   # sharded fp32 master


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_unmodified_ddp_gpu_script_on_four_ranks(tmp_path, shim_library):
    fake = _run_program(tmp_path, "ddp_gpu.py", 4, shim_library, under_fgpu=True)
    port = _run_program(tmp_path, "ddp_cpu.py", 4, shim_library, under_fgpu=False)
    _compare(fake, port, exact=True)  # the backend sums in gloo's order (docs/torch.md)


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_tensor_parallel_on_a_cuda_mesh_matches_its_cpu_port_bit_for_bit(tmp_path, shim_library):
    fake = _run_program(tmp_path, "tp_gpu.py", 2, shim_library, under_fgpu=True)
    port = _run_program(tmp_path, "tp_cpu.py", 2, shim_library, under_fgpu=False)
    _compare(fake, port, exact=True)


def test_fgpu_says_no_rank_reached_nccl_instead_of_a_world_size_1_summary(tmp_path, shim_library):
    from helpers.torchrun import fgpu_env

    done = subprocess.run([sys.executable, "-m", "fakegpu", "run", "--", sys.executable, "-c",
                           "import sys; print('rank failed', file=sys.stderr); sys.exit(3)"],
                          cwd=tmp_path, env=fgpu_env(shim_library), capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 3
    assert "fgpu: no rank reached NCCL" in done.stderr and "status 3" in done.stderr
    assert "world size" not in done.stderr


def test_fgpu_says_a_failed_job_report_covers_only_what_ran(tmp_path, shim_library):
    """Ranks that created their communicator and then failed before any collective: the summary
    is followed by a line that says so (not a finished job's figures)."""
    from helpers.torchrun import fgpu_env

    program = ("import sys\nfrom fakegpu.nccl import Nccl\nn = Nccl()\n"
               "n.comm_init_rank(1, n.get_unique_id(), 0)\nprint('rank failed', file=sys.stderr)\nsys.exit(4)\n")
    done = subprocess.run([sys.executable, "-m", "fakegpu", "run", "--", sys.executable, "-c", program],
                          cwd=tmp_path, env=fgpu_env(shim_library), capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 4, done.stderr[-3000:]
    assert "exited with status 4: the report covers only what ran before the failure" in done.stderr
    assert "no collective completed" in done.stderr


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_accelerator_only_fsdp2_script_on_four_ranks(tmp_path, shim_library):
    fake = _run_program(tmp_path, "accel_fsdp2_gpu.py", 4, shim_library, under_fgpu=True)
    port = _run_program(tmp_path, "accel_fsdp2_cpu.py", 4, shim_library, under_fgpu=False)
    _compare(fake, port, exact=True)  # the backend sums in gloo's order (docs/torch.md)
    assert [f["device_count"] for f in fake] == [4] * 4


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_fsdp1_gpu_script_matches_its_cpu_port_bit_for_bit(tmp_path, shim_library):
    fake = _run_program(tmp_path, "fsdp1_gpu.py", 2, shim_library, under_fgpu=True)
    port = _run_program(tmp_path, "fsdp1_cpu.py", 2, shim_library, under_fgpu=False)
    _compare(fake, port, exact=True)


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_pipeline_gpu_script_matches_its_cpu_port_bit_for_bit(tmp_path, shim_library):
    fake = _run_program(tmp_path, "pp_gpu.py", 2, shim_library, under_fgpu=True)
    port = _run_program(tmp_path, "pp_cpu.py", 2, shim_library, under_fgpu=False)
    _compare(fake, port, exact=True)
    assert fake[1]["losses"] and fake[1]["losses"] == port[1]["losses"]


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_fsdp2_x_tp_with_dcp_checkpoint_matches_its_cpu_port(tmp_path, shim_library):
    # Every reduction group of the 2 x 2 mesh has two ranks: bit for bit.
    fake = _run_program(tmp_path, "fsdp_tp_dcp_gpu.py", 4, shim_library, under_fgpu=True)
    port = _run_program(tmp_path, "fsdp_tp_dcp_cpu.py", 4, shim_library, under_fgpu=False)
    _compare(fake, port, exact=True)


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_context_parallel_sdpa_runs_torchs_ring_attention_exactly(tmp_path, shim_library):
    """torch's context_parallel with SDPA on 4 fake GPUs: the ring (flash kernel for bf16,
    memory-efficient for fp32, grouped keys) gives each rank its shard of the whole causal
    attention and of its q, k, v gradients (a float64 reference), which needs the kernels'
    real log-sum-exp (merging) and gradients taken against the merged result."""
    from helpers.torchrun import fgpu_env, run_fgpu_torchrun

    run_fgpu_torchrun(tmp_path, fgpu_env(shim_library, FAKEGPU_COORDINATOR_TIMEOUT_MS="60000"),
                      ["-q", "--device-count", "4"],
                      ["--standalone", "--nproc-per-node", "4",
                       str(PROGRAMS / "context_parallel_sdpa_gpu.py"), str(tmp_path)])
    for rank in range(4):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert max(errors["fp32"]) < 1e-5, (rank, errors)
        for case in ("bf16", "bf16_gqa"):       # bfloat16 rounds to 2^-8 of the value
            assert max(errors[case]) < 0.02, (rank, case, errors)


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_nccl_spellings_become_the_fakegpu_backend_and_gloo_groups_stay(tmp_path, shim_library):
    from helpers.torchrun import fgpu_env, run_fgpu_torchrun

    report = tmp_path / "report.json"
    run_fgpu_torchrun(tmp_path, fgpu_env(shim_library, FAKEGPU_COORDINATOR_TIMEOUT_MS="60000"),
                      ["-q", "--report", str(report)],
                      ["--standalone", "--nproc-per-node", "2", str(PROBES / "mixed_backends.py"),
                       str(tmp_path)])
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["sum"] == [3.0] * 4 and got["gloo_sum"] == [2.0, 2.0]
        assert got["objects"] == [{"rank": 0}, {"rank": 1}]
        assert got["backend"] == "fakegpu" and got["default_for_cuda"] == "fakegpu"
        assert got["gloo_backend"] == "gloo"
    data = json.loads(report.read_text())
    assert data["world_size"] == 2 and data["communicators"]   # the cuda traffic reached the coordinator


# ---------------------------------------------------------------------------------------------
# Paths of programs written for newer torch and GPU-only features (TorchTitan's, among others)


@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_flex_attention_and_newer_distributed_apis_under_fake_cuda():
    done = _run_probe("probe_newer_torch_paths.py", _rank_env(FAKEGPU_FAKE_CUDA="1"))
    got = json.loads(done.stdout.strip().splitlines()[-1])
    # flex_attention with gradients: torch's reference implementation, eager or compiled,
    # whose output is charged to the fake device like any other op's.
    assert got["flex_forward_close"] and got["flex_grads_close"]
    assert got["compiled_flex_equals_eager"] and got["flex_output_charged"]
    assert got["flex_under_sac_equal"]
    assert got["flex_under_sac_new_graphs"] == 0
    # CUDA graphs are emulated (test_fake_cuda_graphs.py); CUDAGraph is still a class.
    assert got["cudagraph_is_class"] and got["capturing"] is False
    # torch.distributed.set_timeout and step(arg_mbs=...) as the newer torch defines them:
    # microbatches given pre-split train exactly as the whole batch split by step().
    assert got["set_timeout_ok"] and got["step_arg_mbs_equal"] and len(got["step_losses"]) == 2


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.skipif(not HAS_TORCHTITAN,
                    reason="TorchTitan 0.3.0 (with tensorboard, tokenizers, datasets) is not "
                           "installed; CI does not install it")
def test_torchtitan_fsdp2_x_tp2_matches_its_cpu_port(tmp_path, shim_library):
    # TorchTitan unmodified under fgpu, against verification/titan/cpu_port.py; every
    # reduction group of the 2 x 2 mesh has two ranks, so the driver demands bit for bit.
    # Three steps: TorchTitan's default CUDA graph is captured in step 2 and replayed in 3.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_")}
    env["FAKEGPU_NCCL_LIBRARY"] = shim_library
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "verification" / "titan" / "run_titan.py"),
         "--steps", "3", "--only", "fsdp2_tp2", "--workdir", str(tmp_path), "--timeout", "600"],
        env=env, capture_output=True, text=True, timeout=1300, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    row = [line for line in done.stdout.splitlines() if line.startswith("| fsdp2_tp2 ")]
    assert row and "yes (bit for bit)" in row[0], done.stdout
