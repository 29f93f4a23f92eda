"""The agent's event log: one JSON object per line.

Every record carries ``ts`` (unix seconds), ``event``, ``job``, ``node``, ``round``
and ``world_size``. Scale events record their phases so downtime can be read off
the log: ``scale_decided``, ``workers_signalled``, ``checkpoint_saved``,
``workers_stopped``, ``rendezvous_done``, ``workers_started``,
``checkpoint_loaded``, ``first_step``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any


class EventType(str, Enum):
    AGENT_STARTED = "agent_started"
    RENDEZVOUS_DONE = "rendezvous_done"
    WORKERS_STARTED = "workers_started"
    FIRST_STEP = "first_step"
    SCALE_DECIDED = "scale_decided"
    ROUND_IN_PROCESS = (
        "round_in_process"  # every rank declared the in-process API: events and failures are handled in place
    )
    SCALE_TARGETED = "scale_targeted"  # the agreed step and the mode (reconfigure in place or restart)
    WORKERS_SIGNALLED = "workers_signalled"
    CHECKPOINT_SAVED = "checkpoint_saved"
    CHECKPOINT_LOADED = "checkpoint_loaded"
    WORKERS_STOPPED = "workers_stopped"
    WORKERS_RECONFIGURED = "workers_reconfigured"  # every local rank runs in the next round, in place
    WORKER_FAILED = "worker_failed"
    RANKS_REPLACED = "ranks_replaced"  # failed ranks restarted parked: the job repairs its group in place
    SPARE_READY = (
        "spare_ready"  # a pre-started replacement waits beside the ranks, torch imported (elastic_events.rounds.spare)
    )
    RANK_HUNG = "rank_hung"  # no progress for --hang-timeout: stacks dumped, treated as a failure
    NODE_LOST = "node_lost"
    NODE_LEAVING = "node_leaving"
    NODE_REJOINED = "node_rejoined"  # registered again after its lease expired during a store outage
    STORE_UNREACHABLE = "store_unreachable"  # the ranks keep training until the lease expires
    STORE_RECOVERED = "store_recovered"
    STORE_LOST = "store_lost"
    JOB_SUCCEEDED = "job_succeeded"
    JOB_FAILED = "job_failed"
    AGENT_STOPPED = "agent_stopped"


class EventLog:
    """Appends records to a JSONL file (and optionally hands them to a callback)."""

    def __init__(
        self,
        path: Path | None,
        *,
        job: str,
        node: str,
        clock: Callable[[], float] = time.time,
        sink: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.path = path
        self.job = job
        self.node = node
        self.round = 0
        self.world_size = 0
        self._clock = clock
        self._sink = sink
        self._lock = threading.Lock()
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: EventType | str, **fields: Any) -> dict[str, Any]:
        record = {
            "ts": self._clock(),
            "event": event.value if isinstance(event, EventType) else event,
            "job": self.job,
            "node": self.node,
            "round": fields.pop("round", self.round),
            "world_size": fields.pop("world_size", self.world_size),
            **fields,
        }
        line = json.dumps(record, sort_keys=False, default=str) + "\n"
        with self._lock:
            if self.path is not None:
                # One write of one line with O_APPEND: lines of agents sharing a file never interleave.
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    os.write(fd, line.encode())
                finally:
                    os.close(fd)
            if self._sink is not None:
                self._sink(record)
        return record


def read_events(path: Path) -> list[dict[str, Any]]:
    """All records of an event log, in file order (lines that are not JSON are skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
