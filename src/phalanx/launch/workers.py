"""Start the workers of one node, prefix their output with ``[rank N]``, watch them, stop them.

Each worker runs in its own process group (so its own children are stopped with it) and dies
with the agent: ``PR_SET_PDEATHSIG`` = SIGKILL is set between fork and exec. That signal is tied
to the thread that forked, so workers are started from the agent's main thread only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO

__all__ = ["Worker", "WorkerGroup", "WorkerSpec", "die_with_parent", "worker_command"]

_PR_SET_PDEATHSIG = 1
STDERR_TAIL_LINES = 50


def worker_command(script: str, args: Sequence[str], module: bool, no_python: bool) -> list[str]:
    """Command line of a worker: ``python -u script``, ``python -u -m module`` or the executable."""
    if no_python:
        return [script, *args]
    if module:
        return [sys.executable, "-u", "-m", script, *args]
    return [sys.executable, "-u", script, *args]


def die_with_parent(parent_pid: int | None = None) -> Callable[[], None]:
    """A function that, run in a child, makes it receive SIGKILL when its parent dies.

    Use it as ``preexec_fn`` (``parent_pid`` defaults to this process), or call it first thing
    in a child started otherwise, passing the parent's pid.
    """
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved before fork, not in the child
    parent = os.getpid() if parent_pid is None else parent_pid

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


@dataclass(frozen=True)
class WorkerSpec:
    """What to start for one worker."""

    rank: int
    """Global rank (used for the ``[rank N]`` prefix)."""
    local_rank: int
    """Rank on this node."""
    command: list[str]
    """argv of the worker process."""
    env: dict[str, str]
    """Its complete environment."""


@dataclass
class Worker:
    """One running (or finished) worker process and what the agent knows about it."""

    spec: WorkerSpec
    proc: subprocess.Popen[bytes]
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_TAIL_LINES))
    returncode: int | None = None
    exited_at: float | None = None
    threads: list[threading.Thread] = field(default_factory=list)

    @property
    def pid(self) -> int:
        """Process id (also the id of the worker's process group)."""
        return self.proc.pid

    def _wait(self) -> None:
        code = self.proc.wait()
        self.exited_at = time.monotonic()
        self.returncode = code


_OUT_LOCK = threading.Lock()


def _writer(stream: IO[str]) -> Callable[[bytes], None]:
    """Write bytes to a text stream's binary buffer (or decoded, if it has none), flushed."""
    buffer = getattr(stream, "buffer", None)

    def write(data: bytes) -> None:
        with _OUT_LOCK, contextlib.suppress(OSError, ValueError):
            if buffer is not None:
                buffer.write(data)
                buffer.flush()
            else:
                stream.write(data.decode("utf-8", "replace"))
                stream.flush()

    return write


def _pump(
    src: IO[bytes], write: Callable[[bytes], None], prefix: bytes, tail: deque[str] | None
) -> None:
    """Copy ``src`` line by line through ``write``, each line prefixed."""
    for line in iter(src.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        if tail is not None:
            tail.append(line.decode("utf-8", "replace"))
        write(prefix + line)
    src.close()


def _start(spec: WorkerSpec) -> Worker:
    proc = subprocess.Popen(
        spec.command,
        env=spec.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=die_with_parent(),
    )
    worker = Worker(spec, proc)
    prefix = f"[rank {spec.rank}] ".encode()
    assert proc.stdout is not None and proc.stderr is not None
    pumps = [
        (proc.stdout, _writer(sys.stdout), None),
        (proc.stderr, _writer(sys.stderr), worker.stderr_tail),
    ]
    for src, dst, tail in pumps:
        worker.threads.append(threading.Thread(target=_pump, args=(src, dst, prefix, tail)))
    worker.threads.append(threading.Thread(target=worker._wait))
    for thread in worker.threads:
        thread.daemon = True
        thread.start()
    return worker


def _killpg(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


class WorkerGroup:
    """The workers of this node for one generation."""

    def __init__(self, specs: Sequence[WorkerSpec]) -> None:
        assert threading.current_thread() is threading.main_thread(), "see PR_SET_PDEATHSIG"
        self.workers: list[Worker] = []
        try:
            for spec in specs:
                self.workers.append(_start(spec))
        except BaseException:
            self.stop(grace=0.0)
            raise

    def first_failure(self) -> Worker | None:
        """The worker that exited non-zero (or by a signal) first, if any."""
        failed = [w for w in self.workers if w.returncode not in (None, 0)]
        return min(failed, key=lambda w: w.exited_at or 0.0, default=None)

    def all_succeeded(self) -> bool:
        """True when every worker has exited with status 0."""
        return all(w.returncode == 0 for w in self.workers)

    def running(self) -> list[Worker]:
        """Workers that have not exited yet."""
        return [w for w in self.workers if w.returncode is None]

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the process group of every worker still running."""
        for worker in self.running():
            _killpg(worker.pid, signum)

    def stop(
        self,
        grace: float = 3.0,
        signum: int = signal.SIGTERM,
        hurry: Callable[[], bool] = lambda: False,
    ) -> None:
        """Send ``signum`` to every group, wait up to ``grace`` s (or until ``hurry()``), SIGKILL.

        The final SIGKILL goes to every group, so children a worker left behind die too.
        """
        self.send_signal(signum)
        deadline = time.monotonic() + grace
        while self.running() and time.monotonic() < deadline and not hurry():
            time.sleep(0.02)
        for worker in self.workers:
            _killpg(worker.pid, signal.SIGKILL)
        self.join_threads(timeout=2.0)

    def join_threads(self, timeout: float) -> None:
        """Wait for the exit watchers and output pumps to finish (all output is flushed)."""
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            for thread in worker.threads:
                thread.join(max(0.0, deadline - time.monotonic()))
