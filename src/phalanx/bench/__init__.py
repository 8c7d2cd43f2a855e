"""phalanx benchmarks: phalanx against the torch-native equivalent, interleaved in one run.

Each benchmark module has ``main(argv) -> int``, prints a human table and ends with one line
``RESULT {json}``. ``phalanx bench comm`` runs :mod:`phalanx.bench.comm`.
"""

from __future__ import annotations

__all__: list[str] = []
