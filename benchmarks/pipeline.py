"""phalanx pipelines vs torch.distributed.pipelining: ``python benchmarks/pipeline.py [--quick]``.

Same as ``phalanx bench pipeline``; see :mod:`phalanx.bench.pipeline`.
"""

from __future__ import annotations

import sys

from phalanx.bench.pipeline import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
