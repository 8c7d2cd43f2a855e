"""Write this worker's pid, its child's pid and MASTER_PORT to DIR/rank<N>.json, then sleep."""

import json
import os
import subprocess
import sys
import time

out_dir = sys.argv[1]
child = subprocess.Popen(["sleep", "60"])
info = {"pid": os.getpid(), "child": child.pid, "master_port": os.environ["MASTER_PORT"]}
tmp = os.path.join(out_dir, f".rank{os.environ['RANK']}.tmp")
with open(tmp, "w") as f:
    json.dump(info, f)
os.replace(tmp, os.path.join(out_dir, f"rank{os.environ['RANK']}.json"))
time.sleep(60)
