"""Worker for test_checkpoint.py: save at one world size, load at another.

``save OUT``: train a DDP, an FSDP2 and an HSDP copy of a small model for a few AdamW steps,
save each with the Checkpointer (DDP synchronously, FSDP2 and HSDP asynchronously, training
one more step while the write is in flight), and have rank 0 dump the full
(unsharded) state at save time with ``torch.save`` as the reference. Every rank
seeds its global RNG with ``RNG_SEED + rank`` just before saving and dumps what it
draws right after.

``load OUT``: build fresh (differently initialised) models, load, and dump from every
rank the full state it now holds, what ``load`` returned, and the next RNG draw.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LRScheduler

from elastic_events.checkpoint import CheckpointConfig, Checkpointer
from elastic_events.data.sampler import ElasticSampler

WRAPS = ("ddp", "fsdp", "hsdp")
ASYNC = {"ddp": False, "fsdp": True, "hsdp": True}  # both save paths run with real ranks
TRAIN_STEPS = 3
RNG_SEED = 1000


def build(wrap: str, init_seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, LRScheduler]:
    torch.manual_seed(init_seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    world = dist.get_world_size()
    if wrap == "ddp":
        model = DistributedDataParallel(model)
    else:
        if wrap == "hsdp":  # shard groups of 2 where the world divides, else one rank each: 1 x 2, 1 x 1, 3 x 1
            shard = 2 if world % 2 == 0 else 1
            mesh = init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return copy.deepcopy({"model": model_sd, "optimizer": optim_sd})  # DDP's entries alias the live tensors


def sampler(world: int, rank: int) -> ElasticSampler:
    return ElasticSampler(64, global_batch=6, micro_batch=2, rank=rank, world_size=world, seed=7)


def save(out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {}
    for wrap in WRAPS:
        model, optimizer, scheduler = build(wrap, init_seed=0)
        data = sampler(world, rank)
        data.load_state_dict({**data.state_dict(), "epoch": 2, "consumed": 18})
        generator = torch.Generator().manual_seed(100 + rank)
        for _ in range(TRAIN_STEPS):
            loss = model(torch.randn(4, 6, generator=generator)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        extra = {"tokens_seen": 4096, "tag": "phase-a", "ema": torch.arange(3.0)}
        torch.manual_seed(RNG_SEED + rank)  # distinct per-rank streams, so a mix-up on restore shows
        ckpt = Checkpointer(CheckpointConfig(dir=out / wrap, async_save=ASYNC[wrap]))
        path = ckpt.save(TRAIN_STEPS, model=model, optimizer=optimizer, scheduler=scheduler, data=data, extra=extra)
        draw = torch.rand(4)
        reference = full_state(model, optimizer)
        reference.update(scheduler=scheduler.state_dict(), data=data.state_dict(), extra=extra)
        model(torch.randn(4, 6, generator=generator)).sum().backward()
        optimizer.step()  # an async write must not see this step
        ckpt.close()
        result[wrap] = {"path": str(path), "draw": draw}
        if rank == 0:
            torch.save(reference, out / f"reference_{wrap}.pt")
    torch.save(result, out / f"saved_rank{rank}.pt")


def load(out: Path) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {}
    for wrap in WRAPS:
        model, optimizer, scheduler = build(wrap, init_seed=1 + rank)
        data = sampler(world, rank)
        loaded = Checkpointer(CheckpointConfig(dir=out / wrap)).load(
            model=model, optimizer=optimizer, scheduler=scheduler, data=data
        )
        if loaded is None:
            sys.exit(f"rank {rank}: no checkpoint found under {out / wrap}")
        result[wrap] = {
            **full_state(model, optimizer),
            "scheduler": scheduler.state_dict(),
            "data": data.state_dict(),
            "step": loaded.step,
            "extra": loaded.extra,
            "rng": loaded.rng,
            "saved_world": loaded.info.world_size,
            "draw": torch.rand(4),
        }
    torch.save(result, out / f"loaded_w{world}_rank{rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("save", "load"))
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        save(args.out) if args.mode == "save" else load(args.out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    from fast_exit import run_and_exit  # the script's own directory

    run_and_exit(main)
