"""verification/public_examples/run_examples.py: pytorch/examples scripts, unmodified, on fake
CUDA devices against their hand ports to CPU + gloo.

The scripts are not in this repository.  The slow test runs when FAKEGPU_EXAMPLES_DIR names a
checkout (or download) of pytorch/examples with the pinned files; the others check the
driver's port machinery on files written here.
"""
import importlib.util
import os
import subprocess
import sys

import pytest
from helpers.paths import REPO_ROOT

DRIVER = REPO_ROOT / "verification" / "public_examples" / "run_examples.py"


def _driver():
    spec = importlib.util.spec_from_file_location("run_examples", DRIVER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _program(driver, **overrides):
    fields = dict(name="toy", parallelism="DDP", directory="d", files={"train.py": "0" * 40},
                  script="train.py", args=[], two_rank_groups=True,
                  port={"train.py": [('init_process_group("nccl")', 'init_process_group("gloo")')]})
    fields.update(overrides)
    return driver.Program(**fields)


def test_the_port_applies_each_edit_and_leaves_the_fake_run_untouched(tmp_path):
    driver = _driver()
    source = tmp_path / "src"
    (source / "d").mkdir(parents=True)
    text = 'import torch.distributed as dist\ndist.init_process_group("nccl")\n'
    (source / "d" / "train.py").write_text(text)
    program = _program(driver)
    fake = driver.stage(source, program, tmp_path / "fake", ported=False)
    port = driver.stage(source, program, tmp_path / "port", ported=True)
    assert (fake / "train.py").read_text() == text
    assert (port / "train.py").read_text() == text.replace('"nccl"', '"gloo"')


def test_an_edit_that_no_longer_matches_names_the_program_and_file(tmp_path):
    driver = _driver()
    source = tmp_path / "src"
    (source / "d").mkdir(parents=True)
    (source / "d" / "train.py").write_text("print('changed upstream')\n")
    with pytest.raises(SystemExit) as failure:
        driver.stage(source, _program(driver), tmp_path / "port", ported=True)
    assert "port of toy" in str(failure.value) and "train.py" in str(failure.value)


def test_every_pinned_program_is_run_on_four_ranks_with_a_port():
    driver = _driver()
    names = [p.name for p in driver.PROGRAMS]
    assert len(names) == len(set(names)) == 8
    for program in driver.PROGRAMS:
        assert all(len(commit) == 40 for commit in program.files.values())
        assert program.port, program.name
        assert set(program.port) <= set(program.files)


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.skipif(not os.environ.get("FAKEGPU_EXAMPLES_DIR"),
                    reason="FAKEGPU_EXAMPLES_DIR (pytorch/examples at the pinned commits) not set")
def test_public_examples_match_their_cpu_ports(shim_library):
    env = dict(os.environ, FAKEGPU_NCCL_LIBRARY=shim_library,
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, str(DRIVER), "--source", os.environ["FAKEGPU_EXAMPLES_DIR"],
                           "--only", "ddp/example.py", "tensor_parallel", "fsdp_tp"],
                          env=env, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert done.stdout.count("| yes |") == 3
