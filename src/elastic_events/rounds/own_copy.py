"""HSDP's one step back: a copy of this rank's local state as it was before its last optimizer step.

With two replicas or more no snapshot is sent anywhere: another replica holds every shard. But a rank
that dies inside a step's cross-replica reduction can leave the step committed on some shard indices
and not on others. FSDP2 reduces each shard index's gradients among that index's ranks only, so the
ranks of shard 0 may complete the reduction and apply step ``s + 1`` while the only surviving rank of
shard 1 (whose replica peer died) stays at ``s``. No rank then holds every shard at one step.

:class:`OwnCopy` closes that gap. In the optimizer's pre-step hook, with the step's collectives
completed (:mod:`.commit`) and before anything is applied, it copies the local state at ``s`` into a
buffer of its own. A rank that applied ``s + 1`` still holds ``s`` until its next pre-step hook. It
cannot reach that hook, because its next step's collectives need the ranks that failed. So after
any failure every shard index is held at the newer step or at the one before, by some surviving
rank (:func:`~elastic_events.rounds.replica_plan.plan_replicas` picks the newest such step, and a
rank ahead of it loads its copy: one step is trained again).

Cost: one copy of the local state per step, on the step's critical path (host memory; from a GPU,
a device-to-host copy on a stream of its own that the optimizer's kernels wait for), and host memory
of 1x the local state. That is a third of what FSDP's ring snapshots hold, and nothing crosses the network.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from elastic_events.rounds.snapshot import Piece
from elastic_events.rounds.transfer import pinned_empty

__all__ = ["OwnCopy"]


class OwnCopy:
    """This rank's local state as of its last pre-step hook (see the module)."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None
        self._piece: Piece | None = None  # complete once ``_done`` (a CUDA event) has completed, or at once
        self._done: torch.cuda.Event | None = None
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.taken = 0  # copies taken

    def take(self, piece: Piece) -> None:
        """Copy ``piece`` (live tensors, which the optimizer step about to run changes) into the buffer."""
        nbytes = piece.layout.nbytes
        stream = self._stream if any(t.is_cuda for t in piece.tensors) else None
        if self._flat is None or self._flat.numel() != nbytes:  # the optimizer's state appeared: it grew
            self._flat = pinned_empty(nbytes) if stream is not None else torch.empty(nbytes, dtype=torch.uint8)
        views = piece.layout.views(self._flat)
        self._piece, self._done = None, None
        if stream is not None:
            main = torch.cuda.current_stream()
            stream.wait_stream(main)  # the state as of the step's last kernel
            with torch.cuda.stream(stream):
                for view, tensor in zip(views, piece.tensors, strict=True):
                    view.copy_(tensor.detach().reshape(-1).view(torch.uint8), non_blocking=True)
            main.wait_stream(stream)  # the optimizer's kernels change the tensors only after the copy
            self._done = torch.cuda.Event()
            self._done.record(stream)
        else:
            for view, tensor in zip(views, piece.tensors, strict=True):
                view.copy_(tensor.detach().reshape(-1).view(torch.uint8))
        # the small state as of now (the sampler and the script's extras move on); the layout is the round's
        self._piece = dataclasses.replace(piece, small=copy.deepcopy(piece.small), tensors=views)
        self.taken += 1

    def piece(self) -> Piece | None:
        """The copy (complete: a GPU copy is waited for), or None before the first."""
        if self._piece is not None and self._done is not None:
            self._done.synchronize()
        return self._piece

    @property
    def step(self) -> int | None:
        return self._piece.step if self._piece is not None else None

    @property
    def nbytes(self) -> int:
        return self._flat.numel() if self._flat is not None else 0
