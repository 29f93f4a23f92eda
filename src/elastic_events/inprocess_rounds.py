"""The half of :class:`~elastic_events.inprocess.ElasticTraining` that brings a rank into a new round.

Once the round's group is up every rank reports what it holds (:class:`RankReport`), and
the same plan is made everywhere (:func:`plan_hydration`): survivors at the furthest step
are the state; replicated models are streamed from one of them to the newcomers
(:meth:`RoundJoining._replicate`), sharded ones gathered and re-sharded onto the new mesh
(:meth:`RoundJoining._reshard`). When no rank survived with the state, a replaced rank's
hand-off (:mod:`elastic_events.handoff`) is the state, and only without one the checkpoint.
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
from elastic_events import abort, eventlog, names
from elastic_events.control import NO_SNAPSHOT, SNAPSHOT_WRITING, Event, RankPhase
from elastic_events.errors import ElasticTrainingError, HydrationError
from elastic_events.group import RoundSpec, init_round_group
from elastic_events.handoff import discard_handoff, find_handoff, load_handoff, write_handoff
from elastic_events.hydration import (
    FullState,
    RankReport,
    allocate_tensors,
    model_tensors,
    nonpersistent_buffers,
    plan_from_handoff,
    plan_hydration,
    split_tensors,
    structure_digest,
)
from elastic_events.rng import derive_rank_seed, seed_all
from elastic_events.transfer import broadcast_tensors

__all__ = ["Kept", "RoundJoining", "is_sharded", "on_meta"]


@dataclass(kw_only=True)
class Kept:
    """What a survivor takes from its old round into the new one (besides its live objects)."""

    step: int
    sharded: bool
    structure: str
    checksum: str | None
    full: FullState | None = None  # a sharded model's full state, on the new round's rank 0
    small: dict[str, Any] | None = None


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def on_meta(module: torch.nn.Module) -> bool:
    return any(t.is_meta for _, t in model_tensors(module))



class RoundJoining:
    """Mixed into :class:`~elastic_events.inprocess.ElasticTraining`, whose state it brings into each round."""

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
        eventlog.emit(names.GROUP_TORN_DOWN, event_id=event.event_id, step=self.step, seconds=torn_down_s)
        with abort.forming(event.round):
            self._store = init_round_group(spec, device=self.device, backend=self.backend, timeout_s=self.config.timeout_s)
        self.round = event.round
        self._watch_repairs()
        eventlog.emit(names.GROUP_UP, event_id=event.event_id, seconds=time.monotonic() - t0)
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
                print(f"rank {spec.rank}: cannot read its predecessor's hand-off {handoff.path}: {exc}", file=sys.stderr, flush=True)
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
        )
        reports: list[Any] = [None] * spec.world_size
        try:
            dist.all_gather_object(reports, report)
            plan = plan_from_handoff(plan_hydration(reports, recovering=event.repair, local_world_size=self.local_world_size), reports)
            received = spec.rank in plan.newcomers  # a newcomer, or a survivor a step behind the others
            if plan.handoff and plan.source == spec.rank:
                self._load_handoff(handed, fresh_module)
            if plan.source is None:
                self._rebuild_from_storage(fresh_module)
            elif plan.sharded:
                self._reshard(plan.source, kept, fresh_module)
            else:
                self._replicate(plan.source, plan.newcomers, fresh_module if fresh_module is not None else self.module)
                if not received:
                    self.model = self._rewrap()  # DDP over the new group (receivers wrapped in _replicate)
        except ElasticTrainingError:
            raise
        except RuntimeError as exc:  # gloo/NCCL report dead peers and timeouts as RuntimeError
            raise HydrationError(
                f"rank {spec.rank}: bringing round {spec.round}'s {spec.world_size} ranks to one state failed "
                f"or timed out (limit {self.config.timeout_s:.0f}s): {exc}"
            ) from exc
        self._set_world()
        seed_all(derive_rank_seed(self._base_seed, self.step, self.rank))
        if self._reader is not None and event.repair and plan.source is not None:
            # a rank that failed after committing a step may not have counted it: agree on the source's count
            self._reader.set_step(next(r.control_step for r in reports if r.rank == plan.source))
        elif self._reader is not None and received:
            self._reader.set_step(self._control_step)
        self._phase(RankPhase.READY)
        elastic_events._new_round("recovered" if event.repair else "reconfigure" if survivor else "admitted")
        eventlog.emit(
            names.HYDRATED, event_id=event.event_id, step=self.step, seconds=time.monotonic() - t1,
            newcomers=len(plan.newcomers), from_rank=plan.source, sharded=plan.sharded,
        )  # fmt: skip

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
            f"{self.round} (blocked); handed its state at step {self.step} to its replacement", file=sys.stderr, flush=True,
        )  # fmt: skip

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
            [*tensors, *optim_tensors], src=source, group=group, device=self._comm_device(),
            bucket_bytes=self.config.bucket_bytes,
        )  # fmt: skip
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
        box = [kept.small if full is not None else None]
        self.module = fresh_module if fresh_module is not None else self._model_fn()
        self.model = self._wrap(self.module)
        self._check_materialised()
        self._build_optimizer()
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(self.model, full.model if full else {}, options=options)
        if self.optimizer is not None:
            set_optimizer_state_dict(self.model, self.optimizer, full.optimizer if full else {}, options=options)
        if kept is not None:
            kept.full = full = None
        buffers = nonpersistent_buffers(self.model)
        broadcast_tensors(buffers, src=0, device=self._comm_device(), bucket_bytes=self.config.bucket_bytes)
        dist.broadcast_object_list(box, src=0)
        self._load_small_state(box[0])

    def _rebuild_from_storage(self, fresh_module: torch.nn.Module | None) -> None:
        """No rank holds a complete state: every rank builds its model and loads the newest checkpoint."""
        self._build(fresh_module if fresh_module is not None else self._model_fn())
        self._control_step = 0
        if self.checkpointer is not None and self.checkpointer.latest() is not None:
            self._load_checkpoint()

