"""Moving HSDP shards between replicas: what :func:`~.replica_plan.plan_replicas` decided, over the wire.

Each :class:`~.replica_plan.ShardTransfer` gets a group of its own (its source and receivers: the
ranks of one shard index), and the source broadcasts its local state to them in it: the header
(layout, small state, param groups) as one object, then the local tensors with
:func:`~elastic_events.rounds.transfer.broadcast_tensors` (bounded buckets; a receiver writes into
one flat buffer). The groups of different shard indices are disjoint when every rank keeps its shard
index (a node is whole replicas), so they move in parallel over their own links. Nothing is gathered
and nothing re-sharded: a receiver loads the piece into its fresh model's local shards
(:func:`~elastic_events.rounds.snapshot_restore.load_local_state`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from elastic_events import eventlog
from elastic_events.contract import Record
from elastic_events.errors import HydrationError
from elastic_events.rounds import abort
from elastic_events.rounds.replica_plan import ReplicaPlan
from elastic_events.rounds.snapshot import Piece
from elastic_events.rounds.snapshot_restore import load_local_state
from elastic_events.rounds.transfer import broadcast_tensors

if TYPE_CHECKING:
    from elastic_events.rounds.engine import RoundEngine

__all__ = ["exchange_shards", "hydrate_from_replicas"]


def hydrate_from_replicas(
    engine: RoundEngine,
    plan: ReplicaPlan,
    own: Piece | None,
    *,
    build: Callable[[], torch.nn.Module],
    finish: Callable[[torch.nn.Module, dict[str, Any] | None, int], None],
    optimizer: Callable[[], torch.optim.Optimizer | None],
) -> int:
    """Bring this rank to ``plan``: its piece (kept, or received from its shard's source), then ``build()`` its
    model on the new mesh, load the piece into its local shards and ``finish`` (buffers and small state from
    the plan's small source). Every rank of the round calls it; returns the bytes moved by the whole round.
    Ranks ahead of ``plan.step`` load the copy they kept of it (:mod:`.own_copy`): the step is trained again."""
    e = engine
    if plan.newest > plan.step:
        eventlog.emit(Record.STEP_ROLLED_BACK, step=plan.step, redone=plan.newest - plan.step)
        if e.rank == 0:
            print(
                f"round {e.round}: step {plan.newest} was applied on some shard indices only (a rank died in its "
                f"cross-replica reduction): every rank goes on from step {plan.step}, kept one step back",
                file=sys.stderr,
                flush=True,
            )
    mine, sent = exchange_shards(
        plan,
        own,
        rank=e.rank,
        world_size=e.world_size,
        device=e.comm_device,
        bucket_bytes=e.config.bucket_bytes,
        timeout_s=e.config.timeout_s,
    )
    own = None  # a keeper's ``mine`` is it; the rest is freed with the old model
    model = build()
    load_local_state(model, optimizer(), mine)
    finish(model, mine.small if e.rank == plan.small_source else None, plan.small_source)
    total = torch.tensor([sent], dtype=torch.int64, device=e.comm_device)
    dist.all_reduce(total)
    return int(total.item())


def exchange_shards(
    plan: ReplicaPlan,
    own: Piece | None,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    bucket_bytes: int,
    timeout_s: float,
) -> tuple[Piece, int]:
    """Every rank of the round calls it: this rank's piece at ``plan.step`` (the one it kept, or the one its
    shard's source sent) and the bytes it sent. ``own``: the piece this rank kept (None: a newcomer)."""
    timeout = timedelta(seconds=timeout_s)
    # every rank makes every transfer's group, in shard order (dist.new_group is collective)
    with abort.tracking():  # the round's sockets: a failure during the transfer is aborted like any other
        groups = [
            None if len(t.members) == world_size else dist.new_group(list(t.members), timeout=timeout)
            for t in plan.transfers
        ]
    mine = own if rank in plan.keepers else None
    sent = 0
    for transfer, group in zip(plan.transfers, groups, strict=True):
        if rank == transfer.source:
            if own is None:
                raise HydrationError(f"rank {rank} is to send shard {transfer.shard} and kept none")
            dist.broadcast_object_list([own.header()], src=rank, group=group)
            broadcast_tensors(own.tensors, src=rank, group=group, device=device, bucket_bytes=bucket_bytes)
            sent += own.layout.state_bytes * len(transfer.receivers)
        elif rank in transfer.receivers:
            box: list[bytes | None] = [None]
            dist.broadcast_object_list(box, src=transfer.source, group=group)
            header = box[0]
            if header is None:
                raise HydrationError(f"rank {transfer.source} sent no header for shard {transfer.shard}")
            piece = Piece.from_header(header)
            flat = torch.empty(piece.layout.nbytes, dtype=torch.uint8, device=device)
            piece.tensors = piece.layout.views(flat)
            broadcast_tensors(piece.tensors, src=transfer.source, group=group, device=device, bucket_bytes=bucket_bytes)
            if piece.step != plan.step:
                raise HydrationError(
                    f"rank {transfer.source} sent shard {transfer.shard} at step {piece.step}, not {plan.step}"
                )
            mine = piece
    if mine is None:
        raise HydrationError(f"rank {rank}: the plan of step {plan.step} gives it no shard")
    return mine, sent
