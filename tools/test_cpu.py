"""Sum the per-test CPU log of a test run by file: what makes ``make test`` slow on 2 cores.

Usage::

    PHALANX_TEST_CPU_LOG=/tmp/cpu.tsv make pytest    # each test appends a line (tests/conftest.py)
    python tools/test_cpu.py /tmp/cpu.tsv [--top 40]

CPU is the test process's and that of the children it waited for (launchers and their
workers); a forkserver's children count when the forkserver exits, so ``run_distributed``
tests show less than they cost. Where the log has each test's end and worker (newer logs), the
last lines say when each pytest-xdist worker ran out of work and the file it ran last: the
tail where fewer workers than cores are busy.
"""

from __future__ import annotations

import argparse
from collections import defaultdict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    cpu: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    ends: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    with open(args.log) as f:
        for line in f:
            c, w, nodeid, *when = line.rstrip("\n").split("\t")
            path = nodeid.split("::")[0]
            cpu[path] += float(c)
            wall[path] += float(w)
            count[path] += 1
            if when:
                end, worker = when
                ends[worker].append((float(end), float(w), path))
    print(f"{'cpu s':>8} {'wall s':>8} {'tests':>5}  file")
    for path in sorted(cpu, key=cpu.__getitem__, reverse=True)[: args.top]:
        print(f"{cpu[path]:8.1f} {wall[path]:8.1f} {count[path]:5d}  {path}")
    print(f"{sum(cpu.values()):8.1f} {sum(wall.values()):8.1f} {sum(count.values()):5d}  total")
    if ends:
        print_tail(ends)


def print_tail(ends: dict[str, list[tuple[float, float, str]]]) -> None:
    """When each worker's last test ended (seconds after the first test began), and its last
    file: a worker that ends long before the others left a core idle."""
    start = min(end - took for tests in ends.values() for end, took, _ in tests)
    print("\nworker   ends at s  last file")
    for worker, tests in sorted(ends.items(), key=lambda kv: max(kv[1])[0]):
        end, _, path = max(tests)
        print(f"{worker:8} {end - start:9.1f}  {path}")


if __name__ == "__main__":
    main()
