"""Log files of the workers, laid out as torchrun lays them out.

``<log_dir>/<run_id>_<random>/attempt_<restart>/<local_rank>/{stdout,stderr}.log`` receive the
streams named by ``--redirects`` (files only) and ``--tee`` (files and console), each as
``0``..``3`` or ``local_rank:value,...``; ``error.json`` beside them is each worker's
``TORCHELASTIC_ERROR_FILE``; ``--local-ranks-filter`` limits the console (not the files) to
some local ranks, and ``--duplicate-std{out,err}-filters`` copy matching tee'd lines to
``attempt_<n>/filtered_std{out,err}.log``. Without ``--log-dir`` the base is a temporary
directory, removed at the end unless something was written there. ``--logs-specs NAME`` hands
the layout to a ``torchrun.logs_specs`` plugin, as torchrun does.

:func:`plan_attempt` is the layout as a pure function; a test checks it against torch's
``DefaultLogsSpecs`` for every form of the flags.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING

from phalanx.launch.config import ArgsError, LogOptions, StdSpec
from phalanx.launch.output import Lines

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std

__all__ = [
    "AttemptLogs",
    "FilteredLogs",
    "RunLogs",
    "StreamLogs",
    "WorkerLogs",
    "from_logs_dest",
    "load_logs_specs",
    "plan_attempt",
]

OUT, ERR = 1, 2
ENTRY_POINT_GROUP = "torchrun.logs_specs"


@dataclass(frozen=True)
class StreamLogs:
    """Where one stream (stdout or stderr) of one worker goes."""

    file: str | None = None
    """Its log file, if redirected or tee'd."""
    console: bool = True
    """Shown on the launcher's console."""
    filtered: bool = False
    """Tee'd to the console, so its lines may be duplicated to ``filtered_*.log``."""


@dataclass(frozen=True)
class WorkerLogs:
    """Where one worker's output goes."""

    stdout: StreamLogs = StreamLogs()
    stderr: StreamLogs = StreamLogs()
    error_file: str = ""
    """TORCHELASTIC_ERROR_FILE ("" when there is none, as with ``--log-dir /dev/null``)."""


@dataclass(frozen=True)
class AttemptLogs:
    """Where the output of every local worker of one attempt goes."""

    workers: tuple[WorkerLogs, ...]
    """By local rank."""
    filtered_stdout: str | None = None
    """The shared file of ``--duplicate-stdout-filters`` (None: no filters)."""
    filtered_stderr: str | None = None
    """The shared file of ``--duplicate-stderr-filters``."""
    stdout_filters: tuple[str, ...] = ()
    stderr_filters: tuple[str, ...] = ()

    def any_file(self) -> bool:
        """True when some stream is written to a log file."""
        return any(w.stdout.file or w.stderr.file for w in self.workers)


def _stream(which: int, path: str, redirect: int, tee: int, shown: bool) -> StreamLogs:
    """One stream: torchrun tees by redirecting to the file and tailing it to the console."""
    if not (redirect | tee) & which:
        return StreamLogs(None, console=shown)
    teed = bool(tee & which) and shown
    return StreamLogs(path, console=teed, filtered=teed)


def plan_attempt(options: LogOptions, attempt_dir: str | None, nproc: int) -> AttemptLogs:
    """The files of one attempt under ``attempt_dir`` (None: ``--log-dir /dev/null``)."""
    if attempt_dir is None:  # torchrun: every stream on the console, no file at all
        return AttemptLogs(tuple(WorkerLogs() for _ in range(nproc)))
    workers = []
    chosen = options.local_ranks_filter
    for rank in range(nproc):
        folder = os.path.join(attempt_dir, str(rank))
        redirect, tee = options.redirects.of(rank), options.tee.of(rank)
        shown = chosen is None or rank in chosen
        workers.append(
            WorkerLogs(
                _stream(OUT, os.path.join(folder, "stdout.log"), redirect, tee, shown),
                _stream(ERR, os.path.join(folder, "stderr.log"), redirect, tee, shown),
                os.path.join(folder, "error.json"),
            )
        )
    return _with_filters(tuple(workers), attempt_dir, options)


def _with_filters(workers: tuple[WorkerLogs, ...], folder: str, options: LogOptions) -> AttemptLogs:
    out, err = options.duplicate_stdout_filters, options.duplicate_stderr_filters
    return AttemptLogs(
        workers,
        os.path.join(folder, "filtered_stdout.log") if out else None,
        os.path.join(folder, "filtered_stderr.log") if err else None,
        out,
        err,
    )


def _from_dest(paths: dict[int, str], tees: dict[int, str], rank: int) -> StreamLogs:
    path, tee = paths[rank], tees.get(rank)
    if path == "":
        return StreamLogs(None, console=True)
    if path == os.devnull:
        return StreamLogs(None, console=False)
    teed = tee is not None and tee != os.devnull
    return StreamLogs(path, console=teed, filtered=teed)


