"""Training over slow links: replicas that train alone and synchronise every H steps.

- :class:`LocalSGDSync`: average the parameters (and floating-point buffers) every H steps.
- :class:`DiLoCoSync`: DiLoCo's outer Nesterov step on the averaged pseudo-gradient every H
  inner steps (Douillard et al. 2023).
- :mod:`.checkpoint`: each rank's replica and inner optimizer state, plus the shared state.

``phalanx.LocalSGD`` and ``phalanx.DiLoCo`` (``train/strategies/local_sgd.py``) run them in a
:class:`phalanx.Job`.
"""

from __future__ import annotations

from phalanx.local_sgd.diloco import DiLoCoSync
from phalanx.local_sgd.local_sgd import LocalSGDSync
from phalanx.local_sgd.outer import Outer
from phalanx.local_sgd.periodic import PeriodicSync
from phalanx.local_sgd.replicas import Replica
from phalanx.local_sgd.stats import SyncStats

__all__ = ["DiLoCoSync", "LocalSGDSync", "Outer", "PeriodicSync", "Replica", "SyncStats"]
