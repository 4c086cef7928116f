"""One size grammar for the coordinator/launcher and the shim (tests/vectors/size_vectors.json).

fakegpu/env.py's parse_size and native/src/core/env.cc's env::bytes (through its test hook
fakegpu_test_parse_bytes) must turn every text there into the same byte count or both refuse it.
They once disagreed: "16MB" was 16,000,000 bytes in Python and 16 MiB in the shim, and the shim
refused 1.5G, 0.5M and 1T.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fakegpu.env import ConfigError, parse_size
from helpers.paths import VECTORS

VECTORS = json.loads((VECTORS / "size_vectors.json").read_text())["vectors"]
IDS = [repr(v["text"]) for v in VECTORS]


@pytest.fixture(scope="module")
def shim_parse():
    import fakegpu
    cffi = pytest.importorskip("cffi")
    try:
        path = Path(fakegpu.nccl_library_path())
    except Exception as exc:
        pytest.skip(f"fakegpu's libnccl.so.2 is not built: {exc}")
    ffi = cffi.FFI()
    ffi.cdef("int fakegpu_test_parse_bytes(const char* text, uint64_t* out);")
    lib = ffi.dlopen(str(path))

    def parse(text: str):
        out = ffi.new("uint64_t*")
        return int(out[0]) if lib.fakegpu_test_parse_bytes(text.encode("utf-8"), out) else None
    return parse


@pytest.mark.parametrize("vector", VECTORS, ids=IDS)
def test_python_parse_size(vector):
    if vector.get("error"):
        with pytest.raises(ConfigError, match="FAKEGPU_X="):
            parse_size(vector["text"], "FAKEGPU_X")
    else:
        assert parse_size(vector["text"], "FAKEGPU_X") == vector["bytes"]


@pytest.mark.parametrize("vector", VECTORS, ids=IDS)
def test_shim_reads_sizes_the_same_way(shim_parse, vector):
    assert shim_parse(vector["text"]) == (None if vector.get("error") else vector["bytes"])
