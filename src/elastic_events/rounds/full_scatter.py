"""A full state on one rank, split by rows onto a model sharded over the new world (FSDP2), in a few collectives.

At a scale event of a model sharded over the whole world, and after a repair that put the state back
together, rank 0 holds the full state (:class:`~elastic_events.rounds.hydration.FullState`) and every
rank has built its model and optimizer on the new mesh. DCP's ``set_model_state_dict`` /
``set_optimizer_state_dict`` with ``broadcast_from_rank0`` broadcast every full tensor to every rank,
one collective per tensor, and first run one optimizer step on zero gradients to create the state
they then overwrite. :func:`scatter_full_state` sends each rank only its rows, packed in buckets of
at most ``bucket_bytes`` per rank (one ``dist.scatter`` each); the other tensors (buffers, step
counts) travel whole with :func:`~elastic_events.rounds.transfer.broadcast_tensors`; then the model
takes its shards as a sharded state dict and the optimizer its state by parameter name
(``Optimizer.load_state_dict`` matches saved and live parameters by position within each group).

It applies when every DTensor of the model is split by rows over a 1-D mesh of the whole group
(:func:`~elastic_events.rounds.full_gather.rows_sharded`), the optimizer's groups name the model's
parameters in the order of the saved groups, and every optimizer state tensor has its parameter's
shape or none; otherwise it returns False having sent only the state's outline, and the caller
loads the state with DCP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from elastic_events.rounds.full_gather import bucket_size, plan_gather, rows_sharded, share
from elastic_events.rounds.hydration import FullState, TensorSpec, split_tensors
from elastic_events.rounds.transfer import broadcast_tensors, byte_view

__all__ = ["scatter_full_state"]

#: Name prefixes that wrappers add to a parameter's name and a state dict leaves out (as DCP does).
WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def state_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@dataclass(frozen=True)
class Split:
    """A tensor of the outline that travels by rows: its spec and the live DTensor whose layout it takes."""

    spec: TensorSpec
    like: DTensor


def _outline(full: FullState | None, src: int) -> Any:
    """Rank ``src``'s full state with every tensor replaced by its spec, on every rank; its tensors on ``src``."""
    outline, tensors = split_tensors({"model": full.model, "optimizer": full.optimizer}) if full else (None, [])
    box = [outline]
    dist.broadcast_object_list(box, src=src)
    return box[0], tensors


def _plan(
    outline: Any, live: dict[str, Any], optimizer: torch.optim.Optimizer | None, names: dict[int, str], world: int
) -> tuple[list[Split], list[Split], list[TensorSpec]] | None:
    """The model's rows, the optimizer's rows and the whole tensors of ``outline``, or None when the rows path
    does not apply (the same answer on every rank: it reads only the outline and the model's structure)."""
    if outline is None:  # rank src holds no state: nothing to load by rows
        return None
    model_out, optim_out = outline["model"], outline["optimizer"]
    if list(model_out) != list(live) or any(
        isinstance(t, DTensor) and not rows_sharded(t, world) for t in live.values()
    ):
        return None
    model_rows: list[Split] = []
    whole: list[TensorSpec] = []
    for name, spec in model_out.items():
        t = live[name]
        if not isinstance(spec, TensorSpec) or spec.shape != tuple(t.shape) or spec.dtype != t.dtype:
            return None
        if isinstance(t, DTensor):
            model_rows.append(Split(spec, t))
        else:
            whole.append(spec)
    optim_rows: list[Split] = []
    if optimizer is None:
        return (model_rows, optim_rows, whole) if not optim_out else None
    groups = [[names.get(id(p)) for p in g["params"]] for g in optimizer.param_groups]
    if groups != [g.get("params") for g in optim_out.get("param_groups", [])]:
        return None
    for name, entries in optim_out.get("state", {}).items():
        param = live.get(name)
        if param is None or not isinstance(entries, dict):
            return None
        for spec in entries.values():
            if not isinstance(spec, TensorSpec) or not spec.shape:
                if isinstance(spec, TensorSpec):
                    whole.append(spec)
                continue
            if spec.shape != tuple(param.shape):
                return None  # a state of another shape (e.g. factored): its layout is not the parameter's
            if isinstance(param, DTensor):
                optim_rows.append(Split(spec, param))
            else:
                whole.append(spec)
    return model_rows, optim_rows, whole


