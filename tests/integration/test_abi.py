"""fakegpu's native/include/nccl.h is ABI-identical to NVIDIA's NCCL 2.30.7 nccl.h.

tests/integration/abi/abi_dump.c prints every enum value, type size/alignment, struct field offset,
macro value and initializer field; it is built against both headers (as C and as C++)
and the outputs must be identical. NVIDIA's header comes from the nvidia-nccl-cu13
wheel; it includes CUDA headers, taken from the CUDA toolkit when one is installed and
otherwise from tests/integration/abi/cuda_stub (which declares the one CUDA type nccl.h uses).
"""
from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("fakegpu_abi_ncclh", Path(__file__).parent / "abi" / "ncclh.py")
ncclh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncclh)

REAL_INCLUDE = ncclh.real_nccl_include()
CUDA_INCLUDE = ncclh.cuda_toolkit_include()
OUR_HEADER = ncclh.OUR_INCLUDE / "nccl.h"

needs_real_header = pytest.mark.skipif(
    REAL_INCLUDE is None,
    reason="NVIDIA's nccl.h not found: `pip install nvidia-nccl-cu13==2.30.7` "
           "or set FAKEGPU_REAL_NCCL_INCLUDE to its include directory")


def _needs_compiler(language: str) -> None:
    if ncclh.compiler(language) is None:
        pytest.skip(f"no {language} compiler on PATH")


def _cuda_dirs(flavour: str) -> list[Path]:
    if flavour == "toolkit":
        if CUDA_INCLUDE is None:
            pytest.skip("no CUDA toolkit headers (cuda_runtime.h) found; the cuda-stub variant still runs")
        return [CUDA_INCLUDE]
    return [ncclh.CUDA_STUB_INCLUDE]


def _dump(language: str, include_dirs: list[Path], out_dir: Path, tag: str) -> str:
    binary = out_dir / f"abi_dump_{tag}"
    ncclh.compile_program(language, ncclh.DUMP_SOURCE, binary, include_dirs)
    return ncclh.run_program(binary)


@needs_real_header
@pytest.mark.parametrize("cuda", ["toolkit", "stub"])
@pytest.mark.parametrize("language", ["c", "c++"])
def test_layout_enums_and_macros_match_nvidia(language, cuda, tmp_path):
    _needs_compiler(language)
    theirs = _dump(language, [REAL_INCLUDE, *_cuda_dirs(cuda)], tmp_path, "nvidia")
    ours = _dump(language, [ncclh.OUR_INCLUDE], tmp_path, "fakegpu")
    assert len(theirs.splitlines()) > 100, "the dump program printed too little:\n" + theirs
    if ours != theirs:
        diff = "".join(difflib.unified_diff(theirs.splitlines(True), ours.splitlines(True),
                                            "nvidia nccl.h", "fakegpu nccl.h"))
        pytest.fail("ABI facts differ:\n" + diff)


def test_dump_reports_the_documented_abi(tmp_path):
    """Spot-check our header's facts directly, so the test means something without NVIDIA's header."""
    _needs_compiler("c")
    facts = dict(line.rsplit(" ", 1) for line in _dump("c", [ncclh.OUR_INCLUDE], tmp_path, "ours").splitlines()
                 if not line.startswith("offsetof"))
    assert facts["NCCL_VERSION_CODE"] == "23007"
    assert facts["NCCL_VERSION(2, 30, 7)"] == "23007"
    assert facts["NCCL_VERSION(2, 8, 4)"] == "2804"
    assert facts["sizeof(ncclUniqueId)"] == "128"
    assert facts["NCCL_SPLIT_NOCOLOR"] == "-1"
    assert facts["sizeof(ncclRedOp_t)"] == "4"
    assert facts["ncclFloat8e5m2"] == "11"
    assert facts["ncclTimeout"] == "8"
    assert facts["ncclScalarHostImmediate"] == "1"
    assert facts["config.magic"] == str(0xCAFEBEEF)
    assert facts["config.blocking"] == str(-(2**31))
    assert facts["sim.magic"] == str(0x74685283)


