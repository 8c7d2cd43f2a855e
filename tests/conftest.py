"""Test order: the slowest tiers first, so that the two xdist workers of ``make test`` (which
take whole files in collection order) do not end on a long e2e file while the other is idle."""

from __future__ import annotations

import pytest

_FIRST = ("tests/e2e/", "tests/compat/", "tests/distributed/")


def _tier(item: pytest.Item) -> int:
    path = item.nodeid
    return next((i for i, prefix in enumerate(_FIRST) if path.startswith(prefix)), len(_FIRST))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_tier)  # stable: the order within a tier, and within a file, is kept
