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
from pathlib import Path
from typing import Any

from elastic_events.contract import Record

#: The kinds of event-log records, the agents' and the ranks' alike, written once in the launcher-rank contract.
EventType = Record


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
