"""A model sharded over the whole world (FSDP2), gathered onto one rank in a few collectives.

Before a scale event of such a model, its full state goes to the rank that becomes rank 0 of the new
round (:func:`~elastic_events.rounds.hydration.gather_full_state`). ``DTensor.full_tensor()`` does it
one all-gather per tensor, and every rank receives every full tensor only for all but one to drop it.
:func:`gather_tree` instead packs each rank's local rows of many tensors into one buffer of at most
``bucket_bytes`` and gathers the buffers onto the holder alone (``dist.gather``): the other ranks
send their rows once and receive nothing.

A tensor takes this path when its DTensor is sharded by rows over a 1-D mesh of the whole group
(``Shard(0)``, FSDP2's default), so that every rank can tell every other rank's rows from the global
shape (:func:`row_ranges`, ``torch.chunk``'s split). Any other DTensor is gathered with
``full_tensor()`` as before, after the buckets, in the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from elastic_events.errors import HydrationError
from elastic_events.rounds.transfer import DEFAULT_BUCKET_BYTES, byte_view

__all__ = ["bucket_size", "gather_tree", "plan_gather", "row_ranges", "rows_sharded", "share"]


def row_ranges(rows: int, world: int) -> list[tuple[int, int]]:
    """Rows ``[start, end)`` of each of ``world`` ranks for a dimension of ``rows`` split as ``torch.chunk``
    splits it (and ``Shard(0)`` with it): chunks of ``ceil(rows / world)``, the last ones short or empty."""
    if world < 1 or rows < 0:
        raise ValueError(f"rows must be >= 0 and world >= 1, got {rows} and {world}")
    chunk = -(-rows // world)
    return [(min(rows, r * chunk), min(rows, (r + 1) * chunk)) for r in range(world)]


def rows_sharded(t: Any, world: int) -> bool:
    """Whether ``t`` is a DTensor split by rows over a 1-D mesh of the ``world`` ranks of the default group."""
    if not isinstance(t, DTensor) or t.ndim == 0:
        return False
    mesh = t.device_mesh
    return mesh.ndim == 1 and tuple(t.placements) == (Shard(0),) and mesh.mesh.flatten().tolist() == list(range(world))


@dataclass(frozen=True)
class Slot:
    """Where one tensor's rows sit in each rank's buffer of a bucket: ``offset``, room for the longest share."""

    index: int  # in the list of tensors planned
    offset: int
    row_bytes: int
    rows: tuple[tuple[int, int], ...]  # each rank's rows

    @property
    def room(self) -> int:
        return max(end - start for start, end in self.rows) * self.row_bytes


#: Every tensor's place in a bucket starts at a multiple of this, so that its bytes can be viewed as its dtype.
ALIGN = 16
#: A share of this many bytes or more goes alone (at most a bucket's bound): its rows travel from and into the
#: tensors themselves, with no copy into a bucket, where the shares are equal and the tensors on the host.
ALONE_FROM = 2**20


def plan_gather(shapes: list[tuple[tuple[int, ...], int]], world: int, bucket_bytes: int) -> list[list[Slot]]:
    """Buckets of tensors of ``(shape, element size)``: each bucket's buffer holds one rank's rows of every
    tensor in it, each at a multiple of :data:`ALIGN`, at most ``bucket_bytes``. A tensor whose share is
    :data:`ALONE_FROM` bytes or more (or the bound, if smaller), or larger than the bound, goes alone."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    alone = min(bucket_bytes, ALONE_FROM)
    buckets: list[list[Slot]] = []
    current: list[Slot] = []
    used = 0
    for index, (shape, itemsize) in enumerate(shapes):
        rows = tuple(row_ranges(shape[0], world))
        row_bytes = (torch.Size(shape[1:]).numel()) * itemsize
        slot = Slot(index=index, offset=0, row_bytes=row_bytes, rows=rows)
        if current and (slot.room >= alone or used + slot.room > bucket_bytes):  # buckets keep the tensors' order
            buckets.append(current)
            current, used = [], 0
        if slot.room >= alone:
            buckets.append([slot])
            continue
        current.append(Slot(index=index, offset=used, row_bytes=row_bytes, rows=rows))
        used += -(-slot.room // ALIGN) * ALIGN
    if current:
        buckets.append(current)
    return buckets


def share(flat: torch.Tensor, slot: Slot, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of the tensor whose bytes are ``flat``, as a view of them."""
    start, end = slot.rows[rank]
    return flat[start * slot.row_bytes : end * slot.row_bytes]


def bucket_size(bucket: list[Slot]) -> int:
    """Bytes of one rank's buffer of ``bucket``."""
    return bucket[-1].offset + bucket[-1].room


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


@torch.no_grad()
def _gather_rows(
    tensors: list[DTensor], *, holder: int, device: torch.device, bucket_bytes: int
) -> list[torch.Tensor] | None:
    """The full (CPU) tensors of ``tensors`` on ``holder`` (None elsewhere): one ``dist.gather`` per bucket, of
    buffers on ``device`` (where the group's backend moves bytes)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    keep = rank == holder
    fulls: list[torch.Tensor] = []
    plan = plan_gather([(tuple(t.shape), t.element_size()) for t in tensors], world, bucket_bytes)
    # one buffer per rank for every bucket (its padding is sent and never read)
    largest = max(bucket_size(bucket) for bucket in plan)
    send = torch.empty(largest, dtype=torch.uint8, device=device)
    received = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(world)] if keep else None
    for bucket in plan:
        if len(bucket) == 1:
            full = _gather_alone(tensors[bucket[0].index], bucket[0], send, received, holder=holder, device=device)
            if full is not None:
                fulls.append(full)
            continue
        size = bucket_size(bucket)
        buf = send[:size]
        for slot in bucket:
            part = _checked_local(tensors[slot.index], slot, rank)
            if part.numel():
                buf[slot.offset : slot.offset + part.numel() * part.element_size()].copy_(byte_view(part))
        parts = [r[:size] for r in received] if received is not None else None
        dist.gather(buf, gather_list=parts, dst=holder)
        if parts is None:
            continue
        for slot in bucket:
            t = tensors[slot.index]
            full = torch.empty(t.shape, dtype=t.dtype)
            flat = byte_view(full)
            for r, (start, end) in enumerate(slot.rows):
                n = (end - start) * slot.row_bytes
                flat[start * slot.row_bytes : start * slot.row_bytes + n].copy_(parts[r][slot.offset : slot.offset + n])
            fulls.append(full)
    return fulls if keep else None


def _checked_local(t: DTensor, slot: Slot, rank: int) -> torch.Tensor:
    """``t``'s local rows (contiguous), checked against the split :func:`row_ranges` gives."""
    part = t.to_local()
    start, end = slot.rows[rank]
    if part.shape[0] != end - start:
        raise HydrationError(
            f"rank {rank}: a tensor of global shape {tuple(t.shape)} holds {part.shape[0]} rows here, not the "
            f"{end - start} a split over {len(slot.rows)} ranks gives"
        )
    return part.contiguous()


def _gather_alone(
    t: DTensor,
    slot: Slot,
    send: torch.Tensor,
    received: list[torch.Tensor] | None,
    *,
    holder: int,
    device: torch.device,
) -> torch.Tensor | None:
    """One tensor's rows onto ``holder``: each rank sends its local tensor itself (when it is on ``device``)
    and, on the host, the holder receives straight into the full tensor; a short share, or one elsewhere,
    goes through the buffers."""
    mine = byte_view(_checked_local(t, slot, dist.get_rank()))
    buf = mine
    if mine.numel() != slot.room or mine.device != device:
        buf = send[: slot.room]
        buf[: mine.numel()].copy_(mine)
    if received is None:
        dist.gather(buf, gather_list=None, dst=holder)
        return None
    full = torch.empty(t.shape, dtype=t.dtype)
    flat = byte_view(full)
    direct = [device.type == "cpu" and share(flat, slot, r).numel() == slot.room for r in range(len(slot.rows))]
    parts = [share(flat, slot, r) if d else received[r][: slot.room] for r, d in enumerate(direct)]
    dist.gather(buf, gather_list=parts, dst=holder)
    for r, d in enumerate(direct):
        if not d:
            target = share(flat, slot, r)
            target.copy_(parts[r][: target.numel()])
    return full


def gather_tree(
    tree: Any, *, holder: int, device: torch.device | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> Any:
    """``tree`` (a state dict: dicts, lists, tensors, DTensors, other values) with every tensor full and on the
    CPU, on ``holder``; None on the other ranks. Every rank of the default group calls it with a tree of the
    same structure; ``device`` is where its backend moves bytes (default: the first local tensor's)."""
    world = dist.get_world_size()
    keep = dist.get_rank() == holder
    rows = [t for t in _leaves(tree) if rows_sharded(t, world)]
    full_of: dict[int, torch.Tensor] = {}
    if rows:
        via = device if device is not None else rows[0].to_local().device
        gathered = _gather_rows(rows, holder=holder, device=via, bucket_bytes=bucket_bytes)
        full_of = dict(zip(map(id, rows), gathered or []))

    def build(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: build(v) for k, v in node.items()}
        if isinstance(node, list):
            return [build(v) for v in node]
        if isinstance(node, DTensor):
            if rows_sharded(node, world):
                return full_of.get(id(node))
            full = node.full_tensor()  # another layout: one all-gather, in the same order on every rank
            return full.cpu() if keep else None
        if isinstance(node, torch.Tensor):
            return node.detach().cpu().clone() if keep else None
        return node

    result = build(tree)
    return result if keep else None
