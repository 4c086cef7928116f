"""CUDA extensions on fake CUDA devices: said in one line, not in torch's build traceback.

A framework's fused path (DeepSpeed's FusedAdam, Apex's fused kernels, a user's own ``.cu``)
either JIT-builds a CUDA extension with ``torch.utils.cpp_extension.load``/``load_inline`` or
imports one built earlier.  Neither can run here: the kernels are for a real GPU, the tensors
are host memory.  Without this module the user reads "CUDA_HOME environment variable is not
set" from deep inside torch's build, or "libc10_cuda.so: cannot open shared object file",
neither of which says what to do.  Instead:

* ``load``/``load_inline`` of CUDA sources (``with_cuda=True``, or a ``.cu``/``.cuh`` source,
  torch's own rule) raise :class:`UnsupportedOnFakeCuda` before any compiler runs; a C++-only
  extension builds and loads as it would.
* an ``ImportError`` naming torch's or CUDA's GPU libraries (a prebuilt CUDA extension) is told
  as the same one line by the excepthook (``describe_import_error``).

torch.utils.cpp_extension is patched only if the program imports it (it pulls in setuptools).
"""
from __future__ import annotations

import re
from typing import Iterable, Optional

from fakegpu.import_hooks import after_import

from .memory import UnsupportedOnFakeCuda

_CUDA_SUFFIXES = (".cu", ".cuh")
# Libraries only a CUDA build of torch or a CUDA toolkit provides: an extension linked against
# them was built for real GPUs.
_GPU_LIBRARY = re.compile(r"\b(lib(?:c10_cuda|torch_cuda\w*|cudart|cublas\w*|cudnn\w*|nccl|cuda)\.so[\w.]*)")
_ADVICE = ("fake CUDA devices (host memory, torch's CPU kernels) cannot run CUDA kernels; use the "
           "framework's non-fused path (for DeepSpeed, a torch optimizer passed to "
           "deepspeed.initialize) or run the job on real GPUs (fgpu --mode hybrid)")


def extension_message(name: str, how: str) -> str:
    return f"fakegpu: the CUDA extension {name!r} ({how}) cannot run here: {_ADVICE}"


def _has_cuda_sources(sources: Iterable[str]) -> bool:
    return any(str(s).endswith(_CUDA_SUFFIXES) for s in sources)


def describe_import_error(exc: BaseException) -> Optional[str]:
    """The one line for an ImportError of an extension built against GPU libraries, else None."""
    if not isinstance(exc, ImportError):
        return None
    match = _GPU_LIBRARY.search(str(exc))
    if match is None:
        return None
    name = exc.name or (exc.path or "an extension")
    return extension_message(name, f"built against {match.group(1)}, which this machine's torch lacks")


def _patch(cpp_extension) -> None:
    from .identity import replace

    load, load_inline = cpp_extension.load, cpp_extension.load_inline

    def load_(name, sources, *args, **kwargs):
        sources = [sources] if isinstance(sources, str) else list(sources)
        with_cuda = kwargs.get("with_cuda")
        if with_cuda or (with_cuda is None and _has_cuda_sources(sources)):
            raise UnsupportedOnFakeCuda(extension_message(name, "torch.utils.cpp_extension.load of CUDA sources"))
        return load(name, sources, *args, **kwargs)

    def load_inline_(name, cpp_sources, cuda_sources=None, *args, **kwargs):
        if cuda_sources or kwargs.get("with_cuda"):
            raise UnsupportedOnFakeCuda(
                extension_message(name, "torch.utils.cpp_extension.load_inline with CUDA sources"))
        return load_inline(name, cpp_sources, cuda_sources, *args, **kwargs)

    replace(cpp_extension, "load", load_)
    replace(cpp_extension, "load_inline", load_inline_)


def install() -> None:
    after_import("torch.utils.cpp_extension", _patch)
