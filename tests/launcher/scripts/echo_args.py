"""Prints its argv so tests can check that options after the script reach the script."""

import json
import os
import sys

print("ARGS " + json.dumps(sys.argv[1:]), flush=True)
print(f"stderr-line rank {os.environ['RANK']}", file=sys.stderr, flush=True)
