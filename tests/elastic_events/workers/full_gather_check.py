"""A full-state gather check on one rank (run by ``full_state_check.py``): an FSDP2 model and AdamW over the
whole world, gathered onto one rank.

Shapes split unevenly over 3 and 4 ranks, one split into empty shares, and one module sharded by columns
(``Shard(1)``: not split by rows, so gathered one tensor at a time). The holder (the last rank) compares
:func:`gather_full_state`'s tensors with ``full_tensor()``'s of the same state, bit for bit; the other ranks
say whether they were handed nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from elastic_events.rounds.full_gather import rows_sharded
from elastic_events.rounds.hydration import gather_full_state


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 7),  # weight 7 x 6: rows 3+3+1 over 3 ranks, 2+2+2+1 over 4
        torch.nn.Tanh(),
        torch.nn.Linear(7, 2),  # weight 2 x 7: empty shares over 3 and 4 ranks
        torch.nn.Linear(2, 12),
        torch.nn.Linear(12, 8),  # its weight sharded by columns below (FSDP2 splits columns evenly only)
    )
    model.register_buffer("scale", torch.tensor([1.5, 0.5, 2.0, 1.0, 0.25, 3.0, 1.0, 0.5]))
    fully_shard(model[0])
    fully_shard(model[4], shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else Shard(0))
    return fully_shard(model)


def reference(tree: Any, keep: bool) -> Any:
    """Every DTensor's ``full_tensor()`` (one all-gather each), in order; CPU copies kept if ``keep``."""
    if isinstance(tree, DTensor):
        full = tree.full_tensor()
        return full.cpu() if keep else None
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().clone() if keep else None
    if isinstance(tree, dict):
        return {k: reference(v, keep) for k, v in tree.items()}
    if isinstance(tree, list):
        return [reference(v, keep) for v in tree]
    return tree


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def check(rank: int, world: int, bucket: int) -> dict[str, Any]:
    """Gather onto the last rank; its verdicts, or (the others) whether they were handed nothing."""
    holder = world - 1
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        (model(x) * model.scale).square().sum().backward()
        opt.step()
        opt.zero_grad()
    by_rows = sum(rows_sharded(t, world) for t in get_model_state_dict(model).values())
    got = gather_full_state(model, opt, holder=holder, bucket_bytes=bucket)
    keep = rank == holder
    want_model = reference(get_model_state_dict(model), keep)
    want_optim = reference(get_optimizer_state_dict(model, opt), keep)
    result: dict[str, Any] = {"rank": rank, "by_rows": by_rows}
    if keep:
        result["model_same"] = same(got.model, want_model)
        result["optimizer_same"] = same(got.optimizer, want_optim)
        result["tensors"] = sum(isinstance(v, torch.Tensor) for v in got.model.values())
        result["moments"] = sorted({k for s in got.optimizer["state"].values() for k in s})
    else:
        result["nothing"] = got is None
    return result
