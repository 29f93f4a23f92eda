"""Putting the rendezvous' directives on a node's control channel, for its ranks to act on.

:func:`write_event` writes a ``SAVE_AND_EXIT`` or ``RECONFIGURE`` directive (its target step last, so a
rank never reads half an event); :func:`publish` does that for a cooperative event and says which local
ranks had already passed its step (they act one step late), with the ``workers_signalled`` record.
"""

from __future__ import annotations

from elastic_events.contract import Record
from elastic_events.control import ControlWriter, EventKind
from hyperpodrun.events import EventLog
from hyperpodrun.progress import missed_target
from hyperpodrun.rendezvous import Directive, DirectiveKind

__all__ = ["publish", "write_event"]


def write_event(control: ControlWriter, directive: Directive) -> None:
    """Put a SAVE_AND_EXIT or RECONFIGURE directive on the control channel (target step last)."""
    reconfigure = directive.kind == DirectiveKind.RECONFIGURE
    control.publish(
        event_id=directive.event_id,
        target_step=directive.target_step,
        kind=EventKind.RECONFIGURE if reconfigure else EventKind.SAVE_AND_EXIT,
        round=directive.next_round,
        world_size=directive.world_size,
        group_rank=directive.group_rank,
        group_world_size=directive.group_world_size,
        master_addr=directive.master_addr if reconfigure else "",
        master_port=directive.master_port if reconfigure else 0,
        repair=directive.repair,
        hold=directive.hold,
    )


def publish(control: ControlWriter, events: EventLog, directive: Directive) -> list[int]:
    """Put a cooperative event on the control channel; the local ranks that had already passed its step.

    A rank checks the channel once per step and acts at the first step at or past the target, so one
    that was past it when it was written acts one step late: fine when every rank of the job was (they
    act together), a deadlock when some acted in time (``LateRanks`` watches for that). Reading progress
    after the write closes the window between the agent's progress read and the write. A repair (and a
    move out of a held round) has no agreed step: every rank acts on it at once.
    """
    write_event(control, directive)
    progress = control.progress()
    at_once = directive.repair or directive.from_held
    missed = [] if at_once else missed_target(progress, directive.event_id, directive.target_step)
    events.emit(
        Record.WORKERS_SIGNALLED,
        event_id=directive.event_id,
        kind=directive.kind.value,
        event_kind=directive.event_kind.value if directive.event_kind is not None else None,
        target_step=directive.target_step,
        steps=[p.step for p in progress],
        reason=directive.reason,
        **({"late_ranks": missed} if missed else {}),
    )
    return missed
