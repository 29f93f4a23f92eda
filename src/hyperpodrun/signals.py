"""The launcher's termination signals: handlers installed for the agent's life, and waits they cut short.

The agent's loop polls for a signal between its steps (it then stops the ranks with it). A
wait that polls nothing, such as waiting in the rendezvous for a round or for the store,
runs inside :meth:`SignalLatch.interruptible`: a signal raises :class:`SignalReceived` there
at once, whatever the wait was blocked in (a socket read returns ``EINTR`` to Python, which
runs the handler), so Ctrl-C ends a launcher waiting for other nodes within a moment, not at
the wait's timeout. Inside the block the handler raises a ``BaseException`` (as Python's own
``KeyboardInterrupt`` is), so code that absorbs errors on its way (``logging`` does, while it
writes a line) cannot swallow the signal; the block turns it into :class:`SignalReceived`.

A handler runs in the main thread between two of its bytecodes, wherever that thread is: it must
take no lock the interrupted code may hold. ``threading.Event.set()`` takes the event's own lock,
which the main thread holds for a moment in every ``wait()`` and ``clear()``: a signal landing
there deadlocked the agent for good (its loop waited on that event ten times a second). The loop's
wake-up is a :class:`Wakeup` instead, a pipe a handler writes one byte to.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType

from hyperpodrun.errors import SignalReceived

__all__ = ["SignalLatch", "Wakeup"]

log = logging.getLogger(__name__)


class _Interrupted(BaseException):
    """A signal inside :meth:`SignalLatch.interruptible` (a BaseException: nothing on the way absorbs it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class SignalLatch:
    """Notes each signal for the agent (``on_signal``) and raises it inside :meth:`interruptible`."""

    def __init__(self, on_signal: Callable[[int], None], *, interrupts: Callable[[int], bool] = lambda signum: True):
        self._on_signal = on_signal
        self._interrupts = interrupts  # which signals end a block's waits (the others are only noted)
        self._armed = 0
        self._previous: dict[signal.Signals, object] = {}

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self._on_signal(signum)
        if self._armed and self._interrupts(signum):
            self._armed = 0  # once: the cleanup that follows may wait on its own
            raise _Interrupted(signum)

    @contextlib.contextmanager
    def interruptible(self, pending: int | None = None) -> Iterator[None]:
        """A block whose blocking waits a signal ends at once (with :class:`SignalReceived`);
        ``pending``: a signal received before the block that nobody acted on yet ends it on entry."""
        if pending is not None and self._interrupts(pending):
            raise SignalReceived(pending)
        self._armed += 1
        try:
            yield
        except _Interrupted as e:
            raise SignalReceived(e.signum) from None
        finally:
            self._armed = max(0, self._armed - 1)

    def install(self, signals: Iterable[signal.Signals]) -> None:
        """Handle ``signals`` (main thread only: elsewhere the process keeps its handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in signals:
            try:
                self._previous[sig] = signal.signal(sig, self.handle)
            except (OSError, ValueError):
                log.warning("cannot handle %s on this platform", sig.name)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()


class Wakeup:
    """A wait that :meth:`set` cuts short, safe to set from a signal handler: a non-blocking pipe, so
    setting it takes no lock (``threading.Event.set`` does). For the thread that waits and its handlers."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)

    def set(self) -> None:
        with contextlib.suppress(BlockingIOError):  # the pipe is full: it is set already
            os.write(self._write, b"\0")

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 4096):
                pass

    def wait(self, timeout: float) -> bool:
        """Block until set or ``timeout`` seconds passed; whether it is set (it stays set until cleared)."""
        ready, _, _ = select.select([self._read], [], [], max(0.0, timeout))
        return bool(ready)

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)
