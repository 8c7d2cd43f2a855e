"""Rank 0 stops in pdb, then asks for a name with input(); every rank prints DONE."""

import os

PROMPT = "".join(["your", " name? "])  # not spelled out: pdb shows this source line
answer = 41
if os.environ["RANK"] == "0":
    breakpoint()
    name = input(PROMPT)
    print(f"hello {name}")
print(f"DONE {answer + 1}")
