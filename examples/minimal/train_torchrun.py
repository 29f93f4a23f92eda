"""A plain torchrun DDP loop: linear regression on a fixed synthetic dataset, global batch 64.

``train_elastic.py`` beside it is the same loop made elastic and failure-tolerant in place.

Run it:
    torchrun --standalone --nproc-per-node 2 examples/minimal/train_torchrun.py --steps 50
"""

import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    true_w = torch.randn(16, 1)
    x = torch.randn(64 * args.steps, 16, generator=torch.Generator().manual_seed(1))
    dataset = TensorDataset(x, x @ true_w)
    sampler = DistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, batch_size=64 // dist.get_world_size(), sampler=sampler)
    model = DDP(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    for number, (xb, yb) in enumerate(loader, start=1):
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if dist.get_rank() == 0 and (number % 10 == 0 or number == 1):
            print(f"step {number:4d}  loss {loss.item():.4f}  world {dist.get_world_size()}", flush=True)
        if number == args.steps:
            break
    if dist.get_rank() == 0:
        print(f"done: {number} steps at world size {dist.get_world_size()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
