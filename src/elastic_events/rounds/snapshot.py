"""In-memory snapshots of a sharded (FSDP2) model, each held by a peer on another node.

With DDP every rank holds the whole state: after a failure the survivors are the copy
(:meth:`~elastic_events.training.ElasticTraining.recover` uses exactly that). A sharded
model's shards exist once each, so a failed rank's shards must have been copied somewhere
*before* it failed. This module keeps that copy:

* **What.** A rank's *local state*: the local shards of its parameters and of their
  optimizer state, its buffers, and the small state (step, scheduler, sampler position,
  extras, the optimizer's hyperparameters). :func:`capture` finds the tensors once per
  round (they are updated in place) and describes them in a :class:`Layout`: for each,
  its global shape and where its shard lies in it.
* **When.** At every ``snapshot_every``-th step, when the loop calls
  ``elastic_event_detected()`` after the step (its bookkeeping done). The tensors are
  not copied on the spot: a sender thread streams them while the next step's forward and
  backward run, and only the next ``optimizer.step()`` waits for whatever is not sent yet
  (its pre-step hook). No collective is added to a step.
* **Where.** To the rank's *holder*: the rank ``local_world_size`` places further on the
  ring of ranks, i.e. the same local rank on the next node (on one node: the next rank),
  over a gloo group of its own, in buckets of at most ``bucket_mb`` (host memory; an
  accelerator's tensors are staged through one pinned bucket on a stream of their own).
* **Two copies at the holder.** A receiver thread writes each arriving snapshot into the
  older of two slots and marks it complete only when every byte is in. The slot being
  written is never the only copy: whatever fails and whenever (the owner's whole node in
  the middle of a transfer included), a complete copy of every shard at the newest or the
  one before survives, unless a rank *and* its holder are lost together. Host memory:
  two copies of the left neighbour's state per rank, and nothing else (the live state is
  the rank's own copy; the issue's "own snapshot + one replica" would leave a node loss
  during a transfer with no complete copy).

After a failure :mod:`elastic_events.rounds.snapshot_restore` picks the newest step every shard
of the broken round can be had at and puts the pieces back on the new mesh.
"""

from __future__ import annotations

import contextlib
import pickle
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist

from elastic_events.errors import ElasticTrainingError, PeerFailureError
from elastic_events.rounds import abort
from elastic_events.rounds.transfer import byte_view, pinned_empty, recv_tensors, send_tensors

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import ValueType

__all__ = [
    "Captured",
    "Entry",
    "Layout",
    "Piece",
    "Replicator",
    "SnapshotError",
    "capture",
    "holder_of",
    "owner_held_by",
    "recv_body",
    "recv_header",
    "send_piece",
]

#: Largest header (pickled layout and small state) a receiver accepts.
MAX_HEADER_BYTES = 64 * 2**20


class SnapshotError(ElasticTrainingError):
    """A snapshot could not be taken, sent, received or put back together."""


# ----------------------------------------------------------------------------- the ring


def holder_of(rank: int, *, world_size: int, local_world_size: int) -> int:
    """The rank that holds ``rank``'s snapshots: the same local rank on the next node (one node: the next rank)."""
    step = local_world_size if world_size > local_world_size else 1
    return (rank + step) % world_size


def owner_held_by(rank: int, *, world_size: int, local_world_size: int) -> int:
    """The rank whose snapshots ``rank`` holds (the inverse of :func:`holder_of`)."""
    step = local_world_size if world_size > local_world_size else 1
    return (rank - step) % world_size


# --------------------------------------------------------------------------- the layout


@dataclass(frozen=True)
class Entry:
    """One tensor of a rank's local state and where its shard lies in the full tensor."""

    key: tuple[str, ...]  # ("model", fqn) or ("optim", fqn, state name)
    dtype: torch.dtype
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    shard_dim: int | None  # None: every rank holds the whole tensor
    offset: int  # along shard_dim

    @property
    def nbytes(self) -> int:
        return _numel(self.local_shape) * torch.empty((), dtype=self.dtype).element_size()


#: Every entry of a flat buffer starts at a multiple of this: its bytes can be viewed as any dtype.
ALIGN = 64


@dataclass(frozen=True)
class Layout:
    entries: tuple[Entry, ...]

    @property
    def state_bytes(self) -> int:
        """Bytes of the state itself."""
        return sum(e.nbytes for e in self.entries)

    @property
    def nbytes(self) -> int:
        """Bytes of a flat buffer holding it (each entry aligned to :data:`ALIGN`)."""
        return sum(-(-e.nbytes // ALIGN) * ALIGN for e in self.entries)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each entry's bytes in a flat ``uint8`` buffer of :attr:`nbytes`, in order."""
        out, at = [], 0
        for e in self.entries:
            out.append(flat[at : at + e.nbytes])
            at += -(-e.nbytes // ALIGN) * ALIGN
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _entry(key: tuple[str, ...], t: ValueType) -> tuple[Entry, torch.Tensor]:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, torch.Tensor):
        raise SnapshotError(f"{'.'.join(key[1:])}: a {type(t).__name__} in the state dict, not a tensor")
    if not isinstance(t, DTensor):
        return Entry(key, t.dtype, tuple(t.shape), tuple(t.shape), None, 0), t.detach()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t.to_local().detach()
    shards = [p for p in t.placements if isinstance(p, Shard)]
    others = [p for p in t.placements if not isinstance(p, (Shard, Replicate))]
    if len(shards) > 1 or others:
        raise SnapshotError(
            f"{'.'.join(key[1:])}: placements {t.placements} (only Replicate, and Shard on one mesh dimension)"
        )
    if not shards:
        return Entry(key, t.dtype, tuple(t.shape), tuple(local.shape), None, 0), local
    local_shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    dim = shards[0].dim
    return Entry(key, local.dtype, tuple(t.shape), tuple(local_shape), dim, int(offsets[dim])), local


@dataclass
class Captured:
    """A rank's local state: its :class:`Layout`, the live tensors in that order, the param groups' FQNs."""

    layout: Layout
    tensors: list[torch.Tensor]
    group_params: list[list[str]]  # each optimizer param group's parameters, by name
    count: int  # optimizer state tensors when captured: more appear after the first step

    def param_groups(self, optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
        """The optimizer's hyperparameters now (the scheduler moves them), with parameters by name."""
        if optimizer is None:
            return []
        return [
            {**{k: v for k, v in g.items() if k != "params"}, "params": list(names)}
            for g, names in zip(optimizer.param_groups, self.group_params)
        ]


def optimizer_state_count(optimizer: torch.optim.Optimizer | None) -> int:
    return 0 if optimizer is None else sum(len(s) for s in optimizer.state.values())


def capture(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Captured:
    """The live tensors of the rank's local state (no copy) and their layout; names as DCP's state dicts."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    pairs = [_entry(("model", name), t) for name, t in get_model_state_dict(model).items()]
    groups: list[list[str]] = []
    if optimizer is not None and optimizer.state:
        osd = get_optimizer_state_dict(model, optimizer)
        states, param_groups = osd["state"], osd["param_groups"]
        if not isinstance(states, dict) or not isinstance(param_groups, list):
            raise SnapshotError("the optimizer's state dict has no per-parameter state or no param groups")
        for name, state in states.items():
            if not isinstance(state, dict):
                raise SnapshotError(f"{name}: the optimizer's state is a {type(state).__name__}, not a dict")
            pairs += [_entry(("optim", name, k), v) for k, v in state.items() if isinstance(v, torch.Tensor)]
        for g in param_groups:
            params = g["params"]
            if not _names(params):
                raise SnapshotError(f"an optimizer param group names its parameters as {params!r}, not as strings")
            groups.append(list(params))
    elif optimizer is not None:  # before its first step: DCP would make its state with a step of lr 0, which
        groups = group_names(model, optimizer)  # counts (AdamW's bias correction would be one step off)
    tensors = [t if t.is_contiguous() else t.contiguous() for _, t in pairs]
    if any(t.data_ptr() != orig.data_ptr() for t, (_, orig) in zip(tensors, pairs)):
        raise SnapshotError("a shard of the local state is not contiguous: it cannot be streamed in place")
    return Captured(Layout(tuple(e for e, _ in pairs)), tensors, groups, optimizer_state_count(optimizer))


def _names(value: object) -> TypeGuard[list[str]]:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def group_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Each param group's parameters by the names DCP gives them, without touching the optimizer's state."""
    from torch.distributed.checkpoint.state_dict import _get_fqns  # DCP's own naming (wrappers' prefixes dropped)

    names = {id(p): name for name, p in model.named_parameters()}
    missing = [i for g in optimizer.param_groups for i, p in enumerate(g["params"]) if id(p) not in names]
    if missing:
        raise SnapshotError(f"{len(missing)} of the optimizer's parameters are not the model's: no snapshot names them")
    return [[min(_get_fqns(model, names[id(p)])) for p in g["params"]] for g in optimizer.param_groups]


# ------------------------------------------------------------------------- wire format


@dataclass
class Piece:
    """One rank's local state at one step, as it travels and as a holder keeps it."""

    owner: int  # the rank (in ``round``) whose state it is
    round: int
    world_size: int
    step: int
    layout: Layout
    small: dict[str, Any]  # step, extras, scheduler, sampler, base seed, control-channel step
    param_groups: list[dict[str, Any]]
    tensors: list[torch.Tensor] = field(default_factory=list)  # in layout order (live, or views into a slot)

    def header(self) -> bytes:
        return pickle.dumps({k: v for k, v in vars(self).items() if k != "tensors"})

    @staticmethod
    def from_header(data: bytes) -> Piece:
        return Piece(
            **pickle.loads(data)
        )  # from a rank of this job, over the job's own group (as broadcast_object_list)


def send_piece(piece: Piece, *, dst: int, group: Any, bucket_bytes: int, header: bytes | None = None) -> None:
    """Header (its length, then the pickled layout and small state), the tensors, and the step again: a
    receiver counts a piece complete only once that last message arrives and matches (:func:`recv_body`)."""
    data = piece.header() if header is None else header
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst=dst, group=group)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst=dst, group=group)
    send_tensors(piece.tensors, dst=dst, group=group, bucket_bytes=bucket_bytes)
    dist.send(torch.tensor([piece.step], dtype=torch.int64), dst=dst, group=group)


def recv_header(*, src: int, group: Any) -> Piece | None:
    """The next piece's header from ``src``; None when ``src`` says it sends no more."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src, group=group)
    n = int(size.item())
    if n == 0:
        return None
    if not 0 < n <= MAX_HEADER_BYTES:
        raise SnapshotError(f"rank {src} announced a snapshot header of {n} bytes")
    data = torch.empty(n, dtype=torch.uint8)
    dist.recv(data, src=src, group=group)
    return Piece.from_header(data.numpy().tobytes())


def recv_body(piece: Piece, flat: torch.Tensor, *, src: int, group: Any, bucket_bytes: int) -> Piece:
    """Receive ``piece``'s tensors into ``flat`` (``layout.nbytes``), then its closing step; the piece, complete."""
    views = piece.layout.views(flat)
    recv_tensors(views, src=src, group=group, bucket_bytes=bucket_bytes)
    end = torch.zeros(1, dtype=torch.int64)
    dist.recv(end, src=src, group=group)
    if int(end.item()) != piece.step:
        raise SnapshotError(f"rank {src}'s snapshot of step {piece.step} closed with step {int(end.item())}")
    piece.tensors = views
    return piece


# ------------------------------------------------------------------------ replication


@dataclass
class _Slot:
    flat: torch.Tensor | None = None
    piece: Piece | None = None  # set only once complete


@dataclass
class _Job:
    piece: Piece
    header: bytes = b""  # the piece's header, pickled when the snapshot was taken (the small state moves on)
    ready: Any = None  # a CUDA event the copies must wait for
    done: threading.Event = field(default_factory=threading.Event)  # sent, acknowledged by all, own copy taken


#: How long an abort waits for the two threads. Shut-down sockets end their waits at once, except a receive
#: from a peer that was already dead (seen after a node loss: gloo's receive then waits for its timeout). A
#: thread left waiting writes only into its own round's incomplete slot, which the restore never reads.
ABORT_JOIN_S = 0.25


class Replicator:
    """One round's snapshots: this rank's go to its holder, its owner's come here, and a copy of its own stays.

    A snapshot of step ``s`` is a chain run by two daemon threads while the next step computes:

    1. the sender streams the live local state to the holder; the receiver fills the older of
       the two slots with the owner's and marks it complete once every byte is in;
    2. the sender joins an all-reduce of one element on ``acks`` (a second gloo group): once it
       returns, every rank's copy of ``s`` is complete at its holder;
    3. only then the sender copies the live state into :attr:`own` (so until every copy of ``s``
       exists, ``own`` still holds the previous snapshot, which a rank that committed past a
       failed peer's newest copy rolls back to: its own older copy was with that peer).

    The next ``optimizer.step()`` waits for the chain (:meth:`wait`), so no rank commits step
    ``s + 1`` before every copy of ``s`` is complete: after any single failure, the newest or
    the previous snapshot step is held for every shard (:func:`plan_restore`). Memory: the
    owner's state twice and this rank's once (3x the local state), in host memory.
    """

    def __init__(
        self,
        *,
        group: Any,
        acks: Any,
        sockets: set[int],
        round: int,
        rank: int,
        world_size: int,
        local_world_size: int,
        bucket_bytes: int,
        timeout_s: float,
    ) -> None:
        self.group, self.acks, self.sockets, self.round = group, acks, sockets, round
        self.rank, self.world_size = rank, world_size
        self.holder = holder_of(rank, world_size=world_size, local_world_size=local_world_size)
        self.owner = owner_held_by(rank, world_size=world_size, local_world_size=local_world_size)
        self.bucket_bytes, self.timeout_s = bucket_bytes, timeout_s
        self._slots = (_Slot(), _Slot())
        self._own = _Slot()
        self._lock = threading.Condition()
        self._received = -1  # newest step received complete from the owner
        self._jobs: queue.Queue[_Job | None] = queue.Queue()  # None: the last one, nothing more comes
        self._last: _Job | None = None
        self.failed: BaseException | None = None  # why replication stopped in this round
        self.completed = 0  # snapshots whose chain completed
        self.last_chain_us = 0  # how long the last completed chain took, from its start to every copy existing
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._sender = threading.Thread(target=self._send_loop, name="hyperpodrun-snapshot-send", daemon=True)
        self._receiver = threading.Thread(target=self._recv_loop, name="hyperpodrun-snapshot-recv", daemon=True)
        self._sender.start()
        self._receiver.start()

    # ------------------------------------------------------------- main thread
    def snapshot(self, piece: Piece) -> None:
        """Start the chain of ``piece`` (its tensors live: they must not change until :meth:`wait` returns)."""
        if self.failed is not None:
            return
        ready = None
        if self._stream is not None and any(t.is_cuda for t in piece.tensors):
            ready = torch.cuda.Event()
            ready.record()  # after the optimizer step's kernels on the main stream
        self._last = _Job(piece, piece.header(), ready)
        self._jobs.put(self._last)

    def wait(self, *, broken: Callable[[], str | None], poll_s: float = 0.02) -> None:
        """Block until the last snapshot's chain is done (the optimizer's pre-step hook).

        ``broken()`` is asked every ``poll_s``: a reason (the launcher repairs the round) ends
        replication and raises :class:`~elastic_events.errors.PeerFailureError`, as does a
        chain that failed (a peer died); the optimizer step must not run then. Raises
        :class:`SnapshotError` after ``timeout_s``.
        """
        job = self._last
        if job is None:
            return
        deadline = time.monotonic() + self.timeout_s
        while not job.done.wait(poll_s) and self.failed is None:
            reason = broken()
            if reason is not None:
                self._stop_for(PeerFailureError(reason))
            elif time.monotonic() > deadline:
                raise self._stop_for(
                    SnapshotError(
                        f"rank {self.rank}: the snapshot of step {job.piece.step} was not "
                        f"complete on every rank within {self.timeout_s:.0f}s"
                    )
                )
        if self.failed is not None:
            raise PeerFailureError(
                f"rank {self.rank}: the snapshot of step {job.piece.step} did not complete: {self.failed}"
            )

    def holdings(self) -> tuple[tuple[int, int], ...]:
        """``(owner, step)`` of every complete copy held: the owner's two, and this rank's own."""
        with self._lock:
            return tuple((s.piece.owner, s.piece.step) for s in (*self._slots, self._own) if s.piece is not None)

    def held_piece(self, owner: int, step: int) -> Piece:
        with self._lock:
            for s in (*self._slots, self._own):
                if s.piece is not None and (s.piece.owner, s.piece.step) == (owner, step):
                    return s.piece
        raise SnapshotError(f"rank {self.rank} holds no complete snapshot of rank {owner} at step {step}")

    def held_bytes(self) -> int:
        with self._lock:
            return sum(s.flat.numel() for s in (*self._slots, self._own) if s.flat is not None)

    def close(self, *, timeout_s: float) -> bool:
        """The round ends with every rank alive: tell the holder, wait for both threads. False if they hung."""
        if self.failed is None:
            self._jobs.put(None)
        self._sender.join(timeout_s)
        self._receiver.join(max(0.1, timeout_s))
        if self._sender.is_alive() or self._receiver.is_alive():
            self.abort()
            return False
        return True

    def abort(self) -> None:
        """The round is broken: end both threads' waits now (the complete copies are kept)."""
        self._stop_for(SnapshotError(f"round {self.round} was aborted"))
        deadline = time.monotonic() + ABORT_JOIN_S
        for thread in (self._sender, self._receiver):
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():  # a wait its group's shut-down sockets did not end: say where, and go on
                frame = sys._current_frames().get(thread.ident) if thread.ident is not None else None
                where = "".join(traceback.format_stack(frame)[-4:]) if frame is not None else "?"
                print(
                    f"rank {self.rank}: {thread.name} of round {self.round} still runs {ABORT_JOIN_S} s after the "
                    f"abort (left behind: it writes only into its round's incomplete slot):\n{where}",
                    file=sys.stderr,
                    flush=True,
                )

    def _stop_for(self, exc: BaseException) -> BaseException:
        """End replication in this round for ``exc``; returns what ended it (an earlier failure stays the reason)."""
        with self._lock:
            if self.failed is None:
                self.failed = exc
            failed = self.failed
            self._lock.notify_all()
        abort.shutdown_sockets(self.sockets)
        self._jobs.put(None)
        return failed

    # --------------------------------------------------------------- threads
    def _send_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._send_end()
                return
            try:
                if self.failed is None:
                    started = time.monotonic()
                    self._chain(job)
                    self.last_chain_us = round((time.monotonic() - started) * 1e6)
                    self.completed += 1
            except Exception as exc:  # noqa: BLE001 - a broken group: stop replicating in this round
                self._note_failure(exc, f"step {job.piece.step}")
            finally:
                job.done.set()

    def _send_end(self) -> None:
        """Tell the holder that nothing more comes (a zero-length header), unless replication already failed."""
        try:
            if self.failed is None:
                dist.send(torch.zeros(1, dtype=torch.int64), dst=self.holder, group=self.group)
        except Exception as exc:  # noqa: BLE001 - a broken group: the holder learns it from its own receive
            self._note_failure(exc, f"ending the stream to rank {self.holder}")

    def _chain(self, job: _Job) -> None:
        piece = job.piece
        stream = self._stream if job.ready is not None else None  # a CUDA event only where there is a stream
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            if stream is not None:
                stream.wait_event(job.ready)
            send_piece(piece, dst=self.holder, group=self.group, bucket_bytes=self.bucket_bytes, header=job.header)
            with self._lock:
                self._lock.wait_for(lambda: self._received >= piece.step or self.failed is not None)
                if self.failed is not None:
                    raise self.failed
            dist.all_reduce(torch.zeros(1), group=self.acks)  # returns once every rank holds its owner's copy
            flat = self._own.flat
            if flat is None or flat.numel() != piece.layout.nbytes:
                flat = (
                    pinned_empty(piece.layout.nbytes)
                    if job.ready is not None
                    else torch.empty(piece.layout.nbytes, dtype=torch.uint8)
                )
            with self._lock:
                self._own.piece = None  # the previous one is no longer needed: every copy of this step exists
            for view, tensor in zip(piece.layout.views(flat), piece.tensors):
                view.copy_(byte_view(tensor))
            own = Piece(**{**vars(piece), "tensors": piece.layout.views(flat)})
            with self._lock:
                self._own.flat, self._own.piece = flat, own

    def _recv_loop(self) -> None:
        while True:
            try:
                piece = recv_header(src=self.owner, group=self.group)
                if piece is None:
                    return
                slot = self._free_slot()
                need = piece.layout.nbytes
                if slot.flat is None or slot.flat.numel() != need:
                    slot.flat = torch.empty(need, dtype=torch.uint8)
                recv_body(piece, slot.flat, src=self.owner, group=self.group, bucket_bytes=self.bucket_bytes)
                with self._lock:
                    slot.piece = piece
                    self._received = piece.step
                    self._lock.notify_all()
            except Exception as exc:  # noqa: BLE001 - the slot being written stays incomplete
                self._note_failure(exc, f"receiving from rank {self.owner}")
                return

    def _free_slot(self) -> _Slot:
        """The slot to overwrite: an empty one, else the older; it is incomplete until filled."""
        with self._lock:
            a, b = self._slots
            slot = a if a.piece is None or (b.piece is not None and a.piece.step < b.piece.step) else b
            slot.piece = None
            return slot

    def _note_failure(self, exc: BaseException, doing: str) -> None:
        with self._lock:
            first = self.failed is None
            if first:
                self.failed = exc
            self._lock.notify_all()
        if first:
            detail = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            print(
                f"rank {self.rank}: snapshot replication of round {self.round} stopped ({doing}: {detail})",
                file=sys.stderr,
                flush=True,
            )
        # Queued snapshots are let go by the sender (it sends nothing more once failed), never drained here:
        # the queue may hold the sentinel that ends the sender.


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield
