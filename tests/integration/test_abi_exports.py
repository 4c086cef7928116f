"""The built libnccl.so.2 can stand in for NVIDIA's: SONAME, exported names, version.

torch's libraries NEED libnccl.so.2 and import 51 names from it; a missing one makes
`import torch` fail under LD_PRELOAD. We also export the whole NCCL 2.30 public API, the
extra device-API names NVIDIA's library exports, and a pnccl twin of every nccl name.

The library is the one fakegpu.nccl_library_path() finds (FAKEGPU_NCCL_LIBRARY, the
installed package, or a build/ directory). These tests skip only when no library exists.
"""
from __future__ import annotations

import ctypes
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import fakegpu

_spec = importlib.util.spec_from_file_location("fakegpu_abi_ncclh", Path(__file__).parent / "abi" / "ncclh.py")
ncclh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncclh)


@pytest.fixture(scope="module")
def library() -> Path:
    try:
        return Path(fakegpu.nccl_library_path())
    except FileNotFoundError as exc:
        pytest.skip(f"fakegpu's libnccl.so.2 is not built: {exc}")


def _readelf(*args: str) -> str:
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    result = subprocess.run(["readelf", "-W", *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def dynamic_symbols(library) -> dict[str, tuple[str, str]]:
    """Defined dynamic symbols: name (with any @version kept) -> (type, binding)."""
    symbols = {}
    for line in _readelf("--dyn-syms", str(library)).splitlines():
        # Num: Value Size Type Bind Vis Ndx Name
        fields = line.split()
        if len(fields) < 8 or not fields[0].rstrip(":").isdigit() or fields[6] == "UND":
            continue
        symbols[fields[7]] = (fields[3], fields[4])
    return symbols


@pytest.fixture(scope="module")
def exported_functions(dynamic_symbols) -> set[str]:
    return {name for name, (kind, bind) in dynamic_symbols.items()
            if kind in ("FUNC", "IFUNC") and bind in ("GLOBAL", "WEAK")}


def test_soname_is_libnccl_so_2(library):
    dynamic = _readelf("-d", str(library))
    sonames = re.findall(r"\(SONAME\)\s+Library soname: \[([^\]]+)\]", dynamic)
    assert sonames == ["libnccl.so.2"]


def _assert_exported(names, exported, what):
    missing = sorted(set(names) - exported)
    assert missing == [], f"{len(missing)} {what} not exported by the shim: {missing}"


def test_exports_every_name_torch_imports(exported_functions):
    _assert_exported(ncclh.read_names(ncclh.TORCH_IMPORTS_FILE), exported_functions,
                     "names torch 2.14 imports")


def test_exports_the_whole_public_api(exported_functions):
    _assert_exported(ncclh.header_api_functions(), exported_functions, "nccl.h functions")


def test_exports_everything_nvidias_library_exports(exported_functions):
    _assert_exported(ncclh.read_names(ncclh.LIBRARY_EXPORTS_FILE), exported_functions,
                     "names NVIDIA's libnccl.so.2 exports")


def test_exports_a_pnccl_twin_for_every_nccl_name(exported_functions):
    wanted = set(ncclh.read_names(ncclh.LIBRARY_EXPORTS_FILE)) | set(ncclh.header_api_functions())
    wanted |= {name for name in exported_functions if name.startswith("nccl")}
    _assert_exported({"p" + name for name in wanted}, exported_functions, "pnccl twins")


def test_exported_symbols_are_unversioned_and_nothing_internal_leaks(dynamic_symbols):
    versioned = sorted(name for name in dynamic_symbols if "@" in name and re.match(r"p?nccl", name))
    assert versioned == [], "NCCL symbols must be unversioned, as NVIDIA's are"
    # Hidden visibility: no C++ internals (mangled names) in the dynamic symbol table.
    mangled = sorted(name for name in dynamic_symbols if name.startswith("_Z"))
    assert mangled == [], "C++ symbols leak from the shim (check -fvisibility=hidden)"


def test_get_version_reports_2_30_7(library):
    lib = ctypes.CDLL(str(library))
    for name in ("ncclGetVersion", "pncclGetVersion"):
        version = ctypes.c_int(0)
        assert getattr(lib, name)(ctypes.byref(version)) == 0
        assert version.value == 23007


@pytest.mark.parametrize("header", ["fakegpu", "nvidia"])
def test_program_built_against_a_header_links_and_runs_with_the_shim(header, library, tmp_path):
    """A C program taking the address of every function its nccl.h declares links against the
    shim with no undefined symbol and runs: the drop-in claim, checked by the real linker."""
    if ncclh.compiler("c") is None:
        pytest.skip("no C compiler on PATH")
    if header == "nvidia":
        include = ncclh.real_nccl_include()
        if include is None:
            pytest.skip("NVIDIA's nccl.h not found: `pip install nvidia-nccl-cu13==2.30.7`")
        include_dirs = [include, ncclh.cuda_toolkit_include() or ncclh.CUDA_STUB_INCLUDE]
    else:
        include = ncclh.OUR_INCLUDE
        include_dirs = [include]
    functions = sorted(ncclh.function_declarations((include / "nccl.h").read_text()))
    source = tmp_path / "link_all.c"
    source.write_text(
        "#define NCCL_OS_LINUX 1\n#include <nccl.h>\n#include <stdio.h>\n"
        "static void (*const everything[])(void) = {\n"
        + "".join(f"  (void (*)(void)){name},\n" for name in functions)
        + "};\n"
        "int main(void) {\n"
        "  int version = 0;\n"
        "  if (ncclGetVersion(&version) != ncclSuccess) return 1;\n"
        "  printf(\"%d %zu %s\\n\", version, sizeof everything / sizeof everything[0],\n"
        "         ncclGetErrorString(ncclInvalidUsage) ? \"ok\" : \"null\");\n"
        "  return 0;\n"
        "}\n")
    ncclh.compile_program("c", source, tmp_path / "link_all", include_dirs,
                          ["-Wno-deprecated-declarations", "-Wno-cast-function-type"],
                          [f"-L{library.parent}", f"-l:{library.name}", f"-Wl,-rpath,{library.parent}"])
    assert ncclh.run_program(tmp_path / "link_all").split() == ["23007", str(len(functions)), "ok"]
