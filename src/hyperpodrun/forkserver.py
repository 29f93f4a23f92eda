"""The launcher's side of a node's fork server (``--start-method forkserver``).

The server (:mod:`elastic_events.rounds.forkserver`) imports torch once; each rank, spare and
replacement of the node is a fork of it, re-parented to the launcher (a child subreaper), so the
supervisor handles a :class:`ForkedProcess` as it handles a ``Popen``. A command the server cannot run
as a fresh interpreter would (another interpreter, other interpreter options, a differing
``PYTHON*``/``LD_*``/thread-pool variable) is refused and started as a fresh process, as is every
command once the server is unusable (it died or did not get ready in time); each such reason is said
once on stderr.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from elastic_events.rounds.forkserver import MAX_MESSAGE, server_command

__all__ = ["ForkServer", "ForkedProcess"]

log = logging.getLogger(__name__)

#: How long a start waits for the server's imports (torch and what the first step imports).
READY_TIMEOUT_S = 120.0
#: How long a start waits for the server to fork a rank.
SPAWN_TIMEOUT_S = 30.0


class ForkedProcess:
    """A rank forked by the server and re-parented to this process: the part of ``Popen`` the supervisor uses."""

    def __init__(
        self, pid: int, args: Sequence[str], *, stdout: IO[bytes] | None = None, stderr: IO[bytes] | None = None
    ) -> None:
        self.pid, self.args = pid, list(args)
        self.stdout, self.stderr = stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # collected by someone else (psutil.wait_procs): Popen says 0 too
                self.returncode = 0
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is not None:
            return self.returncode  # type: ignore[return-value]
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            pidfd = os.pidfd_open(self.pid)
        except (OSError, AttributeError):
            pidfd = None
        try:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
                if pidfd is not None:
                    select.select([pidfd], [], [], left)  # readable once the process exited
                else:
                    time.sleep(min(0.01, left) if left is not None else 0.01)
        finally:
            if pidfd is not None:
                os.close(pidfd)
        return self.returncode  # type: ignore[return-value]


class ForkServer:
    """Starts the node's fork server at once (it imports while the launcher joins the rendezvous) and forks
    ranks from it. Thread-safe; :meth:`close` stops it."""

    def __init__(
        self,
        *,
        python: str,
        env: Mapping[str, str],
        preexec_fn: Callable[[], None] | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> None:
        self._lock = threading.Lock()
        self._said: set[str] = set()
        self._ready_deadline = time.monotonic() + ready_timeout_s
        self._ready = False
        self.broken: str | None = None
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                server_command(python, theirs.fileno()),
                env=dict(env),
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,  # not hit by a Ctrl-C meant for the launcher
                preexec_fn=preexec_fn,
            )
        finally:
            theirs.close()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def spawn(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        stdout: int,
        stderr: int,
        cwd: str | None = None,
        wait_ready: bool = True,
    ) -> ForkedProcess | None:
        """Fork a rank running ``argv`` with ``env``, its streams on the descriptors ``stdout``/``stderr``
        (the caller keeps and closes its own); None when it must be started as a fresh process instead.

        ``wait_ready``: wait for the server's imports (up to its ready timeout) if they are not done; False:
        None at once then (a parked rank or a spare, whose start must not hold the launcher's loop)."""
        with self._lock:
            if self.broken is None:
                try:
                    if not self._take_ready(wait=wait_ready):
                        return None
                    return self._spawn(argv, env=env, stdout=stdout, stderr=stderr, cwd=cwd or os.getcwd())
                except (OSError, ValueError, TimeoutError) as e:
                    self._break(f"{type(e).__name__}: {e}")
            self._say_once(f"the fork server is unusable ({self.broken}): ranks start as fresh processes")
            return None

    def _take_ready(self, *, wait: bool) -> bool:
        """Whether the server has finished its imports, reading its ready message (waited for when ``wait``)."""
        if self._ready:
            return True
        if not wait and not select.select([self._sock], [], [], 0)[0]:
            return False
        reply = self._receive(self._ready_deadline - time.monotonic(), "its imports (the ready message)")
        if "ready" not in reply:
            raise ValueError(f"unexpected first message {reply!r}")
        self._ready = True
        return True

    def _spawn(
        self, argv: Sequence[str], *, env: Mapping[str, str], stdout: int, stderr: int, cwd: str
    ) -> ForkedProcess | None:
        request = json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd}).encode()
        self._sock.settimeout(SPAWN_TIMEOUT_S)
        socket.send_fds(self._sock, [request], [stdout, stderr])
        reply = self._receive(SPAWN_TIMEOUT_S, "a fork")
        if "refused" in reply:
            self._say_once(
                f"the fork server cannot run this command ({reply['refused']}): it starts as a fresh process"
            )
            return None
        return ForkedProcess(int(reply["pid"]), argv)

    def _receive(self, timeout: float, what: str) -> dict:
        self._sock.settimeout(max(timeout, 0.001))
        try:
            message = self._sock.recv(MAX_MESSAGE)
        except TimeoutError:
            raise TimeoutError(
                f"no answer from the fork server (pid {self.pid}) within {timeout:.0f} s, waiting for {what}"
            ) from None
        if not message:
            code = self._proc.poll()
            raise OSError(f"the fork server (pid {self.pid}) exited{'' if code is None else f' with code {code}'}")
        return json.loads(message)

    def _break(self, why: str) -> None:
        self.broken = why
        self._stop()

    def _say_once(self, text: str) -> None:
        if text not in self._said:
            self._said.add(text)
            print(f"hyperpodrun: {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Stop the server (the ranks it forked are the launcher's and are not touched)."""
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        self._sock.close()  # a ready server's receive ends: it exits
        if not self._ready:
            self._proc.send_signal(signal.SIGKILL)  # still importing: nothing to lose
        try:
            self._proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(timeout=5.0)
