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
  the agent at exit): ``handoff-<local rank>.pt`` and, written last, ``handoff-<local rank>.json``
  (step, the repaired round it is for, the rank's count of ``elastic_event_detected()`` calls,
  and the :class:`HandoffKind`);
* a replicated model's hand-off is its whole state (model tensors by name, optimizer state, the
  small state). A sharded model's rank holds one piece of the state, and the copies of other
  ranks' pieces its in-memory snapshots keep (:mod:`.snapshot`), or, with HSDP, its own piece one
  step back (:mod:`.own_copy`): it hands all of them off (:class:`HandedPieces`), and its
  replacement reports and sends them in the repaired round as the rank itself would have;
* the rank's control slot says ``SNAPSHOT_WRITING`` meanwhile and the step once written: the
  agent does not kill a rank while it writes;
* when the repaired round forms and no survivor holds the state, the rank with the newest
  hand-off for that round loads it and sends it to the others like a survivor would; a
  hand-off for another round is never used, and a rank that recovers by itself deletes its own.
  A replacement deletes the hand-off it took once its round has formed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from elastic_events.contract import rank_context
from elastic_events.rounds.replica_plan import Holding
from elastic_events.rounds.snapshot import Piece
from elastic_events.rounds.snapshot_restore import SnapshotReport
from elastic_events.rounds.transfer import byte_view

__all__ = [
    "HandedPieces",
    "Handoff",
    "HandoffKind",
    "discard_handoff",
    "find_handoff",
    "load_handoff",
    "write_handoff",
]


class HandoffKind(str, Enum):
    REPLICATED = "replicated"  # the whole state: model tensors by name, optimizer state, small state
    PIECES = "pieces"  # a sharded rank's pieces of the state (:class:`HandedPieces`)


@dataclass(frozen=True, kw_only=True)
class Handoff:
    step: int
    control_step: int
    path: Path  # the state (``.pt``)
    kind: HandoffKind = HandoffKind.REPLICATED


@dataclass(frozen=True, kw_only=True)
class HandedPieces:
    """What a blocked rank of a sharded model held of the broken round's state: its live piece and the
    snapshot pieces it kept (its neighbour's copies and its own, or with HSDP its own one step back)."""

    round: int  # the broken round
    world_size: int  # its size
    rank: int  # the blocked rank's rank in it
    live_step: int  # the step of its live piece
    holding: Holding | None  # HSDP: the shard its pieces are (another replica holds it too)
    pieces: tuple[Piece, ...]

    def snapshot_report(self) -> SnapshotReport:
        """The report the blocked rank would have made in the repaired round (FSDP over the world)."""
        copies = tuple((p.owner, p.step) for p in self.pieces if (p.owner, p.step) != (self.rank, self.live_step))
        return SnapshotReport(
            round=self.round, world_size=self.world_size, rank=self.rank, live_step=self.live_step, replicas=copies
        )

    def piece(self, owner: int, step: int) -> Piece | None:
        return next((p for p in self.pieces if (p.owner, p.step) == (owner, step)), None)

    def at(self, step: int) -> Piece | None:
        """HSDP: the blocked rank's own piece at ``step`` (live, or one step back)."""
        return self.piece(self.rank, step)

    def to_state(self) -> dict[str, Any]:
        """As :func:`write_handoff` saves it: tensors and plain containers only (loaded with ``weights_only``)."""
        h = self.holding
        return {
            "round": self.round,
            "world_size": self.world_size,
            "rank": self.rank,
            "live_step": self.live_step,
            "holding": None if h is None else [h.shard_size, h.shard, h.step, -1 if h.previous is None else h.previous],
            "pieces": [
                {
                    "header": torch.frombuffer(bytearray(p.header()), dtype=torch.uint8),
                    "tensors": [byte_view(t) for t in p.tensors],
                }
                for p in self.pieces
            ],
        }

    @staticmethod
    def from_state(state: dict[str, Any]) -> HandedPieces:
        pieces = []
        for saved in state["pieces"]:
            piece = Piece.from_header(saved["header"].numpy().tobytes())  # written by this job's own rank
            piece.tensors = list(saved["tensors"])  # raw bytes, as a holder's copy: read by their layout's dtypes
            pieces.append(piece)
        h = state["holding"]
        holding = (
            None if h is None else Holding(shard_size=h[0], shard=h[1], step=h[2], previous=None if h[3] < 0 else h[3])
        )
        return HandedPieces(
            round=state["round"],
            world_size=state["world_size"],
            rank=state["rank"],
            live_step=state["live_step"],
            holding=holding,
            pieces=tuple(pieces),
        )


def _paths(local_rank: int) -> tuple[Path, Path] | None:
    control = rank_context().control_file
    if control is None:
        return None
    base = Path(control).parent / f"handoff-{local_rank}"
    return base.with_suffix(".pt"), base.with_suffix(".json")


def write_handoff(
    local_rank: int,
    *,
    round: int,
    step: int,
    control_step: int,
    state: dict[str, Any],
    kind: HandoffKind = HandoffKind.REPLICATED,
) -> Path | None:
    """Write ``state`` (of ``kind``) for the replacement of ``local_rank`` in ``round``; None outside a launcher."""
    paths = _paths(local_rank)
    if paths is None:
        return None
    state_path, meta_path = paths
    discard_handoff(local_rank)
    torch.save(state, state_path.with_suffix(".pt.tmp"))
    os.replace(state_path.with_suffix(".pt.tmp"), state_path)
    meta_path.with_suffix(".json.tmp").write_text(
        json.dumps({"step": step, "round": round, "control_step": control_step, "kind": kind.value})
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
    return Handoff(
        step=int(meta["step"]),
        control_step=int(meta["control_step"]),
        path=state_path,
        kind=HandoffKind(meta.get("kind", HandoffKind.REPLICATED.value)),
    )


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
