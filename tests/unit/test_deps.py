"""fakegpu._deps: the packages fakegpu imports where it uses them, and the one line said when
one is missing (issue 32: `./fgpu` from a checkout on a Python without them)."""
from __future__ import annotations

import re
import sys
import sysconfig
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from fakegpu import _deps
from fakegpu.common import dtypes
from helpers.paths import REPO_ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None


def _names(requirements) -> set[str]:
    """The distribution names of requirement strings, normalized (PEP 503)."""
    return {re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", r.strip()).group(0)).lower()
            for r in requirements}


def _requirements_txt() -> list[str]:
    lines = (REPO_ROOT / "requirements.txt").read_text().splitlines()
    return [line for line in (raw.split("#")[0].strip() for raw in lines) if line]


@pytest.mark.skipif(tomllib is None, reason="tomllib needs Python 3.11")
def test_requirements_txt_lists_the_same_packages_as_pyproject():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert _names(_requirements_txt()) == _names(project["dependencies"])
    # and _deps knows every one of them by its import name; torch is the optional extra
    required = {pip for module, pip in _deps.PACKAGES.items() if module not in _deps.OPTIONAL}
    assert _names(required) == _names(project["dependencies"])
    assert set(_deps.OPTIONAL) <= set(project["optional-dependencies"])


def test_float8_saturation_is_ml_dtypes_largest_finite_value():
    assert dtypes._SATURATE == {10: float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max),
                                11: float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max)}


@pytest.fixture
def checkout(monkeypatch):
    """As when fakegpu runs from this checkout (the tests may import an installed copy)."""
    monkeypatch.setattr(_deps, "_checkout_requirements", lambda: REPO_ROOT / "requirements.txt")


def test_message_is_one_line_naming_packages_interpreter_and_command(monkeypatch, checkout):
    monkeypatch.setattr(_deps, "_pip_refuses", lambda python: False)
    line = _deps.message("the coordinator", ["numpy", "yaml"], python="/opt/py/bin/python3")
    assert "\n" not in line
    assert line == ("the coordinator needs the Python packages 'numpy', 'pyyaml', which are not installed "
                    f"for /opt/py/bin/python3: /opt/py/bin/python3 -m pip install -r {REPO_ROOT / 'requirements.txt'}")
    one = _deps.message("reading X", ["cffi"], python="py")
    assert one.startswith("reading X needs the Python package 'cffi', which is not installed for py: ")


def test_optional_package_is_installed_by_name():
    assert _deps.install_command(["torch"], python="py") == "py -m pip install torch"


def test_installed_fakegpu_names_the_packages(monkeypatch):
    monkeypatch.setattr(_deps, "_checkout_requirements", lambda: None)
    assert _deps.install_command(["numpy", "cffi"], python="py") == "py -m pip install numpy cffi"


def test_system_python_whose_packages_the_os_manages_gets_a_venv(monkeypatch, tmp_path, checkout):
    (tmp_path / "EXTERNALLY-MANAGED").write_text("[externally-managed]\n")
    monkeypatch.setattr(sys, "prefix", sys.base_prefix)
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *a, **k: str(tmp_path))
    venv = REPO_ROOT / ".venv"
    assert _deps.install_command(["numpy"]) == (
        f"{sys.executable} -m venv {venv} && {venv}/bin/pip install -r {REPO_ROOT / 'requirements.txt'}, "
        f"then run with FAKEGPU_PYTHON={venv}/bin/python")
    # not this interpreter: nothing is known about its pip
    assert _deps.install_command(["numpy"], python="other").startswith("other -m pip install -r ")


def test_require_imports_or_says_what_needed_it(monkeypatch):
    assert _deps.require("numpy", "x") is np
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)   # the import is blocked: as if not installed
    with pytest.raises(_deps.MissingPackage) as caught:
        _deps.require("ml_dtypes", "NCCL's bfloat16 datatype")
    assert isinstance(caught.value, ImportError)
    assert str(caught.value).startswith("NCCL's bfloat16 datatype needs the Python package 'ml_dtypes', ")


