"""Work objects and the per-group stream that runs the fakegpu process group's operations.

Every operation of a group is a :class:`Task` submitted to the group's :class:`Stream`: one
background thread per group runs the tasks in issue order (as an NCCL stream would), so
``async_op=True`` returns at once and DDP's buckets overlap backward.

Works that C++ can wait on.  A Work subclassed from ``dist.Work`` in Python loses its
overrides once its Python object is gone, and torch's C++ side keeps Works longer than that
(DDP's join all-reduce, functional collectives): the C++ base ``wait()`` then blocks forever.
So where torch has ``PythonCallbackWork`` (2.9 and later), :class:`FakeGpuWork` is one: its
C++ ``wait()`` calls :meth:`Op.wait` through a callback the C++ object itself owns (the
callback references the :class:`Op`, never the Work, so no reference cycle runs through
C++).  When the operation ends, the stream completes the C++ side too: the C++ future gets
the outputs (or the error) and the C++ Work is marked finished, so C++ ``isCompleted()``,
``getFuture()`` and ``wait()`` answer like a gloo Work's whoever holds it.

``PythonCallbackWork`` has no C++ ``result()``.  The one C++ reader of ``result()`` in
torch is DDP's reducer, for the join all-reduce it is handed when
``join(divide_by_initial_world_size=False)``; that Work (only) is torch's future-wrapping
Work (``_create_work_from_future``), whose ``result()`` works (see
``FakeGpuProcessGroup.allreduce``).

Timeouts: ``wait(timeout)`` waits at most ``timeout``, else the group's timeout.  A task
that runs longer than its group's timeout is failed by a watchdog (its Work and future raise
a "Timed out" error) and the group is marked broken: later operations fail at once, as after
an NCCL watchdog abort.
"""
from __future__ import annotations

import atexit
import collections
import os
import threading
import time
import weakref
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

try:  # torch >= 2.9
    from torch._C._distributed_c10d import PythonCallbackWork as _WorkBase

    _CPP_WAIT = True
except ImportError:  # older torch: a plain Python Work (C++ callers cannot wait on it)
    _WorkBase = dist.Work
    _CPP_WAIT = False

from torch._C._distributed_c10d import _create_work_from_future  # noqa: E402

_BackendError = getattr(dist, "DistBackendError", RuntimeError)


def backend_error(message: str) -> BaseException:
    return _BackendError(message)


def call_error(what: str, group: str, exc: BaseException) -> BaseException:
    """The error an operation of process group ``group`` raises when its NCCL call failed."""
    return backend_error(f"fakegpu: {what} on process group {group!r} failed: {exc}")


def _cpp_error(message: str):
    """What the C++ wait callback returns for a failed op.

    A Python exception raised through ``PythonCallbackWork``'s callback is kept as a pybind
    ``error_already_set`` in the C++ Work and future, and pybind aborts the process when that
    one object is rethrown a second time (two waits on a failed future).  An object that
    cannot be cast to bool makes the callback fail with a plain C++ cast error instead, which
    can be rethrown any number of times; its message names the object's type, so the type's
    name is the error text."""
    return type(message, (), {"__module__": "fakegpu"})()


