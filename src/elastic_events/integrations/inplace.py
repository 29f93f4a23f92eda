"""In-place scale events for the framework integrations: the round protocol, without a framework.

:class:`elastic_events.ElasticTraining` carries a hand-written loop through a ``RECONFIGURE``
event in the same process. A ``transformers.Trainer`` or a Lightning ``Trainer`` owns what
that class rebuilds (the DDP wrapper, the optimizer object, the data loader), so the
integrations use the same protocol from outside the framework's loop:

1. :func:`elastic_init`, called before the script builds anything that depends on the world
   (``TrainingArguments``, ``L.Trainer``). Outside hyperpodrun, and on ranks started into a
   round, it returns at once. A pre-warmed joiner (``HYPERPODRUN_PARKED=1``: imported, model
   built, no rank yet) waits there until a ``RECONFIGURE`` event admits its node, then joins
   the new round's process group (:func:`~elastic_events.rounds.group.init_round_group`), so the rest
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
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import elastic_events
from elastic_events import contract, eventlog
from elastic_events.control import CAP_RECONFIGURE, ControlReader, Event, EventKind, RankPhase
from elastic_events.integrations.common import ElasticIntegrationError, rank_and_world
from elastic_events.rounds.group import RoundSpec, backend_for, default_device, init_round_group, teardown_group
from elastic_events.rounds.hydration import (
    RankReport,
    allocate_tensors,
    collective_failures,
    model_tensors,
    plan_hydration,
    split_tensors,
    structure_digest,
    value_checksum,
)
from elastic_events.rounds.transfer import broadcast_tensors

__all__ = [
    "IN_PLACE_UNAVAILABLE",
    "RESTART_REQUESTED",
    "InPlaceConfig",
    "InPlaceConfigError",
    "InPlaceError",
    "Kept",
    "Moved",
    "Rounds",
    "elastic_init",
    "rounds",
]

#: Event-log record of a rank that does not offer in-place events (``reason`` says why).
IN_PLACE_UNAVAILABLE = "in_place_unavailable"
#: Event-log record of a rank that offered in-place events and was asked to save and restart.
RESTART_REQUESTED = "restart_requested"


class InPlaceError(ElasticIntegrationError):
    """A rank could not be carried into a new round in place; the launcher falls back to a restart."""


class InPlaceConfigError(InPlaceError, ValueError):
    """An :class:`InPlaceConfig` field is invalid."""


@dataclass(frozen=True, kw_only=True)
class InPlaceConfig:
    """How a framework job waits and moves state at in-place events (:func:`elastic_init`)."""

    timeout_s: float = 600.0  # forming a round's group, and bringing its ranks to one state
    admission_timeout_s: float = 86_400.0  # how long a pre-warmed joiner waits to be admitted
    poll_s: float = 0.005  # a pre-warmed joiner's look at the control channel
    bucket_mb: float = 64.0  # largest broadcast of the state transfer
    backend: str | None = None  # a joiner's group: None -> nccl on CUDA, else gloo (survivors keep theirs)

    def __post_init__(self) -> None:
        for name in ("timeout_s", "admission_timeout_s", "poll_s", "bucket_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InPlaceConfigError(f"InPlaceConfig.{name} must be a number > 0, got {value!r}")
        if self.backend not in (None, "gloo", "nccl"):
            raise InPlaceConfigError(f"InPlaceConfig.backend must be None, 'gloo' or 'nccl', got {self.backend!r}")

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))


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


class Rounds:
    """This process's side of the in-place protocol for a framework job (one per process: :func:`rounds`)."""

    def __init__(self) -> None:
        self.config = InPlaceConfig()
        self.initialised = False  # elastic_init() ran
        self.offered = False  # CAP_RECONFIGURE declared
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self._admission: Event | None = None  # a joiner admitted into this event's round, not yet hydrated
        self._store: Any = None  # the round's TCPStore: lives as long as its group
        self._refusal_said = False
        self._received = False  # this rank took the state from a peer in the round being formed

    # ------------------------------------------------------------------ start
    @property
    def _reader(self) -> ControlReader | None:
        """The control channel (None outside hyperpodrun); opened on first use."""
        return elastic_events._channel()

    @property
    def admitted(self) -> bool:
        """A pre-warmed joiner that was admitted and has not received its state yet."""
        return self._admission is not None

    def init(self, config: InPlaceConfig) -> None:
        if self.initialised:
            raise InPlaceError("elastic_init() was already called in this process")
        self.config, self.initialised = config, True
        parked = os.environ.get(contract.PARKED_ENV) == "1"
        if self._reader is None:
            if parked:
                raise InPlaceError(
                    f"{contract.PARKED_ENV}=1 needs the control channel ({contract.CONTROL_FILE_ENV}): only hyperpodrun parks ranks"
                )
            return
        if parked:
            self._admit()

    def _admit(self) -> None:
        """A pre-warmed joiner: wait for the event that places this node in a round, and join its group."""
        from elastic_events.rounds.state import prewarm

        prewarm()  # what the first step would import, paid while parked
        event = self._reader.wait_for_admission(timeout_s=self.config.admission_timeout_s, poll_s=self.config.poll_s)
        backend = self.config.backend or backend_for(default_device(self.local_rank))
        try:
            self._form(event, backend=backend)
        except BaseException:
            self._phase(RankPhase.FAILED)
            raise
        self._admission = event

    def offer(self, framework: str, blockers: list[str]) -> bool:
        """Declare in-place events for this rank, or say why not; whether they are offered.

        ``blockers``: what in the framework's configuration prevents them (empty: nothing).
        Outside hyperpodrun nothing is offered and nothing is said.
        """
        if self._reader is None:
            return False
        why = list(blockers)
        if not self.initialised:
            why.append(
                "the script did not call elastic_init() before building its Trainer (a pre-warmed joiner could not "
                "learn its world before the framework fixes it)"
            )
        if self._refusal_said:
            return False  # a rank that said it will not train in place stays on the restart path
        if why:
            if self._admission is not None:
                self._phase(RankPhase.FAILED)
                raise InPlaceError(
                    f"rank admitted in place, but {framework} cannot train in place here: {'; '.join(why)}"
                )
            self._refusal_said = True  # said once: on stderr from each node's first rank, in the event log from rank 0
            rank, _ = rank_and_world()
            reason = "; ".join(why)
            if self.local_rank == 0:
                _say(
                    f"rank {rank}: in-place scale events not offered ({framework}): {reason}; "
                    "scale events save a checkpoint and restart the ranks"
                )
            eventlog.emit(IN_PLACE_UNAVAILABLE, framework=framework, reason=reason)
            return False
        if not self.offered:
            self.offered = True
            self._reader.declare(CAP_RECONFIGURE)
            if self._admission is None:
                self._phase(RankPhase.RUNNING, round=int(os.environ.get(contract.ROUND_ENV, "0")))
        return True

    # ----------------------------------------------------------------- events
    def take_event(self) -> Event | None:
        """The event ``elastic_event_detected()`` just returned True for (taken: asked once)."""
        if self._reader is None:
            return None
        event, self._reader.fired = self._reader.fired, None
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
        eventlog.emit(RESTART_REQUESTED, event_id=event.event_id, step=step, reason=why)

    def is_in_place(self, event: Event | None) -> bool:
        return event is not None and event.kind is EventKind.RECONFIGURE and self.offered

    def move(self, event: Event, *, kept: Kept, module: torch.nn.Module) -> Moved:
        """A survivor at a ``RECONFIGURE`` event, its framework loop stopped and its wrappers dropped:
        leave the old group; then leave the job, or join the new round and bring every rank to one state.

        The caller rebuilds its framework's world and calls :meth:`ready` before training on.
        """
        self._phase(RankPhase.RECONFIGURING)
        try:
            backend = (
                dist.get_backend()
                if dist.is_initialized()
                else self.config.backend or backend_for(default_device(self.local_rank))
            )
            t0 = time.monotonic()
            teardown_group()
            torn_down = time.monotonic() - t0
            if event.leaves:
                eventlog.emit(
                    contract.GROUP_TORN_DOWN, event_id=event.event_id, step=kept.step, seconds=torn_down, left=True
                )
                self._phase(RankPhase.LEAVING)
                return Moved(left=True, payload=None, survivor=True, event=event)
            self._form(event, backend=backend, torn_down=(kept.step, torn_down))
            payload = self._hydrate(event, module=module, kept=kept)
        except BaseException:
            self._phase(RankPhase.FAILED)
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
            self._phase(RankPhase.FAILED)
            raise
        return Moved(left=False, payload=payload, survivor=False, event=event)

    def ready(self, moved: Moved) -> None:
        """The rank's framework is rebuilt for the new round: the agent may consider the event done."""
        if moved.event is None or self._reader is None:
            return
        self._phase(RankPhase.READY, round=moved.event.round)
        elastic_events._new_round("reconfigure" if moved.survivor else "admitted")

    def failed(self) -> None:
        """The framework could not be rebuilt for the new round: the launcher falls back to a restart."""
        self._phase(RankPhase.FAILED)

    # ------------------------------------------------------------- internals
    def _phase(self, phase: RankPhase, *, round: int | None = None) -> None:
        if self._reader is not None:
            self._reader.set_phase(phase, round=round)

    def _form(self, event: Event, *, backend: str, torn_down: tuple[int, float] | None = None) -> None:
        spec = RoundSpec.from_event(event, local_rank=self.local_rank, local_world_size=self.local_world_size)
        os.environ.update(spec.environment())
        if torn_down is not None:
            eventlog.emit(contract.GROUP_TORN_DOWN, event_id=event.event_id, step=torn_down[0], seconds=torn_down[1])
        device = torch.device("cuda", self.local_rank) if backend == "nccl" else torch.device("cpu")
        t0 = time.monotonic()
        self._store = init_round_group(spec, device=device, backend=backend, timeout_s=self.config.timeout_s)
        eventlog.emit(contract.GROUP_UP, event_id=event.event_id, seconds=time.monotonic() - t0)

    def _hydrate(self, event: Event, *, module: torch.nn.Module, kept: Kept | None) -> dict[str, Any] | None:
        """Every rank reports what it holds; the plan's source sends the state to the newcomers."""
        t0 = time.monotonic()
        rank, world = dist.get_rank(), dist.get_world_size()
        survivor = kept is not None
        report = RankReport(
            rank=rank,
            survivor=survivor,
            source_ready=survivor,
            step=kept.step if survivor else -1,
            structure=structure_digest(module),
            checksum=value_checksum(module) if survivor else None,
            sharded=False if survivor else None,
            control_step=self._reader.step if self._reader is not None else 0,
        )
        reports: list[Any] = [None] * world
        with collective_failures(
            InPlaceError, rank=rank, round=event.round, world_size=world, timeout_s=self.config.timeout_s
        ):
            dist.all_gather_object(reports, report)
            plan = plan_hydration(reports, recovering=event.repair, local_world_size=self.local_world_size)
            payload = kept.payload if survivor else None
            received = rank in plan.newcomers and plan.source is not None
            if plan.source is not None and plan.newcomers:
                payload = self._exchange(plan.source, plan.newcomers, module=module, payload=payload)
        if received and self._reader is not None:  # later events target the survivors' count of steps
            self._reader.set_step(next(r.control_step for r in reports if r.rank == plan.source))
        eventlog.emit(
            contract.HYDRATED,
            event_id=event.event_id,
            step=plan.step,
            seconds=time.monotonic() - t0,
            newcomers=len(plan.newcomers),
            from_rank=plan.source,
            sharded=False,
        )
        return payload

    def _exchange(
        self, source: int, newcomers: tuple[int, ...], *, module: torch.nn.Module, payload: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """The source streams the model's tensors into the newcomers' own, then the payload (skeleton + tensors)."""
        rank, world = dist.get_rank(), dist.get_world_size()
        members = sorted((source, *newcomers))
        timeout = timedelta(seconds=self.config.timeout_s)
        group = None if len(members) == world else dist.new_group(members, timeout=timeout)  # every rank calls it
        if rank not in members:
            return payload
        sending = rank == source
        tensors: list[torch.Tensor] = []
        box: list[Any] = [None]
        if sending:
            box[0], tensors = split_tensors(payload)
        dist.broadcast_object_list(box, src=source, group=group)
        if not sending:
            payload, tensors = allocate_tensors(box[0], default_device(self.local_rank))
        comm = (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        )
        broadcast_tensors(
            [*(t for _, t in model_tensors(module)), *tensors],
            src=source,
            group=group,
            device=comm,
            bucket_bytes=self.config.bucket_bytes,
        )
        return payload


_ROUNDS: Rounds | None = None


def rounds() -> Rounds:
    """This process's :class:`Rounds` (made on first use)."""
    global _ROUNDS
    if _ROUNDS is None:
        _ROUNDS = Rounds()
    return _ROUNDS


def elastic_init(*, config: InPlaceConfig | None = None) -> None:
    """Make a framework script able to change world size in place; call it before building the Trainer.

    Under hyperpodrun, a pre-warmed joiner (started before its node is admitted, with no rank
    yet) waits here until the job admits it, then joins its round's process group: the
    framework objects built after this call (``TrainingArguments``, ``L.Trainer``) see the
    world they will train in. Every other rank returns at once; outside hyperpodrun it does
    nothing. Build the model and the dataset before it when they are expensive: a joiner then
    pays for them while it waits, not while the job waits for it.
    """
    if config is not None and not isinstance(config, InPlaceConfig):
        raise InPlaceConfigError(f"config must be an InPlaceConfig, got {type(config).__name__}")
    rounds().init(config or InPlaceConfig())
