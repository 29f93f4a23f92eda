"""Partial saves (``step_N.tmp-*``): who writes each one, and when one may be removed.

Rank 0 of a save writes ``WRITER`` (its host, pid and process start time) into the save's
``.tmp-*`` folder before any shard, and removes the folder itself when the save fails, so a
full disk that clears is writable again at the next save. Another partial is removed only when
its writer is known to be dead: a process of *this* host with that pid and start time no
longer exists. A partial of a live writer (an async save in flight, another job writing to the
same folder) or of a writer on another host is never touched: nothing here can tell that it is
not in progress (its files are left for the operator; loads skip it with a warning).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import psutil

__all__ = ["WRITER_NAME", "claim", "remove", "writer_gone"]

WRITER_NAME = "WRITER"


def claim(tmp: Path) -> None:
    """Create the save's folder and say who writes it (raises OSError, e.g. on a full disk)."""
    tmp.mkdir(parents=True, exist_ok=True)
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": psutil.Process().create_time()}
    (tmp / WRITER_NAME).write_text(json.dumps(me))


def remove(tmp: Path) -> None:
    """Remove a save's folder (its writer's own failed save)."""
    shutil.rmtree(tmp, ignore_errors=True)


def writer_gone(partial: Path) -> bool:
    """Whether ``partial``'s writer is known to be dead (a process of this host that no longer runs)."""
    try:
        writer = json.loads((partial / WRITER_NAME).read_text())
        host, pid, started = writer["host"], int(writer["pid"]), float(writer["started"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if host != socket.gethostname():
        return False
    try:
        return abs(psutil.Process(pid).create_time() - started) > 1.0  # the pid was reused
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False
