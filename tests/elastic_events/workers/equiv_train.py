"""Worker for test_equivalence.py: one phase of an elastic training run.

Loads the newest checkpoint in ``--ckpt-dir`` (if any), trains a small MLP until
``--until`` optimizer steps are done with a constant global batch, saves, exits.
The global batch (10 samples) splits unevenly at every world size:

    world 1: [10]        micro-batches [4, 3, 3]
    world 2: [5, 5]      micro-batches [3, 2] each
    world 3: [4, 3, 3]   micro-batches [4] / [3] / [3]

Each micro-batch's mean loss is scaled by ``loss_scale(n, global_count, world)`` so
the DDP-averaged gradient is the gradient of the mean loss over the global batch.

Writes ``--out/phase_<until>_rank<r>.json`` (what was loaded and which samples each
step trained on) and, on rank 0, ``--out/params_<until>.pt`` with the parameters
after every step of this phase.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from elastic_events.checkpoint import CheckpointConfig, Checkpointer
from elastic_events.data.batching import loss_scale
from elastic_events.data.sampler import ElasticSampler

NUM_SAMPLES = 40
GLOBAL_BATCH = 10
MICRO_BATCH = 4


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(NUM_SAMPLES, 8, generator=generator)
    teacher = torch.randn(8, 3, generator=generator)
    y = torch.tanh(x @ teacher) + 0.1 * torch.randn(NUM_SAMPLES, 3, generator=generator)
    return TensorDataset(torch.arange(NUM_SAMPLES), x, y)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--until", type=int, required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    sampler = ElasticSampler(
        NUM_SAMPLES, global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH, rank=rank, world_size=world, seed=3
    )
    loader = DataLoader(dataset(), batch_sampler=sampler)
    ckpt = Checkpointer(CheckpointConfig(dir=args.ckpt_dir, keep_last=2, timeout_s=120))
    loaded = ckpt.load(model=model, optimizer=optimizer, scheduler=scheduler, data=sampler)
    step = loaded.step if loaded is not None else 0
    report = {
        "world": world,
        "loaded_step": step,
        "loaded_from_world": loaded.info.world_size if loaded is not None else None,
        "steps": [],
    }
    params = {}
    while step < args.until:
        for global_step in sampler.steps(loader):
            sizes = global_step.micro_batch_sizes
            trained = []
            for i, (n, (idx, x, y)) in enumerate(zip(sizes, global_step.micro_batches)):
                sync = contextlib.nullcontext() if i == len(sizes) - 1 else model.no_sync()
                with sync:
                    loss = F.mse_loss(model(x), y)
                    (loss * loss_scale(n, global_step.global_count, world_size=world)).backward()
                trained += idx.tolist()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            sampler.mark_step()
            step += 1
            report["steps"].append({"step": step, "epoch": global_step.epoch, "samples": trained})
            params[step] = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
            if step == args.until:
                break
    ckpt.save(step, model=model, optimizer=optimizer, scheduler=scheduler, data=sampler)
    (args.out / f"phase_{args.until}_rank{rank}.json").write_text(json.dumps(report))
    if rank == 0:
        torch.save(params, args.out / f"params_{args.until}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    from fast_exit import run_and_exit  # the script's own directory

    run_and_exit(main)
