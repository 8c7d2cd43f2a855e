"""phalanx tensor parallel vs torch DTensor: ``python benchmarks/tensor_parallel.py [--quick]``.

Same as ``phalanx bench tensor_parallel``; see :mod:`phalanx.bench.tensor_parallel`.
"""

from __future__ import annotations

import sys

from phalanx.bench.tensor_parallel import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
