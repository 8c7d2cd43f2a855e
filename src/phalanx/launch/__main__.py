"""``python -m phalanx.launch ...`` is ``phalanx run ...``."""

from __future__ import annotations

import sys

from phalanx.launch.run import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
