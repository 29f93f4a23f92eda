"""Trainer-side records in the launcher's event log (``HYPERPODRUN_EVENT_LOG``).

The agents log the launcher's phases of a scale event; the ranks add the phases
only they can see: ``first_step`` (end of the first step of a round),
``checkpoint_saved`` and ``checkpoint_loaded``. Only global rank 0 writes, one
line per record with ``O_APPEND``, in the agents' format (``ts``, ``event``,
``job``, ``node``, ``round``, ``world_size``). Outside hyperpodrun it does nothing.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from elastic_events.contract import EVENT_LOG_ENV, NODE_ID_ENV, ROUND_ENV


def emit(event: str, **fields: Any) -> bool:
    """Append ``event`` to the event log from global rank 0; returns whether it was written."""
    path = os.environ.get(EVENT_LOG_ENV)
    if not path or os.environ.get("RANK", "0") != "0":
        return False
    record = {
        "ts": time.time(),
        "event": event,
        "job": os.environ.get("TORCHELASTIC_RUN_ID", ""),
        "node": os.environ.get(NODE_ID_ENV, ""),
        "round": int(os.environ.get(ROUND_ENV, "0")),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "source": "trainer",
        **fields,
    }
    line = (json.dumps(record, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return True
