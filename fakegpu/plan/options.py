"""Model options that change which kernels run, not the program: torch.compile and Float8.

Both rewrite a captured step's records (fakegpu.plan.compute.OpRecord), so one capture of the
eager program is costed either way.

* :func:`fuse_memory_chains` (``torch.compile``): Inductor fuses a run of memory-bound ops
  (elementwise, reductions, norms) between two matmuls or attentions into one kernel.  A
  maximal run of consecutive memory-bound records in the forward or backward becomes one
  record that launches once and moves only what crosses its boundary: the buffers it reads
  that it did not write itself, and the buffers it writes that a later op reads (saved
  activations, the next matmul's input).  Intermediates stay in registers.  The optimizer's
  ``_foreach`` kernels and FSDP2's copy-in/copy-out are outside compiled regions (TorchTitan
  compiles the model's blocks and the loss) and are left alone.
* :func:`async_tensor_parallel` (TorchTitan's ``enable_async_tensor_parallel``, torch's
  micro-pipelined TP): a sequence-parallel all-gather that feeds a matmul, and a reduce-scatter
  fed by one, run in ``tp`` chunks interleaved with the matmul's chunks.  The matmul starts once
  the first chunk has arrived and the rest of the transfer overlaps it; a reduce-scatter starts
  once the first chunk of the matmul is done.  Each pair then takes about
  ``first chunk + max(the rest of one, the other)`` instead of the sum.
* :func:`float8_matmuls` (TorchTitan's Float8 linears, dynamic tensorwise scaling): a bf16
  matmul of a linear layer runs on the FP8 tensor cores, after its two operands are cast to
  float8 (an extra memory-bound pass per operand: read bf16, write fp8; without compile also a
  separate amax pass).  Matmuls with a dimension in ``excluded_dims`` (TorchTitan leaves the
  output projection, the vocabulary dimension, in bf16) are unchanged.
* :func:`float8_tensor_parallel_gathers` (torchao's ``Float8ColwiseParallel`` /
  ``Float8RowwiseParallel`` / ``PrepareFloat8ModuleInput``, which TorchTitan applied with
  tensorwise Float8 until its TP plans became dtype-agnostic): a tensor-parallel all-gather
  that feeds a Float8 linear casts its shard to float8 first and moves 1-byte elements; the
  forward's activations and the backward's output gradients alike.  The cast is paid once, on
  the shard, instead of on the gathered tensor by each linear that reads it.
"""
from __future__ import annotations

import dataclasses
from typing import Collection, Sequence

from .compute import GROUPED_MATMULS, OpRecord

_FUSIBLE_PHASES = ("forward", "backward", "loss")
# float8_cast: the casts the Float8 options add are priced as compiled casts already
# (CAST_BYTES_COMPILED), not fused a second time
_NOT_COMPILED_PREFIXES = ("_foreach", "split_with_sizes_copy", "_chunk_cat", "chunk_cat", "all_gather_copy_in",
                          "copy_", "float8_cast")
# bytes per element moved to cast one bf16 operand to float8, over its bf16 bytes: a compiled
# cast fuses the amax into the producer and reads 2 B, writes 1 B (1.5x); eager adds the amax
# pass's read (2.5x).
CAST_BYTES_COMPILED = 1.5
CAST_BYTES_EAGER = 2.5
# Share of the memory-bound kernels' bandwidth a compiled (fused) kernel reaches: Inductor's
# generated reductions and multi-output kernels stream below the eager vectorized elementwise
# kernels' rate, and not every chain fuses whole. Fitted on TorchTitan's table 1 compile row
# (docs/planning.md); its held-out check is table 3.
FUSED_BANDWIDTH_SHARE = 0.6


def _fusible(record: OpRecord) -> bool:
    return (record.kind == "memory" and record.phase in _FUSIBLE_PHASES
            and not record.name.startswith(_NOT_COMPILED_PREFIXES))


