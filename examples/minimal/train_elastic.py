"""train_torchrun.py made elastic and failure-tolerant in place: 22 lines in, 20 out (`diff`, docstrings aside).

Under hyperpodrun its ranks keep their processes when nodes join or leave and when a peer dies:
the model, the optimizer and the data position move to the new world in memory, every sample is
trained once and the global batch stays 64. Under torchrun or as a plain script it trains as
train_torchrun.py does.

Run it:
    hyperpodrun --nnodes 1:2 --nproc-per-node 1 --rdzv-endpoint 127.0.0.1:29400 examples/minimal/train_elastic.py
    (the same command in a second terminal: the job grows to 2 ranks in place; Ctrl-C there: back to 1)
"""

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

from elastic_events import ElasticSampler, ElasticTraining, loss_scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()

    torch.manual_seed(0)
    true_w = torch.randn(16, 1)
    x = torch.randn(64 * args.steps, 16, generator=torch.Generator().manual_seed(1))
    dataset = TensorDataset(x, x @ true_w)
    sampler = ElasticSampler(len(dataset), global_batch=64, micro_batch=64)
    loader = DataLoader(dataset, batch_sampler=sampler)
    elastic = ElasticTraining(
        model_fn=lambda: torch.nn.Linear(16, 1),
        optimizer_fn=lambda model: torch.optim.SGD(model.parameters(), lr=0.05),
        sampler=sampler,
    ).start()

    for step in elastic.steps(loader, until=args.steps):
        with step:
            (xb, yb), *_ = step.batch.micro_batches  # this rank's share: the same for any world size in sum
            loss = torch.nn.functional.mse_loss(elastic.model(xb), yb, reduction="sum") / len(xb)
            (loss * loss_scale(len(xb), step.batch.global_count, world_size=elastic.world_size)).backward()
            elastic.optimizer.step()
            elastic.optimizer.zero_grad()
        if elastic.is_main and (step.number % 10 == 0 or step.number == 1):
            print(f"step {step.number:4d}  loss {loss.item():.4f}  world {elastic.world_size}", flush=True)
    if elastic.is_main:
        print(f"done: {elastic.step} steps at world size {elastic.world_size}", flush=True)
    elastic.close()


if __name__ == "__main__":
    main()
