"""Gradient clipping by the global norm, summed from each rank's local shards: no DTensor op, one scalar all-reduce.

``torch.nn.utils.clip_grad_norm_`` on FSDP2 or HSDP gradients (DTensors) runs DTensor ops: ``_foreach_norm``,
a ``stack``, a ``vector_norm`` and ``_foreach_mul_`` over every gradient. DTensor computes a sharding
propagation for each of them the first time it sees their shapes on a mesh, and a mesh a scale event builds is
new to the process: on the example's tiny model with HSDP on a CPU, the clip was 2.8 s of a 4.7 s first step on
such a mesh (``cProfile``), the rest mostly the optimizer's. :func:`clip_grad_norm_` reads the same
gradients through their local tensors instead:

- a gradient's local piece counts towards the norm on the ranks at coordinate 0 of every mesh dimension it
  is replicated on, and on all ranks of the dimensions it is sharded on, so each element counts once;
- the counted pieces' ``norm_type``-th powers are summed (their maximum for ``inf``) and reduced over the
  mesh in one scalar all-reduce (one per mesh dimension where the mesh is not the whole world);
- every local piece is scaled in place by the clip coefficient, as torch's does.

Plain-tensor gradients beside DTensor ones count on every rank as they are: they are replicated. Where no
gradient is a DTensor (DDP, one process), or they are on several meshes or one is ``Partial``, this is torch's
function.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` in place to a total norm of at most ``max_norm``; returns the total
    norm before clipping, a plain 0-dim tensor (float32, float64 for float64 gradients) on the gradients' device.

    The arguments are ``torch.nn.utils.clip_grad_norm_``'s and mean the same (``foreach`` matters only where
    torch's function runs: the local pieces are always reduced and scaled with ``torch._foreach_*``). Raises
    ``RuntimeError`` when the total norm is not finite and ``error_if_nonfinite`` is set; ``ValueError`` for a
    ``max_norm`` or ``norm_type`` that is not a number > 0.
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"norm_type must be > 0 (or inf), got {norm_type!r}")
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [q.grad for q in params if q.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    sharded = _dtensor_grads(grads)
    if sharded is None:  # no DTensor, several meshes, or a Partial gradient: torch's, DTensor's reductions
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach)
        return _full(norm)
    mesh, pieces = sharded
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    device = pieces[0][0].device if pieces else grads[0].device
    total = _reduced_power(mesh, [t for t, counted in pieces if counted], p, dtype, device)
    plain = [g for g in grads if not _is_dtensor(g)]
    total = _combine(total, _local_power(plain, p, dtype, device), p)
    norm = total if math.isinf(p) else total ** (1.0 / p)
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    _scale([t for t, _ in pieces] + plain, coef)
    return norm


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _dtensor_grads(grads: list[torch.Tensor]) -> tuple[Any, list[tuple[torch.Tensor, bool]]] | None:
    """The one mesh of the DTensor gradients and each one's local tensor with whether it counts on this rank;
    None when none is a DTensor, they span several meshes, or one is ``Partial``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = None
    pieces: list[tuple[torch.Tensor, bool]] = []
    for g in grads:
        if not isinstance(g, DTensor):
            continue
        if mesh is None:
            mesh = g.device_mesh
        elif g.device_mesh != mesh:
            return None
        if not all(isinstance(pl, (Shard, Replicate)) for pl in g.placements):
            return None
        coordinate = mesh.get_coordinate()
        if coordinate is None:  # this rank is not in the mesh: it holds no piece
            continue
        counted = all(c == 0 for c, pl in zip(coordinate, g.placements, strict=True) if isinstance(pl, Replicate))
        pieces.append((g.to_local(), counted))
    return None if mesh is None else (mesh, pieces)


def _local_power(tensors: list[torch.Tensor], p: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The sum of ``|x|^p`` over every element of ``tensors`` (their maximum ``|x|`` for ``inf``), as ``dtype``.
    Empty tensors (a shard past the end of a short dimension) add nothing."""
    tensors = [t for t in tensors if t.numel() > 0]
    if not tensors:
        return torch.zeros((), dtype=dtype, device=device)
    norms = torch.stack([n.to(device=device, dtype=dtype) for n in _foreach_norm(tensors, p)])
    return norms.max() if math.isinf(p) else (norms**p).sum()


def _foreach_norm(tensors: list[torch.Tensor], p: float) -> list[torch.Tensor]:
    by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.device, t.dtype), []).append(t)
    return [n for group in by_key.values() for n in torch._foreach_norm(group, p)]


def _reduced_power(
    mesh: Any, counted: list[torch.Tensor], p: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """:func:`_local_power` of the counted local pieces, reduced over every rank of ``mesh``."""
    import torch.distributed as dist

    local = _local_power(counted, p, dtype, device)
    if mesh.size() == 1:
        return local
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    if mesh.size() == dist.get_world_size():
        dist.all_reduce(local, op=op)
    else:  # over each dimension in turn: every rank of the mesh once
        for dim in range(mesh.ndim):
            dist.all_reduce(local, op=op, group=mesh.get_group(dim))
    return local


def _combine(a: torch.Tensor, b: torch.Tensor, p: float) -> torch.Tensor:
    return torch.maximum(a, b) if math.isinf(p) else a + b


def _scale(tensors: list[torch.Tensor], coef: torch.Tensor) -> None:
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for device, group in by_device.items():
        torch._foreach_mul_(group, coef.to(device))
