"""The half of :class:`~elastic_events.training.ElasticTraining` that brings a rank into a new round.

Once the round's group is up every rank reports what it holds (:class:`RankReport`), and
the same plan is made everywhere (:func:`plan_hydration`): survivors at the furthest step
are the state; replicated models are streamed from one of them to the newcomers
(:meth:`RoundJoining._replicate`), sharded ones gathered and re-sharded onto the new mesh
(:meth:`RoundJoining._reshard`). When no rank survived with the state, a replaced rank's
hand-off (:mod:`elastic_events.rounds.handoff`) is the state, and only without one the checkpoint.
A sharded model repaired after a failure is put back together on the new rank 0 from the
survivors' live shards and the copies their peers hold (:mod:`elastic_events.rounds.snapshot`,
:meth:`RoundJoining._restore_from_snapshots`), then re-sharded the same way.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import elastic_events
from elastic_events import contract, eventlog
from elastic_events.control import NO_SNAPSHOT, SNAPSHOT_WRITING, Event, RankPhase
from elastic_events.errors import ElasticTrainingError, HydrationError
from elastic_events.rng import derive_rank_seed, seed_all
from elastic_events.rounds import abort
from elastic_events.rounds.group import RoundSpec, init_round_group
from elastic_events.rounds.handoff import discard_handoff, find_handoff, load_handoff, write_handoff
from elastic_events.rounds.hydration import (
    FullState,
    HydrationPlan,
    RankReport,
    allocate_tensors,
    collective_failures,
    model_tensors,
    nonpersistent_buffers,
    plan_from_handoff,
    plan_hydration,
    split_tensors,
    structure_digest,
)
from elastic_events.rounds.snapshot import Captured, Piece, Replicator, recv_body, recv_header, send_piece
from elastic_events.rounds.snapshot_restore import RestorePlan, SnapshotReport, assemble, load_local_state, plan_restore
from elastic_events.rounds.transfer import broadcast_tensors

__all__ = ["Kept", "RoundJoining", "is_sharded", "on_meta", "prewarm"]


@dataclass(kw_only=True)
class Kept:
    """What a survivor takes from its old round into the new one (besides its live objects)."""

    step: int
    sharded: bool
    structure: str
    checksum: str | None
    full: FullState | None = None  # a sharded model's full state, on the new round's rank 0
    small: dict[str, Any] | None = None
    failed: bool = False  # a peer failed in its round (it came through recover())
    # a sharded survivor of a failure: its live shards, the snapshots it holds, what it reports of them
    captured: Captured | None = None
    replicator: Replicator | None = None
    snapshot: SnapshotReport | None = None


def prewarm() -> None:
    """Import what a rank's first step after admission would import: a parked rank or a spare pays it
    while it waits, not while the survivors wait for it (``torch._dynamo``, which the first optimizer
    step, DDP's first forward and FSDP2's first ``fully_shard`` import: 1-2 s on a CPU; FSDP2 and DCP's
    state dicts: about 1 s more)."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def on_meta(module: torch.nn.Module) -> bool:
    return any(t.is_meta for _, t in model_tensors(module))


