"""A blocked rank's state, handed to its replacement through node-local memory.

A survivor that stays blocked in the broken round's collective after the launcher published
its repair (see :mod:`elastic_events.rounds.abort`) is killed and replaced by its agent
(``hyperpodrun.repair.stuck_in_broken_group``). With one rank per node that rank can be the
only holder of the state, and the repair would fall back to the checkpoint. Its
:class:`~elastic_events.rounds.abort.RepairWatch` thread still runs beside the blocked main thread,
so it writes the rank's state first, here, and the replacement takes it over:

* the state is consistent: a collective that blocks comes before the optimizer step (the
  contract of :meth:`~elastic_events.training.ElasticTraining.recover`), so parameters,
  optimizer state, step and data position are those of the last committed step. The watch
  writes only after the rank has been silent for a few of its step times, and never while an
  optimizer step runs;
* the files lie next to the node's control channel (``/dev/shm/hyperpodrun-*/``, removed by
  the agent at exit): ``handoff-<local rank>.pt`` (model tensors by name, optimizer state, the
  small state) and, written last, ``handoff-<local rank>.json`` (step, the repaired round it is
  for, the rank's count of ``elastic_event_detected()`` calls);
* the rank's control slot says ``SNAPSHOT_WRITING`` meanwhile and the step once written: the
  agent does not kill a rank while it writes;
* when the repaired round forms and no survivor holds the state, the rank with the newest
  hand-off for that round loads it and sends it to the others like a survivor would; a
  hand-off for another round is never used, and a rank that recovers by itself deletes its own.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic_events.contract import rank_context

__all__ = ["Handoff", "discard_handoff", "find_handoff", "load_handoff", "write_handoff"]


@dataclass(frozen=True, kw_only=True)
class Handoff:
    step: int
    control_step: int
    path: Path  # the state (``.pt``)


def _paths(local_rank: int) -> tuple[Path, Path] | None:
    control = rank_context().control_file
    if control is None:
        return None
    base = Path(control).parent / f"handoff-{local_rank}"
    return base.with_suffix(".pt"), base.with_suffix(".json")


def write_handoff(local_rank: int, *, round: int, step: int, control_step: int, state: dict[str, Any]) -> Path | None:
    """Write ``state`` for the replacement of ``local_rank`` in ``round``; None outside a launcher."""
    paths = _paths(local_rank)
    if paths is None:
        return None
    state_path, meta_path = paths
    discard_handoff(local_rank)
    torch.save(state, state_path.with_suffix(".pt.tmp"))
    os.replace(state_path.with_suffix(".pt.tmp"), state_path)
    meta_path.with_suffix(".json.tmp").write_text(
        json.dumps({"step": step, "round": round, "control_step": control_step})
    )
    os.replace(meta_path.with_suffix(".json.tmp"), meta_path)
    return state_path


def find_handoff(local_rank: int, *, round: int) -> Handoff | None:
    """The complete hand-off of ``local_rank``'s predecessor for ``round``, if there is one."""
    paths = _paths(local_rank)
    if paths is None:
        return None
    state_path, meta_path = paths
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        return None
    if meta.get("round") != round or not state_path.is_file():
        return None
    return Handoff(step=int(meta["step"]), control_step=int(meta["control_step"]), path=state_path)


def load_handoff(handoff: Handoff) -> dict[str, Any]:
    """The state of a hand-off (only tensors and plain containers: loaded with ``weights_only``)."""
    return torch.load(handoff.path, map_location="cpu", weights_only=True)


def discard_handoff(local_rank: int) -> None:
    """Delete ``local_rank``'s hand-off (marker first, so a half-deleted one is never found)."""
    paths = _paths(local_rank)
    if paths is None:
        return
    state_path, meta_path = paths
    for path in (meta_path, state_path, state_path.with_suffix(".pt.tmp"), meta_path.with_suffix(".json.tmp")):
        path.unlink(missing_ok=True)
