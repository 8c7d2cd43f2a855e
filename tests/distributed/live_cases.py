"""A live-recovery job driven from the test process: the parent hosts the store, kills and replaces.

The parent plays ``phalanx run --recovery live``: it hosts the job-long TCPStore (so no worker's
death takes it down), writes the join record, starts one process per slot with the launcher's
environment, SIGKILLs a worker on request and reports its death at ``phalanx/live/dead/<slot>``
as the launcher does. Each worker runs an all-reduce loop whose expected sum it checks at every
step, recovers with :meth:`LiveGroup.recover`, admits replacements at step boundaries and hands
them its state with :func:`share_state`; it reports events to the parent through a pipe.
Used by ``test_live_recovery.py`` and by ``tools/recovery_latency``.
"""

from __future__ import annotations

import copy
import hashlib
import multiprocessing.connection
import os
import pickle
import random
import signal
import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from phalanx.comm import join
from phalanx.comm.store import connect_store, host_store
from phalanx.recovery import live_signer, report_death
from phalanx.testing import _context

SECRET = "ab" * 32
State = dict[str, Any] | None
STOP_KEY = "test/stop"


def digest(state: Any) -> str:
    """SHA-256 over a state tree: tensor bytes, dtypes, shapes and every other value's repr."""
    import torch

    h = hashlib.sha256()

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            h.update(f"T{value.dtype}{tuple(value.shape)}".encode())
            h.update(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            h.update(b"D")
            for k, v in value.items():
                h.update(repr((type(k).__name__, k)).encode())
                walk(v)
        elif isinstance(value, list | tuple):
            h.update(type(value).__name__.encode())
            for v in value:
                walk(v)
        else:
            h.update(repr((type(value).__name__, value)).encode())

    walk(state)
    return h.hexdigest()


def _initial_state() -> dict[str, Any]:
    import torch

    from phalanx.recovery import rng_state

    random.seed(0)  # every generator alike on every member: the states must be equal
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "step": 0,
        "acc": torch.zeros(3, dtype=torch.float64),
        "meta": {"name": "live", "ratio": 0.1, "shape": (3, 4)},
        "half": torch.randn(5).to(torch.bfloat16),
        "rng": rng_state(),
    }


def _slot_value(member_id: str) -> int:
    return int(member_id.split(".")[-1]) + 1


def _send(conn: Any, *event: Any) -> None:
    conn.send_bytes(pickle.dumps(event))


def worker(env: dict[str, str], options: dict[str, float], conn: Any) -> None:
    """One slot's process: the checked all-reduce loop (see the module docstring)."""
    import torch

    from phalanx.recovery import LiveGroup, RecoveryError

    os.environ.update(env)
    torch.set_num_threads(1)
    if os.environ.get("LIVE_DEBUG"):
        import logging

        logging.basicConfig(
            level=logging.INFO, format=f"%(created).3f {env['PHALANX_MEMBER_ID']} %(message)s"
        )
    try:
        live = LiveGroup.from_env("gloo", **options)
        control = connect_store(env["MASTER_ADDR"], int(env["MASTER_PORT"]), timedelta(seconds=10))
        joined = bool(live.newcomers)  # a replacement: it gets the state in the loop
        if live.me.incarnation > 0 and not joined:
            raise AssertionError(
                f"replacement {live.me} is not a newcomer of generation {live.generation}: "
                f"members {live.members}, newcomers {live.newcomers}"
            )
        _loop(live, control, None if joined else _initial_state(), conn, joined)
        live.close()
    except RecoveryError as exc:
        _send(conn, "error", env["PHALANX_MEMBER_ID"], repr(exc))
    except BaseException as exc:
        import traceback

        _send(conn, "error", env["PHALANX_MEMBER_ID"], traceback.format_exc() + repr(exc))
    finally:
        conn.close()


def _agree_step(state: State, before: State) -> State:
    """After a recovery: a survivor that completed the failed step rolls it back.

    A replacement without state yet takes no part in the choice (it gets the state next).
    """
    import torch
    import torch.distributed as dist

    mine = 2**62 if state is None else state["step"]
    step = torch.tensor([mine], dtype=torch.int64)
    dist.all_reduce(step, op=dist.ReduceOp.MIN)
    return before if int(step.item()) < mine and state is not None else state


def _hand_over(live: Any, state: State, conn: Any) -> dict[str, Any]:
    """After a membership change: newcomers (if any) receive the state from the source."""
    from phalanx.recovery import share_state

    if not live.newcomers:
        assert state is not None, "a member without state in a generation without newcomers"
        return state
    state = share_state(live, state)
    _send(conn, "admitted", live.me.member_id, live.world_size, digest(state), os.getpid())
    return state


