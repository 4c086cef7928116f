"""A small Python binding to an NCCL library (by default fakegpu's own shim), via cffi ABI mode.

It exists so that tests, the bandwidth command and the torch backend can drive the exact same
C entry points a CUDA program would, without compiling anything.  Every call that fails raises
:class:`NcclError` carrying the ``ncclResult_t`` and the library's ``ncclGetLastError`` text.

Buffers may be numpy arrays, integer addresses, or anything with ``data_ptr()`` (torch tensors).
Streams are always NULL: the shim works on host memory and completes a call before returning.
"""
from __future__ import annotations

import contextlib
import enum
import os
import threading
import time
from typing import Any, Iterator, Optional, Union

import numpy as np
from cffi import FFI

__all__ = [
    "NcclError",
    "Result",
    "DataType",
    "RedOp",
    "ScalarResidence",
    "Nccl",
    "Comm",
    "SPLIT_NOCOLOR",
    "UNIQUE_ID_BYTES",
]

UNIQUE_ID_BYTES = 128
SPLIT_NOCOLOR = -1
_CONFIG_MAGIC = 0xCAFEBEEF
_CONFIG_UNDEF_INT = -(2**31)

_CDEF = """
typedef int ncclResult_t;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef int ncclScalarResidence_t;
typedef struct ncclComm* ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;
typedef void* cudaStream_t;

typedef struct ncclConfig_v23000 {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char *netName;
  int splitShare;
  int trafficClass;
  const char *commName;
  int collnetEnable;
  int CTAPolicy;
  int shrinkShare;
  int nvlsCTAs;
  int nChannelsPerNetPeer;
  int nvlinkCentricSched;
  int graphUsageMode;
  int numRmaCtx;
  int maxP2pPeers;
  int graphStreamOrdering;
} ncclConfig_t;

ncclResult_t ncclGetVersion(int *version);
ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId);
ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank);
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t* config);
ncclResult_t ncclCommInitAll(ncclComm_t* comm, int ndev, const int* devlist);
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                           ncclConfig_t* config);
ncclResult_t ncclCommShrink(ncclComm_t comm, int* excludeRanksList, int excludeRanksCount,
                            ncclComm_t* newcomm, ncclConfig_t* config, int shrinkFlags);
ncclResult_t ncclCommFinalize(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
const char*  ncclGetErrorString(ncclResult_t result);
const char*  ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError);
ncclResult_t ncclCommCount(const ncclComm_t comm, int* count);
ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank);
ncclResult_t ncclMemAlloc(void** ptr, size_t size);
ncclResult_t ncclMemFree(void *ptr);
ncclResult_t ncclRedOpCreatePreMulSum(ncclRedOp_t *op, void *scalar, ncclDataType_t datatype,
                                      ncclScalarResidence_t residence, ncclComm_t comm);
ncclResult_t ncclRedOpDestroy(ncclRedOp_t op, ncclComm_t comm);

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root,
                       ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                               ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream);
ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                           ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count,
                          ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclGather(const void* sendbuff, void* recvbuff, size_t count,
                        ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclScatter(const void* sendbuff, void* recvbuff, size_t count,
                         ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclGroupStart();
ncclResult_t ncclGroupEnd();
ncclResult_t fakegpu_probe_source(ncclComm_t comm, int timeout_ms, int* peer);
"""


_PRECOMPILED_MODULE = "fakegpu._nccl_ffi"


def cdef_digest() -> str:
    import hashlib

    return hashlib.sha256(_CDEF.encode()).hexdigest()


def _parsed_ffi() -> FFI:
    ffi = FFI()
    ffi.cdef(_CDEF)
    return ffi


def _precompiled_ffi() -> Optional[Any]:
    try:
        import importlib

        module = importlib.import_module(_PRECOMPILED_MODULE)
    except Exception:  # noqa: BLE001 - missing, or made for a cffi this one cannot read
        return None
    return module.ffi if getattr(module, "CDEF_SHA256", None) == cdef_digest() else None


