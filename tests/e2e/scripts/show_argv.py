"""Print how this script was started: its argv and __name__ (as a file, a module or run_path)."""

import json
import os
import sys

shown = {"argv": sys.argv[1:], "name": __name__, "file": os.path.basename(sys.argv[0])}
print("ARGV " + json.dumps(shown), flush=True)
