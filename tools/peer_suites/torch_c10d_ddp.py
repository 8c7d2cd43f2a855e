"""Run torch's c10d DDP tests (``test_c10d_gloo.py``) with torch's and with phalanx's class.

torch's repository (not its wheel) holds ``test/distributed/test_c10d_gloo.py`` and
``test_c10d_common.py``: the CPU/gloo tests of ``DistributedDataParallel``. Fetch both into one
directory (never commit them), then::

    python tools/peer_suites/torch_c10d_ddp.py DIR [--impl torch|phalanx|both] [-k EXPR]

Each implementation runs the ``DistributedDataParallelTest`` class under pytest; with
``phalanx``, ``substitute/sitecustomize.py`` makes ``torch.nn.parallel.DistributedDataParallel``
phalanx's class in the driver and in every rank process. Prints each test's outcome per
implementation, the tests that pass with torch's class but not phalanx's (except the reviewed
list of tests that read torch-internal attributes, ``torch_c10d_ddp_internal.txt``), and
``RESULT {json}``; exit status 1 if there is any other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
SUBSTITUTE = "torch.nn.parallel.DistributedDataParallel=phalanx.DistributedDataParallel"
INTERNAL = os.path.join(HERE, "torch_c10d_ddp_internal.txt")


def internal_only() -> dict[str, str]:
    """The reviewed list: test name -> the torch-internal attribute it needs."""
    with open(INTERNAL) as f:
        rows = [line.split("#", 1)[0].split() for line in f]
    return {row[0]: row[1] for row in rows if row}


def run(directory: str, impl: str, expr: str, timeout: float) -> dict[str, str]:
    """Run the suite with ``impl`` and return ``{test: passed|failed|skipped}``."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, "substitute"), directory])
    )
    if impl == "phalanx":
        env["PHALANX_SUBSTITUTE"] = SUBSTITUTE
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.xml")
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "test_c10d_gloo.py",
            "-k",
            expr,
            f"--junitxml={report}",
            "-o",
            "addopts=",
            "--timeout",
            "300",
        ]
        subprocess.run(cmd, cwd=directory, env=env, timeout=timeout, check=False)
        return _outcomes(report)


def _outcomes(report: str) -> dict[str, str]:
    results = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        status = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                status = "failed"
            elif child.tag == "skipped":
                status = "skipped"
        results[case.get("name", "?")] = status
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="holds test_c10d_gloo.py and test_c10d_common.py")
    parser.add_argument("--impl", choices=["torch", "phalanx", "both"], default="both")
    parser.add_argument("-k", dest="expr", default="DistributedDataParallelTest")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    impls = ["torch", "phalanx"] if args.impl == "both" else [args.impl]
    runs = {impl: run(args.directory, impl, args.expr, args.timeout) for impl in impls}
    for name in sorted(set().union(*runs.values())):
        print(f"{name:70} " + " ".join(f"{i}={r.get(name, '-'):8}" for i, r in runs.items()))
    counts = {
        i: {s: sum(v == s for v in r.values()) for s in ("passed", "failed", "skipped")}
        for i, r in runs.items()
    }
    regressions, internal = [], internal_only()
    if len(runs) == 2:
        lost = [
            n
            for n, st in runs["torch"].items()
            if st == "passed" and runs["phalanx"].get(n) != "passed"
        ]
        regressions = sorted(n for n in lost if n not in internal)
        print(
            "needs torch-internal attributes:",
            {n: internal[n] for n in sorted(lost) if n in internal},
        )
        print("passes with torch's class but not phalanx's:", regressions or "none")
    print("RESULT " + json.dumps({"counts": counts, "regressions": regressions}))
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
