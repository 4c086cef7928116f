"""Helpers for the ABI tests: find headers and compilers, parse nccl.h, list NCCL names.

Kept apart from the test files so that tests/integration/test_abi.py and tests/integration/test_abi_exports.py
read as lists of checks.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

ABI_DIR = Path(__file__).resolve().parent
REPO_ROOT = ABI_DIR.parents[2]   # tests/integration/abi
OUR_INCLUDE = REPO_ROOT / "native" / "include"
CUDA_STUB_INCLUDE = ABI_DIR / "cuda_stub"
DUMP_SOURCE = ABI_DIR / "abi_dump.c"

# Name lists taken from NCCL 2.30.7 (pip: nvidia-nccl-cu13==2.30.7, its nccl.h and libnccl.so.2)
# and torch 2.14.1's CUDA build (the NCCL symbols its libraries import).
TORCH_IMPORTS_FILE = ABI_DIR / "torch-2.14-nccl-imports.txt"
HEADER_API_FILE = ABI_DIR / "nccl-2.30-header-api.txt"
LIBRARY_EXPORTS_FILE = ABI_DIR / "nccl-2.30-library-exports.txt"

# Names in the header-API list that are types, not functions.
HEADER_API_TYPES = {"ncclUniqueId"}


def read_names(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def header_api_functions() -> list[str]:
    return [n for n in read_names(HEADER_API_FILE) if n not in HEADER_API_TYPES]


def real_nccl_include() -> Path | None:
    """Include dir of NVIDIA's nccl.h (FAKEGPU_REAL_NCCL_INCLUDE, else the nvidia-nccl wheel)."""
    override = os.environ.get("FAKEGPU_REAL_NCCL_INCLUDE")
    if override:
        path = Path(override)
        return path if (path / "nccl.h").is_file() else None
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(root) / "nccl" / "include"
        if (candidate / "nccl.h").is_file():
            return candidate
    return None


def cuda_toolkit_include() -> Path | None:
    """Include dir of an installed CUDA toolkit (the one beside nvcc), if any."""
    candidates = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(nvcc).resolve().parent.parent / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    for candidate in candidates:
        if (candidate / "cuda_runtime.h").is_file():
            return candidate
    return None


def compiler(language: str) -> str | None:
    """A C ("c") or C++ ("c++") compiler driver: $CC/$CXX, else gcc/cc/clang or g++/c++/clang++."""
    env, names = ("CC", ("gcc", "cc", "clang")) if language == "c" else ("CXX", ("g++", "c++", "clang++"))
    if os.environ.get(env):
        return os.environ[env]
    for name in names:
        if shutil.which(name):
            return name
    return None


def compile_program(language: str, source: Path, output: Path, include_dirs: list[Path],
                    extra_flags: list[str] = (), link_flags: list[str] = ()) -> None:
    """Compile and link one source file; raise AssertionError with the compiler's output."""
    driver = compiler(language)
    assert driver, f"no {language} compiler found"
    lang_flags = ["-x", "c", "-std=c11"] if language == "c" else ["-x", "c++", "-std=c++17"]
    cmd = [driver, *lang_flags, "-Wall", "-Wextra", *extra_flags,
           *[f"-I{d}" for d in include_dirs], str(source), "-o", str(output), *link_flags]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"compile failed: {' '.join(cmd)}\n{result.stdout}{result.stderr}"


def run_program(path: Path) -> str:
    result = subprocess.run([str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{path} exited {result.returncode}: {result.stderr}"
    return result.stdout


# ---- Parsing nccl.h text -----------------------------------------------------------------

_FUNCTION_DECL = re.compile(
    r"^\s*((?:const\s+char\s*\*|ncclResult_t|void)\s*(p?nccl\w+)\s*\([^;{}]*\))\s*$", re.S)
_ENUM_BLOCK = re.compile(r"typedef\s+enum\s*\{(.*?)\}\s*(\w+)\s*;", re.S)
_DEFINE = re.compile(r"^\s*#\s*define\s+(\w+)(\()?", re.M)


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def function_declarations(text: str) -> dict[str, str]:
    """name -> declaration text, for every ncclX/pncclX function declared in a header."""
    body = strip_comments(text)
    # Attribute lines (deprecated(...)) sit before some declarations; drop them.
    body = re.sub(r"__attribute__\s*\(\((?:[^()]|\([^()]*\))*\)\)", " ", body)
    # Every declaration ends with ';'; the pieces between semicolons and braces are candidates.
    decls = {}
    for piece in re.split(r"[;{}]", body):
        piece = re.sub(r"^\s*#[^\n]*\n", "", piece, flags=re.M)  # preprocessor lines before it
        match = _FUNCTION_DECL.match(piece)
        if match:
            decls[match.group(2)] = " ".join(match.group(1).split())
    return decls


def enum_constants(text: str) -> dict[str, list[str]]:
    """enum typedef name -> its enumerator names, in order."""
    out = {}
    for block, name in _ENUM_BLOCK.findall(strip_comments(text)):
        out[name] = re.findall(r"(\w+)\s*=", block)
    return out


def object_macros(text: str) -> set[str]:
    """Names of object-like and function-like macros a header defines (include guard excluded)."""
    return {m.group(1) for m in _DEFINE.finditer(text) if m.group(1) != "NCCL_H_"}