def precompiled_ffi_source() -> str:
    """The text of fakegpu/_nccl_ffi.py: cffi's out-of-line ABI module for ``_CDEF`` (no C
    compiler involved), stamped with the declarations' digest."""
    import tempfile

    builder = FFI()
    builder.cdef(_CDEF)
    builder.set_source(_PRECOMPILED_MODULE, None)
    with tempfile.TemporaryDirectory() as tmp:
        path = builder.compile(tmpdir=tmp)
        with open(path) as fh:
            body = fh.read()
    return (body.rstrip("\n") + "\n\n# sha256 of fakegpu.nccl._CDEF; a mismatch makes fakegpu.nccl parse it instead\n"
            f"CDEF_SHA256 = {cdef_digest()!r}\n")


def write_precompiled_ffi() -> str:
    """Regenerate fakegpu/_nccl_ffi.py after changing ``_CDEF``; returns its path."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_nccl_ffi.py")
    with open(path, "w") as fh:
        fh.write(precompiled_ffi_source())
    return path


class Result(enum.IntEnum):
    success = 0
    unhandled_cuda_error = 1
    system_error = 2
    internal_error = 3
    invalid_argument = 4
    invalid_usage = 5
    remote_error = 6
    in_progress = 7
    timeout = 8

    @property
    def nccl_name(self) -> str:
        return _RESULT_NAMES[self]


_RESULT_NAMES = {
    Result.success: "ncclSuccess",
    Result.unhandled_cuda_error: "ncclUnhandledCudaError",
    Result.system_error: "ncclSystemError",
    Result.internal_error: "ncclInternalError",
    Result.invalid_argument: "ncclInvalidArgument",
    Result.invalid_usage: "ncclInvalidUsage",
    Result.remote_error: "ncclRemoteError",
    Result.in_progress: "ncclInProgress",
    Result.timeout: "ncclTimeout",
}


def result_name(code: int) -> str:
    try:
        return Result(code).nccl_name
    except ValueError:
        return f"ncclResult({code})"


class NcclError(RuntimeError):
    """An NCCL call returned something other than ncclSuccess.

    ``result`` is the raw ``ncclResult_t``; ``name`` its enum spelling (``"ncclInvalidUsage"``).
    """

    def __init__(self, result: int, function: str, detail: str = ""):
        self.result = int(result)
        self.name = result_name(self.result)
        self.function = function
        self.detail = detail
        message = f"{function} failed: {self.name} ({self.result})"
        if detail:
            message += f": {detail}"
        super().__init__(message)


def _ml_dtypes():
    from fakegpu._deps import require  # imported lazily: only the exotic float types need it

    return require("ml_dtypes", "numpy arrays of NCCL's bfloat16 and float8 datatypes")


class DataType(enum.IntEnum):
    int8 = 0
    uint8 = 1
    int32 = 2
    uint32 = 3
    int64 = 4
    uint64 = 5
    float16 = 6
    float32 = 7
    float64 = 8
    bfloat16 = 9
    float8e4m3 = 10
    float8e5m2 = 11

    @property
    def numpy_dtype(self) -> np.dtype:
        if self is DataType.bfloat16:
            return np.dtype(_ml_dtypes().bfloat16)
        if self is DataType.float8e4m3:
            return np.dtype(_ml_dtypes().float8_e4m3fn)
        if self is DataType.float8e5m2:
            return np.dtype(_ml_dtypes().float8_e5m2)
        return np.dtype(self.name)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        return self >= DataType.float16

    @classmethod
    def from_numpy(cls, dtype: Any) -> "DataType":
        """The NCCL datatype of a numpy dtype (or anything ``np.dtype`` accepts, or a torch dtype)."""
        if isinstance(dtype, DataType):
            return dtype
        text = str(dtype)
        if isinstance(dtype, str):
            # NCCL-style names ("float8e4m3") and numpy/ml_dtypes names ("float8_e4m3fn"),
            # without needing numpy to know the ml_dtypes names
            if dtype in cls.__members__:
                return cls[dtype]
            if dtype in _NUMPY_NAMES:
                return cls[_NUMPY_NAMES[dtype]]
        if text.startswith("torch."):
            name = _TORCH_NAMES.get(text[len("torch."):])
            if name is None:
                raise TypeError(f"torch dtype {text} has no NCCL datatype")
            return cls[name]
        np_dtype = np.dtype(dtype)
        name = _NUMPY_NAMES.get(np_dtype.name)
        if name is None:
            raise TypeError(f"numpy dtype {np_dtype} has no NCCL datatype")
        return cls[name]


_ITEMSIZE = {
    DataType.int8: 1, DataType.uint8: 1, DataType.int32: 4, DataType.uint32: 4,
    DataType.int64: 8, DataType.uint64: 8, DataType.float16: 2, DataType.float32: 4,
    DataType.float64: 8, DataType.bfloat16: 2, DataType.float8e4m3: 1, DataType.float8e5m2: 1,
}
_NUMPY_NAMES = {
    "int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32",
    "int64": "int64", "uint64": "uint64", "float16": "float16", "float32": "float32",
    "float64": "float64", "bfloat16": "bfloat16", "float8_e4m3fn": "float8e4m3",
    "float8_e5m2": "float8e5m2",
}
_TORCH_NAMES = {
    "int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32", "int64": "int64",
    "uint64": "uint64", "float16": "float16", "float32": "float32", "float64": "float64",
    "bfloat16": "bfloat16", "float8_e4m3fn": "float8e4m3", "float8_e5m2": "float8e5m2",
    "int": "int32", "long": "int64", "half": "float16", "float": "float32", "double": "float64",
    "bool": "uint8",
}


class RedOp(enum.IntEnum):
    sum = 0
    prod = 1
    max = 2
    min = 3
    avg = 4


class ScalarResidence(enum.IntEnum):
    device = 0
    host_immediate = 1


BufferLike = Union[int, None, np.ndarray, Any]


def _address(buf: BufferLike) -> int:
    """The raw address behind a buffer argument (0 for None)."""
    if buf is None:
        return 0
    if isinstance(buf, (int, np.integer)):
        return int(buf)
    if isinstance(buf, np.ndarray):
        return int(buf.ctypes.data)
    data_ptr = getattr(buf, "data_ptr", None)
    if callable(data_ptr):
        return int(data_ptr())
    raise TypeError(
        f"cannot use {type(buf).__name__} as an NCCL buffer: pass a numpy array, an int address "
        "or an object with data_ptr()"
    )


def _dtype_code(dtype: Any) -> int:
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool):
        return int(dtype)  # raw codes pass through unchanged, so invalid ones reach the library
    return int(DataType.from_numpy(dtype))


def _op_code(op: Any) -> int:
    if isinstance(op, str):
        return int(RedOp[op.lower()])
    return int(op)


class Nccl:
    """One loaded NCCL library.  ``path`` defaults to :func:`fakegpu.nccl_library_path`."""

    _ffi_lock = threading.Lock()
    _ffi: Optional[FFI] = None

    def __init__(self, path: Optional[str] = None):
        if path is None:
            import fakegpu

            path = fakegpu.nccl_library_path()
        self.path = str(path)
        self.ffi = self._shared_ffi()
        self.lib = self.ffi.dlopen(self.path)

    @classmethod
    def _shared_ffi(cls) -> FFI:
        # One FFI for all libraries.  Parsing the declarations takes ~0.5 s (pycparser), so
        # the FFI normally comes pre-parsed from fakegpu/_nccl_ffi.py (see
        # write_precompiled_ffi); a stale or unloadable one falls back to parsing.
        with cls._ffi_lock:
            if cls._ffi is None:
                cls._ffi = _precompiled_ffi() or _parsed_ffi()
            return cls._ffi

    # -- error handling ---------------------------------------------------------------------
    def last_error(self, comm: Any = None) -> str:
        handle = comm._handle if isinstance(comm, Comm) else self.ffi.NULL
        text = self.lib.ncclGetLastError(handle)
        return self.ffi.string(text).decode("utf-8", "replace") if text != self.ffi.NULL else ""

    def error_string(self, result: int) -> str:
        text = self.lib.ncclGetErrorString(int(result))
        return self.ffi.string(text).decode("utf-8", "replace") if text != self.ffi.NULL else ""

    def check(self, result: int, function: str, comm: Any = None) -> int:
        if result != Result.success:
            raise NcclError(result, function, self.last_error(comm))
        return result

    # -- library-wide calls ----------------------------------------------------------------
    def version(self) -> int:
        out = self.ffi.new("int*")
        self.check(self.lib.ncclGetVersion(out), "ncclGetVersion")
        return int(out[0])

    def get_unique_id(self) -> bytes:
        uid = self.ffi.new("ncclUniqueId*")
        self.check(self.lib.ncclGetUniqueId(uid), "ncclGetUniqueId")
        return bytes(self.ffi.buffer(uid.internal, UNIQUE_ID_BYTES))

    def shared_unique_id(self, path: "Union[str, os.PathLike]", rank: int,
                         timeout_s: float = 60.0) -> bytes:
        """A unique id agreed through a file that every rank can see.

        Rank 0 writes a fresh id to ``path`` (atomically: readers never see half an id); the
        other ranks wait for the file at most ``timeout_s`` seconds (TimeoutError).
        """
        path = os.fspath(path)
        if rank == 0:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as fh:
                fh.write(self.get_unique_id())
            os.replace(tmp, path)
        else:
            deadline = time.monotonic() + timeout_s
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank}: no unique id from rank 0 in {path} "
                                       f"after {timeout_s:g} s")
                time.sleep(0.005)
        with open(path, "rb") as fh:
            return fh.read()

    def _unique_id(self, unique_id: bytes) -> Any:
        raw = bytes(unique_id)
        if len(raw) != UNIQUE_ID_BYTES:
            raise ValueError(f"a unique id is {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
        uid = self.ffi.new("ncclUniqueId*")
        self.ffi.memmove(uid.internal, raw, UNIQUE_ID_BYTES)
        return uid

    def new_config(self, *, name: Optional[str] = None, blocking: Optional[bool] = None) -> Any:
        """An ``ncclConfig_t`` set up like ``NCCL_CONFIG_INITIALIZER``; keeps ``name`` alive."""
        config = self.ffi.new("ncclConfig_t*")
        config.size = self.ffi.sizeof("ncclConfig_t")
        config.magic = _CONFIG_MAGIC
        config.version = 23007
        for field in ("blocking", "cgaClusterSize", "minCTAs", "maxCTAs", "splitShare",
                      "trafficClass", "collnetEnable", "CTAPolicy", "shrinkShare", "nvlsCTAs",
                      "nChannelsPerNetPeer", "nvlinkCentricSched", "graphUsageMode", "numRmaCtx",
                      "maxP2pPeers", "graphStreamOrdering"):
            setattr(config, field, _CONFIG_UNDEF_INT)
        if blocking is not None:
            config.blocking = 1 if blocking else 0
        keep = []
        if name is not None:
            name_buf = self.ffi.new("char[]", name.encode("utf-8"))
            keep.append(name_buf)
            config.commName = name_buf
        return config, keep

    def comm_init_rank(self, nranks: int, unique_id: bytes, rank: int, *,
                       name: Optional[str] = None, blocking: bool = True) -> "Comm":
        """Join communicator ``unique_id`` as ``rank`` of ``nranks``.

        With ``blocking=False`` the call may return while the communicator is still forming
        (``ncclInProgress``); poll :meth:`Comm.get_async_error` or call :meth:`Comm.wait_ready`.
        """
        uid = self._unique_id(unique_id)
        out = self.ffi.new("ncclComm_t*")
        if name is None and blocking:
            self.check(self.lib.ncclCommInitRank(out, int(nranks), uid[0], int(rank)),
                       "ncclCommInitRank")
        else:
            config, keep = self.new_config(name=name, blocking=blocking)
            result = self.lib.ncclCommInitRankConfig(out, int(nranks), uid[0], int(rank), config)
            if not (result == Result.in_progress and not blocking):
                self.check(result, "ncclCommInitRankConfig")
            comm = Comm(self, out[0])
            comm._keep_alive = (config, keep)  # a background init may still read the config
            return comm
        return Comm(self, out[0])

    def comm_init_all(self, ndev: int) -> list["Comm"]:
        comms = self.ffi.new("ncclComm_t[]", max(int(ndev), 1))
        self.check(self.lib.ncclCommInitAll(comms, int(ndev), self.ffi.NULL), "ncclCommInitAll")
        return [Comm(self, comms[i]) for i in range(int(ndev))]

    def group_start(self) -> None:
        self.check(self.lib.ncclGroupStart(), "ncclGroupStart")

    def group_end(self) -> None:
        self.check(self.lib.ncclGroupEnd(), "ncclGroupEnd")

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """``with nccl.group(): ...`` — GroupStart, the calls, GroupEnd (also after an exception,
        so the library's group depth stays balanced; the original exception wins)."""
        self.group_start()
        try:
            yield
        except BaseException:
            with contextlib.suppress(NcclError):
                self.group_end()
            raise
        self.group_end()

    def mem_alloc(self, nbytes: int) -> int:
        out = self.ffi.new("void**")
        self.check(self.lib.ncclMemAlloc(out, int(nbytes)), "ncclMemAlloc")
        return int(self.ffi.cast("uintptr_t", out[0]))

    def mem_free(self, ptr: int) -> None:
        self.check(self.lib.ncclMemFree(self.ffi.cast("void*", int(ptr))), "ncclMemFree")


class Comm:
    """One communicator handle (``ncclComm_t``) of a :class:`Nccl` library."""

    def __init__(self, nccl: Nccl, handle: Any):
        self.nccl = nccl
        self._handle = handle
        self._lib = nccl.lib
        self._ffi = nccl.ffi
        self._scalars: dict[int, Any] = {}  # premul-sum op -> scalar storage kept alive

    # -- identity ----------------------------------------------------------------------------
    @property
    def handle(self) -> int:
        return int(self._ffi.cast("uintptr_t", self._handle))

    def _query(self, function: str) -> int:
        out = self._ffi.new("int*")
        self._check(getattr(self._lib, function)(self._handle, out), function)
        return int(out[0])

    @property
    def rank(self) -> int:
        return self._query("ncclCommUserRank")

    @property
    def size(self) -> int:
        return self._query("ncclCommCount")

    @property
    def device(self) -> int:
        return self._query("ncclCommCuDevice")

    def __repr__(self) -> str:
        return f"<fakegpu.nccl.Comm handle=0x{self.handle:x}>"

    def _check(self, result: int, function: str) -> int:
        return self.nccl.check(result, function, self)

    def _ptr(self, buf: BufferLike) -> Any:
        return self._ffi.cast("void*", _address(buf))

    # -- life cycle ----------------------------------------------------------------------------
    def get_async_error(self) -> int:
        out = self._ffi.new("ncclResult_t*")
        self._check(self._lib.ncclCommGetAsyncError(self._handle, out), "ncclCommGetAsyncError")
        return int(out[0])

    def wait_ready(self, timeout_s: float = 60.0, poll_s: float = 0.001) -> None:
        """Wait for a non-blocking init/split to finish; raise its error or a timeout."""
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            state = self.get_async_error()
            if state == Result.success:
                return
            if state != Result.in_progress:
                raise NcclError(state, "ncclCommGetAsyncError", self.nccl.last_error(self))
            if time.monotonic() > deadline:
                raise TimeoutError(f"communicator still in progress after {timeout_s} s")
            time.sleep(poll_s)

    def split(self, color: int, key: int, *, name: Optional[str] = None) -> Optional["Comm"]:
        """``ncclCommSplit``; returns None for ``color == SPLIT_NOCOLOR`` (NCCL gives NULL)."""
        out = self._ffi.new("ncclComm_t*")
        config, keep = (self.nccl.new_config(name=name) if name is not None
                        else (self._ffi.NULL, []))
        self._check(self._lib.ncclCommSplit(self._handle, int(color), int(key), out, config),
                    "ncclCommSplit")
        del keep
        if out[0] == self._ffi.NULL:
            return None
        return Comm(self.nccl, out[0])

    def shrink(self, exclude: "list[int]", *, name: Optional[str] = None,
               abort: bool = False) -> "Comm":
        """``ncclCommShrink``: a new communicator of this one's members minus ``exclude``.

        Only the survivors call it; ``abort=True`` passes NCCL_SHRINK_ABORT.
        """
        out = self._ffi.new("ncclComm_t*")
        ranks = self._ffi.new("int[]", [int(r) for r in exclude] or [0])
        config, keep = (self.nccl.new_config(name=name) if name is not None
                        else (self._ffi.NULL, []))
        self._check(self._lib.ncclCommShrink(self._handle, ranks, len(exclude), out, config,
                                             1 if abort else 0), "ncclCommShrink")
        del keep
        return Comm(self.nccl, out[0])

    def finalize(self) -> None:
        self._check(self._lib.ncclCommFinalize(self._handle), "ncclCommFinalize")

    def destroy(self) -> None:
        self._check(self._lib.ncclCommDestroy(self._handle), "ncclCommDestroy")

    def abort(self) -> None:
        self._check(self._lib.ncclCommAbort(self._handle), "ncclCommAbort")

    # -- reduction operators -------------------------------------------------------------------
    def create_premul_sum(self, scalar: Any, dtype: Any, *, device_scalar: bool = False) -> int:
        """``ncclRedOpCreatePreMulSum``.  With ``device_scalar`` the scalar lives in memory this
        object keeps until :meth:`destroy_op` and the library reads it when a collective runs;
        otherwise it is passed as ``ncclScalarHostImmediate``.  ``scalar`` may be a number
        (converted to ``dtype``), or a one-element numpy array used as the storage itself."""
        code = _dtype_code(dtype)
        if isinstance(scalar, np.ndarray):
            storage = scalar
        else:
            np_dtype = DataType(code).numpy_dtype if 0 <= code <= 11 else np.dtype(np.float64)
            storage = np.array([scalar], dtype=np_dtype)
        out = self._ffi.new("ncclRedOp_t*")
        residence = ScalarResidence.device if device_scalar else ScalarResidence.host_immediate
        self._check(self._lib.ncclRedOpCreatePreMulSum(out, self._ptr(storage), code,
                                                        int(residence), self._handle),
                    "ncclRedOpCreatePreMulSum")
        op = int(out[0])
        if device_scalar:
            self._scalars[op] = storage
        return op

    def destroy_op(self, op: int) -> None:
        self._check(self._lib.ncclRedOpDestroy(int(op), self._handle), "ncclRedOpDestroy")
        self._scalars.pop(int(op), None)

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, send: BufferLike, recv: BufferLike, count: int, dtype: Any,
                   op: Any = RedOp.sum) -> None:
        self._check(self._lib.ncclAllReduce(self._ptr(send), self._ptr(recv), int(count),
                                            _dtype_code(dtype), _op_code(op), self._handle,
                                            self._ffi.NULL), "ncclAllReduce")

    def broadcast(self, send: BufferLike, recv: BufferLike, count: int, dtype: Any,
                  root: int) -> None:
        self._check(self._lib.ncclBroadcast(self._ptr(send), self._ptr(recv), int(count),
                                            _dtype_code(dtype), int(root), self._handle,
                                            self._ffi.NULL), "ncclBroadcast")

    def bcast(self, buf: BufferLike, count: int, dtype: Any, root: int) -> None:
        """The legacy in-place broadcast (``ncclBcast``)."""
        self._check(self._lib.ncclBcast(self._ptr(buf), int(count), _dtype_code(dtype), int(root),
                                        self._handle, self._ffi.NULL), "ncclBcast")

    def reduce(self, send: BufferLike, recv: BufferLike, count: int, dtype: Any, op: Any,
               root: int) -> None:
        self._check(self._lib.ncclReduce(self._ptr(send), self._ptr(recv), int(count),
                                         _dtype_code(dtype), _op_code(op), int(root),
                                         self._handle, self._ffi.NULL), "ncclReduce")

    def all_gather(self, send: BufferLike, recv: BufferLike, sendcount: int, dtype: Any) -> None:
        self._check(self._lib.ncclAllGather(self._ptr(send), self._ptr(recv), int(sendcount),
                                            _dtype_code(dtype), self._handle, self._ffi.NULL),
                    "ncclAllGather")

    def reduce_scatter(self, send: BufferLike, recv: BufferLike, recvcount: int, dtype: Any,
                       op: Any = RedOp.sum) -> None:
        self._check(self._lib.ncclReduceScatter(self._ptr(send), self._ptr(recv), int(recvcount),
                                                _dtype_code(dtype), _op_code(op), self._handle,
                                                self._ffi.NULL), "ncclReduceScatter")

    def all_to_all(self, send: BufferLike, recv: BufferLike, count: int, dtype: Any) -> None:
        self._check(self._lib.ncclAlltoAll(self._ptr(send), self._ptr(recv), int(count),
                                           _dtype_code(dtype), self._handle, self._ffi.NULL),
                    "ncclAlltoAll")

    def gather(self, send: BufferLike, recv: BufferLike, count: int, dtype: Any,
               root: int) -> None:
        self._check(self._lib.ncclGather(self._ptr(send), self._ptr(recv), int(count),
                                         _dtype_code(dtype), int(root), self._handle,
                                         self._ffi.NULL), "ncclGather")

    def scatter(self, send: BufferLike, recv: BufferLike, count: int, dtype: Any,
                root: int) -> None:
        self._check(self._lib.ncclScatter(self._ptr(send), self._ptr(recv), int(count),
                                          _dtype_code(dtype), int(root), self._handle,
                                          self._ffi.NULL), "ncclScatter")

    def send(self, buf: BufferLike, count: int, dtype: Any, peer: int) -> None:
        self._check(self._lib.ncclSend(self._ptr(buf), int(count), _dtype_code(dtype), int(peer),
                                       self._handle, self._ffi.NULL), "ncclSend")

    def recv(self, buf: BufferLike, count: int, dtype: Any, peer: int) -> None:
        self._check(self._lib.ncclRecv(self._ptr(buf), int(count), _dtype_code(dtype), int(peer),
                                       self._handle, self._ffi.NULL), "ncclRecv")

    def probe_source(self, timeout_ms: int = 0) -> int:
        """The rank whose Send to this rank waits at the coordinator, once one does (fakegpu's
        extension ``fakegpu_probe_source``; NCCL has no receive from any source): the earliest
        such Send (ties: the lower rank), which this rank's next :meth:`recv` from that rank
        completes. Waits at most ``timeout_ms`` (0: the coordinator's timeout, which also caps
        larger values); ``NcclError`` ncclTimeout when nobody sent in time. Not inside a group."""
        peer = self._ffi.new("int*")
        self._check(self._lib.fakegpu_probe_source(self._handle, int(timeout_ms), peer),
                    "fakegpu_probe_source")
        return int(peer[0])
