"""How :class:`~elastic_events.ElasticTraining` leaves one round and brings its state into the next.

:class:`Joiner` works on a rank's :class:`~elastic_events.training_state.TrainState` with the round
engine's moves. Leaving (:meth:`Joiner.leave`, :meth:`Joiner.keep_after_failure`) notes what the
rank keeps (:class:`~elastic_events.training_state.Kept`). Joining (:meth:`Joiner.join`): once the
round's group is up every rank reports what it holds (:class:`~.hydration.RankReport`) and the same
plan is made everywhere (:func:`~.hydration.plan_hydration`): survivors at the furthest step are
the state; replicated models are streamed from one of them to the newcomers, sharded ones gathered
and re-sharded onto the new mesh, HSDP ones kept where they are and sent shard by shard from one
replica to the ranks that lack them (:mod:`.replica_plan`, :mod:`.replica_hydration`). When no rank survived with the state, a replaced rank's hand-off
(:mod:`.handoff`) is the state, and only without one the checkpoint. A sharded model repaired after
a failure is put back together from the survivors' live shards and the copies their peers hold
(:mod:`.snapshot`, :meth:`Joiner._restore_from_snapshots`), then re-sharded the same way.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from elastic_events import eventlog
from elastic_events.contract import Record
from elastic_events.control import NO_SNAPSHOT, Event, RankPhase
from elastic_events.errors import ElasticTrainingError, HydrationError, RecoveryError
from elastic_events.rng import derive_rank_seed, seed_all
from elastic_events.rounds.engine import RoundEngine
from elastic_events.rounds.full_scatter import scatter_full_state
from elastic_events.rounds.handoff import HandedPieces, HandoffKind, discard_handoff, find_handoff, load_handoff
from elastic_events.rounds.hydration import (
    FullState,
    HydrationPlan,
    RankReport,
    gather_full_state,
    nonpersistent_buffers,
    plan_from_handoff,
    plan_hydration,
    structure_digest,
    value_checksum,
)
from elastic_events.rounds.replica_hydration import hydrate_from_replicas
from elastic_events.rounds.replica_plan import Holding, ReplicaPlanError, plan_replicas
from elastic_events.rounds.snapshot import Piece, recv_body, recv_header, send_piece
from elastic_events.rounds.snapshot_restore import (
    RestorePlan,
    SnapshotReport,
    assemble,
    load_local_state,
    plan_restore,
)
from elastic_events.rounds.snapshots import Snapshots
from elastic_events.rounds.transfer import broadcast_tensors
from elastic_events.state_loading import loading_over
from elastic_events.training_state import Kept, TrainState, is_sharded

__all__ = ["Joiner", "prewarm"]


def prewarm() -> None:
    """Import what a rank's first step after admission would import: a parked rank or a spare pays it
    while it waits, not while the survivors wait for it (``torch._dynamo``, which the first optimizer
    step, DDP's first forward and FSDP2's first ``fully_shard`` import: 1-2 s on a CPU; FSDP2 and DCP's
    state dicts: about 1 s more). No device is touched."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401


