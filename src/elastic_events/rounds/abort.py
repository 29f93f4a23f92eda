"""Aborting a broken gloo group: gloo has no ``abort``, so its sockets are shut down.

A gloo collective whose peer died ends when it sees the peer's connection close. Until
its timeout (``ElasticConfig.timeout_s``, 600 s by default) it waits when it does not
see that: a peer that is alive but has left the broken group (a gloo group closes its
sockets only once nothing references it), or, seen under load, a dead peer whose end a
survivor blocked in DDP's ``backward()`` never noticed. NCCL communicators have
``abort``; for gloo this module does the same from outside the blocked call: it shuts
down (``shutdown(2)``, not ``close``: the descriptors stay gloo's) the connections the
round's groups made (never a listener: gloo's accept loop calls ``std::terminate`` when its
socket fails), so every wait on them ends at once with a connection error and
every peer's end of them sees it too.

* :func:`begin_round` names the round being formed; :func:`tracking` wraps the forming of
  each of its groups (:func:`forming` does both for the round's default group) (gloo connects its full mesh there): the sockets the process gained
  meanwhile are the round's (``/proc/self/fd``, Linux). A socket another thread of the
  process opens in that window is counted with them.
* :func:`shutdown_round` shuts them down, once, and only while the round is the current
  one: a round that has begun forming (:func:`begin_round`) is never touched.
* :func:`peer_closed` tells whether a peer has closed one of the round's connections (it died):
  evidence of a peer failure that does not depend on what an error message says.
* :class:`~elastic_events.rounds.watchdog.Watchdog` is the thread that calls :func:`shutdown_round`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator

__all__ = [
    "begin_round",
    "current_round",
    "forming",
    "peer_closed",
    "shutdown_round",
    "shutdown_sockets",
    "socket_inodes",
    "tracking",
]

_FD_DIR = "/proc/self/fd"
_lock = threading.Lock()
_round: int | None = None  # the round whose sockets are tracked
_tracked: set[int] = set()  # their inode numbers


def socket_inodes() -> dict[int, int]:
    """The sockets this process has open: descriptor -> inode number (empty where /proc is absent)."""
    found: dict[int, int] = {}
    try:
        fds = os.listdir(_FD_DIR)
    except OSError:
        return found
    for name in fds:
        try:
            target = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            found[int(name)] = int(target[8:-1])
    return found


def begin_round(round: int) -> None:
    """The process now forms ``round``'s groups: what an earlier round tracked is no longer shut down."""
    global _round
    with _lock:
        _round = round
        _tracked.clear()


@contextlib.contextmanager
def forming(round: int) -> Iterator[None]:
    """Form ``round``'s process group in the block: :func:`begin_round`, then :func:`tracking`."""
    begin_round(round)
    with tracking():
        yield


@contextlib.contextmanager
def tracking(into: set[int] | None = None) -> Iterator[None]:
    """Count the sockets the process gains in the block (a group being formed) as the current round's,
    and add them to ``into`` too (a group that is shut down on its own, see :mod:`elastic_events.rounds.snapshot`)."""
    current, before = _round, set(socket_inodes().values())
    try:
        yield
    finally:
        gained = set(socket_inodes().values()) - before
        if into is not None:
            into.update(gained)
        with _lock:
            if current is not None and _round == current:
                _tracked.update(gained)


def shutdown_round(round: int) -> int:
    """Shut down ``round``'s sockets if it is still the current round; returns how many were shut down."""
    with _lock:  # held throughout: begin_round() of the next round waits until this is done
        if _round != round or not _tracked:
            return 0
        inodes = set(_tracked)
        _tracked.clear()
        return shutdown_sockets(inodes)


def shutdown_sockets(inodes: set[int]) -> int:
    """Shut down the connected sockets among ``inodes`` (never a listener); returns how many."""
    done = 0
    for fd, inode in socket_inodes().items():
        if inode not in inodes:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))  # our own descriptor of it: closing it leaves gloo's open
        except OSError:  # closed meanwhile, or the number now names something else
            continue
        with sock:
            try:
                if os.fstat(sock.fileno()).st_ino != inode:  # the number was reused meanwhile
                    continue
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue  # a listener: gloo's accept loop terminates the process on its error
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already shut down
                continue
        done += 1
    return done


def current_round() -> int | None:
    """The round whose groups are being formed or used (None before the first)."""
    return _round


def peer_closed(round: int) -> bool:
    """Whether a peer closed (or reset) one of ``round``'s connections: it died, or left the round.

    gloo closes a connection's descriptor once it fails (the peer closed or reset it), so a tracked
    socket that is gone while the round is current is one; an open one is peeked without blocking: an
    orderly end of stream or a reset is a closed peer, data or nothing to read yet is not. Listeners
    are skipped; sockets this process shut down itself are no longer tracked (:func:`shutdown_round`).
    """
    with _lock:
        if _round != round:
            return False
        inodes = set(_tracked)
    open_now = socket_inodes()
    if inodes - set(open_now.values()):
        return True
    for fd, inode in open_now.items():
        if inode not in inodes:
            continue
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with sock:
            try:
                if os.fstat(sock.fileno()).st_ino != inode or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    return True
            except BlockingIOError:
                continue
            except OSError:  # reset by the peer
                return True
    return False
