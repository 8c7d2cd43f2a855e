"""Print this worker's whole environment as one JSON line (compared with torchrun's)."""

import json
import os

print("ENV " + json.dumps(dict(os.environ), sort_keys=True), flush=True)
