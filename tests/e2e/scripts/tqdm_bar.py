"""Rank 0 draws a tqdm bar over a slow loop and prints MID-EPOCH halfway; rank 1 just waits."""

import os
import time

from tqdm import tqdm

STEPS = 40
if os.environ["RANK"] == "0":
    for step in tqdm(range(STEPS), mininterval=0.05):
        time.sleep(0.05)
        if step == STEPS // 2:
            print("MID-EPOCH", flush=True)
print("END", flush=True)
