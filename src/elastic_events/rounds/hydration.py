"""Peer hydration: newcomers of a round receive the training state from a survivor, never from storage.

Once the new round's group is up, every rank reports what it holds
(:class:`RankReport`: whether it survived the last round with its state, its step,
a structure digest and, for replicated models, a checksum of its parameters), and
:func:`plan_hydration` -- a pure function of the reports -- picks the source or
raises :class:`StateMismatchError` (survivors at different steps, replicas that
differ, models of another shape): state that does not agree is never trained on.

What travels:

* replicated models (plain, DDP): the source streams the parameters, all buffers and
  the optimizer state into the newcomers' own tensors with
  :func:`~elastic_events.rounds.transfer.broadcast_tensors` (bounded buckets), over a
  subgroup of the source and the newcomers;
* sharded models (FSDP2): before the old group is torn down its members gather the
  full state onto the rank that becomes rank 0 of the new round (:func:`gather_full_state`:
  each rank's rows of many tensors in one ``gather``); in the new round every rank rebuilds its model on the
  new mesh and receives only its own rows (:mod:`elastic_events.rounds.full_scatter`; DCP's
  ``broadcast_from_rank0`` for a layout that path does not map);
* HSDP models (FSDP2 on a ``("replicate", "shard")`` mesh): nothing is gathered; each rank keeps
  its local shards and a rank that lacks its shard receives it from a replica that kept it
  (:mod:`elastic_events.rounds.replica_plan`);
* small state (scheduler, sampler position, step, user extras, control-channel step,
  base seed) as one pickled object.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from elastic_events.errors import ElasticTrainingError, HydrationError, StateMismatchError
from elastic_events.rounds.full_gather import gather_tree
from elastic_events.rounds.transfer import DEFAULT_BUCKET_BYTES

if TYPE_CHECKING:
    from elastic_events.rounds.replica_plan import Holding
    from elastic_events.rounds.snapshot_restore import SnapshotReport

__all__ = [
    "HydrationError",
    "HydrationPlan",
    "RankReport",
    "StateMismatchError",
    "collective_failures",
    "plan_from_handoff",
    "plan_hydration",
]


@dataclass(frozen=True, kw_only=True)
class RankReport:
    """What one rank holds when a new round's group has formed."""

    rank: int
    survivor: bool  # trained in the previous round and kept its state
    source_ready: bool  # holds a complete state it can send (a replica, or a gathered full state)
    step: int  # training step (-1 for a newcomer)
    structure: str  # digest of the names, global shapes and dtypes of parameters and buffers
    checksum: str | None  # digest of the parameter values (replicated survivors only)
    sharded: bool | None  # None: not known yet (a newcomer)
    control_step: int = 0  # its count of elastic_event_detected() calls (a repair aligns everyone's on the source's)
    handoff_step: int = (
        -1
    )  # a newcomer: the step of its predecessor's hand-off for this round (elastic_events.rounds.handoff)
    snapshot: SnapshotReport | None = None  # a sharded survivor of a failure: what it holds of the broken round
    failed: bool = False  # a peer failed in its previous round (it came through ElasticTraining.recover)
    holding: Holding | None = None  # an HSDP survivor: the shard it kept (elastic_events.rounds.replica_plan)

    def newest_step(self) -> int:
        """The newest step of the job this rank knows of: its own, a hand-off's, or a snapshot's live state."""
        steps = [self.step, self.handoff_step]
        if self.snapshot is not None:
            steps.append(self.snapshot.live_step)
        if self.holding is not None:
            steps.append(self.holding.step)
        return max(steps)


@dataclass(frozen=True, kw_only=True)
class HydrationPlan:
    source: int | None  # None: no rank holds a complete state (storage is the fallback)
    newcomers: tuple[int, ...]
    survivors: tuple[int, ...]
    sharded: bool
    step: int
    handoff: bool = False  # the source sends the state its predecessor handed off, not a live one


