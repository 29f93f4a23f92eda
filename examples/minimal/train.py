"""The smallest hyperpodrun training script: DDP linear regression on synthetic data.

Run it:
    hyperpodrun --standalone --nproc-per-node 2 examples/minimal/train.py --steps 50
    torchrun    --standalone --nproc-per-node 2 examples/minimal/train.py --steps 50   # same script
"""

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from elastic_events import elastic_event_detected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    true_w = torch.randn(16, 1)
    model = DDP(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)

    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, 16, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), x @ true_w)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  world {world}", flush=True)
        if elastic_event_detected():
            print(f"rank {rank}: elastic event at step {step}, exiting for a restart", flush=True)
            break
    if rank == 0:
        print(
            f"done: {step} steps at world size {world} in {time.perf_counter() - start:.1f}s "
            f"(restart reason: {os.environ.get('HYPERPODRUN_RESTART_REASON', 'n/a')})",
            flush=True,
        )
    # Free DDP before its group: a group still held at interpreter exit makes torch 2.13's gloo
    # abort about one exit in six (SIGABRT) after training succeeded.
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
