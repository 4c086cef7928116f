"""torch.cuda APIs of older GPU scripts on fake devices: legacy tensor types, ipc_collect,
torch.cuda.nccl.version, set_per_process_memory_fraction (probe: fake_cuda/probe_older_apis.py)."""
import pytest
from helpers.fake_cuda_probe import NEEDS_TORCH, run_probe

pytestmark = NEEDS_TORCH


@pytest.fixture(scope="module")
def probe(shim_library) -> dict:
    return run_probe("probe_older_apis.py", 2, FAKEGPU_NCCL_LIBRARY=shim_library)


def test_legacy_cuda_tensor_types_are_the_ports_cpu_types(probe):
    assert probe["legacy_ctor"] == ["torch.float32", [1.5, 2.5], True]
    assert probe["legacy_type"] == [True, True, "torch.FloatTensor"]


def test_ipc_collect_and_the_nccl_version_of_the_shim(probe):
    assert probe["ipc_collect"]
    major, minor, patch = probe["nccl_version"]
    assert major == 2 and minor >= 18 and patch >= 0      # the shim's nccl.h: NCCL_VERSION_CODE


def test_memory_fraction_limits_one_device_with_the_allocators_error(probe):
    assert probe["fraction"] == 0.25
    assert probe["fraction_oom"].startswith("CUDA out of memory. Tried to allocate")
    assert "memory fraction 0.25" in probe["fraction_oom"] and "GPU 1" in probe["fraction_oom"]
    assert probe["device0_unaffected"]
    assert probe["bad_fraction"] == "Invalid fraction value: 1.5. Allowed range: 0~1"
