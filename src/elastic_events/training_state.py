"""What a rank trains with, as :class:`~elastic_events.ElasticTraining` keeps it through rounds.

:class:`TrainState` holds the model (the bare module and what the loop calls: the module wrapped
for the current group), the optimizer, the LR scheduler, the data position (sampler), the step, the
user's small extras and the base seed, and builds them again from :class:`Builders` when a round
needs new objects. :class:`Kept` is what a survivor carries from its old round into the new one.
Nothing here talks to other ranks; :mod:`elastic_events.rounds.joining` moves the state between them.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from elastic_events.errors import ElasticTrainingError, HydrationError
from elastic_events.rounds.config import default_wrap
from elastic_events.rounds.hydration import FullState, model_tensors
from elastic_events.rounds.replica_plan import Holding
from elastic_events.rounds.snapshot import Captured, Piece, Replicator
from elastic_events.rounds.snapshot_restore import SnapshotReport

__all__ = [
    "Builders",
    "DataSampler",
    "Kept",
    "LoadedCheckpoint",
    "StateCheckpointer",
    "StepSampler",
    "TrainState",
    "is_sharded",
    "on_meta",
]

ModelFn = Callable[[], torch.nn.Module]
WrapFn = Callable[..., torch.nn.Module]  # wrap(module), or with HSDP wrap(module, mesh=the round's mesh)
OptimizerFn = Callable[[torch.nn.Module], torch.optim.Optimizer]
SchedulerFn = Callable[[torch.optim.Optimizer], Any]


class DataSampler(Protocol):
    """The data position a rank keeps, saves and hands to newcomers (an ElasticSampler is one).

    One with ``set_world(rank=, world_size=)`` is split over each new world as well."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@runtime_checkable
class StepSampler(DataSampler, Protocol):
    """A sampler that deals each step's global batch: what ``ElasticTraining.steps()`` iterates (ElasticSampler)."""

    @property
    def epoch(self) -> int: ...

    def steps(self, loader: Iterable[Any]) -> Iterator[Any]: ...

    def mark_step(self) -> None: ...


class LoadedCheckpoint(Protocol):
    """What a checkpointer's ``load`` returns of the state it loaded."""

    @property
    def step(self) -> int: ...

    @property
    def extra(self) -> dict[str, Any]: ...


class StateCheckpointer(Protocol):
    """The checkpointer a rank loads its state from at start and saves it with (a Checkpointer is one)."""

    def latest(self) -> object | None: ...

    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        data: DataSampler | None = None,
        extra: dict[str, Any] | None = None,
    ) -> object: ...

    def load(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        data: DataSampler | None = None,
    ) -> LoadedCheckpoint | None: ...

    def wait(self) -> object: ...

    def release_group(self, *, abandon: bool = False) -> None: ...


def is_sharded(model: torch.nn.Module | None) -> bool:
    from torch.distributed.tensor import DTensor

    return model is not None and any(isinstance(p, DTensor) for p in model.parameters())


def on_meta(module: torch.nn.Module) -> bool:
    return any(t.is_meta for _, t in model_tensors(module))


