"""fakegpu.nccl, the cffi binding itself: datatype mapping, buffer addresses, errors."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from fakegpu.nccl import DataType, Nccl, NcclError, RedOp, Result, _address, _dtype_code
from helpers.shim import REPO_ROOT


@pytest.mark.parametrize("dtype", list(DataType))
def test_datatype_numpy_round_trip(dtype):
    assert DataType.from_numpy(dtype.numpy_dtype) is dtype
    assert dtype.numpy_dtype.itemsize == dtype.itemsize


def test_datatype_codes_match_nccl():
    assert [d.value for d in DataType] == list(range(12))
    assert DataType.from_numpy(ml_dtypes.bfloat16) is DataType.bfloat16
    assert DataType.from_numpy(ml_dtypes.float8_e4m3fn) is DataType.float8e4m3
    assert DataType.from_numpy(ml_dtypes.float8_e5m2) is DataType.float8e5m2
    assert DataType.from_numpy("float16") is DataType.float16
    assert DataType.from_numpy("bfloat16") is DataType.bfloat16
    assert DataType.from_numpy("float8e5m2") is DataType.float8e5m2
    assert DataType.from_numpy("float8_e4m3fn") is DataType.float8e4m3
    assert [int(op) for op in RedOp] == [0, 1, 2, 3, 4]


def test_datatype_from_torch_dtype():
    torch = pytest.importorskip("torch")
    assert DataType.from_numpy(torch.bfloat16) is DataType.bfloat16
    assert DataType.from_numpy(torch.float32) is DataType.float32
    assert DataType.from_numpy(torch.int64) is DataType.int64
    with pytest.raises(TypeError, match="complex64"):
        DataType.from_numpy(torch.complex64)


def test_unsupported_numpy_dtype_is_named():
    with pytest.raises(TypeError, match="complex128"):
        DataType.from_numpy(np.complex128)
    with pytest.raises(TypeError, match="int16"):
        _dtype_code(np.int16)


def test_raw_codes_pass_through_unchecked():
    # so that invalid values reach the library, which must reject them itself
    assert _dtype_code(99) == 99
    assert _dtype_code(np.dtype(np.float32)) == 7


def test_buffer_addresses():
    array = np.zeros(4, dtype=np.float32)
    assert _address(array) == array.ctypes.data
    assert _address(array[2:]) == array.ctypes.data + 8
    assert _address(12345) == 12345
    assert _address(None) == 0

    class Tensorish:
        def data_ptr(self):
            return 4096

    assert _address(Tensorish()) == 4096
    with pytest.raises(TypeError, match="str"):
        _address("not a buffer")


def test_nccl_error_fields():
    err = NcclError(5, "ncclAllReduce", "count mismatch")
    assert err.result == 5 and err.name == "ncclInvalidUsage"
    assert "ncclAllReduce" in str(err) and "count mismatch" in str(err)
    assert Result(8).nccl_name == "ncclTimeout"
    assert NcclError(42, "x").name == "ncclResult(42)"


def test_library_basics(shim_library):
    nccl = Nccl(shim_library)
    assert nccl.version() == 23007
    uid = nccl.get_unique_id()
    assert isinstance(uid, bytes) and len(uid) == 128
    assert nccl.get_unique_id() != uid
    assert nccl.error_string(int(Result.invalid_usage))
    with pytest.raises(ValueError, match="128"):
        nccl.comm_init_rank(2, b"short", 0)


def _run_python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=60, cwd=str(REPO_ROOT))


def test_missing_coordinator_is_a_clear_error(shim_library, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FAKEGPU_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["FAKEGPU_NCCL_LIBRARY"] = shim_library
    code = """
        from fakegpu.nccl import Nccl, NcclError
        nccl = Nccl()
        try:
            nccl.comm_init_rank(1, nccl.get_unique_id(), 0)
        except NcclError as exc:
            print("ERROR", exc.name, exc)
        else:
            print("NO ERROR")
    """
    done = _run_python(code, env)
    assert "ERROR" in done.stdout and "NO ERROR" not in done.stdout, done.stdout + done.stderr
    assert "FAKEGPU_COORDINATOR_ADDR" in done.stdout, done.stdout

    env["FAKEGPU_COORDINATOR_TRANSPORT"] = "unix"
    env["FAKEGPU_COORDINATOR_ADDR"] = str(tmp_path / "nobody-listens.sock")
    done = _run_python(code, env)
    assert "ERROR" in done.stdout and "nobody-listens.sock" in done.stdout, (
        done.stdout + done.stderr)


def test_group_context_balances_on_exception(shim_library):
    nccl = Nccl(shim_library)
    with pytest.raises(RuntimeError, match="boom"):
        with nccl.group():
            raise RuntimeError("boom")
    # the depth is back to zero: a lone GroupEnd is now an error, not a silent no-op
    with pytest.raises(NcclError):
        nccl.group_end()