class Op:
    """The state of one submitted operation, shared by its Work, its C++ callback and the
    stream.  ``flush`` (p2p only) issues the queued batch the operation belongs to."""

    __slots__ = ("what", "stream", "outputs", "done", "error", "_future", "source_rank",
                 "flush", "_claimed", "_work", "_cpp_future", "_completion", "__weakref__")

    def __init__(self, what: str, stream: "Stream", outputs: list[torch.Tensor],
                 flush: Optional[Callable[[], None]] = None, source_rank: int = -1):
        self.what = what
        self.stream = stream
        self.outputs = outputs
        self.done = False
        self._claimed = False
        self.error: Optional[BaseException] = None
        self.source_rank = source_rank
        self.flush = flush
        # The future Python callers get (made on first use, most ops never need one): a then()
        # of _completion whose callback raises the op's error, which makes it a real error of
        # the future (Future.set_exception would store the exception as a value, and C++
        # waiters would not see it).
        self._completion: Optional[torch.futures.Future] = None
        self._future: Optional[torch.futures.Future] = None
        self._work: Optional["FakeGpuWork"] = None  # held until finished (C++ completion)
        self._cpp_future = None

    def work(self) -> "FakeGpuWork":
        work = FakeGpuWork(self)
        if _CPP_WAIT:
            self._work = work
            self._cpp_future = _WorkBase.get_future(work)
        return work

    def future_work(self) -> dist.Work:
        """torch's C++ future-wrapping Work around :attr:`future` (C++ ``result()`` works)."""
        return _create_work_from_future(self.future)

    @property
    def future(self) -> torch.futures.Future:
        with self.stream.cond:
            if self._future is None:
                self._completion = torch.futures.Future()
                self._future = self._completion.then(self._outcome)
                complete_now = self.done  # else finish() completes it
            else:
                complete_now = False
        if complete_now:
            self._completion.set_result(None)
        return self._future

    def _outcome(self, _completed=None) -> list[torch.Tensor]:
        if self.error is not None:
            raise self.error
        return self.outputs

    def finish(self, error: Optional[BaseException]) -> None:
        """Record the outcome once (a later call, e.g. a call returning after its watchdog
        timeout, is ignored), then complete the futures and the Work's C++ side."""
        with self.stream.cond:
            if self._claimed:
                return
            self._claimed = True
        if error is None and self._cpp_future is not None:
            # Before ``done`` is visible: a C++ wait() returning first would complete the
            # C++ future with an empty list.
            self._cpp_future.set_result(self.outputs)
        with self.stream.cond:
            self.done = True
            self.error = error
            self.flush = None
            completion = self._completion  # one made later is completed by its maker
            self.stream.cond.notify_all()
        if completion is not None:
            completion.set_result(None)
        work, self._work = self._work, None  # breaks the C++ -> callback -> op -> work cycle
        if work is not None:
            try:
                # PythonCallbackWork::wait runs cpp_wait (which answers at once) and marks the
                # C++ Work finished, and its future failed on an error.
                _WorkBase.wait(work)
            except RuntimeError:
                pass  # the op's own error, kept in self.error

    def run_flush(self) -> None:
        flush = self.flush
        if flush is not None and not self.done:
            flush()

    def _seconds(self, timeout) -> float:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else (timeout or 0)
        return seconds if seconds > 0 else self.stream.timeout_s

    def _timed_out(self, seconds: float) -> BaseException:
        return backend_error(f"fakegpu: {self.what} on process group {self.stream.name!r}: "
                             f"Timed out waiting {seconds * 1000:.0f} ms for the operation "
                             "to complete")

    def wait(self, timeout=None) -> bool:
        """``Work.wait`` for Python callers: raise the operation's error, or a timeout after
        ``timeout`` (a timedelta or seconds; zero or None means the group's timeout)."""
        self.run_flush()
        seconds = self._seconds(timeout)
        if not self.stream.wait_for(self, seconds):
            raise self._timed_out(seconds)
        if self.error is not None:
            raise self.error
        return True

    def cpp_wait(self, timeout):
        """The callback of the C++ ``PythonCallbackWork::wait`` (see :func:`_cpp_error`)."""
        try:
            return self.wait(timeout)
        except Exception as exc:  # noqa: BLE001 - handed to C++ as its error
            return _cpp_error(f"{type(exc).__name__}: {exc}")


class Task:
    """What a stream runs: ``body()``, then every op of ``ops`` finishes with its outcome."""

    __slots__ = ("what", "body", "ops")

    def __init__(self, what: str, body: Callable[[], None], ops: list[Op]):
        self.what = what
        self.body = body
        self.ops = ops


