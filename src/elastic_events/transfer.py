"""Chunked broadcast of many tensors in bounded memory (the byte mover of peer hydration).

The sender and the receivers hold lists of tensors with the same shapes and dtypes
(the receivers' are preallocated destinations, e.g. a model's own parameters). Both
sides compute the same :func:`plan_buckets` from the byte sizes alone:

* a tensor of 1 MiB or more is broadcast *in place*, in slices of at most one bucket
  of its own bytes: no copy at all;
* smaller tensors are packed into a staging bucket (any mix of dtypes: every tensor
  travels as its raw bytes), broadcast, and copied out: few broadcasts for many
  small tensors.

So a transfer needs at most one bucket of extra memory on either side, and the
receivers' state is bitwise the sender's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 64 * 2**20
PACK_BELOW = 2**20  # larger tensors are broadcast in place: copying them into a bucket costs more than it saves


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, start + length)`` of tensor ``index``, at ``offset`` in its bucket."""

    index: int
    start: int
    length: int
    offset: int


@dataclass(frozen=True)
class Bucket:
    """One broadcast: either a slice of one tensor in place (``direct``) or packed pieces."""

    pieces: tuple[Piece, ...]
    direct: bool

    @property
    def nbytes(self) -> int:
        return sum(p.length for p in self.pieces)


def plan_buckets(sizes: Sequence[int], bucket_bytes: int, pack_below: int | None = None) -> list[Bucket]:
    """How tensors of ``sizes`` bytes travel in broadcasts of at most ``bucket_bytes`` each.

    Tensors of ``pack_below`` bytes or more (default: one bucket, at most 1 MiB) go in
    place; smaller ones are packed, so that many small tensors cost few broadcasts.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    limit = min(bucket_bytes, PACK_BELOW if pack_below is None else pack_below)
    buckets: list[Bucket] = []
    packed: list[Piece] = []
    used = 0
    for index, size in enumerate(sizes):
        if size >= limit:
            for start in range(0, size, bucket_bytes):
                length = min(bucket_bytes, size - start)
                buckets.append(Bucket((Piece(index, start, length, 0),), direct=True))
            continue
        if size == 0:
            continue
        if used + size > bucket_bytes:
            buckets.append(Bucket(tuple(packed), direct=False))
            packed, used = [], 0
        packed.append(Piece(index, 0, size, used))
        used += size
    if packed:
        buckets.append(Bucket(tuple(packed), direct=False))
    return buckets


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@dataclass(frozen=True)
class TransferStats:
    nbytes: int
    broadcasts: int
    staging_bytes: int


@torch.no_grad()
def broadcast_tensors(
    tensors: Sequence[torch.Tensor],
    *,
    src: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> TransferStats:
    """Make every rank's ``tensors`` bitwise equal to global rank ``src``'s.

    Every rank of ``group`` calls it with tensors of the same shapes and dtypes, in
    the same order. ``device`` is where the group's backend moves bytes (CPU for
    gloo, the rank's GPU for NCCL); tensors elsewhere, or not contiguous, travel
    through a contiguous copy on ``device``.
    """
    sending = dist.get_rank() == src
    work = [t.detach() if t.is_contiguous() and t.device == device else t.detach().contiguous().to(device)
            for t in tensors]  # fmt: skip
    views = [_bytes(t) for t in work]
    plan = plan_buckets([v.numel() for v in views], bucket_bytes)
    staging_size = max((b.nbytes for b in plan if not b.direct), default=0)
    staging = torch.empty(staging_size, dtype=torch.uint8, device=device) if staging_size else None
    pending = []  # in-place slices are queued back to back (no staging to reuse): the backend pipelines them
    for bucket in plan:
        if bucket.direct:
            piece = bucket.pieces[0]
            chunk = views[piece.index][piece.start : piece.start + piece.length]
            pending.append(dist.broadcast(chunk, src=src, group=group, async_op=True))
            continue
        buf = staging[: bucket.nbytes]
        if sending:
            for p in bucket.pieces:
                buf[p.offset : p.offset + p.length].copy_(views[p.index])
        dist.broadcast(buf, src=src, group=group)
        if not sending:
            for p in bucket.pieces:
                views[p.index].copy_(buf[p.offset : p.offset + p.length])
    for request in pending:
        request.wait()
    if not sending:
        for original, copy in zip(tensors, work):
            if copy is not original and copy.data_ptr() != original.data_ptr():
                original.detach().copy_(copy)
    return TransferStats(nbytes=sum(v.numel() for v in views), broadcasts=len(plan), staging_bytes=staging_size)