class RoundJoining:
    """Mixed into :class:`~elastic_events.training.ElasticTraining`, whose state it brings into each round."""

    def _join(
        self,
        event: Event,
        *,
        kept: Kept | None,
        fresh_module: torch.nn.Module | None,
        torn_down_s: float = 0.0,
    ) -> None:
        """Form the event's group, bring every rank to the same state, mark READY."""
        spec = RoundSpec.from_event(event, local_rank=self.local_rank, local_world_size=self.local_world_size)
        os.environ.update(spec.environment())
        t0 = time.monotonic()
        eventlog.emit(contract.GROUP_TORN_DOWN, event_id=event.event_id, step=self.step, seconds=torn_down_s)
        with abort.forming(event.round):
            self._store = init_round_group(
                spec, device=self.device, backend=self.backend, timeout_s=self.config.timeout_s
            )
        self.round = event.round
        self._watch_repairs()
        eventlog.emit(contract.GROUP_UP, event_id=event.event_id, seconds=time.monotonic() - t0)
        t1 = time.monotonic()
        survivor = kept is not None
        if survivor and self._reader is not None and self._reader.progress().snapshot_step != NO_SNAPSHOT:
            discard_handoff(self.local_rank)  # recovered by itself: what its watch wrote is stale
            self._reader.set_snapshot_step(NO_SNAPSHOT)
        handoff = find_handoff(self.local_rank, round=event.round) if event.repair and not survivor else None
        handed: dict[str, Any] | None = None
        if handoff is not None:
            try:  # before the plan: a hand-off that cannot be read is not offered
                handed = load_handoff(handoff)
            except Exception as exc:  # noqa: BLE001 - storage is the fallback; say why
                print(
                    f"rank {spec.rank}: cannot read its predecessor's hand-off {handoff.path}: {exc}",
                    file=sys.stderr,
                    flush=True,
                )
                handoff = None
        report = RankReport(
            rank=spec.rank,
            survivor=survivor,
            source_ready=survivor and (not kept.sharded or kept.full is not None),
            step=kept.step if survivor else -1,
            structure=kept.structure if survivor else structure_digest(fresh_module),
            checksum=kept.checksum if survivor else None,
            sharded=kept.sharded if survivor else None,
            control_step=handoff.control_step if handoff else self._reader.step if self._reader is not None else 0,
            handoff_step=handoff.step if handoff else -1,
            snapshot=kept.snapshot if survivor else None,
            failed=survivor and kept.failed,
        )
        reports: list[Any] = [None] * spec.world_size
        with collective_failures(
            HydrationError,
            rank=spec.rank,
            round=spec.round,
            world_size=spec.world_size,
            timeout_s=self.config.timeout_s,
        ):
            dist.all_gather_object(reports, report)
            # A failure repaired by this event, or by a scale event it met on its way (its survivors took that
            # event's group, pending before they failed): the survivors may be a step apart.
            repairing = event.repair or any(r.failed for r in reports)
            if any(r.snapshot is not None for r in reports):  # a sharded model after a failure
                plan, received = self._restore_from_snapshots(reports, kept, fresh_module), True
                control_step = max(r.control_step for r in reports)  # never back: events target these counts
            else:
                plan = plan_from_handoff(
                    plan_hydration(reports, recovering=repairing, local_world_size=self.local_world_size), reports
                )
                received = spec.rank in plan.newcomers  # a newcomer, or a survivor a step behind the others
                self._hydrate(plan, kept, handed, fresh_module, received)
                # a rank that failed after committing a step may not have counted it: agree on the source's count
                control_step = (
                    next(r.control_step for r in reports if r.rank == plan.source)
                    if repairing and plan.source is not None
                    else self._control_step
                )
        self._set_world()
        seed_all(derive_rank_seed(self._base_seed, self.step, self.rank))
        if self._reader is not None and ((repairing and plan.source is not None) or received):
            self._reader.set_step(control_step)
        self._start_snapshots()
        self._phase(RankPhase.READY)
        elastic_events._new_round("recovered" if repairing else "reconfigure" if survivor else "admitted")
        eventlog.emit(
            contract.HYDRATED,
            event_id=event.event_id,
            step=self.step,
            seconds=time.monotonic() - t1,
            newcomers=len(plan.newcomers),
            from_rank=plan.source,
            sharded=plan.sharded,
        )

    def _hydrate(
        self,
        plan: HydrationPlan,
        kept: Kept | None,
        handed: dict[str, Any] | None,
        fresh_module: torch.nn.Module | None,
        received: bool,
    ) -> None:
        """Bring this rank to ``plan``'s state: from a hand-off, storage, a full sharded state or a replica."""
        if plan.handoff and plan.source == self.rank:
            self._load_handoff(handed, fresh_module)
        if plan.source is None:
            self._rebuild_from_storage(fresh_module)
        elif plan.sharded:
            self._reshard(plan.source, kept, fresh_module)
        else:
            self._replicate(plan.source, plan.newcomers, fresh_module if fresh_module is not None else self.module)
            if not received:
                self.model = self._rewrap()  # DDP over the new group (receivers wrapped in _replicate)

    def _restore_from_snapshots(
        self, reports: list[RankReport], kept: Kept | None, fresh_module: torch.nn.Module | None
    ) -> HydrationPlan:
        """A sharded model after a failure: the newest step every shard survived at, put back on the new mesh
        (each piece to its own rank when the world size is the broken round's, else assembled on rank 0)."""
        t0 = time.monotonic()
        restore = plan_restore({r.rank: r.snapshot for r in reports if r.snapshot is not None})
        everyone = tuple(range(self.world_size))
        if restore is None:
            held = {r.rank: (r.snapshot.live_step, r.snapshot.replicas) for r in reports if r.snapshot is not None}
            why = f"no step at which every shard of the broken round survived (live step, copies held: {held})"
            if self.rank == 0:
                print(f"rank 0: {why}: loading the newest checkpoint", file=sys.stderr, flush=True)
            eventlog.emit(contract.SNAPSHOT_UNAVAILABLE, reason=why)
            self._drop_state(kept)
            self._rebuild_from_storage(fresh_module)
            return HydrationPlan(source=None, newcomers=everyone, survivors=(), sharded=True, step=-1)
        group = self._side_group()[0]
        in_place = restore.world_size == self.world_size
        if in_place:
            self._load_own_piece(self._own_piece(restore, kept, group), kept, fresh_module)
        else:
            self._assemble_on_rank0(restore, kept, group, fresh_module)
        self.resumed_from = "snapshot"
        live = sum(1 for _, from_live in restore.sources if from_live)
        eventlog.emit(
            contract.SNAPSHOT_RESTORED,
            step=restore.step,
            redone=restore.furthest - restore.step,
            from_live=live,
            from_copies=len(restore.sources) - live,
            broken_round=restore.round,
            seconds=time.monotonic() - t0,
            resharded=not in_place,
        )
        return HydrationPlan(source=0, newcomers=everyone, survivors=(), sharded=True, step=restore.step)

    def _own_piece(self, restore: RestorePlan, kept: Kept | None, group: Any) -> Piece:
        """The broken round's shard of this rank's number, at ``restore.step``: its own, or sent by whoever has it.
        Pairwise sends in owner order (the same order on every rank: no cycle of waits)."""
        mine = None
        for owner, (source, live) in enumerate(restore.sources):
            if self.rank == source:
                piece = self._live_piece(kept) if live else kept.replicator.held_piece(owner, restore.step)
                if owner == self.rank:
                    mine = piece
                else:
                    send_piece(piece, dst=owner, group=group, bucket_bytes=self.config.bucket_bytes)
            elif self.rank == owner:
                mine = self._recv_piece(owner, source, restore.step, group)
        return mine

    def _load_own_piece(self, piece: Piece, kept: Kept | None, fresh_module: torch.nn.Module | None) -> None:
        """Same world size: the fresh model on the new mesh takes this rank's piece as its local shards."""
        self._drop_state(kept)  # the piece holds what it needs of the old state
        self._build_sharded(fresh_module)
        load_local_state(self.model, self.optimizer, piece)
        self._finish_sharded(piece.small if self.rank == 0 else None)  # owner 0's small state, as when assembled

    def _assemble_on_rank0(
        self, restore: RestorePlan, kept: Kept | None, group: Any, fresh_module: torch.nn.Module | None
    ) -> None:
        """Another world size: the full state assembled on rank 0 from every piece, re-sharded onto the new mesh."""
        pieces = self._pieces_to_rank0(restore, kept, group)
        full = small = None
        if self.rank == 0:
            model_sd, optim_sd, first = assemble(pieces)
            full, small = FullState(model=model_sd, optimizer=optim_sd), first.small
        else:
            for _ in pieces:  # the sends
                pass
        self._drop_state(kept)
        self._reshard(
            0, Kept(step=restore.step, sharded=True, structure="", checksum=None, full=full, small=small), fresh_module
        )

    def _pieces_to_rank0(self, restore: RestorePlan, kept: Kept | None, group: Any) -> Iterator[Piece]:
        """Every shard of the broken round at ``restore.step``, in its rank order: rank 0 yields each piece
        (its own or received), a rank that sends one yields nothing for it. One piece in memory at a time."""
        for owner, (source, live) in enumerate(restore.sources):
            if self.rank == source:
                piece = self._live_piece(kept) if live else kept.replicator.held_piece(owner, restore.step)
                if self.rank == 0:
                    yield piece
                else:
                    send_piece(piece, dst=0, group=group, bucket_bytes=self.config.bucket_bytes)
            elif self.rank == 0:
                yield self._recv_piece(owner, source, restore.step, group)

    def _recv_piece(self, owner: int, source: int, step: int, group: Any) -> Piece:
        piece = recv_header(src=source, group=group)
        if piece is None or (piece.owner, piece.step) != (owner, step):
            got = None if piece is None else (piece.owner, piece.step)
            raise HydrationError(f"rank {source} sent {got} instead of rank {owner}'s shard at step {step}")
        flat = torch.empty(piece.layout.nbytes, dtype=torch.uint8)
        return recv_body(piece, flat, src=source, group=group, bucket_bytes=self.config.bucket_bytes)

    def _live_piece(self, kept: Kept) -> Piece:
        snap, c = kept.snapshot, kept.captured
        return Piece(
            owner=snap.rank,
            round=snap.round,
            world_size=snap.world_size,
            step=kept.step,
            layout=c.layout,
            small=self._small_state(),
            param_groups=c.param_groups(self.optimizer),
            tensors=c.tensors,
        )

    def _drop_state(self, kept: Kept | None) -> None:
        """A survivor's old sharded objects and the copies it held: not needed once the state is on rank 0."""
        if kept is not None:
            kept.captured = kept.replicator = None
        self._captured = None
        self.module = self.model = self.optimizer = self.scheduler = None
        gc.collect()  # FSDP2's hooks hold the old sharded model in cycles

    def _small_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "extra": self.extra,
            "base_seed": self._base_seed,
            "control_step": self._reader.step if self._reader is not None else 0,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
        }

    def _load_small_state(self, state: dict[str, Any]) -> None:
        self.resumed_from = "peers"
        self.step, self.extra, self._base_seed = state["step"], state["extra"], state["base_seed"]
        self._control_step = state["control_step"]
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.sampler is not None and state["sampler"] is not None:
            self.sampler.load_state_dict(state["sampler"])

    def _hand_off(self, event: Event) -> None:
        """RepairWatch thread, main thread blocked in the broken round: write the state for this rank's replacement."""
        reader = self._reader
        if self.module is None or reader is None or is_sharded(self.module) or self._optimizer_busy():
            return
        slot = reader.progress()
        if slot.phase not in (RankPhase.RUNNING, RankPhase.READY) or slot.round != self.round:
            return  # between rounds (tearing down, forming, hydrating): the state is not one step's
        begun = self._optimizer_steps[0]
        reader.set_snapshot_step(SNAPSHOT_WRITING)
        try:
            state = {
                "model": dict(model_tensors(self.module)),
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "small": self._small_state(),
            }
            write_handoff(self.local_rank, round=event.round, step=self.step, control_step=reader.step, state=state)
        except Exception as exc:  # noqa: BLE001 - the replacement falls back to storage; say why
            print(f"rank {self.rank}: could not hand off its state: {exc}", file=sys.stderr, flush=True)
            discard_handoff(self.local_rank)
            reader.set_snapshot_step(NO_SNAPSHOT)
            return
        if self._optimizer_steps[0] != begun:  # the loop was not blocked after all: the state may be torn
            discard_handoff(self.local_rank)
            reader.set_snapshot_step(NO_SNAPSHOT)
            return
        reader.set_snapshot_step(self.step)
        print(
            f"rank {self.rank}: its training loop has not returned since the launcher published the repair of round "
            f"{self.round} (blocked); handed its state at step {self.step} to its replacement",
            file=sys.stderr,
            flush=True,
        )

    def _load_handoff(self, state: dict[str, Any], fresh_module: torch.nn.Module) -> None:
        """The source of a round no rank survived: take the state its predecessor handed off."""
        self.module = fresh_module
        if on_meta(self.module):
            self.module.to_empty(device=self.device)
        with torch.no_grad():
            for name, tensor in model_tensors(self.module):
                tensor.copy_(state["model"][name])
        self.model = self.module  # wrapped for the new group after hydration
        self._build_optimizer()
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self._load_small_state(state["small"])
        self.resumed_from = "handoff"

    def _replicate(self, source: int, newcomers: tuple[int, ...], fresh_module: torch.nn.Module | None) -> None:
        """Replicated model: the source streams everything to the newcomers; survivors re-wrap."""
        if not newcomers:
            return
        members = sorted((source, *newcomers))
        timeout = timedelta(seconds=self.config.timeout_s)
        group = None if len(members) == self.world_size else dist.new_group(members, timeout=timeout)
        if self.rank not in members:
            return
        sending = self.rank == source
        if not sending:
            self.module = fresh_module
            if on_meta(self.module):
                self.module.to_empty(device=self.device)
        skeleton, optim_tensors = None, []
        if sending and self.optimizer is not None:
            skeleton, optim_tensors = split_tensors(self.optimizer.state_dict())
        box = [(skeleton, self._small_state()) if sending else None]
        dist.broadcast_object_list(box, src=source, group=group)
        skeleton, small = box[0]
        optim_state = None
        if not sending and skeleton is not None:
            optim_state, optim_tensors = allocate_tensors(skeleton, self.device)
        tensors = [t for _, t in model_tensors(self.module)]
        broadcast_tensors(
            [*tensors, *optim_tensors],
            src=source,
            group=group,
            device=self._comm_device(),
            bucket_bytes=self.config.bucket_bytes,
        )
        if not sending:
            self.model = self._rewrap()
            self._build_optimizer()
            if optim_state is not None:
                self.optimizer.load_state_dict(optim_state)
            self._load_small_state(small)

    def _reshard(self, source: int, kept: Kept | None, fresh_module: torch.nn.Module | None) -> None:
        """Sharded model: everyone rebuilds on the new mesh and takes its shards of the full state."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if source != 0:
            raise ElasticTrainingError(f"the full state of the sharded model is on rank {source}, not on rank 0")
        full = kept.full if kept is not None else None
        small = kept.small if full is not None else None
        self._build_sharded(fresh_module)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(self.model, full.model if full else {}, options=options)
        if self.optimizer is not None:
            set_optimizer_state_dict(self.model, self.optimizer, full.optimizer if full else {}, options=options)
        if kept is not None:
            kept.full = full = None
        self._finish_sharded(small)

    def _build_sharded(self, fresh_module: torch.nn.Module | None) -> None:
        self.module = fresh_module if fresh_module is not None else self._model_fn()
        self.model = self._wrap(self.module)
        self._check_materialised()
        self._build_optimizer()

    def _finish_sharded(self, small: dict[str, Any] | None) -> None:
        """Rank 0's non-persistent buffers and small state (step, scheduler, sampler) to every rank."""
        buffers = nonpersistent_buffers(self.model)
        broadcast_tensors(buffers, src=0, device=self._comm_device(), bucket_bytes=self.config.bucket_bytes)
        box = [small]
        dist.broadcast_object_list(box, src=0)
        self._load_small_state(box[0])

    def _rebuild_from_storage(self, fresh_module: torch.nn.Module | None) -> None:
        """No rank holds a complete state: every rank builds its model and loads the newest checkpoint."""
        self._build(fresh_module if fresh_module is not None else self._model_fn())
        self._control_step = 0
        if self.checkpointer is not None and self.checkpointer.latest() is not None:
            self._load_checkpoint()
