"""Checkpointless scale events and repairs: ranks keep running through a world-size change.

:class:`ElasticTraining` owns what a rank trains with -- the model (and the wrapper that
parallelises it), optimizer, LR scheduler, sampler, step and small extras -- and its place in the
job's rounds. A torchrun loop made elastic and failure-tolerant in place::

    elastic = ElasticTraining(
        model_fn=lambda: Net(),                                # the bare model (``meta`` is fine)
        optimizer_fn=lambda model: AdamW(model.parameters()),
        sampler=sampler, checkpointer=ckpt,                    # both optional
    ).start()                                                  # group up; a parked joiner: admitted, hydrated
    for step in elastic.steps(loader, until=1000):             # one global batch per step
        with step:                                             # a peer's failure here: repaired, step redone
            loss = elastic.model(step.batch).sum()
            loss.backward()
            elastic.optimizer.step(); elastic.optimizer.zero_grad()

:meth:`ElasticTraining.steps` counts the steps, marks the sampler, acts on every scale event at its
agreed step (a ``RECONFIGURE``: the rank joins the new round in place; its node leaving, or a
restart: the iteration ends and the script exits 0), and takes a new loader iterator whenever the
world changed. At a ``RECONFIGURE`` the rank tears its process group down and joins the new round's
(:mod:`elastic_events.rounds.engine`), newcomers receive the state from a survivor
(:mod:`elastic_events.rounds.joining`), the model is wrapped again (DDP) or re-sharded onto the new
mesh (FSDP2), the sampler is split over the new world and every rank re-derives its RNG stream from
``(base seed, step, rank)``. A step whose collectives fail because a peer died is abandoned before
its optimizer step (:mod:`elastic_events.rounds.commit`) and the rank is carried into the repaired
round. Under ``torchrun`` or as a plain script no event ever arrives and every call is what it would
be without elasticity.

The same moves are there one by one for loops that need them: ``elastic_event_detected()`` then
:meth:`reconfigure`, :meth:`recover` in an ``except``, and ``elastic.step += 1`` after each step.
"""

from __future__ import annotations

import atexit
import gc
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

import elastic_events
from elastic_events import eventlog
from elastic_events.contract import Record
from elastic_events.control import CAP_HOLD, CAP_RECONFIGURE, Event, EventKind, RankPhase
from elastic_events.errors import ElasticTrainingError, RecoveryError
from elastic_events.rounds.blocked_handoff import BlockedHandOff
from elastic_events.rounds.config import ElasticConfig
from elastic_events.rounds.engine import RoundEngine
from elastic_events.rounds.hold import hold
from elastic_events.rounds.joining import Joiner, prewarm
from elastic_events.rounds.mesh import hsdp_wrap
from elastic_events.rounds.snapshots import Snapshots
from elastic_events.training_state import (
    Builders,
    DataSampler,
    ModelFn,
    OptimizerFn,
    SchedulerFn,
    StateCheckpointer,
    StepSampler,
    TrainState,
    WrapFn,
)

__all__ = ["ElasticTraining", "Step"]


@dataclass(eq=False)
class Step:
    """One step of :meth:`ElasticTraining.steps`: its batch, and ``with step:`` around its work.

    The step counts as trained once its optimizer step is taken (``elastic.step`` is then
    ``number``, the sampler marked), or at the end of the block without an optimizer. Inside the
    block, a collective that fails because a peer died (or a step the commit check abandoned) is
    taken up by :meth:`ElasticTraining.recover`: the block's exception is swallowed and the
    iteration goes on in the repaired round, from the step the survivors committed. Any other
    exception leaves the block as usual.

    After the block, ``counted`` says whether the step was trained: a peer that dies after the
    optimizer step (in a collective for the log, say) sets ``failed`` and leaves the step counted,
    and the repaired round goes on after it (a sharded model restored from an older snapshot trains
    it again). An uncounted step is abandoned and trained again in the repaired round.
    """

    number: int  # the step being trained (1 for the first)
    batch: Any
    first: bool  # the first step since start, a scale event or a repair (a new loader iterator)
    elastic: ElasticTraining = field(repr=False)
    failed: BaseException | None = field(default=None, repr=False)
    counted: bool = False  # the step was counted (sampler marked, elastic.step == number)

    def __enter__(self) -> Step:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            self.elastic._count(self)  # the code after the block (logging, a save) sees the step counted
            return False
        if not isinstance(exc, RuntimeError) or not self.elastic.peer_failure(exc):
            return False
        self.failed = exc
        return True


