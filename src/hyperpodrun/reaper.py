"""A watchdog process that stops the ranks' process groups if the agent itself dies.

``PR_SET_PDEATHSIG`` kills a rank when its agent is killed with SIGKILL, but not
the rank's own children (dataloader workers, helpers), which would be left
behind. The reaper, started by the agent, reads process-group ids from a pipe
(``+PGID`` / ``-PGID`` lines); when the pipe closes without ``exit`` (the agent
died), it sends SIGTERM and then SIGKILL to every group still registered.

Run as ``python -m hyperpodrun.reaper``; the agent owns the write end of its stdin.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

GRACE = 2.0


class Reaper:
    """Agent side: registers groups with the watchdog process."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "hyperpodrun.reaper"],
            stdin=subprocess.PIPE,
            start_new_session=True,  # not hit by a Ctrl-C meant for the agent
            text=True,
        )

    def _send(self, line: str) -> None:
        stdin = self._proc.stdin
        if stdin is None or stdin.closed:
            return
        try:
            stdin.write(line + "\n")
            stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def add(self, pgid: int) -> None:
        self._send(f"+{pgid}")

    def remove(self, pgid: int) -> None:
        self._send(f"-{pgid}")

    def close(self) -> None:
        """Normal exit: the groups were stopped by the agent; the watchdog ends quietly."""
        self._send("exit")
        if self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass  # the watchdog is gone already: nothing is left to flush to it
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _watch() -> None:
    # Slurm sends SIGTERM to every process of a job step: the watchdog outlives it (it ends when the agent
    # closes its pipe), as the agent and its ranks do when they leave at the next agreed step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    groups: set[int] = set()
    for line in sys.stdin:
        line = line.strip()
        if line == "exit":
            return
        if line[:1] in "+-" and line[1:].isdigit():
            (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + GRACE
        while any(_alive(g) for g in groups) and time.monotonic() < deadline:
            time.sleep(0.05)


if __name__ == "__main__":
    _watch()
