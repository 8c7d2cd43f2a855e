"""Lines on stdout (some with 'loss') and stderr; rank 1 fails on the first attempt only."""

import os
import sys

rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"loss 0.5 rank {rank} attempt {attempt}")
print(f"note rank {rank}")
print(f"warn rank {rank}", file=sys.stderr)
if rank == "1" and attempt == "0":
    sys.exit(3)
