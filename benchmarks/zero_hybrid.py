"""Hybrid ZeRO-3 vs ZeRO-3, DDP and torch HSDP on 2 hosts x 2 ranks over a slow link, one run:
``python benchmarks/zero_hybrid.py [--quick] [--mbit 100]``.

Same as ``phalanx bench zero_hybrid``; see :mod:`phalanx.bench.zero_hybrid`.
"""

from __future__ import annotations

import sys

from phalanx.bench.zero_hybrid import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