@dataclass(frozen=True, kw_only=True)
class Builders:
    """How the script builds its objects: the bare model, its wrapper, optimizer and scheduler."""

    model_fn: ModelFn
    wrap: WrapFn = default_wrap
    optimizer_fn: OptimizerFn | None = None
    scheduler_fn: SchedulerFn | None = None

    def __post_init__(self) -> None:
        if not callable(self.model_fn):
            raise ElasticTrainingError(f"model_fn must be callable, got {type(self.model_fn).__name__}")
        for name in ("wrap", "optimizer_fn", "scheduler_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ElasticTrainingError(f"{name} must be callable or None, got {type(value).__name__}")


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
    # an HSDP survivor: its live local shards (which the other replicas hold too) and which shard they are
    piece: Piece | None = None
    holding: Holding | None = None
    previous: Piece | None = None  # an HSDP survivor of a failure: its local shards as they were one step back

    def at(self, step: int) -> Piece | None:
        """An HSDP survivor's local shards at ``step``: live, one step back, or None (it is sent them)."""
        return next((p for p in (self.piece, self.previous) if p is not None and p.step == step), None)


class TrainState:
    """A rank's training objects and small state (see the module)."""

    def __init__(
        self,
        builders: Builders,
        *,
        sampler: DataSampler | None,
        checkpointer: StateCheckpointer | None,
        device: torch.device,
        mesh: Callable[[], Any] | None = None,
    ) -> None:
        self.builders = builders
        self._mesh = mesh  # HSDP: the current round's mesh (built once per round), handed to wrap as mesh=
        self.sampler, self.checkpointer, self.device = sampler, checkpointer, device
        self.initial_sampler_state = sampler.state_dict() if sampler is not None else None  # step 0's data position
        self.module: torch.nn.Module | None = None  # the bare model (for FSDP2: the sharded model itself)
        self.model: torch.nn.Module | None = None  # what the loop calls: wrapped when a group is up
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.step = 0
        self.extra: dict[str, Any] = {}
        self.base_seed = torch.initial_seed()
        self.resumed_from = "fresh"  # how the state was obtained: fresh, checkpoint, peers, snapshot, handoff
        self.control_step = 0  # a newcomer's step count on the control channel, from its source
        self.optimizer_steps = [0, 0]  # optimizer steps begun, ended (hooks of the optimizer)
        self.step_hooks: tuple[Callable[..., None], ...] = ()  # pre-step hooks every optimizer gets
        self.post_step_hooks: tuple[Callable[..., None], ...] = ()

    @property
    def sharded(self) -> bool:
        return is_sharded(self.module)

    def built_module(self) -> torch.nn.Module:
        """The bare model; raises when none is built (before start, or while a sharded model is rebuilt)."""
        if self.module is None:
            raise ElasticTrainingError("the rank has no model: it is built at start() and again in each new round")
        return self.module

    def built_model(self) -> torch.nn.Module:
        """What the loop calls; raises when none is built (before start, or while a sharded model is rebuilt)."""
        if self.model is None:
            raise ElasticTrainingError("the rank has no model: it is built at start() and again in each new round")
        return self.model

    def optimizer_busy(self) -> bool:
        return self.optimizer_steps[0] != self.optimizer_steps[1]

    # ------------------------------------------------------------------ building
    @property
    def mesh(self) -> Any:
        """The current round's HSDP mesh, or None (no HSDP, or no group)."""
        return self._mesh() if self._mesh is not None else None

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """The script's ``wrap`` of ``module`` for the current group; with HSDP it gets the round's mesh too."""
        if self._mesh is not None:
            return self.builders.wrap(module, mesh=self.mesh)
        return self.builders.wrap(module)

    def build(self, module: torch.nn.Module) -> None:
        """Wrap ``module`` for the current group, then build its optimizer and scheduler."""
        self.module = module
        self.model = self.wrap(module)
        self.check_materialised()
        self.build_optimizer()

    def fresh_module(self) -> torch.nn.Module:
        return self.builders.model_fn()

    def materialise(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` on this rank's device, allocated (contents undefined) when built on ``meta``."""
        if on_meta(module):
            module.to_empty(device=self.device)
        return module

    def rewrap(self) -> None:
        """Wrap the hydrated replica for the new group (no second broadcast with the default DDP)."""
        module = self.built_module()
        if self.builders.wrap is default_wrap:
            self.model = default_wrap(module, init_sync=False)
        else:
            self.model = self.wrap(module)

    def build_optimizer(self) -> None:
        fn = self.builders.optimizer_fn
        self.optimizer = fn(self.built_model()) if fn is not None else None
        if self.optimizer is not None:
            steps = self.optimizer_steps
            for hook in self.step_hooks:
                self.optimizer.register_step_pre_hook(hook)
            self.optimizer.register_step_pre_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
            for hook in self.post_step_hooks:
                self.optimizer.register_step_post_hook(hook)
            self.optimizer.register_step_post_hook(lambda *_: steps.__setitem__(1, steps[1] + 1))
        if self.builders.scheduler_fn is not None and self.optimizer is not None:
            self.scheduler = self.builders.scheduler_fn(self.optimizer)

    def check_materialised(self) -> None:
        if self.model is not None and on_meta(self.model):
            raise ElasticTrainingError(
                "the model is still on the meta device after wrap(): materialise it there (to_empty + init)"
            )

    def drop_wrapper(self) -> None:
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

    def drop_objects(self) -> None:
        """A sharded model's objects: rebuilt on the new mesh (FSDP2's hooks hold them in cycles)."""
        self.module = self.model = self.optimizer = self.scheduler = None
        gc.collect()

    # ------------------------------------------------------------------ small state
    def start_over(self) -> int:
        """Step 0's count and data position for a freshly built model, as a restart without a checkpoint
        would have: never the lost step's (new weights trained as if from that step). Returns the lost step."""
        lost = self.step
        self.step, self.extra, self.resumed_from = 0, {}, "fresh"
        if self.sampler is not None and self.initial_sampler_state is not None:
            self.sampler.load_state_dict(self.initial_sampler_state)
        return lost

    def small_state(self, *, control_step: int) -> dict[str, Any]:
        return {
            "step": self.step,
            "extra": self.extra,
            "base_seed": self.base_seed,
            "control_step": control_step,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
        }

    def load_small_state(self, state: dict[str, Any]) -> None:
        self.resumed_from = "peers"
        self.step, self.extra, self.base_seed = state["step"], state["extra"], state["base_seed"]
        self.control_step = state["control_step"]
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.sampler is not None and state["sampler"] is not None:
            self.sampler.load_state_dict(state["sampler"])

    def load_handed(self, handed: dict[str, Any] | None, fresh_module: torch.nn.Module | None) -> None:
        """The source of a round no rank survived: take the state its predecessor handed off
        (:mod:`elastic_events.rounds.handoff`) into ``fresh_module``."""
        if handed is None or fresh_module is None:
            raise HydrationError("the hydration plan names a hand-off this rank could not read")
        self.module = self.materialise(fresh_module)
        with torch.no_grad():
            for name, tensor in model_tensors(self.module):
                tensor.copy_(handed["model"][name])
        self.model = self.module  # wrapped for the new group after hydration
        self.build_optimizer()
        if self.optimizer is not None and handed["optimizer"] is not None:
            self.optimizer.load_state_dict(handed["optimizer"])
        self.load_small_state(handed["small"])
        self.resumed_from = "handoff"

    def set_world(self, *, rank: int, world_size: int) -> None:
        if self.sampler is not None and hasattr(self.sampler, "set_world"):
            self.sampler.set_world(rank=rank, world_size=world_size)
