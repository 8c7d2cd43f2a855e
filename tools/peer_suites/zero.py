"""Run torch's own ZeroRedundancyOptimizer tests against torch's class and against phalanx's.

    python tools/peer_suites/zero.py PATH/test_zero_redundancy_optimizer.py [--impl both]
    python tools/peer_suites/zero.py PATH --impl phalanx -k local_optimizer_parity

``PATH`` is torch's ``test/distributed/optim/test_zero_redundancy_optimizer.py`` (not shipped
with phalanx: fetch it yourself, e.g. into the git-ignored ``.peer/``). The file is loaded
unmodified; this runner only changes its surroundings:

- **Substitution.** With ``--impl phalanx`` every attribute of the test module that *is*
  ``torch.distributed.optim.ZeroRedundancyOptimizer`` is replaced by
  ``phalanx.ZeroRedundancyOptimizer``. The tests spawn one process per rank (``spawn`` start
  method), and a spawned child re-imports this script as ``__mp_main__`` before it unpickles
  the test: :func:`prepare` runs at import time from the ``PHALANX_PEER_*`` environment, so
  the children load the same patched module.
- **GPU gates.** ``skip_if_no_gpu`` and ``requires_accelerator_dist_backend`` (and any gate
  named with ``--lift``) become no-ops, so tests that run on CPU under gloo are not skipped (the
  file's ``device_type`` is ``"cpu"`` without an accelerator). ``skip_if_lt_x_gpu(4)`` (two
  devices per process) stays. The 16 ``test_ddp_zero_overlap_*`` tests then fail with torch's
  own class: its DDP hook refuses gloo ("Gloo backend using Overlapping DDP with ZeRO may meet
  hangs"), so they do not count against phalanx.
- One thread per rank (2 ranks on 2 cores). torch's ``common_utils`` imports ``expecttest``, a
  dev dependency of phalanx (``pip install -e '.[dev]'``).

Each test runs in its own subprocess (its own process session) with a deadline (``--timeout``);
a test past it is killed and counted as failed. Tests listed in ``zero_exclusions.toml`` (next
to this script) need torch-internal attributes; they run with phalanx's class too but are
reported as ``excluded`` and not counted as failures. Output: one line per test and
implementation, counts, and a last line ``RESULT {json}``. Exit status 1 when a test that
torch's class passes fails with phalanx's (and is not excluded).
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import types
import unittest
from pathlib import Path
from typing import Any

MODULE = "peer_zero_suite"
"""Name under which torch's test file is imported (in the runner and in every rank process)."""
EXCLUSIONS = Path(__file__).with_name("zero_exclusions.toml")
DEFAULT_LIFT = ("skip_if_no_gpu", "requires_accelerator_dist_backend")
ENV_FILE, ENV_IMPL, ENV_LIFT = "PHALANX_PEER_FILE", "PHALANX_PEER_IMPL", "PHALANX_PEER_LIFT"


# ---- what runs in every process (runner, per-test subprocess, rank processes) -----------------
def _lift_gates(names: list[str]) -> None:
    """Make the named decorators of torch's test helpers no-ops (before the file imports them)."""
    from torch.testing._internal import common_distributed

    def identity(fn: Any) -> Any:
        return fn

    for name in names:
        if not hasattr(common_distributed, name):
            raise SystemExit(f"--lift {name}: torch's common_distributed has no such gate")
        # Gates are either decorators (skip_if_no_gpu) or decorator factories (skip_if_lt_x_gpu(4)).
        factory = name in {"requires_accelerator_dist_backend", "skip_if_lt_x_gpu"}
        setattr(common_distributed, name, (lambda *a, **k: identity) if factory else identity)


def prepare(path: str, impl: str, lift: list[str]) -> types.ModuleType:
    """Import torch's test file as :data:`MODULE`, gates lifted, the class substituted."""
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    import torch

    torch.set_num_threads(1)
    _lift_gates(lift)
    spec = importlib.util.spec_from_file_location(MODULE, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE] = module
    spec.loader.exec_module(module)
    if impl == "phalanx":
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

        import phalanx

        for name, value in vars(module).items():
            if value is TorchZero:
                setattr(module, name, phalanx.ZeroRedundancyOptimizer)
    return module


if os.environ.get(ENV_FILE):  # a per-test subprocess or one of its rank processes
    prepare(
        os.environ[ENV_FILE],
        os.environ.get(ENV_IMPL, "torch"),
        [g for g in os.environ.get(ENV_LIFT, "").split(",") if g],
    )


# ---- one test, in its own subprocess -----------------------------------------------------------
def _run_one(test_id: str) -> None:
    """Run ``Class.test_name`` of the prepared module; print ``OUTCOME <json>``."""
    module = sys.modules[MODULE]
    suite = unittest.defaultTestLoader.loadTestsFromName(test_id, module)
    result = unittest.TextTestRunner(stream=sys.stderr, verbosity=0).run(suite)
    if result.errors or result.failures:
        outcome, detail = "failed", (result.errors + result.failures)[0][1].strip()[-3000:]
    elif result.skipped:
        outcome, detail = "skipped", result.skipped[0][1]
    else:
        outcome, detail = "passed", ""
    print("OUTCOME " + json.dumps({"outcome": outcome, "detail": detail}), flush=True)


