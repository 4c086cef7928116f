"""fakegpu.torch in one process: registration, autoload hooks, dtype/op translation and the
errors users see.  The multi-rank behaviour is in tests/e2e/test_torch_verification.py."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from helpers.paths import REPO_ROOT as REPO

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed"),
]



def test_import_registers_backend_for_cpu():
    import torch.distributed as dist

    import fakegpu.torch as ft

    assert ft.is_registered()
    assert dist.Backend.FAKEGPU == "fakegpu"
    assert dist.Backend.backend_capability["fakegpu"] == ["cpu"]
    ft.register()  # idempotent: a second registration must not raise


def _fresh_python(code: str, pythonpath: list[str], extra_env=None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(extra_env or {})
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120, cwd="/")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_sitecustomize_chains_a_shadowed_sitecustomize(tmp_path):
    from fakegpu.torch.autoload import pythonpath_entry

    (tmp_path / "sitecustomize.py").write_text("import builtins; builtins.USER_SITE_RAN = True\n")
    out = _fresh_python("import builtins; print(getattr(builtins, 'USER_SITE_RAN', False))",
                        [pythonpath_entry(), str(tmp_path), str(REPO)])
    assert out == "True"


def test_sitecustomize_registers_after_torch_import_without_importing_torch_early():
    from fakegpu.torch.autoload import pythonpath_entry

    out = _fresh_python(
        "import sys; early = 'torch' in sys.modules\n"
        "import torch.distributed as dist\n"
        "print(early, hasattr(dist.Backend, 'FAKEGPU'))",
        [pythonpath_entry(), str(REPO)])
    assert out == "False True"


def test_autoload_can_be_disabled():
    from fakegpu.torch.autoload import pythonpath_entry

    code = "import torch.distributed as dist; print(hasattr(dist.Backend, 'FAKEGPU'))"
    assert _fresh_python(code, [pythonpath_entry(), str(REPO)],
                         {"FAKEGPU_TORCH_AUTOLOAD": "0"}) == "False"
    assert pythonpath_entry().endswith(os.path.join("fakegpu", "torch", "autoload"))


def test_entry_point_function_registers():
    out = _fresh_python("from fakegpu.torch.autoload import entry_point; entry_point()\n"
                        "import torch.distributed as dist; print(dist.Backend.FAKEGPU)", [str(REPO)])
    assert out == "fakegpu"


def test_pyproject_declares_torch_backends_entry_point():
    text = (REPO / "pyproject.toml").read_text()
    assert '[project.entry-points."torch.backends"]' in text
    assert 'fakegpu = "fakegpu._torch_entry:entry_point"' in text


def test_entry_point_respects_disable_switch():
    """The installed entry point must not import fakegpu.torch (which registers) when disabled."""
    code = ("import os; os.environ['FAKEGPU_TORCH_AUTOLOAD'] = '0'\n"
            "from fakegpu._torch_entry import entry_point; entry_point()\n"
            "import sys; print('fakegpu.torch' in sys.modules)")
    assert _fresh_python(code, [str(REPO)]) == "False"


@pytest.mark.parametrize("dtype_name, nccl, count_scale", [
    ("float32", "float32", 1), ("float64", "float64", 1), ("bfloat16", "bfloat16", 1),
    ("float16", "float16", 1), ("int8", "int8", 1), ("uint8", "uint8", 1), ("int32", "int32", 1),
    ("int64", "int64", 1), ("bool", "uint8", 1), ("float8_e4m3fn", "float8e4m3", 1),
    ("float8_e5m2", "float8e5m2", 1), ("complex64", "float32", 2),
])
def test_buffer_types(dtype_name, nccl, count_scale):
    import torch

    from fakegpu.nccl import DataType
    from fakegpu.torch._types import buffer_of

    t = torch.zeros(6, dtype=getattr(torch, dtype_name))
    buf = buffer_of(t, reducing=True)
    assert buf.dtype == DataType[nccl]
    assert buf.count == 6 * count_scale


def test_unreducible_dtype_moves_as_bytes_but_cannot_be_reduced():
    import torch

    from fakegpu.nccl import DataType
    from fakegpu.torch._types import buffer_of

    t = torch.zeros(5, dtype=torch.uint16)
    assert buffer_of(t, reducing=False) == type(buffer_of(t, reducing=False))(DataType.uint8, 10)
    with pytest.raises(TypeError, match="uint16"):
        buffer_of(t, reducing=True)


def test_reduce_op_translation():
    import torch
    import torch.distributed as dist

    from fakegpu.nccl import RedOp
    from fakegpu.torch._types import reduction_of

    R = dist.ReduceOp
    assert reduction_of(R.SUM, torch.float32).op == RedOp.sum
    assert reduction_of(R.AVG, torch.float32).op == RedOp.avg
    assert reduction_of(R.PRODUCT, torch.float32).op == RedOp.prod
    assert reduction_of(R.MIN, torch.int32).op == RedOp.min
    assert reduction_of(R.MAX, torch.int32).op == RedOp.max
    premul = reduction_of(dist._make_nccl_premul_sum(0.125), torch.float32)
    assert premul.op == RedOp.sum and premul.premul_factor == 0.125
    tensor_factor = reduction_of(dist._make_nccl_premul_sum(torch.tensor(0.5)), torch.float32)
    assert tensor_factor.premul_factor == 0.5
    # bool: any / all, as ProcessGroupNCCL does it
    assert reduction_of(R.SUM, torch.bool).op == RedOp.max
    assert reduction_of(R.BAND, torch.bool).op == RedOp.min
    with pytest.raises(ValueError, match="BXOR"):
        reduction_of(R.BXOR, torch.int32)
    with pytest.raises(ValueError, match="complex"):
        reduction_of(R.MAX, torch.complex64)


def test_process_group_rejects_gpu_style_misuse_with_clear_errors():
    import torch

    from fakegpu.torch import FakeGpuProcessGroup

    class NoStore:
        def set(self, *a):  # pragma: no cover - must not be reached
            raise AssertionError("no communicator should be created")

    pg = FakeGpuProcessGroup(NoStore(), 0, 2)
    with pytest.raises(ValueError, match="peer 0 is not another rank"):
        pg.send([torch.zeros(2)], 0)
    with pytest.raises(ValueError, match="peer 5"):
        pg.recv([torch.zeros(2)], 5)
    with pytest.raises(ValueError, match="expected one tensor, got 2"):
        pg.recv_anysource([torch.zeros(2), torch.zeros(2)])
    with pytest.raises(ValueError, match="recv from any source: this 1-rank group has no other rank"):
        FakeGpuProcessGroup(NoStore(), 0, 1).recv_anysource([torch.zeros(2)])
    assert pg.getBackendName() == "fakegpu"
    pg.setGroupName("7")  # no description yet: stays unconnected
    assert pg.comm_name == "group_7"
    assert "not connected" in repr(pg)


def _write_result(folder, rank, value, losses=(1.0,)):
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"params": {"w": torch.full((3,), value)}, "losses": list(losses)}, folder / f"rank{rank}.pt")


def test_runner_comparison_exact_tolerant_and_failing(tmp_path):
    sys.path.insert(0, str(REPO / "verification"))
    import run_case

    exact = run_case.Case("x.py", nproc=2)
    tolerant = run_case.Case("x.py", nproc=2, tolerance=(1e-5, 1e-7))
    gloo, fake = tmp_path / "gloo", tmp_path / "fake"
    for r in range(2):
        _write_result(gloo, r, 1.0)
        _write_result(fake, r, 1.0)
    assert run_case.compare(exact, gloo, fake) == "bit-exact"
    _write_result(fake, 1, 1.0 + 1e-7)
    with pytest.raises(run_case.CaseFailure, match="rank1 w: not bit-identical"):
        run_case.compare(exact, gloo, fake)
    assert "within rtol" in run_case.compare(tolerant, gloo, fake)
    _write_result(fake, 1, 1.5)
    with pytest.raises(run_case.CaseFailure, match="beyond rtol"):
        run_case.compare(tolerant, gloo, fake)
    (fake / "rank1.pt").unlink()
    with pytest.raises(run_case.CaseFailure, match="left no rank1.pt"):
        run_case.compare(tolerant, gloo, fake)


def test_get_backend_answers_capabilities_for_cpu_only():
    import torch

    from fakegpu.torch import FakeGpuProcessGroup

    pg = FakeGpuProcessGroup(None, 1, 4)
    view = pg._get_backend(torch.device("cpu"))
    assert view.supports_coalescing is False and view.supports_splitting is False
    assert view.supports_tensor_alloc(torch.device("cpu")) is False
    assert view.name() == "fakegpu"
    assert view.size() == 4 and view.rank() == 1  # everything else is the group's
    assert pg._get_backend("cpu").name() == "fakegpu"
    with pytest.raises(RuntimeError, match="device type cuda"):
        pg._get_backend(torch.device("cuda", 0))
