"""NCCL's datatypes on the Python side: the numpy storage and accumulator types of each code
(names, sizes and kinds come from spec/wire.py through fakegpu/wire_spec.py), shared by the
coordinator, the fake modes and the reports."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np

from fakegpu import wire_spec as P
from fakegpu._deps import require

# The float types numpy lacks come from ml_dtypes, imported on first use: the coordinator reduces
# through the shim (fakegpu/native_numerics.py) and moves bytes, for which `storage` (an unsigned
# integer type of the same size) is enough, so a run needs ml_dtypes only where it converts
# values of those types (PreMulSum scalars in fake mode, the tests' numpy oracle).
_ML_DTYPES = {9: "bfloat16", 10: "float8_e4m3fn", 11: "float8_e5m2"}


@lru_cache(maxsize=None)
def _ml_dtype(name: str) -> np.dtype:
    ml_dtypes = require("ml_dtypes", f"NCCL's {name} datatype (values converted in Python)")
    return np.dtype(getattr(ml_dtypes, name))


@dataclass(frozen=True)
class DType:
    code: int
    name: str
    storage: np.dtype       # numpy type of the same size: the type itself, or uintN for ml_dtypes's types
    size: int
    is_float: bool
    acc: np.dtype           # accumulator type
    saturate: Optional[float] = None  # largest finite value for float8 outputs
    ml_name: Optional[str] = None     # the ml_dtypes type of `np`, when numpy has none

    @property
    def np(self) -> np.dtype:
        """The numpy type of the values (ml_dtypes's for bfloat16 and float8, imported here)."""
        return self.storage if self.ml_name is None else _ml_dtype(self.ml_name)

    @property
    def narrow(self) -> bool:
        """True when the accumulator differs from the storage type."""
        return self.ml_name is not None or self.acc != self.storage


def _dt(code, npt, acc, saturate=None) -> DType:
    """The numpy side of datatype `code`; its name, size and kind come from spec/wire.py."""
    ml_name = _ML_DTYPES.get(code)
    npt = np.dtype(f"u{P.DATATYPE_SIZES[code]}") if ml_name else np.dtype(npt)
    if npt.itemsize != P.DATATYPE_SIZES[code]:
        raise AssertionError(f"datatype {code}: numpy {npt} is not {P.DATATYPE_SIZES[code]} bytes")
    return DType(code, P.DATATYPE_NAMES[code], npt, npt.itemsize, P.DATATYPE_IS_FLOAT[code], np.dtype(acc),
                 saturate, ml_name)


_NUMPY_TYPES = {  # code: (storage type, accumulator type); None: ml_dtypes's (_ML_DTYPES)
    0: (np.int8, np.int8), 1: (np.uint8, np.uint8), 2: (np.int32, np.int32), 3: (np.uint32, np.uint32),
    4: (np.int64, np.int64), 5: (np.uint64, np.uint64), 6: (np.float16, np.float32),
    7: (np.float32, np.float32), 8: (np.float64, np.float64), 9: (None, np.float32),
    10: (None, np.float32), 11: (None, np.float32),
}
# float8 results saturate at the largest finite value (NCCL's conversion with saturation):
# ml_dtypes.finfo(float8_e4m3fn).max and finfo(float8_e5m2).max (tests/unit/test_deps.py checks).
_SATURATE = {10: 448.0, 11: 57344.0}
DTYPES: dict[int, DType] = {code: _dt(code, *_NUMPY_TYPES[code], _SATURATE.get(code)) for code in P.DATATYPE_NAMES}
DTYPE_BY_NAME = {d.name: d for d in DTYPES.values()}
ELEM_SIZE = {code: d.size for code, d in DTYPES.items()}


def decode_scalar(dt: DType, raw: bytes):
    """The PreMulSum scalar (a value of the op's datatype, left-aligned in 8 bytes),
    as a numpy scalar of the accumulator type (floats) or of the type itself (ints)."""
    value = np.frombuffer(bytes(raw[:dt.size]), dtype=dt.np)[0]
    return dt.acc.type(value) if dt.is_float else value
