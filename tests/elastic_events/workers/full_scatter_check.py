"""A full-state scatter check on one rank (run by ``full_state_check.py``): rank 0's full state loaded by rows
into a fresh FSDP2 model and AdamW.

A model trained two steps is gathered onto rank 0; a fresh twin
takes that state with :func:`scatter_full_state`. CASE ``rows``: every parameter split by rows; the twin's
gathered state must be the original's bit for bit, and so after one more step of each. ``columns``: one
weight split by columns; ``reordered``: the twin's optimizer lists its parameters in another order. Both
must be refused (False on every rank) with the twin untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

from elastic_events.rounds.full_scatter import scatter_full_state
from elastic_events.rounds.hydration import gather_full_state


def build(case: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 7),  # rows split unevenly over 3 and 4 ranks
        torch.nn.Tanh(),
        torch.nn.Linear(7, 2),  # empty shares
        torch.nn.Linear(2, 12),
        torch.nn.Linear(12, 8),
    )
    model.register_buffer("scale", torch.arange(8, dtype=torch.float64) / 4)
    fully_shard(model[0])
    if case == "columns":
        fully_shard(model[4], shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else Shard(0))
    return fully_shard(model)


def optimizer(model: torch.nn.Module, case: str) -> tuple[torch.optim.Optimizer, Any]:
    params = list(model.parameters())
    if case == "reordered":
        params.reverse()
    opt = torch.optim.AdamW([{"params": params[:3], "lr": 0.1}, {"params": params[3:], "weight_decay": 0.5}], lr=0.05)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, step: int) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
    (model(x) * model.scale).square().sum().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def check(rank: int, world: int, bucket: int, case: str) -> dict[str, Any]:
    """Rank 0's full state scattered into a fresh twin: whether it loaded and, on rank 0, its verdicts."""
    model = build("rows" if case == "reordered" else case)
    opt, sched = optimizer(model, "rows")
    for step in range(2):
        train(model, opt, sched, step)
    full = gather_full_state(model, opt, holder=0)
    twin = build("rows" if case == "reordered" else case)
    twin_opt, twin_sched = optimizer(twin, case)
    loaded = scatter_full_state(twin, twin_opt, full, src=0, device=torch.device("cpu"), bucket_bytes=bucket)
    result: dict[str, Any] = {"rank": rank, "loaded": loaded, "twin_state": len(twin_opt.state)}
    got = gather_full_state(twin, twin_opt, holder=0) if loaded else None
    if loaded:
        twin_sched.load_state_dict(sched.state_dict())  # the small state, as the round sends it
        train(model, opt, sched, 2)
        train(twin, twin_opt, twin_sched, 2)
        after, twin_after = gather_full_state(model, opt, holder=0), gather_full_state(twin, twin_opt, holder=0)
    if rank == 0 and loaded:
        result["model_same"] = same(got.model, full.model)
        result["optimizer_same"] = same(got.optimizer, full.optimizer)
        result["next_step_same"] = same(twin_after.model, after.model) and same(twin_after.optimizer, after.optimizer)
        result["lrs"] = [g["lr"] for g in twin_opt.param_groups]
    return result