class Joiner:
    """Carries one rank's training state from round to round (see the module)."""

    def __init__(self, engine: RoundEngine, state: TrainState, snapshots: Snapshots) -> None:
        self.engine, self.state, self.snapshots = engine, state, snapshots
        self._handed: HandedPieces | None = None  # while joining: the pieces a blocked predecessor handed off
        self._job_step = 0  # while joining: the newest step any rank of the round reported (-1: none)
        self._repairing = False  # while joining: the round repairs a failure

    @property
    def _control_step(self) -> int:
        reader = self.engine.reader
        return reader.step if reader is not None else 0

    # ------------------------------------------------------------------ leaving
    def leave(self, event: Event) -> Kept:
        """Leave the old round at a scale event: note what this rank keeps, drop what referred to the old
        group, tear it down. The shards of a sharded model go to the new round's rank 0 first."""
        e, s = self.engine, self.state
        sharded = e.distributed and is_sharded(s.model)
        self.snapshots.stop(broken=False)  # every rank is alive: its last snapshot is delivered first
        module = s.built_module()
        kept = Kept(
            step=s.step,
            sharded=sharded,
            structure=structure_digest(module),
            checksum=None if sharded else value_checksum(module),
        )
        layout = e.layout() if sharded else None
        if layout is not None:
            # HSDP: every shard stays where it is (the other replicas hold it too): nothing is gathered
            if not event.leaves:
                e.layout(event.world_size)  # a world of whole replicas, or MeshLayoutError before the teardown
                kept.piece = self._live_piece_now()
                kept.holding = Holding(shard_size=layout.shard_size, shard=layout.shard_of(e.rank), step=s.step)
            self.snapshots.captured = None
            s.drop_objects()
        elif sharded:
            # The shards of a leaving rank exist nowhere else: gather the full state onto the rank
            # that becomes rank 0 of the new round, before the old group goes.
            new_rank = -1 if event.leaves else event.group_rank * e.local_world_size + e.local_rank
            ranks: list[int] = [0] * e.world_size
            dist.all_gather_object(ranks, new_rank)
            if 0 not in ranks:
                raise ElasticTrainingError(f"no rank of round {e.round} becomes rank 0 of round {event.round}")
            kept.full = gather_full_state(
                s.built_model(),
                s.optimizer,
                holder=ranks.index(0),
                device=e.comm_device,
                bucket_bytes=e.config.bucket_bytes,
            )
            if kept.full is not None:
                kept.small = s.small_state(control_step=self._control_step)
            s.drop_objects()  # rebuilt on the new mesh, after the old sharded model is freed
        else:
            s.drop_wrapper()  # the DDP wrapper belongs to the old group
        if s.checkpointer is not None:
            s.checkpointer.release_group()
        e.release()
        return kept

    def keep_after_failure(self, exc: BaseException | None) -> Kept:
        """A peer failed in this rank's round (``exc``: what the failed step raised, if one did): note what
        it keeps, drop the broken group (aborted)."""
        e, s = self.engine, self.state
        if s.optimizer is not None:
            s.optimizer.zero_grad(set_to_none=True)  # the failed step's partial gradients
        module = s.built_module()
        kept = Kept(
            step=s.step,
            sharded=s.sharded,
            structure=structure_digest(module),
            checksum=None if s.sharded else value_checksum(module),
            failed=True,
        )
        layout = e.layout() if s.sharded and self.snapshots.replicas else None
        if layout is not None:  # HSDP: its live shards (and one step back) go into the repaired round
            self.snapshots.stop(broken=True)
            kept.piece, kept.previous = self.snapshots.piece(s.step), self.snapshots.one_step_back(s.step)
            back = kept.previous.step if kept.previous is not None else None
            shard = layout.shard_of(e.rank)
            kept.holding = Holding(shard_size=layout.shard_size, shard=shard, step=s.step, previous=back)
        elif s.sharded:  # its live shards, and the copies of its neighbour's it holds, go into the repaired round
            replicator = self.snapshots.stop(broken=True)
            if replicator is None:
                raise RecoveryError(
                    f"rank {e.rank}: a peer failed in round {e.round} and this sharded (FSDP2) model keeps no "
                    "in-memory snapshots (snapshot_every=0, --snapshot-every 0, or its capture failed): the failed "
                    "rank's shards exist nowhere else"
                )
            kept.captured, kept.replicator = self.snapshots.captured, replicator
            kept.snapshot = SnapshotReport(
                round=e.round, world_size=e.world_size, rank=e.rank, live_step=s.step, replicas=replicator.holdings()
            )
        # A gloo group closes its sockets only once nothing references it, and a peer blocked on this rank
        # learns of the failure only then: the failed step's frames (holding the DDP wrapper) must go too.
        if exc is not None:
            traceback.clear_frames(exc.__traceback__)
        s.drop_wrapper()  # the DDP wrapper belongs to the broken group
        if s.checkpointer is not None:
            s.checkpointer.release_group(abandon=True)
        e.release(broken=True)
        return kept

    # ------------------------------------------------------------------ joining
    def join(
        self, event: Event, *, kept: Kept | None, fresh_module: torch.nn.Module | None, torn_down_s: float = 0.0
    ) -> None:
        """Form the event's group, bring every rank to the same state, mark READY."""
        e, s = self.engine, self.state
        spec = e.form(event, step=s.step, torn_down_s=torn_down_s)
        t1 = time.monotonic()
        survivor = kept is not None
        reader = e.reader
        if survivor and reader is not None and reader.progress().snapshot_step != NO_SNAPSHOT:
            discard_handoff(e.local_rank)  # recovered by itself: what its watchdog wrote is stale
            reader.set_snapshot_step(NO_SNAPSHOT)
        handoff = find_handoff(e.local_rank, round=event.round) if event.repair and not survivor else None
        handed: dict[str, Any] | None = None  # a replicated model's whole state
        pieces = self._handed = None  # a sharded model's pieces, reported and sent as the blocked rank would have
        if handoff is not None:
            try:  # before the plan: a hand-off that cannot be read is not offered
                if handoff.kind is HandoffKind.PIECES:
                    pieces = self._handed = HandedPieces.from_state(load_handoff(handoff))
                else:
                    handed = load_handoff(handoff)
            except Exception as exc:  # noqa: BLE001 - storage is the fallback; say why
                print(
                    f"rank {spec.rank}: cannot read its predecessor's hand-off {handoff.path}: {exc}",
                    file=sys.stderr,
                    flush=True,
                )
                handoff = None
        if kept is not None:
            structure = kept.structure
        elif fresh_module is not None:
            structure = structure_digest(fresh_module)
        else:
            raise HydrationError(f"rank {spec.rank} joins round {event.round} with neither its state nor a fresh model")
        report = RankReport(
            rank=spec.rank,
            survivor=survivor,
            source_ready=kept is not None and (not kept.sharded or kept.full is not None),
            step=kept.step if kept is not None else -1,
            structure=structure,
            checksum=kept.checksum if kept is not None else None,
            sharded=kept.sharded if kept is not None else None,
            control_step=handoff.control_step if handoff else self._control_step,
            handoff_step=handoff.step if handoff is not None and handed is not None else -1,
            snapshot=kept.snapshot if kept is not None else self._handed_report(),
            failed=kept is not None and kept.failed,
            holding=kept.holding if kept is not None else pieces.holding if pieces is not None else None,
        )
        with e.collectives(HydrationError):
            reports = e.agree(report, error=HydrationError)
            # A failure repaired by this event, or by a scale event it met on its way (its survivors took that
            # event's group, pending before they failed): the survivors may be a step apart.
            repairing = event.repair or any(r.failed for r in reports)
            # what a start from step 0 would lose: the newest step any rank knows of (-1: none, every rank replaced)
            self._job_step, self._repairing = max(r.newest_step() for r in reports), repairing
            moved: int | None = None
            if any(r.snapshot is not None for r in reports):  # a sharded model after a failure
                plan, received = self._restore_from_snapshots(reports, kept, fresh_module), True
                control_step = max(r.control_step for r in reports)  # never back: events target these counts
            else:
                if any(r.holding is not None for r in reports):  # HSDP: shards from the replicas that kept them
                    plan, moved = self._from_replicas(reports, kept, fresh_module)
                else:
                    plan = plan_from_handoff(
                        plan_hydration(reports, recovering=repairing, local_world_size=e.local_world_size), reports
                    )
                    self._hydrate(plan, kept, handed, fresh_module, spec.rank in plan.newcomers)
                received = spec.rank in plan.newcomers  # a newcomer, or a survivor a step behind the others
                # a rank that failed after committing a step may not have counted it: agree on the source's count
                control_step = (
                    next(r.control_step for r in reports if r.rank == plan.source)
                    if repairing and plan.source is not None
                    else s.control_step
                )
        if handoff is not None:
            discard_handoff(e.local_rank)  # taken: the node's memory is freed
            if pieces is not None and plan.source is not None:
                s.resumed_from = "handoff"
        self._handed = None
        s.set_world(rank=e.rank, world_size=e.world_size)
        seed_all(derive_rank_seed(s.base_seed, s.step, e.rank))
        if reader is not None and ((repairing and plan.source is not None) or received):
            reader.set_step(control_step)
        self.snapshots.start()
        e.set_phase(RankPhase.READY)
        e.new_round("recovered" if repairing else "reconfigure" if survivor else "admitted")
        eventlog.emit(
            Record.HYDRATED,
            event_id=event.event_id,
            step=s.step,
            seconds=time.monotonic() - t1,
            newcomers=len(plan.newcomers),
            from_rank=plan.source,
            sharded=plan.sharded,
            bytes_moved=moved,  # HSDP: the shards sent between replicas (None: not counted on this path)
            mesh=list(layout.shape) if (layout := e.layout()) is not None else None,
        )

    def _handed_report(self) -> SnapshotReport | None:
        """A replacement holding a blocked FSDP rank's pieces reports them as that rank would have."""
        pieces = self._handed
        return pieces.snapshot_report() if pieces is not None and pieces.holding is None else None

    def _hydrate(
        self,
        plan: HydrationPlan,
        kept: Kept | None,
        handed: dict[str, Any] | None,
        fresh_module: torch.nn.Module | None,
        received: bool,
    ) -> None:
        """Bring this rank to ``plan``'s state: from a hand-off, storage, a full sharded state or a replica."""
        s = self.state
        if plan.handoff and plan.source == self.engine.rank:
            s.load_handed(handed, fresh_module)
        if plan.source is None:
            self.rebuild_from_storage(fresh_module)
        elif plan.sharded:
            self._reshard(plan.source, kept, fresh_module)
        else:
            self._replicate(plan.source, plan.newcomers, fresh_module if fresh_module is not None else s.built_module())
            if not received:
                s.rewrap()  # DDP over the new group (receivers wrapped in _replicate)

    def _replicate(self, source: int, newcomers: tuple[int, ...], module: torch.nn.Module) -> None:
        """Replicated model: the source streams everything to the newcomers; survivors re-wrap."""
        e, s = self.engine, self.state
        if not newcomers:
            return
        receiving = e.rank in newcomers
        if receiving:
            s.module = s.materialise(module)
        payload = None
        if e.rank == source:
            optimizer = s.optimizer.state_dict() if s.optimizer is not None else None
            payload = {"optimizer": optimizer, "small": s.small_state(control_step=self._control_step)}
        payload = e.transfer(source, newcomers, module=s.built_module(), payload=payload)
        if receiving:
            s.model = s.module
            s.rewrap()
            s.build_optimizer()
            if payload["optimizer"] is not None:
                if s.optimizer is None:
                    raise HydrationError(f"rank {source} sent optimizer state and this rank builds no optimizer")
                s.optimizer.load_state_dict(payload["optimizer"])
            s.load_small_state(payload["small"])

    def _reshard(self, source: int, kept: Kept | None, fresh_module: torch.nn.Module | None) -> None:
        """Sharded model: everyone rebuilds on the new mesh and takes its shards of the full state (its rows,
        :func:`~.full_scatter.scatter_full_state`)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        s = self.state
        if source != 0:
            raise ElasticTrainingError(f"the full state of the sharded model is on rank {source}, not on rank 0")
        full = kept.full if kept is not None else None
        small = kept.small if kept is not None and full is not None else None
        model = self._build_sharded(fresh_module)
        e = self.engine
        if not scatter_full_state(
            model, s.optimizer, full, src=0, device=e.comm_device, bucket_bytes=e.config.bucket_bytes
        ):  # a layout the rows path cannot map: DCP broadcasts each full tensor
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(model, full.model if full else {}, options=options)
            if s.optimizer is not None:
                set_optimizer_state_dict(model, s.optimizer, full.optimizer if full else {}, options=options)
        if kept is not None:
            kept.full = full = None
        self._finish_sharded(model, small)

    def _build_sharded(self, fresh_module: torch.nn.Module | None) -> torch.nn.Module:
        """The sharded model built and wrapped on the new mesh, with its optimizer; returns what the loop calls.
        Every caller overwrites its state next, so the script's ``wrap`` may skip random init (:mod:`.state_loading`)."""
        s = self.state
        with loading_over():
            s.module = fresh_module if fresh_module is not None else s.fresh_module()
            s.model = model = s.wrap(s.module)
        s.check_materialised()
        s.build_optimizer()
        return model

    def _finish_sharded(self, model: torch.nn.Module, small: dict[str, Any] | None, src: int = 0) -> None:
        """Rank ``src``'s non-persistent buffers and small state (step, scheduler, sampler) to every rank."""
        e = self.engine
        buffers = nonpersistent_buffers(model)
        broadcast_tensors(buffers, src=src, device=e.comm_device, bucket_bytes=e.config.bucket_bytes)
        box = [small]
        dist.broadcast_object_list(box, src=src)
        small = box[0]
        if small is None:  # the same on every rank: rank src's
            raise HydrationError(f"rank {src} has no small state (step, scheduler, sampler) to give the new round")
        self.state.load_small_state(small)

    def rebuild_from_storage(self, fresh_module: torch.nn.Module | None) -> None:
        """No rank holds a complete state: every rank builds its model and loads the newest checkpoint;
        without one, training starts again from step 0 (:meth:`_start_over`)."""
        s = self.state
        s.build(fresh_module if fresh_module is not None else s.fresh_module())
        s.control_step = 0
        if not self.load_checkpoint() and (max(s.step, self._job_step) > 0 or self._repairing):
            self._start_over()

    def load_checkpoint(self) -> bool:
        """Load the newest checkpoint, if there is one; whether the state now is that checkpoint's."""
        s = self.state
        if s.checkpointer is None or s.checkpointer.latest() is None:
            return False
        loaded = s.checkpointer.load(
            model=s.built_model(), optimizer=s.optimizer, scheduler=s.scheduler, data=s.sampler
        )
        if loaded is None:
            return False
        s.step, s.extra = loaded.step, dict(loaded.extra)
        s.resumed_from = "checkpoint"
        return True

    def _start_over(self) -> None:
        """The state of its step is gone (no survivor, complete snapshot or checkpoint held it): training starts
        again from step 0 (:meth:`~elastic_events.training_state.TrainState.start_over`), and says so."""
        own = self.state.start_over()
        # the job's lost steps (a replacement's own step is 0); None when every rank of the failed round was
        # replaced and none of this round knows them
        lost = None if own == 0 and self._job_step < 0 else max(own, self._job_step)
        if self.engine.rank == 0:
            what = f"the state of step {lost}" if lost is not None else "the failed round's state"
            count = f"{lost} steps lost" if lost is not None else "the steps trained so far are lost"
            print(
                f"rank 0: no survivor, hand-off, complete snapshot or checkpoint holds {what}: training starts again "
                f"from step 0 ({count}; --ckpt-every or snapshots would have kept them)",
                file=sys.stderr,
                flush=True,
            )
        eventlog.emit(Record.STATE_LOST, lost_steps=lost)

    # ------------------------------------------------------------------ HSDP
    def _live_piece_now(self) -> Piece:
        """This rank's live local state at its step (captured again if the optimizer's state changed)."""
        self.snapshots.live()
        return self.snapshots.piece(self.state.step)

    def _from_replicas(
        self, reports: list[RankReport], kept: Kept | None, fresh_module: torch.nn.Module | None
    ) -> tuple[HydrationPlan, int | None]:
        """HSDP: every rank's shard from itself or from a replica that kept it (:mod:`.replica_plan`), loaded
        into its model on the new mesh; storage when some shard is held by none. Returns the plan and the bytes moved."""
        e, s = self.engine, self.state
        try:
            layout = e.layout()
            if layout is None:
                raise ReplicaPlanError("ranks kept HSDP shards and this rank has no HSDP layout")
            plan = plan_replicas({r.rank: r.holding for r in reports}, layout)
        except ReplicaPlanError as why:
            return self._sharded_from_storage(str(why), kept, fresh_module), None
        own = kept.at(plan.step) if kept is not None else self._handed.at(plan.step) if self._handed else None
        if kept is not None:
            kept.piece = kept.previous = None  # ``own`` holds what is loaded

        def build() -> torch.nn.Module:
            self._drop_state(kept)  # the old sharded objects go before the new ones are built
            return self._build_sharded(fresh_module)

        moved = hydrate_from_replicas(
            e, plan, own, build=build, finish=self._finish_sharded, optimizer=lambda: s.optimizer
        )
        survivors = tuple(r.rank for r in reports if r.survivor)
        hydration = HydrationPlan(
            source=plan.small_source, newcomers=plan.receivers, survivors=survivors, sharded=True, step=plan.step
        )
        return hydration, moved

    # ------------------------------------------------------------------ after a failure, sharded
    def _restore_from_snapshots(
        self, reports: list[RankReport], kept: Kept | None, fresh_module: torch.nn.Module | None
    ) -> HydrationPlan:
        """A sharded model after a failure: the newest step every shard survived at, put back on the new mesh
        (each piece to its own rank when the world size is the broken round's, else assembled on rank 0)."""
        e, s = self.engine, self.state
        t0 = time.monotonic()
        restore = plan_restore({r.rank: r.snapshot for r in reports if r.snapshot is not None})
        everyone = tuple(range(e.world_size))
        if restore is None:
            held = {r.rank: (r.snapshot.live_step, r.snapshot.replicas) for r in reports if r.snapshot is not None}
            why = f"no step at which every shard of the broken round survived (live step, copies held: {held})"
            return self._sharded_from_storage(why, kept, fresh_module)
        group = e.side_group()[0]
        in_place = restore.world_size == e.world_size
        if in_place:
            self._load_own_piece(self._own_piece(restore, kept, group), kept, fresh_module)
        else:
            self._assemble_on_rank0(restore, kept, group, fresh_module)
        s.resumed_from = "snapshot"
        live = sum(1 for _, from_live in restore.sources if from_live)
        eventlog.emit(
            Record.SNAPSHOT_RESTORED,
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
        rank, mine = self.engine.rank, None
        for owner, (source, live) in enumerate(restore.sources):
            if rank == source:
                piece = self._source_piece(kept, owner, restore.step, live=live)
                if owner == rank:
                    mine = piece
                else:
                    send_piece(piece, dst=owner, group=group, bucket_bytes=self.engine.config.bucket_bytes)
            elif rank == owner:
                mine = self._recv_piece(owner, source, restore.step, group)
        if mine is None:
            raise HydrationError(f"rank {rank}: the restore plan of step {restore.step} gives it no shard of its own")
        return mine

    def _load_own_piece(self, piece: Piece, kept: Kept | None, fresh_module: torch.nn.Module | None) -> None:
        """Same world size: the fresh model on the new mesh takes this rank's piece as its local shards."""
        self._drop_state(kept)  # the piece holds what it needs of the old state
        model = self._build_sharded(fresh_module)
        load_local_state(model, self.state.optimizer, piece)
        self._finish_sharded(model, piece.small if self.engine.rank == 0 else None)  # owner 0's small state

    def _assemble_on_rank0(
        self, restore: RestorePlan, kept: Kept | None, group: Any, fresh_module: torch.nn.Module | None
    ) -> None:
        """Another world size: the full state assembled on rank 0 from every piece, re-sharded onto the new mesh."""
        pieces = self._pieces_to_rank0(restore, kept, group)
        full = small = None
        if self.engine.rank == 0:
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
        rank = self.engine.rank
        for owner, (source, live) in enumerate(restore.sources):
            if rank == source:
                piece = self._source_piece(kept, owner, restore.step, live=live)
                if rank == 0:
                    yield piece
                else:
                    send_piece(piece, dst=0, group=group, bucket_bytes=self.engine.config.bucket_bytes)
            elif rank == 0:
                yield self._recv_piece(owner, source, restore.step, group)

    def _recv_piece(self, owner: int, source: int, step: int, group: Any) -> Piece:
        piece = recv_header(src=source, group=group)
        if piece is None or (piece.owner, piece.step) != (owner, step):
            got = None if piece is None else (piece.owner, piece.step)
            raise HydrationError(f"rank {source} sent {got} instead of rank {owner}'s shard at step {step}")
        flat = torch.empty(piece.layout.nbytes, dtype=torch.uint8)
        return recv_body(piece, flat, src=source, group=group, bucket_bytes=self.engine.config.bucket_bytes)

    def _source_piece(self, kept: Kept | None, owner: int, step: int, *, live: bool) -> Piece:
        """The piece of ``owner`` at ``step`` that the restore plan has this rank send: its live state, or a copy it holds."""
        rank = self.engine.rank
        handed = self._handed.piece(owner, step) if self._handed is not None else None
        if handed is not None:
            return handed
        if kept is None:
            raise HydrationError(f"rank {rank} is to give rank {owner}'s shard at step {step} and kept no old state")
        if live:
            return self._live_piece(kept)
        if kept.replicator is None:
            raise HydrationError(f"rank {rank} is to give a copy of rank {owner}'s shard at step {step} and holds none")
        return kept.replicator.held_piece(owner, step)

    def _live_piece(self, kept: Kept) -> Piece:
        snap, c, s = kept.snapshot, kept.captured, self.state
        if snap is None or c is None:
            raise HydrationError(f"rank {self.engine.rank} kept no live shards of the broken round to give")
        return Piece(
            owner=snap.rank,
            round=snap.round,
            world_size=snap.world_size,
            step=kept.step,
            layout=c.layout,
            small=s.small_state(control_step=self._control_step),
            param_groups=c.param_groups(s.optimizer),
            tensors=c.tensors,
        )

    def _sharded_from_storage(self, why: str, kept: Kept | None, fresh_module: torch.nn.Module | None) -> HydrationPlan:
        """No shard set of one step survived the failure (``why``): every rank loads the newest checkpoint."""
        e = self.engine
        if e.rank == 0:
            print(f"rank 0: {why}: loading the newest checkpoint", file=sys.stderr, flush=True)
        eventlog.emit(Record.SNAPSHOT_UNAVAILABLE, reason=why)
        self._drop_state(kept)
        self.rebuild_from_storage(fresh_module)
        return HydrationPlan(source=None, newcomers=tuple(range(e.world_size)), survivors=(), sharded=True, step=-1)

    def _drop_state(self, kept: Kept | None) -> None:
        """A survivor's old sharded objects and the copies it held: not needed once the state is on rank 0."""
        if kept is not None:
            kept.captured = kept.replicator = kept.piece = None
        self.snapshots.captured = None
        self.state.drop_objects()
