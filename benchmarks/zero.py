"""phalanx ZeRO-1/2/3 vs torch ZeRO-1 and FSDP2, one run: ``python benchmarks/zero.py [--quick]``.

Same as ``phalanx bench zero``; see :mod:`phalanx.bench.zero`.
"""

from __future__ import annotations

import sys

from phalanx.bench.zero import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
