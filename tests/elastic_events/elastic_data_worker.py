"""One phase of an elastic job, run under ``torch.distributed.run`` by test_dataloader_elastic.

Each rank trains a one-layer DDP model on its micro-batches of every global batch
(from a StatefulDataLoader with two workers reading ahead), checks that the reduced
gradient equals the gradient of the mean loss over exactly the global batch, and
appends the sample ids it trained on to its ledger. At the end of the phase rank 0
saves the sampler state for the next phase, which may run at another world size.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchdata.stateful_dataloader import StatefulDataLoader

from elastic_events.data.batching import global_token_count, loss_scale
from elastic_events.data.dataset import TokenDataset
from elastic_events.data.sampler import ElasticSampler


class TinyModel(torch.nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-sample squared error of a toy regression target."""
        prediction = self.head(self.embed(input_ids).mean(dim=1)).squeeze(-1)
        return (prediction - labels.float().mean(dim=1) / 100.0) ** 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--state-in", type=Path)
    parser.add_argument("--state-out", type=Path, required=True)
    parser.add_argument("--ledger", type=Path, required=True)
    parser.add_argument("--steps", type=int, required=True, help="steps in this phase; -1: to the epoch's end")
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    dataset = TokenDataset(args.data)
    sampler = ElasticSampler(len(dataset), global_batch=args.global_batch, micro_batch=args.micro_batch, seed=args.seed)
    if args.state_in is not None:
        sampler.load_state_dict(torch.load(args.state_in))
    loader = StatefulDataLoader(dataset, batch_sampler=sampler, num_workers=2, prefetch_factor=2)
    model = DistributedDataParallel(TinyModel(vocab=258))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    with (args.ledger / f"rank{rank}.txt").open("a") as ledger:
        for taken, step in enumerate(sampler.steps(loader)):
            if taken == args.steps:
                break
            sizes = step.micro_batch_sizes
            assert global_token_count(sum(sizes)) == step.global_count, "ranks disagree on the global batch"
            for i, (n, batch) in enumerate(zip(sizes, step.micro_batches)):
                assert len(batch["sample_id"]) == n
                sync = contextlib.nullcontext() if i == len(sizes) - 1 else model.no_sync()
                with sync:
                    loss = model(batch["input_ids"], batch["labels"]).mean()  # through DDP's forward
                    (loss * loss_scale(n, step.global_count, world_size=world)).backward()
            check_gradient(model, dataset, sampler.global_batch_indices(step.epoch, step.start))
            optimizer.step()
            optimizer.zero_grad()
            sampler.mark_step()
            ids = [int(i) for batch in step.micro_batches for i in batch["sample_id"]]
            ledger.write(" ".join(map(str, ids)) + "\n")
            ledger.flush()

    if rank == 0:
        torch.save(sampler.state_dict(), args.state_out)
    dist.barrier()
    del (
        model,
        optimizer,
    )  # free DDP before its group: torch 2.13's gloo can abort at exit otherwise (see torchrun_ddp_example.py)
    gc.collect()
    dist.destroy_process_group()


def check_gradient(model: DistributedDataParallel, dataset: TokenDataset, indices: list[int]) -> None:
    """The all-reduced gradient is that of the mean loss over the whole global batch."""
    reference = copy.deepcopy(model.module)
    reference.zero_grad()
    samples = [dataset[i] for i in indices]
    input_ids = torch.stack([s["input_ids"] for s in samples])
    labels = torch.stack([s["labels"] for s in samples])
    reference(input_ids, labels).mean().backward()
    for (name, got), want in zip(model.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


if __name__ == "__main__":
    main()
