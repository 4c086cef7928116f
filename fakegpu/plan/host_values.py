"""Values a program reads back to the host from fake tensors, under a balanced router.

A fake tensor has a shape and no values, so a program that copies a GPU value to the host
(``tensor.tolist()``, ``.item()``) cannot run on fake tensors.  Mixture-of-experts layers with
expert parallelism do it at every layer: the all-to-all that sends tokens to their experts takes
its split sizes from the per-expert token counts, which the router's top-k decides.  A planner
needs those counts to be what a trained, balanced router gives, not any particular data's.

:class:`HostValues` keeps a real value (a *shadow*) beside the small integer tensors whose
values follow from the program's structure alone, and computes the shadow of each op whose
tensor inputs all have one by running the op on the shadows:

* sources: constants a factory op makes (``zeros``, ``arange``, ``full``, ... and their
  ``_like`` / ``new_`` forms), and the indices of ``topk``, which a balanced router spreads
  evenly: row r picks ``(r * k + j) mod n`` for j < k (distinct per row when k <= n; every
  index equally often over the rows);
* collectives, assuming every rank of the group holds the same values (the planned rank stands
  for all of them, as everywhere in the planner): an all-to-all delivers this rank's chunk
  from every peer, an all-gather repeats the tensor, a sum all-reduce or reduce-scatter
  multiplies it by the group size;
* ``_local_scalar_dense`` (what ``.item()`` and ``.tolist()`` run) answers a shadowed tensor's
  value; on a tensor without one it still raises torch's data-dependent error, which the
  capture turns into a message naming the op.

Only integer and boolean tensors of at most ``MAX_ELEMENTS`` get shadows (and floating ones
computed from them, as a count turned into a float): activations never do, so this costs
nothing on the models' tensors.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

MAX_ELEMENTS = 1 << 25

aten = torch.ops.aten

_FACTORIES = {"zeros", "ones", "full", "arange", "scalar_tensor", "zeros_like", "ones_like", "full_like",
              "new_zeros", "new_ones", "new_full", "linspace"}
_LIKE = {"zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full"}
_SCALAR_READS = {"_local_scalar_dense", "item"}
_SOURCES = _FACTORIES | {"topk"}
_SUM_REDUCTIONS = {"sum", "avg", "premul_sum"}


def _name(func) -> str:
    return getattr(getattr(func, "overloadpacket", func), "__name__", str(func))


def _small(t: torch.Tensor) -> bool:
    return t.numel() <= MAX_ELEMENTS


def _on_cpu(value):
    if isinstance(value, torch.device):
        return torch.device("cpu")
    return value


def _group_of(name):
    import torch.distributed.distributed_c10d as c10d

    return c10d._resolve_process_group(name)


class HostValues:
    """Shadows of the fake tensors whose values are known (module docstring)."""

    def __init__(self):
        self._shadow = WeakIdKeyDictionary()

    def __contains__(self, tensor) -> bool:
        return tensor in self._shadow

    def value(self, tensor) -> Optional[torch.Tensor]:
        return self._shadow.get(tensor) if isinstance(tensor, torch.Tensor) else None

    def scalar(self, func, args):
        """The host value ``func`` (``_local_scalar_dense`` / ``item``) reads, or None."""
        if _name(func) not in _SCALAR_READS or not args:
            return None
        shadow = self.value(args[0])
        if shadow is None:
            return None
        with _disable_current_modes():
            return shadow.item()

    def after(self, func, args, kwargs, out) -> None:
        """Give ``out`` (and a tensor ``func`` wrote in place) the shadow ``func`` computes on
        its inputs' shadows, where it has one; forget a written tensor's shadow otherwise."""
        name = _name(func)
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        shadowed = any(t in self._shadow for t in tensors)
        if not shadowed and name not in _SOURCES:
            return                    # the common case: an op on activations
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        written = _written(func, args, kwargs)
        with _disable_current_modes():         # real ops on the shadows, unrecorded
            self._update(func, name, args, kwargs, tensors, outs, written)

    def _update(self, func, name, args, kwargs, tensors, outs, written) -> None:
        try:
            result = self._compute(func, name, args, kwargs, tensors, outs)
        except Exception:       # noqa: BLE001 - an op the shadows cannot run: no value known
            result = None
        if result is None:
            for t in written:
                self._shadow.pop(t, None)
            return
        # one real value (or None: unknown) per tensor output
        results = [result] if isinstance(result, torch.Tensor) else \
            [r for r in result if r is None or isinstance(r, torch.Tensor)] if isinstance(result, (tuple, list)) else []
        if len(results) != len(outs):
            return
        for fake, real in zip(outs, results):
            if real is not None and tuple(fake.shape) == tuple(real.shape):
                self._shadow[fake] = real.to(fake.dtype)
            else:
                self._shadow.pop(fake, None)
        for t in written:           # an in-place op's result is its first written tensor
            if t not in outs and results[0] is not None and tuple(t.shape) == tuple(results[0].shape):
                self._shadow[t] = results[0].to(t.dtype)

    # the real computation on shadows, or None when the op's result is not known
    def _compute(self, func, name, args, kwargs, tensors, outs):
        if not outs or not all(_small(t) for t in outs):
            return None
        if name == "topk":
            return self._balanced_topk(args, kwargs, outs)
        if name in _FACTORIES:
            if not all(t.dtype in (torch.bool,) or not t.is_floating_point() for t in outs):
                return None      # float constants feed activations, not counts
            if name in _LIKE:
                base = args[0]
                args = (torch.empty(tuple(base.shape), dtype=base.dtype),) + tuple(args[1:])
            elif tensors:
                return None
            return func(*tree_map(_on_cpu, args), **tree_map(_on_cpu, kwargs))
        if getattr(func, "namespace", None) in ("_c10d_functional", "c10d_functional"):
            return self._collective(name, args, kwargs)
        if not tensors or any(t not in self._shadow for t in tensors):
            return None
        real = tree_map(lambda v: self._shadow[v] if isinstance(v, torch.Tensor) else _on_cpu(v), (args, kwargs))
        if name in ("_to_copy", "to", "copy"):
            real[1].pop("non_blocking", None)
        return func(*real[0], **real[1])

    def _balanced_topk(self, args, kwargs, outs):
        indices = outs[1]
        x = args[0]
        k = int(args[1] if len(args) > 1 else kwargs["k"])
        dim = int(args[2] if len(args) > 2 else kwargs.get("dim", -1)) % max(1, x.dim())
        n = int(x.shape[dim])
        shape = list(indices.shape)
        rows = indices.numel() // max(1, k)
        picks = (torch.arange(rows).unsqueeze(1) * k + torch.arange(k).unsqueeze(0)) % max(1, n)
        moved = shape[:dim] + shape[dim + 1:] + [k]
        picks = picks.reshape(moved).movedim(-1, dim).contiguous()
        return [None, picks]        # the values are the scores' (unknown): only the indices

    def _collective(self, name, args, kwargs):
        if name == "wait_tensor":
            return self.value(args[0])
        x = self.value(args[0])
        if x is None:
            return None
        group = _group_of(args[-1] if isinstance(args[-1], str) else kwargs.get("group_name"))
        size, rank = group.size(), group.rank()
        if name == "all_to_all_single":
            split = args[2] if len(args) > 2 and args[2] is not None else [x.shape[0] // size] * size
            chunk = torch.split(x, list(split))[rank]
            return torch.cat([chunk] * size)
        if name == "all_gather_into_tensor":
            return torch.cat([x] * size)
        if name in ("all_reduce", "reduce_scatter_tensor"):
            op = str(args[1]).lower()
            scaled = x * size if op in _SUM_REDUCTIONS and op != "avg" else x
            return scaled if name == "all_reduce" else torch.chunk(scaled, size)[rank]
        if name == "broadcast":
            return x
        return None


def _written(func, args, kwargs) -> list:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(value, torch.Tensor):
                out.append(value)
    return out