def test_require_lets_a_broken_package_raise_as_it_would(monkeypatch, tmp_path):
    (tmp_path / "fgpu_broken_pkg.py").write_text("import fgpu_no_such_module_inside\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as caught:
        _deps.require("fgpu_broken_pkg", "x")
    assert not isinstance(caught.value, _deps.MissingPackage)
    assert caught.value.name == "fgpu_no_such_module_inside"


def test_check_names_every_missing_package_in_one_line_without_importing(monkeypatch):
    _deps.check(["numpy", "cffi"], "the coordinator")   # present: nothing
    monkeypatch.setitem(sys.modules, "yaml", None)
    monkeypatch.delitem(sys.modules, "fgpu_not_installed", raising=False)
    assert _deps.missing(["numpy", "yaml", "fgpu_not_installed"]) == ["yaml", "fgpu_not_installed"]
    with pytest.raises(_deps.MissingPackage) as caught:
        _deps.check(["numpy", "yaml", "jsonschema"], "reading a cluster YAML")
    text = str(caught.value)
    assert "\n" not in text and "'pyyaml'" in text and "'numpy'" not in text
    assert text.startswith("reading a cluster YAML needs the Python package 'pyyaml', which is not installed")


def test_dtypes_need_ml_dtypes_only_to_convert_values(monkeypatch):
    bf16 = dtypes.DTYPE_BY_NAME["bfloat16"]
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)
    dtypes._ml_dtype.cache_clear()
    try:
        assert bf16.storage == np.dtype(np.uint16) and bf16.size == 2 and bf16.narrow
        assert dtypes.DTYPE_BY_NAME["float32"].np == np.dtype(np.float32)
        with pytest.raises(_deps.MissingPackage, match="'ml_dtypes'"):
            bf16.np
        from fakegpu.fake import semantics

        assert semantics.dtype_of(np.zeros(2, np.float16)).name == "float16"
        assert semantics.dtype_of(np.zeros(2, np.uint16)) is None   # no NCCL type, not bfloat16
    finally:
        monkeypatch.undo()
        dtypes._ml_dtype.cache_clear()
    assert bf16.np == np.dtype(ml_dtypes.bfloat16)


def test_dtype_of_ml_dtypes_arrays():
    from fakegpu.fake import semantics

    for name, ml in (("bfloat16", ml_dtypes.bfloat16), ("float8e4m3", ml_dtypes.float8_e4m3fn),
                     ("float8e5m2", ml_dtypes.float8_e5m2)):
        assert semantics.dtype_of(np.zeros(3, ml)) is dtypes.DTYPE_BY_NAME[name]


def test_python_m_fakegpu_turns_a_missing_package_into_one_line(monkeypatch, tmp_path, capsys):
    from fakegpu import __main__ as entry

    (tmp_path / "fgpu_needs_yaml.py").write_text("import yaml\n\ndef main(argv):\n    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "yaml", None)
    monkeypatch.setitem(entry.SUBCOMMANDS, "needsyaml", ("fgpu_needs_yaml", "test"))
    assert entry.main(["needsyaml"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("fakegpu needsyaml: error: fakegpu needsyaml needs the Python package 'pyyaml'")


def test_requirements_file_is_found_only_in_a_checkout(tmp_path, monkeypatch):
    if Path(_deps.__file__).resolve().parent.parent == REPO_ROOT:
        assert _deps._checkout_requirements() == REPO_ROOT / "requirements.txt"
    # an installed fakegpu (site-packages/fakegpu/_deps.py): no requirements.txt beside it
    installed = tmp_path / "site-packages" / "fakegpu"
    installed.mkdir(parents=True)
    monkeypatch.setattr(_deps, "__file__", str(installed / "_deps.py"))
    assert _deps._checkout_requirements() is None
