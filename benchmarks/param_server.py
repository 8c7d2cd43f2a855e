"""Parameter-server consistency modes against a straggler: ``python benchmarks/param_server.py``.

Same as ``phalanx bench param_server``; see :mod:`phalanx.bench.param_server`.
"""

from __future__ import annotations

import sys

from phalanx.bench.param_server import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
