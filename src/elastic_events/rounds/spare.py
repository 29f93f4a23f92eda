"""A spare rank: an interpreter started ahead of a failure, waiting to replace a failed rank.

A rank repaired in place is restarted parked and hydrated from its peers; what the survivors
wait for is its process start: the interpreter, ``import torch``, ``elastic_events``, and what the
first step imports (:func:`~elastic_events.rounds.joining.prewarm`). A spare pays that in advance. The agent starts one per node (``--spare-ranks``) once the job runs
in-process; it imports torch and waits on its own slot of the control channel without touching
any accelerator, running no line of the training script. When a local rank fails, the agent
resets that rank's slot and writes the rank's number into the spare's slot: the spare takes the
rank's ``LOCAL_RANK`` and runs the script as ``python`` would (``runpy``, ``__main__``), parked,
so the script's own code sees the environment of that rank from its first line.

Only the agent starts it (``USAGE``); everything after the target belongs to the script.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from collections.abc import Sequence

from elastic_events.control import ControlReader, RankPhase

__all__ = ["main", "spare_command"]

POLL_S = 0.005
USAGE = "python -m elastic_events.rounds.spare CONTROL_FILE SLOT (--script PATH | --module NAME) [ARGS...]"


def spare_command(
    python: str, control_file: str, slot: int, *, script: str | None, module: str | None, args: Sequence[str]
) -> list[str]:
    """argv of a spare that will run ``script`` (or ``-m module``) with ``args``."""
    target = ["--module", module] if module else ["--script", str(script)]
    return [python, "-u", "-m", "elastic_events.rounds.spare", control_file, str(slot), *target, *args]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 4 or argv[2] not in ("--script", "--module") or not argv[1].isdigit():
        print(f"usage: {USAGE}", file=sys.stderr)
        return 2
    control_file, slot, kind, target, args = argv[0], int(argv[1]), argv[2], argv[3], argv[4:]

    import torch  # noqa: F401 - the cost a spare exists to pay in advance
    import torch.distributed  # noqa: F401

    from elastic_events.rounds.joining import prewarm

    prewarm()  # and what the first step after admission would import

    reader = ControlReader(control_file, slot)
    reader.set_phase(RankPhase.PARKED)
    while (local_rank := reader.assignment()) is None:  # the agent kills an unused spare with its group
        time.sleep(POLL_S)
    del reader
    os.environ["LOCAL_RANK"] = str(local_rank)
    if kind == "--module":
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as ``python script.py`` sets it
        runpy.run_path(target, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
