"""Run the DDP tests that torch's wheel ships, with torch's class or with phalanx's.

The wheel ships ``torch/testing/_internal/distributed/``: the suites torch's CI runs against
``DistributedDataParallel``. This module is their driver for the compat tier. Two suites:

- ``distributed_test``: every test of ``DistributedTest._DistTestBase`` whose body, or a
  ``self._helper`` it calls (transitively), names ``DistributedDataParallel`` (read from the
  syntax tree, nothing imported), on 2 gloo ranks set up as torch's ``TestDistBackend._run``
  does (``file://`` rendezvous, barrier, test, barrier);
- ``ddp_under_dist_autograd``: DDP under ``torch.distributed.autograd`` with RPC (4 trainers, or
  6 processes with the master and a remote worker), as torch's TensorPipe fixture runs them.

Each test's ranks are forked from a forkserver that has imported the suite once. With
``impl="phalanx"`` every name the suite module uses for the class (``DistributedDataParallel``,
``nn.parallel.DistributedDataParallel``, ``torch.nn.parallel.DistributedDataParallel``) is
phalanx's in every rank process. A test that would only skip for want of a GPU (torch's
``skip_if_lt_x_gpu`` and the like) starts no process: ``static_skips`` runs the same check here.

Run it directly for a report: ``python -m tests.compat.torch_suite --impl both``.
"""

from __future__ import annotations

import argparse
import ast
import json
import multiprocessing
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

from tests.compat.static_skips import skip_reason

PACKAGE = "torch.testing._internal.distributed"
TEST_DEADLINE = 90.0
"""Seconds for one test on every rank; then the ranks are killed and the test fails (healthy
ones take 1-10 s on 2 loaded cores; a start-up race of the RPC suite below hangs until this
deadline, so it bounds what a retried race costs the run)."""
RETRIED_DEADLINE = 30.0
"""The deadline of a test of a retried suite: its tests take about 1 s (5 on a loaded CI box),
and its start-up race hangs; a race then costs 30 s before the retry, not 90."""
RETRIED_SUITES = ("ddp_under_dist_autograd_test",)
BACKEND_VAR = "PHALANX_SUITE_BACKEND"
"""The backend ``distributed_test``'s default group is made with (``--backend``, set in each
rank process; gloo unless set). The suite's own ``BACKEND`` stays ``gloo``, so its
gloo-specific expectations and skips hold: ``--backend shm`` runs the tests torch runs on gloo
on phalanx's shared-memory backend."""
"""Suites whose failed test runs once more. Their fixture starts 4-6 RPC processes with
TensorPipe and races on start-up ("Default process group has not been initialized" on the
master, or the deadline) when a 2-core machine is loaded, with torch's class as with
phalanx's; a test that fails twice fails, and a retry is named in the outcome's detail."""


@dataclass(frozen=True)
class Outcome:
    """How one test ended on the ranks: ``passed``, ``skipped`` or ``failed``."""

    status: str
    detail: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class Case:
    """One test: ``suite`` module, test class, method and its number of ranks."""

    suite: str
    cls: str
    name: str
    world_size: int

    @property
    def id(self) -> str:
        return f"{self.suite}::{self.cls}::{self.name}"


