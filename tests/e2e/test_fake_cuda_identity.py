"""Fake CUDA's replacements of torch objects keep every identity-keyed registry of torch working
(fakegpu/fake_cuda/identity.py; docs/fake-cuda.md, "What fake CUDA replaces")."""
from __future__ import annotations

import pytest

from helpers.fake_cuda_probe import NEEDS_TORCH, run_probe

pytestmark = NEEDS_TORCH

REGISTRIES = {"torchscript", "overrides.ignored", "overrides.overridable", "dynamo", "pickle",
              "inspect.signature", "identity"}


@pytest.fixture(scope="module")
def probed() -> dict:
    return run_probe("probe_identity.py", devices=2)


def test_every_replaced_object_is_registered_where_the_original_is(probed):
    replaced = probed["replaced"]
    # The ones the issue was about, at least: a list that shrank to nothing would pass vacuously.
    assert {"torch.tensor", "torch.as_tensor", "torch.nn.functional.scaled_dot_product_attention",
            "torch.Tensor.to", "torch.Generator"} <= set(replaced)
    wrong = {path: {r: v for r, v in verdicts.items() if v != "ok"}
             for path, verdicts in replaced.items()}
    assert all(set(verdicts) == REGISTRIES for verdicts in replaced.values()), replaced
    assert not {path: v for path, v in wrong.items() if v}, wrong


@pytest.mark.parametrize("program", ["scripted_function", "scripted_sdpa_and_to", "scripted_class",
                                     "distributed_optim_import", "compiled_fullgraph", "fx_traced",
                                     "torch_function_identity", "pickled_references"])
def test_program_that_keys_on_torch_objects_runs(probed, program):
    assert probed["programs"][program] == "ok"
