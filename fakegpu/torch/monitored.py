"""``fakegpu.torch.monitored_barrier``: gloo's monitored barrier for fakegpu groups.

``torch.distributed.monitored_barrier`` refuses every backend not named gloo, so a fakegpu
job calls this instead (same arguments; on a gloo group it calls torch's own).  It does not
go through the communicator: every rank other than 0 checks in through the group's store,
rank 0 waits for each of them at most ``timeout`` and then releases them, so the error names
the ranks that never arrived, as gloo's does.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from .work import backend_error



def monitored_barrier(group=None, timeout: Optional[timedelta] = None,
                      wait_all_ranks: bool = False) -> None:
    from .process_group import FakeGpuProcessGroup

    from torch.distributed import distributed_c10d as c10d

    pg = group if group is not None else c10d._get_default_group()
    if not isinstance(pg, FakeGpuProcessGroup):
        dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)
        return
    timeout = timeout or pg.timeout
    pg._monitored_barriers = getattr(pg, "_monitored_barriers", 0) + 1
    key = f"fakegpu/monitored_barrier/{pg._monitored_barriers}"
    store, rank, ms = pg._store, pg.rank(), int(timeout.total_seconds() * 1000)
    if rank != 0:
        store.set(f"{key}/arrived/{rank}", "1")
        try:
            store.wait([f"{key}/released"], timeout)
        except Exception as exc:  # the store's own timeout error
            raise backend_error(f"[Rank {rank}]: fakegpu monitored_barrier: rank 0 did not "
                                f"release the barrier within {ms} ms ({exc})") from None
        return
    deadline = time.monotonic() + timeout.total_seconds()
    missing = []
    for peer in range(1, pg.size()):
        arrived = f"{key}/arrived/{peer}"
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                if not store.check([arrived]):
                    raise TimeoutError
            else:
                store.wait([arrived], timedelta(seconds=remaining))
        except Exception:
            missing.append(peer)
            if not wait_all_ranks:
                break
    if missing:
        who = (f"Rank {missing[0]}" if len(missing) == 1
               else "Ranks " + ", ".join(map(str, missing)))
        raise backend_error(f"[Rank 0]: {who} failed to pass monitoredBarrier in {ms} ms "
                            f"(fakegpu monitored_barrier on {pg.comm_name!r})")
    store.set(f"{key}/released", "1")
