"""Each rank prints 2000 lines, each in five pieces (print with several arguments, unbuffered)."""

import os

rank = os.environ["RANK"]
for i in range(2000):
    print("rank", rank, "line", i, "end")
