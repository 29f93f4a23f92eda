"""Putting a sharded model back together from the in-memory snapshots of a broken round.

After a failure every rank of the repaired round reports what it can give of the broken
round's state (:class:`SnapshotReport`: its live state's step, the copies it holds), and
:func:`plan_restore` (pure) picks the newest step at which every shard can be had, and from
whom. No rank rolls back to a step another lacks; without such a step the checkpoint is the
fallback. Then, in :mod:`elastic_events.rounds.joining`:

* **Same world size** (a crashed rank replaced, a lost node refilled by a standby): the mesh
  and every shard's place on it are those of the broken round, so owner ``r``'s piece goes
  to new rank ``r`` straight from whoever has it and is loaded into the fresh model's local
  shards (:func:`load_local_state`): one piece moves per rank at most, nothing is gathered.
* **Another world size**: every piece goes to the new rank 0, which assembles the full state
  (:func:`assemble`) and re-shards it onto the new mesh.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from elastic_events.rounds.snapshot import Entry, Piece, SnapshotError, group_names

__all__ = ["RestorePlan", "SnapshotReport", "assemble", "load_local_state", "local_tensors", "plan_restore"]


@dataclass(frozen=True, kw_only=True)
class SnapshotReport:
    """What a rank of a repaired round can give of the broken round's state."""

    round: int  # the broken round
    world_size: int  # its size
    rank: int  # this rank's rank in it (-1: not in it)
    live_step: int  # the step of its live state (-1: none)
    replicas: tuple[tuple[int, int], ...] = ()  # (owner, step) of each complete copy it holds


@dataclass(frozen=True, kw_only=True)
class RestorePlan:
    round: int
    world_size: int
    step: int
    sources: tuple[tuple[int, bool], ...]  # per rank of the broken round: (new rank that sends it, from its live state)
    furthest: int  # the furthest step a survivor had committed (step < furthest: steps are redone)


def plan_restore(reports: dict[int, SnapshotReport]) -> RestorePlan | None:
    """The newest step at which every rank of the broken round's state can be had, and from whom.

    ``reports`` maps each new rank to its report. A survivor's live state is preferred to a
    copy (nothing to move from a slot); among copies, the lowest new rank. None: some rank's
    state exists at no common step (the checkpoint is the fallback).
    """
    if not reports:
        return None
    broken = max(r.round for r in reports.values())
    mine = {new: r for new, r in sorted(reports.items()) if r.round == broken}
    world = max(r.world_size for r in mine.values())
    have: list[dict[int, tuple[int, bool]]] = [{} for _ in range(world)]
    for new, r in mine.items():
        if 0 <= r.rank < world and r.live_step >= 0:
            have[r.rank][r.live_step] = (new, True)
    for new, r in mine.items():
        for owner, step in r.replicas:
            if 0 <= owner < world:
                have[owner].setdefault(step, (new, False))
    common = set(have[0])
    for h in have[1:]:
        common &= set(h)
    if not common:
        return None
    step = max(common)
    furthest = max((r.live_step for r in mine.values()), default=-1)
    return RestorePlan(
        round=broken, world_size=world, step=step, sources=tuple(h[step] for h in have), furthest=max(furthest, step)
    )


def assemble(pieces: Iterator[Piece]) -> tuple[dict[str, torch.Tensor], dict[str, Any], Piece]:
    """Full tensors from every rank's piece, in rank order: the model and optimizer state dicts
    in the form of DCP's ``full_state_dict`` (what :func:`~elastic_events.rounds.hydration.gather_full_state`
    makes), and the first piece (its small state and param groups are everyone's)."""
    full: dict[tuple[str, ...], torch.Tensor] = {}
    first: Piece | None = None
    for piece in pieces:
        first = first or piece
        for entry, local in zip(piece.layout.entries, local_tensors(piece), strict=True):
            if entry.shard_dim is None:
                if entry.key not in full:
                    full[entry.key] = local.detach().cpu().clone()
                continue
            target = full.get(entry.key)
            if target is None:
                target = full[entry.key] = torch.empty(entry.global_shape, dtype=entry.dtype)
            length = entry.local_shape[entry.shard_dim]
            if length:
                target.narrow(entry.shard_dim, entry.offset, length).copy_(local)
    if first is None:
        raise SnapshotError("no snapshot piece to assemble")
    model = {key[1]: t for key, t in full.items() if key[0] == "model"}
    state: dict[str, dict[str, Any]] = {}
    for key, t in full.items():
        if key[0] == "optim":
            state.setdefault(key[1], {})[key[2]] = t
    return model, {"state": state, "param_groups": first.param_groups}, first


