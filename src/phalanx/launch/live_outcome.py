"""How a ``--recovery live`` job ended: what each node saw, and the job's exit code (pure).

Every worker slot ends one of two ways: *finished* (its newest process exited 0) or *lost* (a
process died, non-zero exit or signal, and was not replaced). The job's exit code:

- 0 only when every slot finished (deaths replaced along the way are not failures);
- the exit code of the first worker that died after another had already finished (the job
  was ending, e.g. a final save or evaluation failed: that is not a smaller world, it is a
  failure, and it is never replaced);
- otherwise the exit code of the first loss: a slot lost for good is never a success, even when
  the survivors trained on at a smaller world and ran to the end (the summary says so, and
  names the lost).

When the decisive death is not the first one, the summary also names the first: the cause
(e.g. a worker stopped and killed, whose replacement could not join because every survivor
failed after it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from phalanx.comm.signed import as_record
from phalanx.launch.summary import Failure

__all__ = ["Death", "NodeOutcome", "Verdict", "node_outcome", "to_json", "verdict"]


@dataclass(frozen=True)
class Death:
    """One worker process that exited non-zero or by a signal."""

    member: str
    """Its slot's PHALANX_MEMBER_ID."""
    incarnation: int
    """Its PHALANX_INCARNATION."""
    at: float
    """When its agent saw it (``time.time()``; orders deaths across nodes)."""
    failure: Failure
    """Its rank (as started), pid, exit status and last exception line."""
    replaced: bool
    """A replacement was started in its slot."""
    late: bool = False
    """It died after some worker of the job had finished: the job fails."""

    def describe(self) -> str:
        """``rank 1 (member 0.1, incarnation 0, pid 42): signal SIGKILL (exit code 137)``."""
        f = self.failure
        text = f"rank {f.rank} (member {self.member}, incarnation {self.incarnation}, pid {f.pid})"
        text += f": {f.reason or f.how()}"  # a reason: its node was lost, not the process
        last = f.exception or f.last_line
        return f"{text}; last error: {last}" if last else text


@dataclass(frozen=True)
class NodeOutcome:
    """What one node's agent reports once all of its workers have exited."""

    node: int
    finished: list[str]
    """Slots whose newest process exited 0."""
    deaths: list[Death]
    """Every death on the node, replaced or not, in order."""
    life: int = 0
    """Which agent of the node reports (0: the first; n: its n-th relaunch, which rejoined)."""


def _death(value: Any) -> Death:
    if not isinstance(value, dict) or not isinstance(value.get("failure"), dict):
        raise TypeError("a death is an object with a failure object")
    return as_record(Death, {**value, "failure": as_record(Failure, value["failure"])})


def node_outcome(value: Any) -> NodeOutcome:
    """Parse a NodeOutcome from its JSON (``asdict``); TypeError when malformed."""
    if not isinstance(value, dict) or not isinstance(value.get("deaths"), list):
        raise TypeError("a node outcome is an object with a list of deaths")
    outcome = as_record(NodeOutcome, {**value, "deaths": [_death(d) for d in value["deaths"]]})
    if not all(isinstance(m, str) for m in outcome.finished):
        raise TypeError("finished holds member ids (strings)")
    return outcome


def to_json(outcome: NodeOutcome) -> dict[str, Any]:
    """The JSON object of ``outcome`` (inverse of :func:`node_outcome`)."""
    return asdict(outcome)


@dataclass(frozen=True)
class Verdict:
    """The job's end under live recovery."""

    exit_code: int
    lines: list[str]
    """The summary (empty when no worker died: a clean run stays quiet)."""
    failure: Failure | None
    """The death that decided a failure (None: the job succeeded)."""


def verdict(outcomes: list[NodeOutcome], max_replacements: int) -> Verdict:
    """The job's exit code and its summary lines, from every node's outcome."""
    deaths = sorted((d for o in outcomes for d in o.deaths), key=lambda d: d.at)
    finished = sorted(m for o in outcomes for m in o.finished)
    lost = [d for d in deaths if not d.replaced]
    late = [d for d in lost if d.late]
    slots = len(finished) + len(lost)
    used = sum(d.replaced for d in deaths)
    decisive = late[0] if late else lost[0] if lost else None
    if late:
        head = f"job failed: {late[0].failure.how()} of a worker after another had finished"
    elif not finished:
        head = "job failed: every worker was lost"
    elif lost:
        head = (
            f"job failed: it finished at a smaller world, {len(finished)} of {slots} workers "
            f"ran to the end and {len(lost)} {'was' if len(lost) == 1 else 'were'} lost for good "
            f"(exit {lost[0].failure.exit_code}, the first loss's; raise --max-restarts to "
            f"replace them)"
        )
    else:
        head = f"job finished: {len(finished)} of {slots} workers ran to the end (exit 0)"
    lines = [head]
    if deaths and decisive is not None and deaths[0] is not decisive:
        lines.append(f"  first death (the cause): {deaths[0].describe()}")
    for d in lost:
        when = " (after a worker had finished)" if d.late else ""
        lines.append(f"  lost{when}: {d.describe()}")
    lines.append(f"replacements used: {used} of {max_replacements} (--max-restarts)")
    failure = decisive.failure if decisive else None
    code = failure.exit_code if failure else 0 if finished else 1
    return Verdict(code, lines if deaths else [], failure)
