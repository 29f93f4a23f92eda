"""One rank of a deterministic-reduction check: the ranks sum their shares of one global batch of per-sample values.

Arguments: rank, world size, store port, global batch. Prints one JSON line with the sha256 of the sum's bytes.
"""

from __future__ import annotations

import hashlib
import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_events.data.batching import plan_global_batch, sum_in_batch_order


def sample_values(global_batch: int) -> list[list[torch.Tensor]]:
    """Per-sample values over magnitudes 1e-4 .. 1e4: any other summation order changes the last bits."""
    g = torch.Generator().manual_seed(11)
    return [
        [torch.randn(3, 4, generator=g) * 10.0 ** (i % 9 - 4), torch.randn(5, generator=g) * 10.0 ** (4 - i % 9)]
        for i in range(global_batch)
    ]


def digest(tensors: list[torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in tensors)).hexdigest()


def main() -> int:
    rank, world, port, global_batch = (int(a) for a in sys.argv[1:5])
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    plan = plan_global_batch(global_batch=global_batch, micro_batch=global_batch, world_size=world, rank=rank)
    values = sample_values(global_batch)
    total = sum_in_batch_order(values[plan.rank_slice()], plan, like=values[0])
    print(json.dumps({"rank": rank, "digest": digest(total)}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from fast_exit import run_and_exit  # the script's own directory

    run_and_exit(main)
