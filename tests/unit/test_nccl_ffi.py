"""fakegpu.nccl loads its cffi declarations pre-parsed (fakegpu/_nccl_ffi.py): parsing them
took ~0.5 s of every rank's start-up."""
from __future__ import annotations

from fakegpu import nccl


def test_precompiled_ffi_is_current():
    # After changing nccl._CDEF: python -c "from fakegpu import nccl; nccl.write_precompiled_ffi()"
    with open(nccl.write_precompiled_ffi.__globals__["__file__"].replace("nccl.py", "_nccl_ffi.py")) as fh:
        assert fh.read() == nccl.precompiled_ffi_source()


def test_loaded_ffi_is_the_precompiled_one_and_knows_the_declarations():
    ffi = nccl._precompiled_ffi()
    assert ffi is not None
    assert ffi.sizeof("ncclConfig_t") == nccl._parsed_ffi().sizeof("ncclConfig_t")
    assert ffi.sizeof("ncclUniqueId") == nccl.UNIQUE_ID_BYTES


def test_stale_precompiled_ffi_is_ignored(monkeypatch):
    monkeypatch.setattr(nccl, "_CDEF", nccl._CDEF + "\nint ncclNotAFunction(void);\n")
    assert nccl._precompiled_ffi() is None