def local_tensors(piece: Piece) -> list[torch.Tensor]:
    """Each entry's local tensor, in layout order: a holder's copy is raw bytes, a survivor's live
    tensor has its dtype; both read the same."""
    return [
        tensor.reshape(-1).view(torch.uint8).view(entry.dtype).reshape(entry.local_shape)
        for entry, tensor in zip(piece.layout.entries, piece.tensors, strict=True)
    ]


def load_local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, piece: Piece) -> None:
    """Load ``piece`` into a model freshly sharded on a mesh like the broken round's, and its optimizer.

    Each of the model's tensors takes its local shard as it was at the piece's step; the
    optimizer's state (each entry shaped like its parameter, sharded the same way, or a scalar
    such as Adam's ``step``) and param groups likewise. Raises :class:`SnapshotError` when a
    tensor is missing or its shard's shape or offset on the new mesh is not the piece's (another
    world size, or another rank's piece).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    entries = {e.key: (e, t) for e, t in zip(piece.layout.entries, local_tensors(piece), strict=True)}
    live = get_model_state_dict(model)  # the fresh model's tensors by DCP FQN, DTensors where sharded
    # Into the model's own local shards (the state dict's tensors are views of them): a DTensor ``copy_`` would
    # compute a sharding propagation per shape on a new mesh, 0.24 s of a join's 0.67 s on the tiny model.
    with torch.no_grad():
        for fqn, like in live.items():
            if ("model", fqn) not in entries:
                raise SnapshotError(f"{fqn}: not in rank {piece.owner}'s snapshot of step {piece.step}")
            if not isinstance(like, torch.Tensor):
                raise SnapshotError(f"{fqn}: a {type(like).__name__} in the model's state dict, not a tensor")
            entry, tensor = entries[("model", fqn)]
            _local_of(entry, like).copy_(tensor)
    if optimizer is None:
        return
    state: dict[str, dict[str, Any]] = {}
    for key, (entry, tensor) in entries.items():
        if key[0] == "optim":
            param = live.get(key[1])
            if isinstance(param, torch.Tensor) and entry.global_shape == tuple(param.shape):
                value = _like(entry, tensor, param)
            else:
                value = tensor.clone()
            state.setdefault(key[1], {})[key[2]] = value
    _load_optimizer(model, optimizer, state, piece.param_groups)


def _load_optimizer(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, dict[str, Any]],
    param_groups: list[dict[str, Any]],
) -> None:
    """``optimizer.load_state_dict`` with the parameters named as the snapshot names them.

    Not DCP's ``set_optimizer_state_dict``: on an optimizer without state it first runs a step
    with zero gradients to make one (``_init_optim_state``), which cost most of the load here.
    """
    names = group_names(model, optimizer)
    if [list(g["params"]) for g in param_groups] != names:
        raise SnapshotError(
            f"the optimizer's param groups {names} are not the snapshot's {[g['params'] for g in param_groups]}"
        )
    index = {fqn: i for i, fqn in enumerate(fqn for group in names for fqn in group)}
    groups = [
        {**saved, "params": [index[fqn] for fqn in group]} for saved, group in zip(param_groups, names, strict=True)
    ]
    optimizer.load_state_dict({"state": {index[fqn]: s for fqn, s in state.items()}, "param_groups": groups})


def _local_of(entry: Entry, like: torch.Tensor) -> torch.Tensor:
    """The local tensor of ``like`` (a model's or optimizer's tensor on the new mesh) that ``entry``'s shard
    fills; :class:`SnapshotError` when the new mesh places another shard here."""
    from torch.distributed.tensor import DTensor

    name = ".".join(entry.key[1:])
    if tuple(like.shape) != entry.global_shape:
        raise SnapshotError(f"{name}: shape {tuple(like.shape)} in the model, {entry.global_shape} in the snapshot")
    if not isinstance(like, DTensor):
        return like
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    at = int(offsets[entry.shard_dim]) if entry.shard_dim is not None else 0
    if (tuple(shape), at) != (entry.local_shape, entry.offset):
        raise SnapshotError(
            f"{name}: the new mesh holds {tuple(shape)} at {at} here, the snapshot {entry.local_shape} at "
            f"{entry.offset} (another world size, or another rank's piece)"
        )
    return like.to_local()


def _like(entry: Entry, tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``tensor`` (a local shard) as the model holds ``like``: a DTensor on the same mesh and placements."""
    from torch.distributed.tensor import DTensor

    _local_of(entry, like)
    if not isinstance(like, DTensor):
        return tensor.to(like.device, copy=True)
    return DTensor.from_local(
        tensor.to(like.device, copy=True),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )
