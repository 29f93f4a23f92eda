"""Sum of (rank + 1) over the world with gloo; prints it from every rank."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank={dist.get_rank()} world={dist.get_world_size()} sum={t.item():g}", flush=True)
dist.destroy_process_group()
