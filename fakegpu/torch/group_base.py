"""``GroupBase``: what the two fakegpu process groups share.

fakegpu has two torch backends: ``fakegpu`` (:class:`fakegpu.torch.FakeGpuProcessGroup`,
every rank a real process whose bytes go through the NCCL shim) and ``fakegpu_fake``
(:class:`fakegpu.fake.process_group.FakeWorldProcessGroup`, one process playing one rank of a
large logical world).  Both present the same torch ``ProcessGroup`` surface, so this base
holds it once:

- identity: backend name, group name and description, and the communicator name the report
  labels traffic with ("default_pg", "mesh_dp", ...);
- torch's many spellings of one collective (``_allgather_base``, ``all_gather_single``,
  ``allgather_into_tensor_coalesced``, ...) routed to one primitive per kind, with the shape
  checks done once;
- the list layouts: ``allgather_coalesced`` is ``allgather`` transposed;
- point-to-point argument checks and split-group naming.

A subclass implements the primitives: ``_allgather_pairs(what, pairs)``,
``_reduce_scatter_pairs(what, pairs, reduce_op)``, ``_all_to_all_single(what, output, input,
output_splits, input_splits)`` and ``_point_to_point(kind, tensors, peer)``.  ``what`` is the
name torch called, for error messages.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def reduce_op_of(opts):
    """The ``dist.ReduceOp`` an options struct carries (SUM when it has none)."""
    reduce_op = getattr(opts, "reduceOp", None) if opts is not None else None
    return dist.ReduceOp.SUM if reduce_op is None else reduce_op


class _BackendView:
    """What ``pg._get_backend(cpu)`` returns for a fakegpu group (either backend).

    torch's C++ ProcessGroup has no backend registered for a Python group, so the inherited
    ``_get_backend`` raises; torch 2.14's ``batch_isend_irecv`` and several helpers call it on
    any ProcessGroup and read capability flags.  This answers those flags (no NCCL-style
    coalescing, no splitting through torch, no tensor allocation, no time estimate) and passes
    everything else to the group itself.
    """

    supports_coalescing = False
    supports_splitting = False
    supports_time_estimate = False

    def __init__(self, group: "GroupBase"):
        self._group = group

    def supports_tensor_alloc(self, device) -> bool:  # noqa: ARG002
        return False

    def name(self) -> str:
        return self._group.BACKEND_NAME

    def __getattr__(self, name):
        return getattr(self._group, name)


class GroupBase(dist.ProcessGroup):
    BACKEND_NAME = ""
    # The communicator name of a group torch gave neither a description nor a name.
    UNNAMED_COMM = ""

    def __init__(self, rank: int, size: int, *, group_name: str = "", group_desc: str = ""):
        super().__init__(rank, size)
        self._group_name = group_name
        self._group_desc = group_desc
        self._split_count = 0
        # Tell torch this group serves CPU tensors (no C++ backend object behind it): that is
        # what _get_pg_default_device() and the object collectives read (_get_backend below
        # answers for that device).
        try:
            self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, None)
        except (TypeError, RuntimeError):  # a torch whose binding wants a Backend object
            pass

    def _get_backend(self, device):
        device_type = torch.device(device).type if not isinstance(device, torch.device) else device.type
        if device_type != "cpu":
            raise RuntimeError(f"No backend type associated with device type {device_type}")
        return _BackendView(self)

    # -- identity (forwarded from C++ by the trampoline) --------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - C++ name
        return self.BACKEND_NAME

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name
        self._identity_changed()

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc
        self._identity_changed()

    def _identity_changed(self) -> None:
        """Called after torch names or describes the group (right after construction)."""

    @property
    def comm_name(self) -> str:
        """The communicator name the report shows: the group's description when torch gave one
        ("default_pg", "mesh_tp"), else its name."""
        if self._group_desc and self._group_desc != "undefined":
            return self._group_desc
        return f"group_{self._group_name}" if self._group_name else self.UNNAMED_COMM

    def _error_prefix(self, what: str) -> str:
        return f"{self.BACKEND_NAME} {what}"

    # -- all-gather -----------------------------------------------------------------------------
    def _pairs(self, what: str, outputs, inputs, *, gathering: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(output, input) pairs of a tensor-form all-gather (output = size() x input) or
        reduce-scatter (input = size() x output), checked."""
        if len(outputs) != len(inputs):
            raise ValueError(f"{self._error_prefix(what)}: {len(outputs)} outputs for {len(inputs)} inputs")
        pairs = list(zip(outputs, inputs))
        for output, input_ in pairs:
            whole, block, side = (output, input_, "output") if gathering else (input_, output, "input")
            if whole.numel() != block.numel() * self.size():
                raise ValueError(f"{self._error_prefix(what)}: {side} has {whole.numel()} elements, "
                                 f"expected {self.size()} x {block.numel()}")
        return pairs

    def _gather_pairs(self, what: str, outputs, inputs):
        return self._pairs(what, outputs, inputs, gathering=True)

    def _allgather_base(self, output, input_, opts=None):
        return self._allgather_pairs("_allgather_base", self._gather_pairs("_allgather_base", [output], [input_]))

    def all_gather_single(self, output, input_, opts=None):
        return self._allgather_pairs("all_gather_single",
                                     self._gather_pairs("all_gather_single", [output], [input_]))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        what = "allgather_into_tensor_coalesced"
        return self._allgather_pairs(what, self._gather_pairs(what, outputs, inputs))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        what = "all_gather_single_coalesced"
        return self._allgather_pairs(what, self._gather_pairs(what, outputs, inputs))

    def _check_lists(self, what: str, output_lists, inputs) -> None:
        """List-form collectives: one list of ``size()`` tensors per input tensor."""
        if len(output_lists) != len(inputs):
            raise ValueError(f"{self._error_prefix(what)}: {len(output_lists)} output lists for "
                             f"{len(inputs)} inputs")
        for outs in output_lists:
            if len(outs) != self.size():
                raise ValueError(f"{self._error_prefix(what)}: an output list has {len(outs)} tensors, "
                                 f"the group has {self.size()} ranks")

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        # As gloo: output_lists[r][i] receives input i of rank r (one list per rank), the
        # transpose of allgather's layout (one list per input).
        what = self._error_prefix("allgather_coalesced")
        if len(output_lists) != self.size():
            raise ValueError(f"{what}: {len(output_lists)} output lists, expected one per rank ({self.size()})")
        for rank, outs in enumerate(output_lists):
            if len(outs) != len(input_tensors):
                raise ValueError(f"{what}: output list {rank} has {len(outs)} tensors for "
                                 f"{len(input_tensors)} inputs")
        per_input = [[output_lists[r][i] for r in range(self.size())] for i in range(len(input_tensors))]
        return self.allgather(per_input, input_tensors, opts)

    # -- reduce-scatter -------------------------------------------------------------------------
    def _reduce_scatter_as(self, what: str, outputs, inputs, opts):
        pairs = self._pairs(what, outputs, inputs, gathering=False)
        return self._reduce_scatter_pairs(what, pairs, reduce_op_of(opts))

    def _reduce_scatter_base(self, output, input_, opts=None):
        return self._reduce_scatter_as("_reduce_scatter_base", [output], [input_], opts)

    def reduce_scatter_single(self, output, input_, opts=None):
        return self._reduce_scatter_as("reduce_scatter_single", [output], [input_], opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._reduce_scatter_as("reduce_scatter_tensor_coalesced", outputs, inputs, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._reduce_scatter_as("reduce_scatter_single_coalesced", outputs, inputs, opts)

    # -- all-to-all -----------------------------------------------------------------------------
    def alltoall_base(self, output, input_, output_split_sizes, input_split_sizes, opts=None):
        return self._all_to_all_single("alltoall_base", output, input_, output_split_sizes, input_split_sizes)

    def all_to_all_single(self, output, input_, output_split_sizes, input_split_sizes, opts=None):
        return self._all_to_all_single("all_to_all_single", output, input_, output_split_sizes,
                                       input_split_sizes)

    def _check_alltoall_lists(self, output_tensors, input_tensors) -> None:
        n = self.size()
        if len(output_tensors) != n or len(input_tensors) != n:
            raise ValueError(f"{self._error_prefix('alltoall')}: need {n} input and {n} output tensors, got "
                             f"{len(input_tensors)} and {len(output_tensors)}")

    # -- point to point -------------------------------------------------------------------------
    # Tags are not matched (as with NCCL): sends and recvs between two ranks pair in issue order.
    def send(self, tensors, dstRank, tag=0):  # noqa: N803 - torch's keyword names
        return self._point_to_point("send", tensors, dstRank)

    def recv(self, tensors, srcRank, tag=0):  # noqa: N803
        return self._point_to_point("recv", tensors, srcRank)

    def _check_peer(self, kind: str, tensors, peer: int) -> None:
        if len(tensors) != 1:
            raise ValueError(f"{self._error_prefix(kind)}: expected one tensor, got {len(tensors)}")
        if not 0 <= peer < self.size() or peer == self.rank():
            raise ValueError(f"{self._error_prefix(kind)}: peer {peer} is not another rank of this "
                             f"{self.size()}-rank group (this is rank {self.rank()})")

    # -- groups from groups ---------------------------------------------------------------------
    def _next_split(self, ranks, group_name: Optional[str], group_desc: Optional[str]):
        """(sorted ranks, name, description) of the next ``split_group``; counts the split
        whether or not this rank is in it, as every member does."""
        ranks = sorted(int(r) for r in ranks)
        self._split_count += 1
        name = group_name or f"{self._group_name}_split{self._split_count}_{'_'.join(map(str, ranks))}"
        desc = group_desc or f"{self.comm_name}:split:{self._split_count}"
        return ranks, name, desc

    def comm_split_count(self) -> int:
        return self._split_count
