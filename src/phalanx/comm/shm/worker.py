"""One worker thread per group runs its collectives in issue order; ``wait()`` may run them.

Every call returns a :class:`ShmWork` at once; its future completes when the collective has
run. The worker thread runs queued calls in order, so an ``async_op=True`` call (and DDP's
bucket all-reduces) overlap with the caller. A thread that waits for a call that has not run
yet runs it itself, and every call queued before it, in order: a synchronous collective then
costs no hand-over between threads (that is most of the latency of a small message), and a
wait on the worker thread itself (a future callback that waits) cannot deadlock. Whichever
thread runs a call holds ``_running``, so calls never overlap and never run out of order.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.futures import Future

__all__ = ["Executor", "ShmWork"]

# A work made in Python and handed to C++ by Python code (torch DDP's join passes the work of
# its forward all-reduce to the reducer, which calls getFuture() in backward) has no Python
# owner left, and torch's Work trampoline then loses the Python methods (getFuture "not
# implemented", wait() forever). Each group keeps its latest calls alive for that reason.
KEEP_RECENT = 256


class ShmWork(dist._Work):  # torch's Work trampoline (PyWork)
    """A collective call: ``wait()`` raises its error, ``get_future()`` completes with it.

    A queued call gets its future when it is made (another thread may complete it while the
    caller holds it). A call that ran before it was returned (a synchronous one) makes its
    future only if asked: a ``Future`` costs microseconds, and ``dist.all_reduce`` never asks.
    """

    def __init__(self, executor: Executor, run: Callable[[], None], value: object) -> None:
        super().__init__()
        self._executor = executor
        self._run = run
        self._value = value
        self._finished = False
        self._error: BaseException | None = None
        self._future: Future[object] | None = None

    @classmethod
    def queued(cls, executor: Executor, run: Callable[[], None], value: object) -> ShmWork:
        work = cls(executor, run, value)
        work._future = Future()
        return work

    def execute(self) -> None:
        run, self._run = self._run, _done
        try:
            run()
        except BaseException as exc:  # the waiter re-raises it
            self._error = exc
        self._finished = True
        future = self._future
        if future is not None:
            if self._error is not None:
                future.set_exception(self._error)
            else:
                future.set_result(self._value)

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._finished:
            self._executor.run_until(self)
        if self._future is not None:
            self._future.wait()  # raises the collective's error; waits for its callbacks
        elif self._error is not None:
            raise self._error
        return True

    def get_future(self) -> Future[object]:
        if self._future is None:  # ran synchronously, so finished
            with _LAZY:
                if self._future is None:
                    future: Future[object] = Future()
                    if self._error is not None:
                        future.set_exception(self._error)
                    else:
                        future.set_result(self._value)
                    self._future = future
        return self._future

    def is_completed(self) -> bool:
        return self._finished

    def is_success(self) -> bool:
        return self._finished and self._error is None

    def exception(self) -> BaseException | None:
        return self._error if self._finished else None

    def result(self) -> list[torch.Tensor]:
        return self._value if isinstance(self._value, list) else []

    def synchronize(self) -> None:
        self.wait()


_LAZY = threading.Lock()


def _done() -> None:
    raise AssertionError("a ShmWork ran twice")


class Executor:
    """The ordered queue of a group's calls and the worker thread that drains it."""

    def __init__(self, name: str) -> None:
        self._queue: deque[ShmWork] = deque()
        self._recent: deque[ShmWork] = deque(maxlen=KEEP_RECENT)
        self._cond = threading.Condition()
        self._running = threading.RLock()  # a callback of a finished call may wait: re-enter
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, run: Callable[[], None], value: object, wake: bool) -> ShmWork:
        """Queue ``run``, or run it now when it is synchronous (``wake=False``) and nothing is
        queued or running before it; else a sync call is left to the caller's ``wait()``."""
        if not wake and not self._queue and not self._stopped and self._running.acquire(False):
            try:
                if not self._queue:
                    work = ShmWork(self, run, value)
                    self._recent.append(work)
                    work.execute()
                    return work
            finally:
                self._running.release()
        work = ShmWork.queued(self, run, value)
        self._recent.append(work)
        with self._cond:
            if self._stopped:
                raise RuntimeError("the shm process group was shut down")
            self._queue.append(work)
            if wake:
                self._cond.notify()
        return work

    def _pop(self) -> ShmWork | None:
        with self._cond:
            return self._queue.popleft() if self._queue else None

    def run_until(self, work: ShmWork) -> None:
        """Run queued calls in order on this thread until ``work`` has run."""
        with self._running:
            while not work._finished:
                head = self._pop()
                if head is None:
                    break  # it ran on the worker while we waited for the lock
                head.execute()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopped:
                    self._cond.wait(timeout=0.1)
                if self._stopped and not self._queue:
                    return
            with self._running:
                head = self._pop()
                if head is not None:
                    head.execute()

    def stop(self) -> None:
        """Finish what is queued, then end the worker thread."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
