"""Writes this rank's environment to OUT_DIR/env_<RANK>.json (argv[1] is OUT_DIR)."""

import json
import os
import sys
from pathlib import Path

Path(sys.argv[1], f"env_{os.environ['RANK']}.json").write_text(json.dumps(dict(os.environ)))