class Stream:
    """One background thread running a group's tasks in issue order.

    A waiter runs queued tasks itself (in order, one at a time, as the thread would) when
    the thread has not started them yet: from inside the stream's own thread (a future
    callback waiting on another collective of the same group) that avoids a deadlock, and
    for a synchronous call it saves the hand-over to the thread and back (two wake-ups, which
    on a busy machine cost more than the call).  Other waiters do that only where the group's
    timeout is not shorter than the coordinator's (``FAKEGPU_COORDINATOR_TIMEOUT_MS``, 10 min
    by default): a waiter inside a call can be released by nothing but the coordinator, so a
    shorter group timeout is kept by waiting for the thread instead.
    """

    def __init__(self, name: str, timeout_s: float):
        self.name = name
        self.timeout_s = timeout_s
        self.cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[Task] = collections.deque()
        self._busy = False
        self._drainers = 0  # threads in drain(), woken when the stream goes idle
        self._current: Optional[Task] = None
        self._started_at = 0.0
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self.broken: Optional[BaseException] = None
        self.waiters_run_tasks = timeout_s >= _coordinator_timeout_s()
        _watchdog.watch(self)

    def submit(self, task: Task) -> None:
        with self.cond:
            if self.broken is None and not self._closed:
                self._queue.append(task)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, daemon=True,
                                                    name=f"fakegpu-stream-{self.name}")
                    self._thread.start()
                self.cond.notify_all()
                return
            reason = self.broken or backend_error(
                f"fakegpu: process group {self.name!r} was shut down")
        error = backend_error(f"fakegpu: {task.what} on process group {self.name!r} not run: "
                              f"the group is unusable ({reason})")
        for op in task.ops:
            op.finish(error)

    def run_now(self, what: str, call: Callable, *args) -> bool:
        """Run ``call(*args)`` on the caller's thread, as the stream's next task, when nothing is
        queued or running and waiters may run tasks (see the class docstring); False (nothing
        run) otherwise.  The watchdog watches it as it watches the thread's tasks: a call that
        overran the group's timeout raises the timeout even if it then returned."""
        task = Task(what, call, [])
        with self.cond:
            if (not self.waiters_run_tasks or self._busy or self._queue
                    or self.broken is not None or self._closed):
                return False
            self._busy = True
            self._current = task
            self._started_at = time.monotonic()
        try:
            call(*args)
        finally:
            with self.cond:
                self._busy = False
                self._current = None
                broken = self.broken  # set meanwhile only by the watchdog, for this call
                # Wake only who needs it: the thread or a waiter for a task queued meanwhile,
                # or a drain.  Waking the idle thread for nothing costs a GIL hand-over and
                # two context switches on every call.
                if self._queue or self._drainers:
                    self.cond.notify_all()
        if broken is not None:
            raise broken
        return True

    def _take(self) -> Optional[Task]:
        # called with the lock held
        if self._busy or not self._queue:
            return None
        task = self._queue.popleft()
        self._busy = True
        self._current = task
        self._started_at = time.monotonic()
        return task

    def _execute(self, task: Task) -> None:
        error: Optional[BaseException] = None
        try:
            task.body()
        except BaseException as exc:  # every op must end, whatever went wrong
            error = exc
        for op in task.ops:
            op.finish(error)
        with self.cond:
            self._busy = False
            self._current = None
            self.cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cond:
                task = self._take()
                while task is None:
                    if self._closed and not self._queue:
                        return
                    self.cond.wait()
                    task = self._take()
            self._execute(task)

    def wait_for(self, op: Op, seconds: float) -> bool:
        """Wait until ``op`` finished; False after ``seconds``."""
        deadline = time.monotonic() + seconds
        runs_tasks = self.waiters_run_tasks or threading.current_thread() is self._thread
        while True:
            with self.cond:
                if op.done:
                    return True
                task = self._take() if runs_tasks else None
                if task is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    self.cond.wait(remaining)
                    continue
            self._execute(task)

    def drain(self, seconds: float) -> bool:
        """Wait until every submitted task ran (False after ``seconds``)."""
        deadline = time.monotonic() + seconds
        with self.cond:
            self._drainers += 1
            try:
                while self._queue or self._busy:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self.broken is not None:
                        return False
                    self.cond.wait(remaining)
            finally:
                self._drainers -= 1
        return True

    def close(self) -> None:
        with self.cond:
            self._closed = True
            self.cond.notify_all()

    def join(self, seconds: float) -> None:
        """Close, and wait up to ``seconds`` for the thread to finish what was queued."""
        self.close()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(seconds)

    def check_timeout(self, now: float) -> None:
        """Watchdog: fail the running task (and the group) once it overran the timeout."""
        with self.cond:
            task = self._current
            if task is None or now - self._started_at <= self.timeout_s or self.broken:
                return
            error = backend_error(
                f"fakegpu: {task.what} on process group {self.name!r}: Timed out after "
                f"{self.timeout_s * 1000:.0f} ms (the group's timeout); the group is unusable "
                "from now on")
            self.broken = error
            queued = list(self._queue)
            self._queue.clear()
        for op in task.ops:
            op.finish(error)
        for other in queued:
            for op in other.ops:
                op.finish(backend_error(f"fakegpu: {other.what} on process group "
                                        f"{self.name!r} not run: {error}"))


