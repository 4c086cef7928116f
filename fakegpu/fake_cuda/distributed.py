"""torch.distributed under fake CUDA devices: NCCL requests get the fakegpu backend.

- ``Backend.default_device_backend_map["cuda"]`` is ``fakegpu``, so
  ``get_default_backend_for_device("cuda")``, ``init_process_group()`` without a backend
  and ``init_device_mesh("cuda", ...)`` pick it;
- ``_new_process_group_helper`` (every group torch creates goes through it) turns a backend
  that names NCCL — ``"nccl"``, ``"cuda:nccl,cpu:gloo"`` — into ``fakegpu``, which carries the
  group's CPU tensors, fake-cuda or not, through the shim and the coordinator; a
  ``device_id`` is dropped (there is no device to bind an eager NCCL communicator to);
- DDP drops ``device_ids`` / ``output_device`` for a module whose parameters are on fake
  devices (torch accepts them only for real accelerator modules); FSDP2 places the shards of
  a "cuda" mesh, and FSDP1 its flat parameters, on the CPU, as the port does;
- DTensor's RNG tracker is off on "cuda" meshes, as it is on the CPU meshes of the port;
- ``torch.distributed.set_timeout`` and pipeline ``step(arg_mbs=...)``, where this torch
  predates them (``torch_compat``).
"""
from __future__ import annotations

import functools

import torch
from torch.distributed import distributed_c10d as c10d

from fakegpu.torch import BACKEND_NAME, FakeGpuProcessGroup, register
from fakegpu.torch.process_group import tries_now

_installed = False


def _names_nccl(backend) -> bool:
    if backend is None:
        return False
    text = str(backend).lower()
    return "nccl" in text or text.startswith("cuda:")


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    register()
    from fakegpu.torch.dynamo_skip import skip_fakegpu

    skip_fakegpu()  # its wrappers around the backend's methods run under C++ callers too
    c10d.Backend.default_device_backend_map["cuda"] = BACKEND_NAME

    original_helper = c10d._new_process_group_helper

    @functools.wraps(original_helper)
    def new_process_group_helper(group_size, group_rank, global_ranks_in_group, backend, store,
                                 group_name, backend_options=None, timeout=None, pg_tag=None,
                                 device_id=None, group_desc=None, **newer):
        # newer: arguments later torch releases add (2.14: enable_reconfigure), passed on.
        if _names_nccl(backend) or str(backend).lower() == BACKEND_NAME:
            backend = c10d.Backend(BACKEND_NAME)
            backend_options = None
            device_id = None
        return original_helper(group_size, group_rank, global_ranks_in_group, backend, store,
                               group_name, backend_options=backend_options, timeout=timeout,
                               pg_tag=pg_tag, device_id=device_id, group_desc=group_desc, **newer)

    c10d._new_process_group_helper = new_process_group_helper

    original_timeout = c10d._get_default_timeout

    @functools.wraps(original_timeout)
    def get_default_timeout(backend):
        # NCCL's default timeout, without torch's warning that NCCL is not compiled in.
        return original_timeout(BACKEND_NAME if _names_nccl(backend) else backend)

    c10d._get_default_timeout = get_default_timeout

    from fakegpu.torch.group_base import GroupBase

    original_get_backend = GroupBase._get_backend

    def _get_backend(self, device):   # both backends' groups: cuda tensors are host memory
        device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
        return original_get_backend(self, "cpu" if device_type == "cuda" else device)

    GroupBase._get_backend = _get_backend
    _collectives_below_the_modes()
    # A fake world's groups (one process playing rank r) are Python backends called from C++
    # too: inside a capture their collectives are graph steps as well, so replays reduce anew
    # and reach the report.
    from fakegpu.import_hooks import after_import

    after_import("fakegpu.fake.process_group",
                 lambda module: _record_in_cuda_graphs(module.FakeWorldProcessGroup))

    from . import torch_compat

    torch_compat.install(skip_backend=BACKEND_NAME)
    _patch_ddp()
    _patch_dtensor_rng()
    _patch_dtensor_meta()
    _patch_fsdp2_device()
    _patch_fsdp1_device()


_COLLECTIVES = ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather",
                "allgather_coalesced", "_allgather_base", "allgather_into_tensor_coalesced",
                "all_gather_single", "all_gather_single_coalesced", "all_to_all_single",
                "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
                "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced",
                "alltoall_base", "alltoall", "gather", "scatter", "barrier", "send", "recv",
                "recv_anysource")


def _below_the_modes(method, disable_current_modes):
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with torch._C.DisableTorchFunction(), disable_current_modes():
            return method(self, *args, **kwargs)
    return run


def _without_torch_function(method):
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with torch._C.DisableTorchFunction():
            return method(self, *args, **kwargs)
    return run


