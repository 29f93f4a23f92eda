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
receivers' state is bitwise the sender's. :func:`send_tensors` / :func:`recv_tensors`
move the same way between two ranks (the replicas of :mod:`elastic_events.rounds.snapshot`);
a sender whose tensors are on an accelerator stages each bucket through pinned host
memory on a stream of its own, so the bytes travel over a gloo group.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
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


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat ``uint8`` view of its storage (outside autograd)."""
    return t.detach().reshape(-1).view(torch.uint8)


@dataclass(frozen=True)
class TransferStats:
    nbytes: int
    broadcasts: int
    staging_bytes: int


Post = Callable[[torch.Tensor], "dist.Work | None"]


def _move(
    views: list[torch.Tensor], plan: list[Bucket], staging: torch.Tensor | None, *, sending: bool, post: Post
) -> None:
    """Run ``plan``: ``post`` moves one buffer (a broadcast, a send or a receive) and returns its work.

    In-place slices are queued back to back (no staging to reuse: the backend pipelines
    them); packed buckets go one at a time through ``staging``. A sender's views may be on
    an accelerator only if every bucket is staged (``staging`` on the host, see
    :func:`send_tensors`)."""
    pending = []
    for bucket in plan:
        if bucket.direct and (staging is None or views[bucket.pieces[0].index].device == staging.device):
            piece = bucket.pieces[0]
            pending.append(post(views[piece.index][piece.start : piece.start + piece.length]))
            continue
        if staging is None:  # _staging makes one whenever the plan has a packed bucket
            raise ValueError(f"a packed bucket of {bucket.nbytes} bytes and no staging buffer to pack it in")
        buf = staging[: bucket.nbytes]
        if sending:
            for p in bucket.pieces:
                buf[p.offset : p.offset + p.length].copy_(views[p.index][p.start : p.start + p.length])
        work = post(buf)
        if work is not None:
            work.wait()
        if not sending:
            for p in bucket.pieces:
                views[p.index][p.start : p.start + p.length].copy_(buf[p.offset : p.offset + p.length])
    for work in pending:
        if work is not None:
            work.wait()


def pinned_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` host bytes pinned for copies to and from the GPU, exactly that many, unpinned when freed.

    ``torch.empty(..., pin_memory=True)`` takes them from the caching host allocator, which rounds a
    request up to a power of two and keeps the block once it is freed (an H100 run held 4.06 GB pinned
    for a 2.09 GB snapshot, and kept it across rounds). Without CUDA the bytes are ordinary.
    """
    flat = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes == 0 or not torch.cuda.is_available():
        return flat
    from torch.cuda import _pin_memory_utils

    _pin_memory_utils.pin_memory(flat.data_ptr(), nbytes)
    weakref.finalize(flat, _pin_memory_utils.unpin_memory, flat.data_ptr())
    return flat


def _staging(
    views: list[torch.Tensor], plan: list[Bucket], device: torch.device, *, every: bool
) -> torch.Tensor | None:
    size = max((b.nbytes for b in plan if every or not b.direct), default=0)
    if not size:
        return None
    return torch.empty(size, dtype=torch.uint8, device=device, pin_memory=every and torch.cuda.is_available())


def _stats(views: list[torch.Tensor], plan: list[Bucket], staging: torch.Tensor | None) -> TransferStats:
    return TransferStats(
        nbytes=sum(v.numel() for v in views),
        broadcasts=len(plan),
        staging_bytes=staging.numel() if staging is not None else 0,
    )


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
    work = [
        t.detach() if t.is_contiguous() and t.device == device else t.detach().contiguous().to(device) for t in tensors
    ]
    views = [byte_view(t) for t in work]
    plan = plan_buckets([v.numel() for v in views], bucket_bytes)
    staging = _staging(views, plan, device, every=False)
    _move(
        views, plan, staging, sending=sending, post=lambda buf: dist.broadcast(buf, src=src, group=group, async_op=True)
    )
    if not sending:
        for original, copy in zip(tensors, work):
            if copy is not original and copy.data_ptr() != original.data_ptr():
                original.detach().copy_(copy)
    return _stats(views, plan, staging)


@torch.no_grad()
def send_tensors(
    tensors: Sequence[torch.Tensor],
    *,
    dst: int,
    group: dist.ProcessGroup | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> TransferStats:
    """Send contiguous ``tensors`` to global rank ``dst`` (over a gloo group), which calls :func:`recv_tensors`.

    Host tensors go in place or packed, as in :func:`broadcast_tensors`; if any tensor is
    on an accelerator, every bucket is copied through one pinned host bucket (the caller
    runs this on a stream that is ordered after the writes it must see).
    """
    views = [byte_view(t) for t in tensors]
    plan = plan_buckets([v.numel() for v in views], bucket_bytes)
    staging = _staging(views, plan, torch.device("cpu"), every=any(v.device.type != "cpu" for v in views))
    _move(views, plan, staging, sending=True, post=lambda buf: dist.isend(buf, dst=dst, group=group))
    return _stats(views, plan, staging)


@torch.no_grad()
def recv_tensors(
    tensors: Sequence[torch.Tensor],
    *,
    src: int,
    group: dist.ProcessGroup | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> TransferStats:
    """Receive into contiguous host ``tensors`` what global rank ``src`` sends with :func:`send_tensors`."""
    views = [byte_view(t) for t in tensors]
    plan = plan_buckets([v.numel() for v in views], bucket_bytes)
    staging = _staging(views, plan, torch.device("cpu"), every=False)
    _move(views, plan, staging, sending=False, post=lambda buf: dist.irecv(buf, src=src, group=group))
    return _stats(views, plan, staging)
