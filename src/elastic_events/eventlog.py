"""Trainer-side records in the launcher's event log (``HYPERPODRUN_EVENT_LOG``).

The agents log the launcher's phases of a scale event; the ranks add the phases only they can
see (:class:`~elastic_events.contract.Record`: ``first_step``, ``checkpoint_saved``,
``group_up``, ``hydrated``, ...). Only the current round's rank 0 writes, one line per record with
``O_APPEND``, in the agents' format (``ts``, ``event``, ``job``, ``node``, ``round``,
``world_size``). The round is the one the rank is in now: the round engine tells this module when
it enters one (:func:`enter_round`). Outside hyperpodrun nothing is written.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from elastic_events.contract import Record, rank_context


@dataclass(frozen=True)
class _Where:
    round: int
    rank: int
    world_size: int


_where: _Where | None = None  # None: the round the process was started in


def enter_round(*, round: int, rank: int, world_size: int) -> None:
    """This process is now ``rank`` of ``world_size`` in ``round`` (its records say so)."""
    global _where
    _where = _Where(round, rank, world_size)


def current() -> tuple[int, int, int]:
    """(round, rank, world size) of this process as its records give them."""
    if _where is not None:
        return _where.round, _where.rank, _where.world_size
    ctx = rank_context()
    return ctx.round, -1 if ctx.parked else ctx.rank, ctx.world_size  # a parked rank has no rank until admitted


def emit(event: Record | str, **fields: Any) -> bool:
    """Append ``event`` to the event log from the current round's rank 0; returns whether it was written."""
    ctx = rank_context()
    round, rank, world_size = current()
    if ctx.event_log is None or rank != 0:
        return False
    record = {
        "ts": time.time(),
        "event": event.value if isinstance(event, Record) else event,
        "job": ctx.run_id,
        "node": ctx.node_id,
        "round": round,
        "world_size": world_size,
        "source": "trainer",
        **fields,
    }
    line = (json.dumps(record, default=str) + "\n").encode()
    fd = os.open(ctx.event_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return True
