"""Each rank starts a grandchild process, writes both pids to argv[1]/pids_<RANK>, then sleeps."""

import os
import subprocess
import sys
import time
from pathlib import Path

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
out = Path(sys.argv[1], f"pids_{os.environ['RANK']}")
out.with_suffix(".tmp").write_text(f"{os.getpid()} {child.pid}")
out.with_suffix(".tmp").rename(out)
time.sleep(300)