def _scatter_rows(
    splits: list[Split], tensors: list[torch.Tensor], *, src: int, device: torch.device, bucket_bytes: int
) -> dict[int, DTensor]:
    """Each rank's rows of ``splits`` (full tensors on ``src``), as DTensors laid out like their live ones."""
    rank, world = dist.get_rank(), dist.get_world_size()
    made: dict[int, DTensor] = {}
    shapes = [(s.spec.shape, torch.empty((), dtype=s.spec.dtype).element_size()) for s in splits]
    plan = plan_gather(shapes, world, bucket_bytes)
    largest = max((bucket_size(bucket) for bucket in plan), default=0)
    # src packs every bucket in the same buffers (their padding is sent and never read); each rank's
    # buffer of a bucket is its own: the rows loaded stay in it
    packed = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(world)] if rank == src else None
    for bucket in plan:
        size = bucket_size(bucket)
        out = torch.empty(size, dtype=torch.uint8, device=device)
        parts = None
        if packed is not None:
            parts = [p[:size] for p in packed]
            for slot in bucket:
                flat = byte_view(tensors[splits[slot.index].spec.index].contiguous())
                for r in range(world):
                    rows = share(flat, slot, r)
                    if len(bucket) == 1 and rows.numel() == size and flat.device == out.device:
                        parts[r] = rows  # a tensor alone: its rows are sent from where they are
                    else:
                        parts[r][slot.offset : slot.offset + rows.numel()].copy_(rows)
        dist.scatter(out, scatter_list=parts, src=src)
        for slot in bucket:
            split = splits[slot.index]
            start, end = slot.rows[rank]
            shape = (end - start, *split.spec.shape[1:])
            local = out[slot.offset : slot.offset + (end - start) * slot.row_bytes].view(split.spec.dtype).view(shape)
            like = split.like
            home = like.to_local().device  # e.g. the host, for a model whose shards are offloaded there
            if local.device != home:
                local = local.to(home)
            made[split.spec.index] = DTensor.from_local(
                local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
            )
    return made


def _fill(outline: Any, values: dict[int, torch.Tensor]) -> Any:
    if isinstance(outline, TensorSpec):
        return values[outline.index]
    if isinstance(outline, dict):
        return {k: _fill(v, values) for k, v in outline.items()}
    if isinstance(outline, (list, tuple)):
        return type(outline)(_fill(v, values) for v in outline)
    return outline


@torch.no_grad()
def scatter_full_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    full: FullState | None,
    *,
    src: int,
    device: torch.device,
    bucket_bytes: int,
) -> bool:
    """Load ``full`` (held by global rank ``src``; None elsewhere) into every rank's sharded ``model`` and
    ``optimizer``. False, on every rank, when the rows path does not apply (see the module)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    world = dist.get_world_size()
    outline, tensors = _outline(full, src)
    live = get_model_state_dict(model)
    names = {id(p): state_name(n) for n, p in model.named_parameters()}
    plan = _plan(outline, live, optimizer, names, world)
    if plan is None:
        return False
    model_rows, optim_rows, whole = plan
    values: dict[int, torch.Tensor] = {}
    if whole:
        if dist.get_rank() == src:  # copies: an optimizer step updates its step counts in place
            received = [tensors[spec.index].clone() for spec in whole]
        else:
            received = [
                torch.empty(spec.shape, dtype=spec.dtype, device=device if spec.on_accelerator else "cpu")
                for spec in whole
            ]
        broadcast_tensors(received, src=src, device=device, bucket_bytes=bucket_bytes)
        values.update((spec.index, t) for spec, t in zip(whole, received))
    # the model's rows are copied into its parameters and their buckets freed; the optimizer keeps its buckets
    values.update(_scatter_rows(model_rows, tensors, src=src, device=device, bucket_bytes=bucket_bytes))
    set_model_state_dict(model, _fill(outline["model"], values))
    for spec in (s.spec for s in model_rows):
        del values[spec.index]
    if optimizer is not None:
        values.update(_scatter_rows(optim_rows, tensors, src=src, device=device, bucket_bytes=bucket_bytes))
        optimizer.load_state_dict(_fill(outline["optimizer"], values))
    return True
