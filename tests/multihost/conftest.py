"""The multi-host tier: every test here runs launchers on namespace hosts (``bench.hosts``),
each with its own network, host name, ``/dev/shm`` and ``/tmp``; ``tmp_path`` is shared, as NFS
would be. The tier skips, naming why, where namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.bench.hosts import Hosts
from tests.multihost.hosts import make_hosts


@pytest.fixture
def two_hosts(tmp_path: Path) -> Iterator[Hosts]:
    """Two namespace hosts on a bridge (``mh0``, ``mh1``) sharing ``tmp_path``."""
    yield from make_hosts(2, tmp_path)


@pytest.fixture
def three_hosts(tmp_path: Path) -> Iterator[Hosts]:
    """Three namespace hosts on a bridge (``mh0`` .. ``mh2``) sharing ``tmp_path``."""
    yield from make_hosts(3, tmp_path)


@pytest.fixture
def two_hosts_100mbit(tmp_path: Path) -> Iterator[Hosts]:
    """Two namespace hosts whose links are capped at 100 Mbit/s each way (``tc tbf``)."""
    yield from make_hosts(2, tmp_path, mbit=100)
