"""SIGKILL a process at random moments while it saves asynchronously; check what survives.

    python tools/checkpoint_async_soak.py --kills 20 [--mb 48] [--window 2.0] [--seed 0]

Not part of ``make test`` (a minute or two). Each run starts ``tests/e2e/scripts/async_saver.py``,
which saves with ``checkpoint.save(async_=True)`` in a loop and changes its state in place while
each background write runs, logging a digest of the state at each ``save`` call and
each commit. Once its first checkpoint is committed, this script SIGKILLs it after a random delay
(uniform in ``[0, window]`` seconds) and then loads the newest committed checkpoint.

A run is correct when a checkpoint loads, its step is at least the last one the saver saw
committed, and its tensors' digest is the one recorded when that step was saved. Reported per
run, and on the last line as ``RESULT {json}``: correct runs, and how many kills landed inside a
background write (a ``.tmp-step-*`` directory was left behind).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from tests.e2e.scripts.async_saver import verify  # noqa: E402

SAVER = ROOT / "tests" / "e2e" / "scripts" / "async_saver.py"


def _committed_once(log: Path, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and "committed 1\n" in log.read_text():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"the saver exited ({proc.returncode}) before its first commit")
        time.sleep(0.02)
    raise TimeoutError(f"no first commit within {timeout} s")


def _run(work: Path, mb: float, delay: float, env: dict[str, str]) -> dict[str, object]:
    directory, log = work / "ckpt", work / "log"
    cmd = [sys.executable, str(SAVER), str(directory), str(log), "--mb", str(mb)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    try:
        _committed_once(log, proc, 120)
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # leftovers of the killed write are named
        found = verify(directory, log, mb)
    loaded, committed = found["loaded"], found["committed"]
    ok = isinstance(loaded, int) and isinstance(committed, int) and loaded >= committed
    return {**found, "delay_s": round(delay, 3), "correct": ok and found["equal"] is True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--mb", type=float, default=48.0, help="size of the saved state")
    parser.add_argument("--window", type=float, default=2.0, help="kill within this many s")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    runs = []
    with tempfile.TemporaryDirectory(prefix="phalanx-async-soak-") as tmp:
        for i in range(args.kills):
            work = Path(tmp) / f"run-{i:02d}"
            work.mkdir()
            run = _run(work, args.mb, rng.uniform(0, args.window), env)
            runs.append(run)
            print(f"kill {i + 1}/{args.kills}: {json.dumps(run)}", flush=True)
    result = {
        "kills": len(runs),
        "correct": sum(bool(r["correct"]) for r in runs),
        "inside_a_write": sum(bool(r["in_write"]) for r in runs),
        "loaded_the_write_in_flight": sum(
            isinstance(r["loaded"], int) and r["loaded"] > r["committed"]  # type: ignore[operator]
            for r in runs
        ),
        "mb": args.mb,
        "window_s": args.window,
    }
    print("RESULT " + json.dumps(result))
    sys.exit(0 if result["correct"] == result["kills"] else 1)


if __name__ == "__main__":
    main()
