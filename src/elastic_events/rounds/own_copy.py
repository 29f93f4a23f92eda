"""HSDP's one step back: a copy of this rank's local state as it was before its last optimizer step.

With two replicas or more no snapshot is sent anywhere: another replica holds every shard. But a rank
that dies inside a step's cross-replica reduction can leave the step committed on some shard indices
and not on others. FSDP2 reduces each shard index's gradients among that index's ranks only, so the
ranks of shard 0 may complete the reduction and apply step ``s + 1`` while the only surviving rank of
shard 1 (whose replica peer died) stays at ``s``. No rank then holds every shard at one step.

:class:`OwnCopy` closes that gap. At the end of step ``s`` (``elastic_event_detected()``, after anything
the script changed after ``optimizer.step()``) it starts copying the local state into a buffer of its
own (:meth:`OwnCopy.start`); in the optimizer's pre-step hook of step ``s + 1``, with that step's
collectives completed (:mod:`.commit`) and before anything is applied, the copy is sealed as the state
at ``s`` (:meth:`OwnCopy.seal`: the small state, the sampler's included, is taken then). A rank that
applied ``s + 1`` still holds ``s`` until its next pre-step hook. It cannot reach that hook, because its
next step's collectives need the ranks that failed. So after any failure every shard index is held at
the newer step or at the one before, by some surviving rank
(:func:`~elastic_events.rounds.replica_plan.plan_replicas` picks the newest such step, and a rank ahead
of it loads its copy: one step is trained again).

Two buffers take turns: the copy of ``s`` is written into the one not holding the sealed copy of
``s - 1``, which stays whole until the seal. A rank of shard 0 that applied ``s`` while shard 1 did
not must still hold ``s - 1``, and it is between those two hooks when it blocks in ``s + 1``.

Cost: host memory of 2x the local state; nothing crosses the network. On a GPU the copy runs on a
stream of its own, device to pinned host memory, beside the next step's forward and backward (they
only read what is copied; the model's buffers, which a forward may write, are copied on the current
stream before it); only the optimizer's kernels of ``s + 1`` wait for it. Without a GPU it is a
plain copy after each step.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence, Set

import torch

from elastic_events.rounds.snapshot import Layout, Piece
from elastic_events.rounds.transfer import byte_view, pinned_empty

__all__ = ["OwnCopy"]


@dataclasses.dataclass(eq=False)
class _Buffer:
    """One of the two buffers: its bytes, and the copy in it once started (complete once ``done`` has)."""

    flat: torch.Tensor
    layout: Layout | None = None
    views: list[torch.Tensor] = dataclasses.field(default_factory=list)
    done: torch.cuda.Event | None = None  # a GPU copy's end, on the copy stream


class OwnCopy:
    """This rank's local state as of its last pre-step hook (see the module)."""

    def __init__(self) -> None:
        self._buffers: list[_Buffer] = []
        self._pending: _Buffer | None = None  # started after the last optimizer step, not sealed yet
        self._sealed: _Buffer | None = None
        self._piece: Piece | None = None  # the sealed copy: its tensors are views into ``_sealed``
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.started = 0  # copies started before their seal
        self.taken = 0  # copies sealed
        self.overlapped = 0  # of them, copies started before the seal (not at it)

    def start(
        self, layout: Layout, tensors: Sequence[torch.Tensor], *, forward_written: Set[int] = frozenset()
    ) -> None:
        """Start copying the live local state (``tensors``, in ``layout``'s order) as the last step left it.
        ``forward_written``: the data pointers of tensors a forward may change (the model's buffers); on a
        GPU they are copied on the current stream, ahead of the next forward's kernels."""
        self._pending = self._copy(layout, tensors, forward_written)
        self.started += 1

    def _copy(self, layout: Layout, tensors: Sequence[torch.Tensor], written: Set[int]) -> _Buffer:
        buffer = self._free(layout.nbytes)
        if buffer.layout is not layout and buffer.layout != layout:
            buffer.layout, buffer.views = layout, layout.views(buffer.flat)
        buffer.done = None
        stream = self._stream
        if stream is None or not any(t.is_cuda for t in tensors):
            for view, tensor in zip(buffer.views, tensors, strict=True):
                view.copy_(byte_view(tensor))
            return buffer
        main = torch.cuda.current_stream()
        stream.wait_stream(main)  # the state as of the optimizer's last kernel
        for view, tensor in zip(buffer.views, tensors, strict=True):
            if tensor.data_ptr() in written:
                view.copy_(byte_view(tensor), non_blocking=True)  # on ``main``: before the next forward
        with torch.cuda.stream(stream):
            for view, tensor in zip(buffer.views, tensors, strict=True):
                if tensor.data_ptr() not in written:
                    view.copy_(byte_view(tensor), non_blocking=True)
                    tensor.record_stream(stream)  # not reused by the allocator before the copy read it
        stream.wait_stream(main)  # the buffers' copies on ``main`` end before the copy counts as done
        buffer.done = torch.cuda.Event()
        buffer.done.record(stream)
        return buffer

    def seal(self, piece: Piece) -> None:
        """The optimizer's pre-step hook: the copy started after the last step is ``piece`` (the live state
        at ``piece.step``, its small state now). Without one started, or of another layout (the optimizer's
        state appeared), ``piece``'s tensors are copied now. On a GPU the current stream (the optimizer's
        kernels about to be queued) waits for the copy."""
        buffer, self._pending = self._pending, None
        if buffer is None or (buffer.layout is not piece.layout and buffer.layout != piece.layout):
            buffer = self._copy(piece.layout, piece.tensors, frozenset())
        else:
            self.overlapped += 1
        if buffer.done is not None and self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        self._sealed = buffer
        self._piece = dataclasses.replace(piece, small=copy.deepcopy(piece.small), tensors=buffer.views)
        self.taken += 1

    def take(self, piece: Piece) -> None:
        """Copy ``piece`` (live tensors, which the optimizer step about to run changes) and seal it at once."""
        self._pending = None
        self.seal(piece)

    def piece(self) -> Piece | None:
        """The sealed copy (complete: a GPU copy is waited for), or None before the first."""
        if self._sealed is not None and self._sealed.done is not None:
            self._sealed.done.synchronize()
        return self._piece

    def close(self) -> None:
        """Wait for any copy still running (its buffers and sources must outlive it)."""
        for buffer in self._buffers:
            if buffer.done is not None:
                buffer.done.synchronize()

    @property
    def step(self) -> int | None:
        return self._piece.step if self._piece is not None else None

    @property
    def nbytes(self) -> int:
        """Host bytes of both buffers."""
        return sum(b.flat.numel() for b in self._buffers)

    def _free(self, nbytes: int) -> _Buffer:
        """The buffer not holding the sealed copy, of ``nbytes`` (a new one when the state grew)."""
        spare = [b for b in self._buffers if b is not self._sealed]
        if spare and spare[0].flat.numel() == nbytes:
            if spare[0].done is not None:
                spare[0].done.synchronize()  # an earlier copy into it, started and never sealed
            return spare[0]
        for b in spare:
            self._buffers.remove(b)
            if b.done is not None:
                b.done.synchronize()
        flat = pinned_empty(nbytes) if self._stream is not None else torch.empty(nbytes, dtype=torch.uint8)
        buffer = _Buffer(flat=flat)
        self._buffers.append(buffer)
        return buffer
