"""In-place scale events for the framework integrations: the round protocol, without a framework.

:class:`elastic_events.ElasticTraining` carries a hand-written loop through a ``RECONFIGURE``
event in the same process. A ``transformers.Trainer`` or a Lightning ``Trainer`` owns what
that class rebuilds (the DDP wrapper, the optimizer object, the data loader), so the
integrations use the same protocol from outside the framework's loop:

1. :func:`elastic_init`, called before the script builds anything that depends on the world
   (``TrainingArguments``, ``L.Trainer``). Outside hyperpodrun, and on ranks started into a
   round, it returns at once. A pre-warmed joiner (``HYPERPODRUN_PARKED=1``: imported, model
   built, no rank yet) waits there until a ``RECONFIGURE`` event admits its node, then joins
   the new round's process group (:meth:`~elastic_events.rounds.engine.RoundEngine.form`), so the rest
   of the script builds its framework objects for the world it will train in.
2. The framework driver (``ElasticTrainer.train`` / ``ElasticCallback.fit``) calls
   :meth:`Rounds.offer` once: the rank declares ``CAP_RECONFIGURE`` on the control channel only
   when everything above is in place; otherwise one line on stderr and an
   ``in_place_unavailable`` record in the event log say why the launcher will use the restart
   path for this job.
3. At the agreed step the callback stops the framework's loop without saving; the loop returns
   with the model, optimizer state, scheduler and trainer state in memory. :meth:`Rounds.move`
   tears the old group down (a leaving node's ranks stop there and exit 0), joins the new
   round's group, and hydrates the newcomers: every rank reports what it holds, the same plan
   is made everywhere (:func:`~elastic_events.rounds.hydration.plan_hydration`: survivors at
   different steps or with different replicas are refused), and one survivor streams the model
   tensors into the newcomers' own tensors and the rest of the framework's state as one
   skeleton plus tensors (:func:`~elastic_events.rounds.transfer.broadcast_tensors`, bounded buckets).
4. The driver rebuilds the framework's world (accelerate's state, the Trainer's accelerator,
   Lightning's strategy) and calls :meth:`Rounds.ready`; then it re-enters the framework's loop,
   which resumes from the in-memory state through the framework's own resume path.

Nothing here imports a training framework.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from elastic_events import eventlog
from elastic_events.contract import Record
from elastic_events.control import CAP_RECONFIGURE, ControlReader, Event, EventKind, RankPhase
from elastic_events.integrations.common import ElasticIntegrationError, rank_and_world
from elastic_events.rounds.config import ElasticConfig
from elastic_events.rounds.engine import RoundEngine
from elastic_events.rounds.hydration import RankReport, plan_hydration, structure_digest, value_checksum

__all__ = [
    "InPlaceError",
    "Kept",
    "Moved",
    "Rounds",
    "elastic_init",
    "rounds",
]


class InPlaceError(ElasticIntegrationError):
    """A rank could not be carried into a new round in place; the launcher falls back to a restart."""


@dataclass(frozen=True, kw_only=True)
class Kept:
    """What a survivor holds when its framework loop has stopped at the agreed step.

    ``payload``: the framework's state except the model's tensors (optimizer state dict,
    scheduler, trainer state, ...): tensors referenced, not copied. The model's parameters and
    buffers travel from the module itself.
    """

    step: int
    payload: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class Moved:
    """Where :meth:`Rounds.move` or :meth:`Rounds.admitted_state` left a rank."""

    left: bool  # its node left the job: exit 0
    payload: dict[str, Any] | None  # the state to resume from; None: no rank held one (use storage)
    survivor: bool
    event: Event | None


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def expose_round(engine: RoundEngine) -> None:
    """Give the framework the torchrun variables of the engine's current round.

    The one place the rank side writes its process's environment: Hugging Face's accelerate decides
    whether the process is distributed, and Lightning's cluster environment which rank it is, from
    ``WORLD_SIZE`` and ``RANK`` in the environment when they are rebuilt for a new round. A script's
    own code reads its round from the engine (:class:`~elastic_events.ElasticTraining`'s ``rank``).
    """
    os.environ.update(engine.torchrun_environment())


class Rounds:
    """This process's side of the in-place protocol for a framework job (one per process: :func:`rounds`)."""

    def __init__(self) -> None:
        self.engine: RoundEngine | None = None  # made by elastic_init()
        self.offered = False  # CAP_RECONFIGURE declared
        self._admission: Event | None = None  # a joiner admitted into this event's round, not yet hydrated
        self._refusal_said = False

    @property
    def initialised(self) -> bool:
        """elastic_init() ran."""
        return self.engine is not None

    @property
    def _reader(self) -> ControlReader | None:
        """The control channel (None outside hyperpodrun); opened on first use."""
        import elastic_events

        return self.engine.reader if self.engine is not None else elastic_events._channel()

    def _engine(self) -> RoundEngine:
        """The round engine elastic_init() made; raises :class:`InPlaceError` without one."""
        if self.engine is None:
            raise InPlaceError("elastic_init() was not called in this process: call it before building the Trainer")
        return self.engine

    @property
    def admitted(self) -> bool:
        """A pre-warmed joiner that was admitted and has not received its state yet."""
        return self._admission is not None

    def init(self, config: ElasticConfig) -> None:
        if self.engine is not None:
            raise InPlaceError("elastic_init() was already called in this process")
        self.engine = RoundEngine(config)
        if self.engine.reader is not None and self.engine.context.parked:
            self._admit()

    def _admit(self) -> None:
        """A pre-warmed joiner: wait for the event that places this node in a round, and join its group."""
        from elastic_events.rounds.joining import prewarm

        engine = self._engine()
        prewarm()  # what the first step would import, paid while parked
        event = engine.wait_for_admission()
        try:
            engine.form(event, step=0)
            expose_round(engine)
        except BaseException:
            engine.set_phase(RankPhase.FAILED)
            raise
        self._admission = event

    def offer(self, framework: str, blockers: list[str]) -> bool:
        """Declare in-place events for this rank, or say why not; whether they are offered.

        ``blockers``: what in the framework's configuration prevents them (empty: nothing).
        Outside hyperpodrun nothing is offered and nothing is said.
        """
        reader = self._reader
        if reader is None:
            return False
        why = list(blockers)
        if self.engine is None:
            why.append(
                "the script did not call elastic_init() before building its Trainer (a pre-warmed joiner could not "
                "learn its world before the framework fixes it)"
            )
        if self._refusal_said:
            return False  # a rank that said it will not train in place stays on the restart path
        if why:
            if self._admission is not None:  # admitted by elastic_init(): an engine exists
                self._engine().set_phase(RankPhase.FAILED)
                raise InPlaceError(
                    f"rank admitted in place, but {framework} cannot train in place here: {'; '.join(why)}"
                )
            self._refusal_said = True  # said once: on stderr from each node's first rank, in the event log from rank 0
            rank, _ = rank_and_world()
            reason = "; ".join(why)
            if self.engine is None or self.engine.local_rank == 0:
                _say(
                    f"rank {rank}: in-place scale events not offered ({framework}): {reason}; "
                    "scale events save a checkpoint and restart the ranks"
                )
            eventlog.emit(Record.IN_PLACE_UNAVAILABLE, framework=framework, reason=reason)
            return False
        if not self.offered:
            self.offered = True
            reader.declare(CAP_RECONFIGURE)
            if self._admission is None:
                self._engine().set_phase(RankPhase.RUNNING)
        return True

    # ----------------------------------------------------------------- events
    def take_event(self) -> Event | None:
        """The event ``elastic_event_detected()`` just returned True for (taken: asked once)."""
        reader = self._reader
        if reader is None:
            return None
        event, reader.fired = reader.fired, None
        return event

    def restart_requested(self, event: Event, *, step: int) -> None:
        """This rank offered in-place events and the launcher published a restart: say so."""
        if not self.offered:
            return
        rank, _ = rank_and_world()
        why = (
            "the launcher asked for a restart (--restart-mode process, or a rank of the job does not support "
            "in-place events; see in_place_unavailable in the event log)"
        )
        if rank == 0:
            _say(f"rank 0: event {event.event_id} at step {step}: {why}: saving a checkpoint and exiting")
        eventlog.emit(Record.RESTART_REQUESTED, event_id=event.event_id, step=step, reason=why)

    def is_in_place(self, event: Event | None) -> bool:
        return event is not None and event.kind is EventKind.RECONFIGURE and self.offered

    def move(self, event: Event, *, kept: Kept, module: torch.nn.Module) -> Moved:
        """A survivor at a ``RECONFIGURE`` event, its framework loop stopped and its wrappers dropped:
        leave the old group; then leave the job, or join the new round and bring every rank to one state.

        The caller rebuilds its framework's world and calls :meth:`ready` before training on.
        """
        engine = self._engine()
        engine.set_phase(RankPhase.RECONFIGURING)
        try:
            torn_down = engine.release()
            if event.leaves:
                eventlog.emit(
                    Record.GROUP_TORN_DOWN, event_id=event.event_id, step=kept.step, seconds=torn_down, left=True
                )
                engine.set_phase(RankPhase.LEAVING)
                return Moved(left=True, payload=None, survivor=True, event=event)
            engine.form(event, step=kept.step, torn_down_s=torn_down)
            expose_round(engine)
            payload = self._hydrate(event, module=module, kept=kept)
        except BaseException:
            engine.set_phase(RankPhase.FAILED)
            raise
        return Moved(left=False, payload=payload, survivor=True, event=event)

    def admitted_state(self, *, module: torch.nn.Module) -> Moved:
        """An admitted joiner whose framework objects exist now: receive the state from the survivors."""
        event = self._admission
        if event is None:
            raise InPlaceError("admitted_state() on a rank that was not admitted in place")
        self._admission = None
        try:
            payload = self._hydrate(event, module=module, kept=None)
        except BaseException:
            self._engine().set_phase(RankPhase.FAILED)
            raise
        return Moved(left=False, payload=payload, survivor=False, event=event)

    def ready(self, moved: Moved) -> None:
        """The rank's framework is rebuilt for the new round: the agent may consider the event done."""
        if moved.event is None or self._reader is None:
            return
        engine = self._engine()
        engine.set_phase(RankPhase.READY, round=moved.event.round)
        engine.new_round("reconfigure" if moved.survivor else "admitted")

    def failed(self) -> None:
        """The framework could not be rebuilt for the new round: the launcher falls back to a restart."""
        if self.engine is not None:
            self.engine.set_phase(RankPhase.FAILED)

    def finished(self, *, step: int) -> None:
        """The framework's training ended on this rank at ``step``: no further event is acted on, in place or on
        the restart path (the launcher admits no joiner and takes a crash at exit for success)."""
        reader = self._reader
        if reader is not None:
            reader.set_phase(RankPhase.FINISHED)
            eventlog.emit(Record.TRAINING_FINISHED, step=step)

    # ------------------------------------------------------------- internals
    def _hydrate(self, event: Event, *, module: torch.nn.Module, kept: Kept | None) -> dict[str, Any] | None:
        """Every rank reports what it holds; the plan's source sends the state to the newcomers."""
        import time

        engine = self._engine()
        t0 = time.monotonic()
        survivor = kept is not None
        reader = self._reader
        report = RankReport(
            rank=engine.rank,
            survivor=survivor,
            source_ready=survivor,
            step=kept.step if kept is not None else -1,
            structure=structure_digest(module),
            checksum=value_checksum(module) if survivor else None,
            sharded=False if survivor else None,
            control_step=reader.step if reader is not None else 0,
        )
        with engine.collectives(InPlaceError):
            reports = engine.agree(report, error=InPlaceError)
            plan = plan_hydration(reports, recovering=event.repair, local_world_size=engine.local_world_size)
            payload = kept.payload if kept is not None else None
            received = engine.rank in plan.newcomers and plan.source is not None
            if plan.source is not None and plan.newcomers:
                payload = engine.transfer(plan.source, plan.newcomers, module=module, payload=payload)
        if received and reader is not None:  # later events target the survivors' count of steps
            reader.set_step(next(r.control_step for r in reports if r.rank == plan.source))
        eventlog.emit(
            Record.HYDRATED,
            event_id=event.event_id,
            step=plan.step,
            seconds=time.monotonic() - t0,
            newcomers=len(plan.newcomers),
            from_rank=plan.source,
            sharded=False,
        )
        return payload


_ROUNDS: Rounds | None = None


def rounds() -> Rounds:
    """This process's :class:`Rounds` (made on first use)."""
    global _ROUNDS
    if _ROUNDS is None:
        _ROUNDS = Rounds()
    return _ROUNDS


def elastic_init(*, config: ElasticConfig | None = None) -> None:
    """Make a framework script able to change world size in place; call it before building the Trainer.

    Under hyperpodrun, a pre-warmed joiner (started before its node is admitted, with no rank
    yet) waits here until the job admits it, then joins its round's process group: the
    framework objects built after this call (``TrainingArguments``, ``L.Trainer``) see the
    world they will train in. Every other rank returns at once; outside hyperpodrun it does
    nothing. Build the model and the dataset before it when they are expensive: a joiner then
    pays for them while it waits, not while the job waits for it.
    """
    if config is not None and not isinstance(config, ElasticConfig):
        raise InPlaceError(f"config must be an ElasticConfig, got {type(config).__name__}")
    rounds().init(config or ElasticConfig())
