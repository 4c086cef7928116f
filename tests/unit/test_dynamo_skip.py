"""fakegpu/torch/dynamo_skip.py: fakegpu's frames on dynamo's skip list, added when dynamo loads."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from helpers.shim import REPO_ROOT

pytestmark = [pytest.mark.torch,
              pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")]

PROBE = r"""
import json, sys
import torch
import fakegpu.torch
fakegpu.torch.register()
before = "torch._dynamo" in sys.modules   # registering does not import dynamo (a second's cost)
import torch._dynamo.trace_rules as rules
import fakegpu.torch.process_group as pg, fakegpu.shim_helpers as helpers
import fakegpu.fake_cuda.runtime as runtime, fakegpu.fake_cuda._patch as patch
print(json.dumps({"dynamo_imported_by_register": before,
                  "skipped": [rules.check_file(m.__file__).skipped for m in (pg, helpers)],
                  "traced": [rules.check_file(m.__file__).skipped for m in (runtime, patch)],
                  "user_file": rules.check_file("/tmp/train.py").skipped}))
"""


def test_fakegpu_is_skipped_once_dynamo_loads_and_the_device_rewrite_is_traced():
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(REPO_ROOT), "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
                                            "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"dynamo_imported_by_register": False, "skipped": [True, True], "traced": [False, False],
                   "user_file": False}


def test_the_skip_list_names_every_fakegpu_module_but_the_traced_ones():
    from fakegpu.torch.dynamo_skip import USER_CODE_MODULES, fakegpu_modules

    names = fakegpu_modules()
    assert "fakegpu.torch" in names and "fakegpu.fake" in names and "fakegpu.fake_cuda.distributed" in names
    assert not set(USER_CODE_MODULES) & set(names)
    assert "fakegpu.fake_cuda" not in names      # listed module by module instead
