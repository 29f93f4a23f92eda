"""Checkpointless scale events: ranks keep running through a world-size change.

:class:`ElasticTraining` owns what a rank trains with -- the model (and the wrapper
that parallelises it), optimizer, LR scheduler, sampler, step and small extras --
and the process group. A script needs a handful of lines::

    elastic = ElasticTraining(
        model_fn=lambda: Net(),                       # the bare model (``meta`` is fine)
        optimizer_fn=lambda model: AdamW(model.parameters()),
        sampler=sampler, checkpointer=ckpt,           # both optional
    ).start()                                         # group up; parked joiner: admitted and hydrated
    while elastic.step < steps:
        for batch in sampler.steps(loader):
            train_step(elastic.model, elastic.optimizer, batch)
            sampler.mark_step(); elastic.step += 1
            if elastic_event_detected():
                if not elastic.reconfigure():         # left the job, or saved for a restart
                    return 0
                break                                 # new world: new loader iterator

At a ``RECONFIGURE`` event the rank tears its process group down and joins the new
round's (see :mod:`elastic_events.group`), newcomers receive the state from a
survivor (:mod:`elastic_events.hydration`), the model is wrapped again (DDP) or
re-sharded onto the new mesh (FSDP2), the sampler is split over the new world and
every rank re-derives its RNG stream from ``(base seed, step, rank)``. A leaving
rank returns False and should exit 0. At a ``SAVE_AND_EXIT`` event (a job where some
rank does not use this API, or ``--restart-mode process``) it saves through the
checkpointer and returns False. Under ``torchrun`` or as a plain script no event
ever arrives and every call is what it would be without elasticity.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import elastic_events
from elastic_events import abort, eventlog, names
from elastic_events.control import CAP_RECONFIGURE, AdmissionTimeoutError, ControlReader, Event, EventKind, RankPhase
from elastic_events.errors import ElasticTrainingError, RecoveryError
from elastic_events.group import backend_for, default_device, init_env_group, is_peer_failure, teardown_group
from elastic_events.hold import CAP_HOLD, hold
from elastic_events.hydration import gather_full_state, structure_digest, value_checksum
from elastic_events.inprocess_config import ElasticConfig, default_wrap
from elastic_events.inprocess_rounds import Kept, RoundJoining, is_sharded, on_meta, prewarm
from elastic_events.names import PARKED_ENV, ROUND_ENV
from elastic_events.snapshot import Captured, Piece, Replicator, SnapshotError, capture, optimizer_state_count
from elastic_events.snapshot_restore import SnapshotReport

ModelFn = Callable[[], torch.nn.Module]
WrapFn = Callable[[torch.nn.Module], torch.nn.Module]
OptimizerFn = Callable[[torch.nn.Module], torch.optim.Optimizer]
SchedulerFn = Callable[[torch.optim.Optimizer], Any]


class ElasticTraining(RoundJoining):
    """A rank's training state and process group, kept alive through scale events.

    Args:
        model_fn: builds the bare model (same architecture on every rank; may build on ``meta``).
        wrap: prepares the bare model for the current world and returns what the loop calls
            (default: DDP when a group is up, else the model itself). It runs at start and again
            in every new round; for FSDP2 it calls ``fully_shard`` and materialises a ``meta``
            model (``to_empty`` + init) itself.
        optimizer_fn: builds the optimizer of the wrapped model.
        scheduler_fn: builds the LR scheduler of an optimizer (optional).
        sampler: the data position (``state_dict``/``load_state_dict``; ``set_world`` if it
            splits batches over ranks, like :class:`~elastic_events.sampler.ElasticSampler`).
        checkpointer: a :class:`~elastic_events.checkpoint.Checkpointer`: loaded from at
            start, written at a ``SAVE_AND_EXIT`` event; storage is the fallback only.
    """

    def __init__(
        self,
        *,
        model_fn: ModelFn,
        wrap: WrapFn | None = None,
        optimizer_fn: OptimizerFn | None = None,
        scheduler_fn: SchedulerFn | None = None,
        sampler: Any = None,
        checkpointer: Any = None,
        config: ElasticConfig | None = None,
    ) -> None:
        if not callable(model_fn):
            raise ElasticTrainingError(f"model_fn must be callable, got {type(model_fn).__name__}")
        self.config = config or ElasticConfig()
        self._model_fn, self._wrap = model_fn, wrap or default_wrap
        self._optimizer_fn, self._scheduler_fn = optimizer_fn, scheduler_fn
        self.sampler, self.checkpointer = sampler, checkpointer
        self.module: torch.nn.Module | None = None  # the bare model (for FSDP2: the sharded model itself)
        self.model: torch.nn.Module | None = None  # what the loop calls: wrapped when a group is up
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.step = 0
        self.extra: dict[str, Any] = {}
        self.resumed_from = "fresh"  # how start() got the state: fresh, checkpoint or peers
        self._saved_step: int | None = None  # the step this process last saved
        self.round = int(os.environ.get(ROUND_ENV, "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.device = torch.device(self.config.device) if self.config.device else default_device(self.local_rank)
        self.backend = self.config.backend or backend_for(self.device)
        self._base_seed = torch.initial_seed()
        self._store: Any = None
        self._control_step = 0  # a newcomer's step count on the control channel, from its source
        self._reader: ControlReader | None = None
        self._repair_watch: abort.RepairWatch | None = None
        self._optimizer_steps = [0, 0]  # optimizer steps begun, ended (hooks of the optimizer)
        self._snapshot_every = self.config.snapshot_interval
        self._replicator: Replicator | None = (
            None  # a sharded model's snapshots of this round (elastic_events.snapshot)
        )
        self._captured: Captured | None = None  # its local state's live tensors
        self._side: tuple[Any, Any, set[int]] | None = None  # this round's gloo groups for snapshots, their sockets
        self._started = False

    # ------------------------------------------------------------------ the world
    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.distributed else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if self.distributed else 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # --------------------------------------------------------------------- start
    def start(self) -> ElasticTraining:
        """Join the group and build the state: from the environment (torchrun, hyperpodrun,
        plain python), or, for a parked joiner (``HYPERPODRUN_PARKED=1``), at admission
        into a round, with the state received from its peers."""
        if self._started:
            raise ElasticTrainingError("start() was already called")
        self._started = True
        atexit.register(self.close)  # stores and groups must not outlive the interpreter's shutdown
        if self.config.freeze_gc:
            gc.collect()  # what is garbage now is not frozen with the rest
            gc.freeze()  # before any model is built: a replaced model must stay collectable (ElasticConfig.freeze_gc)
        self._reader = elastic_events._channel()
        if self._reader is not None:
            self._reader.declare(CAP_RECONFIGURE | CAP_HOLD)
        if os.environ.get(PARKED_ENV) == "1":
            return self._start_parked()
        if "RANK" in os.environ and "WORLD_SIZE" not in os.environ:
            raise ElasticTrainingError("RANK is set but WORLD_SIZE is not: launch with torchrun or hyperpodrun")
        with abort.forming(self.round):
            init_env_group(device=self.device, backend=self.backend, timeout_s=self.config.timeout_s)
        self._watch_repairs()
        self._build(self._model_fn())
        if self.checkpointer is not None and self.checkpointer.latest() is not None:
            self._load_checkpoint()
        self._set_world()
        self._start_snapshots()
        self._phase(RankPhase.RUNNING)
        return self

    def _start_parked(self) -> ElasticTraining:
        if self._reader is None:
            raise ElasticTrainingError(
                f"{PARKED_ENV}=1 needs the control channel (HYPERPODRUN_CONTROL_FILE): only hyperpodrun parks ranks"
            )
        module = self._model_fn()  # built while parked: admission pays group init and hydration only
        prewarm()
        event = self._reader.wait_for_admission(timeout_s=self.config.admission_timeout_s, poll_s=self.config.poll_s)
        try:
            self._join(event, kept=None, fresh_module=module)
        except BaseException:
            self._phase(RankPhase.FAILED)
            raise
        return self

    # ------------------------------------------------------------------- events
    def reconfigure(self) -> bool:
        """Act on the event ``elastic_event_detected()`` just returned True for.

        Returns True when this rank goes on training in the new round (rebuild the
        loader iterator: the sampler was split over the new world), False when it must
        exit 0 (its node leaves, or the event is a restart and the state was saved).
        """
        event = self._reader.fired if self._reader is not None else None
        if event is None:
            raise ElasticTrainingError(
                "reconfigure() without a pending event: call it when elastic_event_detected() returns True"
            )
        self._reader.fired = None
        if event.kind is EventKind.SAVE_AND_EXIT:
            return self._save_and_exit(event)
        if event.kind is not EventKind.RECONFIGURE:
            raise ElasticTrainingError(f"event {event.event_id} has unknown kind {event.kind!r}")
        self._phase(RankPhase.RECONFIGURING)
        try:
            moved = self._reconfigure(event)
        except BaseException:
            self._phase(RankPhase.FAILED)
            raise
        return hold(self) if moved and event.hold else moved  # below the minimum: save, hold the state (.hold)

    def recover(self, exc: BaseException) -> bool:
        """Carry this rank through the failure of a peer, in process: call it where a step raised.

        ``exc`` is what the step raised. Unless it is a collective that failed because another
        rank died or hung (:func:`~elastic_events.group.is_peer_failure`), or there is no launcher
        to repair the group, it is raised again unchanged. Otherwise the rank drops the broken
        group and waits for the launcher's repair (a ``RECONFIGURE`` into a new round: the failed
        rank replaced, or its node left out); the survivors at the furthest committed step are the
        state, every other rank is brought to it from them. A sharded (FSDP2) model is put back
        together from the survivors' shards and the in-memory snapshots their peers hold of the
        failed ranks' shards, at the newest step all of them have (:mod:`elastic_events.snapshot`:
        at most ``snapshot_every`` steps back). Call it with every collective of a
        step before the optimizer step and ``step += 1`` right after it, so a step that failed
        changed nothing. Returns True to train on (rebuild the loader iterator, as after
        :meth:`reconfigure`), False when this node is not part of the repaired job (exit 0).
        Raises :class:`RecoveryError` (from ``exc``) when no repair came within
        ``config.recover_timeout_s`` or it failed.
        """
        if self._reader is None or not self.distributed or not is_peer_failure(exc):
            raise exc
        sharded = is_sharded(self.module)
        if sharded and self._replicator is None:
            raise RecoveryError(
                f"rank {self.rank}: a collective failed at step {self.step + 1} and this sharded (FSDP2) model keeps "
                "no in-memory snapshots (snapshot_every=0 or --snapshot-every 0): the failed rank's shards exist nowhere else"
            ) from exc
        rank, t0 = self.rank, time.monotonic()
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        print(
            f"rank {rank}: a collective failed during step {self.step + 1} ({reason}); waiting for the repaired group",
            file=sys.stderr,
            flush=True,
        )
        eventlog.emit(names.PEER_FAILED, rank=rank, step=self.step, error=reason)
        self._reader.fired = None
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)  # the failed step's partial gradients
        if sharded:  # its live shards, and the copies of its neighbour's it holds, go into the repaired round
            replicator = self._stop_snapshots(broken=True)
            kept = Kept(
                step=self.step,
                sharded=True,
                structure=structure_digest(self.module),
                checksum=None,
                failed=True,
                captured=self._captured,
                replicator=replicator,
                snapshot=SnapshotReport(
                    round=self.round,
                    world_size=self.world_size,
                    rank=rank,
                    live_step=self.step,
                    replicas=replicator.holdings(),
                ),
            )
        else:
            kept = Kept(
                step=self.step,
                sharded=False,
                structure=structure_digest(self.module),
                checksum=value_checksum(self.module),
                failed=True,
            )
        # A gloo group closes its sockets only once nothing references it, and a peer blocked on this rank
        # learns of the failure only then: the failed step's frames (holding the DDP wrapper) must go too.
        traceback.clear_frames(exc.__traceback__)
        self._drop_wrapper()  # the DDP wrapper belongs to the broken group
        if self.checkpointer is not None:
            self.checkpointer.release_group(abandon=True)
        if self.backend == "gloo":  # its sockets outlive the group while anything holds it: end peers' waits now
            abort.shutdown_round(self.round)
        teardown_group(broken=True)
        self._store, self._side = None, None
        torn_down = time.monotonic() - t0
        try:
            event = self._reader.wait_for_reconfigure(
                RankPhase.RECOVERING,
                timeout_s=self.config.recover_timeout_s,
                poll_s=self.config.poll_s,
                what=f"rank {rank} (its collective failed at step {self.step + 1}) was not carried into a repaired group",
            )
        except AdmissionTimeoutError as timeout:
            self._phase(RankPhase.FAILED)
            raise RecoveryError(str(timeout)) from exc
        if event.leaves:
            self._phase(RankPhase.LEAVING)
            return False
        try:
            self._join(event, kept=kept, fresh_module=None, torn_down_s=torn_down)
        except BaseException as failed:
            self._phase(RankPhase.FAILED)
            raise RecoveryError(
                f"rank {rank}: the repaired group of round {event.round} could not be joined: {failed}"
            ) from failed
        return hold(self) if event.hold else True  # too few survivors: save, hold the state (.hold)

    def _save_and_exit(self, event: Event) -> bool:
        if self.checkpointer is None:
            print(
                f"rank {self.rank}: restart event {event.event_id} at step {self.step} and no checkpointer: "
                "the restarted job starts without this state",
                file=sys.stderr,
                flush=True,
            )
        else:
            if self._saved_step != self.step:  # the loop may have saved this very step already
                self.save_checkpoint()
            self.checkpointer.wait()
        return False

    def _reconfigure(self, event: Event) -> bool:
        t0 = time.monotonic()
        kept = self._release(event)
        if event.leaves:
            self._phase(RankPhase.LEAVING)
            return False
        self._join(event, kept=kept, fresh_module=None, torn_down_s=time.monotonic() - t0)
        return True

    def _release(self, event: Event) -> Kept:
        """Leave the old round: note what this rank keeps, drop what referred to the old group, tear it down."""
        sharded = self.distributed and is_sharded(self.model)
        self._stop_snapshots(broken=False)  # every rank is alive: its last snapshot is delivered first
        kept = Kept(
            step=self.step,
            sharded=sharded,
            structure=structure_digest(self.module),
            checksum=None if sharded else value_checksum(self.module),
        )
        if sharded:
            # The shards of a leaving rank exist nowhere else: gather the full state onto the rank
            # that becomes rank 0 of the new round, before the old group goes.
            new_rank = -1 if event.leaves else event.group_rank * self.local_world_size + self.local_rank
            ranks: list[int] = [0] * self.world_size
            dist.all_gather_object(ranks, new_rank)
            if 0 not in ranks:
                raise ElasticTrainingError(f"no rank of round {self.round} becomes rank 0 of round {event.round}")
            kept.full = gather_full_state(self.model, self.optimizer, holder=ranks.index(0))
            if kept.full is not None:
                kept.small = self._small_state()
            self.module = self.model = self.optimizer = self.scheduler = None  # rebuilt on the new mesh
            gc.collect()  # FSDP2's hooks hold the old sharded model in cycles: free it before the new one is built
        else:
            self._drop_wrapper()  # the DDP wrapper belongs to the old group
        if self.checkpointer is not None:
            self.checkpointer.release_group()
        teardown_group()
        self._store, self._side = None, None
        return kept

    def close(self) -> None:
        """Leave the process group at the end of training (also run at interpreter exit).

        The DDP wrapper holds the group: left alive, the group outlives ``destroy_process_group``
        and is freed during interpreter finalization, where torch 2.13's gloo aborts the process
        about one exit in six ("terminate called without an active exception", SIGABRT) after
        training succeeded. Dropping the wrapper first lets the group go here.
        """
        if self._repair_watch is not None:
            self._repair_watch.stop()
            self._repair_watch = None
        self._stop_snapshots(broken=False)
        if self.distributed:
            if self.module is not None:
                self.model = self.module
            gc.collect()
            teardown_group()
        self._store, self._side = None, None

    # ---------------------------------------------------------------- building
    def _build(self, module: torch.nn.Module) -> None:
        self.module = module
        self.model = self._wrap(module)
        self._check_materialised()
        self._build_optimizer()

    def _drop_wrapper(self) -> None:
        """Let the old round's DDP wrapper go: its reducer hooks our parameters' gradients and holds the old group.

        Usually nothing else references it and it goes at once; only then is a full garbage
        collection (0.1-0.2 s of every event) skipped. Frames of the failed step's traceback or an
        asynchronous checkpoint may still hold it for a moment; they let it go when they end.
        """
        wrapper = self.model if self.model is not self.module else None
        self.model = self.module
        if wrapper is None:
            return
        alive = weakref.ref(wrapper)
        del wrapper
        if alive() is not None:
            gc.collect()  # a reference cycle, or a holder that goes later

    def _rewrap(self) -> torch.nn.Module:
        """Wrap the hydrated replica for the new group (no second broadcast with the default DDP)."""
        if self._wrap is default_wrap:
            return default_wrap(self.module, init_sync=False)
        return self._wrap(self.module)

    def _build_optimizer(self) -> None:
        self.optimizer = self._optimizer_fn(self.model) if self._optimizer_fn is not None else None
        if self.optimizer is not None:  # counted, so that a hand-off is never taken mid-step
            self.optimizer.register_step_pre_hook(lambda *_: self._wait_snapshot())
            self.optimizer.register_step_post_hook(lambda *_: self._recapture())
            steps = self._optimizer_steps
            self.optimizer.register_step_pre_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
            self.optimizer.register_step_post_hook(lambda *_: steps.__setitem__(1, steps[1] + 1))
        if self._scheduler_fn is not None and self.optimizer is not None:
            self.scheduler = self._scheduler_fn(self.optimizer)

    def _check_materialised(self) -> None:
        if on_meta(self.model):
            raise ElasticTrainingError(
                "the model is still on the meta device after wrap(): materialise it there (to_empty + init)"
            )

    def _optimizer_busy(self) -> bool:
        return self._optimizer_steps[0] != self._optimizer_steps[1]

    def _watch_repairs(self) -> None:
        """Under a launcher, with gloo: end this rank's collectives of a round the launcher repairs (:mod:`.abort`)."""
        if self._repair_watch is None and self._reader is not None and self.backend == "gloo" and self.distributed:
            self._repair_watch = abort.RepairWatch(self._reader, on_blocked=self._hand_off).start()

    # --------------------------------------------------------------- snapshots
    def _start_snapshots(self) -> None:
        """A sharded model under a launcher: snapshots of every rank's shards, each kept by a peer (:mod:`.snapshot`).

        Collective (two gloo groups of the round's ranks): every rank decides the same way. The
        round's first state is snapshotted at once, so a failure in its first step is covered too."""
        if (
            self._snapshot_every == 0
            or self._reader is None
            or not self.distributed
            or self.world_size < 2
            or self.module is None
            or not is_sharded(self.module)
        ):
            return
        try:
            self._captured = capture(self.model, self.optimizer)
        except SnapshotError as exc:
            print(f"rank {self.rank}: no in-memory snapshots: {exc}", file=sys.stderr, flush=True)
            return
        group, acks, sockets = self._side_group()
        self._replicator = Replicator(
            group=group,
            acks=acks,
            sockets=sockets,
            round=self.round,
            rank=self.rank,
            world_size=self.world_size,
            local_world_size=self.local_world_size,
            bucket_bytes=self.config.bucket_bytes,
            timeout_s=self.config.timeout_s,
        )
        elastic_events._set_step_hook(self._snapshot)
        self._snapshot(every=1)

    def _side_group(self) -> tuple[Any, Any, set[int]]:
        """This round's two gloo groups for snapshots (made once per round: bytes, and acknowledgements);
        their sockets are the round's too (:mod:`.abort`)."""
        if self._side is None:
            sockets: set[int] = set()
            timeout = timedelta(
                seconds=max(self.config.timeout_s, 86_400)
            )  # idle between snapshots: only failures end waits
            with abort.tracking(sockets):
                group = dist.new_group(backend="gloo", timeout=timeout)
                acks = dist.new_group(backend="gloo", timeout=timeout)
            self._side = (group, acks, sockets)
        return self._side

    def _snapshot(self, every: int | None = None) -> None:
        """``elastic_event_detected()``, after step :attr:`step`: snapshot this step in the background."""
        replicator = self._replicator
        if replicator is None or replicator.failed is not None or self.step % (every or self._snapshot_every):
            return
        c = self._captured
        replicator.snapshot(
            Piece(
                owner=self.rank,
                round=self.round,
                world_size=self.world_size,
                step=self.step,
                layout=c.layout,
                small=self._small_state(),
                param_groups=c.param_groups(self.optimizer),
                tensors=c.tensors,
            )
        )

    def _recapture(self) -> None:
        """The optimizer's post-step hook: its state appears at its first step (every shard is sharded here)."""
        if self._replicator is not None and self._captured.count != optimizer_state_count(self.optimizer):
            self._captured = capture(self.model, self.optimizer)

    def _wait_snapshot(self) -> None:
        """The optimizer's pre-step hook: no step is committed before every copy of the last snapshot exists
        (and the live tensors being sent must not change yet). A peer's failure raises ``PeerFailureError``."""
        if self._replicator is not None:
            self._replicator.wait(broken=self._repair_pending)

    def _repair_pending(self) -> str | None:
        """Why this rank's round is broken, if its launcher published a repair of it."""
        event = self._reader.event() if self._reader is not None else None
        if event is not None and event.kind is EventKind.RECONFIGURE and event.repair and event.round > self.round:
            return f"the launcher repairs round {self.round} (event {event.event_id}): a peer failed"
        return None

    def _stop_snapshots(self, *, broken: bool) -> Replicator | None:
        """End this round's replication (``broken``: at once, keeping what is held) and return it."""
        replicator, self._replicator = self._replicator, None
        elastic_events._set_step_hook(None)
        if replicator is None:
            return None
        if broken:
            replicator.abort()
        elif not replicator.close(timeout_s=self.config.timeout_s):
            print(
                f"rank {self.rank}: snapshot threads of round {replicator.round} did not end within "
                f"{self.config.timeout_s:.0f}s; their group was shut down",
                file=sys.stderr,
                flush=True,
            )
        return replicator

    def snapshot_stats(self) -> dict[str, int]:
        """Bytes of this rank's local state, bytes of snapshots it holds (its neighbour's two and its own),
        snapshots completed this round."""
        c, r = self._captured, self._replicator
        return {
            "state_bytes": c.layout.state_bytes if c is not None else 0,
            "held_bytes": r.held_bytes() if r is not None else 0,
            "snapshots": r.completed if r is not None else 0,
        }

    def _set_world(self) -> None:
        if self.sampler is not None and hasattr(self.sampler, "set_world"):
            self.sampler.set_world(rank=self.rank, world_size=self.world_size)

    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def _phase(self, phase: RankPhase) -> None:
        if self._reader is not None:
            self._reader.set_phase(phase, round=self.round)

    # -------------------------------------------------------------- checkpoints
    def save_checkpoint(self) -> None:
        """Save the state at :attr:`step` through the checkpointer (collective)."""
        self._saved_step = self.step
        self.checkpointer.save(
            self.step,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            data=self.sampler,
            extra=self.extra,
        )

    def _load_checkpoint(self) -> None:
        loaded = self.checkpointer.load(
            model=self.model, optimizer=self.optimizer, scheduler=self.scheduler, data=self.sampler
        )
        if loaded is not None:
            self.step, self.extra = loaded.step, dict(loaded.extra)
            self.resumed_from = "checkpoint"
