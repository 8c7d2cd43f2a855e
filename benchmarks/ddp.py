"""torch DDP vs phalanx DDP, interleaved in one invocation: ``python benchmarks/ddp.py [--quick]``.

Same as ``phalanx bench ddp``; see :mod:`phalanx.bench.ddp`.
"""

from __future__ import annotations

import sys

from phalanx.bench.ddp import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