def _loop(live: Any, control: Any, state: State, conn: Any, joined: bool) -> None:
    """The step loop; a replacement (``joined``) starts where the others' ``admit()`` returned."""
    import torch
    import torch.distributed as dist

    log: list[tuple[int, int, bool]] = []
    before = copy.deepcopy(state)
    recovering: float | None = None
    admit_s: list[float] = []
    steady = (-1, 0)  # (generation, checked steps in it)
    while True:
        try:
            changed = joined or recovering is not None  # both skip this step's admit()
            if recovering is not None:
                state = _agree_step(state, before)
            t_admit = time.perf_counter()
            if changed or live.admit():
                state = _hand_over(live, state, conn)
            else:
                admit_s.append(time.perf_counter() - t_admit)  # a step boundary with no change
            joined = False
            assert state is not None
            step, ws = state["step"], live.world_size
            stop = 1.0 if control.check([STOP_KEY]) else 0.0
            x = torch.tensor(
                [_slot_value(live.me.member_id) * (step + 1.0), stop], dtype=torch.float64
            )
            dist.all_reduce(x)
            expected = (step + 1.0) * sum(_slot_value(m.member_id) for m in live.members)
            log.append((step, ws, bool(x[0].item() == expected)))
            if recovering is not None:
                _send(
                    conn, "recovered", live.me.member_id, time.time(), ws, os.getpid(), recovering
                )
                recovering = None
            before = copy.deepcopy(state)
            state["acc"] += x[0]
            state["step"] = step + 1
            steady = (live.generation, steady[1] + 1 if steady[0] == live.generation else 1)
            if steady[1] == 20:
                _send(conn, "steady", live.me.member_id, ws)
            if x[1].item() > 0:
                break
        except RuntimeError as exc:
            if recovering is None:
                recovering = time.time()
            from phalanx.recovery import RecoveryError

            if isinstance(exc, RecoveryError):
                raise
            live.recover(exc)
    admit_median = statistics.median(admit_s) if admit_s else float("nan")
    _send(conn, "done", live.me.member_id, os.getpid(), log, digest(state), admit_median)


@dataclass
class LiveJob:
    """The parent's side: the store, the slots' processes and their events."""

    world_size: int
    options: dict[str, float]
    procs: dict[str, Any] = field(default_factory=dict)
    conns: dict[str, Any] = field(default_factory=dict)
    incarnations: dict[str, int] = field(default_factory=dict)
    events: list[tuple[Any, ...]] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)
    """Members that reported an error (their end is then no surprise)."""

    def __post_init__(self) -> None:
        self.store, self.port = host_store("127.0.0.1", 0, timedelta(seconds=30))
        nonce = join.host_job(self.store, SECRET.encode(), "live-test", 0, f"127.0.0.1:{self.port}")
        self.live = live_signer(self.store, SECRET.encode(), nonce)

    def _env(self, rank: int, incarnation: int) -> dict[str, str]:
        return {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.port),
            "RANK": str(rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(self.world_size),
            "GROUP_RANK": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "PHALANX_RUN_ID": "live-test",
            "PHALANX_RESTART_COUNT": "0",
            "PHALANX_JOB_SECRET": SECRET,
            "PHALANX_RECOVERY": "live",
            "PHALANX_MEMBER_ID": f"0.{rank}",
            "PHALANX_INCARNATION": str(incarnation),
        }

    def start(self, rank: int, incarnation: int = 0) -> None:
        """Start slot ``0.<rank>`` at ``incarnation`` (a replacement when > 0)."""
        ctx = _context()
        recv, send = ctx.Pipe(duplex=False)
        member = f"0.{rank}"
        p = ctx.Process(
            target=worker, args=(self._env(rank, incarnation), self.options, send), daemon=True
        )
        p.start()
        send.close()
        self.procs[member], self.conns[member], self.incarnations[member] = p, recv, incarnation

    def kill(self, member: str, report: bool = True) -> float:
        """SIGKILL ``member``'s process, reap it and (``report``) report its death as the
        launcher does; the time of the kill."""
        p = self.procs[member]
        t = time.time()
        os.kill(p.pid, signal.SIGKILL)
        p.join(timeout=10)
        if report:
            report_death(self.live, member, self.incarnations[member])
        self.conns.pop(member).close()
        return t

    def signal(self, member: str, sig: int) -> None:
        """Send ``sig`` to ``member``'s process (SIGSTOP: a hung process, heartbeat included)."""
        os.kill(self.procs[member].pid, sig)

    def wait_for(self, kind: str, count: int, deadline: float) -> list[tuple[Any, ...]]:
        """The next ``count`` events of ``kind`` (others are kept); raises on an error event."""
        found = [e for e in self.events if e[0] == kind][:count]
        while len(found) < count:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"waited for {count} {kind!r} events, got {found}; events: {self.events}"
                )
            for conn in multiprocessing.connection.wait(list(self.conns.values()), timeout=left):
                try:
                    event = pickle.loads(conn.recv_bytes())  # type: ignore[union-attr]
                except EOFError:
                    dead = next(m for m, c in self.conns.items() if c is conn)
                    self.conns.pop(dead)
                    finished = any(e[0] == "done" and e[1] == dead for e in self.events)
                    if dead in self.failed or finished:
                        continue  # it reported its result or error (as expected), then ended
                    raise RuntimeError(
                        f"member {dead} ended without a result; events: {self.events}"
                    ) from None
                if event[0] == "error":
                    self.failed.add(event[1])
                if event[0] == "error" and kind != "error":
                    raise RuntimeError(f"member {event[1]} failed: {event[2]}")
                self.events.append(event)
                if event[0] == kind and len(found) < count:
                    found.append(event)  # more of them stay in self.events for the next call
        for e in found:
            self.events.remove(e)
        return found

    def stop(self) -> None:
        """Ask every member to finish after the step that sees the flag (all see it alike)."""
        self.store.set(STOP_KEY, "1")

    def close(self) -> None:
        """Kill whatever still runs."""
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


def run_options(**overrides: float) -> dict[str, float]:
    """The LiveGroup timeouts the tests use (short: a failure must show within seconds)."""
    return {
        "timeout": 10.0,
        "heartbeat_interval": 0.5,
        "heartbeat_timeout": 10.0,
        "join_timeout": 60.0,
        **overrides,
    }


__all__ = ["LiveJob", "digest", "run_options", "worker"]
