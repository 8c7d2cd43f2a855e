"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from phalanx.bench.slow_link import Link
from tests.e2e.namespaces import link_pair


@pytest.fixture
def pair() -> Iterator[Link]:
    """Two network namespaces joined by a veth pair (skips where they cannot be made)."""
    yield from link_pair()