def plan_hydration(
    reports: Sequence[RankReport], *, recovering: bool = False, local_world_size: int = 1
) -> HydrationPlan:
    """Who sends the state to whom; raises :class:`StateMismatchError` when the state disagrees.

    A replicated state is sent by a survivor on the newcomers' node when they are all on one
    (rank // ``local_world_size``): a crashed rank is hydrated by a sibling over the node's own
    links, needing no other node. Otherwise, and for a sharded model (whose full state is on
    rank 0), by the lowest ready rank.

    ``recovering``: the round repairs a failure. A peer died mid-step, so a survivor may have
    committed one step more than another (its collectives completed before the peer's death
    reached the others): the survivors at the furthest step are the state, the others are
    brought to it like newcomers. A sharded model cannot be recovered this way (its shards
    on the dead rank exist nowhere else): its snapshots are (:func:`elastic_events.rounds.snapshot.plan_restore`).
    """
    reports = sorted(reports, key=lambda r: r.rank)
    if recovering:
        furthest = max((r.step for r in reports if r.survivor), default=-1)
        if any(r.survivor and r.sharded for r in reports):
            raise HydrationError(
                "a sharded (FSDP2) model's shards on the failed rank exist nowhere else and no in-memory snapshot "
                "of them was reported (the job restarts from its checkpoint)"
            )
        reports = [
            r
            if not r.survivor or r.step == furthest
            else RankReport(
                rank=r.rank,
                survivor=False,
                source_ready=False,
                step=-1,
                structure=r.structure,
                checksum=None,
                sharded=None,
            )
            for r in reports
        ]
    first = reports[0]
    for r in reports[1:]:
        if r.structure != first.structure:
            raise StateMismatchError(
                f"rank {r.rank}'s model has other parameter names, shapes or dtypes than rank {first.rank}'s: "
                "every rank must build the same model"
            )
    survivors = [r for r in reports if r.survivor]
    newcomers = tuple(r.rank for r in reports if not r.survivor)
    steps = sorted({r.step for r in survivors})
    if len(steps) > 1:
        detail = ", ".join(f"rank {r.rank} at step {r.step}" for r in survivors)
        raise StateMismatchError(f"survivors hold different steps ({detail}): refusing to train on mismatched state")
    modes = {r.sharded for r in survivors}
    if len(modes) > 1:
        raise StateMismatchError("some survivors hold a sharded (FSDP2) model and others a replicated one")
    sharded = bool(modes.pop()) if modes else False
    if not sharded:
        sums = {r.checksum for r in survivors}
        if len(sums) > 1:
            detail = ", ".join(f"rank {r.rank}: {r.checksum}" for r in survivors)
            raise StateMismatchError(f"survivors' model replicas differ at step {steps[0]} ({detail})")
    sources = [r.rank for r in reports if r.source_ready]
    source = None
    if sources:
        source = sources[0] if sharded else _nearest(sources, newcomers, local_world_size)
    return HydrationPlan(
        source=source,
        newcomers=newcomers,
        survivors=tuple(r.rank for r in survivors),
        sharded=sharded,
        step=steps[0] if steps else -1,
    )