@pytest.mark.parametrize("language,std", [("c", "c99"), ("c", "c11"), ("c++", "c++11"), ("c++", "c++17")])
def test_our_header_needs_no_cuda(language, std, tmp_path):
    """Strict, warning-free use of every type and initializer with only the system headers."""
    _needs_compiler(language)
    source = tmp_path / "use_header.c"
    source.write_text(
        "#include <nccl.h>\n"
        "int main(void) {\n"
        "  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;\n"
        "  ncclSimInfo_t sim = NCCL_SIM_INFO_INITIALIZER;\n"
        "  ncclUniqueId id; cudaStream_t stream = 0; ncclComm_t comm = NCCL_COMM_NULL;\n"
        "  ncclWaitSignalDesc_t desc = {1, 0, 0, 0};\n"
        "  (void)id; (void)stream; (void)comm; (void)desc;\n"
        "  return (int)(config.size + sim.size) - (int)(sizeof config + sizeof sim);\n"
        "}\n")
    flags = ["-pedantic", "-Werror", f"-std={std}"]
    ncclh.compile_program(language, source, tmp_path / "use_header", [ncclh.OUR_INCLUDE], flags)
    assert ncclh.run_program(tmp_path / "use_header") == ""


@pytest.mark.parametrize("cuda_first", [True, False])
@pytest.mark.parametrize("language", ["c", "c++"])
def test_our_header_coexists_with_cuda_runtime(language, cuda_first, tmp_path):
    """Including cuda_runtime.h before or after our nccl.h must not redefine cudaStream_t."""
    _needs_compiler(language)
    cuda_dir = CUDA_INCLUDE or ncclh.CUDA_STUB_INCLUDE
    includes = ["#include <cuda_runtime.h>", "#include <nccl.h>"]
    if not cuda_first:
        includes.reverse()
    source = tmp_path / "with_cuda.c"
    source.write_text("\n".join(includes) + "\nint main(void) { cudaStream_t s = 0; (void)s;"
                      " return 0; }\n")
    ncclh.compile_program(language, source, tmp_path / "with_cuda.o", [ncclh.OUR_INCLUDE, cuda_dir],
                          ["-c", "-Werror"])


@needs_real_header
def test_function_signatures_match_nvidia(tmp_path):
    """Redeclare every function of our header after NVIDIA's: C rejects any conflicting type."""
    _needs_compiler("c")
    ours = ncclh.function_declarations(OUR_HEADER.read_text())
    source = tmp_path / "signatures.c"
    source.write_text("#define NCCL_OS_LINUX 1\n#include <nccl.h>\n"
                      + "".join(f"{decl};\n" for decl in ours.values())
                      + "int main(void) { return 0; }\n")
    cuda_dir = CUDA_INCLUDE or ncclh.CUDA_STUB_INCLUDE
    ncclh.compile_program("c", source, tmp_path / "signatures", [REAL_INCLUDE, cuda_dir],
                          ["-Werror", "-Wno-deprecated-declarations", "-Wno-strict-prototypes"])


@needs_real_header
def test_declares_the_same_functions_as_nvidia():
    theirs = set(ncclh.function_declarations((REAL_INCLUDE / "nccl.h").read_text()))
    ours = set(ncclh.function_declarations(OUR_HEADER.read_text()))
    assert len(theirs) >= 120, f"parsed too few declarations from NVIDIA's header: {sorted(theirs)}"
    assert sorted(theirs - ours) == [], "declared by NVIDIA's nccl.h but not ours"
    assert sorted(ours - theirs) == [], "declared by ours but not NVIDIA's nccl.h"


def test_declares_every_public_function_and_its_pnccl_twin():
    ours = set(ncclh.function_declarations(OUR_HEADER.read_text()))
    wanted = set(ncclh.header_api_functions())
    wanted |= {"p" + name for name in wanted}
    assert sorted(wanted - ours) == []
    unpaired = sorted(n for n in ours if n.startswith("nccl") and "p" + n not in ours)
    assert unpaired == [], "functions without a pnccl twin"


@needs_real_header
def test_declares_every_enum_constant_and_macro_of_nvidia():
    real_text = (REAL_INCLUDE / "nccl.h").read_text()
    our_text = OUR_HEADER.read_text()
    their_enums, our_enums = ncclh.enum_constants(real_text), ncclh.enum_constants(our_text)
    assert their_enums == our_enums, "enum typedefs or their enumerators differ (names or order)"
    # NVIDIA's header turns ncclResetDebugInit into a no-op macro off NCCL_OS_LINUX; ours declares
    # the function instead (see the note at the top of native/include/nccl.h), so those two names are not macros here.
    their_macros = ncclh.object_macros(real_text) - {"ncclResetDebugInit", "pncclResetDebugInit"}
    missing = sorted(their_macros - ncclh.object_macros(our_text))
    assert missing == [], "macros NVIDIA's nccl.h defines and ours does not"
