"""``dist.Work`` objects returned by the fakegpu process group.

Collectives run to completion inside the call (the shim completes an NCCL call before it
returns), so most Work objects are born finished.  Point-to-point operations are the
exception: they are queued and issued together as one NCCL group when somebody first needs
a result (see ``FakeGpuProcessGroup._flush_p2p``), so a Work may carry a ``resolve``
callback that runs that flush.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist


class FakeGpuWork(dist.Work):
    def __init__(self, outputs: list[torch.Tensor],
                 resolve: Optional[Callable[[], None]] = None,
                 error: Optional[BaseException] = None, source_rank: int = -1):
        super().__init__()
        self._outputs = list(outputs)
        self._resolve = resolve
        self._error = error
        self._done = resolve is None
        self._source_rank = source_rank

    # Called by the process group when a queued operation finishes (or fails).
    def _finish(self, error: Optional[BaseException] = None) -> None:
        self._error = error
        self._done = True
        self._resolve = None

    def _complete(self) -> None:
        if not self._done and self._resolve is not None:
            self._resolve()  # the flush calls _finish on every queued Work, this one included

    # -- dist.Work API ----------------------------------------------------------------------
    def wait(self, timeout=None) -> bool:  # noqa: ARG002 - the call already ran or runs now
        self._complete()
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        # DDP chains its bucket callbacks on this future and never calls wait().
        self._complete()
        future: torch.futures.Future = torch.futures.Future()
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self._outputs)
        return future

    def is_completed(self) -> bool:
        # Polling code spins on this; running the queued group here keeps it from spinning forever.
        self._complete()
        return self._done

    def is_success(self) -> bool:
        self._complete()
        return self._error is None

    def exception(self):
        self._complete()
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def source_rank(self) -> int:
        return self._source_rank

    def synchronize(self) -> None:
        self.wait()


def done(outputs: list[torch.Tensor]) -> FakeGpuWork:
    return FakeGpuWork(outputs)
