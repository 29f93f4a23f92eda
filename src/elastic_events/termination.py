"""SIGTERM in a rank under hyperpodrun: a request to leave the job at the next agreed step, not a death.

Cluster managers signal more than the launcher. Slurm sends SIGTERM to every process of a job step
(``scancel --signal=TERM``, ``#SBATCH --signal=TERM@<s>``, preemption, a plain ``scancel``): the
launcher, its ranks and their data-loader workers at once. A rank that died of it would be a rank
failure, and a data-loader worker that died of it would make PyTorch raise in its rank. Under
hyperpodrun (the control channel is there) :func:`install` makes a rank take SIGTERM as the launcher
does, a request to leave (or stop) at the next agreed step:

* its handler marks the request in the rank's control-channel slot, where the launcher reads it (and
  leaves the job as for its own SIGTERM), says so once on stderr, and returns: training goes on until
  ``elastic_event_detected()`` returns True at the agreed step;
* SIGTERM stays blocked in the thread that installs the guard (the main thread), so every process it
  starts afterwards -- data-loader workers, forked or spawned -- inherits the block: a worker never
  sees the SIGTERM meant for the job, and ends when its rank ends it or exits. A thread started here
  keeps SIGTERM unblocked, so the kernel always has a thread to deliver the rank's SIGTERM to; Python
  runs the handler in the main thread;
* the rank declares ``CAP_LEAVE_ON_SIGTERM``, so its launcher stops it with SIGKILL, not SIGTERM;
* at exit, multiprocessing ends daemonic children (data-loader workers whose iterator is still alive)
  with SIGTERM and waits for them without a timeout; theirs is blocked, so the guard ends them with
  SIGKILL just before (what SIGTERM's default action would have done). ``Process.terminate()`` on a
  child the rank started after the guard no longer ends it: use ``kill()``.

States (:class:`GuardState`)::

    UNINSTALLED --install()--> WATCHING --SIGTERM--> REQUESTED (further SIGTERMs: nothing more)
    UNINSTALLED --install(): the script handles SIGTERM itself, or not the main thread--> DECLINED

A script that installed its own SIGTERM handler keeps it (nothing is installed). Call
:func:`install` early, before the data loader starts its workers: ``ElasticTraining.start()`` and
the first ``elastic_event_detected()`` call it; so does ``leave_on_sigterm()`` at the top of a script.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from enum import Enum
from types import FrameType

from elastic_events.control import CAP_LEAVE_ON_SIGTERM, ControlReader

__all__ = ["GuardState", "SigtermGuard", "install", "state"]

#: How long the catcher thread sleeps between wake-ups (it only exists to receive signals).
_CATCHER_NAP_S = 3600.0


class GuardState(str, Enum):
    UNINSTALLED = "uninstalled"
    WATCHING = "watching"  # SIGTERM asks the launcher to leave the job
    REQUESTED = "requested"  # a SIGTERM came; the launcher has been asked
    DECLINED = "declined"  # the script handles SIGTERM itself, or install() ran outside the main thread


class SigtermGuard:
    """One rank's SIGTERM handling: a request to the launcher, written to the control channel."""

    def __init__(self, reader: ControlReader) -> None:
        self.reader = reader
        self.state = GuardState.UNINSTALLED
        self._catcher: threading.Thread | None = None

    def install(self) -> GuardState:
        """Take over SIGTERM (see the module's docstring); the resulting state."""
        if self.state is not GuardState.UNINSTALLED:
            return self.state
        if threading.current_thread() is not threading.main_thread():
            self.state = GuardState.DECLINED  # signal handlers can only be set from the main thread
            return self.state
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
            self.state = GuardState.DECLINED  # the script's own handler decides
            return self.state
        signal.signal(signal.SIGTERM, self._on_sigterm)
        atexit.register(_end_daemonic_children)  # before multiprocessing's own exit handler (registered earlier)
        self._catcher = threading.Thread(target=_catch_sigterm, name="hyperpodrun-sigterm", daemon=True)
        self._catcher.start()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        self.reader.declare(CAP_LEAVE_ON_SIGTERM)
        self.state = GuardState.WATCHING
        return self.state

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """Runs in the main thread between two bytecodes: no locks, one unbuffered write."""
        if self.state is GuardState.REQUESTED:
            return
        self.reader.request_termination()
        self.state = GuardState.REQUESTED
        rank = os.environ.get("RANK")  # a parked rank has none until it is admitted
        who = f"rank {rank}" if rank is not None else f"local rank {os.environ.get('LOCAL_RANK', '0')}"
        message = f"{who}: SIGTERM: the launcher leaves the job at the next agreed step\n"
        try:
            os.write(2, message.encode())
        except OSError:
            pass  # stderr closed: the request stands


def _catch_sigterm() -> None:
    """A thread with SIGTERM unblocked, so that the rank's SIGTERM always has a thread to go to."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    idle = threading.Event()
    while not idle.wait(_CATCHER_NAP_S):
        pass


def _end_daemonic_children() -> None:
    """Exit: SIGKILL the daemonic multiprocessing children, which multiprocessing would end with SIGTERM and wait
    for; they inherited this rank's blocked SIGTERM and would never end."""
    mp = sys.modules.get("multiprocessing")
    if mp is None:
        return
    for child in mp.active_children():
        if child.daemon:
            child.kill()


_guard: SigtermGuard | None = None


def install(reader: ControlReader) -> GuardState:
    """Make SIGTERM a leave request in this rank (once per process)."""
    global _guard
    if _guard is None:
        _guard = SigtermGuard(reader)
    return _guard.install()


def state() -> GuardState:
    """The guard's state in this process."""
    return _guard.state if _guard is not None else GuardState.UNINSTALLED
