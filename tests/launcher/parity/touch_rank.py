"""A worker for the torchrun parity tests: prints the launcher's variables, touches DIR/<RANK>.

argv: DIR [--fail]. With --fail it raises instead (a worker exception). No torch import: each
rank starts in a fraction of a second, so a launch costs the launcher's own time.
"""

import json
import os
import sys
from pathlib import Path

VARS = (
    "LOCAL_RANK",
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
    "TEST_SENTINEL_PARENT",
)

if __name__ == "__main__":
    out = Path(sys.argv[1])
    if "--fail" in sys.argv:
        raise RuntimeError("raising exception since --fail flag was set")
    seen = {name: os.environ.get(name) for name in VARS}
    print(f"creating {out / os.environ['RANK']}", flush=True)
    (out / os.environ["RANK"]).write_text(json.dumps({"env": seen, "main": __name__, "argv": sys.argv[2:]}))
