"""nn.DataParallel over 3 fake devices in one process (fakegpu/fake_cuda/data_parallel.py).

The probe (tests/e2e/fake_cuda/probe_data_parallel.py) runs in a fresh interpreter set up as fgpu
sets up a rank; it trains `nn.DataParallel(model).cuda()` beside the computation DataParallel
stands for, done by hand, and everything must agree bit for bit.
"""
import pytest
from helpers.fake_cuda_probe import NEEDS_TORCH, run_probe

pytestmark = NEEDS_TORCH


@pytest.fixture(scope="module")
def probe() -> dict:
    return run_probe("probe_data_parallel.py", 3)


def test_data_parallel_spans_every_fake_device(probe):
    assert probe["device_count"] == 3 and probe["device_ids"] == [0, 1, 2]


def test_training_equals_chunks_on_replicas_with_gradients_summed_in_device_order(probe):
    assert probe["outputs_equal"] == [True, True, True]
    assert probe["grads_equal"] == [True, True, True]
    assert all(a == b for a, b in probe["losses"])
    assert probe["params_equal"]


def test_only_replica_zeros_running_statistics_survive(probe):
    # batch norm normalised each chunk by its own statistics; replica 0 shares the module's
    # buffers, so the module's running statistics are chunk 0's updates
    assert probe["buffers_equal"] and probe["running_mean_moved"]


def test_each_replica_is_charged_to_its_own_device(probe):
    assert probe["replica_memory_charged"] == [True, True, True]


def test_keyword_inputs_another_output_device_and_eval_mode(probe):
    assert probe["kwargs_output_shape"] == [7, 2]
    assert probe["eval_equal"]
