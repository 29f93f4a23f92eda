"""Rank FAIL_RANK fails in the way argv[1] says: exit:<code>, signal:<name>, raise:<msg>.

With argv[2] == "first-attempt-only", it fails only when TORCHELASTIC_RESTART_COUNT is 0.
Other ranks wait (they must be stopped by the launcher).
"""

import os
import signal
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main() -> None:
    mode, _, arg = sys.argv[1].partition(":")
    only_first = len(sys.argv) > 2 and sys.argv[2] == "first-attempt-only"
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    print(
        f"rank {os.environ['RANK']} attempt {attempt} reason {os.environ.get('HYPERPODRUN_RESTART_REASON')}", flush=True
    )
    if only_first and attempt > 0:
        return
    if os.environ["RANK"] != os.environ.get("FAIL_RANK", "1"):
        time.sleep(120)  # a healthy sibling: must be stopped by the launcher, not waited for
        return
    if mode == "exit":
        sys.exit(int(arg))
    if mode == "signal":
        os.kill(os.getpid(), getattr(signal, arg))
    if mode == "raise":
        raise ValueError(arg)


if __name__ == "__main__":
    main()
