"""One rank of ``test_grad_norm``: clips gradients that are DTensors on a mesh of REPLICAS x SHARDS (HSDP; 1 x N
is FSDP over the world), beside plain ones, with ``elastic_events.clip_grad_norm_`` for each of ``CLIPS``, and
writes for each the norm, the clipped gradients in full and how many DTensor sharding propagations it computed.

Every rank builds the same full parameters and gradients from one seed: 5 x 3 (uneven on 2 and 3 shards), 1 x 4
(empty shards past the first), 7 (1-D), and a plain 2 x 2. ``PLACEMENTS`` says how each is laid out.

    python grad_norm_ranks.py RANK WORLD PORT REPLICAS OUT.pt
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from propagations import count_computed_propagations
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from elastic_events import clip_grad_norm_

SHAPES = ((5, 3), (1, 4), (7,), (2, 2))
#: (norm_type, max_norm): clipped by the 2-norm, by the largest element, and a 1-norm below max_norm (no clip)
CLIPS = ((2.0, 1.0), (float("inf"), 1.0), (1.0, 1e6))


def full_tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) * (i + 1) for i, shape in enumerate(SHAPES)]


def main() -> None:
    rank, world, port, replicas = (int(a) for a in sys.argv[1:5])
    out = sys.argv[5]
    computed = count_computed_propagations()
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    hsdp = [Replicate(), Shard(0)]
    placements = (hsdp, hsdp, [Replicate(), Replicate()], None)  # None: a plain tensor
    results = []
    for norm_type, max_norm in CLIPS:
        params = []
        for value, grad, placement in zip(full_tensors(0), full_tensors(1), placements, strict=True):
            if placement is None:
                p = torch.nn.Parameter(value.clone())
                p.grad = grad.clone()
            else:
                p = torch.nn.Parameter(distribute_tensor(value, mesh, placement))
                p.grad = distribute_tensor(grad, mesh, placement)
            params.append(p)
        before = computed[0]
        norm = clip_grad_norm_(params, max_norm, norm_type)
        clip_computed = computed[0] - before
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
        results.append({"norm": norm, "grads": grads, "computed": clip_computed, "type": type(norm).__name__})
    torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
