"""SIGTERM under cluster managers: what reaches the ranks means what reaches the launcher.

Slurm signals every process of a job step, not only the launcher. A rank under hyperpodrun takes
SIGTERM as a request to leave (``elastic_events.termination``): it marks its control-channel slot and
trains on until the agreed step. The agent reads those marks (:func:`requested_by_ranks`) as its own
SIGTERM, and stops such ranks with SIGKILL (:func:`ranks_leaving_on_sigterm`): SIGTERM no longer ends
them. While the agent waits in a rendezvous, its own SIGTERM ends the wait at once
(:class:`LeaveRequested`): a halted launcher answers ``scancel --signal=TERM`` without delay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from elastic_events.control import CAP_LEAVE_ON_SIGTERM, ControlWriter, RankProgress

__all__ = ["InterruptibleWaits", "LeaveRequested", "ranks_leaving_on_sigterm", "requested_by_ranks"]


class LeaveRequested(Exception):
    """Raised by the agent's SIGTERM handler into a rendezvous wait: this node leaves the job now."""


def ranks_leaving_on_sigterm(progress: Sequence[RankProgress]) -> tuple[int, ...]:
    """The local ranks that take SIGTERM as a request to leave (the agent stops them with SIGKILL)."""
    return tuple(r for r, p in enumerate(progress) if p.capabilities & CAP_LEAVE_ON_SIGTERM)


def requested_by_ranks(control: ControlWriter) -> bool:
    """Whether a local rank received SIGTERM since its slot was reset (Slurm signals every process of a step)."""
    return bool(control.termination_requests())


class InterruptibleWaits:
    """A rendezvous store whose waits end with :class:`LeaveRequested` when the agent has a SIGTERM to act on.

    ``pending()`` says whether the agent received a SIGTERM it has not acted on yet (in a rendezvous);
    a wait checks it first, and the agent's signal handler raises :class:`LeaveRequested` into a wait in
    progress (:attr:`waiting`). Only a wait is interrupted: it changes nothing, so the rendezvous call
    around it can simply be made again after the node asked to leave. Everything else is the store's.
    """

    def __init__(self, store, *, pending: Callable[[], bool]) -> None:
        self._store = store
        self._pending = pending
        self.inner = getattr(store, "inner", store)
        self.waiting = False

    def wait_for_change(self, prefix: str, *, after_revision: int, timeout: float) -> int | None:
        if self._pending():
            raise LeaveRequested
        self.waiting = True
        try:
            return self._store.wait_for_change(prefix, after_revision=after_revision, timeout=timeout)
        finally:
            self.waiting = False

    def __getattr__(self, name: str):
        return getattr(self._store, name)
