"""Start the workers of one node, route their output, watch them, stop them.

Each stream goes, chunk by chunk (see :mod:`phalanx.launch.output`), to the console with its
``[rank N]`` prefix, to its log file (:mod:`phalanx.launch.logs`) or both; the last stderr
lines are kept for the failure summary. Global rank 0 reads the launcher's stdin, the others
read /dev/null.

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

from phalanx.launch.logs import AttemptLogs, FilteredLogs, StreamLogs, WorkerLogs
from phalanx.launch.output import ConsoleSink, FileSink, Sink, TailSink, pump
from phalanx.launch.prefix import Prefixer, line_prefix

__all__ = [
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "die_with_parent",
    "numa_bound",
    "worker_command",
]

_PR_SET_PDEATHSIG = 1
STDERR_TAIL_LINES = 50


RUN_PATH = (
    "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
)
"""torchrun's --run-path: the script runs through ``runpy.run_path`` (argv: script, args)."""


def worker_command(
    script: str,
    args: Sequence[str],
    module: bool = False,
    no_python: bool = False,
    run_path: bool = False,
    python: str = sys.executable,
) -> list[str]:
    """Command line of a worker, as torchrun builds it: ``python -u script``, ``python -u -m
    module``, the executable itself (``--no-python``), or ``runpy.run_path`` (``--run-path``)."""
    if run_path:
        return [python, "-u", "-c", RUN_PATH, script, *args]
    if no_python:
        return [script, *args]
    if module:
        return [python, "-u", "-m", script, *args]
    return [python, "-u", script, *args]


def numa_bound(command: list[str], gpu: int, mode: str) -> list[str]:
    """``command`` bound by numactl to the CPUs near GPU ``gpu``, exactly as torchrun does it.

    The topology rules of the four modes are torch's own (``torch.numa.binding``), so the
    binding is the one torchrun would choose.
    """
    from torch.numa.binding import (
        AffinityMode,
        NumaOptions,
        _maybe_wrap_command_args_with_numa_binding,
    )

    options = NumaOptions(affinity_mode=AffinityMode(mode))
    wrapped = _maybe_wrap_command_args_with_numa_binding(
        tuple(command), gpu_index=gpu, numa_options=options
    )
    return list(wrapped)


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
    stdin: bool = False
    """Read the launcher's stdin (global rank 0, so that ``breakpoint()`` and ``input()``
    work there); otherwise /dev/null."""
    prefix: str = ""
    """Console prefix of its lines (default ``[rank N] ``)."""
    logs: WorkerLogs = field(default_factory=WorkerLogs)
    """Its log files and whether each stream is shown on the console."""


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


def _sinks(
    name: str, where: StreamLogs, spec: WorkerSpec, filtered: FilteredLogs | None, append: bool
) -> list[Sink]:
    """The console, log file and filtered-lines copies of one stream of a worker."""
    prefix = spec.prefix or line_prefix(None, "", spec.rank, spec.local_rank)
    sinks: list[Sink] = []
    if where.file is not None:
        sinks.append(FileSink(where.file, append))
    if where.console:
        # torch's excepthook and c10d's log lines start with "[rank0]:" once init_process_group
        # ran: that is our prefix again, so it is dropped.
        torch_prefix = f"[rank{spec.rank}]:".encode()
        sinks.append(ConsoleSink(name, Prefixer(prefix.encode(), torch_prefix)))
    duplicate = filtered.sink(name, prefix) if where.filtered and filtered else None
    if duplicate is not None:
        sinks.append(duplicate)
    return sinks


def _prompt_watch(spec: WorkerSpec, sinks: list[Sink], pid: int) -> Callable[[], None] | None:
    """For a worker reading the launcher's terminal: notice when a partial line is a prompt."""
    shown = [s for s in sinks if isinstance(s, ConsoleSink)]
    if not (spec.stdin and shown and sys.stdin is not None and sys.stdin.isatty()):
        return None
    return lambda: shown[0].idle(pid)


def _start(spec: WorkerSpec, filtered: FilteredLogs | None, append: bool = False) -> Worker:
    tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
    out = _sinks("stdout", spec.logs.stdout, spec, filtered, append)
    err = [*_sinks("stderr", spec.logs.stderr, spec, filtered, append), TailSink(tail)]
    try:
        proc = subprocess.Popen(
            spec.command,
            env=spec.env,
            stdin=None if spec.stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )
    except BaseException:
        for sink in (*out, *err):
            sink.close()
        raise
    worker = Worker(spec, proc, stderr_tail=tail)
    assert proc.stdout is not None and proc.stderr is not None
    worker.threads = [
        threading.Thread(target=pump, args=(proc.stdout, out, _prompt_watch(spec, out, proc.pid))),
        threading.Thread(target=pump, args=(proc.stderr, err, _prompt_watch(spec, err, proc.pid))),
        threading.Thread(target=worker._wait),
    ]
    for thread in worker.threads:
        thread.daemon = True
        thread.start()
    return worker


def _killpg(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


class WorkerGroup:
    """The workers of this node for one generation (``workers[i]``: local rank i's newest)."""

    def __init__(self, specs: Sequence[WorkerSpec], logs: AttemptLogs | None = None) -> None:
        assert threading.current_thread() is threading.main_thread(), "see PR_SET_PDEATHSIG"
        self.workers: list[Worker] = []
        self.replaced: list[Worker] = []
        """Workers that exited and were replaced (``--recovery live``), oldest first."""
        self.filtered = FilteredLogs(logs) if logs is not None else None
        try:
            for spec in specs:
                self.workers.append(_start(spec, self.filtered))
        except BaseException:
            self.stop(grace=0.0)
            raise

    def replace(self, index: int, spec: WorkerSpec) -> Worker:
        """Start ``spec`` in place of the exited ``workers[index]``, appending to its log files.

        Children the exited worker left in its process group are killed first, and its output
        is flushed (for at most a second) before the new worker's starts.
        """
        assert threading.current_thread() is threading.main_thread(), "see PR_SET_PDEATHSIG"
        old = self.workers[index]
        assert old.returncode is not None, f"local rank {index} (pid {old.pid}) is still running"
        _killpg(old.pid, signal.SIGKILL)
        for thread in old.threads[:2]:  # its output pumps
            thread.join(0.5)
        worker = _start(spec, self.filtered, append=True)
        self.replaced.append(old)
        self.workers[index] = worker
        return worker

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
        for worker in [*self.replaced, *self.workers]:
            for thread in worker.threads:
                thread.join(max(0.0, deadline - time.monotonic()))
        if self.filtered is not None:
            self.filtered.close()
