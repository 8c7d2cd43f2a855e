"""Run Horovod's own ``test/parallel/test_torch.py`` against ``phalanx.horovod`` on two ranks.

Usage::

    python tools/peer_suites/horovod_suite.py PATH/TO/test_torch.py [--nproc 2] [--timeout 1800]

Horovod's file is not part of phalanx: fetch it (and ``test/utils/common.py`` beside it, at
``../utils/common.py`` relative to the test file) into the git-ignored ``.peer/`` directory.
The runner starts ``phalanx run --standalone --nproc-per-node N horovod_rank.py ...`` under one
deadline; every rank runs the same tests in the same order (Horovod's tests compare ranks through
collectives) minus the reviewed exclusions in ``horovod_exclusions.txt``. It merges the ranks'
outcomes (a test passes only if it passed on every rank), prints the counts, the reason for every
skip, exclusion and failure, and ends with one line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
EXCLUSIONS = HERE / "horovod_exclusions.txt"


def read_rules(path: Path) -> tuple[dict[str, str], dict[str, str]]:
    """``({test: reason}, {hidden optimizer: reason})`` from the reviewed rules file.

    Lines are ``test_name: reason`` (the test is not run) or ``hide torch.optim.Name: reason``
    (the optimizer class is left out of ``torch.optim.Optimizer.__subclasses__()``, which some
    tests enumerate); ``#`` starts a comment.
    """
    exclusions: dict[str, str] = {}
    hidden: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, reason = (part.strip() for part in line.partition(":"))
        if name.startswith("hide torch.optim.") and sep and reason:
            hidden[name.removeprefix("hide torch.optim.")] = reason
        elif name.startswith("test") and sep and reason:
            exclusions[name] = reason
        else:
            raise ValueError(
                f"{path}:{n}: expected 'test_name: reason' or "
                f"'hide torch.optim.Name: reason', got {raw!r}"
            )
    return exclusions, hidden


def merge(per_rank: list[dict[str, Any]], nproc: int) -> dict[str, dict[str, str]]:
    """One outcome per test: failed if it failed (or is missing) on any rank, skipped if
    skipped on every rank, passed if passed on every rank."""
    names = list(dict.fromkeys(n for outcomes in per_rank for n in outcomes))
    merged = {}
    for name in names:
        got = [outcomes.get(name) for outcomes in per_rank]
        missing = [r for r, g in enumerate(got) if g is None]
        kinds = {g["outcome"] for g in got if g is not None}
        failed = [
            f"rank {r}: {g['reason']}"
            for r, g in enumerate(got)
            if g is not None and g["outcome"] == "failed"
        ]
        if missing:
            failed.append(f"no outcome from rank(s) {missing} (crashed or past the deadline)")
        if failed:
            merged[name] = {"outcome": "failed", "reason": "; ".join(failed)}
        elif kinds == {"skipped"}:
            merged[name] = {"outcome": "skipped", "reason": got[0]["reason"]}  # type: ignore[index]
        elif kinds == {"passed"}:
            merged[name] = {"outcome": "passed", "reason": ""}
        else:
            merged[name] = {"outcome": "failed", "reason": f"ranks disagree: {kinds}"}
    return merged


def _launch(
    args: argparse.Namespace, out_dir: Path, excluded: list[str], hidden: list[str]
) -> tuple[int, float]:
    cmd = [
        sys.executable,
        "-m",
        "phalanx",
        "run",
        "--standalone",
        "--nproc-per-node",
        str(args.nproc),
        str(HERE / "horovod_rank.py"),
        str(Path(args.test_file).resolve()),
        str(out_dir),
        f"--per-test-timeout={args.per_test_timeout}",
    ]
    cmd += [f"--deselect={name}" for name in excluded]
    cmd += [f"--hide-optimizer={name}" for name in hidden]
    if args.k:
        cmd += ["-k", args.k]
    log = (out_dir / "log.txt").open("w")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        code = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # phalanx run forwards it to every rank and stops
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        code = -1
    log.close()
    return code, time.monotonic() - start


def _report(
    merged: dict[str, dict[str, str]], exclusions: dict[str, str], hidden: dict[str, str]
) -> dict[str, Any]:
    counts = {
        k: sum(v["outcome"] == k for v in merged.values()) for k in ("passed", "failed", "skipped")
    }
    counts["excluded"] = len(exclusions)
    for kind in ("skipped", "failed"):
        rows = [(n, v["reason"]) for n, v in merged.items() if v["outcome"] == kind]
        if rows:
            print(f"\n{kind.upper()} ({len(rows)}):")
            for name, reason in rows:
                print(f"  {name}: {reason}")
    if exclusions:
        print(f"\nEXCLUDED ({len(exclusions)}, from {EXCLUSIONS.name}):")
        for name, reason in exclusions.items():
            print(f"  {name}: {reason}")
    for name, reason in hidden.items():
        print(f"\nADAPTED: torch.optim.{name} hidden from Optimizer.__subclasses__(): {reason}")
    print("\n" + ", ".join(f"{v} {k}" for k, v in counts.items()))
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("test_file", help="Horovod's test/parallel/test_torch.py")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=1800.0, help="deadline for the job (s)")
    parser.add_argument("--per-test-timeout", type=int, default=240)
    parser.add_argument("-k", default=None, help="pytest -k expression (a subset, for debugging)")
    parser.add_argument("--keep", action="store_true", help="keep the per-rank logs")
    args = parser.parse_args()
    exclusions, hidden = read_rules(EXCLUSIONS)
    out_dir = Path(tempfile.mkdtemp(prefix="phalanx-peer-horovod-"))
    code, wall = _launch(args, out_dir, list(exclusions), list(hidden))
    per_rank = []
    for r in range(args.nproc):
        path = out_dir / f"rank{r}.json"
        per_rank.append(json.loads(path.read_text()) if path.exists() else {})
    merged = merge(per_rank, args.nproc)
    counts = _report(merged, exclusions, hidden)
    status = "deadline" if code == -1 else f"exit {code}"
    print(f"job: {status} after {wall:.0f} s; logs: {out_dir / 'log.txt'}")
    by_kind = {
        k: {n: v["reason"] for n, v in merged.items() if v["outcome"] == k}
        for k in ("failed", "skipped")
    }
    result = {
        "suite": "horovod/test/parallel/test_torch.py",
        "nproc": args.nproc,
        **counts,
        "wall_s": round(wall, 1),
        "job": status,
        "failed_tests": by_kind["failed"],
        "skipped_tests": by_kind["skipped"],
        "excluded_tests": exclusions,
        "hidden_optimizers": hidden,
    }
    print("RESULT " + json.dumps(result))
    if not args.keep and counts["failed"] == 0 and code == 0:
        shutil.rmtree(out_dir, ignore_errors=True)
    return 0 if counts["failed"] == 0 and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
