"""Write to stdout and stderr, including a line in two pieces (run with -m under a launcher)."""

import os
import sys

rank = os.environ["RANK"]
print(f"out from {rank}")
print(f"err from {rank}", file=sys.stderr)
sys.stdout.write(f"partial {rank}")
sys.stdout.flush()
print(" done")
