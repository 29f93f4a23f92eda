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
* :class:`RepairWatch` is the thread that calls it: when the launcher publishes a repair
  (a ``RECONFIGURE`` event with the repair flag, for a later round) and the rank has not
  taken it up yet, the rank is, or soon will be, blocked in the broken group.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

from elastic_events.control import ControlReader, Event, EventKind

__all__ = ["RepairWatch", "begin_round", "forming", "shutdown_round", "shutdown_sockets", "socket_inodes", "tracking"]

#: How often the watch looks at the control channel: the delay between a repair's publication
#: and the end of a blocked collective.
WATCH_POLL_S = 0.02

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


class RepairWatch:
    """A daemon thread that ends a blocked collective of a round the launcher is repairing.

    It reads the control channel every ``poll_s``; when a repair event for a round after
    the current one appears that this rank has not acknowledged (so the training loop has
    not reached :meth:`~elastic_events.training.ElasticTraining.recover` yet), it shuts down
    the current round's sockets. The loop's next or current collective then fails and the
    rank recovers like any survivor. If the rank still has not taken the repair up after
    ``BLOCKED_STEPS`` of its step times (at least ``BLOCKED_MIN_S``), its main thread is blocked
    for good: ``on_blocked(event)`` is called once (the rank hands its state off, see
    :mod:`elastic_events.rounds.handoff`) before its agent replaces it.
    """

    BLOCKED_MIN_S = 0.5
    BLOCKED_STEPS = 3

    def __init__(
        self,
        reader: ControlReader,
        *,
        on_blocked: Callable[[Event], None] | None = None,
        poll_s: float = WATCH_POLL_S,
    ) -> None:
        self._reader, self._on_blocked, self._poll_s = reader, on_blocked, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hyperpodrun-repair-watch", daemon=True)
        self._seen: tuple[int, float] | None = None  # (step, time) at the last poll that saw the step move
        self._step_s: float | None = None  # smoothed seconds per step
        self._repair: tuple[int, float] | None = None  # (event id, when first seen) of the repair under way
        self._blocked_done = False

    def start(self) -> RepairWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            self.poll_once(time.monotonic())

    def blocked_after_s(self) -> float:
        """How long a repair may stay untaken before the rank counts as blocked for good."""
        return max(self.BLOCKED_MIN_S, self.BLOCKED_STEPS * (self._step_s or 0.0))

    def poll_once(self, now: float) -> int:
        """One look at the channel at monotonic time ``now``; returns how many sockets it shut down."""
        slot = self._reader.progress()
        self._note_step(slot.step, now)
        event = self._reader.event()
        current = _round
        if (
            event is None
            or event.kind is not EventKind.RECONFIGURE
            or not event.repair
            or current is None
            or event.round <= current
            or slot.acked_event == event.event_id
        ):
            self._repair = None
            return 0
        if self._repair is None or self._repair[0] != event.event_id:
            self._repair, self._blocked_done = (event.event_id, now), False
        shut = shutdown_round(current)
        if shut:
            print(
                f"rank {os.environ.get('RANK', '?')}: the launcher repairs round {current} (event {event.event_id}): "
                f"shut down {shut} socket(s) of its process groups so that no collective waits on them",
                file=sys.stderr,
                flush=True,
            )
        if self._on_blocked is not None and not self._blocked_done and now - self._repair[1] >= self.blocked_after_s():
            self._blocked_done = True
            self._on_blocked(event)
        return shut

    def _note_step(self, step: int, now: float) -> None:
        if self._seen is not None and step > self._seen[0] and self._repair is None:
            per_step = (now - self._seen[1]) / (step - self._seen[0])
            self._step_s = per_step if self._step_s is None else 0.8 * self._step_s + 0.2 * per_step
        if self._seen is None or step != self._seen[0]:
            self._seen = (step, now)