def _collectives_below_the_modes() -> None:
    """The fakegpu backend's collectives run with the device-rewrite and tracking modes off.

    Its staging copies are the communication library's business, which a CUDA caching
    allocator never sees either, and every torch call it makes would otherwise pay the two
    modes' Python cost (a large share of a small model's step)."""
    from torch.utils._python_dispatch import _disable_current_modes

    for name in _COLLECTIVES:
        method = getattr(FakeGpuProcessGroup, name, None)
        if method is None or getattr(method, "_below_modes", False):
            continue

        run_now = getattr(method, "now", None)
        if run_now is None:
            run = _below_the_modes(method, _disable_current_modes)
        else:
            # A blocking call the caller's thread runs at once (fakegpu.torch.now) makes no
            # tensors, so only the torch-function mode (its tensor queries) is turned off;
            # turning the dispatch modes off and on would cost more than the call.
            run = tries_now(_without_torch_function(run_now))(
                _below_the_modes(method.queued, _disable_current_modes))
        run = _recorded_in_cuda_graphs(run)
        run._below_modes = True
        setattr(FakeGpuProcessGroup, name, run)


def _record_in_cuda_graphs(backend: type) -> None:
    """Every collective method of ``backend`` (a Python c10d backend) is a step of a CUDA graph
    captured around it."""
    for name in _COLLECTIVES:
        method = getattr(backend, name, None)
        if method is None or getattr(method, "_in_cuda_graphs", False):
            continue
        run = _recorded_in_cuda_graphs(method)
        run._in_cuda_graphs = True
        setattr(backend, name, run)


def _recorded_in_cuda_graphs(method):
    """Inside a CUDA graph capture a collective is a step of the graph (the backend is called
    from C++ below the dispatcher, where the capture's dispatch mode does not see it)."""
    from . import graphs

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        capture = graphs.capturing()
        if capture is None:
            return method(self, *args, **kwargs)
        return capture.collective(method, (self, *args), kwargs)
    return run


def _patch_fsdp1_device() -> None:
    """FSDP1 (``FullyShardedDataParallel``): a cuda ``device_id`` (or none, with parameters
    on fake devices) becomes ``device_id=torch.device("cpu")``, how the CPU port spells it."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:
        return
    original_init = FSDP.__init__

    @functools.wraps(original_init)
    def __init__(self, module, *args, device_id=None, **kwargs):
        if device_id is None or type(device_id) is int or \
                torch.device(device_id).type == "cuda":
            device_id = torch.device("cpu")
        original_init(self, module, *args, device_id=device_id, **kwargs)

    FSDP.__init__ = __init__


def _replace_everywhere(original, replacement, package: str) -> None:
    """Rebind ``original`` to ``replacement`` in every loaded module of ``package`` that
    imported it by name (``from x import f`` copies the binding)."""
    import sys

    for name, module in list(sys.modules.items()):
        if module is None or not (name == package or name.startswith(package + ".")):
            continue
        for attr, value in list(vars(module).items()):
            if value is original:
                setattr(module, attr, replacement)


def _patch_fsdp2_device() -> None:
    """FSDP2 places shards on the mesh's device; a "cuda" mesh's tensors are CPU tensors."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard  # noqa: F401
        import torch.distributed._composable.replicate_with_fsdp  # noqa: F401
    except ImportError:
        return
    original = _fsdp_init._get_device_from_mesh

    @functools.wraps(original)
    def _get_device_from_mesh(mesh):
        if mesh.device_type == "cuda":
            return torch.device("cpu")
        return original(mesh)

    _replace_everywhere(original, _get_device_from_mesh, "torch.distributed")


def _patch_ddp() -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    original_init = DDP.__init__

    @functools.wraps(original_init)
    def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
        params = list(module.parameters())
        if params and all(p.device.type == "cpu" for p in params):
            device_ids = None
            output_device = None
        original_init(self, module, device_ids, output_device, *args, **kwargs)

    DDP.__init__ = __init__


def _patch_dtensor_meta() -> None:
    """DTensor's sharding propagation builds fake tensors on the mesh's device type, below the
    device-rewrite mode; a "cuda" mesh's are built on the CPU, the port's (random ops such as
    ``uniform_`` on a sharded parameter otherwise need a CUDA device guard)."""
    try:
        from torch.distributed.tensor import _op_schema
    except ImportError:
        return
    original = getattr(_op_schema, "_rebuild_tensor_from_dtensor_meta", None)
    if original is None:
        return

    @functools.wraps(original)
    def _rebuild_tensor_from_dtensor_meta(arg):
        if arg.mesh.device_type != "cuda" or arg.tensor_meta is None:
            return original(arg)
        meta = arg.tensor_meta
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="cpu")

    _op_schema._rebuild_tensor_from_dtensor_meta = _rebuild_tensor_from_dtensor_meta


def _patch_dtensor_rng() -> None:
    try:
        from torch.distributed.tensor import _random
    except ImportError:  # torch without DTensor
        return
    original = _random.is_rng_supported_mesh

    @functools.wraps(original)
    def is_rng_supported_mesh(device_mesh) -> bool:
        if device_mesh.device_type == "cuda":
            return False  # the tensors are CPU tensors: the CPU mesh's answer
        return original(device_mesh)

    _random.is_rng_supported_mesh = is_rng_supported_mesh
    try:
        from torch.distributed.tensor import _dispatch
    except ImportError:
        return
    if getattr(_dispatch, "is_rng_supported_mesh", None) is original:
        _dispatch.is_rng_supported_mesh = is_rng_supported_mesh
