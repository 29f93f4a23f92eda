"""Constant global batch at any world size.

The job trains on a fixed number of samples per optimizer step (``global_batch``)
whatever the current data-parallel world size. :func:`plan_global_batch` decides,
for the current world, how many samples each rank takes of every global batch and
how those samples are cut into micro-batches (gradient accumulation):

* every rank takes ``floor(global / world)`` or ``ceil(global / world)`` samples;
  the first ``global % world`` ranks take the larger share;
* a rank's samples are cut into ``ceil(samples / micro_batch)`` micro-batches whose
  sizes differ by at most one (larger first), so none exceeds ``micro_batch``.

E.g. 128 samples over 24 ranks with ``micro_batch=5``: ranks 0-7 take 6 samples as
micro-batches ``[3, 3]``, ranks 8-23 take 5 samples as ``[5]``. Ranks may run a
different number of micro-batches per step; DDP tolerates that as long as each
rank runs exactly one synchronised backward per step (use ``model.no_sync()`` for
the others).

Loss normalisation. The gradient of a step must be the gradient of the mean loss
over exactly the global batch, however it was split. With ``N`` the number of
items (samples, or tokens) in the global batch, ``W`` the world size and ``n`` the
items in one micro-batch whose loss ``L`` is the *mean* over its ``n`` items::

    (L * loss_scale(n, N, world_size=W)).backward()      # scale = n * W / N

Each rank thereby contributes ``sum(loss_i) / N`` and DDP, which *averages*
gradients over the ``W`` ranks, would divide that by ``W``; the factor ``W``
(:func:`global_mean_loss_factor`) undoes the averaging. After the all-reduce every
rank holds ``grad(sum over the global batch of loss_i / N)``. Pass
``grad_averaged=False`` when gradients are summed (e.g. a custom comm hook). For
token-level losses ``N`` is the job-wide token count of the step, which
:func:`global_token_count` computes with a single scalar all-reduce.

Training-loop pattern (see :mod:`elastic_events.data.sampler` for the data side)::

    for step in sampler.steps(loader):                # one optimizer step
        sizes = step.plan.micro_batches()
        for i, (mb, n) in enumerate(zip(step.micro_batches, sizes)):
            ctx = model.no_sync() if i < len(sizes) - 1 else contextlib.nullcontext()
            with ctx:
                loss = model(mb)                      # mean over the n samples
                (loss * loss_scale(n, step.global_count, world_size=W)).backward()
        optimizer.step(); optimizer.zero_grad()
        sampler.mark_step()

Deterministic reduction. Floating-point addition is not associative: an all-reduce
sums the ranks' gradients in an order that depends on the world size, so runs at two
sizes (or one run across a resize) differ in the last bits, and training amplifies
that. :func:`sum_in_batch_order` instead sums one value per sample (e.g. each
sample's gradients) along a binary tree fixed by the batch positions, whatever rank
holds them: the same additions of the same values at every world size, so the sum
has the same bits as one process adding the same values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = [
    "BatchPlan",
    "BatchPlanError",
    "global_mean_loss_factor",
    "global_token_count",
    "loss_scale",
    "max_world_size",
    "plan_global_batch",
    "sum_in_batch_order",
]


class BatchPlanError(ValueError):
    """A global batch cannot be planned with the given sizes."""


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BatchPlanError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise BatchPlanError(f"{name} must be positive, got {value}")


def _split_evenly(total: int, parts: int) -> tuple[int, ...]:
    """``total`` cut into ``parts`` integers that differ by at most one, larger first."""
    base, extra = divmod(total, parts)
    return tuple(base + 1 if i < extra else base for i in range(parts))


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """How one global batch is split over the ranks of the current world.

    ``samples_per_rank[r]`` samples starting at ``rank_offsets[r]`` of the global
    batch belong to rank ``r``. ``rank`` is the caller's own rank (optional); the
    per-rank methods default to it. ``allow_idle_ranks`` permits more ranks than
    samples (some ranks then take none); it is meant for the last, partial global
    batch of an epoch.
    """

    global_batch: int
    micro_batch: int
    world_size: int
    rank: int | None = None
    allow_idle_ranks: bool = False
    samples_per_rank: tuple[int, ...] = field(init=False)
    rank_offsets: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        _check_positive("global_batch", self.global_batch)
        _check_positive("micro_batch", self.micro_batch)
        _check_positive("world_size", self.world_size)
        if self.world_size > self.global_batch and not self.allow_idle_ranks:
            raise BatchPlanError(
                f"world_size={self.world_size} exceeds global_batch={self.global_batch}: every rank needs "
                f"at least one sample per step (at most {max_world_size(self.global_batch)} ranks)"
            )
        if self.rank is not None and (
            isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size
        ):
            raise BatchPlanError(f"rank must be in [0, world_size={self.world_size}), got {self.rank!r}")
        samples = _split_evenly(self.global_batch, self.world_size)
        offsets, start = [], 0
        for count in samples:
            offsets.append(start)
            start += count
        object.__setattr__(self, "samples_per_rank", samples)
        object.__setattr__(self, "rank_offsets", tuple(offsets))

    def _rank(self, rank: int | None) -> int:
        if rank is None:
            if self.rank is None:
                raise BatchPlanError("rank is required: this plan was made without a rank")
            return self.rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise BatchPlanError(f"rank must be in [0, world_size={self.world_size}), got {rank!r}")
        return rank

    def local_samples(self, rank: int | None = None) -> int:
        """Number of samples of the global batch that ``rank`` trains on."""
        return self.samples_per_rank[self._rank(rank)]

    def rank_slice(self, rank: int | None = None) -> slice:
        """Positions of ``rank``'s samples within the global batch."""
        r = self._rank(rank)
        return slice(self.rank_offsets[r], self.rank_offsets[r] + self.samples_per_rank[r])

    def micro_batches(self, rank: int | None = None) -> list[int]:
        """Sizes of ``rank``'s micro-batches, in order (empty for an idle rank)."""
        samples = self.samples_per_rank[self._rank(rank)]
        if samples == 0:
            return []
        return list(_split_evenly(samples, -(-samples // self.micro_batch)))

    def accumulation_steps(self, rank: int | None = None) -> int:
        """Forward/backward passes ``rank`` runs per optimizer step."""
        samples = self.samples_per_rank[self._rank(rank)]
        return -(-samples // self.micro_batch)

    @property
    def max_accumulation_steps(self) -> int:
        """Passes of the slowest rank: the step time is bound by it."""
        return -(-self.samples_per_rank[0] // self.micro_batch)

    @property
    def is_even(self) -> bool:
        """True when every rank takes the same number of samples."""
        return self.global_batch % self.world_size == 0


def plan_global_batch(
    *,
    global_batch: int,
    micro_batch: int,
    world_size: int,
    rank: int | None = None,
    allow_idle_ranks: bool = False,
) -> BatchPlan:
    """Plan one global batch of ``global_batch`` samples over ``world_size`` ranks.

    Raises :class:`BatchPlanError` for non-positive sizes, a rank outside the world,
    or more ranks than samples (some rank would have nothing to train on) unless
    ``allow_idle_ranks`` (used for the last, partial batch of an epoch).
    """
    return BatchPlan(
        global_batch=global_batch,
        micro_batch=micro_batch,
        world_size=world_size,
        rank=rank,
        allow_idle_ranks=allow_idle_ranks,
    )


def max_world_size(global_batch: int) -> int:
    """Largest data-parallel world that can train on ``global_batch`` samples per step."""
    _check_positive("global_batch", global_batch)
    return global_batch


def global_mean_loss_factor(world_size: int, *, grad_averaged: bool = True) -> float:
    """Multiplier undoing the gradient reduction's averaging over ``world_size`` ranks.

    ``world_size`` when gradients are averaged (DDP, FSDP defaults), 1 when summed.
    """
    _check_positive("world_size", world_size)
    return float(world_size) if grad_averaged else 1.0


def loss_scale(local_count: int, global_count: int, *, world_size: int, grad_averaged: bool = True) -> float:
    """Factor for a loss that is the mean over ``local_count`` items on this rank.

    Multiplying each micro-batch's mean loss by this factor before ``backward()``
    makes the reduced gradient the gradient of the mean over the ``global_count``
    items of the whole global batch (see the module docstring). For a loss that is
    already a *sum* over its items, use ``local_count=1``.
    """
    if isinstance(local_count, bool) or not isinstance(local_count, int) or local_count < 0:
        raise BatchPlanError(f"local_count must be a non-negative int, got {local_count!r}")
    _check_positive("global_count", global_count)
    if local_count > global_count:
        raise BatchPlanError(f"local_count={local_count} exceeds global_count={global_count}")
    return local_count * global_mean_loss_factor(world_size, grad_averaged=grad_averaged) / global_count


def global_token_count(
    local_count: int,
    *,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> int:
    """Sum of ``local_count`` over the ranks of ``group``: one scalar all-reduce.

    Returns ``local_count`` unchanged when torch.distributed is not initialised
    (single process). ``device`` defaults to the current CUDA device for NCCL and
    to the CPU otherwise. Every rank of the group must call it at the same step.
    """
    if isinstance(local_count, bool) or not isinstance(local_count, int) or local_count < 0:
        raise BatchPlanError(f"local_count must be a non-negative int, got {local_count!r}")
    if not (dist.is_available() and dist.is_initialized()):
        return local_count
    if device is None:
        backend = str(dist.get_backend(group)).lower()
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    count = torch.tensor([local_count], dtype=torch.int64, device=device)
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return int(count.item())


def sum_in_batch_order(
    samples: Sequence[Sequence[torch.Tensor]],
    plan: BatchPlan,
    *,
    like: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None = None,
) -> list[torch.Tensor]:
    """The sum of the global batch's per-sample values along a binary tree fixed by batch positions: the same bits
    at every world size.

    ``samples`` holds one value per sample of this rank's share (``plan.rank_slice()`` of the global batch), in
    order; a value is a list of tensors shaped like ``like`` (e.g. one sample's gradients, ``like`` the parameters).
    They are consumed (summed in place). The tree is pairwise summation over positions ``0 .. 2**k - 1``
    (positions past the batch are absent): each node is its left child plus its right child. A rank sums the nodes
    inside its contiguous share (one node when the share is an aligned power of two, at most ``2 log2(global_batch)``),
    those partial sums are all-gathered as flat vectors, and every rank adds them up the rest of the tree. Each node is
    the same additions of the same values whichever rank computes it, so the result equals one process summing all
    values (torch.distributed not initialised, ``plan.world_size`` 1) bit for bit. Every rank of ``group`` must call it
    at the same step.
    """
    if len(samples) != plan.local_samples():
        raise BatchPlanError(
            f"{len(samples)} sample values for the {plan.local_samples()} samples of this rank's share"
        )
    for value in samples:
        if [t.shape for t in value] != [t.shape for t in like]:
            raise BatchPlanError("every sample's value must be tensors shaped like `like`")
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    if world != plan.world_size:
        raise BatchPlanError(f"the plan is for {plan.world_size} ranks, the group has {world}")
    size, count = 1 << (plan.global_batch - 1).bit_length(), plan.global_batch
    rank = plan._rank(None)
    mine = plan.rank_slice(rank)
    leaves = {(mine.start + i, mine.start + i + 1): list(value) for i, value in enumerate(samples)}
    if world == 1:
        return _tree_node(0, size, leaves, count)
    shares = [_nodes_inside(s.start, s.stop, 0, size) for s in map(plan.rank_slice, range(world))]
    partial = [_tree_node(lo, hi, leaves, count) for lo, hi in shares[rank]]
    width, numel = max(len(nodes) for nodes in shares), sum(t.numel() for t in like)
    padded = like[0].new_zeros((width, numel))
    for i, value in enumerate(partial):
        torch.cat([t.reshape(-1) for t in value], out=padded[i])
    gathered = like[0].new_empty((world * width, numel))
    dist.all_gather_into_tensor(gathered, padded, group=group)
    known = {
        node: _unflatten(gathered[r * width + i], like)
        for r, nodes in enumerate(shares)
        for i, node in enumerate(nodes)
    }
    return _tree_node(0, size, known, count)


def _unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    views, offset = [], 0
    for t in like:
        views.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return views


def _nodes_inside(start: int, stop: int, lo: int, hi: int) -> list[tuple[int, int]]:
    """The largest tree nodes ``[lo', hi')`` under ``[lo, hi)`` that lie inside ``[start, stop)``, left to right."""
    if stop <= lo or hi <= start:
        return []
    if start <= lo and hi <= stop:
        return [(lo, hi)]
    mid = (lo + hi) // 2
    return _nodes_inside(start, stop, lo, mid) + _nodes_inside(start, stop, mid, hi)


def _tree_node(lo: int, hi: int, known: dict[tuple[int, int], list[torch.Tensor]], count: int) -> list[torch.Tensor]:
    """Node ``[lo, hi)``'s sum from the ``known`` nodes below it (summed in place); positions from ``count`` on
    are absent, so a node must start before ``count``."""
    if lo >= count:
        raise BatchPlanError(f"tree node [{lo}, {hi}) lies past the {count} positions of the batch")
    if (lo, hi) in known:
        return known[(lo, hi)]
    if hi - lo == 1:
        raise BatchPlanError(f"batch position {lo} has no value")
    mid = (lo + hi) // 2
    left = _tree_node(lo, mid, known, count)
    if mid < count:  # a right half past the batch adds nothing
        torch._foreach_add_(left, _tree_node(mid, hi, known, count))
    return left
