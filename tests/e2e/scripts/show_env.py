"""Print this worker's whole environment as one JSON line (compared with torchrun's).

One write of the whole line: torchrun's workers share one stdout pipe, and print() may write
the text and its newline separately, so the other worker's line could land between them.
"""

import json
import os
import sys

sys.stdout.write("ENV " + json.dumps(dict(os.environ), sort_keys=True) + "\n")
sys.stdout.flush()
