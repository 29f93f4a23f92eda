"""A tiny DDP trainer for the two-host test: no sleeps, state saved at every scale event.

argv: RUN_DIR. Each rank trains a small linear model with DDP on rank-specific data. After
its CHECK-th step of every round each rank writes RUN_DIR/params-<round>-<rank>.json (world
size, global step, the flattened parameters), so the test can compare the replicas; rank 0
then also appends {"round", "world", "step"} to RUN_DIR/progress.jsonl. The model, optimizer
and step persist in RUN_DIR/state.pt across rounds. The job ends at the first step after
RUN_DIR/stop exists (agreed through an all-reduce).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_events import elastic_event_detected

CHECK = 5
run = Path(sys.argv[1])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
round_no = os.environ["HYPERPODRUN_ROUND"]
torch.manual_seed(0)
model = torch.nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
state_file = run / "state.pt"
step = 0
if state_file.exists():
    state = torch.load(state_file)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step = state["step"]
ddp = DistributedDataParallel(model)


def save() -> None:
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, run / "tmp.pt")
        (run / "tmp.pt").replace(state_file)
    dist.barrier()


steps_this_round = 0
while True:
    data = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(16, 8, generator=data)
    loss = (ddp(x) - x[:, :2]).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    step += 1
    steps_this_round += 1
    if steps_this_round == CHECK:
        params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
        record = {"round": int(round_no), "world": world, "rank": rank, "step": step, "params": params}
        (run / f"params-{round_no}-{rank}.tmp").write_text(json.dumps(record))
        (run / f"params-{round_no}-{rank}.tmp").replace(
            run / f"params-{round_no}-{rank}.json"
        )  # never read half-written
        if rank == 0:
            with open(run / "progress.jsonl", "a") as f:
                f.write(json.dumps({"round": int(round_no), "world": world, "step": step}) + "\n")
    stop = torch.tensor([float((run / "stop").exists())])
    dist.all_reduce(stop)
    if elastic_event_detected() or stop.item() > 0:
        save()
        break
dist.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # skip interpreter finalization: torch's gloo teardown can abort there (SIGABRT, pytorch/pytorch#179291)
