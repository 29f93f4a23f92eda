"""One rank of a chunked-transfer check: rank 0 sends a mix of tensors, the others receive them.

Prints one JSON line: whether every received tensor is bitwise the sent one, and the stats.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_events.rounds.transfer import broadcast_tensors


def tensors(fill: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    made = [
        torch.randn(3, 5, generator=g),
        torch.randn(7, generator=g).to(torch.bfloat16),
        torch.randint(-(2**40), 2**40, (2, 2), generator=g),
        torch.rand(9, generator=g) > 0.5,
        torch.tensor(3.25, dtype=torch.float64),
        torch.randn(4, 6, generator=g).t(),  # not contiguous
        torch.randn(1000, generator=g),  # larger than a bucket: sent in place, in slices
        torch.empty(0),
        torch.randn(2, 3, generator=g).to(torch.float16),
    ]
    return made if fill else [torch.zeros_like(t) for t in made]


def main() -> int:
    rank, world, port, bucket = (int(a) for a in sys.argv[1:5])
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    mine = tensors(fill=rank == 0)
    stats = broadcast_tensors(mine, src=0, device=torch.device("cpu"), bucket_bytes=bucket)
    same = all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(mine, tensors(fill=True)))
    print(
        json.dumps(
            {
                "rank": rank,
                "same": same,
                "nbytes": stats.nbytes,
                "broadcasts": stats.broadcasts,
                "staging": stats.staging_bytes,
            }
        ),
        flush=True,
    )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from fast_exit import run_and_exit  # the script's own directory

    run_and_exit(main)
