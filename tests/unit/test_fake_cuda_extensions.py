"""fakegpu/fake_cuda/extensions.py: CUDA extensions are refused in one line; C++ ones pass."""
from __future__ import annotations

import sys
import types

import pytest

torch = pytest.importorskip("torch")

from fakegpu.fake_cuda import extensions  # noqa: E402
from fakegpu.fake_cuda.memory import UnsupportedOnFakeCuda  # noqa: E402


@pytest.fixture()
def cpp_extension(monkeypatch):
    """A stand-in for torch.utils.cpp_extension that records what reaches the real functions."""
    module = types.ModuleType("fakegpu_test_cpp_extension")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    module.calls = []
    module.load = lambda name, sources, *a, **k: module.calls.append(("load", name, k)) or "built"
    module.load_inline = lambda name, cpp_sources, cuda_sources=None, *a, **k: (
        module.calls.append(("load_inline", name, k)) or "built")
    extensions._patch(module)
    return module


@pytest.mark.parametrize("sources, kwargs", [(["ops.cpp", "kernels.cu"], {}), ("kernel.cuh", {}),
                                             (["ops.cpp"], {"with_cuda": True})])
def test_load_of_cuda_sources_is_refused_before_building(cpp_extension, sources, kwargs):
    with pytest.raises(UnsupportedOnFakeCuda) as err:
        cpp_extension.load("fused_thing", sources, **kwargs)
    assert str(err.value).startswith("fakegpu: the CUDA extension 'fused_thing'") and "\n" not in str(err.value)
    assert cpp_extension.calls == []


def test_cpp_only_extensions_build_as_before(cpp_extension):
    assert cpp_extension.load("cpu_ops", ["ops.cpp"], verbose=True) == "built"
    assert cpp_extension.load("cpu_ops", ["ops.cpp", "kernels.cu"], with_cuda=False) == "built"
    assert cpp_extension.load_inline("cpu_inline", "int f();") == "built"
    assert [c[0] for c in cpp_extension.calls] == ["load", "load", "load_inline"]
    with pytest.raises(UnsupportedOnFakeCuda):
        cpp_extension.load_inline("gpu_inline", "int f();", cuda_sources="__global__ void k() {}")


def test_prebuilt_cuda_extension_import_error_is_described():
    exc = ImportError("libc10_cuda.so: cannot open shared object file: No such file or directory",
                      name="fused_adam_cuda")
    line = extensions.describe_import_error(exc)
    assert line.startswith("fakegpu: the CUDA extension 'fused_adam_cuda' (built against libc10_cuda.so")
    assert extensions.describe_import_error(ImportError("No module named 'yaml'", name="yaml")) is None
    assert extensions.describe_import_error(ValueError("libcudart.so")) is None
