"""One rank of Horovod's test file under ``phalanx run``: pytest in-process, outcomes to JSON.

Started by ``horovod_suite.py`` on every rank. It plays horovodrun's part (``HOROVOD_RANK``,
``HOROVOD_SIZE``, ... from the launcher's ``RANK`` / ``WORLD_SIZE``), puts the ``horovod`` shim
first on ``sys.path``, deselects the reviewed exclusions and writes ``rank<R>.json`` after every
test, so a crash or a deadline still leaves the outcomes so far.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHIM = HERE / "horovod_shim"


def _horovodrun_env() -> None:
    """The variables horovodrun's gloo launcher gives each worker, from phalanx run's."""
    env = os.environ
    rank, size = env["RANK"], env["WORLD_SIZE"]
    local_rank, local_size = env.get("LOCAL_RANK", rank), env.get("LOCAL_WORLD_SIZE", size)
    env.update(
        HOROVOD_RANK=rank,
        HOROVOD_SIZE=size,
        HOROVOD_LOCAL_RANK=local_rank,
        HOROVOD_LOCAL_SIZE=local_size,
        HOROVOD_CROSS_RANK=env.get("GROUP_RANK", "0"),
        HOROVOD_CROSS_SIZE=str(int(size) // int(local_size)),
    )
    env.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", "60")


def _hide_optimizers(names: list[str]) -> None:
    """Leave these classes out of ``torch.optim.Optimizer.__subclasses__()`` (the rules file
    says why): tests that build every optimizer with one model skip the ones that refuse it."""
    import torch

    def subclasses(cls: type) -> list[type]:
        return [k for k in type.__subclasses__(cls) if k.__name__ not in names]

    if names:
        torch.optim.Optimizer.__subclasses__ = classmethod(subclasses)  # type: ignore[assignment, method-assign]


def _import_path() -> None:
    sys.path.insert(0, str(SHIM))
    for name in ("mock", "cloudpickle"):  # imported by Horovod's test helpers, not used
        try:
            __import__(name)
        except ImportError:
            sys.path.append(str(SHIM / "_standins"))


class Recorder:
    """pytest plugin: one outcome per test (passed / failed / skipped) with its reason."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.outcomes: dict[str, dict[str, Any]] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        name = report.nodeid.split("::")[-1]
        entry = self.outcomes.setdefault(name, {"outcome": "passed", "reason": ""})
        if report.failed:
            entry.update(outcome="failed", reason=f"{report.when}: {_last_line(report)}")
        elif report.skipped and entry["outcome"] != "failed":
            entry.update(outcome="skipped", reason=_skip_reason(report))
        if report.when == "teardown":
            self.path.write_text(json.dumps(self.outcomes, indent=1))


def _last_line(report: Any) -> str:
    text = str(report.longrepr).strip().splitlines()
    errors = [line for line in text if line.startswith("E ")]
    return (errors[-1] if errors else text[-1] if text else "?")[:300]


def _skip_reason(report: Any) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("test_file")
    parser.add_argument("out_dir")
    parser.add_argument("--deselect", action="append", default=[])
    parser.add_argument("--hide-optimizer", action="append", default=[])
    parser.add_argument("--per-test-timeout", type=int, default=240)
    parser.add_argument("-k", default=None)
    args = parser.parse_args()
    _horovodrun_env()
    _import_path()
    import pytest
    import torch

    torch.set_num_threads(1)  # two ranks share two cores
    _hide_optimizers(args.hide_optimizer)
    recorder = Recorder(Path(args.out_dir) / f"rank{os.environ['RANK']}.json")
    test_file = str(Path(args.test_file).resolve())
    argv = [
        test_file,
        "-c",
        os.devnull,
        "-q",
        "-p",
        "no:cacheprovider",
        f"--timeout={args.per_test_timeout}",
    ]
    argv += [f"--deselect={test_file}::TorchTests::{name}" for name in args.deselect]
    if args.k:
        argv += ["-k", args.k]
    code = pytest.main(argv, plugins=[recorder])
    recorder.path.write_text(json.dumps(recorder.outcomes, indent=1))
    return 0 if code in (0, 1, 5) else int(code)


if __name__ == "__main__":
    sys.exit(main())
