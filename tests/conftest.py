"""Settings for every test process, made before any test module imports torch.

``OMP_WAIT_POLICY=PASSIVE`` (unless set already): torch's OpenMP threads (libgomp) sleep as soon
as a parallel region ends instead of spinning for it first. It changes no result and no
variable phalanx reads; it stops idle threads of the pytest workers, and of the processes they
start by hand (every child inherits it), from burning CPU that the other processes of a loaded
machine need. On the 2-core CI box, seed 004's ``mnist.py`` started by hand on 3 ranks
(``tests/e2e/test_examples.py``) took 41 CPU-seconds with libgomp's default and 24 with this.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

FIRST = ("multihost", "e2e", "compat", "docs", "distributed")
"""Test folders in the order their files start, the rest after (in collection order). pytest-xdist
(``--dist loadfile``) hands out files in collection order; alphabetically the multi-host tier's
long, mostly waiting files came last and ran past the others' end. Long files first, the many
short unit tests last to fill the workers' gaps."""


def pytest_collection_modifyitems(items: list[object]) -> None:
    def folder(item: object) -> int:
        parts = getattr(item, "nodeid", "").split("/")
        name = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
        return FIRST.index(name) if name in FIRST else len(FIRST)

    items.sort(key=folder)  # stable: each file's tests stay together and in order


CPU_LOG_ENV = "PHALANX_TEST_CPU_LOG"
"""A file: each test appends its CPU seconds (its process and the children it waited for) and
its wall seconds, its end (seconds since the epoch) and its pytest-xdist worker, to find what
makes ``make test`` slow on two cores (``tools/test_cpu.py`` sums it by file and shows when each
worker ran out of work)."""

if os.environ.get(CPU_LOG_ENV):
    import resource
    import time
    from collections.abc import Iterator

    import pytest

    def _cpu() -> float:
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
        cpu, wall = _cpu(), time.monotonic()
        yield
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        took = f"{_cpu() - cpu:.2f}\t{time.monotonic() - wall:.2f}"
        line = f"{took}\t{item.nodeid}\t{time.time():.2f}\t{worker}\n"
        with open(os.environ[CPU_LOG_ENV], "a") as log:
            log.write(line)
