"""One rank of a snapshot-replication check: a sharded (FSDP2) model, AdamW, a ring of Replicators.

argv: RANK WORLD PORT LOCAL_WORLD MODE. Every rank trains a few steps, snapshotting after each;
then the copies its peers hold are put back together on rank 0 and compared with the live
model's and optimizer's full state (gathered by DCP), which must equal a twin's trained without
snapshots (a snapshot taken before the first step must not touch the optimizer). MODE ``ok`` ends the round cleanly and
also loads each rank's own copy into a fresh model (the same-world restore) and another rank's (refused); MODE
``abort`` breaks it while its threads wait (as a repair does) and times how long they take to end; MODE
``die`` makes the last rank kill itself in the middle of sending its next snapshot (after its
header, before its tensors), and the survivors report what they hold afterwards. Prints one JSON line per rank.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import elastic_events.rounds.snapshot as snapshot
from elastic_events.errors import PeerFailureError
from elastic_events.rounds import abort
from elastic_events.rounds.hydration import gather_full_state
from elastic_events.rounds.snapshot import Piece, Replicator, SnapshotError, capture, recv_body, recv_header, send_piece
from elastic_events.rounds.snapshot_restore import assemble, load_local_state

STEPS = 3


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5), torch.nn.Linear(5, 2))
    model.register_buffer("scale", torch.tensor([1.5, 0.5]))
    fully_shard(model[0])
    return fully_shard(model)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 6, generator=g)
    (model(x) * model.scale).square().sum().backward()
    opt.step()
    opt.zero_grad()


def piece_of(rank: int, world: int, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Piece:
    c = capture(model, opt)
    return Piece(
        owner=rank,
        round=1,
        world_size=world,
        step=step,
        layout=c.layout,
        small={"step": step},
        param_groups=c.param_groups(opt),
        tensors=c.tensors,
    )


def full_equal(a: dict, b: dict) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(full_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(full_equal(x, y) for x, y in zip(a, b))
    return a == b


def main() -> int:
    rank, world, port, local_world = (int(a) for a in sys.argv[1:5])
    mode = sys.argv[5]
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sockets: set[int] = set()
    with abort.tracking(sockets):
        group, acks = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    rep = Replicator(
        group=group,
        acks=acks,
        sockets=sockets,
        round=1,
        rank=rank,
        world_size=world,
        local_world_size=local_world,
        bucket_bytes=64,
        timeout_s=60,
    )
    opt.register_step_pre_hook(lambda *_: rep.wait(broken=lambda: None))
    twin = build()  # the same training, never snapshotted: snapshots must not change what is trained
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.01)
    rep.snapshot(piece_of(rank, world, 0, model, opt))  # before the first step, as a round's start does
    for step in range(1, STEPS + 1):
        train_step(model, opt, step)
        rep.snapshot(piece_of(rank, world, step, model, opt))
        train_step(twin, twin_opt, step)
    rep.wait(broken=lambda: None)
    out = {"rank": rank, "holder": rep.holder, "owner": rep.owner, "holdings": sorted(rep.holdings())}
    c = capture(model, opt)
    out["state_bytes"], out["held_bytes"] = c.layout.nbytes, rep.held_bytes()  # buffer sizes (entries aligned)

    if mode == "abort":  # healthy, idle rounds broken from outside (the launcher repairs them): both threads end
        out["abort_s"], out["alive"] = [], []
        for again in range(6):
            if again:  # a fresh round of groups and threads, one snapshot in it
                sockets = set()
                with abort.tracking(sockets):
                    group, acks = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
                rep = Replicator(
                    group=group,
                    acks=acks,
                    sockets=sockets,
                    round=1 + again,
                    rank=rank,
                    world_size=world,
                    local_world_size=local_world,
                    bucket_bytes=64,
                    timeout_s=60,
                )
                rep.snapshot(piece_of(rank, world, STEPS, model, opt))
                rep.wait(broken=lambda: None)
            dist.barrier()  # every rank's chain is done: an abort here breaks only idle waits
            t0 = time.monotonic()
            rep.abort()
            out["abort_s"].append(time.monotonic() - t0)
            out["alive"] += [rep._sender.is_alive(), rep._receiver.is_alive()]
    elif mode == "ok":
        out["closed"] = rep.close(timeout_s=30)  # the copies stay; the group is free for the restore's sends
        full = gather_full_state(model, opt, holder=0)  # the live truth at step STEPS
        untouched = gather_full_state(twin, twin_opt, holder=0)
        for owner in range(world):  # rank 0 assembles every shard from the copies its holders keep
            holder = snapshot.holder_of(owner, world_size=world, local_world_size=local_world)
            if rank == holder and holder != 0:
                send_piece(rep.held_piece(owner, STEPS), dst=0, group=group, bucket_bytes=64)
        if rank == 0:

            def pieces():
                for owner in range(world):
                    holder = snapshot.holder_of(owner, world_size=world, local_world_size=local_world)
                    if holder == 0:
                        yield rep.held_piece(owner, STEPS)
                        continue
                    piece = recv_header(src=holder, group=group)
                    yield recv_body(
                        piece,
                        torch.empty(piece.layout.nbytes, dtype=torch.uint8),
                        src=holder,
                        group=group,
                        bucket_bytes=64,
                    )

            model_sd, optim_sd, first = assemble(pieces())
            out["model_equal"] = full_equal(model_sd, full.model)
            out["optim_equal"] = full_equal(optim_sd, full.optimizer)
            out["untouched_equal"] = full_equal(full.model, untouched.model) and full_equal(
                full.optimizer, untouched.optimizer
            )
            out["small"] = first.small
        # the same world again (a crashed rank replaced): a fresh model takes this rank's copy as its local shards
        fresh = build()
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
        load_local_state(fresh, fresh_opt, rep.held_piece(rank, STEPS))
        reloaded = gather_full_state(fresh, fresh_opt, holder=0)
        if rank == 0:
            out["reloaded_equal"] = full_equal(reloaded.model, full.model) and full_equal(
                reloaded.optimizer, full.optimizer
            )
        try:  # another rank's piece: its shards lie elsewhere on the mesh
            load_local_state(build(), None, rep.held_piece(rep.owner, STEPS))
            out["wrong_piece"] = None
        except SnapshotError as exc:
            out["wrong_piece"] = str(exc)
    else:  # the last rank dies in the middle of sending its snapshot of the next step: after its header
        if rank == world - 1:

            def die(*_args, **_kwargs):
                os.kill(os.getpid(), signal.SIGKILL)

            dist.isend = die  # the tensors' buckets go by isend, and only the snapshot's sender uses it
        train_step_ok = True
        try:
            g = torch.Generator().manual_seed(STEPS + 1)
            (model(torch.randn(8, 6, generator=g)) * model.scale).square().sum().backward()
            rep.snapshot(piece_of(rank, world, STEPS + 1, model, opt))  # as if step STEPS + 1 had been committed
            opt.step()  # waits for the chain of STEPS + 1: a dead peer
        except PeerFailureError as exc:
            train_step_ok = False
            out["error"] = str(exc)[:200]
        out["step_committed"] = train_step_ok
        out["holdings_after"] = sorted(rep.holdings())
        rep.abort()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip gloo's teardown at interpreter exit (pytorch/pytorch#179291)