def _coordinator_timeout_s() -> float:
    try:
        return int(os.environ.get("FAKEGPU_COORDINATOR_TIMEOUT_MS", "")) / 1000
    except ValueError:
        return 600.0  # the coordinator's default (docs/usage.md)


class _Watchdog:
    """One daemon thread per process checking every stream's running task against its
    group's timeout (started with the first stream)."""

    PERIOD_S = 0.1

    def __init__(self):
        self._streams: "weakref.WeakSet[Stream]" = weakref.WeakSet()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def watch(self, stream: Stream) -> None:
        with self._lock:
            self._streams.add(stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="fakegpu-watchdog")
                self._thread.start()
                atexit.register(self.shutdown)

    def shutdown(self, seconds: float = 5.0) -> None:
        """At interpreter exit: end every stream thread and this one while Python still runs.
        A daemon thread still inside torch's C++ (a future's callbacks, a GIL hand-over) when the
        interpreter finalizes is unwound by pthread_exit through noexcept frames, which aborts
        the process ("terminate called without an active exception")."""
        self._stop.set()
        with self._lock:
            streams = list(self._streams)
        deadline = time.monotonic() + seconds
        for stream in streams:
            stream.join(max(0.0, deadline - time.monotonic()))
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))

    def _loop(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            now = time.monotonic()
            with self._lock:
                streams = list(self._streams)
            for stream in streams:
                stream.check_timeout(now)


_watchdog = _Watchdog()


def finished_work(outputs: list[torch.Tensor]) -> dist.Work:
    """The Work of an operation that already ran (:meth:`Stream.run_now`): torch's
    future-wrapping Work around a completed future, which C++ and Python callers wait on,
    poll and read ``result()`` / ``get_future()`` of as they do a gloo Work's."""
    future = torch.futures.Future()
    future.set_result(outputs)
    return _create_work_from_future(future)


class FakeGpuWork(_WorkBase):
    """The Work of one fakegpu operation (see the module docstring)."""

    def __init__(self, op: Op):
        if _CPP_WAIT:
            super().__init__(op.cpp_wait)  # the C++ object owns this callback, not the Work
        else:
            super().__init__()
        self._op = op

    # -- dist.Work API for Python callers ----------------------------------------------------
    def wait(self, timeout=None) -> bool:
        return self._op.wait(timeout)

    def get_future(self) -> torch.futures.Future:
        self._op.run_flush()
        return self._op.future

    def is_completed(self) -> bool:
        # Polling code spins on this; issuing a queued p2p batch here keeps it from spinning forever.
        self._op.run_flush()
        return self._op.done

    def is_success(self) -> bool:
        self._op.run_flush()
        return self._op.done and self._op.error is None

    def exception(self):
        self._op.run_flush()
        return self._op.error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._op.outputs

    def source_rank(self) -> int:
        return self._op.source_rank

    def _source_rank(self) -> int:
        return self._op.source_rank

    def synchronize(self) -> None:
        self.wait()
