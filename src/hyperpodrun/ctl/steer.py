"""Steering a job through its store: the operator cap (``ctl/cap``) and following the decisions.

``cap N`` bounds the job at N replicas; ``yield K`` sets the cap K below the current size
(compare-and-swap, so concurrent operators cannot both take the same base); ``uncap``
deletes the key. The decider reads the cap every tick (:mod:`hyperpodrun.rendezvous.decider`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum

from hyperpodrun.ctl.job import ConnectionSettings, read_job
from hyperpodrun.ctl.status import CtlError, JobClosedError, JobRecords, NoSuchJobError, job_exists
from hyperpodrun.errors import ConfigError
from hyperpodrun.rendezvous.records import (
    CapRecord,
    ClosedRecord,
    HistoryEntry,
    Keys,
    cap_of,
    decode,
    decode_list,
    encode,
)
from hyperpodrun.store import Store

__all__ = ["FollowEnd", "cap_after_yield", "follow_history", "set_cap", "yield_replicas"]

_WATCH_SLICE = 30.0  # seconds of one change wait while following the history


def _require_open(records: JobRecords, settings: ConnectionSettings) -> None:
    if not job_exists(records):
        raise NoSuchJobError(settings.run_id, settings.endpoint)
    if records.closed is not None:
        raise JobClosedError(
            f"job {settings.run_id} has ended ({records.closed.status.value}); there is nothing to steer"
        )


def set_cap(store: Store, settings: ConnectionSettings, cap: int | None) -> JobRecords:
    """Cap the job at ``cap`` replicas (``None`` lifts the cap); returns the records read before."""
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
        raise ConfigError(f"cap: must be an integer >= 0, got {cap!r}")
    records = read_job(store)
    _require_open(records, settings)
    if cap is None:
        store.delete(Keys.CAP)
    else:
        store.put(Keys.CAP, encode(CapRecord(cap=cap)))
    return records


def cap_after_yield(*, members: int, current_cap: int | None, count: int) -> int:
    """The cap that gives back ``count`` replicas: below the current size and below any existing cap."""
    if count < 1:
        raise ConfigError(f"yield: COUNT must be >= 1, got {count}")
    base = members if current_cap is None else min(members, current_cap)
    if count > base:
        raise ConfigError(f"yield {count}: the job runs {base} replica(s), it cannot give back {count}")
    return base - count


def yield_replicas(
    store: Store, settings: ConnectionSettings, count: int, *, attempts: int = 5
) -> tuple[int, JobRecords]:
    """Set the cap ``count`` below the job's size, atomically against concurrent caps.

    Returns the new cap and the records it was computed from.
    """
    for _ in range(attempts):
        entry = store.get(Keys.CAP)
        records = read_job(store)
        _require_open(records, settings)
        if records.round is None:
            raise CtlError(f"job {settings.run_id} has not started a round yet; use 'hyperpodctl cap N' to bound it")
        current = cap_of(entry.value) if entry is not None else None
        cap = cap_after_yield(members=len(records.round.members), current_cap=current, count=count)
        revision = entry.revision if entry is not None else 0
        if store.compare_and_swap(Keys.CAP, encode(CapRecord(cap=cap)), expected_revision=revision):
            return cap, records
    raise CtlError(f"yield: {Keys.CAP} kept changing under concurrent writers ({attempts} attempts); try again")


class FollowEnd(str, Enum):
    CLOSED = "closed"
    TIMEOUT = "timeout"


def follow_history(
    store: Store,
    *,
    timeout: float,
    emit: Callable[[HistoryEntry], None],
    clock: Callable[[], float] = time.monotonic,
) -> tuple[FollowEnd, ClosedRecord | None]:
    """Emit every history entry, then new ones as deciders append them.

    Ends when the job closes (returns its ``closed`` record) or after ``timeout`` seconds.
    The history is a bounded list, so entries are recognised by content, not position.
    """
    if not timeout > 0:
        raise ConfigError(f"--timeout: must be > 0 seconds, got {timeout!r}")
    deadline = clock() + timeout
    seen: set[HistoryEntry] = set()
    revision = store.current_revision()
    while True:
        closed = store.get(Keys.CLOSED)  # before the history: what was written before closing is printed
        entry = store.get(Keys.HISTORY)
        for item in decode_list(HistoryEntry, Keys.HISTORY, entry.value if entry is not None else None):
            if item not in seen:
                seen.add(item)
                emit(item)
        if closed is not None:
            return FollowEnd.CLOSED, decode(ClosedRecord, Keys.CLOSED, closed.value)
        remaining = deadline - clock()
        if remaining <= 0:
            return FollowEnd.TIMEOUT, None
        # Bounded waits: a long-quiet watch stream is re-opened rather than trusted for an hour.
        revision = store.wait_for_change("", after_revision=revision, timeout=min(remaining, _WATCH_SLICE)) or revision
