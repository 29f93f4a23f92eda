"""How long running ranks ride out an unreachable rendezvous store, and how the job ends after that.

The ranks do not need the store to train, so a short outage (an etcd leader change, a restart)
costs nothing. A store gone for good must not leave the launcher running forever, though: after
``--rdzv-conf outage_timeout`` seconds without a successful store request (60 by default,
measured on this node's monotonic clock) the outage is final. Then, as a pure function of the
ranks' state:

* ranks that all exited 0: this node's part is done; the agent exits 0, as torchrun's does when
  its exit barrier cannot reach the store;
* a rank failed: the agent exits with that failure;
* ranks that call ``elastic_event_detected()``: they are asked to save and exit at a step just
  ahead of the furthest one (a local event: without the store, nodes cannot agree on a step, so a
  job of several nodes saves only where their ranks reach the same step), then the job fails as
  "lost the rendezvous store";
* other ranks: stopped at once.

Documented bound: the launcher exits at most ``outage_timeout`` + the graceful shutdown timeout
(the save) + ``--shutdown-timeout`` + ``store_timeout`` after the store's last answer.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import monotonic

from hyperpodrun.events import EventLog, EventType
from hyperpodrun.rendezvous import Directive, DirectiveKind, LocalStatus, RendezvousHandler
from hyperpodrun.store import EmbeddedStoreGoneError, StoreError
from hyperpodrun.supervisor import WorkerState

__all__ = ["StoreOutage", "final_directive", "poll_riding_out_outages"]

#: How far ahead of the furthest rank the local save is placed (steps): the ranks learn it within one.
SAVE_MARGIN_STEPS = 2


@dataclass
class StoreOutage:
    """The current outage of the store, if any, on this node's monotonic clock."""

    limit: float
    clock: Callable[[], float] = field(default=monotonic)
    since: float | None = None
    concluded: bool = False  # the job's end was decided once (the ranks may be saving): never again

    def failed(self) -> bool:
        """A store request failed; whether this starts an outage (the caller says so once)."""
        if self.since is not None:
            return False
        self.since = self.clock()
        return True

    def recovered(self) -> float | None:
        """A store request succeeded; the outage's length if one was in progress."""
        if self.since is None:
            return None
        length, self.since = self.clock() - self.since, None
        return length

    def conclude(self) -> bool:
        """Whether the outage has become final now (``limit`` seconds without the store): true once only,
        so the ranks asked to save are not stopped by a second decision while they do."""
        if self.concluded or self.since is None or self.clock() - self.since < self.limit:
            return False
        self.concluded = True
        return True


def final_directive(
    status: LocalStatus, *, pending: bool, acked_events: Sequence[int], limit: float, error: str
) -> Directive:
    """What the agent does with its ranks once an outage is final (see the module's rules)."""
    why = f"the rendezvous store has been unreachable for {limit:g}s (--rdzv-conf outage_timeout): {error}"
    if status.group_state == WorkerState.SUCCEEDED:
        reason = f"this node's ranks all exited 0; {why}, so the job's outcome is not known here"
        return Directive(kind=DirectiveKind.EXIT, exit_code=0, reason=reason)
    if status.group_state == WorkerState.FAILED:
        return Directive(kind=DirectiveKind.EXIT, exit_code=1, reason=f"{status.failure or 'a rank failed'}; {why}")
    if pending or not status.cooperative:
        return Directive(kind=DirectiveKind.STOP, reason=why)
    return Directive(
        kind=DirectiveKind.SAVE_AND_EXIT,
        event_id=max(acked_events, default=0) + 1,
        target_step=max(status.steps) + SAVE_MARGIN_STEPS,
        reason=f"{why}; the ranks save and exit",
    )


def poll_riding_out_outages(
    rdzv: RendezvousHandler,
    status: LocalStatus,
    outage: StoreOutage,
    *,
    pending: bool,
    events: EventLog,
    acked_events: Callable[[], Sequence[int]],
) -> Directive | None:
    """``rdzv.poll(status)``; while the store is unreachable the ranks keep training (they do not need it)
    for up to ``outage.limit``; then the job ends for this node (:func:`final_directive`). ``acked_events``:
    the events the local ranks acted on. An embedded store gone for good raises ``EmbeddedStoreGoneError``."""
    try:
        directive = rdzv.poll(status)
    except EmbeddedStoreGoneError:
        raise
    except StoreError as e:
        if outage.failed():
            _say(
                f"the rendezvous store is unreachable ({e}); the ranks keep training meanwhile, "
                f"for up to {outage.limit:g}s"
            )
            events.emit(EventType.STORE_UNREACHABLE, message=str(e))
        if not outage.conclude():
            return None
        final = final_directive(status, pending=pending, acked_events=acked_events(), limit=outage.limit, error=str(e))
        _say(final.reason)
        events.emit(EventType.STORE_LOST, message=final.reason)
        return final
    if (length := outage.recovered()) is not None:
        _say(f"the rendezvous store is back after {length:.1f}s")
        events.emit(EventType.STORE_RECOVERED, outage_s=round(length, 3))
    return directive


def _say(message: str) -> None:
    print(f"hyperpodrun: {message}", file=sys.stderr, flush=True)