def _passive(record: OpRecord) -> bool:
    return record.kind in ("view", "no_kernel")


def fuse_memory_chains(records: Sequence[OpRecord]) -> list[OpRecord]:
    """The records as torch.compile would run them (see the module docstring)."""
    records = list(records)
    last_read: dict = {}
    for index, record in enumerate(records):
        for key, _ in record.reads:
            last_read[key] = index
    out: list[OpRecord] = []
    i = 0
    while i < len(records):
        if not _fusible(records[i]):
            out.append(records[i])
            i += 1
            continue
        chain, passive, j = [], [], i
        while j < len(records) and (_fusible(records[j]) or _passive(records[j])) and \
                records[j].phase == records[i].phase and records[j].step == records[i].step:
            (chain if _fusible(records[j]) else passive).append(records[j])
            j += 1
        if len(chain) == 1:
            out.extend(records[i:j])
            i = j
            continue
        written: dict = {}
        reads: dict = {}
        for record in chain:
            for key, nbytes in record.reads:
                if key not in written:
                    reads.setdefault(key, nbytes)
            for key, nbytes in record.writes:
                written[key] = nbytes
        escaping = {key: n for key, n in written.items() if last_read.get(key, -1) >= j or key in reads}
        nbytes = int((sum(reads.values()) + sum(escaping.values())) / FUSED_BANDWIDTH_SHARE)
        first = chain[0]
        out.append(dataclasses.replace(
            first, op=f"fused({len(chain)})", name=f"fused_{first.name}", bytes=nbytes,
            reads=tuple(reads.items()), writes=tuple(written.items())))
        out.extend(passive)
        i = j
    return out


def _writes_keys(record: OpRecord) -> set:
    return {k for k, _ in record.writes}


def _reads_keys(record: OpRecord) -> set:
    return {k for k, _ in record.reads}


_LOOKAHEAD = 16     # records between a collective and the matmul it pairs with (views, waits, a cat)


def _tp_collective(record: OpRecord, groups: Collection[str]):
    """The collective ``record`` runs on one of the tensor-parallel ``groups`` (of two or more
    ranks), or None."""
    c = record.collective
    return c if c is not None and c.group in groups and len(c.ranks) >= 2 else None


