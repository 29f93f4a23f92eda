"""The agent's loop wakes up on a signal through :class:`hyperpodrun.signals.Wakeup`, which a signal handler
may set wherever the main thread was interrupted. ``threading.Event.set()`` may not: it takes the event's
lock, which the main thread holds inside every ``wait()``, so a SIGTERM landing there deadlocked the agent
for good (a node that never left: ``test_shrink_two_to_one[hf-in_place]`` hung 300 s once in CI)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from hyperpodrun.signals import Wakeup

# The handler sets the wake-up; the signal is raised from a trace function at the n-th line of the object's
# own wait(): the second of threading.Event.wait is where it holds its lock (``with self._cond:`` entered).
SCRIPT = textwrap.dedent(
    """
    import signal, sys, threading
    from hyperpodrun.signals import Wakeup

    wake = Wakeup() if sys.argv[1] == "wakeup" else threading.Event()
    at = int(sys.argv[2])
    signal.signal(signal.SIGUSR1, lambda *_: wake.set())
    target, lines = type(wake).wait.__code__, []

    def local(frame, event, arg):
        if event == "line":
            lines.append(frame.f_lineno)
            if len(lines) == at:
                signal.raise_signal(signal.SIGUSR1)  # the handler runs before the next bytecode
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code is target and not lines else None

    sys.settrace(tracer)
    woken = wake.wait(2.0)
    sys.settrace(None)
    print("woken" if woken else "timed out", flush=True)
    """
)


def run(kind: str, at: int, timeout: float) -> subprocess.CompletedProcess[str] | None:
    """The script with ``kind``'s wake-up, signalled at line ``at`` of its wait; None if it was still running
    after ``timeout`` (then killed)."""
    try:
        return subprocess.run(
            [sys.executable, "-c", SCRIPT, kind, str(at)], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return None


def test_a_handler_that_sets_the_wakeup_before_it_blocks_wakes_it() -> None:
    done = run("wakeup", 1, timeout=20)
    assert done is not None and done.returncode == 0, done
    assert done.stdout.strip() == "woken"


@pytest.mark.parametrize("at", [1, 2])
def test_a_handler_that_sets_the_wakeup_anywhere_in_its_wait_never_deadlocks(at: int) -> None:
    done = run("wakeup", at, timeout=20)
    assert done is not None and done.returncode == 0, done


def test_the_same_handler_deadlocks_a_threading_event() -> None:
    """Why the agent does not use one: the interrupted wait holds the lock the handler asks for."""
    assert run("event", 2, timeout=8) is None


def test_a_wakeup_is_set_until_cleared() -> None:
    wake = Wakeup()
    try:
        assert wake.wait(0.01) is False
        for _ in range(100_000):  # more than a pipe holds: setting never blocks
            wake.set()
        assert wake.wait(0.0) is True and wake.wait(0.0) is True
        wake.clear()
        assert wake.wait(0.01) is False
    finally:
        wake.close()


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_a_wakeup_set_from_another_thread_ends_a_wait(delay: float) -> None:
    import threading
    import time

    wake = Wakeup()
    try:
        setter = threading.Timer(delay, wake.set)
        t0 = time.monotonic()
        setter.start()
        assert wake.wait(10.0) is True
        assert time.monotonic() - t0 < 5.0
        setter.join()
    finally:
        wake.close()
