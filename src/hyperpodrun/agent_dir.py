"""The agent's node-local folder (``/dev/shm/hyperpodrun-*``): owned through a lock, swept when stale.

The folder holds the control channel and the ranks' hand-offs (a full model and optimizer
state), so a folder left by an agent that died (``kill -9``, a lost node) costs memory until
something removes it. Each agent holds an exclusive ``flock`` on ``agent.lock`` in its folder
for its whole life; the kernel drops the lock when the process dies, however it dies. At
start, an agent removes every folder of its user whose lock nobody holds, and notes the live
agents of the same job (``--rdzv-id``) on this host: two launchers of one job on one host
both give their ranks ``LOCAL_RANK`` 0 upward (the same GPUs).

The lock file gets its content and its lock under a temporary name and is then renamed into
place, so a sweeping agent never sees it unlocked. Folders without a lock file (another
program's, or the per-user store-secret folder ``hyperpodrun-<uid>``) are never touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["AgentDir", "default_root", "sweep"]

PREFIX = "hyperpodrun-"
LOCK = "agent.lock"


def default_root() -> str | None:
    """``/dev/shm`` where it exists and is writable (memory-backed), else the temporary folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@dataclass(frozen=True)
class Swept:
    """What :func:`sweep` found: folders removed, and the pids of live agents of the same job."""

    removed: tuple[Path, ...]
    same_job: tuple[int, ...]


def _try_lock(path: Path) -> int | None:
    """An fd holding ``path``'s exclusive lock, or None when a live process holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def sweep(root: Path, *, job: str | None) -> Swept:
    """Remove this user's agent folders under ``root`` whose owner is dead; the live agents of ``job``."""
    removed: list[Path] = []
    same_job: list[int] = []
    try:
        candidates = [p for p in root.iterdir() if p.name.startswith(PREFIX)]
    except OSError:
        return Swept((), ())
    for folder in candidates:
        lock = folder / LOCK
        try:
            if folder.is_symlink() or folder.stat().st_uid != os.getuid() or not lock.is_file():
                continue
        except OSError:
            continue
        fd = _try_lock(lock)
        if fd is None:  # alive
            if job is not None and (owner := _read_owner(lock)) is not None and owner.get("job") == job:
                same_job.append(int(owner.get("pid", 0)))
            continue
        try:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            os.close(fd)
    return Swept(tuple(removed), tuple(same_job))


def _read_owner(lock: Path) -> dict | None:
    try:
        owner = json.loads(lock.read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


class AgentDir:
    """This agent's folder, locked for the agent's life; :meth:`close` removes it."""

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._fd: int | None = lock_fd

    @classmethod
    def create(cls, *, job: str | None, root: str | None = None) -> tuple[AgentDir, Swept]:
        """Sweep stale folders, then make and lock a fresh one; ``job`` None: no job to compare."""
        root = root if root is not None else default_root()
        swept = sweep(Path(root or tempfile.gettempdir()), job=job)
        path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))
        staging = path / f".{LOCK}.{os.getpid()}"
        fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, json.dumps({"pid": os.getpid(), "job": job}).encode())
            os.rename(staging, path / LOCK)
        except BaseException:
            os.close(fd)
            shutil.rmtree(path, ignore_errors=True)
            raise
        return cls(path, fd), swept

    def close(self) -> None:
        """Remove the folder, then drop the lock."""
        if self._fd is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = None
