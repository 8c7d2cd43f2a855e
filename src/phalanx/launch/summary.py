"""What went wrong, in a few lines: the failing rank, how it ended and the last exception line."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phalanx.launch.workers import Worker

__all__ = [
    "Failure",
    "describe_failure",
    "exit_code_of",
    "failure_of",
    "format_summary",
    "last_exception_line",
    "signal_name",
]


def signal_name(signum: int) -> str:
    """``9`` -> ``"SIGKILL"``; unknown numbers become ``"signal 42"``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code_of(returncode: int) -> int:
    """Shell convention: a process killed by signal N reports 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


# torch's elastic error handler prefixes a worker's traceback lines with "[rank3]: ".
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")


def last_exception_line(lines: Iterable[str]) -> str | None:
    """The exception line of the last traceback in ``lines`` (e.g. ``"ValueError: boom"``).

    A traceback is ``Traceback (most recent call last):``, indented frame lines, then the first
    unindented line: the exception. Returns None when ``lines`` hold no traceback.
    """
    found: str | None = None
    in_traceback = False
    for line in lines:
        text = _TORCH_RANK_PREFIX.sub("", line.rstrip("\r\n"))
        if text.startswith("Traceback (most recent call last):"):
            in_traceback = True
        elif in_traceback and text and not text[0].isspace():
            found, in_traceback = text, False
    return found


@dataclass(frozen=True)
class Failure:
    """The first worker failure of a generation, as published to every node's agent."""

    rank: int
    """Global rank of the failed worker (-1: an agent failed, not a worker)."""
    local_rank: int
    """Rank on its node."""
    node_rank: int
    """Node whose agent saw the failure."""
    pid: int
    """Process id of the worker on its node."""
    returncode: int
    """Popen return code: exit status, or minus the signal number."""
    exception: str | None = None
    """Last line of the worker's last traceback, if it printed one."""
    last_line: str | None = None
    """Last line the worker wrote to stderr (when there is no traceback)."""
    reason: str | None = None
    """Why an agent (not a worker) failed: a signal, a lost peer, a lost store."""

    @property
    def exit_code(self) -> int:
        """Exit code ``phalanx run`` reports for this failure (never 0)."""
        return exit_code_of(self.returncode) or 1

    def how(self) -> str:
        """How the process ended, e.g. ``exit code 1`` or ``signal SIGKILL (exit code 137)``."""
        if self.returncode < 0:
            return f"signal {signal_name(-self.returncode)} (exit code {self.exit_code})"
        return f"exit code {self.returncode}"

    def to_json(self) -> str:
        """Serialise for the agent store."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Failure:
        """Inverse of :meth:`to_json`."""
        return cls(**json.loads(text))


def failure_of(worker: Worker, node_rank: int) -> Failure:
    """The Failure of ``worker`` (exited) on node ``node_rank``, from its stderr tail."""
    tail = list(worker.stderr_tail)
    last = next((line.strip() for line in reversed(tail) if line.strip()), None)
    return Failure(
        rank=worker.spec.rank,
        local_rank=worker.spec.local_rank,
        node_rank=node_rank,
        pid=worker.pid,
        returncode=worker.returncode or 0,
        exception=last_exception_line(tail),
        last_line=last,
    )


def describe_failure(failure: Failure) -> list[str]:
    """Lines naming the failed rank (or agent), how it ended and its last exception line."""
    if failure.rank < 0:
        return [f"node {failure.node_rank}: {failure.reason}"]
    lines = [
        f"rank {failure.rank} failed (local rank {failure.local_rank} on node "
        f"{failure.node_rank}, pid {failure.pid}): {failure.how()}",
    ]
    if failure.exception:
        lines.append(f"  exception: {failure.exception}")
    elif failure.last_line:
        lines.append(f"  last stderr line: {failure.last_line}")
    return lines


def format_summary(failure: Failure, restarts_used: int, max_restarts: int) -> list[str]:
    """Lines of the final failure summary (without the ``phalanx run:`` prefix)."""
    return [
        "job failed; first failure:",
        *describe_failure(failure),
        f"restarts used: {restarts_used} of {max_restarts} (--max-restarts {max_restarts})",
    ]
