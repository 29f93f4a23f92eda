"""The rank-side watchdog: ends the collectives of a round the launcher is repairing, on any backend.

A collective whose peer died does not always end by itself. gloo waits until its timeout when it
does not see the peer's connection close; NCCL never raises on the host at all: the host blocks at
its next wait for the device (a ``.item()``, a synchronize) behind a kernel that waits for the dead
peer. :class:`Watchdog` is a daemon thread that reads the control channel every ``poll_s``; when the
launcher publishes a repair (a ``RECONFIGURE`` event with the repair flag, for a later round) that
the rank has not taken up yet, it marks the round broken and ends every collective of the round
with the round's :class:`Abort`:

* gloo: :class:`GlooAbort` shuts down the round's connections (:mod:`.abort`);
* NCCL: :class:`NcclAbort` aborts every communicator of the process, each on a thread of its own
  (:func:`~elastic_events.rounds.group.end_backends`): the device kernels waiting on the dead peer
  end, so does the host's wait, and the step's commit check (:mod:`.commit`) sees the round broken.

If the rank still has not taken the repair up after ``BLOCKED_STEPS`` of its step times (at least
``BLOCKED_MIN_S``), its main thread is blocked for good: ``on_blocked(event)`` is called once (the
rank hands its state off, :mod:`.handoff`) before its agent replaces it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Protocol

from elastic_events.control import ControlReader, Event, EventKind
from elastic_events.rounds import abort
from elastic_events.rounds.group import TEARDOWN_TIMEOUT_S, end_backends, nccl_backends

__all__ = ["Abort", "GlooAbort", "NcclAbort", "Watchdog", "abort_for"]

#: How often the watchdog looks at the control channel: the delay between a repair's publication
#: and the end of a blocked collective.
WATCH_POLL_S = 0.02


class Abort(Protocol):
    """Ends every collective of ``round`` now; returns how many connections or communicators it ended."""

    def __call__(self, round: int) -> int: ...


class GlooAbort:
    """gloo has no abort: shut down the round's connections (never a listener)."""

    def __call__(self, round: int) -> int:
        return abort.shutdown_round(round)


class NcclAbort:
    """Abort every NCCL communicator of the process (the round's groups are the only ones it has)."""

    def __init__(self, *, timeout_s: float = TEARDOWN_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._done: int | None = None

    def __call__(self, round: int) -> int:
        if abort.current_round() != round or self._done == round:
            return 0
        self._done = round
        backends = nccl_backends()
        end_backends(backends, "abort", timeout_s=self.timeout_s)
        return len(backends)


def abort_for(backend: str) -> Abort:
    """The abort of a round whose default group uses ``backend`` (its side groups are gloo's)."""
    if backend == "nccl":
        nccl, gloo = NcclAbort(), GlooAbort()
        return lambda round: nccl(round) + gloo(round)
    return GlooAbort()


class Watchdog:
    """A daemon thread that ends the collectives of a round its launcher repairs (see the module)."""

    BLOCKED_MIN_S = 0.5
    BLOCKED_STEPS = 3

    def __init__(
        self,
        reader: ControlReader,
        *,
        abort: Abort,
        on_broken: Callable[[int, str], None],
        on_blocked: Callable[[Event], None] | None = None,
        rank: Callable[[], int] = lambda: 0,
        poll_s: float = WATCH_POLL_S,
    ) -> None:
        self._reader, self._abort, self._on_broken, self._on_blocked = reader, abort, on_broken, on_blocked
        self._rank, self._poll_s = rank, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hyperpodrun-watchdog", daemon=True)
        self._seen: tuple[int, float] | None = None  # (step, time) at the last poll that saw the step move
        self._step_s: float | None = None  # smoothed seconds per step
        self._repair: tuple[int, float] | None = None  # (event id, when first seen) of the repair under way
        self._blocked_done = False

    def start(self) -> Watchdog:
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
        """One look at the channel at monotonic time ``now``; returns how many things it ended."""
        slot = self._reader.progress()
        self._note_step(slot.step, now)
        event = self._reader.event()
        current = abort.current_round()
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
        why = f"the launcher repairs round {current} (event {event.event_id}): a peer failed"
        self._on_broken(current, why)
        ended = self._abort(current)
        if ended:
            print(
                f"rank {self._rank()}: {why}; ended {ended} connection(s) or communicator(s) of its process groups "
                "so that no collective waits on them",
                file=sys.stderr,
                flush=True,
            )
        if self._on_blocked is not None and not self._blocked_done and now - self._repair[1] >= self.blocked_after_s():
            self._blocked_done = True
            self._on_blocked(event)
        return ended

    def _note_step(self, step: int, now: float) -> None:
        if self._seen is not None and step > self._seen[0] and self._repair is None:
            per_step = (now - self._seen[1]) / (step - self._seen[0])
            self._step_s = per_step if self._step_s is None else 0.8 * self._step_s + 0.2 * per_step
        if self._seen is None or step != self._seen[0]:
            self._seen = (step, now)
