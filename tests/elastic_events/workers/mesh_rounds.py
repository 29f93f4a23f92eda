"""One rank of ``test_mesh_reuse``: four rounds of a 2-rank gloo job, each torn down before the next, meshes
1 x 2, 2 x 1, 1 x 2 again (with other subgroups made first, so its subgroups get other names), then 1 x 2
with the two processes' ranks swapped (as an event renumbers ranks). Each round
shards a small model on its mesh (FSDP2) and trains two steps; writes what each round saw as JSON.

    python mesh_rounds.py RANK PORT OUT.json
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from propagations import count_computed_propagations
from torch.distributed.fsdp import fully_shard

from elastic_events.rounds.mesh import MeshLayout, build_mesh

#: replicas, shard size, extra subgroups made before the mesh, whether the two processes swap ranks
ROUNDS = ((1, 2, 0, False), (2, 1, 1, False), (1, 2, 3, False), (1, 2, 0, True))


def main() -> None:
    process, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    computed = count_computed_propagations()
    store = dist.TCPStore("127.0.0.1", port, 2, process == 0, timeout=timedelta(seconds=60))
    seen, meshes = [], []
    for number, (replicas, shard, extra, swapped) in enumerate(ROUNDS):
        rank = 1 - process if swapped else process
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"round{number}", store),
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=60),
        )
        for _ in range(extra):
            dist.new_group(backend="gloo")
        mesh = build_mesh(MeshLayout(world_size=2, shard_size=shard), torch.device("cpu"))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        before = computed[0]
        for step in range(2):
            torch.manual_seed(10 + step)
            model(torch.randn(4, 8)).sum().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        weights = {k: v.full_tensor().tolist() for k, v in model.state_dict().items()}
        live = [mesh.get_group(dim).group_name for dim in ("replicate", "shard")]
        meshes.append(mesh)
        seen.append(
            {
                "shape": [replicas, shard],
                "same_object_as": [i for i, m in enumerate(meshes[:-1]) if m is mesh],
                "computed": computed[0] - before,
                "group_names": list(mesh._dim_group_names),
                "resolved": live,
                "rank": rank,
                "coordinate": mesh.get_coordinate(),
                "local_shards": {k: v.to_local().tolist() for k, v in model.state_dict().items()},
                "weights": weights,
            }
        )
        dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
