"""fakegpu's Python dependencies, imported where they are used, and the one line said when one
is missing (a checkout run without `pip install .`: docs/usage.md "From a source checkout").

``require(module, what)`` imports a package or raises :class:`MissingPackage`, whose text is that
line; ``python -m fakegpu`` (so `fgpu` and `./fgpu`) prints it and exits 2. ``check(modules,
what)`` finds, without importing them, those of ``modules`` this interpreter lacks, so that fgpu
stops at once, before starting a coordinator that could not run."""
from __future__ import annotations

import importlib
import importlib.util
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Iterable, Optional, Sequence

# import name -> the name pip installs it by. requirements.txt and pyproject.toml's dependencies
# list the same packages (tests/unit/test_deps.py); torch is the optional extra.
PACKAGES = {
    "numpy": "numpy",
    "ml_dtypes": "ml_dtypes",
    "yaml": "pyyaml",
    "jsonschema": "jsonschema",
    "psutil": "psutil",
    "cffi": "cffi",
    "torch": "torch",
}
OPTIONAL = ("torch",)

# What every coordinator needs: buffers are numpy arrays and the shim's reductions are called
# through cffi. A cluster YAML also needs CLUSTER_CONFIG; bfloat16 and float8 need ml_dtypes only
# where values are converted in Python (fakegpu/common/dtypes.py), never in the coordinator.
COORDINATOR = ("numpy", "cffi")
CLUSTER_CONFIG = ("yaml", "jsonschema")


class MissingPackage(ImportError):
    """A Python package fakegpu needs here is not installed; ``str()`` is the one line to print
    (after the program's name)."""


def _checkout_requirements() -> Optional[Path]:
    """requirements.txt of the source tree this fakegpu runs from, or None when installed."""
    path = Path(__file__).resolve().parent.parent / "requirements.txt"
    return path if path.is_file() and (path.parent / "pyproject.toml").is_file() else None


def _pip_refuses(python: str) -> bool:
    """True when ``python -m pip install`` would not install here: this interpreter has no pip, or
    it is a system Python whose packages the OS manages (PEP 668's EXTERNALLY-MANAGED file; pip
    then stops with "externally-managed-environment"). Only for this interpreter."""
    if python != sys.executable:
        return False
    if importlib.util.find_spec("pip") is None:
        return True
    if sys.prefix != sys.base_prefix:  # a venv: pip installs into it
        return False
    stdlib = sysconfig.get_path("stdlib")
    return bool(stdlib) and (Path(stdlib) / "EXTERNALLY-MANAGED").is_file()


def install_command(modules: Sequence[str], python: Optional[str] = None) -> str:
    """The command that installs ``modules`` for ``python`` (default: this interpreter): the
    checkout's requirements.txt when fakegpu runs from one, else the packages by name; a venv in
    the checkout when pip cannot install for ``python`` itself."""
    python = python or sys.executable
    names = [PACKAGES.get(m, m) for m in modules]
    requirements = _checkout_requirements()
    if requirements is None or any(m in OPTIONAL for m in modules):
        return f"{python} -m pip install {' '.join(names)}"
    if _pip_refuses(python):
        venv = requirements.parent / ".venv"
        return (f"{python} -m venv {venv} && {venv}/bin/pip install -r {requirements}, "
                f"then run with FAKEGPU_PYTHON={venv}/bin/python")
    return f"{python} -m pip install -r {requirements}"


def message(what: str, modules: Sequence[str], python: Optional[str] = None) -> str:
    """One line: what needs which packages, for which interpreter, and the command that installs
    them."""
    names = [PACKAGES.get(m, m) for m in modules]
    quoted = ", ".join(f"'{n}'" for n in names)
    several = len(names) > 1
    return (f"{what} needs the Python package{'s' if several else ''} {quoted}, which "
            f"{'are' if several else 'is'} not installed for {python or sys.executable}: "
            f"{install_command(modules, python)}")


def require(module: str, what: str) -> ModuleType:
    """``import module``, or :class:`MissingPackage` naming what needed it and how to install it.
    A package that is there but fails inside its own imports raises as it would."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module.split(".")[0]:
            raise
        raise MissingPackage(message(what, [module])) from None


def missing(modules: Iterable[str]) -> list[str]:
    """Those of ``modules`` this interpreter cannot import (found without importing them)."""
    out = []
    for m in modules:
        if m in sys.modules:   # None there: an import that is blocked
            found = sys.modules[m] is not None
        else:
            try:
                found = importlib.util.find_spec(m) is not None
            except (ImportError, ValueError):
                found = False
        if not found:
            out.append(m)
    return out


def check(modules: Iterable[str], what: str) -> None:
    """:class:`MissingPackage` naming all of ``modules`` this interpreter lacks, in one line."""
    lacking = missing(modules)
    if lacking:
        raise MissingPackage(message(what, lacking))
