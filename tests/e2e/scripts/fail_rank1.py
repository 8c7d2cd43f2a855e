"""Rank 1 raises ValueError('boom'); every other rank sleeps 60 s.

With an argument, rank 1 first writes the wall-clock time of its failure to that file, so the
test can measure failure -> launcher exit without counting interpreter and torch start-up.
"""

import os
import sys
import time

if os.environ["RANK"] == "1":
    time.sleep(0.2)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(repr(time.time()))
    raise ValueError("boom")
time.sleep(60)
