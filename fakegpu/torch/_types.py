"""How torch dtypes and reduce ops become NCCL datatypes and ops.

Kept apart from the process group so the mapping can be read (and tested) on its own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from fakegpu.nccl import DataType, RedOp

# torch dtype -> NCCL datatype, for dtypes NCCL can reduce natively.
_NATIVE = {
    torch.int8: DataType.int8,
    torch.uint8: DataType.uint8,
    torch.int32: DataType.int32,
    torch.int64: DataType.int64,
    torch.float16: DataType.float16,
    torch.float32: DataType.float32,
    torch.float64: DataType.float64,
    torch.bfloat16: DataType.bfloat16,
    # bool travels as bytes; reductions on it are rewritten below (as ProcessGroupNCCL does).
    torch.bool: DataType.uint8,
}
for _name, _code in (("uint32", DataType.uint32), ("uint64", DataType.uint64),
                     ("float8_e4m3fn", DataType.float8e4m3), ("float8_e5m2", DataType.float8e5m2)):
    if hasattr(torch, _name):  # not every supported torch version has these dtypes
        _NATIVE[getattr(torch, _name)] = _code

_COMPLEX_PARTS = {torch.complex64: DataType.float32, torch.complex128: DataType.float64}


@dataclass(frozen=True)
class Buffer:
    """What NCCL is told about one contiguous tensor: its element type and element count."""

    dtype: DataType
    count: int


def buffer_of(tensor: torch.Tensor, *, reducing: bool) -> Buffer:
    """The NCCL view of a contiguous CPU tensor.

    Complex tensors are reduced as pairs of reals.  Dtypes NCCL has no type for (uint16,
    float8 variants without an NCCL code, ...) can still be *moved* as raw bytes, but a
    reduction on them is an error that names the dtype.
    """
    dtype = tensor.dtype
    if dtype in _NATIVE:
        return Buffer(_NATIVE[dtype], tensor.numel())
    if dtype in _COMPLEX_PARTS:
        return Buffer(_COMPLEX_PARTS[dtype], tensor.numel() * 2)
    if not reducing:
        return Buffer(DataType.uint8, tensor.numel() * tensor.element_size())
    raise TypeError(f"fakegpu: NCCL has no datatype to reduce torch.{str(dtype)[6:]} tensors")


_OP_TYPES = dist.ReduceOp.RedOpType


@dataclass(frozen=True)
class Reduction:
    """An NCCL reduction: a builtin op, or PreMulSum with its scalar factor."""

    op: RedOp
    premul_factor: Optional[float] = None


# NCCL has no logical ops; on 0/1 bytes, any/all are max/min (ProcessGroupNCCL does this too).
_BOOL_OPS = {_OP_TYPES.SUM: RedOp.max, _OP_TYPES.MAX: RedOp.max, _OP_TYPES.BOR: RedOp.max,
             _OP_TYPES.PRODUCT: RedOp.min, _OP_TYPES.MIN: RedOp.min, _OP_TYPES.BAND: RedOp.min}
_BUILTIN_OPS = {_OP_TYPES.SUM: RedOp.sum, _OP_TYPES.AVG: RedOp.avg, _OP_TYPES.PRODUCT: RedOp.prod,
                _OP_TYPES.MIN: RedOp.min, _OP_TYPES.MAX: RedOp.max}
_COMPLEX_OPS = (_OP_TYPES.SUM, _OP_TYPES.AVG)


def reduction_of(reduce_op, dtype: torch.dtype) -> Reduction:
    """Translate a ``dist.ReduceOp`` (from an options struct) for tensors of ``dtype``."""
    op_type = getattr(reduce_op, "op", reduce_op)  # ReduceOp wraps a RedOpType
    if op_type == _OP_TYPES.PREMUL_SUM:
        factor = reduce_op.factor
        if isinstance(factor, torch.Tensor):
            # NCCL reads a device scalar when the collective runs; on host memory the value
            # at call time is the same thing.
            factor = factor.item()
        if dtype.is_complex:
            raise TypeError("fakegpu: PREMUL_SUM on complex tensors is not supported")
        return Reduction(RedOp.sum, float(factor))
    if dtype == torch.bool and op_type in _BOOL_OPS:
        return Reduction(_BOOL_OPS[op_type])
    if op_type not in _BUILTIN_OPS:
        raise ValueError(f"fakegpu: reduce op {op_type.name} is not supported by NCCL "
                         f"(for {dtype} tensors)")
    if dtype.is_complex and op_type not in _COMPLEX_OPS:
        raise ValueError(f"fakegpu: reduce op {op_type.name} is not defined for complex tensors")
    return Reduction(_BUILTIN_OPS[op_type])


def builtin_op_of(reduce_op) -> Optional[RedOp]:
    """The NCCL op of a plain builtin ``reduce_op`` (None for PreMulSum and ops NCCL lacks,
    which take the general path of :func:`reduction_of`), for tensors whose dtype
    :func:`native_dtype_of` accepts."""
    return _BUILTIN_OPS.get(getattr(reduce_op, "op", reduce_op))


def native_dtype_of(tensor: torch.Tensor) -> Optional[DataType]:
    """The NCCL datatype of a tensor NCCL handles as it is (not bool, complex or raw bytes)."""
    dtype = tensor.dtype
    return None if dtype == torch.bool else _NATIVE.get(dtype)