class ElasticTraining:
    """A rank's training state and its place in the job's rounds, kept alive through scale events.

    Args:
        model_fn: builds the bare model (same architecture on every rank; may build on ``meta``).
        wrap: prepares the bare model for the current world and returns what the loop calls
            (default: DDP when a group is up, else the model itself). It runs at start and again
            in every new round; for FSDP2 it calls ``fully_shard`` and materialises a ``meta``
            model (``to_empty`` + init) itself. With ``config.hsdp`` it is called as
            ``wrap(module, mesh=mesh)``, the round's ``("replicate", "shard")`` mesh (:attr:`mesh`;
            default: ``fully_shard(module, mesh=mesh)``).
        optimizer_fn: builds the optimizer of the wrapped model.
        scheduler_fn: builds the LR scheduler of an optimizer (optional).
        sampler: the data position (``state_dict``/``load_state_dict``; ``set_world`` if it
            splits batches over ranks, like :class:`~elastic_events.data.sampler.ElasticSampler`).
        checkpointer: a :class:`~elastic_events.checkpoint.Checkpointer`: loaded from at
            start, written at a ``SAVE_AND_EXIT`` event; storage is the fallback only.
        config: how the rank waits and moves state (:class:`~elastic_events.rounds.config.ElasticConfig`).
    """

    def __init__(
        self,
        *,
        model_fn: ModelFn,
        wrap: WrapFn | None = None,
        optimizer_fn: OptimizerFn | None = None,
        scheduler_fn: SchedulerFn | None = None,
        sampler: DataSampler | None = None,
        checkpointer: StateCheckpointer | None = None,
        config: ElasticConfig | None = None,
    ) -> None:
        if config is not None and not isinstance(config, ElasticConfig):
            raise ElasticTrainingError(f"config must be an ElasticConfig, got {type(config).__name__}")
        self.config = config or ElasticConfig()
        hsdp = self.config.hsdp is not None
        if wrap is None and hsdp:
            wrap = hsdp_wrap
        builders = Builders(model_fn=model_fn, optimizer_fn=optimizer_fn, scheduler_fn=scheduler_fn)
        if wrap is not None:
            builders = Builders(model_fn=model_fn, wrap=wrap, optimizer_fn=optimizer_fn, scheduler_fn=scheduler_fn)
        self.engine = RoundEngine(self.config)
        self.state = TrainState(
            builders,
            sampler=sampler,
            checkpointer=checkpointer,
            device=self.engine.device,
            mesh=self.engine.mesh if hsdp else None,
        )
        self.snapshots = Snapshots(self.engine, self.state)
        self.joiner = Joiner(self.engine, self.state, self.snapshots)
        self._hand_off = BlockedHandOff(self.engine, self.state, self.snapshots)
        hooks = [lambda *_: self.snapshots.wait()]
        commit = self.engine.commit
        if commit is not None:
            hooks.insert(0, lambda *_: commit.check(self.state.step + 1))
        self.state.step_hooks = tuple(hooks)
        self.state.post_step_hooks = (lambda *_: self.snapshots.recapture(), lambda *_: self._count_current())
        self._current: Step | None = None  # the step steps() is in, until it is counted
        self._stepping: StepSampler | None = None  # the sampler steps() iterates (the state's)
        self._saved_step: int | None = None  # the step this process last saved
        self._started = self._finished = False

    # ------------------------------------------------------------------ the state, for the loop
    @property
    def model(self) -> torch.nn.Module | None:
        """What the loop calls (wrapped for the current group); a new object after a scale event."""
        return self.state.model

    @property
    def module(self) -> torch.nn.Module | None:
        """The bare model (for FSDP2 the sharded model itself)."""
        return self.state.module

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.state.optimizer

    @property
    def scheduler(self) -> Any:
        return self.state.scheduler

    @property
    def mesh(self) -> Any:
        """HSDP (``ElasticConfig(hsdp=...)``): the current round's ``("replicate", "shard")`` DeviceMesh, the
        one ``wrap`` is given as ``mesh=``; a new object after a scale event. None without HSDP or a group."""
        return self.state.mesh

    @property
    def sampler(self) -> Any:
        return self.state.sampler

    @property
    def checkpointer(self) -> Any:
        return self.state.checkpointer

    @property
    def step(self) -> int:
        """Optimizer steps trained (committed) so far; the loop adds one after each step."""
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    @property
    def extra(self) -> dict[str, Any]:
        """Small picklable extras saved and hydrated with the state (e.g. tokens seen)."""
        return self.state.extra

    @extra.setter
    def extra(self, value: dict[str, Any]) -> None:
        self.state.extra = value

    @property
    def resumed_from(self) -> str:
        """How :meth:`start` got the state: fresh, checkpoint, peers, snapshot or handoff."""
        return self.state.resumed_from

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def backend(self) -> str:
        return self.engine.backend

    @property
    def round(self) -> int:
        return self.engine.round

    @property
    def distributed(self) -> bool:
        return self.engine.distributed

    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    @property
    def local_rank(self) -> int:
        return self.engine.local_rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ start
    def start(self) -> ElasticTraining:
        """Join the group and build the state: from the environment (torchrun, hyperpodrun, plain
        python), or, for a parked joiner, at admission into a round, with the state from its peers."""
        if self._started:
            raise ElasticTrainingError("start() was already called")
        self._started = True
        atexit.register(self.close)  # stores and groups must not outlive the interpreter's shutdown
        if self.config.freeze_gc:
            gc.collect()  # what is garbage now is not frozen with the rest
            gc.freeze()  # before any model is built: a replaced model must stay collectable (ElasticConfig.freeze_gc)
        e = self.engine
        if e.reader is not None:
            e.reader.declare(CAP_RECONFIGURE | CAP_HOLD)
        elastic_events._set_step_hook(self._on_step)
        if e.context.parked:
            return self._start_parked()
        e.start_group()
        e.watch_blocked(self._hand_off)
        self.state.build(self.state.fresh_module())
        self.joiner.load_checkpoint()
        self.state.set_world(rank=e.rank, world_size=e.world_size)
        self.snapshots.start()
        e.set_phase(RankPhase.RUNNING)
        return self

    def _start_parked(self) -> ElasticTraining:
        module = self.state.fresh_module()  # built while parked: admission pays group init and hydration only
        prewarm()
        event = self.engine.wait_for_admission()
        try:
            self.joiner.join(event, kept=None, fresh_module=module)
        except BaseException:
            self.engine.set_phase(RankPhase.FAILED)
            raise
        self.engine.watch_blocked(self._hand_off)
        return self

    def _on_step(self) -> None:
        """``elastic_event_detected()``, after step :attr:`step`: the step time, and a snapshot of the step."""
        self.engine.note_step()
        self.snapshots.take()

    # ------------------------------------------------------------------ the loop
    def steps(self, loader: Iterable[Any], *, until: int | None = None) -> Iterator[Step]:
        """The job's steps, one global batch each: up to step ``until`` (then training is finished:
        :meth:`finish`), or to the end of the sampler's current epoch when ``until`` is None.

        Each step's work goes in ``with step:``; after it the step is counted, the sampler marked and a
        scale event acted on. The iteration also ends when this rank leaves the job (exit 0 then).
        """
        sampler = self.state.sampler
        if not isinstance(sampler, StepSampler):
            raise ElasticTrainingError("steps() needs an ElasticSampler: pass sampler= to ElasticTraining")
        self._stepping = sampler
        epoch = sampler.epoch
        while True:
            if until is not None and self.step >= until:
                self.finish()
                return
            if until is None and sampler.epoch != epoch:
                return
            first = True
            for global_step in sampler.steps(loader):  # a new iterator: after an event the world changed
                step = Step(number=self.step + 1, batch=global_step, first=first, elastic=self)
                first, self._current = False, step
                try:
                    yield step
                finally:
                    self._current = None
                if step.failed is not None:
                    if not self.recover(step.failed, step=step.number):
                        return
                    break
                self._count(step)
                if elastic_events.elastic_event_detected():
                    if not self.reconfigure():
                        return
                    break
                if until is not None and self.step >= until:
                    break

    def _count(self, step: Step) -> None:
        if not step.counted:
            sampler = self._stepping
            if sampler is None:
                raise ElasticTrainingError("a step is counted only in steps(), which marks its sampler")
            step.counted = True
            sampler.mark_step()
            self.state.step += 1

    def _count_current(self) -> None:
        """The optimizer's post-step hook: the step of :meth:`steps` is trained."""
        if self._current is not None:
            self._count(self._current)

    # ------------------------------------------------------------------ events
    def reconfigure(self) -> bool:
        """Act on the event ``elastic_event_detected()`` just returned True for.

        Returns True when this rank goes on training in the new round (rebuild the loader iterator:
        the sampler was split over the new world), False when it must exit 0 (its node leaves, or the
        event is a restart and the state was saved).
        """
        event = self.engine.take_event()
        if event is None:
            raise ElasticTrainingError(
                "reconfigure() without a pending event: call it when elastic_event_detected() returns True"
            )
        if event.kind is EventKind.SAVE_AND_EXIT:
            return self._save_and_exit(event)
        if event.kind is not EventKind.RECONFIGURE:
            raise ElasticTrainingError(f"event {event.event_id} has unknown kind {event.kind!r}")
        self.engine.set_phase(RankPhase.RECONFIGURING)
        try:
            moved = self._move(event)
        except BaseException:
            self.engine.set_phase(RankPhase.FAILED)
            raise
        return hold(self) if moved and event.hold else moved  # below the minimum: save, hold the state

    def _move(self, event: Event) -> bool:
        """Leave the current round for ``event``'s; False when this node leaves the job."""
        t0 = time.monotonic()
        if event.repair or self.engine.broken() is not None:
            # a repair reached at its step: a peer of this round failed, so no collective, no graceful
            # teardown on it (NCCL's would block on the dead peer): aborted, as after a failed step
            kept = self.joiner.keep_after_failure(None)
        else:
            kept = self.joiner.leave(event)
        if event.leaves:
            self.engine.set_phase(RankPhase.LEAVING)
            return False
        self.joiner.join(event, kept=kept, fresh_module=None, torn_down_s=time.monotonic() - t0)
        return True

    def peer_failure(self, exc: BaseException) -> bool:
        """Whether ``exc`` (raised by a step) is another rank's failure that a launcher can repair in place
        (:meth:`~elastic_events.rounds.engine.RoundEngine.peer_failure`)."""
        return self.engine.reader is not None and self.engine.peer_failure(exc)

    def recover(self, exc: BaseException, *, step: int | None = None) -> bool:
        """Carry this rank through the failure of a peer, in process: call it where a step raised.

        Unless ``exc`` is another rank's failure (:meth:`peer_failure`), or there is no launcher to
        repair the group, it is raised again unchanged. Otherwise the rank drops the broken group
        (aborted, never awaited) and waits for the launcher's repair (a ``RECONFIGURE`` into a new
        round: the failed rank replaced, or its node left out); the survivors at the furthest
        committed step are the state, every other rank is brought to it from them. A sharded (FSDP2)
        model is put back together from the survivors' shards and the in-memory snapshots their peers
        hold of the failed ranks' shards, at the newest step all of them have (at most ``snapshot_every``
        steps back). The commit check makes a failed step change nothing. Returns True to train on
        (rebuild the loader iterator, as after :meth:`reconfigure`), False when this node is not part
        of the repaired job (exit 0). Raises :class:`RecoveryError` (from ``exc``) when no repair came
        within ``config.recover_timeout_s`` or it failed. ``step`` is the step whose work raised, for the
        messages (default: the one after :attr:`step`; it is :attr:`step` itself where the optimizer step
        was taken before a later collective of the step failed).
        """
        e, s = self.engine, self.state
        if not self.peer_failure(exc):
            raise exc
        if s.sharded and self.snapshots.replicator is None and not self.snapshots.replicas:
            raise RecoveryError(
                f"rank {e.rank}: a collective failed at step {s.step + 1} and this sharded (FSDP2) model keeps "
                "no in-memory snapshots (snapshot_every=0 or --snapshot-every 0): the failed rank's shards exist "
                "nowhere else"
            ) from exc
        rank, t0, failed_step = e.rank, time.monotonic(), s.step + 1 if step is None else step
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        print(
            f"rank {rank}: a collective failed during step {failed_step} ({reason}); waiting for the repaired group",
            file=sys.stderr,
            flush=True,
        )
        eventlog.emit(Record.PEER_FAILED, rank=rank, step=s.step, error=reason)
        e.take_event()
        kept = self.joiner.keep_after_failure(exc)
        torn_down = time.monotonic() - t0
        event = e.wait_for_repair(failed_step=failed_step)
        if event.leaves:
            e.set_phase(RankPhase.LEAVING)
            return False
        try:
            self.joiner.join(event, kept=kept, fresh_module=None, torn_down_s=torn_down)
        except BaseException as failed:
            e.set_phase(RankPhase.FAILED)
            raise RecoveryError(
                f"rank {rank}: the repaired group of round {event.round} could not be joined: {failed}"
            ) from failed
        return hold(self) if event.hold else True  # too few survivors: save, hold the state

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

    # ------------------------------------------------------------------ checkpoints, the end
    def save_checkpoint(self) -> None:
        """Save the state at :attr:`step` through the checkpointer (collective)."""
        s = self.state
        if s.checkpointer is None:
            raise ElasticTrainingError("save_checkpoint() needs a checkpointer: pass checkpointer= to ElasticTraining")
        self._saved_step = s.step
        s.checkpointer.save(
            s.step, model=s.built_model(), optimizer=s.optimizer, scheduler=s.scheduler, data=s.sampler, extra=s.extra
        )

    def snapshot_stats(self) -> dict[str, int]:
        """Bytes of this rank's local state, bytes of snapshots it holds (its neighbour's two and its own),
        snapshots completed this round, and the last one's chain time in µs (see ``Snapshots.stats``)."""
        return self.snapshots.stats()

    def finish(self) -> None:
        """Training is over for this rank: its launcher acts on no further event (no joiner is admitted,
        this rank is not restarted). Called by :meth:`steps` at ``until``; call it when a loop of your own ends."""
        if self._finished:
            return
        self._finished = True
        self.engine.set_phase(RankPhase.FINISHED)
        eventlog.emit(Record.TRAINING_FINISHED, step=self.step)

    def close(self) -> None:
        """Leave the process group at the end of training (also run at interpreter exit).

        The DDP wrapper holds the group: left alive, the group outlives ``destroy_process_group``
        and is freed during interpreter finalization, where torch 2.13's gloo aborts the process
        about one exit in six ("terminate called without an active exception", SIGABRT) after
        training succeeded. Dropping the wrapper first lets the group go here.
        """
        elastic_events._set_step_hook(None)
        self.snapshots.stop(broken=False)
        if self.engine.distributed and self.state.module is not None:
            self.state.model = self.state.module
            gc.collect()
        self.engine.close()
