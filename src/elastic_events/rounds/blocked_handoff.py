"""What a rank blocked in a broken round hands to its replacement (:mod:`.handoff` stores it).

The repair watch (:mod:`.watchdog`) calls :class:`BlockedHandOff` from its own thread once the main
thread has stayed blocked for a few step times after the launcher published a repair. The state is
one step's: a collective that blocks comes before the optimizer step, so nothing changes it while it
is written, and it is written only while the rank is RUNNING (or READY) in the round being repaired
and no optimizer step runs; if an optimizer step began meanwhile, the hand-off is deleted.

* A replicated model: the whole state (model tensors by name, optimizer state, small state).
* A sharded model (FSDP2) whose in-memory snapshots ran: the rank's live piece and every complete copy
  it held (its neighbour's, and its own), so that its replacement reports and sends them in the
  repaired round as the rank would have (:meth:`~.joining.Joiner.join`). Snapshot replication is
  ended first: the copies then stay as they are while they are written.
* HSDP with two replicas or more: the rank's live piece and its copy one step back (:mod:`.own_copy`);
  another replica usually holds the same shard, but not when it was the failed rank's peer.
* A sharded model without snapshots: nothing (its one piece cannot complete any restore).
"""

from __future__ import annotations

import sys
from typing import Any

from elastic_events.control import NO_SNAPSHOT, SNAPSHOT_WRITING, Event, RankPhase
from elastic_events.rounds.engine import RoundEngine
from elastic_events.rounds.handoff import HandedPieces, HandoffKind, discard_handoff, write_handoff
from elastic_events.rounds.hydration import model_tensors
from elastic_events.rounds.replica_plan import Holding
from elastic_events.rounds.snapshots import Snapshots
from elastic_events.training_state import TrainState

__all__ = ["BlockedHandOff"]


class BlockedHandOff:
    """The repair watch's ``on_blocked`` (see the module)."""

    def __init__(self, engine: RoundEngine, state: TrainState, snapshots: Snapshots) -> None:
        self.engine, self.state, self.snapshots = engine, state, snapshots

    def __call__(self, event: Event) -> None:
        """Watch thread, main thread blocked in the broken round: write the state for this rank's replacement."""
        e, s = self.engine, self.state
        reader = e.reader
        if s.module is None or reader is None or s.optimizer_busy():
            return
        slot = reader.progress()
        if slot.phase not in (RankPhase.RUNNING, RankPhase.READY) or slot.round != e.round:
            return  # between rounds (tearing down, forming, hydrating): the state is not one step's
        begun = s.optimizer_steps[0]
        reader.set_snapshot_step(SNAPSHOT_WRITING)
        try:
            kind, state = self._state(reader.step)
            if state is not None:
                write_handoff(
                    e.local_rank, round=event.round, step=s.step, control_step=reader.step, state=state, kind=kind
                )
        except Exception as exc:  # noqa: BLE001 - the replacement falls back to storage; say why
            print(f"rank {e.rank}: could not hand off its state: {exc}", file=sys.stderr, flush=True)
            state = None
        if state is None or s.optimizer_steps[0] != begun:  # nothing written, or the loop was not blocked after all
            discard_handoff(e.local_rank)
            reader.set_snapshot_step(NO_SNAPSHOT)
            return
        reader.set_snapshot_step(s.step)
        what = "its state" if kind is HandoffKind.REPLICATED else f"its {len(state['pieces'])} piece(s) of the state"
        print(
            f"rank {e.rank}: its training loop has not returned since the launcher published the repair of round "
            f"{e.round} (blocked); handed {what} at step {s.step} to its replacement",
            file=sys.stderr,
            flush=True,
        )

    def _state(self, control_step: int) -> tuple[HandoffKind, dict[str, Any] | None]:
        s, module = self.state, self.state.built_module()
        if not s.sharded:
            return HandoffKind.REPLICATED, {
                "model": {name: t.detach().cpu() for name, t in model_tensors(module)},
                "optimizer": s.optimizer.state_dict() if s.optimizer is not None else None,
                "small": s.small_state(control_step=control_step),
            }
        handed = self._pieces()
        return HandoffKind.PIECES, handed.to_state() if handed is not None else None

    def _pieces(self) -> HandedPieces | None:
        """A sharded rank's pieces (see the module); None when it holds nothing a restore could use."""
        e, s, snaps = self.engine, self.state, self.snapshots
        replicator, layout = snaps.replicator, e.layout()
        if snaps.replicas and layout is not None:
            snaps.live()
            pieces = [snaps.piece(s.step)]
            back = snaps.one_step_back(s.step)
            if back is not None:
                pieces.append(back)
            holding = Holding(
                shard_size=layout.shard_size,
                shard=layout.shard_of(e.rank),
                step=s.step,
                previous=back.step if back is not None else None,
            )
        elif replicator is not None:
            replicator.abort()  # the round is being repaired: its copies stay as they are from here on
            snaps.live()
            pieces = [snaps.piece(s.step)]
            pieces += [replicator.held_piece(o, at) for o, at in replicator.holdings() if (o, at) != (e.rank, s.step)]
            holding = None
        else:
            return None
        return HandedPieces(
            round=e.round, world_size=e.world_size, rank=e.rank, live_step=s.step, holding=holding, pieces=tuple(pieces)
        )