def _spawn(path: str, impl: str, lift: list[str], test_id: str, timeout: float) -> dict[str, Any]:
    env = {**os.environ, ENV_FILE: path, ENV_IMPL: impl, ENV_LIFT: ",".join(lift)}
    cmd = [sys.executable, __file__, path, "--one", test_id]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the test and its rank processes
        out, err = proc.communicate()
        detail = f"no result within --timeout {timeout:.0f} s; stderr tail:\n{err[-2000:]}"
        return {"outcome": "timeout", "detail": detail, "seconds": timeout}
    line = next((ln for ln in out.splitlines() if ln.startswith("OUTCOME ")), None)
    if line is None:
        res = {"outcome": "failed", "detail": f"exit {proc.returncode}; stderr:\n{err[-3000:]}"}
    else:
        res = json.loads(line.removeprefix("OUTCOME "))
    res["seconds"] = round(time.monotonic() - start, 1)
    return res


# ---- the runner --------------------------------------------------------------------------------
def load_exclusions(path: Path = EXCLUSIONS) -> list[dict[str, str]]:
    """Entries ``{test, attribute, reason}``; ``test`` is a glob over ``Class.test_name``."""
    import tomllib

    with path.open("rb") as f:
        entries = tomllib.load(f).get("exclude", [])
    for e in entries:
        missing = {"test", "attribute", "reason"} - set(e)
        if missing:
            raise ValueError(f"{path}: entry {e} lacks {sorted(missing)}")
    return entries


def _excluded(test_id: str, exclusions: list[dict[str, str]]) -> dict[str, str] | None:
    return next((e for e in exclusions if fnmatch.fnmatchcase(test_id, e["test"])), None)


def _test_ids(module: types.ModuleType, pattern: str | None) -> list[str]:
    ids = []
    for name, cls in sorted(vars(module).items()):
        if (
            isinstance(cls, type)
            and issubclass(cls, unittest.TestCase)
            and cls.__module__ == MODULE
        ):
            names = unittest.defaultTestLoader.getTestCaseNames(cls)
            ids += [f"{name}.{t}" for t in names if not pattern or pattern in t]
    return ids


Results = dict[str, dict[str, dict[str, Any]]]


def _summarise(
    results: Results, exclusions: list[dict[str, str]]
) -> tuple[dict[str, dict[str, int]], list[str]]:
    counts: dict[str, dict[str, int]] = {}
    regressions = []
    for test_id, by_impl in results.items():
        for impl, res in by_impl.items():
            kind = res["outcome"]
            if impl == "phalanx" and _excluded(test_id, exclusions) and kind != "passed":
                kind = "excluded"
            bucket = counts.setdefault(impl, {})
            bucket[kind] = bucket.get(kind, 0) + 1
        torch_ok = by_impl.get("torch", {}).get("outcome") == "passed"
        ours = by_impl.get("phalanx", {}).get("outcome")
        if torch_ok and ours not in (None, "passed") and not _excluded(test_id, exclusions):
            regressions.append(test_id)
    return counts, regressions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", help="torch's test_zero_redundancy_optimizer.py")
    parser.add_argument("--impl", choices=["torch", "phalanx", "both"], default="both")
    parser.add_argument("-k", dest="pattern", help="only tests whose name contains this")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per test")
    parser.add_argument("--lift", action="append", default=[], help="another gate to lift")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--verbose", action="store_true", help="print failure details")
    args = parser.parse_args(argv)
    path = str(Path(args.path).resolve())
    lift = [*DEFAULT_LIFT, *args.lift]
    if args.one:
        prepare(path, os.environ.get(ENV_IMPL, "torch"), lift)
        _run_one(args.one)
        return 0
    exclusions = load_exclusions()
    impls = ["torch", "phalanx"] if args.impl == "both" else [args.impl]
    test_ids = _test_ids(prepare(path, "torch", lift), args.pattern)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for test_id in test_ids:
        for impl in impls:
            res = _spawn(path, impl, lift, test_id, args.timeout)
            results.setdefault(test_id, {})[impl] = res
            note = " (excluded)" if impl == "phalanx" and _excluded(test_id, exclusions) else ""
            print(
                f"{res['outcome']:8} {impl:8} {res['seconds']:6.1f}s  {test_id}{note}", flush=True
            )
            if args.verbose and res["outcome"] in ("failed", "timeout"):
                print("    " + res["detail"].replace("\n", "\n    "), flush=True)
    counts, regressions = _summarise(results, exclusions)
    for impl in impls:
        print(f"{impl}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts[impl].items())))
    for test_id in regressions:
        print(f"REGRESSION (torch's class passes, phalanx's does not): {test_id}")
    outcomes = {t: {i: r["outcome"] for i, r in by.items()} for t, by in results.items()}
    summary = {"counts": counts, "regressions": regressions, "tests": outcomes, "lifted": lift}
    print("RESULT " + json.dumps(summary))
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