def _nearest(sources: list[int], newcomers: tuple[int, ...], local_world_size: int) -> int:
    nodes = {rank // local_world_size for rank in newcomers}
    if len(nodes) == 1:
        node = nodes.pop()
        for source in sources:
            if source // local_world_size == node:
                return source
    return sources[0]


def plan_from_handoff(plan: HydrationPlan, reports: Sequence[RankReport]) -> HydrationPlan:
    """No rank survived with the state: the newest hand-off of a replaced rank is the state, if there is one."""
    holders = [r for r in reports if r.handoff_step >= 0]
    if plan.source is not None or plan.survivors or not holders:
        return plan
    best = max(holders, key=lambda r: (r.handoff_step, -r.rank))
    others = tuple(r.rank for r in sorted(reports, key=lambda r: r.rank) if r.rank != best.rank)
    return HydrationPlan(
        source=best.rank, newcomers=others, survivors=(), sharded=False, step=best.handoff_step, handoff=True
    )


# --------------------------------------------------------------------------- digests


def model_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters, then all buffers (persistent or not), in a fixed order."""
    return [*module.named_parameters(), *module.named_buffers()]


def structure_digest(module: torch.nn.Module) -> str:
    spec = [(name, tuple(t.shape), str(t.dtype)) for name, t in model_tensors(module)]  # DTensor: global shape
    return hashlib.sha256(repr(spec).encode()).hexdigest()[:16]


#: Elements summed at a time by :func:`value_checksum`: its float64 copy of a chunk is at most 32 MiB.
CHECKSUM_CHUNK = 1 << 22


def _chunked_sum(t: torch.Tensor) -> torch.Tensor:
    """``t``'s sum in float64, a chunk at a time: never a float64 copy of the whole tensor (a 4 GB one for
    Llama-3-8B's embedding); torch's ``sum(dtype=float64)`` makes that copy too."""
    flat = t.detach().reshape(-1)
    return torch.stack([c.double().sum() for c in flat.split(CHECKSUM_CHUNK)]).sum()


@torch.no_grad()
def value_checksum(module: torch.nn.Module) -> str:
    """A cheap digest of the parameter values: one float64 sum per tensor (chunk by chunk), one device sync."""
    sums = [_chunked_sum(t) for _, t in model_tensors(module) if t.is_floating_point() and t.numel()]
    if not sums:
        return "empty"
    return hashlib.sha256(torch.stack(sums).cpu().numpy().tobytes()).hexdigest()[:16]


# ------------------------------------------------------------------- optimizer state


@dataclass(frozen=True)
class TensorSpec:
    """A tensor left out of a pickled skeleton; it travels separately."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    on_accelerator: bool


def split_tensors(obj: Any) -> tuple[Any, list[torch.Tensor]]:
    """``obj`` with every tensor replaced by a :class:`TensorSpec`, and the tensors in order."""
    found: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            found.append(x)
            return TensorSpec(len(found) - 1, tuple(x.shape), x.dtype, x.device.type != "cpu")
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(obj), found


def allocate_tensors(skeleton: Any, device: torch.device) -> tuple[Any, list[torch.Tensor]]:
    """The receiving side of :func:`split_tensors`: empty tensors where the specs are."""
    made: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, TensorSpec):
            t = torch.empty(x.shape, dtype=x.dtype, device=device if x.on_accelerator else "cpu")
            made.append(t)
            return t
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    return walk(skeleton), made


# ------------------------------------------------------------------- sharded models


@dataclass
class FullState:
    """A sharded model's full state, held by one rank between two rounds (CPU memory)."""

    model: dict[str, Any] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)


def gather_full_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    holder: int,
    device: torch.device | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> FullState | None:
    """On the old group: every rank takes part, only ``holder`` keeps the full state (CPU tensors), gathered
    a bucket of rows at a time through ``device`` (:func:`~elastic_events.rounds.full_gather.gather_tree`)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_sd = gather_tree(get_model_state_dict(model), holder=holder, device=device, bucket_bytes=bucket_bytes)
    optim_sd = (
        gather_tree(get_optimizer_state_dict(model, optimizer), holder=holder, device=device, bucket_bytes=bucket_bytes)
        if optimizer is not None
        else {}
    )
    return FullState(model=model_sd, optimizer=optim_sd) if dist.get_rank() == holder else None


def nonpersistent_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    """Buffers a state dict leaves out (e.g. rotary tables): they travel with the model tensors."""
    persistent = set(module.state_dict().keys())
    return [b for name, b in module.named_buffers() if name not in persistent]


@contextlib.contextmanager
def collective_failures(
    error: type[Exception], *, rank: int, round: int, world_size: int, timeout_s: float
) -> Iterator[None]:
    """Turn what gloo/NCCL raise while a round's ranks are brought to one state (a ``RuntimeError`` for a
    dead peer or a timeout) into ``error``, naming the rank, the round and the limit; our own errors pass."""
    try:
        yield
    except (ElasticTrainingError, error):
        raise
    except RuntimeError as exc:
        raise error(
            f"rank {rank}: bringing round {round}'s {world_size} ranks to one state failed or timed out (limit {timeout_s:.0f}s): {exc}"
        ) from exc
