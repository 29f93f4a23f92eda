"""A typical script written for torchrun, in the style of PyTorch's DDP tutorial; nothing of hyperpodrun in it.

Run it with:  torchrun --standalone --nproc-per-node 2 torchrun_ddp_example.py --steps 5
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(steps: int) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    print(f"Start running basic DDP example on rank {rank} (local {local_rank}).")
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    for _ in range(steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10))
        labels = torch.randn(20, 5)
        loss_fn(outputs, labels).backward()
        optimizer.step()
    # DDP keeps replicas identical: every rank reports the same checksum.
    checksum = sum(p.detach().sum().item() for p in model.parameters())
    print(f"Finished running basic DDP example on rank {rank}: checksum={checksum:.6f}")
    # Free DDP before its group: a group still held at interpreter exit makes torch 2.13's gloo
    # abort about one exit in six (SIGABRT), under torchrun and hyperpodrun alike.
    del ddp_model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    demo_basic(parser.parse_args().steps)
