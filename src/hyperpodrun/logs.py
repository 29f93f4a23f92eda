"""Worker log destinations: one folder per attempt, never deleted; tee and rank prefixes.

Layout (torchrun's, except that an existing attempt folder is never removed)::

    <log_dir>/<run_id>/attempt_<n>/<local_rank>/{stdout.log,stderr.log,error.json}

``n`` counts every start of the worker group by this agent (restarts and scale
events alike); if a folder of that name exists from an earlier launch, the next
free number is used, so nothing of an earlier attempt is ever overwritten.

Without ``--log-dir`` the logs go to a fresh ``hyperpodrun_*`` folder in the system
temporary directory, which is removed when the job succeeds and kept when it fails
(the failure message names a log file in it). torchrun keeps its ``torchelastic_*``
folders in every case, so they pile up; a folder worth keeping needs ``--log-dir``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hyperpodrun.config import Std


@dataclass(frozen=True, kw_only=True)
class RankLogs:
    """Where one local rank's streams go.

    Both streams are always kept in the attempt folder, so a failure summary can
    always name a log file; ``--redirects``/``--tee`` decide what the console shows.
    """

    stdout_file: Path
    stderr_file: Path
    error_file: Path
    console_stdout: bool  # echo to the launcher's console (prefixed with the rank)
    console_stderr: bool


class LogDirectory:
    """Allocates attempt folders under ``<root>/<run_id>``; a temporary root when none is given."""

    def __init__(self, root: Path | None, run_id: str) -> None:
        self.temporary = root is None
        if root is None:
            root = Path(tempfile.mkdtemp(prefix="hyperpodrun_"))
        self.root = Path(root)
        self.run_dir = self.root / run_id
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def finish(self, *, succeeded: bool) -> None:
        """Remove a temporary root after a successful job, or a failed one that started no
        worker (nothing in it to read); keep it when workers ran and the job failed."""
        started = any(self.run_dir.glob("attempt_*"))
        if self.temporary and (succeeded or not started):
            shutil.rmtree(self.root, ignore_errors=True)

    def new_attempt(self, attempt: int) -> Path:
        n = attempt
        while True:
            path = self.run_dir / f"attempt_{n}"
            try:
                path.mkdir()
                return path
            except FileExistsError:
                n += 1

    @staticmethod
    def rank_logs(
        attempt_dir: Path,
        local_rank: int,
        *,
        redirect: Std,
        tee: Std,
        show_on_console: bool,
    ) -> RankLogs:
        rank_dir = attempt_dir / str(local_rank)
        rank_dir.mkdir(parents=True, exist_ok=True)
        return RankLogs(
            stdout_file=rank_dir / "stdout.log",
            stderr_file=rank_dir / "stderr.log",
            error_file=rank_dir / "error.json",
            console_stdout=show_on_console and (not redirect & Std.OUT or bool(tee & Std.OUT)),
            console_stderr=show_on_console and (not redirect & Std.ERR or bool(tee & Std.ERR)),
        )


class StreamPump(threading.Thread):
    """Copies a worker's pipe to a log file and/or the console, prefixing console lines."""

    _console_lock = threading.Lock()

    def __init__(self, pipe: IO[bytes], *, prefix: str, file: Path, console: IO[str] | None) -> None:
        super().__init__(daemon=True, name=f"pump{prefix}")
        self._pipe = pipe
        self._prefix = prefix.encode()
        self._file = file
        self._console = console

    def relabel(self, prefix: str) -> None:
        """Prefix the console lines from now on with ``prefix`` (a spare that became a rank)."""
        self._prefix = prefix.encode()

    def run(self) -> None:
        sink = open(self._file, "ab", buffering=0)
        try:
            for line in iter(self._pipe.readline, b""):
                sink.write(line)
                if self._console is not None:
                    text = (self._prefix + line).decode(errors="replace")
                    with self._console_lock:
                        self._console.write(text if text.endswith("\n") else text + "\n")
                        self._console.flush()
        except (OSError, ValueError):
            pass  # the pipe or console was closed under us during shutdown
        finally:
            sink.close()
            self._pipe.close()


def open_for_child(path: Path) -> int:
    """A file descriptor a child writes to directly (a stream that is not shown on the console)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
