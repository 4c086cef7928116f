"""GPU-only attention kernels on fake CUDA devices, against the CPU computation.

The probe (tests/e2e/fake_cuda/probe_kernels.py) runs in a fresh interpreter set up as fgpu sets
up a rank, so the patches never touch this pytest process.
"""
import pytest
from helpers.fake_cuda_probe import NEEDS_TORCH, probe_process, run_probe

pytestmark = NEEDS_TORCH


@pytest.fixture(scope="module")
def probe() -> dict:
    return run_probe("probe_kernels.py", 2)


def test_varlen_attention_equals_math_per_sequence_bit_for_bit(probe):
    # output and the gradients of q, k, v (GQA: k and v have half the heads)
    assert probe["varlen_causal_gqa"] == [0.0, 0.0, 0.0, 0.0]


def test_flash_forward_sliding_window_and_logsumexp(probe):
    out_diff, lse_diff = probe["dense_window"]
    assert out_diff == 0.0
    assert lse_diff < 1e-5
    assert probe["dense_window_lse_shape"] == [2, 4, 12]   # (batch, heads, query length)


def test_cudnn_sdpa_called_directly_equals_math(probe):
    # the output bit for bit; the gradients, taken from the output and log-sum-exp as the
    # fused kernel takes them, within float rounding of the math kernel's autograd
    out_diff, *grads = probe["cudnn_sdpa"]
    assert out_diff == 0.0 and max(grads) < 1e-5


def test_flash_blocks_merged_as_ring_attention_merges_them_are_the_whole_attention(probe):
    # output, log-sum-exp, and the q, k, v gradients of the backward run per block
    assert max(probe["flash_blocks_merged"]) < 1e-5


def test_sdpa_efficient_kernel_returns_its_log_sum_exp(probe):
    lse_diff, shape, padding_is_inf = probe["sdpa_efficient_lse"]
    assert lse_diff < 1e-5 and shape == [1, 2, 32] and padding_is_inf


def test_cudnn_attention_forward_dense_and_packed_equals_math(probe):
    out_diff, *grads = probe["cudnn_attention_dense"]
    assert out_diff == 0.0 and max(grads) < 1e-5
    assert probe["cudnn_attention_packed"] == [0.0, 0.0, 0.0, 0.0]
    assert probe["cudnn_attention_packed_lse_shape"] == [4, 24]   # (heads, total_q), flash's


def test_efficient_attention_called_directly_equals_math(probe):
    # output, log-sum-exp rows, and the gradients of q, k, v and the bias
    out_diff, lse_diff, *grads = probe["efficient_bias_causal"]
    assert out_diff == 0.0 and grads == [0.0, 0.0, 0.0, 0.0]
    assert lse_diff < 1e-5
    # (batch, heads, query length padded to 32), +inf past the end; the max lengths
    assert probe["efficient_lse"] == [[2, 3, 32], True, 10, 10]
    varlen_diff, lse_shape = probe["efficient_varlen_bottom_right"]
    assert varlen_diff == 0.0
    assert lse_shape == [2, 2, 32]   # one row set per sequence


def test_efficient_attention_window_is_refused_in_one_line(probe):
    message = probe["efficient_window_refusal"]
    assert message and message.startswith("fakegpu: aten::_efficient_attention_forward with window_size=4")
    assert "\n" not in message


def test_sdpa_kernel_contexts_run_within_rounding_of_math(probe):
    assert probe["sdpa_EFFICIENT_ATTENTION"] == 0.0    # math fallback
    assert probe["sdpa_CUDNN_ATTENTION"] == 0.0
    assert probe["sdpa_FLASH_ATTENTION"] < 1e-5        # torch's CPU flash kernel


def test_flash_dropout_is_refused_in_one_line(probe):
    message = probe["dropout_refusal"]
    assert message and message.startswith("fakegpu: aten::_flash_attention_forward with dropout_p=0.1")
    assert "\n" not in message


def test_integer_devices_are_fake_cuda_devices(probe):
    # Module.to(1) and device=1 mean cuda:1; the tensors are CPU tensors charged to device 1.
    assert probe["int_devices"] == ["cpu", "cpu", True]


def test_without_memory_tracking_an_op_without_cpu_kernel_still_fails_in_one_line():
    # FAKEGPU_FAKE_CUDA_MEMORY=0 leaves out the per-op tracking mode; the message is the same.
    done = probe_process("probe_unsupported_op.py", 1, FAKEGPU_FAKE_CUDA_MEMORY="0")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("fakegpu: fgpu_probe::cuda_only has no CPU implementation")
