"""One module per collective; each exposes ``execute(dt, redop, count, root, ins, outs, scalars)``
working on uint8 numpy views of every rank's staged input and output, in rank order."""
from __future__ import annotations

from fakegpu import protocol as P

from . import allgather, allreduce, alltoall, broadcast, gather, reduce, reduce_scatter, scatter

EXECUTORS = {
    P.KIND_ALLREDUCE: allreduce.execute,
    P.KIND_BROADCAST: broadcast.execute,
    P.KIND_REDUCE: reduce.execute,
    P.KIND_ALLGATHER: allgather.execute,
    P.KIND_REDUCESCATTER: reduce_scatter.execute,
    P.KIND_ALLTOALL: alltoall.execute,
    P.KIND_GATHER: gather.execute,
    P.KIND_SCATTER: scatter.execute,
}