def async_tensor_parallel(records: Sequence[OpRecord], tp_groups: Collection[str]) -> list[OpRecord]:
    """The records as micro-pipelined TP runs them (module docstring)."""
    import itertools

    fresh = itertools.count(-1, -1)       # synthetic buffer keys (real ones are addresses)
    out = list(records)
    groups = set(tp_groups)
    extra_reads: dict[int, set] = {}
    i = 0
    while i < len(out):
        r = out[i]
        c = _tp_collective(r, groups)
        if c is None:
            i += 1
            continue
        chunks = len(c.ranks)
        if c.kind == "AllGather":
            j = _consumer_matmul(out, i)
            if j is None:
                i += 1
                continue
            done = next(fresh)
            head = dataclasses.replace(r, collective=dataclasses.replace(c, count=max(1, c.count // chunks)))
            rest = dataclasses.replace(r, name=f"{r.name}_overlapped", writes=((done, 0),),
                                       collective=dataclasses.replace(c, count=c.count - max(1, c.count // chunks)))
            out[i:i + 1] = [head, rest]
            j += 1
            # whatever follows the matmul needs the whole gather
            k = j + 1
            while k < len(out) and out[k].kind in ("view", "no_kernel"):
                k += 1
            if k < len(out):
                extra_reads.setdefault(id(out[k]), set()).add(done)
            i += 2
        elif c.kind == "ReduceScatter":
            j = _producer_matmul(out, i)
            if j is None:
                i += 1
                continue
            mm = out[j]
            done = next(fresh)
            first = dataclasses.replace(mm, flops=mm.flops // chunks, bytes=mm.bytes // chunks,
                                        matmul=_chunk(mm.matmul, chunks))
            rest = dataclasses.replace(mm, name=f"{mm.name}_overlapped", flops=mm.flops - mm.flops // chunks,
                                       bytes=mm.bytes - mm.bytes // chunks, writes=((done, 0),),
                                       matmul=_chunk(mm.matmul, chunks, rest=True))
            # the first chunk stays where the matmul was; the rest runs after the reduce-scatter is
            # issued (the ops between, a wait or a cat, need only the first chunk's rows)
            out[j:j + 1] = [first]
            out.insert(i + 1, rest)
            # the reduce-scatter's readers also need the whole matmul
            k = i + 2
            while k < len(out) and out[k].kind in ("view", "no_kernel"):
                k += 1
            if k < len(out):
                extra_reads.setdefault(id(out[k]), set()).add(done)
            i += 2
        else:
            i += 1
    if extra_reads:
        out = [dataclasses.replace(r, reads=r.reads + tuple((k, 0) for k in sorted(extra_reads[id(r)])))
               if id(r) in extra_reads else r for r in out]
    return out


def _consumer_matmul(records, i: int):
    """Index of the matmul that consumes collective ``i``'s output, following it through the
    ops between (``wait_tensor``, the ``cat`` that puts a sequence-dimension gather in order),
    or None."""
    produced = _writes_keys(records[i])
    for j in range(i + 1, min(len(records), i + 1 + _LOOKAHEAD)):
        r = records[j]
        if not (_reads_keys(r) & produced):
            continue
        if r.kind == "matmul":
            return j
        produced |= _writes_keys(r)
    return None


def _producer_matmul(records, i: int):
    """Index of the matmul whose output collective ``i`` reduces (through the ops between), or
    None."""
    needed = _reads_keys(records[i])
    for j in range(i - 1, max(-1, i - 1 - _LOOKAHEAD), -1):
        r = records[j]
        if not (_writes_keys(r) & needed):
            continue
        if r.kind == "matmul":
            return j
        needed |= _reads_keys(r)
    return None


def _chunk(geometry, chunks: int, rest: bool = False):
    """A matmul's (batch, m, n, k) for its first of ``chunks`` row blocks, or for the rest."""
    if geometry is None:
        return None
    batch, m, n, k = geometry
    first = max(1, m // chunks)
    return (batch, m - first if rest else first, n, k)


def _becomes_float8(record: OpRecord, excluded: set) -> bool:
    """Whether ``float8_matmuls`` moves this matmul to the FP8 tensor cores."""
    # TorchTitan's Float8 linear converter leaves the experts' grouped matmuls in bf16
    return (record.kind == "matmul" and record.math == "bf16" and record.matmul is not None
            and record.name not in GROUPED_MATMULS and not excluded & set(record.matmul[1:]))


def _cast_factor(compiled: bool) -> float:
    return CAST_BYTES_COMPILED if compiled else CAST_BYTES_EAGER


def float8_tensor_parallel_gathers(records: Sequence[OpRecord], tp_groups: Collection[str],
                                   excluded_dims: Collection[int] = (), compiled: bool = True) -> list[OpRecord]:
    """The records with float8 all-gathers on the tensor-parallel groups (module docstring).
    The ops between such a gather and its linears (the wait, the ``cat`` that orders a
    sequence-dimension gather) move float8 too; the linears' records read the gathered
    buffers, which :func:`float8_matmuls` then does not cast again."""
    groups = set(tp_groups)
    excluded = set(int(d) for d in excluded_dims)
    out = list(records)
    i = 0
    while i < len(out):
        r = out[i]
        c = _tp_collective(r, groups)
        if c is None or c.kind != "AllGather" or c.elem_size != 2:
            i += 1
            continue
        j = _consumer_matmul(out, i)
        if j is None or not _becomes_float8(out[j], excluded):
            i += 1
            continue
        # the ops from the gather to its first linear carry the gathered buffer in float8
        fp8 = _writes_keys(r)
        for k in range(i + 1, j):
            between = out[k]
            if _reads_keys(between) & fp8:
                fp8 |= _writes_keys(between)
                if between.kind == "memory":
                    out[k] = dataclasses.replace(between, bytes=between.bytes // 2)
        cast = dataclasses.replace(r, op="float8_cast", name="float8_cast", kind="memory", collective=None,
                                   bytes=int(c.count * 2 * _cast_factor(compiled)), writes=())
        gathered = dataclasses.replace(r, collective=dataclasses.replace(c, elem_size=1),
                                       writes=tuple((key, n // 2) for key, n in r.writes),
                                       float8_buffers=tuple(sorted(fp8, key=str)))
        out[i:i + 1] = [cast, gathered]
        i += 2
    return out


def float8_matmuls(records: Sequence[OpRecord], excluded_dims: Collection[int] = (),
                   compiled: bool = True) -> list[OpRecord]:
    """The records with linear-layer matmuls on the FP8 tensor cores (module docstring)."""
    factor = _cast_factor(compiled)
    excluded = set(int(d) for d in excluded_dims)
    # buffers that arrive in float8 (float8_tensor_parallel_gathers): read as they are
    arrived = {key for r in records for key in r.float8_buffers}
    out: list[OpRecord] = []
    for record in records:
        if not _becomes_float8(record, excluded):
            out.append(record)
            continue
        operand_bytes = 0
        for shape in record.input_shapes[-2:] if record.name in ("addmm", "baddbmm") else record.input_shapes[:2]:
            elements = 1
            for d in shape:
                elements *= d
            operand_bytes += elements * 2
        already = min(operand_bytes, sum(n for key, n in record.reads if key in arrived)) if arrived else 0
        out.append(dataclasses.replace(
            record, op="float8_cast", name="float8_cast", kind="memory", flops=0,
            bytes=int((operand_bytes - already) * factor), math=None, matmul=None, writes=()))
        # the matmul itself reads the 1-byte float8 operands, not the bf16 ones
        out.append(dataclasses.replace(record, math="fp8", name=f"{record.name}_fp8",
                                       bytes=max(0, record.bytes - operand_bytes // 2)))
    return out


def compiled_activation_savings(records: Sequence[OpRecord]) -> int:
    """Bytes of saved activations a compiled forward does not keep, in the last step.

    Inductor's partitioner saves a fused region's inputs for the backward and recomputes its
    cheap pointwise intermediates there instead of keeping them (the eager program keeps
    every tensor autograd saved).  Counted: a buffer a fusible forward op writes whose readers
    in the backward are all memory-bound ops (a matmul's saved input is kept, and so is an
    activation checkpoint's input, read by its recomputation)."""
    if not records:
        return 0
    last = max(r.step for r in records)
    writer: dict = {}            # key -> (index of the forward op that last wrote it, bytes)
    readers: dict = {}           # (writer index, key) -> set of reader kinds in the backward
    for index, record in enumerate(r for r in records if r.step == last):
        if record.phase == "backward":
            for key, _ in record.reads:
                w = writer.get(key)
                if w is not None:
                    # a checkpoint's recomputation reads its saved input: kept, whatever fuses
                    readers.setdefault((w[0], key), set()).add("kept" if record.recomputed else record.kind)
        for key, nbytes in record.writes:
            if record.phase == "forward" and _fusible(record):
                writer[key] = (index, nbytes)
            else:
                writer.pop(key, None)       # written by something else: no longer that activation
    sizes = {}
    for index, record in enumerate(r for r in records if r.step == last):
        if record.phase == "forward" and _fusible(record):
            for key, nbytes in record.writes:
                sizes[(index, key)] = nbytes
    return sum(sizes.get(k, 0) for k, kinds in readers.items() if kinds and kinds <= {"memory", "view", "no_kernel"})
