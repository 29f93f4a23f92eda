"""Durations the decider measures on its own monotonic clock, never against another node's.

The records carry wall-clock times for people (``decided_at``, ``halted_at``, the rounds'
``events``), written by whichever agent decided then; a decider that compared them with its
own clock would wait too long or too little by the skew between the two machines. So the
decider notes, in its :class:`~hyperpodrun.rendezvous.decider.DeciderMemory`, when *it* first
saw each record that starts a timer (an event, a halted round, a published round), and
measures from there. A decider that takes over mid-way starts those timers afresh: it waits
at most one timeout longer, never shorter. Of the rounds' ``events`` only the spacing is used,
anchored at the moment this decider first saw the newest one.
"""

from __future__ import annotations

from collections.abc import Mapping

from hyperpodrun.policy import ScaleEvent
from hyperpodrun.rendezvous.records import EventRecord, RoundRecord, RoundState

__all__ = ["event_key", "gone_key", "halt_key", "made_key", "observe", "round_key", "scale_events"]


def event_key(event_id: int) -> str:
    return f"event/{event_id}"


def made_key(event_id: int) -> str:
    """Set by the decider that wrote the event: it knows the event's whole age."""
    return f"made/{event_id}"


def gone_key(event_id: int) -> str:
    """When this decider first saw a next member of the event gone (its lease lapsed), while the event lives."""
    return f"gone/{event_id}"


def round_key(round_no: int) -> str:
    return f"round/{round_no}"


def halt_key(round_no: int) -> str:
    return f"halt/{round_no}"


def observe(
    seen: Mapping[str, float], *, round: RoundRecord | None, event: EventRecord | None, now: float
) -> dict[str, float]:
    """``seen`` with the current round, its halt and the current event noted (at ``now`` when new),
    and nothing older: the timers of records that were replaced are dropped."""
    keys = []
    if round is not None:
        keys.append(round_key(round.round))
        if round.state is RoundState.HALTED:
            keys.append(halt_key(round.round))
    if event is not None:
        keys.append(event_key(event.id))
    noted = {key: seen.get(key, now) for key in keys}
    for key in (made_key(event.id), gone_key(event.id)) if event is not None else ():
        if key in seen:
            noted[key] = seen[key]
    return noted


def scale_events(rnd: RoundRecord | None, seen: Mapping[str, float], now: float) -> tuple[ScaleEvent, ...]:
    """The round's recorded scale events on this decider's clock, oldest first: the newest at the moment
    this decider first saw the round, the older ones by their recorded spacing."""
    if rnd is None or not rnd.events:
        return ()
    anchor = seen.get(round_key(rnd.round), now)
    newest = rnd.events[-1][0]
    out: list[ScaleEvent] = []
    later = anchor
    for at, n in reversed(rnd.events):  # newest first; written by several deciders, so kept in order by force
        later = min(later, anchor - max(0.0, newest - at))
        out.append(ScaleEvent(later, n))
    return tuple(reversed(out))
