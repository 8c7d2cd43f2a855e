"""phalanx checkpoints vs torch.distributed.checkpoint vs raw writes, interleaved in one run.

``python benchmarks/checkpoint.py [--mb 100,1000] [--ranks 1,2] [--rounds 3] [--cold]``; see
:mod:`phalanx.bench.checkpoint`.
"""

from __future__ import annotations

import sys

from phalanx.bench.checkpoint import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