def _path(suite: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and spec.submodule_search_locations
    return os.path.join(next(iter(spec.submodule_search_locations)), f"{suite}.py")


# ---- selection: pure, from the syntax tree ----------------------------------------------------
def select() -> list[Case]:
    """Every DDP test of both suites, in file order."""
    return _select_distributed_test() + _select_dist_autograd()


def _classes(suite: str) -> dict[str, ast.ClassDef]:
    with open(_path(suite)) as f:
        tree = ast.parse(f.read())
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            found[node.name] = node
    return found


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _select_distributed_test() -> list[Case]:
    methods = _methods(_classes("distributed_test")["_DistTestBase"])
    direct = {name for name, fn in methods.items() if "DistributedDataParallel" in _names(fn)}
    calls = {name: _self_calls(fn) & methods.keys() for name, fn in methods.items()}
    return [
        Case("distributed_test", "_DistTestBase", n, 2)
        for n in methods
        if n.startswith("test_") and _reaches(n, direct, calls)
    ]


def _select_dist_autograd() -> list[Case]:
    classes = _classes("ddp_under_dist_autograd_test")
    sizes = {"DdpUnderDistAutogradTest": 6, "DdpComparisonTest": 4}  # the classes' world_size
    return [
        Case("ddp_under_dist_autograd_test", cls, n, size)
        for cls, size in sizes.items()
        for n in _methods(classes[cls])
        if n.startswith("test_")
    ]


def _names(fn: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
    return found


def _self_calls(fn: ast.AST) -> set[str]:
    return {
        node.attr
        for node in ast.walk(fn)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def _reaches(start: str, targets: set[str], calls: dict[str, set[str]]) -> bool:
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in targets:
            return True
        if name not in seen:
            seen.add(name)
            todo.extend(calls.get(name, ()))
    return False


# ---- one test on one rank ---------------------------------------------------------------------
def _env(tmp: str, world_size: int) -> dict[str, str]:
    return {
        "BACKEND": "gloo",
        "WORLD_SIZE": str(world_size),
        "TEMP_DIR": tmp,
        "INIT_METHOD": "file://" + os.path.join(tmp, "init_dir", "shared_init_file"),
        "MASTER_ADDR": "127.0.0.1",
    }


def substitute_phalanx(module: Any) -> None:
    """Point every name the suite module uses for torch's DDP at phalanx's class."""
    import torch

    import phalanx

    module.DistributedDataParallel = phalanx.DistributedDataParallel
    torch.nn.parallel.DistributedDataParallel = phalanx.DistributedDataParallel  # type: ignore[misc]


def _skip_reason(code: int) -> str | None:
    from torch.testing._internal.common_distributed import TEST_SKIPS

    return next((s.message for s in TEST_SKIPS.values() if s.exit_code == code), None)


def _instance(case: Case, module: Any, rank: int, tmp: str) -> Any:
    if case.suite == "distributed_test":
        base: Any = module.TestDistBackend
        test_cls = module.DistributedTest._DistTestBase
    else:
        from torch.testing._internal.common_distributed import MultiProcessTestCase
        from torch.testing._internal.distributed.rpc.tensorpipe_rpc_agent_test_fixture import (
            TensorPipeRpcAgentTestFixture,
        )

        test_cls = getattr(module, case.cls)
        base = type("Fixture", (TensorPipeRpcAgentTestFixture, MultiProcessTestCase), {})
    bound = type("Bound", (base, test_cls), {})
    instance = bound(case.name)
    instance.rank, instance.file_name = rank, os.path.join(tmp, "store")
    return instance


def _run_body(case: Case, module: Any, instance: Any, rank: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.testing._internal import common_utils

    common_utils.set_rng_seed()
    if case.suite != "distributed_test":  # the RPC fixture (dist_init) sets itself up
        getattr(instance, case.name)()
        return
    seconds = module.CUSTOM_PG_TIMEOUT.get(case.name, module.default_pg_timeout)
    dist.init_process_group(
        init_method=instance.init_method,
        backend=os.environ.get(BACKEND_VAR, "gloo"),
        world_size=case.world_size,
        rank=rank,
        timeout=timedelta(seconds=seconds),
    )
    instance._barrier()
    getattr(instance, case.name)()
    instance._barrier()


def _rank(case: Case, impl: str, rank: int, tmp: str, backend: str, conn: Any) -> None:
    os.environ.update(_env(tmp, case.world_size))
    os.environ[BACKEND_VAR] = backend
    import importlib
    import unittest

    module = importlib.import_module(f"{PACKAGE}.{case.suite}")
    if impl == "phalanx":
        substitute_phalanx(module)
    start = time.perf_counter()
    try:
        _run_body(case, module, _instance(case, module, rank, tmp), rank)
        outcome = Outcome("passed")
    except unittest.SkipTest as e:
        outcome = Outcome("skipped", str(e))
    except SystemExit as e:
        code = int(e.code or 0)
        reason = _skip_reason(code)
        outcome = Outcome("skipped", reason) if reason else Outcome("failed", f"exit {code}")
    except BaseException:
        outcome = Outcome("failed", traceback.format_exc()[-4000:])
    outcome = Outcome(outcome.status, outcome.detail, time.perf_counter() - start)
    conn.send(asdict(outcome))
    conn.close()
    os._exit(0)  # no atexit / process-group teardown that could hang after a failure


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    suites = [f"{PACKAGE}.distributed_test", f"{PACKAGE}.ddp_under_dist_autograd_test"]
    ctx.set_forkserver_preload(["torch", "torch.distributed", *suites, "phalanx"])
    return ctx


def run_test(case: Case, impl: str, ctx: Any, backend: str = "gloo") -> Outcome:
    """Run one test on every rank (``distributed_test``'s default group on ``backend``); the
    first failing rank decides, a deadline bounds it."""
    tmp = tempfile.mkdtemp(prefix="phalanx-compat-")
    for sub in ("barrier", "test_dir", "init_dir"):
        os.mkdir(os.path.join(tmp, sub))
    procs, conns = [], []
    try:
        for rank in range(case.world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank, args=(case, impl, rank, tmp, backend, send), daemon=True)
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
        deadline = RETRIED_DEADLINE if case.suite in RETRIED_SUITES else TEST_DEADLINE
        return _gather(procs, conns, time.monotonic() + deadline, deadline)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)


def _gather(procs: list[Any], conns: list[Any], deadline: float, limit: float) -> Outcome:
    outcomes: dict[int, Outcome] = {}
    pending = dict(enumerate(conns))
    while pending:
        ready = multiprocessing.connection.wait(
            list(pending.values()), max(0.0, deadline - time.monotonic())
        )
        if not ready:
            late = sorted(pending)
            return Outcome("failed", f"ranks {late} missed the {limit:g} s deadline")
        for conn in ready:
            rank = next(r for r, c in pending.items() if c is conn)
            del pending[rank]
            try:
                got = Outcome(**conn.recv())
            except EOFError:
                procs[rank].join(timeout=5)
                got = Outcome("failed", f"rank {rank} died (exit code {procs[rank].exitcode})")
            if got.status == "failed":
                return Outcome("failed", f"rank {rank}: {got.detail}", got.seconds)
            outcomes[rank] = got
    return max(outcomes.values(), key=lambda o: (o.status == "skipped", o.seconds))


def run_suite(
    impl: str,
    cases: list[Case],
    verbose: bool = False,
    static: bool = True,
    backend: str = "gloo",
) -> dict[str, Outcome]:
    """Run ``cases`` with ``impl`` ("torch" or "phalanx") and ``distributed_test``'s default
    group on ``backend``; each test's outcome by id.

    With ``static``, a test that ``static_skips`` finds skipped here starts no process; the first
    such test of each reason still runs on its ranks, and fails unless they skip it for that
    reason (so the decision cannot drift from torch's decorators unnoticed).
    """
    os.environ.update({k: v for k, v in _env(tempfile.gettempdir(), 2).items() if k != "TEMP_DIR"})
    ctx = _context()
    results: dict[str, Outcome] = {}
    confirmed: set[str] = set()
    for case in cases:
        if static:
            o = _outcome(case, impl, ctx, confirmed, backend)
        else:
            o = _run_retried(case, impl, ctx, backend)
        results[case.id] = o
        if verbose:
            print(f"{impl:8} {backend:4} {o.status:8} {o.seconds:6.2f}s {case.id}", flush=True)
    return results


def _outcome(case: Case, impl: str, ctx: Any, confirmed: set[str], backend: str) -> Outcome:
    """The static skip where its reason is in ``confirmed``, else the ranks' outcome, checked."""
    skip = _skipped_here(case)
    if skip is not None and skip.detail in confirmed:
        return skip
    o = _run_retried(case, impl, ctx, backend)
    if skip is None:
        return o
    confirmed.add(skip.detail)
    if (o.status, o.detail) != (skip.status, skip.detail):
        return Outcome("failed", f"static_skips said skipped ({skip.detail}), ranks: {o}")
    return o


def _run_retried(case: Case, impl: str, ctx: Any, backend: str) -> Outcome:
    o = run_test(case, impl, ctx, backend)
    if o.status == "failed" and case.suite in RETRIED_SUITES:
        first = o.detail.strip().splitlines()[-1:] or [""]
        o = run_test(case, impl, ctx, backend)
        o = Outcome(o.status, f"{o.detail} (retried once; first run: {first[0]})", o.seconds)
    return o


def _skipped_here(case: Case) -> Outcome | None:
    """The skip the ranks would report (see ``static_skips``), decided without starting them."""
    import importlib

    module = importlib.import_module(f"{PACKAGE}.{case.suite}")
    tmp = tempfile.gettempdir()
    instance = _instance(case, module, 0, tmp)
    test = getattr(type(instance), case.name)
    reason = skip_reason(test, instance, _env(tmp, case.world_size))
    return None if reason is None else Outcome("skipped", reason)


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.compat.torch_suite [--impl torch|phalanx|both] [--backend gloo|shm]
    [--then-shm] [-k SUBSTRING]``.

    With ``both``, phalanx's class runs only the tests torch's passes: the others (no GPU
    here, or skipped by torch itself) say nothing about phalanx's class. With ``--then-shm``,
    each class then runs again, with the default group on phalanx's ``backend="shm"``, the
    ``distributed_test`` tests it passed (reported as ``torch@shm`` and ``phalanx@shm``): the
    same ranks' forkserver, so no second start-up of the suites.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=["torch", "phalanx", "both"], default="both")
    parser.add_argument("-k", dest="pattern", default="", help="only tests containing this")
    parser.add_argument("--json", help="write every outcome to this file")
    parser.add_argument(
        "--backend",
        choices=["gloo", "shm"],
        default="gloo",
        help="the default group's backend in distributed_test (shm: phalanx's shared memory)",
    )
    parser.add_argument(
        "--then-shm",
        action="store_true",
        help="then run each class's passed distributed_test tests again on shm",
    )
    parser.add_argument(
        "--run-all", action="store_true", help="start the ranks of every test, even static skips"
    )
    args = parser.parse_args(argv)
    cases = [c for c in select() if args.pattern in c.id]
    static = not args.run_all
    report = {}
    if args.impl in ("torch", "both"):
        report["torch"] = run_suite("torch", cases, True, static, args.backend)
    if args.impl in ("phalanx", "both"):  # with both, only where torch's class passes
        baseline = report.get("torch")
        ours = [c for c in cases if baseline is None or baseline[c.id].status == "passed"]
        report["phalanx"] = run_suite("phalanx", ours, True, static, args.backend)
    if args.then_shm:
        for impl, outcomes in list(report.items()):
            passed = [
                c
                for c in cases
                if c.suite == "distributed_test" and c.id in outcomes
                if outcomes[c.id].status == "passed"
            ]
            report[f"{impl}@shm"] = run_suite(impl, passed, True, static, "shm")
    counts = {
        impl: {s: sum(o.status == s for o in r.values()) for s in ("passed", "skipped", "failed")}
        for impl, r in report.items()
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump({i: {n: asdict(o) for n, o in r.items()} for i, r in report.items()}, f)
    print("RESULT " + json.dumps({"selected": len(cases), **counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
