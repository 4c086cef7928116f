"""NCCL's datatypes on the Python side: the numpy storage and accumulator types of each code
(names, sizes and kinds come from spec/wire.py through fakegpu/wire_spec.py), shared by the
coordinator, the fake modes and the reports."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import ml_dtypes
import numpy as np

from fakegpu import wire_spec as P


@dataclass(frozen=True)
class DType:
    code: int
    name: str
    np: np.dtype
    size: int
    is_float: bool
    acc: np.dtype           # accumulator type
    saturate: Optional[float] = None  # largest finite value for float8 outputs

    @property
    def narrow(self) -> bool:
        """True when the accumulator differs from the storage type."""
        return self.acc != self.np


def _dt(code, npt, acc, saturate=None) -> DType:
    """The numpy side of datatype `code`; its name, size and kind come from spec/wire.py."""
    npt = np.dtype(npt)
    if npt.itemsize != P.DATATYPE_SIZES[code]:
        raise AssertionError(f"datatype {code}: numpy {npt} is not {P.DATATYPE_SIZES[code]} bytes")
    return DType(code, P.DATATYPE_NAMES[code], npt, npt.itemsize, P.DATATYPE_IS_FLOAT[code], np.dtype(acc), saturate)


_NUMPY_TYPES = {  # code: (storage type, accumulator type)
    0: (np.int8, np.int8), 1: (np.uint8, np.uint8), 2: (np.int32, np.int32), 3: (np.uint32, np.uint32),
    4: (np.int64, np.int64), 5: (np.uint64, np.uint64), 6: (np.float16, np.float32),
    7: (np.float32, np.float32), 8: (np.float64, np.float64), 9: (ml_dtypes.bfloat16, np.float32),
    10: (ml_dtypes.float8_e4m3fn, np.float32), 11: (ml_dtypes.float8_e5m2, np.float32),
}
# float8 results saturate at the largest finite value (NCCL's conversion with saturation).
_SATURATE = {10: float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max),
             11: float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max)}
DTYPES: dict[int, DType] = {code: _dt(code, *_NUMPY_TYPES[code], _SATURATE.get(code)) for code in P.DATATYPE_NAMES}
DTYPE_BY_NAME = {d.name: d for d in DTYPES.values()}
ELEM_SIZE = {code: d.size for code, d in DTYPES.items()}


def decode_scalar(dt: DType, raw: bytes):
    """The PreMulSum scalar (a value of the op's datatype, left-aligned in 8 bytes),
    as a numpy scalar of the accumulator type (floats) or of the type itself (ints)."""
    value = np.frombuffer(bytes(raw[:dt.size]), dtype=dt.np)[0]
    return dt.acc.type(value) if dt.is_float else value