def from_logs_dest(dest: LogsDest, nproc: int, options: LogOptions) -> AttemptLogs:
    """Read torch's ``LogsDest`` (what a ``LogsSpecs.reify`` returns) as an AttemptLogs."""
    workers = tuple(
        WorkerLogs(
            _from_dest(dest.stdouts, dest.tee_stdouts, rank),
            _from_dest(dest.stderrs, dest.tee_stderrs, rank),
            "" if dest.error_files[rank] == os.devnull else dest.error_files[rank],
        )
        for rank in range(nproc)
    )
    folder = os.path.dirname(dest.filtered_stdout)
    return _with_filters(workers, folder, options)


@functools.cache
def load_logs_specs(name: str) -> type[LogsSpecs]:
    """The LogsSpecs class of entry point ``name`` in group ``torchrun.logs_specs``."""
    found = metadata.entry_points(group=ENTRY_POINT_GROUP)
    for entry in found:
        if entry.name == name:
            return entry.load()
    known = ", ".join(sorted(e.name for e in found)) or "none is installed"
    raise ArgsError(
        f"--logs-specs {name}: no entry point {name!r} in group {ENTRY_POINT_GROUP} "
        f"(installed: {known}); install the package that provides it or drop --logs-specs"
    )


def _torch_std(spec: StdSpec) -> Std | dict[int, Std]:
    from torch.distributed.elastic.multiprocessing.api import Std

    if spec.per_rank is None:
        return Std(spec.value)
    return {rank: Std(value) for rank, value in spec.per_rank}


class RunLogs:
    """The log directory of this node's run; one :class:`AttemptLogs` per attempt."""

    def __init__(self, options: LogOptions, log: Callable[[str], None]) -> None:
        self.options = options
        self.log = log
        self._run_dir: str | None = None
        self._temp_base: str | None = None
        """The temporary base directory made when there is no --log-dir."""
        self._kept = False
        """Some worker output was written to a file: keep the temporary directory."""
        self._plugin: LogsSpecs | None = None
        """The --logs-specs plugin instance, made at the first attempt."""

    def attempt(self, run_id: str, restart_count: int, envs: list[dict[str, str]]) -> AttemptLogs:
        """Create the attempt's folders and set each worker's TORCHELASTIC_ERROR_FILE."""
        if self.options.logs_specs is not None:
            plan = self._plugin_attempt(envs)
        else:
            folder = self._attempt_dir(run_id, restart_count, len(envs))
            plan = plan_attempt(self.options, folder, len(envs))
        for env, worker in zip(envs, plan.workers):
            env["TORCHELASTIC_ERROR_FILE"] = worker.error_file
        if plan.any_file():
            self._kept = True
            where = os.path.dirname(os.path.dirname(plan.workers[0].error_file or "."))
            self.log(f"worker logs of attempt {restart_count} in {where}")
        return plan

    def _attempt_dir(self, run_id: str, restart_count: int, nproc: int) -> str | None:
        if self.options.log_dir == os.devnull:
            return None
        if self._run_dir is None:
            base = self.options.log_dir
            if base is None:
                base = self._temp_base = tempfile.mkdtemp(prefix="phalanx_logs_")
            os.makedirs(base, exist_ok=True)
            self._run_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=base)
        folder = os.path.join(self._run_dir, f"attempt_{restart_count}")
        shutil.rmtree(folder, ignore_errors=True)
        for rank in range(nproc):
            os.makedirs(os.path.join(folder, str(rank)))
        return folder

    def _plugin_attempt(self, envs: list[dict[str, str]]) -> AttemptLogs:
        if self._plugin is None:
            o = self.options
            self._plugin = load_logs_specs(str(o.logs_specs))(
                log_dir=o.log_dir,
                redirects=_torch_std(o.redirects),
                tee=_torch_std(o.tee),
                local_ranks_filter=set(o.local_ranks_filter) if o.local_ranks_filter else None,
            )
        by_rank = dict(enumerate(envs))
        dest = self._plugin.reify(by_rank)
        return from_logs_dest(dest, len(envs), self.options)

    def close(self) -> None:
        """Remove the temporary base directory, unless worker output was written there."""
        if self._temp_base is not None and not self._kept:
            shutil.rmtree(self._temp_base, ignore_errors=True)


class FilteredLogs:
    """The two shared files of ``--duplicate-std{out,err}-filters`` for one attempt."""

    def __init__(self, plan: AttemptLogs) -> None:
        self._lock = threading.Lock()
        self._files = {
            name: (open(path, "w", errors="replace", buffering=1), filters)  # noqa: SIM115
            for name, path, filters in (
                ("stdout", plan.filtered_stdout, plan.stdout_filters),
                ("stderr", plan.filtered_stderr, plan.stderr_filters),
            )
            if path is not None and filters
        }

    def sink(self, name: str, prefix: str) -> Lines | None:
        """A sink that copies the matching lines of one worker's stream ``name``, prefixed."""
        if name not in self._files:
            return None
        file, filters = self._files[name]

        def take(line: str) -> None:
            if any(needle in line for needle in filters):
                with self._lock, contextlib.suppress(ValueError):  # closed after a join timeout
                    file.write(prefix + line)

        return Lines(take)

    def close(self) -> None:
        """Close both files."""
        for file, _ in self._files.values():
            file.close()
